"""Benchmark of the attention backends against PyTorch's fused softmax (``attnkit bench``).

For each sequence length ``L`` (``B=1, H=8, D=64`` unless configured; float32 on CPU, bfloat16 on CUDA)
and each mechanism x backend, the median time of the forward pass and of forward+backward, their ratio to
``F.scaled_dot_product_attention`` softmax measured in the same process (rounds of the row and of SDPA in
turn; the ratio is the median of the per-round ratios, ``_interleaved``), and the peak memory of one
forward+backward, measured in a fresh subprocess per configuration (CPU: peak RSS above the RSS after
creating the inputs, with a fixed glibc mmap threshold so that freed blocks leave the RSS; CUDA:
``torch.cuda.max_memory_allocated``). The reference backend (materialized weights) is the in-house
baseline.

Peers, as extra rows timed the same way when installed: ``naive`` (``kernels/naive_peer.py``: DNAS in three
lines, Sinkhorn-k as alternating log-domain normalizations, the HNAS mix, all on the materialized matrix with
autograd), ``xtransformers`` (x-transformers' ``Attend(inverted_attention=True)``, which is DNAS; the
``[bench]`` extra) and, on CUDA, ``flex`` (FlexAttention, ``kernels/flex_peer.py``). A peer has rows only for
the mechanisms it implements.

``dropout`` > 0 times every call with attention dropout, SDPA's included (on the CPU its fused kernel has no
dropout and takes its materializing math path); ``padding`` > 0 pads the batch: the valid lengths fall
evenly from ``L`` to ``(1 - padding) L`` over the batch (one element: ``(1 - padding) L``), passed as
``key_mask`` and ``query_mask`` (SDPA: a boolean ``attn_mask`` over the keys). The peers take neither (their
rows say so).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from .config import MAX_SINKHORN_ITERS, Hybrid
from .registry import MECHANISMS, canonical_name, resolve_options

__all__ = [
    "BenchConfig",
    "run_bench",
    "format_table",
    "spread",
    "load_warning",
    "DEFAULT_LENGTHS",
    "QUICK_LENGTHS",
    "DEFAULT_MECHANISMS",
    "PEER_BACKENDS",
    "default_backends",
    "valid_lengths",
]

DEFAULT_LENGTHS = (256, 1024, 4096, 8192)
QUICK_LENGTHS = (256, 1024)
DEFAULT_MECHANISMS = MECHANISMS
HNAS_U = Hybrid().u0  # the mixing weight of every hnas row: attnkit's default u0, given to the peers too
BACKENDS = ("reference", "efficient")
# Peers: FlexAttention (compiled; ``flex_peer``) on CUDA, where it has a backward pass; the naive versions
# (``naive_peer``); x-transformers' DNAS option (``xtransformers_peer``).
PEER_BACKENDS = ("flex", "naive", "xtransformers")
# The mechanisms each peer implements (no row for the others); flex rows say why CoDA has none.
PEER_MECHANISMS = {"naive": ("dnas", "hnas", "sinkhorn"), "xtransformers": ("dnas",)}
# Peers that materialize the (Lq, Lk) weights: skipped above ``max_reference_length`` like the reference.
MATERIALIZING = ("reference", "naive", "xtransformers")
# Why the bench has no FlexAttention row for CoDA.
FLEX_CODA = (
    "no FlexAttention form: CoDA is not normalized and M may be negative, while FlexAttention "
    "row-normalizes exp(score); it would take two calls (log of the positive and negative parts of M, "
    "rescaled by their log-sum-exps) and an L1 reduction over D inside score_mod"
)


def _canonical(name) -> Optional[str]:
    try:
        return canonical_name(name)
    except ValueError:
        return None


def _distinct(field: str, names: list, given) -> tuple:
    """``names`` as a tuple; a name given twice (under two spellings too) is refused."""
    twice = sorted({given[i] for i, name in enumerate(names) if names.index(name) != i})
    if twice:
        raise ValueError(f"{field} names {twice} more than once (given {list(given)}); name each once")
    return tuple(names)


@dataclass
class BenchConfig:
    lengths: Sequence[int] = DEFAULT_LENGTHS
    mechanisms: Sequence[str] = DEFAULT_MECHANISMS
    backends: Sequence[str] = BACKENDS
    repeats: int = 3
    sinkhorn_iters: int = 3
    memory: bool = True
    max_reference_length: int = 2048
    device: str = "cpu"
    time_limit_s: float = 120.0  # per timed configuration: fewer repeats when one run is this slow
    batch: int = 1  # B, H, D of q, k, v (B, H, L, D)
    heads: int = 8
    head_dim: int = 64
    threads: Optional[int] = None  # torch's intra-op threads during the run (None: as set)
    dropout: float = 0.0  # attention dropout of every call, SDPA's included
    padding: float = 0.0  # the valid lengths fall evenly from L to (1 - padding) L over the batch

    def __post_init__(self) -> None:
        for name in ("lengths", "mechanisms", "backends"):
            if not list(getattr(self, name)):
                raise ValueError(f"{name} is empty; name at least one (or leave it out for the default)")
        bad = [L for L in self.lengths if isinstance(L, bool) or not isinstance(L, int) or L < 1]
        if bad:
            raise ValueError(f"lengths must be positive integers, got {bad}")
        unknown = sorted(name for name in self.mechanisms if _canonical(name) not in DEFAULT_MECHANISMS)
        if unknown:
            raise ValueError(f"unknown mechanism(s) {unknown}; expected some of {DEFAULT_MECHANISMS}")
        # one row per mechanism, whatever the case or alias it was named by ("DNAS", "lnas")
        self.mechanisms = _distinct("mechanisms", [canonical_name(name) for name in self.mechanisms],
                                    self.mechanisms)
        self.backends = _distinct("backends", [str(name).lower() for name in self.backends], self.backends)
        unknown = sorted(set(self.backends) - set(BACKENDS) - set(PEER_BACKENDS))
        if unknown:
            raise ValueError(f"unknown backend(s) {unknown}; expected some of {BACKENDS + PEER_BACKENDS}")
        if "xtransformers" in self.backends and not _xtransformers_available():
            raise ValueError(
                "backend 'xtransformers' needs x-transformers; pip install 'attnkit[bench]' or drop it"
            )
        if "flex" in self.backends and self.device != "cuda":
            raise ValueError(
                "backend 'flex' (FlexAttention) is timed on CUDA only; pass --device cuda or drop it"
            )
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"repeats={self.repeats!r}; expected an integer >= 1")
        try:
            resolve_options("sinkhorn", sinkhorn_iters=self.sinkhorn_iters)
        except ValueError:
            raise ValueError(f"sinkhorn_iters={self.sinkhorn_iters!r}; expected an integer in [0, "
                             f"{MAX_SINKHORN_ITERS}] (0 = softmax, 1 = DNAS, 3 = the default)") from None
        m = self.max_reference_length
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"max_reference_length={m!r}; expected a positive integer (the longest L the "
                             "materializing backends run)")
        for name in ("batch", "heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}; expected a positive integer")
        t = self.threads
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= 1024):
            # 100000 threads crashed OpenMP (a segmentation fault, no message)
            raise ValueError(f"threads={t!r}; expected an integer in [1, 1024] (None: torch's own)")
        for name in ("dropout", "padding"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"{name}={value!r}; expected a number in [0, 1)")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r}; expected 'cpu' or 'cuda'")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available; use --device cpu")
        need = _input_bytes(self)
        have = _device_bytes(self.device)
        if have is not None and need > have:
            raise ValueError(
                f"B={self.batch} H={self.heads} L={max(self.lengths)} D={self.head_dim} needs "
                f"{need / 2**30:.3g} GiB for q, k, v, the output and their gradients, more than the "
                f"{have / 2**30:.3g} GiB this {self.device} has; choose smaller sizes"
            )
        plan = [(L, m, b) for L in self.lengths for m in self.mechanisms for b in self.backends]
        # the materializing backends hold several (B, H, L, L) matrices at once (weights, scores, their
        # gradients): a length they run that cannot fit ended in an allocator traceback, losing every row
        size = 2 if self.device == "cuda" else 4
        materialized = [L for L, m, b in plan if b in MATERIALIZING and _timed(L, m, b, self)]
        if materialized and have is not None:
            L = max(materialized)
            need = 5 * self.batch * self.heads * L * L * size
            if need > have:
                names = ", ".join(b for b in self.backends if b in MATERIALIZING)
                raise ValueError(
                    f"the materializing backends ({names}) at L={L} hold about {need / 2**30:.3g} GiB of "
                    f"(B, H, L, L) matrices, more than the {have / 2**30:.3g} GiB this {self.device} has; "
                    f"lower --max-reference-length below {L} or drop them"
                )
        if not any(_timed(L, m, b, self) for L, m, b in plan):
            raise ValueError(
                f"mechanisms {list(self.mechanisms)} x backends {list(self.backends)} x lengths "
                f"{list(self.lengths)} time nothing but SDPA: {_why_nothing(self)}"
            )


def _input_bytes(cfg: "BenchConfig") -> int:
    """Bytes of q, k, v, the output and their gradients at the largest length (a lower bound of a run)."""
    size = 2 if cfg.device == "cuda" else 4  # bfloat16 / float32
    return 8 * cfg.batch * cfg.heads * max(cfg.lengths) * cfg.head_dim * size


def _device_bytes(device: str) -> Optional[int]:
    """The memory of ``device`` in bytes (physical memory for the CPU), ``None`` where it cannot be read."""
    try:
        if device == "cuda":
            return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError, RuntimeError):
        return None


def _timed(L: int, mechanism: str, backend: str, cfg: "BenchConfig") -> bool:
    """Whether the bench times ``mechanism`` on ``backend`` at length ``L`` (rather than skipping it)."""
    if mechanism not in PEER_MECHANISMS.get(backend, (mechanism,)):
        return False
    if backend == "flex" and mechanism == "coda":
        return False
    if backend in PEER_BACKENDS and _peer_unsupported(cfg):
        return False
    return not (backend in MATERIALIZING and L > cfg.max_reference_length)


def _why_nothing(cfg: "BenchConfig") -> str:
    """What to change when :func:`_timed` holds for no configuration of ``cfg``."""
    reasons = [f"{b} implements only {', '.join(PEER_MECHANISMS[b])}" for b in cfg.backends
               if b in PEER_MECHANISMS and not set(cfg.mechanisms) & set(PEER_MECHANISMS[b])]
    if "flex" in cfg.backends and set(cfg.mechanisms) == {"coda"}:
        reasons.append("flex has no CoDA form")
    if _peer_unsupported(cfg) and any(b in PEER_BACKENDS for b in cfg.backends):
        reasons.append(_peer_unsupported(cfg))
    if any(b in MATERIALIZING for b in cfg.backends) and min(cfg.lengths) > cfg.max_reference_length:
        reasons.append(f"{', '.join(b for b in cfg.backends if b in MATERIALIZING)} run only "
                       f"L <= max_reference_length={cfg.max_reference_length}")
    return "; ".join(reasons) + "; add the efficient backend or other mechanisms"


def _xtransformers_available() -> bool:
    from .kernels.xtransformers_peer import xtransformers_available

    return xtransformers_available()


def default_backends(device: str) -> tuple[str, ...]:
    """The backends ``attnkit bench`` times by default: attnkit's two, and every peer installed."""
    peers = ("flex",) if device == "cuda" else ()
    peers += ("naive",) + (("xtransformers",) if _xtransformers_available() else ())
    return BACKENDS + peers


