"""The functional core: ``attention``, ``normalize`` and ``explain_dispatch`` (docs/design.md section 7).

Both accept a mechanism name (``"softmax"``, ``"dnas"``, ``"hnas"``, ``"sinkhorn"``, ``"coda"``) or a
config object (``ak.Sinkhorn(iters=5)``), the masks of ``attnkit.masks`` and return weights in which
invalid pairs weigh exactly 0 and queries without a valid key get zeros (never NaN).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Callable, Iterator, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import CoDA, Hybrid, MechanismConfig, MechanismLike
from .kernels import ROUTES, Plan, plan, run_route
from .masks import MASKED_BIAS, MaskInfo, build_mask, causal_pattern, check_qkv, constant_key_bias
from .mechanisms import check_hybrid_weight
from .registry import causal_problem, check_causal, normalizes_over_queries, resolve_options, spec_of
from .scores import neg_l1_distance, scaled_dot
from .scores._checks import check_scale
from .validators import (
    EAGER_UNDER_COMPILE,
    check_bool,
    check_not_traced,
    check_number,
    unbatched_values,
    values_hidden,
)

__all__ = [
    "attention",
    "normalize",
    "explain_dispatch",
    "observe_weights",
    "observing",
    "observed_query_padding",
    "BACKENDS",
    "resolve_call",
    "WeightObserver",
]

BACKENDS: tuple[str, ...] = ("auto", "reference", "efficient")


WeightObserver = Callable[[Tensor, MaskInfo, MechanismConfig], None]
# per thread (and asyncio task): a block open in one thread neither observes nor reroutes another's calls
_OBSERVERS: contextvars.ContextVar[tuple[tuple[WeightObserver, object], ...]] = contextvars.ContextVar(
    "attnkit_observers", default=()
)  # (observer, a key of its block): a block leaves by its key, in any order (two generators' blocks)


@contextlib.contextmanager
def observe_weights(observer: WeightObserver) -> Iterator[None]:
    """Call ``observer(weights, mask_info, config)`` for every ``attention`` call inside the block.

    ``weights`` is the detached ``(B, H, Lq, Lk)`` matrix of the mechanism, before attention dropout (a model
    in training mode is observed as its mechanism weighs, not as the dropout mask thins it); calls inside
    the block use the reference backend so that the weights exist. Diagnostics (``attnkit.analysis``) build
    on this. The block observes the calls of its own thread (and asyncio task), not those that other
    threads make meanwhile.
    """
    key = object()
    _OBSERVERS.set((*_OBSERVERS.get(), (observer, key)))
    try:
        yield
    finally:  # by its key, not by resetting: blocks that close out of order must not bring a closed one back
        entries = _OBSERVERS.get()
        if any(entry[1] is key for entry in entries):
            _OBSERVERS.set(tuple(entry for entry in entries if entry[1] is not key))
        else:  # closed from another thread (a generator finished there): its own context drops it when read
            _CLOSED_ELSEWHERE.add(key)


_CLOSED_ELSEWHERE: set = set()  # keys of blocks closed outside the context that opened them


def _active_observers() -> tuple[tuple[WeightObserver, object], ...]:
    """This context's open observers (without blocks closed from another thread)."""
    entries = _OBSERVERS.get()
    if entries and _CLOSED_ELSEWHERE:
        closed = [entry for entry in entries if entry[1] in _CLOSED_ELSEWHERE]
        if closed:
            entries = tuple(entry for entry in entries if entry[1] not in _CLOSED_ELSEWHERE)
            _OBSERVERS.set(entries)
            for _, key in closed:
                _CLOSED_ELSEWHERE.discard(key)
    return entries


@torch.compiler.disable(reason=EAGER_UNDER_COMPILE)
def observing() -> bool:
    """Whether an ``observe_weights`` block is active. Self-attention modules (``ak.nn.MultiheadAttention``,
    converted Hugging Face models) then infer the query padding of softmax from the key padding too, and
    give it to the observers only (:func:`observed_query_padding`)."""
    return bool(_active_observers())


_OBSERVED_QUERY: contextvars.ContextVar[Optional[Tensor]] = contextvars.ContextVar(
    "attnkit_observed_query", default=None
)


@contextlib.contextmanager
def observed_query_padding(query_mask: Optional[Tensor]) -> Iterator[None]:
    """Observers of the ``attention`` calls inside the block see ``query_mask`` ``(B, Lq)`` (True = real
    query) as the call's query padding: the weights of padded query rows zero, the mask info holding it.
    The outputs are not changed: softmax self-attention keeps its padded query rows as torch does, and an
    open ``observe_weights`` block must not change what a model computes, yet those rows entered the
    column sums that the diagnostics read."""
    token = _OBSERVED_QUERY.set(query_mask)
    try:
        yield
    finally:
        _OBSERVED_QUERY.reset(token)


