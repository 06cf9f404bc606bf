"""The Triton kernels for DNAS, HNAS and Sinkhorn (kernels/triton_potentials.py) in Triton's interpreter
against the float64 reference: outputs, gradients, padding masks, empty rows, odd sizes, low precision,
the inference path and the CUDA route of the efficient backend."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU

import pytest
import torch

import attnkit as ak

triton = pytest.importorskip("triton")

from attnkit.kernels import dispatch  # noqa: E402
from attnkit.kernels import _triton_kernels, triton_potentials  # noqa: E402
from attnkit.kernels.triton_potentials import triton_attention  # noqa: E402

pytestmark = pytest.mark.skipif(
    not _triton_kernels.INTERPRETED, reason="triton was imported before TRITON_INTERPRET=1 was set"
)

MECHANISMS = {
    "dnas": ("dnas", 1, {}), "hnas": ("hnas", 1, {}), "sinkhorn1": ("sinkhorn", 1, {"sinkhorn_iters": 1}),
    "sinkhorn2": ("sinkhorn", 2, {"sinkhorn_iters": 2}), "sinkhorn3": ("sinkhorn", 3, {"sinkhorn_iters": 3}),
}


def _inputs(B, H, Lq, Lk, D, Dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, Dv))
    return [torch.randn(s, generator=g, dtype=torch.float64).requires_grad_() for s in shapes]


def _masks(B, Lq, Lk, which, seed=1):
    g = torch.Generator().manual_seed(seed)
    km = torch.rand(B, Lk, generator=g) > 0.3
    qm = torch.rand(B, Lq, generator=g) > 0.3
    km[0], qm[0] = True, True
    km[-1, : Lk // 2] = False  # left padding on the last element
    return (km if which in ("keys", "both") else None), (qm if which in ("queries", "both") else None)


def _run(name, q, k, v, km, qm, *, dtype=torch.float32, block=None):
    """``(out, ref, grads, ref_grads)`` of the Triton kernel (inputs cast to ``dtype``) and the reference."""
    mech, iters, kw = MECHANISMS[name]
    H, D = q.shape[1], q.shape[3]
    u = torch.linspace(0.2, 0.8, H, dtype=torch.float64, requires_grad=True) if name == "hnas" else None
    if u is not None:
        kw = {"hybrid_weight": u}
    ref = ak.attention(q, k, v, mech, key_mask=km, query_mask=qm, backend="reference", **kw)
    out = triton_attention(q.to(dtype), k.to(dtype), v.to(dtype), key_mask=km, query_mask=qm, scale=D**-0.5,
                           iters=iters, u=None if u is None else u.view(1, H, 1, 1), block=block)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    wrt = (q, k, v) if u is None else (q, k, v, u)
    grads = torch.autograd.grad(out, wrt, g.to(out.dtype))
    ref_grads = torch.autograd.grad(ref, wrt, g)
    return out, ref, grads, ref_grads


def _close(out, ref, grads, ref_grads, atol, rtol=1e-4):
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)
    for n, a, b in zip("qkvu", grads, ref_grads):
        torch.testing.assert_close(a.double(), b, atol=atol, rtol=rtol, msg=lambda m, n=n: f"d{n}: {m}")


@pytest.mark.parametrize("name", list(MECHANISMS))
def test_matches_reference_with_padding_on_both_sides(name):
    q, k, v = _inputs(2, 2, 19, 23, 8, 5)  # two 16-wide tiles each way, the last one partial
    km, qm = _masks(2, 19, 23, "both")
    _close(*_run(name, q, k, v, km, qm), atol=2e-5)


@pytest.mark.parametrize("which", ["none", "keys", "queries"])
@pytest.mark.parametrize("name", ["dnas", "sinkhorn3"])
def test_matches_reference_for_each_mask(name, which):
    q, k, v = _inputs(2, 1, 17, 9, 6, 3, seed=3)  # D, Dv not powers of two
    km, qm = _masks(2, 17, 9, which)
    _close(*_run(name, q, k, v, km, qm), atol=2e-5)


@pytest.mark.parametrize("name", ["hnas", "sinkhorn2"])
def test_single_query_and_single_tile(name):
    q, k, v = _inputs(1, 3, 1, 5, 4, 7, seed=2)
    _close(*_run(name, q, k, v, None, None, block=32), atol=2e-5)


# The compiled path takes a tile per kernel (triton_potentials._TILES): the column and row passes of one call
# cut the keys and queries differently, and BLOCK_M != BLOCK_N. The interpreter runs the same tiles here.
@pytest.mark.parametrize("table", list(triton_potentials._TILES))
@pytest.mark.parametrize("name", ["dnas", "hnas", "sinkhorn3"])
def test_compiled_tiles_per_kernel_match_reference(name, table, monkeypatch):
    tiles = triton_potentials._TILES[table]
    monkeypatch.setattr(triton_potentials, "_tiles", lambda block, width, dtype: tiles)
    q, k, v = _inputs(2, 1, 70, 150, 8, 5, seed=5)  # partial tiles of every size in the table
    km, qm = _masks(2, 70, 150, "both")
    _close(*_run(name, q, k, v, km, qm), atol=2e-5)


@pytest.mark.parametrize("name", ["dnas", "hnas", "sinkhorn3"])
@pytest.mark.parametrize("Lq, Lk", [(32, 48), (32, 40), (24, 48)])
@pytest.mark.parametrize("D, Dv", [(8, 6), (16, 16)])
def test_whole_tiles_without_masks_skip_the_pair_mask_and_match_reference(name, Lq, Lk, D, Dv, monkeypatch):
    """Without padding masks and with the streamed axis a whole number of tiles, the kernels take no
    select per score (``MASK_PAIRS`` off) and load the streamed tiles without a row mask (``EVEN_S``), and
    with no padded head columns (D = Dv = the padded width) without a column mask either (``EVEN_D``); a
    partial tile on either axis turns both on for the passes that stream that axis. Outputs and gradients
    match the reference either way."""
    launched = []

    class Recorder:  # stands in for a kernel: records whether the launch masks the pairs, then launches
        def __init__(self, kernel, jitted):
            self.kernel, self.jitted = kernel, jitted

        def __getitem__(self, grid):
            def launch(*args, **consts):
                launched.append((self.kernel, consts["MASK_PAIRS"]))
                assert consts["EVEN_S"] == ((Lq if self.kernel.startswith("col") else Lk) % 16 == 0)
                assert consts["EVEN_D"] == (D == Dv == 16)
                return self.jitted[grid](*args, **consts)
            return launch

    monkeypatch.setattr(_triton_kernels, "KERNELS",
                        {n: Recorder(n, kern) for n, kern in _triton_kernels.KERNELS.items()})
    q, k, v = _inputs(2, 2, Lq, Lk, D, Dv, seed=9)
    _close(*_run(name, q, k, v, None, None, block=16), atol=2e-5)
    expected = {"col": Lq % 16 != 0, "row": Lk % 16 != 0}  # the axis each pass streams
    assert {kernel for kernel, _ in launched} == set(triton_potentials.KERNEL_NAMES)
    assert all(masked == expected[kernel[:3]] for kernel, masked in launched), launched
    launched.clear()
    km, qm = _masks(2, Lq, Lk, "both")
    _close(*_run(name, q, k, v, km, qm, block=16), atol=2e-5)
    assert launched and all(masked for _, masked in launched)  # padding masks: every pass masks


def test_hnas_last_round_takes_its_own_tile_and_the_other_launches_the_plain_ones(monkeypatch):
    """A table entry ``<kernel>_hybrid`` is the tile of the variant that also carries the softmax half
    (HNAS's last round); every other launch, DNAS's and Sinkhorn's included, keeps ``<kernel>``'s."""
    plain = {"col_fwd": (16, 32, 4, 2), "row_fwd": (32, 16, 4, 2), "col_bwd": (16, 16, 4, 2),
             "row_bwd": (32, 32, 4, 2)}
    tiles = dict(plain, row_fwd_hybrid=(16, 64, 4, 2), col_bwd_hybrid=(64, 16, 4, 2),
                 row_bwd_hybrid=(16, 16, 4, 3))
    monkeypatch.setattr(triton_potentials, "_tiles", lambda block, width, dtype: tiles)
    launched = []

    class Recorder:  # stands in for a kernel: records the tile of each launch, then launches
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **consts):
                tile = tuple(consts[c] for c in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"))
                launched.append((self.name, bool(consts.get("HYBRID")), tile))
                return self.kernel[grid](*args, **consts)
            return launch

    monkeypatch.setattr(_triton_kernels, "KERNELS",
                        {n: Recorder(n, kern) for n, kern in _triton_kernels.KERNELS.items()})
    for name in ("hnas", "dnas", "sinkhorn2"):
        launched.clear()
        q, k, v = _inputs(1, 2, 40, 50, 8, 8, seed=3)
        _close(*_run(name, q, k, v, None, None), atol=2e-5)
        hybrid = {kernel for kernel, is_hybrid, _ in launched if is_hybrid}
        assert hybrid == ({"row_fwd", "col_bwd", "row_bwd"} if name == "hnas" else set())
        assert {kernel for kernel, _, _ in launched} == set(plain)
        for kernel, is_hybrid, tile in launched:
            assert tile == tiles[kernel + "_hybrid" if is_hybrid else kernel], (name, kernel)


@pytest.mark.parametrize("name", ["dnas", "hnas", "sinkhorn3"])
def test_empty_rows_and_columns_are_zero_with_finite_gradients(name):
    q, k, v = _inputs(3, 2, 10, 12, 4, 4, seed=5)
    km = torch.ones(3, 12, dtype=torch.bool)
    qm = torch.ones(3, 10, dtype=torch.bool)
    km[1] = False  # no valid key at all: every query of element 1 returns zeros
    qm[2, 3:] = False  # most queries padded: the remaining ones fill every column normalization
    out, ref, grads, ref_grads = _run(name, q, k, v, km, qm)
    assert torch.all(out[1] == 0) and torch.all(out[2, :, 3:] == 0)
    assert all(torch.isfinite(g).all() for g in grads)
    _close(out, ref, grads, ref_grads, atol=2e-5)


# Scores of order 100 (x12) and 600 (x25): every exp needs its running maximum, and dQ is a small difference
# of large terms, so the potentials must reach the backward as the forward computed them (converting them
# between natural and base-2 units on the way cost float32 dQ 4-20x at x25; Sinkhorn's rounds compound
# rounding of the potentials too much for x25 at this tolerance).
@pytest.mark.parametrize("name, mult", [("sinkhorn3", 12.0), ("dnas", 12.0), ("hnas", 12.0), ("dnas", 25.0),
                                        ("hnas", 25.0)])
def test_large_logits_stay_finite_and_accurate(name, mult):
    q, k, v = _inputs(1, 2, 20, 20, 8, 8, seed=4)
    with torch.no_grad():
        q.mul_(mult)
        k.mul_(mult)
    out, ref, grads, ref_grads = _run(name, q, k, v, None, None)
    assert torch.isfinite(out).all()
    _close(out, ref, grads, ref_grads, atol=5e-4, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["dnas", "hnas", "sinkhorn3"])
def test_low_precision_error_is_a_small_multiple_of_eager(name, dtype):
    """FlexAttention's rule: error against float64 at most a few times that of the eager path in ``dtype``."""
    q, k, v = _inputs(2, 2, 19, 21, 16, 16, seed=6)
    km, qm = _masks(2, 19, 21, "both")
    mech, _, kw = MECHANISMS[name]
    out, ref, grads, ref_grads = _run(name, q, k, v, km, qm, dtype=dtype)
    assert out.dtype == dtype
    ql, kl, vl = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    kw = {"hybrid_weight": torch.linspace(0.2, 0.8, 2, dtype=torch.float64)} if name == "hnas" else kw
    eager = ak.attention(ql, kl, vl, mech, key_mask=km, query_mask=qm, backend="reference", **kw)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    eager_grads = torch.autograd.grad(eager, (ql, kl, vl), g.to(dtype))
    for fast, slow, exact in zip((out, *grads[:3]), (eager, *eager_grads), (ref, *ref_grads[:3])):
        err_fast = (fast.double() - exact).abs().max().item()
        err_eager = (slow.double() - exact).abs().max().item()
        assert err_fast <= 5 * err_eager + 1e-3, (err_fast, err_eager)


@pytest.mark.parametrize("name", ["dnas", "hnas", "sinkhorn3"])
def test_inference_saves_nothing_and_matches_training_bitwise(name):
    q, k, v = _inputs(2, 2, 13, 11, 8, 8, seed=8)
    km, qm = _masks(2, 13, 11, "both")
    _, iters, _ = MECHANISMS[name]
    u = torch.tensor([0.3, 0.7]).view(1, 2, 1, 1) if name == "hnas" else None
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    train = triton_attention(qf, kf, vf, key_mask=km, query_mask=qm, scale=0.3, iters=iters, u=u)
    with torch.no_grad():
        infer = triton_attention(qf, kf, vf, key_mask=km, query_mask=qm, scale=0.3, iters=iters, u=u)
    assert train.grad_fn is not None and infer.grad_fn is None
    assert torch.equal(train, infer)


def test_efficient_backend_routes_cuda_tensors_to_triton(monkeypatch):
    """``dispatch._triton_module`` is the CUDA switch; on the CPU the interpreter stands in for the GPU."""
    calls = []

    def route(q):
        calls.append(q.shape)
        return triton_potentials

    monkeypatch.setattr(dispatch, "_triton_module", route)
    q, k, v = (t.detach().float().requires_grad_() for t in _inputs(2, 2, 9, 10, 8, 8, seed=9))
    km, qm = _masks(2, 9, 10, "both")
    out = ak.attention(q, k, v, "sinkhorn", key_mask=km, query_mask=qm, sinkhorn_iters=2, backend="auto")
    assert calls, "backend='auto' did not take the Triton route"
    ref = ak.attention(q.double(), k.double(), v.double(), "sinkhorn", key_mask=km, query_mask=qm,
                       sinkhorn_iters=2, backend="reference")
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    calls.clear()
    general = torch.ones(9, 10, dtype=torch.bool)
    general[0, 9] = False  # an all-True attn_mask counts as none
    ak.attention(q, k, v, "dnas", attn_mask=general, backend="efficient")
    assert not calls, "attn_mask calls must keep the block-wise PyTorch path"


def test_rejects_float64_and_cpu_route_is_off():
    q, k, v = (t.detach() for t in _inputs(1, 1, 4, 4, 4, 4))
    with pytest.raises(ValueError, match="float64|backend='reference'"):
        triton_attention(q, k, v, key_mask=None, query_mask=None, scale=0.5, iters=1)
    assert dispatch._triton_module(q.float()) is None  # CPU tensors never take Triton outside the tests


# The variants the launcher compiles (triton_potentials._forward / _backward: the rounds' flags) with its
# tiles (_TILES: a warp count and a pipeline depth per kernel, HNAS's last round its own where the table has
# one) and masks (their code contains the unmasked one); the sm_90 build of each must keep its tiles in
# registers (cuobjdump's STACK: 0 bytes spilled per thread). Built as a launch with lengths and head sizes
# divisible by 16 builds them: Triton specializes such integer arguments (and 16-byte aligned pointers) as
# divisible by 16, which the builds here state with the same attribute. "hybrid" compiles only the variants
# of HNAS's last round, "all" every variant without masks too (no select per score: MASK_PAIRS off). Run in
# a fresh process, where Triton compiles instead of interpreting.
_COMPILE = r"""
import importlib.util, sys
import torch
from attnkit.kernels import triton_potentials as P

dtype, width, which, sweep = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
spec = importlib.util.spec_from_file_location("triton_tiles", sweep)  # benchmarks/triton_tiles.py
tiles_mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tiles_mod)
tiles = P._tiles(None, width, {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype])
variants = tiles_mod.launcher_variants()
if which == "hybrid":
    variants = [v for v in variants if v[1].get("HYBRID")]
runs = [(v, True) for v in variants] + ([(v, False) for v in variants] if which == "all" else [])
spilled = []
for (name, flags), masks in runs:
    tile = (tiles.get(name + "_hybrid") if flags.get("HYBRID") else None) or tiles[name]
    registers, stack = tiles_mod.sm90_build(name, flags, tile, dtype, width, masks)
    if stack:
        spilled.append((name, flags, masks, stack))
assert not spilled, spilled
print("compiled", len(runs))
"""


# bfloat16 is the dtype of ``attnkit bench --device cuda``; float32 takes IEEE dots; float16 differs from
# bfloat16 in its type alone.
@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype, width, which, count",
    [("bf16", 64, "all", 32), ("bf16", 128, "every", 16), ("fp32", 64, "every", 16),
     ("fp16", 64, "hybrid", 4)],
)
def test_kernels_compile_for_a_gpu_target_without_spills(dtype, width, which, count):
    """The interpreter runs Python semantics; Triton's compiler (sm_90 cubins, no GPU needed) must accept the
    same kernels in the variants and tiles the launcher uses, for each supported dtype, without spilling."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    sweep = Path(__file__).resolve().parents[2] / "benchmarks" / "triton_tiles.py"
    proc = subprocess.run([sys.executable, "-c", _COMPILE, dtype, str(width), which, str(sweep)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0 and f"compiled {count}\n" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("D, Dv", [(40, 24), (64, 32), (24, 40), (64, 64)])
def test_launch_pads_q_and_v_to_one_width(D, Dv):
    """Compiled for an H100 in bfloat16 / float16, tiles of 64 gave wrong outputs when v's padded width was
    below q's (seen with Triton 3.6; the interpreter and float32 were right): the launcher gives both one
    width, the larger (tests/cuda checks the outputs on a GPU)."""
    q3, k3 = torch.randn(2, 5, D), torch.randn(2, 7, D)
    v3 = torch.randn(2, 7, Dv)
    launch = triton_potentials._Launch(q3, k3, v3, None, None, 1, 0.5, None)
    width = max(16, triton.next_power_of_2(max(D, Dv)))
    assert launch.consts["BLOCK_D"] == launch.dv_const == width


@pytest.mark.parametrize("name", ["dnas", "hnas", "sinkhorn3"])
@pytest.mark.parametrize("where", ["nan_q", "inf_k"])
@pytest.mark.parametrize("seed", [10, 11, 12, 13])
def test_a_nan_or_inf_in_a_valid_position_propagates_as_in_the_reference(name, where, seed):
    """A NaN column sum is not an empty column: its potential is NaN, not 0, so every row that meets it is
    NaN as in the reference (the rows were finite softmax outputs before); an inf in k gives the scores of
    its column +inf or -inf depending on the queries, and exactly the reference's rows turn NaN."""
    q, k, v = (t.detach() for t in _inputs(1, 2, 3, 4, 2, 2, seed=seed))
    if where == "nan_q":
        q[0, 0, 1, 0] = float("nan")
    else:
        k[0, 0, 2, 1] = float("inf")
    mech, iters, kw = MECHANISMS[name]
    u = torch.tensor([0.3, 0.6]).view(1, 2, 1, 1) if name == "hnas" else None
    ref = ak.attention(q, k, v, mech, backend="reference",
                       **({"hybrid_weight": u.view(2).double()} if u is not None else kw))
    out = triton_attention(q.float(), k.float(), v.float(), key_mask=None, query_mask=None, scale=2**-0.5,
                           iters=iters, u=u)
    assert torch.equal(out.isnan(), ref.isnan())
    finite = ~ref.isnan()
    torch.testing.assert_close(out.double()[finite], ref[finite], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"key_mask": torch.ones(2, 6) * 0.5}, "key_mask has shape .* dtype torch.float32; expected a bool"),
        ({"key_mask": torch.ones(2, 3, dtype=torch.bool)}, r"key_mask has shape \(2, 3\)"),
        ({"query_mask": torch.ones(3, 4, dtype=torch.bool)}, r"query_mask has shape \(3, 4\)"),
        ({"u": torch.tensor(1.5)}, r"outside \[0, 1\]"),
        ({"u": "half"}, "expected a number"),
        ({"u": torch.ones(3)}, r"u has shape \(3,\)"),
        ({"iters": 2.9}, "iters=2.9"),
        ({"block": 16.0}, "block=16.0"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    q, k, v = torch.randn(2, 1, 4, 8), torch.randn(2, 1, 6, 8), torch.randn(2, 1, 6, 8)
    call = dict(key_mask=None, query_mask=None, scale=0.3, iters=1) | kwargs
    with pytest.raises(ValueError, match=message):
        triton_attention(q, k, v, **call)


def test_mismatched_shapes_are_named():
    q, v = torch.randn(2, 1, 4, 8), torch.randn(2, 1, 5, 8)
    with pytest.raises(ValueError, match="one head size D"):
        triton_attention(q, torch.randn(2, 1, 5, 3), v, key_mask=None, query_mask=None, scale=0.3, iters=1)
    with pytest.raises(ValueError, match="batch sizes 2, 3, 2"):
        triton_attention(q, torch.randn(3, 1, 5, 8), v, key_mask=None, query_mask=None, scale=0.3, iters=1)


@pytest.mark.parametrize("u", [0.3, torch.tensor(0.3), torch.tensor([0.3, 0.7])])
def test_hybrid_weight_takes_a_number_a_scalar_or_one_per_head(u):
    q, k, v = (t.detach().float() for t in _inputs(1, 2, 5, 6, 8, 8, seed=11))
    out = triton_attention(q, k, v, key_mask=None, query_mask=None, scale=0.3, iters=1, u=u)
    hw = torch.as_tensor(u, dtype=torch.float64)
    ref = ak.attention(q.double(), k.double(), v.double(), "hnas", scale=0.3, hybrid_weight=hw,
                       backend="reference")
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)


def test_a_hybrid_weight_of_another_batch_size_is_named():
    # an expand() RuntimeError before
    q, k, v = (torch.randn(2, 2, 5, 4) for _ in range(3))
    with pytest.raises(ValueError, match=r"u has shape \(3, 2, 1, 1\); expected .*\(2\|1, 2\|1, 1, 1\)"):
        triton_attention(q, k, v, key_mask=None, query_mask=None, scale=0.5, iters=1,
                         u=torch.full((3, 2, 1, 1), 0.5))


@pytest.mark.parametrize("iters", [1, 3])
def test_a_nan_gradient_at_a_padded_query_stays_there(iters):
    # 0 * NaN in P^T dO made every gradient of the batch element NaN (the direct kernel API; ak.attention
    # stops it before)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 4, requires_grad=True) for _ in range(3))
    qm = torch.ones(2, 6, dtype=torch.bool)
    qm[0, -2:] = False
    out = triton_attention(q, k, v, key_mask=None, query_mask=qm, scale=0.5, iters=iters)
    grad = torch.randn_like(out)
    grad[0, :, -1] = float("nan")
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out, (q, k, v), grad))
