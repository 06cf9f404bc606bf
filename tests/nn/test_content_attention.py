"""Content attention modules (``AdditiveAttention``, ``BilinearAttention``, ``DotAttention``): the
lecture's score
formulas in float64, masks (padding = truncation, fully masked rows) and normalizations."""

from __future__ import annotations

import math
import re

import pytest
import torch

import attnkit as ak

F64 = dict(atol=1e-12, rtol=1e-10)


def _modules(D: int = 6):
    torch.manual_seed(0)
    return {
        "additive": ak.nn.AdditiveAttention(D, D, hidden_dim=5).double(),
        "bilinear": ak.nn.BilinearAttention(D, D).double(),
        "dot": ak.nn.DotAttention(D).double(),
        "scaled_dot": ak.nn.DotAttention(D, scaled=True).double(),
    }


def _formula(name: str, module, q, k):
    """``e_j`` for one query ``q (D,)`` and keys ``k (L, D)`` written from the lecture's score functions."""
    if name == "additive":
        s = module.scorer
        return torch.stack([s.w @ torch.tanh(s.w_q @ q + s.w_k @ kj + s.bias) for kj in k])
    if name == "bilinear":
        return torch.stack([q @ module.scorer.weight @ kj for kj in k])
    if name == "dot":
        return torch.stack([q @ kj for kj in k])
    return torch.stack([q @ kj / math.sqrt(q.numel()) for kj in k])


@pytest.mark.parametrize("name", ["additive", "bilinear", "dot", "scaled_dot"])
def test_matches_softmax_of_the_lecture_score_float64(name):
    module = _modules()[name]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 6, generator=g, dtype=torch.float64)
    keys = torch.randn(3, 5, 6, generator=g, dtype=torch.float64)
    values = torch.randn(3, 5, 4, generator=g, dtype=torch.float64)
    context, weights = module(q, keys, values)
    for b in range(3):
        alpha = torch.softmax(_formula(name, module, q[b], keys[b]), dim=0)  # (L,)
        torch.testing.assert_close(weights[b], alpha, **F64)
        torch.testing.assert_close(context[b], alpha @ values[b], **F64)


@pytest.mark.parametrize("name", ["additive", "bilinear", "dot", "scaled_dot"])
@pytest.mark.parametrize("mechanism", ["softmax", "sinkhorn"])
def test_padding_equals_truncation(name, mechanism):
    module = _modules()[name]
    module.mechanism = ak.resolve_mechanism(mechanism)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 3, 6, generator=g, dtype=torch.float64)  # (B, Lq, D): several queries
    keys = torch.randn(2, 7, 6, generator=g, dtype=torch.float64)
    lengths = [7, 4]
    mask = torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]  # (B, Lk)
    context, weights = module(q, keys, key_mask=mask)
    for b, n in enumerate(lengths):
        c_alone, w_alone = module(q[b : b + 1], keys[b : b + 1, :n])
        torch.testing.assert_close(context[b], c_alone[0], **F64)
        torch.testing.assert_close(weights[b, :, :n], w_alone[0], **F64)
        assert torch.all(weights[b, :, n:] == 0)


@pytest.mark.parametrize("name", ["additive", "bilinear", "dot"])
def test_fully_masked_row_gives_zero_context(name):
    module = _modules()[name]
    keys = torch.randn(2, 4, 6, dtype=torch.float64)
    mask = torch.tensor([[True, True, False, False], [False, False, False, False]])
    context, weights = module(torch.randn(2, 6, dtype=torch.float64), keys, key_mask=mask)
    assert torch.all(context[1] == 0) and torch.all(weights[1] == 0)
    assert torch.isfinite(context).all()
    torch.testing.assert_close(weights[0].sum(), torch.tensor(1.0, dtype=torch.float64), **F64)