def _observed(weights: Tensor, mask: MaskInfo, config: MechanismConfig) -> tuple[Tensor, MaskInfo]:
    """The weights and mask info the observers see: with :func:`observed_query_padding`'s query padding
    (for a call that has none of its own), padded query rows zero and the padding in the mask info."""
    hint = _OBSERVED_QUERY.get()
    if hint is None or mask.query_mask is not None:
        return weights, mask
    B, H, Lq, Lk = weights.shape
    if hint.shape != (B, Lq):
        raise ValueError(f"observed_query_padding got a mask of shape {tuple(hint.shape)} for a call of "
                         f"{B} sequences of {Lq} queries; pass (B, Lq) = ({B}, {Lq})")
    observed = build_mask(B, H, Lq, Lk, key_mask=mask.key_mask, query_mask=hint, attn_mask=mask.attn_mask,
                          causal=mask.causal, device=weights.device, allow_bias=not isinstance(config, CoDA))
    return weights.masked_fill(~hint[:, None, :, None], 0.0), observed


def resolve_call(
    mechanism: MechanismLike,
    hybrid_weight: Optional[Union[float, Tensor]],
    sinkhorn_iters: Optional[int],
) -> MechanismConfig:
    """Merge the per-call options with the mechanism's config, rejecting options that do not apply."""
    return resolve_options(mechanism, hybrid_weight=hybrid_weight, sinkhorn_iters=sinkhorn_iters)


def _check_dropout(p: float) -> float:
    expected = "expected a number in [0, 1)"
    return check_number(p, f"dropout_p={p!r}", expected, low=0.0, high=1.0, high_open=True, sep="; ")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half-precision inputs are normalized in float32 (as torch's softmax does internally)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _weights(
    scores: Tensor,
    config: MechanismConfig,
    mask: MaskInfo,
    u: Optional[Tensor],
    gate_scores: Optional[Tensor] = None,
) -> Tensor:
    """Weights ``(B, H, Lq, Lk)`` of ``config`` from scores in the compute dtype."""
    if mask.bias is not None:  # never for CoDA: build_mask refuses a float attn_mask there
        scores = scores + mask.bias.to(scores.dtype)
    return spec_of(config).weights(scores, mask.valid, config, u, gate_scores)


def _hybrid_u(config: MechanismConfig, hybrid_weight, H: int, like: Tensor) -> Optional[Tensor]:
    """``u`` broadcastable to ``(B, H, Lq, Lk)`` in the compute dtype (float32 for half inputs)."""
    if not isinstance(config, Hybrid):
        return None
    u = config.u0 if hybrid_weight is None else hybrid_weight
    return check_hybrid_weight(u, H, like, dtype=_compute_dtype(like.dtype))


def _zero_padding(q: Tensor, k: Tensor, v: Tensor, mask: MaskInfo) -> tuple[Tensor, Tensor, Tensor]:
    """Zero the padded rows (``query_mask`` / ``key_mask`` False) so that whatever they hold never matters.

    Padded pairs weigh exactly 0, but ``0 * nan = nan`` and ``inf - inf = nan`` in the products and
    column sums of every backend: a select (``torch.where``, never a multiplication) makes "padding =
    truncation" hold for NaN, inf and huge values too, and passes zero gradients to the padded rows.
    A call without padding (no mask, or a CPU mask without a False) is left untouched (no copy).
    """
    if _has_padding(mask.query_mask):
        q = torch.where(mask.query_mask[:, None, :, None], q, 0.0)  # (B, H, Lq, D)
    if _has_padding(mask.key_mask):
        keep = mask.key_mask[:, None, :, None]  # (B, 1, Lk, 1)
        k = torch.where(keep, k, 0.0)  # (B, H, Lk, D)
        v = torch.where(keep, v, 0.0)  # (B, H, Lk, Dv)
    return q, k, v


def _autocast_inputs(q, k, v):
    """``q, k, v`` in the autocast dtype of their device when autocast is on there: floating tensors are cast,
    float64 ones are not (autocast's own rule)."""
    if not all(isinstance(t, Tensor) for t in (q, k, v)):
        return q, k, v  # the boundary names what is wrong
    device = q.device.type
    try:
        if not torch.is_autocast_enabled(device):
            return q, k, v
        dtype = torch.get_autocast_dtype(device)
    except RuntimeError:  # a device type without autocast
        return q, k, v
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t for t in (q, k, v))


def _has_padding(m: Optional[Tensor]) -> bool:
    """``m`` has a False entry; on an accelerator (checking would synchronize with the device) and under
    ``vmap`` (the values cannot be read) assumed so."""
    if m is None:
        return False
    return m.device.type != "cpu" or values_hidden(m) or not bool(m.all())


