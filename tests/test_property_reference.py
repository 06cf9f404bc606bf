"""Seeded property test: every mechanism setting of ``tests/_reference.py`` on every backend route matches the
float64 reference, outputs and gradients, over random sizes (across the kernels' strip and chunk boundaries),
random padding (rows and columns left empty), boolean attention masks, causal masks, scales and memory layouts
(transposed, strided, expanded-head inputs). Each parameter runs a fixed, seeded list of draws, so a failure
names its draw and reproduces."""

from __future__ import annotations

import random

import pytest
import torch

import attnkit as ak
from attnkit.kernels import cpu_ext
from tests._reference import CASES, ref_attention

ROUTES = ("reference", "efficient", "efficient-no-cpp", "auto")
DRAWS = 4  # per (case, route): 20 cases x 4 routes x 4 draws = 320 comparisons
LAYOUTS = ("contiguous", "blhd", "strided", "k-transposed")
H = 2  # the per-head hybrid case of CASES has two heads


def _lay_out(t: torch.Tensor, layout: str, rng: random.Random) -> torch.Tensor:
    """The same values as ``t`` in another memory layout (a view with other strides)."""
    if layout == "blhd":  # (B, L, H, D) storage, as a (B, L, H*D) projection reshaped without a copy
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "strided":  # every other element of a wider last dimension
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]
    if layout == "k-transposed":  # (B, H, D, L) storage
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    return t.contiguous()


def _draw(rng: random.Random, causal_ok: bool) -> dict:
    big = rng.random() < 0.3
    Lq = rng.randint(1, 80 if big else 12)
    Lk = rng.randint(1, 80 if big else 12)
    B = rng.randint(1, 3)
    draw = dict(B=B, Lq=Lq, Lk=Lk, D=rng.randint(1, 9), Dv=rng.randint(1, 7), layout=rng.choice(LAYOUTS),
                scale=rng.choice([None, 0.3, 2.0]), seed=rng.randrange(2**31))
    g = torch.Generator().manual_seed(draw["seed"])
    masks: dict = {}
    if rng.random() < 0.7:
        lengths = torch.randint(0, Lk + 1, (B,), generator=g)  # a length 0 leaves every query without a key
        masks["key_mask"] = torch.arange(Lk)[None, :] < lengths[:, None]  # (B, Lk)
    if rng.random() < 0.5:
        lengths = torch.randint(0, Lq + 1, (B,), generator=g)
        masks["query_mask"] = torch.arange(Lq)[None, :] < lengths[:, None]  # (B, Lq)
    if rng.random() < 0.3:
        masks["attn_mask"] = torch.rand(B, 1, Lq, Lk, generator=g) < 0.75  # (B, 1, Lq, Lk)
        if not causal_ok:  # query 0 sees the last key: no example is a causal pattern, which
            masks["attn_mask"][:, :, 0, -1] = True  # dnas/hnas/sinkhorn refuse (a small random one can be)
    if causal_ok and rng.random() < 0.3:
        masks["causal"] = True
    draw["masks"] = masks
    return draw


@pytest.fixture(params=ROUTES)
def route(request, monkeypatch):
    if request.param == "efficient-no-cpp":  # what ATTNKIT_NO_CPP=1 does
        monkeypatch.setattr(cpu_ext, "_state", {"loaded": True, "ok": False, "error": "off in this test"})
        return "efficient"
    return request.param


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_matches_float64_reference_on_random_inputs(case, route):
    rng = random.Random(f"{case.id}/{route}")
    for i in range(DRAWS):
        d = _draw(rng, case.causal_ok)
        g = torch.Generator().manual_seed(d["seed"])
        B, Lq, Lk, D, Dv = d["B"], d["Lq"], d["Lk"], d["D"], d["Dv"]
        base = [
            torch.randn(B, H, L, n, generator=g, dtype=torch.float64) for L, n in ((Lq, D), (Lk, D), (Lk, Dv))
        ]
        q, k, v = (_lay_out(t, d["layout"], rng).requires_grad_() for t in base)
        call, ref = dict(case.call), dict(case.ref)
        inputs = [q, k, v]
        u = call.get("hybrid_weight")
        if isinstance(u, torch.Tensor):
            u = u.detach().clone().requires_grad_()
            call["hybrid_weight"], ref["u"] = u, u
            inputs.append(u)
        where = f"draw {i}: {({k: v for k, v in d.items() if k != 'masks'})}, masks {sorted(d['masks'])}"
        out = ak.attention(q, k, v, case.attnkit_mechanism(ak), backend=route, scale=d["scale"], **call,
                           **d["masks"])
        expected, _ = ref_attention(q, k, v, case.ref_mechanism, scale=d["scale"], **ref, **d["masks"])
        torch.testing.assert_close(
            out, expected, atol=1e-10, rtol=1e-8, msg=lambda m, where=where: f"{where}: out: {m}"
        )
        grad = torch.randn(out.shape, generator=g, dtype=out.dtype)
        mine = torch.autograd.grad((out * grad).sum(), inputs)
        theirs = torch.autograd.grad((expected * grad).sum(), inputs)
        for name, a, b in zip("qkvu", mine, theirs):
            torch.testing.assert_close(
                a, b, atol=1e-9, rtol=1e-7, msg=lambda m, name=name, where=where: f"{where}: d{name}: {m}"
            )
