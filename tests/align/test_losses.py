"""The four alignment losses: minimum at equal sets, growth with a shift, padding, gradient reversal,
OT = geomloss."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from attnkit.align import Critic, Discriminator, Navigator, ct_loss, gan_loss, grad_reverse, mmd, ot_loss

METHODS = ("gan", "ot", "ct", "mmd")


def _modules(method: str, d: int, seed: int = 0):
    torch.manual_seed(seed)
    if method == "gan":
        return {"discriminator": Discriminator(d).double()}
    if method == "ct":
        return {"critic": Critic(d).double(), "navigator": Navigator(d).double()}
    return {}


def _loss(method: str, q, k, qm=None, km=None, **mods):
    if method == "gan":
        return gan_loss(q, k, mods["discriminator"], qm, km)
    if method == "ct":
        return ct_loss(q, k, mods["critic"], mods["navigator"], qm, km)
    if method == "ot":
        return ot_loss(q, k, qm, km, diameter=mods.get("diameter"))
    return mmd(q, k, key_mask=km, query_mask=qm)


def _train_discriminator(q, k, disc, steps=80):
    opt = torch.optim.Adam(disc.parameters(), lr=3e-2)
    for _ in range(steps):
        opt.zero_grad()
        gan_loss(q, k, disc).mean().backward()
        opt.step()
    return float(gan_loss(q, k, disc).mean().detach())


@pytest.mark.parametrize("method", ("ot", "ct", "mmd"))
def test_minimum_at_equal_sets_and_grows_with_shift(method):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 24, 4, generator=g, dtype=torch.float64)
    mods = _modules(method, 4)
    values = [float(_loss(method, q, q + shift, **mods).mean().detach()) for shift in (0.0, 0.5, 2.0)]
    if method in ("ot", "mmd"):
        assert values[0] == pytest.approx(0.0, abs=1e-6)
    assert values[0] < values[1] < values[2], values
    permuted = q[:, :, torch.randperm(24, generator=g)]
    assert float(_loss(method, q, permuted, **mods).mean().detach()) == pytest.approx(values[0], abs=1e-6)


def test_gan_generator_objective_minimal_at_equal_sets():
    """The generator minimizes -BCE; a trained discriminator's BCE is largest (log 4) when q and k
    coincide."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 32, 4, generator=g, dtype=torch.float64)
    bce = []
    for shift in (0.0, 1.0, 3.0):
        disc = _modules("gan", 4)["discriminator"]
        bce.append(_train_discriminator(q, q + shift, disc))
    assert bce[0] == pytest.approx(2 * torch.log(torch.tensor(2.0)).item(), abs=1e-2)
    assert bce[0] > bce[1] > bce[2], bce


def test_ot_matches_geomloss():
    from geomloss import SamplesLoss

    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 9, 5, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, 7, 5, generator=g, dtype=torch.float64) + 0.7
    ours = ot_loss(q, k, diameter=8.0)  # (B, H)
    reference = SamplesLoss("sinkhorn", p=2, blur=0.05, diameter=8.0)
    default = SamplesLoss("sinkhorn", p=2, blur=0.05)  # its own annealing start: the same limit, nearly
    for b in range(2):
        for h in range(3):
            assert float(ours[b, h]) == pytest.approx(float(reference(q[b, h], k[b, h])), rel=1e-9, abs=1e-12)
            assert float(ours[b, h]) == pytest.approx(float(default(q[b, h], k[b, h])), rel=1e-3)


@pytest.mark.parametrize("method", METHODS)
def test_padding_equals_each_sample_alone(method):
    g = torch.Generator().manual_seed(2)
    B, H, L, d = 3, 2, 8, 4
    q = torch.randn(B, H, L, d, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, L, d, generator=g, dtype=torch.float64) + 0.3
    lengths = [8, 5, 2]
    mask = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]  # (B, L)
    q = q.masked_fill(~mask[:, None, :, None], 1e3)  # padded positions hold garbage
    k = k.masked_fill(~mask[:, None, :, None], -1e3)
    mods = _modules(method, d)
    if method == "ot":
        mods["diameter"] = 10.0  # the same annealing schedule in the batch and alone
    batched = _loss(method, q, k, mask, mask, **mods)
    for b, n in enumerate(lengths):
        alone = _loss(method, q[b : b + 1, :, :n], k[b : b + 1, :, :n], **mods)
        torch.testing.assert_close(batched[b : b + 1], alone, rtol=1e-7, atol=1e-9)


def test_ot_padding_values_change_nothing():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 6, 3, generator=g)
    k = torch.randn(2, 2, 6, 3, generator=g)
    mask = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    a = ot_loss(q, k, mask, mask)
    q2, k2 = q.clone(), k.clone()
    q2[1, :, 3:], k2[1, :, 3:] = 1e4, -1e4
    torch.testing.assert_close(ot_loss(q2, k2, mask, mask), a)