# Under torch.compile the call runs eagerly, one graph break, and the model around it compiles: its route is
# chosen from the masks' values (host reads), and its kernels (C++, Triton) are opaque to the tracer.
@torch.compiler.disable(reason=EAGER_UNDER_COMPILE)
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mechanism: MechanismLike = "softmax",
    *,
    key_mask: Optional[Tensor] = None,
    query_mask: Optional[Tensor] = None,
    attn_mask: Optional[Tensor] = None,
    causal: bool = False,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    hybrid_weight: Optional[Union[float, Tensor]] = None,
    sinkhorn_iters: Optional[int] = None,
    return_weights: bool = False,
    backend: str = "auto",
) -> Union[Tensor, tuple[Tensor, Tensor]]:
    r"""Attention ``out_i = sum_j pi_ij v_j`` with the weights ``pi`` of ``mechanism``.

    .. math::
        s_{ij} = \text{scale} \cdot q_i \cdot k_j, \qquad
        \pi = \text{normalize}(s), \qquad \text{out} = \pi v

    For ``"coda"``, ``pi = f_E(alpha E) * gate(beta N)`` with ``N = -scale * ||q_i - k_j||_1``.

    Shapes:
        q ``(B, H, Lq, D)``, k ``(B, H, Lk, D)``, v ``(B, H, Lk, Dv)`` -> out ``(B, H, Lq, Dv)``;
        weights ``(B, H, Lq, Lk)`` when ``return_weights``.

    Args:
        mechanism: a name in ``ak.MECHANISMS`` or a config object.
        key_mask, query_mask, attn_mask, causal: masks, True = may attend (see ``attnkit.masks``).
        scale: score scale, ``1/sqrt(D)`` by default.
        dropout_p: dropout on the weights, in ``[0, 1)`` (applied whenever > 0, as in SDPA; 1, which
            SDPA takes and answers with zeros, is refused). The C++ CPU routes draw it from a counter-based
            hash seeded by one draw from torch's generator, at a rate rounded to a multiple of ``2**-16`` (at
            most 7.6e-6 off: a rate below that drops nothing there): the same distribution as torch's
            dropout but other masks for a given seed; ``backend="reference"`` takes torch's ``F.dropout``
            (the masks SDPA's math path and ``torch.nn.MultiheadAttention`` draw).
        hybrid_weight: ``u`` for ``"hnas"``: a number or a tensor of ``()``, ``(H,)`` or ``(B, H, 1, 1)``.
            Defaults to the config's ``u0`` (0.5).
        sinkhorn_iters: iterations for ``"sinkhorn"`` (default 3).
        return_weights: also return the weights (uses the reference backend).
        backend: ``"reference"`` (materialized weights), ``"efficient"`` (O(L) memory) or ``"auto"``.

    Invariants: invalid pairs weigh 0; a query with no valid key returns zeros; dnas/hnas/sinkhorn,
    and CoDA with ``gate="centered"`` or ``center_e=True`` (means over all valid pairs), raise a
    ``ValueError`` under ``causal=True`` (they would leak future positions).

    Under ``torch.autocast`` floating ``q``, ``k``, ``v`` (not float64) are cast to the autocast dtype first,
    as autocast does for SDPA, so that every route computes and returns in that dtype (the C++ kernels, which
    autocast does not see, returned float32 where SDPA and the reference returned bfloat16); the routes then
    run as for inputs given in that dtype, with autocast off (it recast the reference's and the block
    sweeps' float32 score products to bfloat16: logits 10-20x less accurate than the same call outside it).
    """
    q, k, v = _autocast_inputs(q, k, v)
    with _autocast_off(q):
        return _attention(q, k, v, mechanism, key_mask, query_mask, attn_mask, causal, scale, dropout_p,
                          hybrid_weight, sinkhorn_iters, return_weights, backend)


def _autocast_off(q):
    """A context without autocast on ``q``'s device where it is on (else one that does nothing)."""
    device = q.device.type if isinstance(q, Tensor) else "cpu"
    try:
        on = torch.is_autocast_enabled(device)
    except RuntimeError:  # a device type without autocast
        on = False
    return torch.autocast(device, enabled=False) if on else contextlib.nullcontext()


