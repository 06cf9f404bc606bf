"""ak.nn.MultiheadAttention: torch equivalence for softmax, every mechanism against float64 references,
query padding, state_dict compatibility, the learnable hybrid weight and argument validation."""

from __future__ import annotations

import copy

import warnings

import numpy as np
import pytest
import torch

import attnkit as ak
import attnkit.nn as aknn
from tests._reference import ref_weights

E, H = 8, 2
MECHANISMS = [
    "softmax",
    "dnas",
    "hnas",
    "sinkhorn",
    "coda",
    ak.CoDA(gate="centered", center_e=True),
    ak.Sinkhorn(iters=7),
]
QUERY_NORMALIZED = ["dnas", "hnas", "sinkhorn"]


def _pair(seed: int = 0, **kwargs) -> tuple[torch.nn.MultiheadAttention, aknn.MultiheadAttention]:
    torch.manual_seed(seed)
    theirs = torch.nn.MultiheadAttention(E, H, dtype=torch.float64, **kwargs)
    ours = aknn.MultiheadAttention(E, H, dtype=torch.float64, **kwargs)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def _inputs(B=3, Lq=5, Lk=4, kdim=E, vdim=E, batch_first=True, seed=1):
    g = torch.Generator().manual_seed(seed)
    shape = (lambda L, d: (B, L, d)) if batch_first else (lambda L, d: (L, B, d))
    q = torch.randn(*shape(Lq, E), generator=g, dtype=torch.float64)
    k = torch.randn(*shape(Lk, kdim), generator=g, dtype=torch.float64)
    v = torch.randn(*shape(Lk, vdim), generator=g, dtype=torch.float64)
    return q, k, v


def _masks(kind: str, B=3, Lq=5, Lk=4):
    """torch-convention masks; key 0 is always allowed so that no row is fully masked."""
    g = torch.Generator().manual_seed(2)
    kpm = torch.zeros(B, Lk, dtype=torch.bool)
    kpm[1, 2:] = True
    kpm[2, 1] = True
    am = torch.rand(Lq, Lk, generator=g) < 0.4
    am[:, 0] = False
    if kind == "none":
        return {}
    if kind == "bool_kpm":
        return {"key_padding_mask": kpm}
    if kind == "float_kpm":
        return {"key_padding_mask": torch.zeros(B, Lk, dtype=torch.float64).masked_fill(kpm, float("-inf"))}
    if kind == "bool_attn":
        return {"attn_mask": am}
    if kind == "float_attn_3d":
        bias = torch.randn(B * H, Lq, Lk, generator=g, dtype=torch.float64)
        bias[:, :, 1] = float("-inf")
        return {"attn_mask": bias}
    if kind == "both":
        return {"key_padding_mask": kpm, "attn_mask": am}
    if kind == "mixed":
        return {"key_padding_mask": kpm, "attn_mask": torch.randn(Lq, Lk, generator=g, dtype=torch.float64)}
    raise ValueError(kind)