def _dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def _inputs(L: int, device: str, shape: tuple[int, int, int] = (1, 8, 64), seed: int = 0):
    """q, k, v of ``(B, H, L, D)`` for ``shape = (B, H, D)``."""
    B, H, D = shape
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [
        torch.randn(B, H, L, D, generator=g).to(device=device, dtype=_dtype(device)).requires_grad_()
        for _ in range(3)
    ]


def valid_lengths(L: int, batch: int, padding: float) -> list[int]:
    """The valid length of each batch element: evenly from ``L`` down to ``(1 - padding) L`` (one element:
    ``(1 - padding) L``), at least 1."""
    if batch == 1:
        return [max(1, round((1 - padding) * L))]
    return [max(1, round(L - padding * L * b / (batch - 1))) for b in range(batch)]


def _mask(L: int, batch: int, padding: float, device: str) -> Optional[torch.Tensor]:
    """``(B, L)`` bool, True = real token, or None without padding."""
    if padding == 0:
        return None
    lengths = torch.tensor(valid_lengths(L, batch, padding))
    return (torch.arange(L)[None, :] < lengths[:, None]).to(device)


def _peer_unsupported(cfg: "BenchConfig") -> Optional[str]:
    """Why the peers have no row under this configuration, or None."""
    what = [f"dropout={cfg.dropout}" if cfg.dropout else "", f"padding={cfg.padding}" if cfg.padding else ""]
    what = [w for w in what if w]
    return f"the peers take no {' or '.join(what)}" if what else None