@pytest.mark.parametrize(
    "name, mechanism",
    [(name, m) for name in ("additive", "bilinear", "dot") for m in ak.MECHANISMS
     if m != "coda" or name == "dot"],  # CoDA's gate: DotAttention only
)
def test_no_keys_at_all_gives_zero_context_with_every_mechanism(name, mechanism):
    """Keys of length 0 (B, 0, D) gave a zero context under softmax and coda but an IndexError from an amax
    of nothing under dnas, hnas and sinkhorn (so did ``ak.normalize`` of (B, H, Lq, 0) scores)."""
    D = 6
    cls = {"additive": ak.nn.AdditiveAttention, "bilinear": ak.nn.BilinearAttention}.get(name)
    module = (cls(D, D, mechanism=mechanism) if cls else ak.nn.DotAttention(D, mechanism=mechanism)).double()
    queries = torch.randn(2, 3, D, dtype=torch.float64, requires_grad=True)
    context, weights = module(queries, torch.randn(2, 0, D, dtype=torch.float64))
    assert context.shape == (2, 3, D) and weights.shape == (2, 3, 0) and torch.all(context == 0)
    context.sum().backward()
    assert torch.all(queries.grad == 0)
    gate = {"gate_scores": torch.zeros(1, 2, 3, 0)} if mechanism == "coda" else {}
    float_mask = torch.zeros(1, 2, 3, 0) if mechanism != "coda" else torch.ones(1, 2, 3, 0, dtype=torch.bool)
    for masks in ({}, {"attn_mask": torch.ones(3, 0, dtype=torch.bool)}, {"attn_mask": float_mask},
                  {"key_mask": torch.ones(1, 0, dtype=torch.bool)}):  # an attn_mask raised an IndexError
        assert ak.normalize(torch.zeros(1, 2, 3, 0), mechanism, **gate, **masks).shape == (1, 2, 3, 0)


def test_dnas_normalizes_over_the_given_queries():
    module = ak.nn.DotAttention(6, mechanism="dnas").double()
    g = torch.Generator().manual_seed(3)
    q, keys = (
        torch.randn(1, 4, 6, generator=g, dtype=torch.float64),
        torch.randn(1, 5, 6, generator=g, dtype=torch.float64),
    )
    _, weights = module(q, keys)
    scores = q[0] @ keys[0].T  # (Lq, Lk)
    xi = torch.softmax(scores, dim=0)  # over queries, per key
    torch.testing.assert_close(weights[0], xi / xi.sum(dim=1, keepdim=True), **F64)


def test_dot_attention_with_coda_uses_the_l1_gate():
    module = ak.nn.DotAttention(6, mechanism="coda").double()
    g = torch.Generator().manual_seed(4)
    q, keys = (
        torch.randn(1, 6, generator=g, dtype=torch.float64),
        torch.randn(1, 3, 6, generator=g, dtype=torch.float64),
    )
    _, weights = module(q, keys)
    e = keys[0] @ q[0]  # scaled=False: the plain dot product is CoDA's E
    n = -(keys[0] - q[0]).abs().sum(dim=1) / math.sqrt(6)
    torch.testing.assert_close(weights[0], torch.tanh(e) * 2 * torch.sigmoid(n), **F64)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="DotAttention for coda"):
        ak.nn.AdditiveAttention(4, 4, mechanism="coda")
    with pytest.raises(ValueError, match="same size|one size"):
        ak.nn.DotAttention()(torch.randn(2, 4), torch.randn(2, 3, 5))
    with pytest.raises(ValueError, match="key_mask"):
        ak.nn.DotAttention()(torch.randn(2, 4), torch.randn(2, 3, 4), key_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="query has shape"):
        ak.nn.DotAttention()(torch.randn(4), torch.randn(2, 3, 4))