OPTIONS = {
    "plain": {},
    "bias_kv": {"add_bias_kv": True},
    "zero_attn": {"add_zero_attn": True},
    "kdim_vdim": {"kdim": 6, "vdim": 3},
    "no_bias": {"bias": False},
    "seq_first": {"batch_first": False},
    "all": {"add_bias_kv": True, "add_zero_attn": True, "kdim": 6, "vdim": 3},
}


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@pytest.mark.parametrize(
    "mask_kind", ["none", "bool_kpm", "float_kpm", "bool_attn", "float_attn_3d", "both", "mixed"]
)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_softmax_matches_torch(option, mask_kind):
    opts = {"batch_first": True, **OPTIONS[option]}
    theirs, ours = _pair(**opts)
    theirs.train(), ours.train()  # dropout=0 in training mode must still agree
    q, k, v = _inputs(kdim=opts.get("kdim", E), vdim=opts.get("vdim", E), batch_first=opts["batch_first"])
    masks = _masks(mask_kind)
    for average in (True, False):
        out_t, w_t = theirs(q, k, v, average_attn_weights=average, **masks)
        out_o, w_o = ours(q, k, v, average_attn_weights=average, **masks)
        torch.testing.assert_close(out_o, out_t, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(w_o, w_t, rtol=1e-10, atol=1e-12)
    out_t, none_t = theirs(q, k, v, need_weights=False, **masks)
    out_o, none_o = ours(q, k, v, need_weights=False, **masks)
    assert none_t is None and none_o is None
    torch.testing.assert_close(out_o, out_t, rtol=1e-10, atol=1e-12)


def test_softmax_self_attention_with_padding_matches_torch_everywhere():
    theirs, ours = _pair(batch_first=True)
    x, _, _ = _inputs(Lk=5)
    kpm = torch.tensor([[False] * 5, [False, False, False, True, True], [False] * 4 + [True]])
    out_t, w_t = theirs(x, x, x, key_padding_mask=kpm)
    out_o, w_o = ours(x, x, x, key_padding_mask=kpm)
    torch.testing.assert_close(out_o, out_t, rtol=1e-10, atol=1e-12)  # padded queries too
    torch.testing.assert_close(w_o, w_t, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("three_d_mask", [False, True])
def test_unbatched_matches_torch(three_d_mask):
    theirs, ours = _pair(batch_first=True, add_zero_attn=True)
    q, k, v = (t[0] for t in _inputs())
    kpm = torch.tensor([False, True, False, False])
    am = torch.zeros(H, 5, 4, dtype=torch.bool) if three_d_mask else torch.zeros(5, 4, dtype=torch.bool)
    am[..., 2] = True
    out_t, w_t = theirs(q, k, v, key_padding_mask=kpm, attn_mask=am, average_attn_weights=False)
    out_o, w_o = ours(q, k, v, key_padding_mask=kpm, attn_mask=am, average_attn_weights=False)
    assert out_o.shape == (5, E) and w_o.shape == (H, 5, 5)
    torch.testing.assert_close(out_o, out_t, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w_o, w_t, rtol=1e-10, atol=1e-12)


def test_is_causal_matches_torch_causal_mask():
    theirs, ours = _pair(batch_first=True)
    x, _, _ = _inputs(Lk=5)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)
    out_t, w_t = theirs(x, x, x, attn_mask=causal, is_causal=True)
    out_o, w_o = ours(x, x, x, is_causal=True)
    torch.testing.assert_close(out_o, out_t, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w_o, w_t, rtol=1e-10, atol=1e-12)


def _manual_mha(module: aknn.MultiheadAttention, x_q, x_k, mechanism, **ref_kwargs):
    """Float64 reference: project with the module's weights, normalize with tests._reference, project out."""
    B, Lq, _ = x_q.shape
    Lk = x_k.shape[1]
    w_q, w_k, w_v = module.in_proj_weight.chunk(3)
    b_q, b_k, b_v = module.in_proj_bias.chunk(3)
    q = (x_q @ w_q.T + b_q).view(B, Lq, H, E // H).transpose(1, 2)  # (B, H, Lq, D)
    k = (x_k @ w_k.T + b_k).view(B, Lk, H, E // H).transpose(1, 2)  # (B, H, Lk, D)
    v = (x_k @ w_v.T + b_v).view(B, Lk, H, E // H).transpose(1, 2)  # (B, H, Lk, D)
    w = ref_weights(q, k, mechanism, **ref_kwargs)  # (B, H, Lq, Lk)
    out = (w @ v).transpose(1, 2).reshape(B, Lq, E)  # (B, Lq, E)
    return module.out_proj(out), w


@pytest.mark.parametrize("mechanism", ["dnas", "hnas", "sinkhorn", "coda"])
def test_mechanism_matches_float64_reference(mechanism):
    torch.manual_seed(0)
    module = aknn.MultiheadAttention(E, H, mechanism=mechanism, dtype=torch.float64, batch_first=True)
    if mechanism == "hnas":
        with torch.no_grad():
            module.theta.copy_(torch.tensor([-1.0, 2.0]))
    x, y, _ = _inputs(Lq=5, Lk=6)
    kpm = torch.zeros(3, 6, dtype=torch.bool)
    kpm[1, 4:] = True
    out, w = module(x, y, y, key_padding_mask=kpm, average_attn_weights=False)
    u = torch.sigmoid(torch.tensor([-1.0, 2.0], dtype=torch.float64))
    ref_out, ref_w = _manual_mha(module, x, y, mechanism, key_mask=~kpm, u=u)
    torch.testing.assert_close(w, ref_w, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-12)


def _padded_batch(lengths, L, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(lengths), L, E, generator=g, dtype=torch.float64)
    pad = torch.arange(L)[None, :] >= torch.tensor(lengths)[:, None]  # (B, L) True = padding
    return x, pad


@pytest.mark.parametrize("mechanism", MECHANISMS, ids=str)
def test_padding_equals_truncation(mechanism, backend):
    torch.manual_seed(0)
    module = aknn.MultiheadAttention(
        E, H, mechanism=mechanism, dtype=torch.float64, backend=backend, batch_first=True
    )
    lengths = [6, 3, 4]
    x, pad = _padded_batch(lengths, 6)
    out, _ = module(x, x, x, key_padding_mask=pad, need_weights=False)
    for b, n in enumerate(lengths):
        alone, _ = module(x[b : b + 1, :n], x[b : b + 1, :n], x[b : b + 1, :n], need_weights=False)
        torch.testing.assert_close(out[b : b + 1, :n], alone, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED)
@pytest.mark.parametrize("learned", [False, True])
def test_a_float_key_padding_mask_with_biases_pads_the_queries_too(mechanism, learned):
    """A float key_padding_mask holding finite biases beside its -inf (or one that requires grad) stayed
    float, and the padded queries entered the column sums: real tokens moved by up to 0.027."""
    torch.manual_seed(0)
    module = aknn.MultiheadAttention(E, H, mechanism=mechanism, dtype=torch.float64, batch_first=True)
    lengths = [6, 3, 4]
    x, pad = _padded_batch(lengths, 6)
    bias = torch.zeros(3, 6, dtype=torch.float64).masked_fill(pad, float("-inf"))
    bias[:, 1] = -0.5  # a finite bias on a real key
    bias.requires_grad_(learned)
    out, _ = module(x, x, x, key_padding_mask=bias, need_weights=False)
    for b, n in enumerate(lengths):
        alone, _ = module(x[b : b + 1, :n], x[b : b + 1, :n], x[b : b + 1, :n],
                          key_padding_mask=bias[b : b + 1, :n], need_weights=False)
        torch.testing.assert_close(out[b : b + 1, :n], alone, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED)
def test_padding_equals_truncation_when_query_and_key_are_views_of_one_tensor(mechanism):
    """``m(x.transpose(0, 1), x.transpose(0, 1), ...)`` (batch-first data, a sequence-first module) was read
    as cross-attention: the padded queries entered the column sums and real tokens moved by 0.03."""
    torch.manual_seed(0)
    module = aknn.MultiheadAttention(E, H, mechanism=mechanism, dtype=torch.float64)  # batch_first=False
    lengths = [6, 3, 4]
    x, pad = _padded_batch(lengths, 6)
    out, _ = module(x.transpose(0, 1), x.transpose(0, 1), x.transpose(0, 1), key_padding_mask=pad,
                    need_weights=False)  # three views, not one object
    for b, n in enumerate(lengths):
        alone = x[b : b + 1, :n].transpose(0, 1)
        torch.testing.assert_close(out[:n, b : b + 1], module(alone, alone, alone, need_weights=False)[0],
                                   rtol=1e-9, atol=1e-11)
    shifted = x.transpose(0, 1)[1:]  # another view with other elements stays cross-attention
    assert not aknn.module_utils.same_tensor(x.transpose(0, 1)[:-1], shifted)


@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED + ["coda"])
def test_explicit_query_padding_equals_truncation_in_cross_attention(mechanism):
    torch.manual_seed(0)
    module = aknn.MultiheadAttention(E, H, mechanism=mechanism, dtype=torch.float64, batch_first=True)
    xq, qpad = _padded_batch([5, 2], 5, seed=4)
    xk, kpad = _padded_batch([3, 4], 4, seed=5)
    out, w = module(xq, xk, xk, key_padding_mask=kpad, query_padding_mask=qpad)
    assert torch.all(w[1, 2:] == 0), "padded queries must carry no weight"
    for b, (nq, nk) in enumerate([(5, 3), (2, 4)]):
        alone, _ = module(xq[b : b + 1, :nq], xk[b : b + 1, :nk], xk[b : b + 1, :nk])
        torch.testing.assert_close(out[b : b + 1, :nq], alone, rtol=1e-9, atol=1e-11)


def test_padded_queries_change_dnas_columns_without_query_mask():
    """The failure the query mask prevents: in cross-attention without it, padding leaks into real rows."""
    torch.manual_seed(0)
    module = aknn.MultiheadAttention(E, H, mechanism="dnas", dtype=torch.float64, batch_first=True)
    xq, qpad = _padded_batch([2], 5, seed=4)
    xk = torch.randn(1, 4, E, dtype=torch.float64)
    leaky, _ = module(xq, xk, xk)
    alone, _ = module(xq[:, :2], xk, xk)
    assert not torch.allclose(leaky[:, :2], alone)
    masked, _ = module(xq, xk, xk, query_padding_mask=qpad)
    torch.testing.assert_close(masked[:, :2], alone, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED)
def test_causal_raises_for_query_normalized(mechanism):
    module = aknn.MultiheadAttention(E, H, mechanism=mechanism, batch_first=True)
    x = torch.randn(2, 4, E)
    with pytest.raises(ValueError, match="future-token leak"):
        module(x, x, x, is_causal=True)


def test_fully_masked_query_gets_zeros_not_nan():
    _, ours = _pair(batch_first=True)
    q, k, v = _inputs()
    am = torch.zeros(5, 4, dtype=torch.bool)
    am[2] = True  # query 2 may attend to nothing
    out, w = ours(q, k, v, attn_mask=am)
    assert torch.isfinite(out).all()
    assert torch.all(w[:, 2] == 0)
    torch.testing.assert_close(out[:, 2], ours.out_proj.bias.expand(3, E))


@pytest.mark.parametrize("kwargs", [{}, {"kdim": 6, "vdim": 3}, {"add_bias_kv": True, "bias": False}])
def test_torch_state_dict_loads_and_hnas_adds_only_theta(kwargs):
    theirs = torch.nn.MultiheadAttention(E, H, batch_first=True, **kwargs)
    softmax = aknn.MultiheadAttention(E, H, **kwargs, batch_first=True)
    softmax.load_state_dict(theirs.state_dict())  # strict
    assert set(softmax.state_dict()) == set(theirs.state_dict())
    hnas = aknn.MultiheadAttention(E, H, mechanism="hnas", u0=0.3, **kwargs, batch_first=True)
    result = hnas.load_state_dict(theirs.state_dict())  # strict: theta, torch's lack, keeps logit(u0)
    assert result.missing_keys == [] and result.unexpected_keys == []
    torch.testing.assert_close(hnas.u, torch.full((H,), 0.3))
    assert set(hnas.state_dict()) - set(theirs.state_dict()) == {"theta"}
    for name, tensor in theirs.state_dict().items():
        torch.testing.assert_close(hnas.state_dict()[name], tensor)


@pytest.mark.parametrize("build", ["multihead", "transformer", "content"])
def test_a_meta_built_hnas_module_gets_u0_from_a_load_without_theta(build, monkeypatch):
    """Built on the meta device, given memory by to_empty() and loaded strictly from a torch state_dict:
    "All keys matched" and theta kept what was in memory (u 0 on some heads, NaN outputs for a NaN); with
    assign=True theta stayed on meta ("hybrid_weight is on meta")."""
    def make():
        if build == "multihead":
            return aknn.MultiheadAttention(E, H, mechanism="hnas", u0=0.3, batch_first=True)
        if build == "transformer":
            return aknn.Transformer(E, H, 1, 1, 16, dropout=0.0, batch_first=True,
                                    encoder_mechanism=ak.Hybrid(u0=0.3))
        return aknn.AdditiveAttention(E, E, E, mechanism=ak.Hybrid(u0=0.3))

    torch.manual_seed(0)
    reference = make()
    weights = {k: v for k, v in reference.state_dict().items() if not k.endswith("theta")}
    with torch.device("meta"):
        empty = make()
    with monkeypatch.context() as m:  # the memory to_empty() gives holds NaN
        m.setattr(torch, "empty_like", lambda t, **kw: torch.full_like(t, float("nan"), **kw))
        empty.to_empty(device="cpu")
    assert empty.load_state_dict(weights).missing_keys == []
    with torch.device("meta"):
        assigned = make()
    assigned.load_state_dict(weights, assign=True)
    for model in (empty, assigned):
        thetas = [p for n, p in model.named_parameters() if n.endswith("theta")]
        assert thetas and all(t.device.type == "cpu" for t in thetas)
        u = torch.sigmoid(torch.cat(thetas).detach())
        torch.testing.assert_close(u, torch.full_like(u, 0.3))
    with torch.device("meta"):  # a value set in place after to_empty() is the user's: kept
        chosen = make()
    chosen.to_empty(device="cpu")
    with torch.no_grad():
        for n, p in chosen.named_parameters():
            if n.endswith("theta"):
                torch.nn.init.constant_(p, 2.0)
    # the second look: the user's value survives a deepcopy and the conversion flags; a second to_empty()
    # gives u0 again (its memory was whatever it was, with the version counter of the first)
    copied = copy.deepcopy(chosen)
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        converted = copy.deepcopy(chosen).double().float()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    again = copy.deepcopy(chosen)
    with monkeypatch.context() as m:
        m.setattr(torch, "empty_like", lambda t, **kw: torch.full_like(t, float("nan"), **kw))
        again.to_empty(device="cpu")
    users = float(torch.sigmoid(torch.tensor(2.0)))
    for model, expected in ((chosen, users), (copied, users), (converted, users), (again, 0.3)):
        model.load_state_dict(weights)
        u = torch.sigmoid(torch.cat([p.detach() for n, p in model.named_parameters() if n.endswith("theta")]))
        torch.testing.assert_close(u, torch.full_like(u, expected))
    trained = make()  # a module with values keeps them, as documented
    with torch.no_grad():
        next(p for n, p in trained.named_parameters() if n.endswith("theta")).fill_(2.0)
    trained.load_state_dict(weights)
    assert next(p for n, p in trained.named_parameters() if n.endswith("theta")).eq(2.0).all()


def test_hnas_state_dict_with_theta_loads_theta():
    trained = aknn.MultiheadAttention(E, H, mechanism="hnas", u0=0.8, batch_first=True)
    fresh = aknn.MultiheadAttention(E, H, mechanism="hnas", u0=0.3, batch_first=True)
    fresh.load_state_dict(trained.state_dict())
    torch.testing.assert_close(fresh.u, torch.full((H,), 0.8))
    softmax = aknn.MultiheadAttention(E, H, batch_first=True)
    with pytest.raises(RuntimeError, match="theta"):  # a theta where the module has none stays an error
        softmax.load_state_dict(trained.state_dict())


@pytest.mark.parametrize("value, expected", [(True, True), (1, True), (0, False), (None, False),
                                             (np.bool_(True), True)])
def test_need_weights_takes_what_torch_takes(value, expected):
    ours = aknn.MultiheadAttention(E, H, mechanism="dnas", batch_first=True).double()
    q, k, v = _inputs()
    assert (ours(q, k, v, need_weights=value)[1] is not None) == expected
    ours(q, k, v, average_attn_weights=value)


@pytest.mark.parametrize("value", ["False", 2, 0.5, torch.ones(2)], ids=repr)
@pytest.mark.parametrize("name", ["need_weights", "average_attn_weights"])
def test_flag_that_torch_would_misread_is_refused_naming_it(name, value):
    ours = aknn.MultiheadAttention(E, H, mechanism="dnas", batch_first=True).double()
    q, k, v = _inputs()
    with pytest.raises(ValueError, match=f"^{name}="):
        ours(q, k, v, **{name: value})


def test_ours_loads_into_torch():
    ours = aknn.MultiheadAttention(E, H, mechanism="dnas", kdim=5, batch_first=True)
    theirs = torch.nn.MultiheadAttention(E, H, kdim=5, batch_first=True)
    theirs.load_state_dict(ours.state_dict())
    assert torch.equal(theirs.k_proj_weight, ours.k_proj_weight)


def test_init_matches_torch_scheme():
    torch.manual_seed(5)
    theirs = torch.nn.MultiheadAttention(E, H, add_bias_kv=True, batch_first=True)
    torch.manual_seed(5)
    ours = aknn.MultiheadAttention(E, H, add_bias_kv=True, batch_first=True)
    for name, tensor in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[name], tensor, msg=name)


def test_gradients_reach_theta():
    module = aknn.MultiheadAttention(E, H, mechanism="hnas", batch_first=True)
    x = torch.randn(2, 5, E)
    pad = torch.tensor([[False] * 5, [False, False, False, True, True]])
    out, _ = module(x, x, x, key_padding_mask=pad)
    (out[:, :3] ** 2).sum().backward()
    assert module.theta.grad is not None and module.theta.grad.shape == (H,)
    assert torch.isfinite(module.theta.grad).all() and (module.theta.grad.abs() > 0).all()


@pytest.mark.parametrize(
    "kwargs, expected",
    [({}, 0.5), ({"u0": 0.1}, 0.1), ({"mechanism": ak.Hybrid(u0=0.25)}, 0.25),
     ({"mechanism": ak.Hybrid(u0=0.25), "u0": 0.25}, 0.25)],
)
def test_u_starts_at_u0(kwargs, expected):
    module = aknn.MultiheadAttention(E, 4, **{"mechanism": "hnas", **kwargs}, batch_first=True)
    torch.testing.assert_close(module.u, torch.full((4,), expected))
    assert not module.u.requires_grad
    module.reset_parameters()
    torch.testing.assert_close(module.u, torch.full((4,), expected))


@pytest.mark.parametrize("mechanism", ["softmax", "dnas", "coda"])
def test_u_of_another_mechanism_is_an_attribute_error(mechanism):
    """``hasattr(module, "u")`` / ``getattr(module, "u", None)`` probing (module walks, tracers) must not
    raise: it was a ValueError."""
    for module in (aknn.MultiheadAttention(E, 4, mechanism=mechanism),
                   aknn.MultiViewAttention(E, num_views=2, num_heads=4, mechanism=mechanism)):
        assert not hasattr(module, "u") and getattr(module, "u", None) is None
        with pytest.raises(AttributeError, match=f"only for mechanism 'hnas'.*uses '{mechanism}'"):
            module.u
    assert hasattr(aknn.MultiheadAttention(E, 4, mechanism="hnas"), "u")


def test_dropout_only_in_training():
    torch.manual_seed(0)
    module = aknn.MultiheadAttention(E, H, mechanism="dnas", dropout=0.5, batch_first=True)
    x = torch.randn(2, 5, E)
    module.eval()
    first, _ = module(x, x, x)
    second, _ = module(x, x, x)
    assert torch.equal(first, second)
    module.train()
    dropped, w = module(x, x, x, average_attn_weights=False)
    assert not torch.allclose(dropped, first)
    assert (w == 0).any()


def test_extra_repr_names_the_mechanism():
    assert "embed_dim=384, num_heads=12, mechanism=hnas" in repr(
        aknn.MultiheadAttention(384, 12, mechanism="hnas")
    )
    assert "mechanism=Sinkhorn(iters=5)" in repr(
        aknn.MultiheadAttention(8, 2, mechanism=ak.Sinkhorn(iters=5))
    )


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"embed_dim": 10, "num_heads": 3}, "embed_dim=10"),
        ({"mechanism": "hnas", "u0": 1.5}, "1.5"),
        ({"mechanism": "hnas", "u0": 0.0}, "u0=0.0"),
        ({"mechanism": "hnas", "u0": 1.0}, "u0=1.0"),
        ({"mechanism": ak.Hybrid(u0=0.2), "u0": 0.3}, "u0=0.3"),
        ({"mechanism": "softmax", "u0": 0.3}, "u0=0.3"),
        ({"mechanism": "bogus"}, "bogus"),
        ({"dropout": 1.0}, "dropout=1.0"),
        ({"backend": "fast"}, "fast"),
        ({"kdim": 0}, "kdim=0"),
        ({"vdim": 2.0}, "vdim=2.0"),
        ({"batch_first": "yes"}, "batch_first='yes'; expected True or False"),
        ({"add_zero_attn": None}, "add_zero_attn=None"),
        ({"dropout": float("nan")}, "dropout=nan"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_value(kwargs, needle):
    args = {"embed_dim": E, "num_heads": H, **kwargs}
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        aknn.MultiheadAttention(**args)


@pytest.mark.parametrize(
    "call, needle",
    [
        (lambda m, x: m(x, x[:, :, :4], x[:, :, :4]), r"last dimension 8"),
        (lambda m, x: m(x, x, x, key_padding_mask=torch.zeros(2, 3, dtype=torch.bool)), r"\(2, 3\)"),
        (lambda m, x: m(x, x, x, attn_mask=torch.zeros(4, 5, dtype=torch.bool)), r"\(4, 5\)"),
        (lambda m, x: m(x, x, x, key_padding_mask=torch.zeros(2, 5, dtype=torch.long)), "torch.int64"),
        (lambda m, x: m(x, x, x[:1]), "value"),
        (
            lambda m, x: m(torch.nested.nested_tensor([x[0], x[1, :3]]), x, x),
            "query is a nested tensor; pad it",
        ),
        (
            lambda m, x: m(*(torch.nested.nested_tensor([x[0], x[1, :3]]),) * 3,
                           key_padding_mask=torch.zeros(2, 5, dtype=torch.bool)),
            "nested input carries its own lengths",
        ),
    ],
)
def test_bad_inputs_raise_value_error(call, needle):
    module = aknn.MultiheadAttention(E, H, batch_first=True)
    with pytest.raises(ValueError, match=needle):
        call(module, torch.randn(2, 5, E))


def test_efficient_backend_refuses_need_weights():
    module = aknn.MultiheadAttention(E, H, mechanism="dnas", backend="efficient", batch_first=True)
    x = torch.randn(2, 5, E)
    with pytest.raises(ValueError, match="need_weights=False"):
        module(x, x, x)
    out, weights = module(x, x, x, need_weights=False)
    assert weights is None and out.shape == (2, 5, E)


# -- drop-in: torch's defaults, layouts and every option ---------------------------------------------------

def test_signature_and_defaults_match_torch():
    import inspect

    for method in ("__init__", "forward"):
        theirs = inspect.signature(getattr(torch.nn.MultiheadAttention, method)).parameters
        ours = inspect.signature(getattr(aknn.MultiheadAttention, method)).parameters
        assert list(ours)[: len(theirs)] == list(theirs), method  # same names, same positions
        for name, param in theirs.items():
            assert ours[name].default == param.default, (method, name)
            if param.kind is not inspect.Parameter.KEYWORD_ONLY:
                assert ours[name].kind is param.kind, (method, name)
    assert aknn.MultiheadAttention(E, H).batch_first is False
    assert aknn.TransformerEncoderLayer(E, H).self_attn.batch_first is False
    assert aknn.TransformerDecoderLayer(E, H).multihead_attn.batch_first is False


DROP_IN_OPTIONS = {k: v for k, v in OPTIONS.items() if k != "seq_first"}
DROP_IN_MASKS = ["none", "bool_kpm", "float_kpm", "bool_attn", "float_attn_3d", "both", "mixed", "causal"]


def _drop_in_masks(kind: str, layout: str, Lq: int, Lk: int):
    if kind == "causal":  # torch takes is_causal as a hint and needs the causal mask itself
        return {"attn_mask": torch.nn.Transformer.generate_square_subsequent_mask(Lq, dtype=torch.float64),
                "is_causal": True}
    masks = _masks(kind, Lq=Lq, Lk=Lk)
    if layout == "unbatched":
        masks = {n: (m[0] if n == "key_padding_mask" or m.dim() == 3 and m.shape[0] == 3 * H else m)
                 for n, m in masks.items()}
        if "attn_mask" in masks and masks["attn_mask"].dim() == 3:
            masks["attn_mask"] = masks["attn_mask"][:H]  # (H, Lq, Lk) for one sequence
    return masks


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@pytest.mark.filterwarnings("ignore:Converting mask without torch.bool dtype")
@pytest.mark.parametrize("mask_kind", DROP_IN_MASKS)
@pytest.mark.parametrize("option", list(DROP_IN_OPTIONS))
@pytest.mark.parametrize("layout", ["default", "batch_first", "unbatched"])
def test_drop_in_equals_torch_outputs_and_weights(layout, option, mask_kind):
    """Built with the same arguments as torch's module (its defaults: sequence-first), loaded with its
    state_dict and called the same way, the softmax module returns the same outputs and weights."""
    opts = dict(DROP_IN_OPTIONS[option])
    if layout == "batch_first":
        opts["batch_first"] = True
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(E, H, dtype=torch.float64, **opts)
    ours = aknn.MultiheadAttention(E, H, dtype=torch.float64, **opts)
    ours.load_state_dict(theirs.state_dict())
    Lq, Lk = 5, (5 if mask_kind == "causal" else 4)
    q, k, v = _inputs(Lq=Lq, Lk=Lk, kdim=opts.get("kdim", E), vdim=opts.get("vdim", E),
                      batch_first=layout != "default")
    if layout == "unbatched":
        q, k, v = q[0], k[0], v[0]  # (L, E)
    masks = _drop_in_masks(mask_kind, layout, Lq, Lk)
    for call in ({}, {"average_attn_weights": False}, {"need_weights": False}):
        hint_dropped = call.get("need_weights") is False and masks.get("is_causal") and (
            opts.get("add_bias_kv") or opts.get("add_zero_attn"))
        # torch 2.13 drops attn_mask for the is_causal hint without weights, and SDPA's top-left causal mask
        # then also hides the appended bias/zero key: its result with the mask alone is the reference.
        theirs_masks = {n: m for n, m in masks.items() if n != "is_causal"} if hint_dropped else masks
        out_t, w_t = theirs(q, k, v, **call, **theirs_masks)
        out_o, w_o = ours(q, k, v, **call, **masks)
        assert out_o.shape == out_t.shape
        torch.testing.assert_close(out_o, out_t, rtol=1e-10, atol=1e-12)
        if w_t is None:
            assert w_o is None
        else:
            assert w_o.shape == w_t.shape
            torch.testing.assert_close(w_o, w_t, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED + ["coda"])
@pytest.mark.parametrize("blocked", [-1e9, torch.finfo(torch.float64).min])
def test_a_float_key_padding_mask_of_large_negatives_masks_like_a_boolean_one(mechanism, blocked):
    torch.manual_seed(0)
    module = aknn.MultiheadAttention(E, H, mechanism=mechanism, batch_first=True, dtype=torch.float64)
    x, _, _ = _inputs(B=2, Lq=5, Lk=5)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])  # True = padding
    as_bool, w_bool = module(x, x, x, key_padding_mask=pad)
    additive = torch.zeros(2, 5, dtype=torch.float64).masked_fill(pad, blocked)
    as_float, w_float = module(x, x, x, key_padding_mask=additive)
    assert torch.all(w_float[1, :, 3:] == 0)
    torch.testing.assert_close(as_float, as_bool, rtol=0, atol=0)
    torch.testing.assert_close(w_float, w_bool, rtol=0, atol=0)