def _call(
    mechanism: str, backend: str, sinkhorn_iters: int, dropout: float = 0.0,
    mask: Optional[torch.Tensor] = None,
) -> Callable:
    """``f(q, k, v) -> out`` for one configuration; ``backend="sdpa"`` is PyTorch's fused softmax. ``mask``
    ``(B, L)``: the valid tokens (keys and queries), None for none; the peers take neither it nor dropout."""
    if backend == "sdpa":
        attn = None if mask is None else mask[:, None, None, :]  # (B, 1, 1, L)
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=attn, dropout_p=dropout)
    if backend == "flex":
        from .kernels.flex_peer import flex_call

        return flex_call(mechanism, sinkhorn_iters)
    if backend == "naive":
        from .kernels.naive_peer import naive_call

        return naive_call(mechanism, sinkhorn_iters, u=HNAS_U)
    if backend == "xtransformers":
        from .kernels.xtransformers_peer import xtransformers_call

        return xtransformers_call(mechanism)
    from .functional import attention

    mech = resolve_options(mechanism, sinkhorn_iters=sinkhorn_iters if mechanism == "sinkhorn" else None)
    return lambda q, k, v: attention(q, k, v, mech, key_mask=mask, query_mask=mask, dropout_p=dropout,
                                     backend=backend)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# On CUDA one call can take well under a millisecond, where the host's launch and synchronization overheads
