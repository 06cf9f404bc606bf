"""The one-step lecture modules (content, mixed, location and hard attention) and the positional encodings
inside torch.func.vmap: each example's call under vmap equals the call on that example alone, per-sample
gradients equal a loop of grad calls, and the checks of the values (NaN inputs, out-of-range positions)
still raise their ValueError there. Before, a host read of a batched value (zero_where's finiteness
shortcut, MixedAttention's prev_weights check, GMMLocationAttention's query check, HardAttention's score
check, the positions' range check, the in-place sinusoid table) raised torch's "data-dependent control
flow" RuntimeError inside vmap."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, grad, vmap

import attnkit as ak
from attnkit.nn.hard import reinforce_loss

B, Lk, Dq, Dk = 3, 6, 5, 4
ATOL = 1e-12


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _inputs():
    """``query (B, Dq)``, ``keys (B, Lk, Dk)`` and ``key_mask (B, Lk)`` (True = real) in float64; example 1
    is padded after 4 keys, and its padded keys hold NaN (padding must equal truncation)."""
    q = torch.randn(B, Dq, dtype=torch.float64, generator=_gen(1))
    k = torch.randn(B, Lk, Dk, dtype=torch.float64, generator=_gen(2))
    km = torch.ones(B, Lk, dtype=torch.bool)
    km[1, 4:] = False
    k[1, 4:] = float("nan")
    return q, k, km


def _content(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "DotAttention":
        return ak.nn.DotAttention().double()
    return getattr(ak.nn, name)(Dq, Dk).double()


def _query_for(name: str, q: torch.Tensor) -> torch.Tensor:
    return q[:, :Dk] if name == "DotAttention" else q  # dot attention needs queries of the keys' size


def _mixed() -> ak.nn.MixedAttention:
    torch.manual_seed(0)
    return ak.nn.MixedAttention(Dq, Dk, 8, num_filters=3, kernel_size=3).double()


def _assert_vmap_equals_loop(one, *args) -> None:
    """``vmap(one)(*args)`` against ``one`` called on each example alone."""
    loop = torch.stack([one(*(a[i] for a in args)) for i in range(B)])
    torch.testing.assert_close(vmap(one)(*args), loop, rtol=0, atol=ATOL)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("name", ["AdditiveAttention", "BilinearAttention", "DotAttention"])
def test_content_attention_under_vmap_equals_loop(name, masked):
    """With a key_mask, zero_where's host-read shortcut raised torch's data-dependent control-flow error."""
    m = _content(name)
    q, k, km = _inputs()
    q = _query_for(name, q)
    if not masked:
        k = torch.nan_to_num(k)

    def one(qi, ki, mi):  # (Dq,), (Lk, Dk), (Lk,) -> (Dk,)
        return m(qi[None], ki[None], key_mask=mi[None] if masked else None)[0][0]

    _assert_vmap_equals_loop(one, q, k, km)


def test_content_attention_with_query_mask_under_vmap_equals_loop():
    """Several queries per example with a query_mask go through zero_where for the queries too."""
    m = _content("AdditiveAttention")
    q = torch.randn(B, 3, Dq, dtype=torch.float64, generator=_gen(3))
    _, k, km = _inputs()
    qm = torch.ones(B, 3, dtype=torch.bool)
    qm[2, 2] = False
    q[2, 2] = float("nan")

    def one(qi, ki, mi, qmi):  # (Lq, Dq), (Lk, Dk), (Lk,), (Lq,) -> (Lq, Dk)
        return m(qi[None], ki[None], key_mask=mi[None], query_mask=qmi[None])[0][0]

    _assert_vmap_equals_loop(one, q, k, km, qm)


@pytest.mark.parametrize("masked", [False, True])
def test_mixed_attention_under_vmap_equals_loop(masked):
    """MixedAttention raised inside vmap even without a key_mask (its prev_weights finiteness check)."""
    m = _mixed()
    q, k, km = _inputs()
    if not masked:
        k = torch.nan_to_num(k)
    pw = ak.nn.MixedAttention.initial_weights(km).double()  # (B, Lk)

    def one(qi, ki, pi, mi):  # -> (Dk,)
        return m(qi[None], ki[None], pi[None], key_mask=mi[None] if masked else None)[0][0]

    _assert_vmap_equals_loop(one, q, k, pw, km)


@pytest.mark.parametrize("masked", [False, True])
def test_gmm_location_attention_under_vmap_equals_loop(masked):
    """GMMLocationAttention raised inside vmap even without a key_mask (its query finiteness check)."""
    torch.manual_seed(0)
    m = ak.nn.GMMLocationAttention(Dq, 2).double()
    q, v, km = _inputs()
    if not masked:
        v = torch.nan_to_num(v)
    kappa = m.initial_kappa(B, dtype=torch.float64)  # (B, K)

    def one(qi, vi, ki, mi):  # -> (Dk,)
        return m(qi[None], vi[None], ki[None], key_mask=mi[None] if masked else None)[0][0]

    _assert_vmap_equals_loop(one, q, v, kappa, km)


@pytest.mark.parametrize("mode", ["soft", "argmax"])
def test_hard_attention_under_vmap_equals_loop(mode):
    """HardAttention zeroes the forbidden values through zero_where on every call, mask or not."""
    torch.manual_seed(0)
    m = ak.nn.HardAttention(Dq, Dk, 6).double()
    q, k, km = _inputs()

    def one(qi, ki, mi):  # -> (Dk,)
        return m(qi[None], ki[None], key_mask=mi[None], mode=mode).context[0]

    _assert_vmap_equals_loop(one, q, k, km)


@pytest.mark.parametrize("mode", ["reinforce", "gumbel"])
def test_hard_attention_sampling_under_vmap_picks_one_real_key(mode):
    """Sampling (randomness="different"): "reinforce" also built its probabilities with a boolean-index
    write, which vmap cannot batch; each example must choose exactly one of its real keys."""
    torch.manual_seed(0)
    m = ak.nn.HardAttention(Dq, Dk, 6).double()
    q, k, km = _inputs()
    sel = vmap(lambda qi, ki, mi: m(qi[None], ki[None], key_mask=mi[None], mode=mode).selection[0],
               randomness="different")(q, k, km)  # (B, Lk)
    assert torch.equal(sel.sum(-1), torch.ones(B, dtype=sel.dtype))
    assert not sel[~km].any()


def test_reinforce_loss_under_vmap_equals_loop():
    """Its reward finiteness check read a batched value."""
    log_prob = torch.randn(B, 4, dtype=torch.float64, generator=_gen(4))
    reward = torch.randn(B, 4, dtype=torch.float64, generator=_gen(5))
    _assert_vmap_equals_loop(reinforce_loss, log_prob, reward)


@pytest.mark.parametrize("name", ["AdditiveAttention", "BilinearAttention", "DotAttention", "MixedAttention"])
def test_per_sample_grads_equal_loop_of_grads(name):
    """vmap(grad(...)) over examples with a key_mask raised; it must equal one grad call per example
    (DotAttention has no parameters: its gradient is taken with respect to the query)."""
    m = _mixed() if name == "MixedAttention" else _content(name)
    q, k, km = _inputs()
    q = _query_for(name, q)
    pw = ak.nn.MixedAttention.initial_weights(km).double()  # (B, Lk)
    params = {n: p.detach() for n, p in m.named_parameters()}

    def loss(p, qi, ki, mi, pi):
        args = (qi[None], ki[None], pi[None]) if name == "MixedAttention" else (qi[None], ki[None])
        out = functional_call(m, p, args, {"key_mask": mi[None]})[0]  # (1, Dk)
        return (out * torch.arange(1, Dk + 1, dtype=out.dtype)).sum()

    per_example = grad(loss, argnums=0 if params else 1)
    per_sample = vmap(per_example, in_dims=(None, 0, 0, 0, 0))(params, q, k, km, pw)
    for i in range(B):
        one = per_example(params, q[i], k[i], km[i], pw[i])
        for n in params or [None]:
            got, want = (per_sample[n][i], one[n]) if n else (per_sample[i], one)
            torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


def test_gmm_location_per_sample_grads_equal_loop_of_grads():
    torch.manual_seed(0)
    m = ak.nn.GMMLocationAttention(Dq, 2).double()
    q, v, km = _inputs()
    kappa = m.initial_kappa(B, dtype=torch.float64)
    params = {n: p.detach() for n, p in m.named_parameters()}

    def loss(p, qi, vi, ki, mi):
        return functional_call(m, p, (qi[None], vi[None], ki[None]), {"key_mask": mi[None]})[0].sum()

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0, 0, 0))(params, q, v, kappa, km)
    for i in range(B):
        one = grad(loss)(params, q[i], v[i], kappa[i], km[i])
        for n in params:
            torch.testing.assert_close(per_sample[n][i], one[n], rtol=0, atol=ATOL)


def _under_vmap_and_outside(call, *args):
    """``call`` on the whole batch, then under vmap example by example: both must raise the ValueError."""
    return [lambda: call(*args), lambda: vmap(lambda *a: call(*(t[None] for t in a)))(*args)]


def test_mixed_nan_prev_weights_still_raise_under_vmap():
    m = _mixed()
    q, k, km = _inputs()
    pw = ak.nn.MixedAttention.initial_weights(km).double()
    pw[2, 1] = float("nan")  # a real key of example 2
    for run in _under_vmap_and_outside(lambda *a: m(a[0], a[1], a[2], key_mask=a[3])[0], q, k, pw, km):
        with pytest.raises(ValueError, match="prev_weights contains NaN or inf"):
            run()


def test_gmm_nan_query_still_raises_under_vmap():
    torch.manual_seed(0)
    m = ak.nn.GMMLocationAttention(Dq, 2).double()
    q, v, km = _inputs()
    q[1, 0] = float("nan")
    kappa = m.initial_kappa(B, dtype=torch.float64)
    for run in _under_vmap_and_outside(lambda *a: m(*a)[0], q, torch.nan_to_num(v), kappa):
        with pytest.raises(ValueError, match="query contains NaN or inf"):
            run()


def test_hard_nan_score_still_raises_under_vmap():
    torch.manual_seed(0)
    m = ak.nn.HardAttention(Dq, Dk, 6).double()
    q, k, km = _inputs()
    k[0, 2, 1] = float("nan")  # a real key: its score is NaN

    def call(qb, kb, mb):
        return m(qb, kb, key_mask=mb, mode="soft").context

    for run in _under_vmap_and_outside(call, q, k, km):
        with pytest.raises(ValueError, match="scores contain NaN"):
            run()


def _padded_positions():
    """``x (B, L, d)`` float64 and left-padded ``positions (B, L)``."""
    x = torch.randn(B, 5, 8, dtype=torch.float64, generator=_gen(6))
    mask = torch.ones(B, 5, dtype=torch.long)
    mask[1, :2] = 0
    return x, (mask.cumsum(1) - 1).clamp(min=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cls", [ak.nn.SinusoidalPositionalEncoding, ak.nn.LearnedPositionalEncoding])
def test_positional_encoding_with_positions_under_vmap_equals_batched_call(cls, dtype):
    """The range check read positions.min() on the host; float64 sinusoids also wrote rows computed from
    batched positions into a new unbatched tensor."""
    torch.manual_seed(0)
    pe = cls(8, max_len=16).to(dtype)
    x, pos = _padded_positions()
    x = x.to(dtype)
    out = vmap(lambda xi, pi: pe(xi[None], positions=pi[None])[0])(x, pos)
    torch.testing.assert_close(out, pe(x, positions=pos), rtol=0, atol=ATOL)


@pytest.mark.parametrize("cls", [ak.nn.SinusoidalPositionalEncoding, ak.nn.LearnedPositionalEncoding])
def test_out_of_range_positions_still_raise_under_vmap(cls):
    pe = cls(8, max_len=16)
    x, pos = _padded_positions()
    x = x.float()
    pos[2, 1] = 20
    for run in _under_vmap_and_outside(lambda xi, pi: pe(xi, positions=pi), x, pos):
        with pytest.raises(ValueError, match=r"positions span 0\.\.20, outside \[0, max_len=16\)"):
            run()


@pytest.mark.parametrize("mechanism", ["softmax", "dnas"])
def test_multiview_attention_under_vmap_equals_loop(mechanism):
    """Already held (MultiViewAttention reads no values on the host); kept as a guard beside the others."""
    torch.manual_seed(0)
    m = ak.nn.MultiViewAttention(8, num_views=2, mechanism=mechanism).double()
    primary = torch.randn(B, 5, 8, dtype=torch.float64, generator=_gen(7))
    s1 = torch.randn(B, 4, 8, dtype=torch.float64, generator=_gen(8))
    s2 = torch.randn(B, 6, 8, dtype=torch.float64, generator=_gen(9))
    pad1 = torch.zeros(B, 4, dtype=torch.bool)
    pad1[0, 2:] = True
    qpad = torch.zeros(B, 5, dtype=torch.bool)
    qpad[2, 3:] = True

    def one(p, a, b, m1, qp):  # -> (5, 8)
        return m(p[None], [a[None], b[None]], qp[None], [m1[None], None])[0]

    _assert_vmap_equals_loop(one, primary, s1, s2, pad1, qpad)


@pytest.mark.parametrize("name", ["AdditiveAttention", "MixedAttention"])
def test_jacrev_and_jvp_with_key_mask_match_autograd(name):
    """jacrev (a vmap over cotangents) and jvp of a masked call equal autograd's Jacobian."""
    m = _mixed() if name == "MixedAttention" else _content(name)
    q, k, km = _inputs()
    k = torch.nan_to_num(k)
    pw = ak.nn.MixedAttention.initial_weights(km).double()

    def f(qb):  # (B, Dq) -> (B, Dk)
        args = (qb, k, pw) if name == "MixedAttention" else (qb, k)
        return m(*args, key_mask=km)[0]

    jac = torch.autograd.functional.jacobian(f, q)  # (B, Dk, B, Dq)
    torch.testing.assert_close(torch.func.jacrev(f)(q), jac, rtol=0, atol=ATOL)
    t = torch.randn(B, Dq, dtype=torch.float64, generator=_gen(10))
    _, jvp = torch.func.jvp(f, (q,), (t,))
    torch.testing.assert_close(jvp, torch.einsum("bdcq,cq->bd", jac, t), rtol=0, atol=ATOL)