def _attention(q, k, v, mechanism, key_mask, query_mask, attn_mask, causal, scale, dropout_p, hybrid_weight,
               sinkhorn_iters, return_weights, backend):
    """``attention`` past the autocast cast of its inputs."""
    config, mask, scale, dropout_p = _boundary(
        q, k, v, mechanism, key_mask, query_mask, attn_mask, causal, scale, dropout_p, hybrid_weight,
        sinkhorn_iters, backend,
    )
    check_bool(return_weights, f"return_weights={return_weights!r}")
    u = _hybrid_u(config, hybrid_weight, q.shape[1], q)

    observers = _active_observers()
    if observers:
        q, k, v = _zero_padding(q, k, v, mask)
        mechanism_weights: list = []  # before attention dropout: Lemma 1 and the column sums are of these
        out, w = _reference_attention(q, k, v, config, mask, scale, dropout_p, u, return_weights=True,
                                      before_dropout=mechanism_weights)
        observed, observed_mask = _observed(mechanism_weights[0].detach(), mask, config)
        for observer, _ in observers:
            observer(observed, observed_mask, config)
        out = _stop_gradient_of_empty_rows(out, mask)
        return (out, w) if return_weights else out

    route = _plan(q, k, v, config, mask, dropout_p, backend, return_weights).route
    if route == "reference" or not ROUTES[route].compacts(config):  # the C++ kernels gather the valid rows
        q, k, v = _zero_padding(q, k, v, mask)
    if route == "reference":
        result = _reference_attention(q, k, v, config, mask, scale, dropout_p, u, return_weights)
        if return_weights:
            return _stop_gradient_of_empty_rows(result[0], mask), result[1]
        return _stop_gradient_of_empty_rows(result, mask)
    out = run_route(route, q, k, v, config, mask, scale=scale, dropout_p=dropout_p, u=u)
    if out.requires_grad:
        out.register_hook(_first_order_only)
    return _stop_gradient_of_empty_rows(out, mask)


def _stop_gradient_of_empty_rows(out: Tensor, mask: MaskInfo) -> Tensor:
    """``out`` with no gradient path from the rows of padded queries and of queries without a valid key
    (padding, ``attn_mask``, ``causal``): their outputs are the constant 0, so a NaN or inf gradient arriving
    there (``o / o.norm()`` of a zero row) must not reach the real tokens (0 * NaN in ``P^T dO`` made every
    gradient of the batch element NaN on some routes). A select, whenever gradients are on (under ``vmap``
    ``out.requires_grad`` is False) and a row may be empty; the values are unchanged."""
    if not torch.is_grad_enabled():
        return out
    rows = _rows_with_a_key(mask)  # (B|1, H|1, Lq, 1) or None: every row has one
    if _has_padding(mask.query_mask):
        query = mask.query_mask[:, None, :, None]  # (B, 1, Lq, 1)
        rows = query if rows is None else rows & query
    if rows is None:
        return out
    return torch.where(rows, out, torch.zeros((), dtype=out.dtype, device=out.device))


def _rows_with_a_key(mask: MaskInfo) -> Optional[Tensor]:
    """Which queries see at least one valid key, ``(B|1, H|1, Lq, 1)``; ``None`` when all may (no mask that
    can empty a row)."""
    key = mask.key_mask  # (B, Lk) or None
    Lq, Lk = mask.Lq, mask.Lk
    if mask.pair is not None:
        seen = mask.pair if key is None else mask.pair & key[:, None, None, :]  # (B|1, H|1, Lq|1, Lk)
        if mask.causal:
            seen = seen & torch.ones(Lq, Lk, dtype=torch.bool, device=seen.device).tril()
        return seen.any(-1, keepdim=True)
    if key is None or not _has_padding(key):
        return None
    if mask.causal:  # query i sees keys j <= i (top-left): none while no valid key lies at or before i
        upto = key.cumsum(-1) > 0  # (B, Lk): a valid key at or before j
        last = torch.arange(Lq, device=key.device).clamp(max=Lk - 1)
        return upto[:, last][:, None, :, None]  # (B, 1, Lq, 1)
    return key.any(-1)[:, None, None, None]  # (B, 1, 1, 1)


def _first_order_only(grad: Optional[Tensor]) -> None:
    """Refuse ``create_graph=True`` (Hessian-vector products, gradient penalties, second-order meta-learning)
    through an efficient route: the kernels' backward passes are not differentiable, so the gradients they
    return would carry no graph and a second-order term would silently be zero. The materialized path
    (``backend="reference"``) is differentiable twice. A tensor hook: nothing is saved."""
    functorch = torch._C._functorch
    if grad is not None and (functorch.is_batchedtensor(grad) or functorch.is_legacy_batchedtensor(grad)):
        raise ValueError(
            "batched gradients (torch.autograd.functional.jacobian(..., vectorize=True), "
            "is_grads_batched=True) are not available through attnkit's efficient attention kernels; use "
            "vectorize=False, or backend='reference' for this computation"
        )
    if torch.is_grad_enabled():
        raise ValueError(
            "second derivatives (create_graph=True) are not available through attnkit's efficient "
            "attention kernels: their gradients are not differentiable; pass backend='reference' to "
            "ak.attention or the attnkit module (a converted Hugging Face model: "
            "attnkit.hf.set_backend(model, 'reference')) for this computation"
        )