# would dominate a round of one call: a round there is as many back-to-back calls as fill this many seconds,
# timed with CUDA events, and reports the time per call.
CUDA_ROUND_S = 0.05


def _calls_per_round(fn: Callable[[], None]) -> int:
    """How many calls of ``fn`` fill ``CUDA_ROUND_S`` on the current CUDA device (at least 1), from the
    time of three calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(3):
        fn()
    end.record()
    torch.cuda.synchronize()
    one = max(start.elapsed_time(end) / 1e3 / 3, 1e-6)
    return max(1, min(1000, int(CUDA_ROUND_S / one)))


def _cuda_round_times(fn: Callable[[], None], repeats: int, limit: float) -> list[float]:
    """Seconds per call in each round of back-to-back calls, by CUDA events (after a warm-up call: the
    first forward+backward compiles the backward's kernels)."""
    fn()
    n = _calls_per_round(fn)
    times = []
    for _ in range(repeats):
        times.append(_one_round(fn, n, "cuda"))
        if sum(times) * n > limit:
            break
    return times


def _round_times(fn: Callable[[], None], repeats: int, device: str, limit: float) -> list[float]:
    """Seconds of each timed round (fewer than ``repeats`` once their sum passes ``limit``); on CUDA the
    seconds per call of rounds of back-to-back calls (``_cuda_round_times``)."""
    if device == "cuda":
        return _cuda_round_times(fn, repeats, limit)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
        if sum(times) > limit:
            break
    return times


def spread(times: Sequence[float]) -> dict:
    """``{"min", "median", "max"}`` of the rounds: the median is the headline, min..max how much it moved."""
    return {"min": min(times), "median": statistics.median(times), "max": max(times), "rounds": len(times)}


def load_warning(load: Optional[float] = None, cores: Optional[int] = None) -> Optional[str]:
    """A sentence when the 1-minute load average exceeds the cores (timings are then inflated), else None."""
    load = os.getloadavg()[0] if load is None else load
    cores = (os.cpu_count() or 1) if cores is None else cores
    if load <= cores:
        return None
    return (
        f"warning: load average {load:.1f} > {cores} cores: other processes share the CPU, "
        "so times are inflated and ratios move between runs; compare rows of one run "
        "and rerun on an idle machine for absolute numbers"
    )


def _time_config(f: Callable, q, k, v, cfg: BenchConfig) -> tuple[float, float]:
    """Median seconds of forward and of forward+backward (``_spread_config`` keeps every round)."""
    fwd, fb = _spread_config(f, q, k, v, cfg)
    return fwd["median"], fb["median"]


def _spread_config(f: Callable, q, k, v, cfg: BenchConfig) -> tuple[dict, dict]:
    def fwd() -> None:
        with torch.no_grad():
            f(q, k, v)

    def fwd_bwd() -> None:
        q.grad = k.grad = v.grad = None
        f(q, k, v).float().sum().backward()

    fwd()  # warm-up, of the backward too (its first call builds its kernels)
    fwd_bwd()
    t_fwd = spread(_round_times(fwd, cfg.repeats, cfg.device, cfg.time_limit_s))
    t_fb = spread(_round_times(fwd_bwd, cfg.repeats, cfg.device, cfg.time_limit_s))
    return t_fwd, t_fb


def _interleaved(f: Callable, base: Callable, q, k, v, cfg: BenchConfig) -> dict:
    """Rounds of ``f`` and of the baseline ``base`` (SDPA) in turn, the order flipped every round so that a
    change of the machine's speed falls on both alike; forward rounds first, then forward+backward, each
    after a warm-up call of both (the first backward builds its kernels). On CUDA a round is as many
    back-to-back calls as fill ``CUDA_ROUND_S`` (the count fixed per function after its warm-up).

    Returns ``{"fwd": (f spread, base spread, ratio spread), "fwd_bwd": (...)}``; a ratio is one round of
    ``f`` over the ``base`` round next to it, and the row's ratio is their median."""

    def forward(g: Callable) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                g(q, k, v)
        return run

    def forward_backward(g: Callable) -> Callable[[], None]:
        def run() -> None:
            q.grad = k.grad = v.grad = None
            g(q, k, v).float().sum().backward()
        return run

    out = {}
    for mode, make in (("fwd", forward), ("fwd_bwd", forward_backward)):
        pair = (make(f), make(base))
        for fn in pair:
            fn()  # warm-up
        counts = [_calls_per_round(fn) if cfg.device == "cuda" else 1 for fn in pair]
        times: tuple[list, list] = ([], [])
        for r in range(cfg.repeats):
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                times[i].append(_one_round(pair[i], counts[i], cfg.device))
            if sum(times[0]) * counts[0] + sum(times[1]) * counts[1] > cfg.time_limit_s:
                break
        ratios = [a / b for a, b in zip(*times)]
        # every round kept (in round order), so that the JSON's ratios can be recomputed from its times
        out[mode] = ({**spread(times[0]), "times_s": times[0]}, {**spread(times[1]), "times_s": times[1]},
                     {**spread(ratios), "per_round": ratios})
    return out


def _one_round(fn: Callable[[], None], n: int, device: str) -> float:
    """Seconds per call of one round of ``n`` back-to-back calls (CUDA events on CUDA)."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / n
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def _rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure_peak(mechanism: str, backend: str, L: int, device: str, sinkhorn_iters: int,
                 shape: tuple[int, int, int] = (1, 8, 64), threads: Optional[int] = None,
                 dropout: float = 0.0, padding: float = 0.0) -> dict:
    """Peak memory of one forward+backward in this process (call it in a fresh process)."""
    import attnkit  # noqa: F401  (imported before the baseline for every backend alike)

    if threads is not None:
        torch.set_num_threads(threads)
    q, k, v = _inputs(L, device, shape)
    mask = _mask(L, shape[0], padding, device)
    f = _call(mechanism, backend, sinkhorn_iters, dropout, mask)
    # the warm-up: the first n <= 8 positions, by the same route as the measured call: its mask pads (its
    # last column False; all True would count as no mask) where the measured one does
    n = min(L, 8)
    small_mask = None if mask is None else mask[:, :n].clone()  # (B, n); column 0 is True (lengths >= 1)
    if small_mask is not None and not bool(mask.all()):
        small_mask[:, -1] = False
    small = _call(mechanism, backend, sinkhorn_iters, dropout, small_mask)
    small(
        q[..., :n, :], k[..., :n, :], v[..., :n, :]  # (B, H, n, D)
    ).float().sum().backward()  # load kernels (CUDA: cuBLAS workspaces, Triton compiles) before the baseline
    q.grad = k.grad = v.grad = None
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        f(q, k, v).float().sum().backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        return {"peak_mb": peak / 2**20, "peak_extra_mb": (peak - base) / 2**20}
    reset = _reset_peak_rss()
    base = _rss_mb()
    f(q, k, v).float().sum().backward()
    peak = _peak_rss_mb() if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_mb": peak, "peak_extra_mb": max(0.0, peak - base)}


def _reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark of this process (Linux ``clear_refs`` 5); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


_MMAP_THRESHOLD = 128 * 1024


_PARENT_ENV = "ATTNKIT_BENCH_PARENT"  # the pid of the process that started a memory subprocess


def _die_with_parent() -> None:
    """In a memory subprocess: end when the process that started it ends (SIGTERM, SIGKILL), rather than run
    on with PID 1 as its parent. On Linux the kernel kills it (``prctl(PR_SET_PDEATHSIG, SIGKILL)``);
    elsewhere a daemon thread checks the parent's pid twice a second."""
    parent = os.environ.get(_PARENT_ENV, "")
    if not parent.isdigit():
        return
    armed = False
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        try:
            armed = ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL)) == 0  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != int(parent):  # the parent ended before this process could watch it
        os._exit(1)
    if not armed:
        import threading

        def watch() -> None:
            while os.getppid() == int(parent):
                time.sleep(0.5)
            os._exit(1)

        threading.Thread(target=watch, daemon=True).start()


