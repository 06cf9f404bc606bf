"""The route table of the attention backends and the one function that chooses a route: ``plan``.

One table ``ROUTES[name]`` (what each route computes, when it can run, how to call it) and one chooser, as
geomloss keeps one ``routines[loss][backend]`` table and decides ``"auto"`` in one block. Every mechanism's
``MechanismSpec.routes`` (``attnkit.registry``) lists the efficient routes that can run it, in order of
preference; ``plan`` takes the first whose ``supports`` accepts the call, and decides for ``backend="auto"``
whether the efficient path pays at all. ``ak.attention`` runs the plan; ``ak.explain_dispatch`` and
``attnkit info`` / ``attnkit bench`` print it.

Routes (docs/design.md section 5):

- ``reference``: the materialized ``(Lq, Lk)`` weights (``attnkit.functional``), every mechanism and mask;
- ``sdpa``: softmax through ``F.scaled_dot_product_attention`` (fused), when the masks fit its one mask;
- ``cpp_softmax``: softmax on the CPU with padding masks, through the C++ kernels, when some token is padded
  (they skip the padding that SDPA computes, and need no zeroed copies of q, k, v) or with attention dropout
  (their hashed, replayed dropout, where SDPA's fused CPU kernel has no dropout and falls back to its
  materializing math path);
- ``triton``: dnas / hnas / sinkhorn on CUDA with padding masks, the Triton kernels (``triton_potentials.py``,
  the ``[triton]`` extra);
- ``cpp``: dnas / hnas / sinkhorn on the CPU with padding masks, the C++ kernels (``cpp_potentials.py``),
  attention dropout included (a hashed keep mask that the backward pass replays);
- ``aten``: dnas / hnas with padding masks through PyTorch's fused CPU attention op where the C++ kernels
  cannot be built (``aten_fallback.py``);
- ``blockwise``: the potential loop in block sweeps with recomputation, any mask, CPU or CUDA
  (``blockwise.py``);
- ``coda_triton``: CoDA on CUDA, any mask, the fused Triton kernel (``triton_coda.py``, the ``[triton]``
  extra);
- ``coda_cpp``: CoDA on the CPU, the fused C++ kernel (``coda_cpp.py``), every mask and variant, attention
  dropout included (a hashed keep mask that the backward pass replays);
- ``coda_blockwise``: CoDA in query blocks with recomputation (``coda_blockwise.py``), any device.

A new route (e.g. a CUDA kernel) is one ``Route`` entry here plus its name in the specs of the mechanisms
it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import MechanismConfig
from ..masks import MaskInfo
from ..registry import spec_of
from ..validators import EAGER_UNDER_COMPILE, values_hidden
from .aten_fallback import fused_available, fused_dnas_attention
from .blockwise import potential_attention
from .autodiff import unsupported_autodiff
from .coda_blockwise import coda_attention
from .coda_cpp import coda_cpp_attention, coda_cpp_available
from .cpp_potentials import fused_cpu_attention, fused_cpu_available

__all__ = ["Plan", "Route", "ROUTES", "plan", "run_route", "MIN_PAIRS", "CODA_MIN_TOTAL_PAIRS"]

# backend="auto" takes the efficient path from this many (query, key) pairs on: below it the
# materialized path is as fast and the memory it saves is small.
MIN_PAIRS = 128 * 128
# CoDA through the fused C++ kernel (``coda_cpp``, the CPU) beats the materialized path at every size:
# measured (1 thread, fp32, CPU time, interleaved, with key padding; efficient / reference) fwd+bwd B=1 H=1
# L=8 D=16 0.70, B=2 H=8 L=16 D=64 0.77, L=128 D=64 0.45, B=16 H=12 L=128 D=32 0.36, L=512 0.26,
# L=1024 0.16, L=2048 0.14; with dropout 0.1 and forward-only alike. So ``"auto"`` always takes it.
# The threshold below is for ``coda_blockwise`` (CUDA tensors, or no C++ extension), whose cost is the
# L1 distance (``torch.cdist(p=1)``, no BLAS path), computed twice (forward, and again in the backward
# pass): the materialized path is faster until its memory traffic dominates. Measured (2 threads, fp32,
# B=1, H=8, D=64, forward+backward, efficient / reference): L=256 1.45, 1024 1.15, 1536 1.10, 2048 0.91,
# 4096 0.76. So ``coda_blockwise`` goes efficient from this many pairs over the whole batch (B * H * Lq * Lk),
# where the reference holds about 0.6 GiB.
CODA_MIN_TOTAL_PAIRS = 1 << 24


@dataclass(frozen=True)
class Plan:
    """The route a call takes and why (``str(plan)`` is ``"route: reason"``)."""

    route: str
    reason: str

    def __str__(self) -> str:
        return f"{self.route}: {self.reason}"


@dataclass(frozen=True)
class Call:
    """What a route needs to know about one call (inputs already validated at the public boundary)."""

    q: Tensor
    k: Tensor
    v: Tensor
    config: MechanismConfig
    mask: MaskInfo
    dropout_p: float

    @property
    def iters(self) -> Optional[int]:
        fn = spec_of(self.config).potential_iters
        return None if fn is None else fn(self.config)


@dataclass(frozen=True)
class Route:
    """One efficient route: ``supports(call)`` returns ``None`` when it can run the call, else why not;
    ``run(call, scale, u)`` returns the output ``(B, H, Lq, Dv)``; ``dropout`` whether it applies dropout;
    ``compacts(config)`` whether it gathers the valid rows itself (the C++ kernels), so that what padded
    rows hold never enters it, nor its gradients, and the caller need not zero them first."""

    name: str
    summary: str
    supports: Callable[[Call], Optional[str]]
    run: Callable[[Call, float, Optional[Tensor]], Tensor]
    dropout: bool = False
    compacts: Callable[[MechanismConfig], bool] = lambda config: False


def _sdpa_supports(call: Call) -> Optional[str]:
    """The fused kernel takes one mask: fine unless causal comes with another pair mask or a learnable
    bias."""
    if call.iters != 0:
        return "SDPA computes softmax (0 normalization rounds) only"
    mask = call.mask
    if mask.bias is not None and mask.bias.requires_grad:
        return "a learnable float attn_mask (SDPA gives it no gradient here)"
    key = _unless_all_true(mask.key)  # a collate's all-False key_padding_mask is no mask
    if mask.causal and (key is not None or mask.pair is not None or mask.bias is not None):
        return "causal together with another mask (SDPA takes one mask)"
    return None


def _unless_all_true(m: Optional[Tensor]) -> Optional[Tensor]:
    """``m``, or ``None`` for a CPU mask without a False (an all-True mask would cost SDPA its unmasked
    kernel and the output a masked copy: 17% of fwd+bwd at B=16 H=12 L=128 D=32); CUDA masks are kept
    (checking would synchronize)."""
    if m is not None and m.device.type == "cpu" and bool(m.all()):
        return None
    return m


def _without_all_true_attn_mask(mask: MaskInfo) -> MaskInfo:
    """``mask`` without its boolean ``attn_mask`` when that holds no False (all-True masks count as none), or
    under ``causal`` when it allows every pair the causal mask allows (torch's ``is_causal`` beside its own
    causal mask, as ``nn.TransformerDecoderLayer(tgt_mask=..., tgt_is_causal=True)`` passes it), so that the
    call takes the routes of an unmasked, padded or causal one: the C++, Triton and ATen kernels take padding
    masks only, SDPA ``is_causal`` alone. One read of the mask (a host sync on CUDA), for boolean masks only:
    a float mask that allows every pair has no ``pair`` already."""
    pair = mask.pair
    if pair is None or mask.bias is not None or values_hidden(pair) or pair.device.type == "meta":
        return mask
    if not bool(pair.all()):
        if not mask.causal:
            return mask
        Lq, Lk = pair.shape[-2:]
        later = torch.ones(Lq, Lk, dtype=torch.bool, device=pair.device).triu(1)  # what causal hides
        if not bool((pair | later).all()):
            return mask
    return replace(mask, attn_mask=None, pair=None, _valid=None, _valid_built=False)


def _sdpa_run(call: Call, scale: float, u: Optional[Tensor]) -> Tensor:
    mask = call.mask
    key, query = _unless_all_true(mask.key), _unless_all_true(mask.query)
    pair = _unless_all_true(mask.pair) if mask.bias is None else mask.pair
    if mask.causal and pair is not None:  # plan takes SDPA under causal with a redundant attn_mask only
        pair = _without_all_true_attn_mask(mask).pair  # SDPA refuses a mask beside is_causal
    attn: Optional[Tensor] = None
    if key is not None or pair is not None:
        attn = key if pair is None else (pair if key is None else key & pair)
    if mask.bias is not None:
        bias = mask.bias.to(call.q.dtype)
        attn = bias if attn is None else bias.masked_fill(~attn, float("-inf"))  # (B|1, H|1, Lq|1, Lk)
    out = F.scaled_dot_product_attention(
        call.q, call.k, call.v, attn_mask=attn, dropout_p=call.dropout_p, is_causal=mask.causal, scale=scale
    )  # (B, H, Lq, Dv); rows without a valid key are zeros
    if attn is None and call.dropout_p == 0:
        # PyTorch's fused CPU kernel (no mask or is_causal alone, no dropout) returns zeros for a query
        # holding a NaN, as for a row without a valid key; the math gives NaN, as do the other routes. On the
        # CPU one sum of q says whether any is NaN (a NaN makes it NaN), so that a call without one pays no
        # (B, H, Lq) mask and no copy of the output (forward 1.5x SDPA at B=16 L=128 with them)
        q = call.q
        if (q.device.type != "cpu" or values_hidden(q) or torch.compiler.is_compiling()
                or bool(torch.isnan(q.detach().sum()))):
            out = out.masked_fill(q.isnan().any(-1, keepdim=True), float("nan"))
    if query is not None:
        out = out.masked_fill(~query, 0.0)
    return out


def _cpp_unsupported(call: Call) -> Optional[str]:
    """Why the C++ potential kernels cannot take the call's masks or tensors, or ``None``."""
    if not call.mask.padding_only:
        return "the C++ kernels take padding masks only (no attn_mask, not causal)"
    if not fused_cpu_available(call.q):
        return "the C++ kernels are not available (not a CPU tensor, or the extension did not build)"
    return None