def _boundary(
    q, k, v, mechanism, key_mask, query_mask, attn_mask, causal, scale, dropout_p, hybrid_weight,
    sinkhorn_iters, backend,
) -> tuple[MechanismConfig, MaskInfo, float, float]:
    """Resolve and validate one call once: the config, the call's one ``MaskInfo``, scale and dropout."""
    check_not_traced("ak.attention")
    config = resolve_call(mechanism, hybrid_weight, sinkhorn_iters)
    check_qkv(q, k, v)
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    check_causal(config, causal)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    mask = build_mask(
        B, H, Lq, Lk,
        key_mask=key_mask, query_mask=query_mask, attn_mask=attn_mask, causal=causal,
        device=q.device, allow_bias=not isinstance(config, CoDA),
    )
    check_causal_pattern(config, mask)
    check_constant_key_bias(config, mask)
    scale = check_scale(scale, D)
    _check_fits(q, k, scale, mask, config)
    return config, mask, scale, _check_dropout(dropout_p)


def _check_fits(q: Tensor, k: Tensor, scale: float, mask: MaskInfo, config: MechanismConfig) -> None:
    """The scores are finite in the dtype they are computed in (float32 for float16 and bfloat16 inputs,
    else the inputs'): ``scale=1e39``, a bias of ``1e39``, or ``scale=1e38`` with unit-size inputs became
    inf in float32 and every output NaN.

    ``scale`` is checked as a value, and a float ``attn_mask``'s biases of another dtype against the inputs'
    own (a route may cast them to it: SDPA made a float32 bias of 1e5 inf for float16 inputs), on every
    device; on CPU the largest bias of any dtype enters the bound on the scores below.
    The scores of finite inputs, ``scale * q . k`` (and CoDA's ``scale * ||q - k||_1``), and their sums
    before scaling, are bounded on CPU through ``max|q|`` and ``max|k|`` over the rows that are not padded
    (padded rows may hold anything, ``_zero_padding``): two min/max reductions of the inputs. A NaN or inf
    in q or k is not refused (it gives non-finite outputs, as in torch, which ``GradScaler`` and the like
    rely on). On other devices the inputs are not read before the kernels run, so that a call never waits
    for the device."""
    dtype = q.dtype
    if not dtype.is_floating_point:
        return
    top = torch.finfo(torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype).max
    if scale > top:
        raise ValueError(f"scale={scale!r} overflows the scores' dtype (largest {top:.4g}); pass a smaller "
                         "scale")
    largest_bias = 0.0
    bias = mask.bias
    other = bias is not None and bias.dtype != dtype  # a route may cast it to q's dtype: checked everywhere
    if (bias is not None and (other or q.device.type == "cpu") and not values_hidden(bias)
            and bias.numel()):  # a bias of q's own dtype enters the CPU bound on the scores below
        largest_bias = float(bias.detach().abs().amax())
        own = torch.finfo(dtype).max
        if other and largest_bias > own:
            raise ValueError(f"attn_mask holds {largest_bias:.4g}, which overflows q's dtype {dtype} "
                             f"(largest {own:.4g}); use finite biases in that range and -inf for pairs that "
                             "may not attend")
    if q.device.type != "cpu" or values_hidden(q) or values_hidden(k) or not q.numel() or not k.numel():
        return

    def reach(q_top: float, k_top: float) -> float:  # the largest |score|, or sum before scaling, possible
        D, factor = q.shape[-1], max(1.0, scale)
        if isinstance(config, CoDA):  # tanh(alpha E), E = scale q.k; gate(beta N), N = -scale ||q - k||_1
            return factor * D * max(q_top * k_top * max(1.0, abs(config.alpha)),
                                    (q_top + k_top) * max(1.0, abs(config.beta)))
        return factor * D * q_top * k_top + largest_bias

    with torch.no_grad():
        q_top, k_top = (max(-float(lo), float(hi)) for lo, hi in (torch.aminmax(t.detach()) for t in (q, k)))
        if reach(q_top, k_top) > top or not (q_top + k_top) < math.inf:
            q_top, k_top = _largest_unpadded(q, mask.query_mask), _largest_unpadded(k, mask.key_mask)
    if not (math.isfinite(q_top) and math.isfinite(k_top)):
        return  # a NaN or inf in q or k: the outputs are not finite either, as torch's (never hidden)
    bound = reach(q_top, k_top)
    if bound > top:
        what = "scale * q . k and scale * ||q - k||_1" if isinstance(config, CoDA) else "scale * q . k"
        raise ValueError(
            f"the scores {what} may reach {bound:.4g} (scale={scale:.4g}, D={q.shape[-1]}, largest |q| and "
            f"|k| entries of the rows not padded), beyond the largest {top:.4g} of the scores' dtype: they "
            "would overflow to inf and the outputs be NaN; scale q and k (or the scale) down"
        )


def _largest_unpadded(x: Tensor, mask: Optional[Tensor]) -> float:
    """``max |x|`` over the rows of ``x`` ``(B, H, L, D)`` that ``mask`` ``(B, L)`` (True = real) keeps."""
    top = x.detach().abs().amax(dim=-1)  # (B, H, L)
    if mask is not None:
        top = top.masked_fill(~mask[:, None, :], 0.0)
    return float(top.amax())


