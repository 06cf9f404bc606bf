"""``kernels/dispatch.py``: the one route table and chooser; ``ak.attention`` takes the route
``ak.explain_dispatch`` names, and the reason says why."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit import functional
from attnkit.kernels import dispatch
from tests._reference import random_qkv


def _padded(B, L):
    return torch.arange(L)[None, :] < torch.tensor([L, L // 2] * (B // 2))[:, None]  # (B, L)


CALLS = {
    "dnas-padded": (dict(B=2, L=8), "dnas", dict(padded=True), {}),
    "softmax-large": (dict(B=1, L=160), "softmax", {}, {}),
    "softmax-small": (dict(B=1, L=8), "softmax", {}, {}),
    "coda-small": (dict(B=2, L=8), "coda", dict(padded=True), {}),
    "sinkhorn-pair-large": (dict(B=1, L=160), "sinkhorn", dict(pair=True), {}),
    "hnas-weights": (dict(B=2, L=8), "hnas", dict(padded=True), dict(return_weights=True)),
    "dnas-dropout": (dict(B=2, L=8), "dnas", dict(padded=True), dict(dropout_p=0.1)),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_attention_takes_the_route_explain_dispatch_names(name, monkeypatch):
    shape, mechanism, masks, extra = CALLS[name]
    q, k, v = random_qkv(shape["B"], 2, shape["L"], shape["L"], D=4, Dv=4, seed=0, dtype=torch.float32)
    kw = {}
    if masks.get("padded"):
        kw["key_mask"] = kw["query_mask"] = _padded(shape["B"], shape["L"])
    if masks.get("pair"):
        kw["attn_mask"] = torch.rand(shape["L"], shape["L"], generator=torch.Generator().manual_seed(0)) < 0.9
        kw["attn_mask"][:, 0] = True
    plan = ak.explain_dispatch(q, k, v, mechanism, **kw, **extra)
    taken = []
    real = functional.run_route

    def spy(route, *args, **kwargs):
        taken.append(route)
        return real(route, *args, **kwargs)

    monkeypatch.setattr(functional, "run_route", spy)
    ak.attention(q, k, v, mechanism, **kw, **extra)
    assert (taken[0] if taken else "reference") == plan.route
    assert plan.reason and str(plan).startswith(plan.route + ": ")


def test_routes_follow_the_spec_order_and_say_why_one_was_skipped(monkeypatch):
    q, k, v = random_qkv(2, 2, 6, 6, D=4, Dv=4, seed=1, dtype=torch.float32)
    km = _padded(2, 6)
    assert ak.explain_dispatch(q, k, v, "dnas", key_mask=km, backend="efficient").route == "cpp"
    monkeypatch.setattr(dispatch, "fused_cpu_available", lambda q: False)
    plan = ak.explain_dispatch(q, k, v, "dnas", key_mask=km, backend="efficient")
    assert plan.route == "aten" and "not cpp" in plan.reason
    plan = ak.explain_dispatch(q, k, v, "sinkhorn", key_mask=km, backend="efficient")
    assert plan.route == "blockwise" and "not cpp" in plan.reason  # the ATen fallback runs one round only


def test_efficient_backend_refuses_dropout_where_the_route_cannot_replay_it():
    q, k, v = random_qkv(1, 2, 4, 4, seed=0)
    pair = torch.rand(4, 4, generator=torch.Generator().manual_seed(0)) < 0.8  # a general mask: block sweeps
    pair[:, 0] = True
    with pytest.raises(ValueError, match="dropout_p=0.1 is not supported by backend='efficient'"):
        ak.explain_dispatch(q, k, v, "dnas", attn_mask=pair, dropout_p=0.1, backend="efficient")
    plan = ak.explain_dispatch(q, k, v, "dnas", attn_mask=pair, dropout_p=0.1)
    assert plan.route == "reference"  # auto falls back
    assert ak.explain_dispatch(q, k, v, "dnas", dropout_p=0.1).route == "cpp"  # the C++ kernels replay it


def test_softmax_dropout_refusal_names_the_route_not_a_causal_mask_it_was_not_given():
    """A learned float bias sends softmax to the blockwise kernel: the refusal said "with causal=True"."""
    q, k, v = random_qkv(1, 2, 4, 4, seed=0)
    bias = torch.randn(1, 2, 4, 4, dtype=q.dtype).requires_grad_()
    with pytest.raises(ValueError, match="for softmax with these masks \\(the blockwise route") as exc:
        ak.explain_dispatch(q, k, v, "softmax", attn_mask=bias, dropout_p=0.1, backend="efficient")
    assert "causal" not in str(exc.value)


def test_explain_dispatch_takes_and_checks_scale_as_attention_does():
    q, k, v = random_qkv(1, 2, 4, 4, seed=0)
    assert ak.explain_dispatch(q, k, v, "dnas", scale=0.1).route == ak.explain_dispatch(q, k, v, "dnas").route
    with pytest.raises(ValueError, match="scale"):
        ak.explain_dispatch(q, k, v, "dnas", scale=float("nan"))


def test_every_route_is_reachable_from_some_spec():
    from attnkit.registry import SPECS

    assert {r for spec in SPECS.values() for r in spec.routes} == set(dispatch.ROUTES)


def test_sdpa_gets_no_mask_for_masks_without_a_false(monkeypatch):
    """All-True CPU key/query masks are no masks to SDPA: its unmasked kernel, no masked copy of the output
    (the same values as the call without masks); a mask with a False still reaches it."""
    seen = []
    real = dispatch.F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, **kw):
        seen.append(attn_mask)
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(dispatch.F, "scaled_dot_product_attention", sdpa)
    q, k, v = random_qkv(2, 2, 160, 160, 8, dtype=torch.float64)
    full = torch.ones(2, 160, dtype=torch.bool)
    out = ak.attention(q, k, v, "softmax", key_mask=full, query_mask=full, backend="efficient")
    assert seen == [None]
    torch.testing.assert_close(out, ak.attention(q, k, v, "softmax", backend="efficient"), rtol=0, atol=0)
    pair = torch.rand(160, 160, generator=torch.Generator().manual_seed(0)) < 0.9
    ak.attention(q, k, v, "softmax", key_mask=full, attn_mask=pair, backend="efficient")
    assert seen[-1] is not None and seen[-1].shape[-2:] == (160, 160)