def _cpp_call(call: Call, scale: float, iters: int, u: Optional[Tensor]) -> Tensor:
    return fused_cpu_attention(
        call.q, call.k, call.v, key_mask=call.mask.key_mask, query_mask=call.mask.query_mask, scale=scale,
        iters=iters, u=u, dropout_p=call.dropout_p,
    )


def _padded(call: Call) -> bool:
    """Some key or query is padded (a CPU mask with a False entry)."""
    masks = (call.mask.key_mask, call.mask.query_mask)
    return any(m is not None and m.device.type == "cpu" and not bool(m.all()) for m in masks)


def _cpp_softmax_supports(call: Call) -> Optional[str]:
    if call.iters != 0:
        return "softmax (0 normalization rounds) only"
    if call.dropout_p <= 0 and not _padded(call):
        return "only with attention dropout or padding (else SDPA's fused kernel is as fast)"
    return _cpp_unsupported(call)


def _cpp_softmax_run(call: Call, scale: float, u: Optional[Tensor]) -> Tensor:
    return _cpp_call(call, scale, 0, None)  # 0 normalization rounds: the kernels' softmax alone


def _cpp_supports(call: Call) -> Optional[str]:
    if call.iters < 1:
        return "the C++ kernels run at least one column normalization (softmax takes cpp_softmax or SDPA)"
    return _cpp_unsupported(call)