def check_causal_pattern(config: MechanismConfig, mask: MaskInfo, source: str = "attn_mask") -> None:
    """Raise ``causal_problem`` when ``source`` (``attn_mask``, or the ``-inf`` scores given to
    ``normalize``) is causal in all but name (``attnkit.masks.causal_pattern``)."""
    problem = causal_problem(config)
    if problem is not None and not mask.causal and causal_pattern(mask):
        raise ValueError(
            f"{source} is a causal pattern (no query sees a later key; or a prefix-LM one: a bidirectional "
            f"prefix, then no query sees a later key; or another order, in which each query's keys are "
            f"within those of a query it may not see: block-causal, right-to-left, permuted): {problem}"
        )


def check_constant_key_bias(
    config: MechanismConfig, mask: MaskInfo, source: str = "attn_mask", fix: Optional[str] = None
) -> None:
    """Refuse, for a mechanism that normalizes over queries, a float mask that hides a key with a finite
    fill (``attnkit.masks.constant_key_bias``: -1000 at padded keys, alone or under a graded bias), to which
    its column normalization gives a share of the weight all the same. ``source`` names the mask in the
    message and ``fix`` says what to pass instead (the modules name their own masks)."""
    found = constant_key_bias(mask) if normalizes_over_queries(config) else None
    if found is not None:
        smallest, largest, key = found
        held = f"{largest:g}" if smallest == largest else f"{smallest:g} to {largest:g}"
        if fix is None:
            fix = (
                f"mark keys that may not attend with -inf (or <= {MASKED_BIAS:g}), a boolean attn_mask or "
                "key_mask"
            )
        raise ValueError(
            f"{source} holds {held} at key {key} for every query, 100 or more below the row's largest "
            f"entry: mechanism {config.name!r} normalizes over queries, which cancels a bias that is the "
            f"same for every query of a key (and normalizes what varies on top), so that key keeps its "
            f"weight; {fix}"
        )


def _plan(q, k, v, config, mask, dropout_p: float, backend: str, return_weights: bool) -> Plan:
    """The route of a validated call: ``"reference"`` or a route of ``attnkit.kernels.ROUTES``, with why."""
    if backend == "efficient":
        if return_weights:
            raise ValueError(
                "backend='efficient' never materializes the (Lq, Lk) weights; use backend='reference' "
                "(or 'auto') with return_weights=True"
            )
        return plan(q, k, v, config, mask, dropout_p=dropout_p, backend="efficient")
    if backend == "reference":
        return Plan("reference", "backend='reference' was asked for")
    if return_weights:
        return Plan("reference", "return_weights=True needs the materialized (Lq, Lk) weights")
    return plan(q, k, v, config, mask, dropout_p=dropout_p, backend="auto")


def explain_dispatch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mechanism: MechanismLike = "softmax",
    *,
    key_mask: Optional[Tensor] = None,
    query_mask: Optional[Tensor] = None,
    attn_mask: Optional[Tensor] = None,
    causal: bool = False,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    hybrid_weight: Optional[Union[float, Tensor]] = None,
    sinkhorn_iters: Optional[int] = None,
    return_weights: bool = False,
    backend: str = "auto",
) -> Plan:
    """Which route ``ak.attention`` takes for these arguments, and why, without running it.

    Returns a ``Plan(route, reason)``: ``route`` is ``"reference"`` (materialized weights) or one of
    ``attnkit.kernels.ROUTES`` (``"sdpa"``, ``"cpp_softmax"``, ``"cpp"``, ``"aten"``, ``"blockwise"``,
    ``"triton"``, ``"coda_cpp"``, ``"coda_triton"``, ``"coda_blockwise"``; docs/design.md has the table).
    Takes the arguments of ``ak.attention`` and validates them the same way.

        >>> ak.explain_dispatch(q, k, v, "dnas", key_mask=mask)
        Plan(route='cpp', reason='the C++ kernels beat the materialized path at every size; ...')
    """
    config, mask, _, dropout_p = _boundary(  # scale is validated; the route does not depend on it
        q, k, v, mechanism, key_mask, query_mask, attn_mask, causal, scale, dropout_p, hybrid_weight,
        sinkhorn_iters, backend,
    )
    check_bool(return_weights, f"return_weights={return_weights!r}")
    if _active_observers():
        return Plan("reference", "inside observe_weights(): the observers need the weights")
    return _plan(q, k, v, config, mask, dropout_p, backend, return_weights)