@pytest.mark.parametrize(
    "cls, args, needle",
    [
        ("AdditiveAttention", (0, 4), "query_dim=0"),
        ("AdditiveAttention", (4, 4.0), "key_dim=4.0"),
        ("AdditiveAttention", (4, 4, -2), "hidden_dim=-2"),
        ("AdditiveAttention", (4, 4, True), "hidden_dim=True"),
        ("BilinearAttention", (True, 4), "query_dim=True"),
        ("BilinearAttention", (4, "4"), "key_dim='4'"),
    ],
)
def test_sizes_must_be_positive_integers(cls, args, needle):
    with pytest.raises(ValueError, match=re.escape(f"{cls}({needle}): expected a positive integer")):
        getattr(ak.nn, cls)(*args)


@pytest.mark.parametrize("name", ["additive", "bilinear"])
def test_inputs_must_have_the_configured_feature_sizes(name):
    module = {"additive": ak.nn.AdditiveAttention(4, 6), "bilinear": ak.nn.BilinearAttention(4, 6)}[name]
    cls = type(module).__name__
    msg = rf"{cls}\(query_dim=4, key_dim=6\) got query \(2, 5\) and keys \(2, 3, 6\); pass query \(B, 4\)"
    with pytest.raises(ValueError, match=msg):
        module(torch.randn(2, 5), torch.randn(2, 3, 6))
    with pytest.raises(ValueError, match=r"keys \(2, 3, 4\).*build the module with query_dim=4, key_dim=4"):
        module(torch.randn(2, 3, 4), torch.randn(2, 3, 4))
    assert module(torch.randn(2, 3, 4), torch.randn(2, 5, 6))[1].shape == (2, 3, 5)


@pytest.mark.parametrize("name", ["additive", "bilinear"])
def test_inputs_must_have_the_module_dtype_and_device(name):
    module = {"additive": ak.nn.AdditiveAttention(4, 6), "bilinear": ak.nn.BilinearAttention(4, 6)}[name]
    cls = type(module).__name__
    q, keys = torch.randn(2, 4), torch.randn(2, 3, 6)
    with pytest.raises(ValueError, match=rf"dtype torch.float64 but {cls}'s parameters are torch.float32"):
        module(q.double(), keys.double())
    with pytest.raises(ValueError, match=r"query, keys, values have dtypes .*float32, .*float32, .*float64"):
        module(q, keys, torch.randn(2, 3, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"keys has dtype torch.int64; expected a floating dtype"):
        module(q, keys.long())
    with pytest.raises(ValueError, match="query is on cpu but keys is on meta"):
        module(q, keys.to("meta"))
    with pytest.raises(ValueError, match=rf"the inputs are on cpu but {cls}'s parameters are on meta"):
        module.to("meta")(q, keys)


@pytest.mark.parametrize("name", ["additive", "bilinear"])
def test_key_mask_must_be_bool_b_lk_on_the_keys_device(name):
    module = {"additive": ak.nn.AdditiveAttention(4, 6), "bilinear": ak.nn.BilinearAttention(4, 6)}[name]
    q, keys = torch.randn(2, 4), torch.randn(2, 3, 6)
    with pytest.raises(ValueError, match=r"key_mask is \(\(2, 3\), torch.float32\); expected a bool tensor"):
        module(q, keys, key_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"expected a bool tensor of shape \(B, Lk\) = \(2, 3\)"):
        module(q, keys, key_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_mask is on meta but keys are on cpu"):
        module(q, keys, key_mask=torch.ones(2, 3, dtype=torch.bool, device="meta"))


def _lengths_mask(lengths, L):
    return torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]  # (B, L)


@pytest.mark.parametrize("name", ["additive", "bilinear", "dot", "scaled_dot"])
def test_padded_nan_and_inf_keys_and_values_equal_truncation(name):
    """Padded keys holding inf and values holding NaN made every real output NaN (0 * NaN) or raised
    "scores contain NaN"; they must not matter, for the outputs or for the gradients of the parameters."""
    module = _modules()[name]
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 6, generator=g, dtype=torch.float64)
    keys = torch.randn(2, 5, 6, generator=g, dtype=torch.float64)
    values = torch.randn(2, 5, 3, generator=g, dtype=torch.float64)
    lengths = [5, 3]
    mask = _lengths_mask(lengths, 5)
    keys[1, 3:] = float("inf")
    values[1, 3:] = float("nan")
    keys.requires_grad_(True)
    context, weights = module(q, keys, values, key_mask=mask)
    context[1].sum().backward()
    assert torch.isfinite(keys.grad).all() and torch.all(keys.grad[1, 3:] == 0)
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad()
    keys_alone = keys.detach()[1:, :3].clone().requires_grad_(True)
    c_alone, w_alone = module(q[1:], keys_alone, values[1:, :3])
    c_alone.sum().backward()
    torch.testing.assert_close(keys.grad[1, :3], keys_alone.grad[0], **F64)
    torch.testing.assert_close(context[1], c_alone[0], **F64)
    torch.testing.assert_close(weights[1, :3], w_alone[0], **F64)
    assert torch.all(weights[1, 3:] == 0)
    for n, p in module.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, **F64)