def test_a_learned_attn_mask_that_starts_at_zero_gets_torchs_gradient():
    """An all-zero float mask was turned into a boolean one, which cut the gradient of a learned bias
    (a relative-position bias initialized to zeros never trained)."""
    theirs, ours = _pair(batch_first=True)
    x, _, _ = _inputs(B=2, Lq=5, Lk=5)
    for name, shape in (("attn_mask", (5, 5)), ("key_padding_mask", (2, 5))):  # a learned key bias too
        grads = []
        for module in (theirs, ours):
            bias = torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64))
            module(x, x, x, need_weights=False, **{name: bias})[0].pow(2).sum().backward()
            grads.append(bias.grad)
        assert grads[1] is not None and grads[1].abs().sum() > 0
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-9, atol=1e-12)
    coda = aknn.MultiheadAttention(E, H, mechanism="coda", batch_first=True, dtype=torch.float64)
    with pytest.raises(ValueError, match="requires grad .*CoDA's masks are multiplicative"):
        coda(x, x, x, attn_mask=torch.nn.Parameter(torch.zeros(5, 5, dtype=torch.float64)))


@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED)
def test_a_causal_attn_mask_raises_for_query_normalized(mechanism):
    module = aknn.MultiheadAttention(E, H, mechanism=mechanism, batch_first=True)
    x = torch.randn(2, 4, E)
    future = torch.ones(4, 4, dtype=torch.bool).triu(1)  # torch: True = not allowed
    with pytest.raises(ValueError, match="causal pattern.*future-token leak"):
        module(x, x, x, attn_mask=future)