def _reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: MechanismConfig,
    mask: MaskInfo,
    scale: float,
    dropout_p: float,
    u: Optional[Tensor],
    return_weights: bool,
    before_dropout: Optional[list] = None,
) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """The materialized path: weights ``(B, H, Lq, Lk)`` in float32 (or float64), then ``weights @ v``.

    Scores are computed from ``q`` and ``k`` cast to the compute dtype, so half-precision inputs lose
    no accuracy in the logits; the weights are cast to ``v``'s dtype for the product, as SDPA does. The
    returned weights are those after dropout (as torch's ``need_weights``); ``before_dropout`` receives the
    mechanism's own.
    """
    cdtype = _compute_dtype(q.dtype)
    qc, kc = q.to(cdtype), k.to(cdtype)
    s = scaled_dot(qc, kc, scale)  # (B, H, Lq, Lk)
    n = neg_l1_distance(qc, kc, scale) if isinstance(config, CoDA) else None  # (B, H, Lq, Lk)
    w = _weights(s, config, mask, u, gate_scores=n)
    if before_dropout is not None:
        before_dropout.append(w)
    if dropout_p > 0:
        w = F.dropout(w, p=dropout_p, training=True)
    w = w.to(v.dtype)
    out = w @ v  # (B, H, Lq, Dv)
    return (out, w) if return_weights else out


MASKED_SCORE = -1e8
"""A score given to ``normalize`` at or below this is a masked pair, as ``-inf`` is (a mask of -1e9 or
``finfo.min`` added to the scores gets there; no real score does)."""


SCORE_PATTERN_GAP = 5000.0
"""For the causal-pattern check of ``normalize`` under the mechanisms that normalize over queries, a score
(with the ``attn_mask`` bias added) this far or more below its row's largest valid one counts as hidden: a
causal fill of -1e4 (float16 code) or -1e6 added to the scores leaks and is refused. Why 5000: BERT-style
-1e4 fills sit on scores of either sign, so half of it leaves room for the real scores' spread; real scores
5000 apart within one row are beyond float32's resolution of a softmax and rare (ALiBi at slope 0.5 over
10000+ positions), and are refused only if they also form a causal pattern. Sharp real scores (later keys
~150 lower) pass. Such scores are still weighed as scores, never masked."""


def _fold_neg_inf(scores: Tensor, mask: MaskInfo) -> tuple[Tensor, MaskInfo]:
    """``-inf`` scores, and any at or below ``MASKED_SCORE`` (-1e8; half the dtype's lowest value in half
    precision), are masked pairs (so a row or column of them gets zeros, not NaN); NaN and ``+inf`` are
    errors."""
    hidden = values_hidden(scores)  # under vmap: checked on the plain values, -inf folded wherever it may be
    plain = unbatched_values(scores) if hidden else scores
    if torch.isnan(plain).any() or torch.isposinf(plain).any():
        raise ValueError(
            "scores contain NaN or +inf, which have no weight; check the score function's inputs, and mark "
            "pairs that may not attend with -inf or a mask"
        )
    # a score at or below MASKED_SCORE (in half precision: half the dtype's lowest value) is a mask added
    # to the scores (Hugging Face's eager ``scores + mask`` of finfo.min, the common -1e9): the
    # column-normalizing mechanisms would otherwise cancel it per key and give padded keys weight. Real scores
    # never get there (an attn_mask counts from -1e4; for softmax, scores of -1e4 are still scores)
    allowed = scores > max(MASKED_SCORE, torch.finfo(scores.dtype).min / 2)  # (B, H, Lq, Lk)
    if not hidden and bool(allowed.all()):
        return scores, mask
    pair = allowed if mask.pair is None else mask.pair & allowed
    folded = dataclasses.replace(mask, pair=pair, _valid=None, _valid_built=False)
    return scores.masked_fill(~allowed, 0.0), folded


def _with_bias(scores: Tensor, mask: MaskInfo) -> Tensor:
    """``scores`` plus the float ``attn_mask`` bias (0 at its masked pairs), ``(B, H, Lq, Lk)``."""
    return scores if mask.bias is None else scores + mask.bias.to(scores.dtype)