# ``python -m attnkit.benchmark`` for the memory subprocess, which first asks Linux to kill it when its parent
# ends: armed here, before torch is imported (seconds), and again with a check in ``_die_with_parent``
_CHILD_START = (
    "import ctypes, runpy, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    try:\n"
    "        ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL\n"
    "    except (OSError, AttributeError):\n"
    "        pass\n"
    "runpy.run_module('attnkit.benchmark', run_name='__main__', alter_sys=True)\n"
)


def _peak_in_subprocess(mechanism: str, backend: str, L: int, cfg: BenchConfig) -> dict:
    cmd = [
        # -P: the current folder is not put first on the import path (with -c it would be, and a random.py
        # or json.py there replaced the module torch imports in the child)
        sys.executable, "-P", "-c", _CHILD_START, "--peak",
        mechanism, backend, str(L), cfg.device, str(cfg.sinkhorn_iters),
        str(cfg.batch), str(cfg.heads), str(cfg.head_dim), str(cfg.threads or torch.get_num_threads()),
        repr(float(cfg.dropout)), repr(float(cfg.padding)),
    ]
    # A fixed mmap threshold: blocks of 128 KiB and more are mapped and returned to the system when
    # freed. With glibc's default (a threshold that rises after each free), freed blocks stay in the
    # heap and fragment it, and the RSS of a kernel that allocates many block-sized temporaries grows
    # far above the memory it ever holds at once (CoDA at L=4096: 2.2 GiB RSS, 0.17 GiB live).
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(_MMAP_THRESHOLD), **{_PARENT_ENV: str(os.getpid())})
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        status = (f"killed by signal {-proc.returncode}" if proc.returncode < 0
                  else f"exit code {proc.returncode}")
        last = (proc.stderr.strip().splitlines() or [""])[-1].strip()
        return {"peak_mb": None, "peak_extra_mb": None,
                "error": f"the memory subprocess failed ({status})" + (f": {last}" if last else "")}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_bench(cfg: BenchConfig, log: Optional[Callable[[str], None]] = None) -> dict:
    """Run the benchmark; returns ``{"meta": ..., "rows": [...]}`` (one row per length x mechanism x
    backend)."""
    log = log or (lambda msg: None)
    threads_before = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        return _run_bench(cfg, log)
    finally:
        torch.set_num_threads(threads_before)