@pytest.mark.parametrize("method", METHODS)
def test_fully_padded_sample_gives_zero_and_finite_gradients(method):
    q = torch.randn(2, 2, 5, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 5, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True] * 5, [False] * 5])
    values = _loss(method, q, k, mask, mask, **_modules(method, 3))
    assert torch.equal(values[1], torch.zeros(2, dtype=torch.float64))
    values.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    assert torch.equal(q.grad[1], torch.zeros_like(q.grad[1]))


def test_grad_reverse_flips_the_sign():
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    (grad_reverse(x, 0.5) * torch.arange(3.0, dtype=torch.float64)).sum().backward()
    assert torch.equal(grad_reverse(x), x)
    torch.testing.assert_close(x.grad, -0.5 * torch.arange(3.0, dtype=torch.float64).expand(4, 3))


def test_gan_gradient_reaching_q_and_k_is_reversed():
    import torch.nn.functional as F

    disc = _modules("gan", 4)["discriminator"]
    q = torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True)
    gq, gk = torch.autograd.grad(gan_loss(q, k, disc).sum(), (q, k))

    lq, lk = disc(q), disc(k)
    plain = (
        F.binary_cross_entropy_with_logits(lq, torch.zeros_like(lq), reduction="none").mean(-1)
        + F.binary_cross_entropy_with_logits(lk, torch.ones_like(lk), reduction="none").mean(-1)
    ).sum()
    pq, pk = torch.autograd.grad(plain, (q, k), retain_graph=True)
    torch.testing.assert_close(gq, -pq)
    torch.testing.assert_close(gk, -pk)
    # the discriminator itself descends the cross-entropy (no reversal on its parameters)
    w = disc.fc2.weight
    torch.testing.assert_close(
        torch.autograd.grad(gan_loss(q, k, disc).sum(), w)[0], torch.autograd.grad(plain, w)[0]
    )


def test_highway_has_the_papers_separate_gate_and_transform():
    """Sec. 2.3.1: a gate sigma(FC(x)) and "another linear layer followed by ReLU"; one matrix served both."""
    from attnkit.align._common import Highway

    torch.manual_seed(0)
    layer = Highway(4).double()
    assert sum(p.numel() for p in layer.parameters()) == 2 * (4 * 4 + 4)
    x = torch.randn(3, 4, dtype=torch.float64)
    t = torch.sigmoid(x @ layer.gate.weight.T + layer.gate.bias)
    h = torch.relu(x @ layer.transform.weight.T + layer.transform.bias)
    torch.testing.assert_close(layer(x), t * h + (1 - t) * x)


def test_ct_critic_gradient_is_reversed_and_inputs_are_not():
    mods = _modules("ct", 4)
    critic, navigator = mods["critic"], mods["navigator"]
    q = torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 6, 4, dtype=torch.float64) + 1
    value = ct_loss(q, k, critic, navigator).sum()
    g_critic = torch.autograd.grad(value, critic.fc1.weight, retain_graph=True)[0]
    g_q = torch.autograd.grad(value, q)[0]
    # without reversal: the same cost computed from plain module calls
    fq, fk = critic(q), critic(k)
    # the paper's point-to-point cost 1 - cos(f(q), f(k)) (sec. 2.3.3; the code took |f(q) - f(k)|)
    cost = 1 - F.cosine_similarity(fq.unsqueeze(-2), fk.unsqueeze(-3), dim=-1)
    logits = navigator(q) @ navigator(k).transpose(-1, -2)
    plain = (
        0.5 * (cost * logits.softmax(-1)).sum((-1, -2)) / 6
        + 0.5 * (cost * logits.softmax(-2)).sum((-1, -2)) / 6
    )
    plain = plain.sum()
    torch.testing.assert_close(value, plain)
    torch.testing.assert_close(g_critic, -torch.autograd.grad(plain, critic.fc1.weight, retain_graph=True)[0])
    torch.testing.assert_close(g_q, torch.autograd.grad(plain, q)[0])


@pytest.mark.parametrize("method", METHODS)
def test_training_two_linear_maps_lowers_mmd_tenfold(method):
    """Only the alignment loss trains W_q, W_k (and the method's own modules): MMD(q, k) falls >= 10x."""
    torch.manual_seed(0)
    d_in, d = 6, 4
    x = torch.randn(4, 32, d_in)  # 4 samples of 32 tokens
    w_q = torch.nn.Linear(d_in, d)
    w_k = torch.nn.Linear(d_in, d)
    with torch.no_grad():
        w_k.bias.add_(2.0)
    mods = {n: m.float() for n, m in _modules(method, d, seed=1).items()}

    def qk():
        return w_q(x).unsqueeze(1), w_k(x).unsqueeze(1)  # (B, 1, L, d)

    before = mmd(*qk()).mean().item()
    params = [*w_q.parameters(), *w_k.parameters()] + [p for m in mods.values() for p in m.parameters()]
    opt = torch.optim.Adam(params, lr=1e-2)
    for _ in range(300):
        opt.zero_grad()
        q, k = qk()
        _loss(method, q, k, **mods).mean().backward()
        opt.step()
    after = mmd(*qk()).mean().item()
    assert after * 10 <= before, (before, after)