def normalize(
    scores: Tensor,
    mechanism: MechanismLike = "softmax",
    *,
    key_mask: Optional[Tensor] = None,
    query_mask: Optional[Tensor] = None,
    attn_mask: Optional[Tensor] = None,
    causal: bool = False,
    hybrid_weight: Optional[Union[float, Tensor]] = None,
    sinkhorn_iters: Optional[int] = None,
    gate_scores: Optional[Tensor] = None,
) -> Tensor:
    """Attention weights ``(B, H, Lq, Lk)`` from any scores ``(B, H, Lq, Lk)``.

    Use it with any score function of ``ak.scores`` (dot, scaled dot, bilinear, additive). For
    ``"coda"``, ``scores`` is the affinity ``E`` and ``gate_scores`` the negative distance ``N``
    (e.g. ``ak.scores.neg_l1_distance(q, k)``); alpha and beta of the config scale them.

    A ``-inf`` score, or any at or below ``MASKED_SCORE`` (-1e8, or half the dtype's lowest value in half
    precision: a mask added to the scores, such as ``finfo.min`` or ``-1e9``), marks a pair that may not
    attend, as a mask does: it weighs 0, and a row (or, for the column-normalizing mechanisms, a column) of
    them gets zeros, never NaN; such a pattern that is causal is refused as a causal ``attn_mask`` is. NaN and
    ``+inf`` scores raise a ``ValueError``.

    Finite scores are scores: a mask added to the scores counts as one only at ``-inf`` or at or below
    ``-1e8`` (``finfo.min``, as transformers builds masks). A finite padding bias such as BERT's legacy
    ``(1 - mask) * -10000`` added to the scores is a score there, which the column normalization of dnas /
    sinkhorn cancels per key: pass padding as ``key_mask`` or ``attn_mask`` instead (``ak.attention``'s
    ``attn_mask`` rules). For the mechanisms that normalize over queries (dnas, hnas, sinkhorn with
    ``iters >= 1``) a causal fill ``SCORE_PATTERN_GAP`` (5000) or more below its row's largest valid score
    (-1e4, -1e6) is refused as a causal mask is; a shallower fill (-1000) reads as scores and is not detected
    (future tokens leak through the column sums), so pass a causal mask as ``causal=True`` or ``attn_mask``,
    where a fill 100 below is refused. Softmax (and ``Sinkhorn(iters=0)``) is ``torch.softmax`` on the rest.
    """
    check_not_traced("ak.normalize")
    config = resolve_call(mechanism, hybrid_weight, sinkhorn_iters)
    if not isinstance(scores, Tensor) or scores.dim() != 4 or not scores.dtype.is_floating_point:
        got = tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__
        raise ValueError(f"scores must be a floating tensor of shape (B, H, Lq, Lk), got {got}")
    B, H, Lq, Lk = scores.shape
    check_causal(config, causal)
    if isinstance(config, CoDA):
        if gate_scores is None:
            raise ValueError(
                "mechanism 'coda' needs gate_scores (the N matrix, e.g. ak.scores.neg_l1_distance(q, k)) "
                "besides scores (the E matrix)"
            )
        if not isinstance(gate_scores, Tensor) or gate_scores.shape != scores.shape:
            got = tuple(gate_scores.shape) if isinstance(gate_scores, Tensor) else type(gate_scores).__name__
            raise ValueError(
                f"gate_scores has shape {got}, expected the shape of scores "
                f"{tuple(scores.shape)}"
            )
        if not gate_scores.dtype.is_floating_point:
            raise ValueError(
                f"gate_scores has dtype {gate_scores.dtype}; expected a floating dtype like "
                "scores"
            )
        if gate_scores.device != scores.device:
            raise ValueError(
                f"gate_scores is on {gate_scores.device} but scores are on {scores.device}; move it with "
                ".to(device)"
            )
        plain = unbatched_values(gate_scores) if values_hidden(gate_scores) else gate_scores
        if torch.isnan(plain).any() or torch.isposinf(plain).any():
            raise ValueError(
                "gate_scores contain NaN or +inf, which have no gate; check the distance's inputs (N is a "
                "negative distance <= 0; -inf marks a pair infinitely far apart, whose gate is 0)"
            )
    elif gate_scores is not None:
        raise ValueError(f"gate_scores is only used by mechanism 'coda', got {config.name!r}")
    mask = build_mask(
        B, H, Lq, Lk,
        key_mask=key_mask, query_mask=query_mask, attn_mask=attn_mask, causal=causal,
        device=scores.device, allow_bias=not isinstance(config, CoDA),
    )
    check_constant_key_bias(config, mask)
    scores, folded = _fold_neg_inf(scores, mask)
    # -inf scores hide pairs as a mask does, so they can make the pattern causal too; for the mechanisms that
    # normalize over queries, so does a finite causal fill far below its row's largest (-1e4, -1e6)
    check_causal_pattern(config, folded, "attn_mask" if folded is mask else "the mask with the masked scores")
    if normalizes_over_queries(config) and Lk > 0:  # no keys: no pattern to read (amax of nothing)
        total = _with_bias(scores, folded)  # (B, H, Lq, Lk)
        valid = folded.valid
        seen = total if valid is None else total.masked_fill(~valid, float("-inf"))  # (B, H, Lq, Lk)
        top = seen.amax(-1, keepdim=True)  # (B, H, Lq, 1)
        near = seen > top - SCORE_PATTERN_GAP  # (B, H, Lq, Lk)
        pair = near if folded.pair is None else folded.pair & near
        check_causal_pattern(
            config, dataclasses.replace(folded, pair=pair, bias=None, _valid=None, _valid_built=False),
            f"the scores (a score {SCORE_PATTERN_GAP:g} or more below its row's largest counts as masked)",
        )
    mask = folded
    cdtype = _compute_dtype(scores.dtype)
    u = _hybrid_u(config, hybrid_weight, H, scores)
    n = gate_scores.to(cdtype) if gate_scores is not None else None
    return _weights(scores.to(cdtype), config, mask, u, gate_scores=n).to(scores.dtype)