def _cpp_run(call: Call, scale: float, u: Optional[Tensor]) -> Tensor:
    return _cpp_call(call, scale, call.iters, u)


def _triton_module(q: Tensor):
    """``triton_potentials`` when it can run ``q`` (a CUDA tensor, Triton installed), else ``None``.

    Triton is imported here, for CUDA tensors only (a CPU-only install never imports it)."""
    if not q.is_cuda:
        return None
    from . import triton_potentials

    return triton_potentials if triton_potentials.triton_available(q) else None


def _triton_supports(call: Call) -> Optional[str]:
    if call.iters < 1:
        return "the Triton kernels run at least one column normalization (softmax goes to SDPA)"
    if not call.mask.padding_only:
        return "the Triton kernels take padding masks only (no attn_mask, not causal)"
    if _triton_module(call.q) is None:
        return "the Triton kernels need a CUDA tensor (float32/bfloat16/float16) and the [triton] extra"
    return None


def _triton_run(call: Call, scale: float, u: Optional[Tensor]) -> Tensor:
    return _triton_module(call.q).triton_attention(
        call.q,
        call.k,
        call.v,
        key_mask=call.mask.key_mask,
        query_mask=call.mask.query_mask,
        scale=scale,
        iters=call.iters,
        u=u,
    )


def _aten_supports(call: Call) -> Optional[str]:
    if call.iters != 1:
        return "the ATen fallback runs one normalization round (dnas / hnas) only"
    if not call.mask.padding_only:
        return "the ATen fallback takes padding masks only (no attn_mask, not causal)"
    if not fused_available(call.q, call.v):
        return "PyTorch's fused CPU attention op does not take these inputs (not CPU, or D != Dv)"
    return None