def _run_bench(cfg: BenchConfig, log: Callable[[str], None]) -> dict:
    load_before = os.getloadavg()
    warning = load_warning(load_before[0])
    if warning:
        log(warning)
    rows = []
    for L in cfg.lengths:
        q, k, v = _inputs(L, cfg.device, (cfg.batch, cfg.heads, cfg.head_dim))
        mask = _mask(L, cfg.batch, cfg.padding, cfg.device)
        sdpa = _call("softmax", "sdpa", cfg.sinkhorn_iters, cfg.dropout, mask)
        sdpa_fwd, sdpa_fb = _spread_config(sdpa, q, k, v, cfg)
        sdpa_mem = _peak_in_subprocess("softmax", "sdpa", L, cfg) if cfg.memory else {}
        ones = {"fwd": sdpa_fwd, "fwd_bwd": sdpa_fb}
        ones = {m: (sp, sp, {"min": 1.0, "median": 1.0, "max": 1.0, "rounds": sp["rounds"]})
                for m, sp in ones.items()}
        rows.append(_row(L, "softmax", "sdpa", ones, sdpa_mem))
        log(f"L={L} sdpa fwd {sdpa_fwd['median']:.4f}s fwd+bwd {sdpa_fb['median']:.4f}s"
            + (f"; no memory figure: {sdpa_mem['error']}" if sdpa_mem.get("error") else ""))
        for mechanism in cfg.mechanisms:
            for backend in cfg.backends:
                if mechanism not in PEER_MECHANISMS.get(backend, (mechanism,)):
                    continue  # this peer does not implement the mechanism
                if backend == "flex" and mechanism == "coda":
                    rows.append(_skipped(L, mechanism, backend, FLEX_CODA))
                    continue
                if backend in PEER_BACKENDS and _peer_unsupported(cfg):
                    rows.append(_skipped(L, mechanism, backend, _peer_unsupported(cfg)))
                    continue
                if backend in MATERIALIZING and L > cfg.max_reference_length:
                    rows.append(
                        _skipped(
                            L, mechanism, backend, f"L > max_reference_length={cfg.max_reference_length}"
                        )
                    )
                    continue
                try:
                    route = _route(mechanism, backend, q, k, v, cfg, mask)
                except ValueError as err:  # e.g. dropout on a route that cannot replay it
                    rows.append(_skipped(L, mechanism, backend, str(err)))
                    continue
                f = _call(mechanism, backend, cfg.sinkhorn_iters, cfg.dropout, mask)
                try:
                    timed = _interleaved(f, sdpa, q, k, v, cfg)
                except Exception as err:  # a peer that breaks (a compiler error, say) costs its row only
                    if backend not in PEER_BACKENDS:
                        raise
                    first = (str(err).strip().splitlines() or [""])[0][:160]
                    reason = f"failed: {type(err).__name__}" + (f": {first}" if first else "")
                    rows.append(_skipped(L, mechanism, backend, reason))
                    log(f"L={L} {mechanism}/{backend}: {reason}")
                    continue
                mem = _peak_in_subprocess(mechanism, backend, L, cfg) if cfg.memory else {}
                row = _row(L, mechanism, backend, timed, mem)
                row["route"] = route
                rows.append(row)
                log(
                    f"L={L} {mechanism}/{backend}: fwd x{row['fwd_ratio']:.2f} fwd+bwd "
                    f"x{row['fwd_bwd_ratio']:.2f}"
                    + (
                        f" peak {row['peak_extra_mb']:.0f} MiB"
                        if row.get("peak_extra_mb") is not None
                        else ""
                    )
                    + (f"; no memory figure: {row['memory_error']}" if row.get("memory_error") else "")
                )
    meta = {
        "B": cfg.batch, "H": cfg.heads, "D": cfg.head_dim,
        "dtype": str(_dtype(cfg.device)).replace("torch.", ""),
        "device": cfg.device, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "repeats": cfg.repeats, "sinkhorn_iters": cfg.sinkhorn_iters, "cores": os.cpu_count(),
        "hnas_u": HNAS_U,
        "dropout": cfg.dropout, "padding": cfg.padding, "score_cache_mb": _score_cache_mb(),
        "valid_lengths": (
            {L: valid_lengths(L, cfg.batch, cfg.padding) for L in cfg.lengths} if cfg.padding else None
        ),
        "load_average_before": list(load_before), "load_average_after": list(os.getloadavg()),
        "load_warning": load_warning(max(load_before[0], os.getloadavg()[0])),
        "memory": None if not cfg.memory
        else "peak RSS above the inputs, fresh process per row, "
        f"MALLOC_MMAP_THRESHOLD_={_MMAP_THRESHOLD}"
        if cfg.device == "cpu"
        else "torch.cuda.max_memory_allocated above the inputs",
        "lengths": list(cfg.lengths), "mechanisms": list(cfg.mechanisms), "backends": list(cfg.backends),
        "max_reference_length": cfg.max_reference_length, "time_limit_s": cfg.time_limit_s,
    }
    return {"meta": meta, "rows": rows}


