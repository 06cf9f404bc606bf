"""Plain float64 reference implementations of every mechanism, written from the papers.

Nothing here imports attnkit: the tests compare attnkit against these formulas.

- softmax (LNAS), "Doubly-Normalized Attention" eq. (1)/(3): ``pi_ij = exp(s_ij) / sum_j exp(s_ij)``.
- DNAS, "Doubly-Normalized Attention" eqs. (7)-(8): ``xi_ji = exp(s_ij) / sum_i exp(s_ij)``, ``pi_ij = xi_ji /
sum_j xi_ji``.
- HNAS, "Doubly-Normalized Attention" section 6: ``u * pi^D + (1 - u) * pi^L``.
- Sinkhorn, "Doubly-Normalized Attention" section 4: start from ``exp(s)`` and alternate column / row
normalizations
  (``k`` rounds; ``k = 0`` is one row normalization).
- CoDA, "Compositional De-Attention Networks" eqs. (3)-(6) and (10): ``tanh(E) * sigmoid(N)`` and its
variants.

Every normalization runs over the *valid* entries only: a pair is valid when the key mask, the
query mask, the boolean/float attention mask and the causal mask all allow it. Empty rows give 0.
The implementations work in the probability domain with explicit loops-free sums, so that they are
as far as possible from attnkit's log-domain code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

__all__ = [
    "full_valid",
    "ref_scores",
    "ref_softmax",
    "ref_dnas",
    "ref_hybrid",
    "ref_sinkhorn",
    "ref_coda",
    "ref_coda_from_scores",
    "ref_attention",
    "ref_weights",
    "Case",
    "CASES",
    "CODA_VARIANTS",
    "random_qkv",
    "random_padding",
    "random_lengths_masks",
]


# ----------------------------------------------------------------------------------------- masks


def full_valid(
    B: int,
    H: int,
    Lq: int,
    Lk: int,
    *,
    key_mask: Optional[Tensor] = None,
    query_mask: Optional[Tensor] = None,
    attn_mask: Optional[Tensor] = None,
    causal: bool = False,
) -> Tensor:
    """Boolean ``(B, H, Lq, Lk)``: True where every mask allows the pair (i, j)."""
    valid = torch.ones(B, H, Lq, Lk, dtype=torch.bool)
    for b in range(B):
        for i in range(Lq):
            for j in range(Lk):
                ok = True
                if key_mask is not None and not bool(key_mask[b, j]):
                    ok = False
                if query_mask is not None and not bool(query_mask[b, i]):
                    ok = False
                if causal and j > i:
                    ok = False
                if not ok:
                    valid[b, :, i, j] = False
    if attn_mask is not None:
        am = attn_mask.expand(B, H, Lq, Lk)
        if am.dtype == torch.bool:
            valid = valid & am
        else:
            valid = valid & (am != float("-inf"))
    return valid


def _additive_bias(attn_mask: Optional[Tensor], shape) -> Optional[Tensor]:
    if attn_mask is None or attn_mask.dtype == torch.bool:
        return None
    am = attn_mask.to(torch.float64).expand(*shape)
    return torch.where(torch.isinf(am), torch.zeros((), dtype=torch.float64), am)


# ---------------------------------------------------------------------------------- mechanisms


def ref_scores(q: Tensor, k: Tensor, scale: Optional[float] = None) -> Tensor:
    """``s_ij = scale * sum_d q_id k_jd`` in float64."""
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    return scale * (q.double().unsqueeze(-2) * k.double().unsqueeze(-3)).sum(-1)  # (B, H, Lq, Lk)


def _exp_valid(s: Tensor, valid: Tensor) -> Tensor:
    """``exp(s - m)`` on valid entries and 0 elsewhere, ``m`` a per-matrix shift (any shift cancels)."""
    shift = torch.where(valid, s, torch.full_like(s, -1e300)).amax(dim=(-2, -1), keepdim=True)
    shift = torch.where(shift < -1e299, torch.zeros_like(shift), shift).detach()
    safe = torch.where(valid, s - shift, torch.zeros_like(s))
    return torch.where(valid, torch.exp(safe), torch.zeros_like(s))


def _normalize(p: Tensor, dim: int) -> Tensor:
    total = p.sum(dim=dim, keepdim=True)
    return p / torch.where(total > 0, total, torch.ones_like(total))


def _row_shift_exp(s: Tensor, valid: Tensor) -> Tensor:
    shift = torch.where(valid, s, torch.full_like(s, -1e300)).amax(dim=-1, keepdim=True)
    shift = torch.where(shift < -1e299, torch.zeros_like(shift), shift).detach()
    safe = torch.where(valid, s - shift, torch.zeros_like(s))
    return torch.where(valid, torch.exp(safe), torch.zeros_like(s))


def ref_softmax(s: Tensor, valid: Tensor) -> Tensor:
    """Row normalization of ``exp(s)`` over valid keys."""
    return _normalize(_row_shift_exp(s, valid), dim=-1)


def ref_dnas(s: Tensor, valid: Tensor) -> Tensor:
    """DNA eqs. (7)-(8): normalize over queries i for each key j, then over keys j for each query i."""
    shift = torch.where(valid, s, torch.full_like(s, -1e300)).amax(dim=-2, keepdim=True)
    shift = torch.where(shift < -1e299, torch.zeros_like(shift), shift).detach()
    safe = torch.where(valid, s - shift, torch.zeros_like(s))
    e = torch.where(valid, torch.exp(safe), torch.zeros_like(s))
    xi = _normalize(e, dim=-2)  # xi_ji: sums to 1 over i
    return _normalize(xi, dim=-1)  # pi_ij = xi_ji / sum_j xi_ji


def ref_hybrid(s: Tensor, valid: Tensor, u) -> Tensor:
    """DNA section 6: ``u * pi^D + (1 - u) * pi^L``; ``u`` a number or a per-head tensor ``(H,)``."""
    if isinstance(u, Tensor) and u.dim() == 1:
        u = u.double().view(1, -1, 1, 1)
    return u * ref_dnas(s, valid) + (1 - u) * ref_softmax(s, valid)


def ref_sinkhorn(s: Tensor, valid: Tensor, iters: int) -> Tensor:
    """DNA section 4: ``pi^0 = exp(s)``, then ``iters`` rounds of column then row normalization."""
    p = _exp_valid(s, valid)
    for _ in range(iters):
        p = _normalize(p, dim=-2)
        p = _normalize(p, dim=-1)
    if iters == 0:
        p = _normalize(p, dim=-1)
    return p


_ACTS = {
    "tanh": lambda x: (torch.exp(x) - torch.exp(-x)) / (torch.exp(x) + torch.exp(-x)),
    "sigmoid": lambda x: 1.0 / (1.0 + torch.exp(-x)),
    "arctan": torch.atan,
    "algebraic": lambda x: x / torch.sqrt(1.0 + x * x),
}


_ACT_RANGES = {"tanh": (-1.0, 1.0), "sigmoid": (0.0, 1.0), "arctan": (-math.pi / 2, math.pi / 2),
               "algebraic": (-1.0, 1.0)}


def _valid_mean(x: Tensor, valid: Tensor) -> Tensor:
    count = valid.sum(dim=(-2, -1), keepdim=True)
    total = torch.where(valid, x, torch.zeros_like(x)).sum(dim=(-2, -1), keepdim=True)
    return total / torch.where(count > 0, count, torch.ones_like(count))


def ref_coda(
    q: Tensor,
    k: Tensor,
    valid: Tensor,
    *,
    gate: str = "scaled",
    center_e: bool = False,
    alpha: float = 1.0,
    beta: float = 1.0,
    e_activation: str = "tanh",
    n_activation: str = "sigmoid",
    scale: Optional[float] = None,
) -> Tensor:
    """CoDA eq. (10): ``M = f_E(alpha E) * g(-beta ||q_i - k_j||_1 * scale)``, 0 on invalid pairs."""
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    e = ref_scores(q, k, scale)
    n = -scale * (q.double().unsqueeze(-2) - k.double().unsqueeze(-3)).abs().sum(-1)  # (B, H, Lq, Lk)
    return ref_coda_from_scores(
        e, n, valid, gate=gate, center_e=center_e, alpha=alpha, beta=beta,
        e_activation=e_activation, n_activation=n_activation,
    )


def ref_coda_from_scores(
    e: Tensor,
    n: Tensor,
    valid: Tensor,
    *,
    gate: str = "scaled",
    center_e: bool = False,
    alpha: float = 1.0,
    beta: float = 1.0,
    e_activation: str = "tanh",
    n_activation: str = "sigmoid",
) -> Tensor:
    """CoDA eqs. (3)-(6) from an affinity ``E`` and a negative distance ``N`` (before alpha / beta)."""
    e = alpha * e.double()
    n = beta * n.double()
    if center_e:
        e = e - _valid_mean(e, valid)  # eq. (6)
    if gate == "centered":
        n = n - _valid_mean(n, valid)  # eq. (4)
    lo, hi = _ACT_RANGES[n_activation]
    g = (_ACTS[n_activation](n) - lo) / (hi - lo)  # the gate mapped onto [0, 1]
    if gate == "scaled":
        g = 2.0 * g  # eq. (5)
    m = _ACTS[e_activation](e) * g
    return torch.where(valid, m, torch.zeros_like(m))


# ------------------------------------------------------------------------------- full attention


def ref_weights(
    q: Tensor,
    k: Tensor,
    mechanism: str,
    *,
    key_mask=None,
    query_mask=None,
    attn_mask=None,
    causal=False,
    scale=None,
    u=0.5,
    iters=3,
    coda: Optional[dict] = None,
) -> Tensor:
    """Weights ``(B, H, Lq, Lk)`` in float64 for ``mechanism``."""
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    valid = full_valid(
        B, H, Lq, Lk, key_mask=key_mask, query_mask=query_mask, attn_mask=attn_mask, causal=causal
    )
    if mechanism == "coda":
        return ref_coda(q, k, valid, scale=scale, **(coda or {}))
    s = ref_scores(q, k, scale)
    bias = _additive_bias(attn_mask, s.shape)
    if bias is not None:
        s = s + bias
    if mechanism == "softmax":
        return ref_softmax(s, valid)
    if mechanism == "dnas":
        return ref_dnas(s, valid)
    if mechanism == "hnas":
        return ref_hybrid(s, valid, u)
    if mechanism == "sinkhorn":
        return ref_sinkhorn(s, valid, iters)
    raise ValueError(mechanism)


def ref_attention(q: Tensor, k: Tensor, v: Tensor, mechanism: str, **kwargs) -> tuple[Tensor, Tensor]:
    """``(out, weights)`` in float64: ``out_i = sum_j pi_ij v_j``."""
    w = ref_weights(q, k, mechanism, **kwargs)
    out = (w.unsqueeze(-1) * v.double().unsqueeze(-3)).sum(-2)  # (B, H, Lq, Dv)
    return out, w


# --------------------------------------------------------------------------- shared test cases


@dataclass(frozen=True)
class Case:
    """One mechanism setting: how to call ``ak.attention`` and how to call the reference."""

    id: str
    mechanism: (
        object  # a name, or a zero-argument callable building the config (attnkit is not imported here)
    )
    call: dict = field(default_factory=dict)  # extra kwargs of ak.attention
    ref: dict = field(default_factory=dict)  # extra kwargs of ref_weights
    ref_mechanism: str = ""
    causal_ok: bool = False

    def attnkit_mechanism(self, ak):
        return self.mechanism(ak) if callable(self.mechanism) else self.mechanism


CODA_VARIANTS: dict[str, dict] = {
    "coda-default": {},
    "coda-sigmoid": {"gate": "sigmoid"},
    "coda-centered": {"gate": "centered"},
    "coda-center_e": {"center_e": True},
    "coda-center_e-centered": {"center_e": True, "gate": "centered"},
    "coda-alpha-beta": {"alpha": 0.5, "beta": 2.0},
    "coda-e_sigmoid-n_tanh": {"e_activation": "sigmoid", "n_activation": "tanh"},
    "coda-e_arctan-n_arctan": {"e_activation": "arctan", "n_activation": "arctan"},
    "coda-e_algebraic-n_algebraic": {"e_activation": "algebraic", "n_activation": "algebraic"},
    "coda-e_tanh-n_algebraic-centered": {"n_activation": "algebraic", "gate": "centered"},
}


def _coda_case(name: str, opts: dict) -> Case:
    centered = opts.get("center_e", False) or opts.get("gate") == "centered"
    return Case(
        id=name,
        mechanism=lambda ak, opts=opts: ak.CoDA(**opts),
        ref={"coda": opts},
        ref_mechanism="coda",
        causal_ok=not centered,
    )


CASES: list[Case] = [
    Case("softmax", "softmax", ref_mechanism="softmax", causal_ok=True),
    Case("dnas", "dnas", ref_mechanism="dnas"),
    Case("hnas-0.3", "hnas", {"hybrid_weight": 0.3}, {"u": 0.3}, "hnas"),
    Case("hnas-default", "hnas", {}, {"u": 0.5}, "hnas"),
    Case("hnas-u0-0.1", lambda ak: ak.Hybrid(u0=0.1), {}, {"u": 0.1}, "hnas"),
    Case(  # one u per head: every test that uses CASES has H = 2
        "hnas-per-head",
        "hnas",
        {"hybrid_weight": torch.tensor([0.2, 0.9], dtype=torch.float64)},
        {"u": torch.tensor([0.2, 0.9], dtype=torch.float64)},
        "hnas",
    ),
    Case("sinkhorn-0", "sinkhorn", {"sinkhorn_iters": 0}, {"iters": 0}, "sinkhorn", causal_ok=True),
    Case("sinkhorn-1", "sinkhorn", {"sinkhorn_iters": 1}, {"iters": 1}, "sinkhorn"),
    Case("sinkhorn-2", "sinkhorn", {"sinkhorn_iters": 2}, {"iters": 2}, "sinkhorn"),
    Case("sinkhorn-5", lambda ak: ak.Sinkhorn(iters=5), {}, {"iters": 5}, "sinkhorn"),
] + [_coda_case(name, opts) for name, opts in CODA_VARIANTS.items()]


# ------------------------------------------------------------------------------------- inputs


def random_qkv(
    B=2, H=2, Lq=5, Lk=6, D=4, Dv=3, *, seed=0, dtype=torch.float64, scale=1.0, requires_grad=False
):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64) * scale
    k = torch.randn(B, H, Lk, D, generator=g, dtype=torch.float64) * scale
    v = torch.randn(B, H, Lk, Dv, generator=g, dtype=torch.float64)
    out = [t.to(dtype) for t in (q, k, v)]
    if requires_grad:
        out = [t.requires_grad_() for t in out]
    return out


def random_lengths_masks(lengths: list[int], L: int) -> Tensor:
    """Boolean ``(B, L)``: the first ``lengths[b]`` positions are real."""
    return torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]


def random_padding(B: int, Lq: int, Lk: int, seed: int = 1) -> tuple[Tensor, Tensor]:
    """``(key_mask (B, Lk), query_mask (B, Lq))``: random holes (30%), element 0 unpadded, and the first
    half of the keys of the last element padded (left padding)."""
    g = torch.Generator().manual_seed(seed)
    km = torch.rand(B, Lk, generator=g) > 0.3
    qm = torch.rand(B, Lq, generator=g) > 0.3
    km[0], qm[0] = True, True
    km[-1, : Lk // 2] = False
    return km, qm