def _aten_run(call: Call, scale: float, u: Optional[Tensor]) -> Tensor:
    return fused_dnas_attention(
        call.q, call.k, call.v, key_mask=call.mask.key_mask, query_mask=call.mask.query_mask, scale=scale, u=u
    )


def _always(call: Call) -> Optional[str]:
    return None


def _blockwise_run(call: Call, scale: float, u: Optional[Tensor]) -> Tensor:
    return potential_attention(call.q, call.k, call.v, call.mask, scale=scale, iters=call.iters, u=u)


def _triton_coda_module(q: Tensor):
    """``triton_coda`` when it can run ``q`` (a CUDA tensor, Triton installed), else ``None``."""
    if not q.is_cuda:
        return None
    from . import triton_coda

    return triton_coda if triton_coda.triton_coda_available(q) else None


def _coda_triton_supports(call: Call) -> Optional[str]:
    if _triton_coda_module(call.q) is None:
        return "the Triton CoDA kernel needs a CUDA tensor (float32/bfloat16/float16) and the [triton] extra"
    return None


def _coda_triton_run(call: Call, scale: float, u: Optional[Tensor]) -> Tensor:
    return _triton_coda_module(call.q).triton_coda_attention(
        call.q, call.k, call.v, call.mask, call.config, scale=scale
    )


def _coda_run(call: Call, scale: float, u: Optional[Tensor]) -> Tensor:
    return coda_attention(call.q, call.k, call.v, call.mask, call.config, scale=scale)


def _coda_cpp_supports(call: Call) -> Optional[str]:
    if not coda_cpp_available(call.q):
        return "the fused CoDA kernel is not available (not a CPU tensor, or the extension did not build)"
    return None


def _coda_cpp_compacts(config: MechanismConfig) -> bool:
    # The kernel compacts the padding; the centred variants' means (coda_blockwise.coda_means, in PyTorch)
    # read every row, and their gradient would carry a NaN of a padded row through a product with 0.
    return not config.uses_global_means


def _coda_cpp_run(call: Call, scale: float, u: Optional[Tensor]) -> Tensor:
    return coda_cpp_attention(
        call.q, call.k, call.v, call.mask, call.config, scale=scale, dropout_p=call.dropout_p
    )


ROUTES: dict[str, Route] = {
    route.name: route
    for route in (
        Route(
            "sdpa", "F.scaled_dot_product_attention (fused softmax)", _sdpa_supports, _sdpa_run, dropout=True
        ),
        Route(
            "cpp_softmax", "C++ kernels, softmax of the valid tokens, replayed dropout (CPU, padding masks)",
            _cpp_softmax_supports, _cpp_softmax_run, dropout=True, compacts=lambda config: True,
        ),
        Route("triton", "Triton potential kernels (CUDA, padding masks)", _triton_supports, _triton_run),
        Route(
            "cpp", "C++ potential kernels (CPU, padding masks)", _cpp_supports, _cpp_run, dropout=True,
            compacts=lambda config: True,
        ),
        Route("aten", "ATen fused CPU attention op, two passes (fallback)", _aten_supports, _aten_run),
        Route("blockwise", "block sweeps of the potential loop with recomputation", _always, _blockwise_run),
        Route(
            "coda_triton", "fused Triton CoDA kernel (CUDA, any mask)", _coda_triton_supports,
            _coda_triton_run,
        ),
        Route(
            "coda_cpp", "fused C++ CoDA kernel (CPU, every mask)", _coda_cpp_supports, _coda_cpp_run,
            dropout=True, compacts=_coda_cpp_compacts,
        ),
        Route("coda_blockwise", "CoDA in query blocks with recomputation", _always, _coda_run),
    )
}


def _efficient_route(call: Call) -> tuple[str, str]:
    """The first route of the mechanism's spec that supports the call, with the reasons the others did not."""
    skipped = []
    for name in spec_of(call.config).routes:
        why_not = ROUTES[name].supports(call)
        if why_not is None:
            reason = ROUTES[name].summary
            return name, reason + (f" ({'; '.join(skipped)})" if skipped else "")
        skipped.append(f"not {name}: {why_not}")
    raise AssertionError(f"no route for {call.config!r}; the last route of every spec supports every call")