@pytest.mark.parametrize("method", METHODS)
def test_float_and_non_binary_masks_are_refused_not_inverted(method):
    """An additive mask (0 = keep, -inf = padding) cast to bool would swap real tokens and padding."""
    q, k = torch.randn(2, 2, 5, 3, dtype=torch.float64), torch.randn(2, 2, 5, 3, dtype=torch.float64)
    mods = _modules(method, 3)
    additive = torch.zeros(2, 5, dtype=torch.float64)
    additive[1, 3:] = float("-inf")
    with pytest.raises(ValueError, match=r"dtype torch.float64; pass a bool mask.*m == 0"):
        _loss(method, q, k, additive, additive, **mods)
    with pytest.raises(ValueError, match="values other than 0 and 1"):
        _loss(method, q, k, torch.full((2, 5), 2), None, **mods)
    ints = (additive == 0).long()  # a Hugging Face attention_mask: 1 = real token
    expected = _loss(method, q, k, ints > 0, ints > 0, **mods)
    torch.testing.assert_close(_loss(method, q, k, ints, ints, **mods), expected)


@pytest.mark.parametrize("method", METHODS)
def test_mismatched_inputs_are_named(method):
    q = torch.randn(1, 2, 4, 3, dtype=torch.float64)
    mods = _modules(method, 3)
    with pytest.raises(ValueError, match="one dtype on one device"):
        _loss(method, q, q.float(), **mods)
    with pytest.raises(ValueError, match="must be floating"):
        _loss(method, q.long(), q.long(), **mods)
    with pytest.raises(ValueError, match="must be tensors, got list"):
        _loss(method, q.tolist(), q, **mods)


@pytest.mark.parametrize("method", ("gan", "ct"))
def test_module_dtype_differing_from_queries_is_named(method):
    q = torch.randn(1, 2, 4, 3)  # float32; the modules are float64
    with pytest.raises(ValueError, match=r"parameters are torch.float64 on cpu, q and k torch.float32"):
        _loss(method, q, q.clone(), **_modules(method, 3))


@pytest.mark.parametrize("method", ["gan", "ct", "ot", "mmd"])
@pytest.mark.parametrize("fill", [float("nan"), float("inf")])
def test_non_finite_padded_values_leave_every_gradient_finite(method, fill):
    # gan fed the padded values to its discriminator: 0 * NaN made its weight gradients and q.grad NaN
    torch.manual_seed(0)
    B, H, L, d = 2, 2, 5, 4
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[0, 3:] = False
    mask[1] = False
    q, k = torch.randn(B, H, L, d), torch.randn(B, H, L, d)
    padded = ~mask[:, None, :, None].expand_as(q)
    q, k = q.masked_fill(padded, fill).requires_grad_(), k.masked_fill(padded, fill).requires_grad_()
    modules = {"gan": [Discriminator(d)], "ct": [Critic(d), Navigator(d)]}.get(method, [])
    loss = {
        "gan": lambda: gan_loss(q, k, *modules, mask, mask),
        "ct": lambda: ct_loss(q, k, *modules, mask, mask),
        "ot": lambda: ot_loss(q, k, mask, mask),
        "mmd": lambda: mmd(q, k, key_mask=mask),
    }[method]()
    loss.mean().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    assert all(torch.isfinite(p.grad).all() for m in modules for p in m.parameters() if p.grad is not None)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"scaling": 1.0}, "scaling=1.0; expected a number in (0, 1)"),
        ({"scaling": 0.0}, "scaling=0.0; expected a number in (0, 1)"),
        ({"scaling": 1.5}, "scaling=1.5; expected a number in (0, 1)"),
        ({"scaling": float("nan")}, "scaling=nan; expected a number in (0, 1)"),
        ({"blur": 0.0}, "blur=0.0; expected a finite number > 0"),
        ({"blur": -0.05}, "blur=-0.05; expected a finite number > 0"),
        ({"diameter": 0.0}, "diameter=0.0; expected a finite number > 0"),
        ({"diameter": float("inf")}, "diameter=inf; expected a finite number > 0"),
    ],
)
def test_ot_loss_names_an_out_of_range_schedule_argument(kwargs, match):
    """scaling=1.5 or 0 gave a silently wrong value, blur=0 or a negative diameter a numpy error."""
    pytest.importorskip("geomloss")
    q, k = torch.randn(1, 1, 6, 3, dtype=torch.float64), torch.randn(1, 1, 6, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=re.escape(match)):
        ot_loss(q, k, **kwargs)