def _score_cache_mb() -> Optional[float]:
    """The C++ kernels' budget of kept Sinkhorn scores in MiB (``ATTNKIT_SCORE_CACHE_MB``), or None when the
    variable is unreadable (the rows then carry its error)."""
    from .kernels.cpp_potentials import score_cache_bytes

    try:
        return score_cache_bytes() / 2**20
    except ValueError:
        return None


def _route(mechanism: str, backend: str, q, k, v, cfg: BenchConfig, mask: Optional[torch.Tensor]) -> str:
    """The route ``ak.attention`` takes for this configuration (``attnkit.kernels.plan``); a peer's name.
    A ``ValueError`` when the backend cannot run it (``backend="efficient"`` with dropout its route cannot
    replay)."""
    if backend in PEER_BACKENDS:
        return backend
    from .functional import explain_dispatch

    iters = cfg.sinkhorn_iters if mechanism == "sinkhorn" else None
    mech = resolve_options(mechanism, sinkhorn_iters=iters)
    return explain_dispatch(
        q, k, v, mech, key_mask=mask, query_mask=mask, dropout_p=cfg.dropout, backend=backend
    ).route


def _row(L, mechanism, backend, timed: dict, mem) -> dict:
    """One row from ``_interleaved``'s rounds (SDPA's own row: SDPA against itself, ratios 1)."""
    (fwd, sdpa_fwd, fwd_ratio), (fb, sdpa_fb, fb_ratio) = timed["fwd"], timed["fwd_bwd"]
    row = {
        "L": L, "mechanism": mechanism, "backend": backend,
        "fwd_s": fwd["median"], "fwd_bwd_s": fb["median"],
        # the median over rounds of (this round / the SDPA round next to it)
        "fwd_ratio": fwd_ratio["median"], "fwd_bwd_ratio": fb_ratio["median"],
        "sdpa_fwd_s": sdpa_fwd["median"], "sdpa_fwd_bwd_s": sdpa_fb["median"],
        "fwd_spread_s": fwd, "fwd_bwd_spread_s": fb,
        "sdpa_fwd_spread_s": sdpa_fwd, "sdpa_fwd_bwd_spread_s": sdpa_fb,
        "fwd_ratio_spread": fwd_ratio, "fwd_bwd_ratio_spread": fb_ratio,
        "peak_mb": mem.get("peak_mb"), "peak_extra_mb": mem.get("peak_extra_mb"),
    }
    if "error" in mem:
        row["memory_error"] = mem["error"]
    return row


def _skipped(L, mechanism, backend, reason) -> dict:
    return {
        "L": L, "mechanism": mechanism, "backend": backend, "fwd_s": None, "fwd_bwd_s": None,
        "fwd_ratio": None, "fwd_bwd_ratio": None, "peak_mb": None, "peak_extra_mb": None, "skipped": reason,
    }