def _dropout_error(call: Call, route: str) -> Optional[str]:
    if call.dropout_p <= 0 or ROUTES[route].dropout:
        return None
    if call.config.name != "softmax":
        return (
            f"dropout_p={call.dropout_p} is not supported by backend='efficient' for mechanism "
            f"{call.config.name!r} (its backward pass recomputes the weights and cannot replay the dropout "
            "mask); use backend='reference' (or 'auto') for attention dropout"
        )
    return (  # softmax reaches the blockwise kernel with a causal mask beside another, or a learned bias
        f"dropout_p={call.dropout_p} is not supported by backend='efficient' for softmax with these masks "
        f"(the {route} route: {ROUTES[route].summary}, without dropout); use backend='reference' (or 'auto')"
    )


def plan(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: MechanismConfig,
    mask: MaskInfo,
    *,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> Plan:
    """The route of one call (inputs validated, ``config`` resolved) for ``backend`` ``"efficient"`` or
    ``"auto"``, and why. ``"efficient"`` raises a ``ValueError`` when its route cannot apply the dropout.

    ``"auto"`` takes the efficient path when it pays and supports the call: DNAS/HNAS/Sinkhorn with padding
    masks only, on the CPU with the C++ kernels built, always (measured, fwd+bwd, B=4, H=8, D=32: 0.45-0.6x
    the reference's time at L=8..32, 0.3-0.5x at L=128). Otherwise from ``Lq * Lk >= MIN_PAIRS``; CoDA from
    ``B * H * Lq * Lk >= CODA_MIN_TOTAL_PAIRS`` in query blocks, but always with the fused kernels: the C++
    one on the CPU (measured faster than the materialized path at every size) and the Triton one on CUDA
    (like the Triton potential kernels: one launch that never materializes the weights).
    """
    why = unsupported_autodiff(q, k, v, mask.bias)  # a dual float attn_mask (a bias's tangent) too
    if why is not None:
        return Plan("reference", why)
    call = Call(q, k, v, config, _without_all_true_attn_mask(mask), dropout_p)
    route, reason = _efficient_route(call)
    if backend == "efficient":
        error = _dropout_error(call, route)
        if error is not None:
            raise ValueError(error)
        return Plan(route, reason)
    if _dropout_error(call, route) is not None:
        return Plan("reference", f"dropout_p={dropout_p} > 0 and the {route} route cannot apply dropout")
    Lq, Lk = q.shape[2], k.shape[2]
    if route == "coda_cpp":
        return Plan(route, f"the fused CoDA kernel beats the materialized path at every size; {reason}")
    if route == "coda_blockwise":
        B, H = max(q.shape[0], k.shape[0]), max(q.shape[1], k.shape[1])
        total = B * H * Lq * Lk
        if total < CODA_MIN_TOTAL_PAIRS:
            return Plan(
                "reference",
                f"B*H*Lq*Lk = {total} < {CODA_MIN_TOTAL_PAIRS}: CoDA's materialized path is faster below "
                "this size",
            )
        return Plan(route, f"B*H*Lq*Lk = {total} >= {CODA_MIN_TOTAL_PAIRS}; {reason}")
    if route == "cpp":
        return Plan(route, f"the C++ kernels beat the materialized path at every size; {reason}")
    if route == "cpp_softmax":
        return Plan(
            route, f"with padding or dropout the C++ kernels beat SDPA and the materialized path; {reason}"
        )
    if route == "triton":
        return Plan(route, f"the Triton kernels never materialize the weights; {reason}")
    if route == "coda_triton":
        return Plan(route, f"the Triton CoDA kernel never materializes M; {reason}")
    if Lq * Lk < MIN_PAIRS:
        return Plan(
            "reference", f"Lq*Lk = {Lq * Lk} < {MIN_PAIRS}: the materialized path is as fast at this size"
        )
    return Plan(route, f"Lq*Lk = {Lq * Lk} >= {MIN_PAIRS}; {reason}")


@torch.compiler.disable(reason=EAGER_UNDER_COMPILE)  # kernels opaque to the tracer: run eagerly
def run_route(
    route: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: MechanismConfig,
    mask: MaskInfo,
    *,
    scale: float,
    dropout_p: float = 0.0,
    u: Optional[Tensor] = None,
) -> Tensor:
    """Run efficient ``route`` (a name of ``ROUTES``) on one call; ``u`` is the hybrid weight (hnas only)."""
    return ROUTES[route].run(Call(q, k, v, config, mask, dropout_p), scale, u)