@pytest.mark.parametrize(
    "name, mechanism",
    [(n, m) for n in ("additive", "bilinear", "dot", "scaled_dot") for m in ("softmax", "dnas", "hnas")]
    + [(n, "sinkhorn") for n in ("additive", "bilinear", "dot", "scaled_dot")]
    + [("dot", "coda"), ("scaled_dot", "coda")],
)
def test_padding_equals_truncation_for_queries_and_keys_with_every_mechanism(name, mechanism):
    """dnas / hnas / sinkhorn normalize over the queries: padded query rows entered the column sums (0.09 off)
    until ``query_mask`` kept them out. Padded rows hold NaN to show that their content never matters."""
    module = _modules()[name]
    module.mechanism = ak.resolve_mechanism(mechanism)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(3, 5, 6, generator=g, dtype=torch.float64)  # (B, Lq, D)
    keys = torch.randn(3, 7, 6, generator=g, dtype=torch.float64)
    q_len, k_len = [5, 3, 1], [7, 4, 2]
    query_mask, key_mask = _lengths_mask(q_len, 5), _lengths_mask(k_len, 7)
    q[~query_mask] = float("nan")
    keys[~key_mask] = float("nan")
    context, weights = module(q, keys, key_mask=key_mask, query_mask=query_mask)
    for b, (m, n) in enumerate(zip(q_len, k_len)):
        c_alone, w_alone = module(q[b : b + 1, :m], keys[b : b + 1, :n])
        torch.testing.assert_close(context[b, :m], c_alone[0], **F64)
        torch.testing.assert_close(weights[b, :m, :n], w_alone[0], **F64)
        assert torch.all(weights[b, :, n:] == 0) and torch.all(weights[b, m:] == 0)
        assert torch.all(context[b, m:] == 0)


def test_query_mask_of_a_single_step_is_b_and_a_padded_step_gets_a_zero_context():
    module = _modules()["additive"]
    q = torch.randn(2, 6, dtype=torch.float64)
    q[1] = float("nan")
    keys = torch.randn(2, 4, 6, dtype=torch.float64)
    context, weights = module(q, keys, query_mask=torch.tensor([True, False]))
    c_alone, _ = module(q[:1], keys[:1])
    torch.testing.assert_close(context[0], c_alone[0], **F64)
    assert torch.all(context[1] == 0) and torch.all(weights[1] == 0)


def test_query_mask_must_be_bool_of_the_query_shape_on_its_device():
    module = ak.nn.DotAttention()
    q, keys = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    with pytest.raises(ValueError, match=r"query_mask is \(\(2, 3\), torch.float32\); expected a bool"):
        module(q, keys, query_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"shape \(B, Lq\) = \(2, 3\)"):
        module(q, keys, query_mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"shape \(B,\) = \(2,\)"):
        module(q[:, 0], keys, query_mask=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="query_mask is on meta but query is on cpu"):
        module(q, keys, query_mask=torch.ones(2, 3, dtype=torch.bool, device="meta"))