def format_table(result: dict) -> str:
    """A plain-text table of the rows: times, ratios to SDPA softmax and peak memory (MiB)."""
    head = (
        f"{'L':>6} {'mechanism':<9} {'backend':<13} {'route':<14} {'fwd s':>9} {'x sdpa':>7} "
        f"{'f+b s':>9} {'x sdpa':>7} {'f+b min / max s':>19} {'peak MiB':>9}"
    )
    lines = [head, "-" * len(head)]
    def fmt(x, spec: str) -> str:
        width = int(spec.split(".")[0])
        return f"{'-':>{width}}" if x is None else format(x, spec)

    skipped: dict[str, int] = {}  # footnotes: why a row was skipped or its memory is missing
    for r in result["rows"]:
        fb = r.get("fwd_bwd_spread_s")
        minmax = "-" if fb is None else f"{fb['min']:.4f} / {fb['max']:.4f}"
        route = r.get("route", "sdpa")
        if r.get("skipped"):
            number = skipped.setdefault(r["skipped"], len(skipped) + 1)
            route = f"skipped ({number})"
        peak = fmt(r["peak_extra_mb"], "9.0f")
        if r.get("memory_error"):
            peak = f"({skipped.setdefault(r['memory_error'], len(skipped) + 1)})".rjust(9)
        lines.append(
            f"{r['L']:>6} {r['mechanism']:<9} {r['backend']:<13} {route:<14} "
            f"{fmt(r['fwd_s'], '9.4f')} "
            f"{fmt(r['fwd_ratio'], '7.2f')} {fmt(r['fwd_bwd_s'], '9.4f')} {fmt(r['fwd_bwd_ratio'], '7.2f')} "
            f"{minmax:>19} {peak}"
        )
    lines += [f"({number}) {reason}" for reason, number in skipped.items()]
    meta = result.get("meta", {})
    shape = f"B={meta.get('B', '?')} H={meta.get('H', '?')} D={meta.get('D', '?')} {meta.get('dtype', '')}"
    if meta.get("dropout"):
        shape += f", dropout {meta['dropout']}"
    if meta.get("padding") and meta.get("B") == 1:
        shape += f", padded (the one sequence {1 - meta['padding']:.2g} L long, SDPA computing all of L)"
    elif meta.get("padding"):
        shape += f", padded (valid lengths from L to {1 - meta['padding']:.2g} L)"
    if meta.get("score_cache_mb") not in (None, 64):
        shape += f", Sinkhorn score cache {meta['score_cache_mb']:g} MiB"
    timed = {r["mechanism"] for r in result["rows"]}
    if "sinkhorn" in timed and meta.get("sinkhorn_iters") is not None:
        shape += f", sinkhorn k={meta['sinkhorn_iters']}"
    if "hnas" in timed and meta.get("hnas_u") is not None:
        shape += f", hnas u={meta['hnas_u']:g}"
    threads = meta.get('threads', '?')
    lines.append(f"{shape}, {threads} thread{'' if threads == 1 else 's'}; "
                 f"times: median of {meta.get('repeats', '?')} rounds, fewer where a configuration passed "
                 "the time limit (min / max beside it); each row's x sdpa is the median of its rounds' "
                 "ratios to SDPA rounds run in turn with them, not to the SDPA row's time; load average "
                 f"{', '.join(f'{x:.2f}' for x in meta.get('load_average_before', []))} before, "
                 f"{', '.join(f'{x:.2f}' for x in meta.get('load_average_after', []))} after, "
                 f"on {meta.get('cores', '?')} cores")
    if meta.get("load_warning"):
        lines.append(meta["load_warning"])
    return "\n".join(lines)


def write_json(result: dict, path: Path, overwrite: bool = False) -> None:
    """Write the results whole (``attnkit._files.write_text_file``); an existing file only with
    ``overwrite``."""
    from ._files import write_text_file

    write_text_file(path, json.dumps(result, indent=2) + "\n", overwrite=overwrite)


if __name__ == "__main__":
    if len(sys.argv) == 13 and sys.argv[1] == "--peak":
        _die_with_parent()
        mech, backend, length, device, iters, batch, heads, head_dim, threads, dropout, padding = sys.argv[2:]
        shape = (int(batch), int(heads), int(head_dim))
        peak = measure_peak(mech, backend, int(length), device, int(iters), shape, int(threads),
                            float(dropout), float(padding))
        print(json.dumps(peak))
    else:
        print(
            "usage: python -m attnkit.benchmark --peak MECHANISM BACKEND L DEVICE SINKHORN_ITERS "
            "B H D THREADS DROPOUT PADDING",
            file=sys.stderr,
        )
        sys.exit(2)