@pytest.mark.parametrize("option", ["add_bias_kv", "add_zero_attn"])
def test_a_causal_attn_mask_is_refused_also_with_an_appended_key(option):
    """The appended key is visible to every query, which hid the causal pattern: dnas was accepted and
    changing the last token moved the first output by 7e-2."""
    module = aknn.MultiheadAttention(E, H, mechanism="dnas", batch_first=True, **{option: True})
    x = torch.randn(2, 4, E)
    future = torch.ones(4, 4, dtype=torch.bool).triu(1)
    with pytest.raises(ValueError, match="causal pattern.*future-token leak"):
        module(x, x, x, attn_mask=future)
    module(x, x, x, attn_mask=torch.zeros(4, 4, dtype=torch.bool))  # a bidirectional mask is fine


def test_an_input_of_another_dtype_than_the_parameters_is_one_clear_error():
    module = aknn.MultiheadAttention(E, H, batch_first=True)  # float32
    x = torch.randn(2, 3, E, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"query has dtype torch.float64 but the module's parameters are "
                                         r"torch.float32; cast the input with .to\(torch.float32\)"):
        module(x, x, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast mixes dtypes on purpose
        out, _ = module(x.bfloat16(), x.bfloat16(), x.bfloat16())
    assert out.shape == (2, 3, E)


def test_coda_names_the_additive_mask_it_cannot_take():
    module = aknn.MultiheadAttention(E, H, batch_first=True, mechanism="coda")
    x = torch.randn(1, 3, E)
    with pytest.raises(ValueError, match="key_padding_mask is an additive float mask.*multiplicative"):
        module(x, x, x, key_padding_mask=torch.tensor([[0.0, -1.0, 0.0]]))
    with pytest.raises(ValueError, match="attn_mask is an additive float mask.*multiplicative"):
        module(x, x, x, attn_mask=torch.full((3, 3), -0.5))


# -- inside torch's Transformer layers ----------------------------------------------------------------------


def _torch_encoder(mechanism: str, swap_after_building: bool):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(E, H, 16, dropout=0.0, batch_first=True)
    if not swap_after_building:
        layer.self_attn = aknn.MultiheadAttention(E, H, batch_first=True, mechanism=mechanism)
    with warnings.catch_warnings():  # torch: "use_nested_tensor is False because ..._qkv_same_embed_dim ..."
        warnings.simplefilter("ignore")
        encoder = torch.nn.TransformerEncoder(layer, 2)
    if swap_after_building:  # the encoder decided at construction to nest padded batches
        for built in encoder.layers:
            built.self_attn = aknn.MultiheadAttention(E, H, batch_first=True, mechanism=mechanism)
    return encoder.eval()


@pytest.mark.parametrize("mechanism", ["dnas", "coda", "softmax"])
@pytest.mark.parametrize("swap_after_building", [False, True])
def test_in_torch_encoder_layers_the_mechanism_runs_in_eval_without_grad(mechanism, swap_after_building):
    """torch's TransformerEncoderLayer/Encoder (eval, no grad) take a fused softmax fast path on
    in_proj_weight when self_attn._qkv_same_embed_dim is True (it raised on the missing merge_masks, and would
    have computed softmax), and an encoder built before the swap hands self_attn a nested tensor. Both now
    compute what the same layers compute with gradients on, and padding equals truncation."""
    encoder = _torch_encoder(mechanism, swap_after_building)
    x = torch.randn(2, 5, E, generator=torch.Generator().manual_seed(3))
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[1, 3:] = True
    with_grad = encoder(x, src_key_padding_mask=padding)
    assert with_grad.requires_grad
    with torch.no_grad():
        without = encoder(x, src_key_padding_mask=padding)
        layer_alone = encoder.layers[0](x)
    torch.testing.assert_close(without[~padding], with_grad[~padding], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer_alone, encoder.layers[0](x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(encoder(x[1:, :3])[0], with_grad[1, :3], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("mechanism", ["dnas", "sinkhorn", "coda"])
def test_nested_self_attention_equals_each_sequence_alone(mechanism, batch_first, layout):
    module = aknn.MultiheadAttention(E, H, mechanism=mechanism, batch_first=batch_first, dtype=torch.float64)
    g = torch.Generator().manual_seed(4)
    sequences = [torch.randn(n, E, generator=g, dtype=torch.float64) for n in (5, 2, 4)]
    nested = torch.nested.nested_tensor(sequences, layout=layout)
    out, weights = module(nested, nested, nested)
    assert out.is_nested and out.layout == layout and weights.shape == (3, 5, 5)
    for got, seq in zip(out.unbind(), sequences):
        alone, _ = module(seq, seq, seq)  # unbatched (L, E)
        torch.testing.assert_close(got, alone, rtol=1e-12, atol=1e-12)


class _Doubled(aknn.MultiheadAttention):
    """A subclass whose forward post-processes torch's positional signature (doubles the output)."""

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False, query_padding_mask=None):
        self.calls = getattr(self, "calls", 0) + 1
        out, weights = super().forward(query, key, value, key_padding_mask, need_weights, attn_mask,
                                       average_attn_weights, is_causal, query_padding_mask)
        return out * 2, weights


class _Keywords(aknn.MultiheadAttention):
    """A subclass with a torch-style keyword forward."""

    def forward(self, query, key, value, **kwargs):
        return super().forward(query, key, value, **kwargs)


@pytest.mark.parametrize("cls", [_Doubled, _Keywords])
def test_a_subclass_runs_its_forward_once_and_the_nested_path_equals_the_padded_one(cls):
    """The nested path called self.forward again with 8 positional arguments: _Doubled's output was doubled
    twice (x4) and _Keywords raised a TypeError."""
    module = cls(E, H, batch_first=True, mechanism="dnas").eval()
    g = torch.Generator().manual_seed(5)
    sequences = [torch.randn(n, E, generator=g) for n in (4, 2)]
    padded = torch.zeros(2, 4, E)  # (B, L, E)
    padded[0], padded[1, :2] = sequences
    padding = torch.tensor([[False] * 4, [False, False, True, True]])
    with torch.no_grad():
        nested = torch.nested.nested_tensor(sequences, layout=torch.jagged)
        out, _ = module(nested, nested, nested, need_weights=False)
        expected, _ = module(padded, padded, padded, key_padding_mask=padding, need_weights=False)
    if cls is _Doubled:
        assert module.calls == 2  # one per call above
    for b, got in enumerate(out.unbind()):
        torch.testing.assert_close(got, expected[b, : len(sequences[b])], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("holder", ["module", "layer"])
def test_a_strict_load_of_an_hnas_state_dict_into_softmax_names_the_fix(holder):
    """torch said only 'Unexpected key(s) in state_dict: "self_attn.theta"'."""
    if holder == "module":
        hnas, softmax = aknn.MultiheadAttention(E, H, mechanism="hnas"), aknn.MultiheadAttention(E, H)
    else:
        hnas = aknn.TransformerEncoderLayer(E, H, 16, mechanism="hnas")
        softmax = aknn.TransformerEncoderLayer(E, H, 16)
    needle = r"theta' is the hybrid weight of an hnas layer.*build it with mechanism=\"hnas\""
    with pytest.raises(RuntimeError, match=needle):
        softmax.load_state_dict(hnas.state_dict())
    result = softmax.load_state_dict(hnas.state_dict(), strict=False)  # ignored, as torch ignores it
    assert [key.rsplit(".", 1)[-1] for key in result.unexpected_keys] == ["theta"]


@pytest.mark.parametrize("attn_mask_kind", [None, "2d", "3d"])
@pytest.mark.parametrize("with_padding", [False, True])
def test_merge_masks_matches_torch(attn_mask_kind, with_padding):
    theirs, ours = _pair(batch_first=True)
    B, L = 3, 4
    query = torch.randn(B, L, E, dtype=torch.float64)
    g = torch.Generator().manual_seed(6)
    padding = torch.rand(B, L, generator=g) > 0.7 if with_padding else None
    attn_mask = {None: None, "2d": torch.rand(L, L, generator=g) > 0.5,
                 "3d": torch.rand(B * H, L, L, generator=g) > 0.5}[attn_mask_kind]
    got = ours.merge_masks(attn_mask, padding, query)
    expected = theirs.merge_masks(attn_mask, padding, query)
    assert got[1] == expected[1]
    assert (got[0] is None and expected[0] is None) or torch.equal(got[0], expected[0])


@pytest.mark.parametrize("need_weights", [True, False])
def test_reference_backend_dropout_draws_torchs_masks_for_the_same_seed(need_weights):
    """What the class docstring promises: backend="reference" reproduces torch's dropout masks and leaves
    the generator where torch leaves it (the default CPU route hashes its own mask from one seed)."""
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(E, H, dropout=0.3, batch_first=True)
    ours = aknn.MultiheadAttention(E, H, dropout=0.3, batch_first=True, backend="reference")
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 6, E)
    torch.manual_seed(5)
    expected, _ = theirs(x, x, x, need_weights=need_weights)
    after_theirs = torch.rand(3)
    torch.manual_seed(5)
    got, _ = ours(x, x, x, need_weights=need_weights)
    torch.testing.assert_close(got, expected)
    assert torch.equal(torch.rand(3), after_theirs)


@pytest.mark.parametrize("batch_first, shape", [(True, (1, 0, 8)), (False, (0, 1, 8)), (True, (0, 8))])
def test_keys_with_no_positions_are_refused_naming_key_and_value(batch_first, shape):
    """Zero keys failed deep inside with "k has an empty sequence (shape (1, 2, 0, 4))", a per-head tensor
    the user never passed; with add_bias_kv or add_zero_attn the queries still have a key (torch's result)."""
    query = torch.randn(*((1, 3, 8) if batch_first else (3, 1, 8))) if len(shape) == 3 else torch.randn(3, 8)
    empty = torch.randn(*shape)
    module = ak.nn.MultiheadAttention(8, 2, batch_first=batch_first)
    with pytest.raises(ValueError, match=r"key \(.*\) and value \(.*\) hold no positions"):
        module(query, empty, empty)
    for extra in (dict(add_bias_kv=True), dict(add_zero_attn=True)):
        torch.manual_seed(0)
        ours = ak.nn.MultiheadAttention(8, 2, batch_first=batch_first, **extra)
        torch.manual_seed(0)
        theirs = torch.nn.MultiheadAttention(8, 2, batch_first=batch_first, **extra)
        ours.load_state_dict(theirs.state_dict())
        torch.testing.assert_close(ours(query, empty, empty)[0], theirs(query, empty, empty)[0])