@pytest.mark.parametrize("name", ["additive", "bilinear", "dot"])
def test_hnas_content_attention_learns_its_hybrid_weight(name):
    from attnkit.nn import hybrid_weights

    torch.manual_seed(0)
    build = {
        "additive": lambda m: ak.nn.AdditiveAttention(4, 4, mechanism=m),
        "bilinear": lambda m: ak.nn.BilinearAttention(4, 4, mechanism=m),
        "dot": lambda m: ak.nn.DotAttention(mechanism=m),
    }[name]
    module = build(ak.Hybrid(u0=0.1))
    assert torch.allclose(module.u, torch.tensor([0.1])) and "theta" in dict(module.named_parameters())
    q, k = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    context, weights = module(q, k)
    scores = module.score(q[:, None], k[:, None])  # (B, 1, Lq, Lk)
    expected = 0.1 * ak.normalize(scores, "dnas") + 0.9 * ak.normalize(scores, "softmax")
    torch.testing.assert_close(weights, expected[:, 0])
    context.square().sum().backward()
    assert module.theta.grad is not None and module.theta.grad.abs().item() > 0
    assert torch.equal(hybrid_weights(torch.nn.ModuleList([module])), module.u[None])
    with torch.no_grad():
        module.theta.fill_(3.0)
    module.reset_parameters()
    assert torch.allclose(module.u, torch.tensor([0.1]))
    with pytest.raises(AttributeError, match="only for mechanism 'hnas'"):
        build("softmax").u


def test_hnas_content_attention_loads_a_state_dict_without_theta_and_takes_float64_inputs():
    # modules saved before the hybrid weight was learned have no theta (load_state_dict raised "Missing
    # key(s)"), and a DotAttention whose only parameter is theta refused the float64 inputs it took before
    module = ak.nn.AdditiveAttention(4, 4, mechanism=ak.Hybrid(u0=0.2))
    old = {k: v for k, v in module.state_dict().items() if k != "theta"}
    fresh = ak.nn.AdditiveAttention(4, 4, mechanism=ak.Hybrid(u0=0.2))
    fresh.load_state_dict(old)
    assert torch.allclose(fresh.u, torch.tensor([0.2]))
    dot = ak.nn.DotAttention(mechanism="hnas")
    q, k = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 5, 4, dtype=torch.float64)
    context, weights = dot(q, k)
    assert context.dtype == torch.float64
    context.sum().backward()
    assert dot.theta.grad is not None and dot.theta.grad.dtype == torch.float32


@pytest.mark.parametrize("dtype, fill", [(torch.float32, 1e20), (torch.float16, 200.0)])
@pytest.mark.parametrize("name, mechanism", [("dot", "softmax"), ("bilinear", "softmax"), ("dot", "dnas"),
                                             ("scaled_dot", "coda")])
def test_large_finite_padding_equals_truncation(dtype, fill, name, mechanism):
    """A padded query and key holding large finite values (1e20 in float32, 200 in float16) made a padded
    pair's score inf, refused as "scores contain NaN or +inf" though the docstring says padding never
    matters."""
    module = _modules()[name].to(dtype)
    module.mechanism = ak.resolve_mechanism(mechanism)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 3, 6, generator=g).to(dtype)
    keys = torch.randn(2, 5, 6, generator=g).to(dtype)
    query_mask, key_mask = _lengths_mask([3, 2], 3), _lengths_mask([5, 3], 5)
    q[~query_mask] = fill
    keys[~key_mask] = fill
    context, weights = module(q, keys, key_mask=key_mask, query_mask=query_mask)
    c_alone, w_alone = module(q[1:, :2], keys[1:, :3])
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(context[1, :2], c_alone[0], **tol)
    torch.testing.assert_close(weights[1, :2, :3], w_alone[0], **tol)
    assert torch.all(weights[1, :, 3:] == 0) and torch.all(context[1, 2:] == 0)
