"""Scores kept between Sinkhorn rounds in the C++ kernels (``SCORE_CACHE_BYTES``, csrc/potentials_cpu.cpp):
the forward, the forward-only entry and the gradients do not depend on how many key strips are kept (none,
some, all), with padding, fully masked rows, odd sizes and dropout, and agree with the float64 reference."""

from __future__ import annotations

import re

import pytest
import torch

import attnkit as ak
from attnkit.kernels import cpp_potentials, cpu_ext
from attnkit.kernels.cpp_potentials import fused_cpu_attention
from tests._reference import ref_attention

pytestmark = [
    pytest.mark.skipif(not cpu_ext.load(warn=False), reason="C++ CPU kernels not built"),
    pytest.mark.usefixtures("query_chunks_of_256"),  # inputs of a few hundred queries span several chunks
]

LQ, LK = 300, 389  # two query chunks, four key strips (the last one of 5 keys)


@pytest.fixture(autouse=True)
def _budget_from_the_module(monkeypatch):
    """The tests set ``SCORE_CACHE_BYTES``; a budget in the environment would override it."""
    monkeypatch.delenv(cpp_potentials.SCORE_CACHE_ENV, raising=False)


def _budgets(dtype):
    """Bytes that keep no strip, one strip and a half (one is kept), and every strip of a (LQ, 128) head."""
    strip = LQ * 128 * torch.finfo(dtype).bits // 8
    return [0, strip * 3 // 2, 8 * strip]


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 2, LQ, 12, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, LK, 12, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, LK, 7, generator=g, dtype=torch.float64)
    km = torch.rand(2, LK, generator=g) > 0.3
    qm = torch.rand(2, LQ, generator=g) > 0.2
    km[0], qm[0] = True, True
    qm[1, :40] = False
    km[1, -100:] = False  # the last key strips of the second element are padding
    return [t.to(dtype) for t in (q, k, v)], km, qm


def _run(q, k, v, km, qm, iters, dropout_p, budget, monkeypatch, grad):
    monkeypatch.setattr(cpp_potentials, "SCORE_CACHE_BYTES", budget)
    torch.manual_seed(5)  # the dropout seed
    if not grad:
        with torch.no_grad():
            out = fused_cpu_attention(q, k, v, key_mask=km, query_mask=qm, scale=0.3, iters=iters,
                                      dropout_p=dropout_p)
            return out, None
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fused_cpu_attention(q, k, v, key_mask=km, query_mask=qm, scale=0.3, iters=iters,
                              dropout_p=dropout_p)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return out.detach(), torch.autograd.grad(out, (q, k, v), do)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("iters", [2, 3])
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("masks", [True, False])
def test_outputs_and_gradients_do_not_depend_on_the_score_budget(dtype, iters, dropout_p, masks, monkeypatch):
    (q, k, v), km, qm = _inputs(dtype)
    if not masks:
        km = qm = None
    runs = [_run(q, k, v, km, qm, iters, dropout_p, b, monkeypatch, grad=True) for b in _budgets(dtype)]
    forward_only = [_run(q, k, v, km, qm, iters, dropout_p, b, monkeypatch, grad=False)[0]
                    for b in _budgets(dtype)]
    out0, grads0 = runs[0]
    for out, grads in runs[1:]:
        assert torch.equal(out, out0)
        for a, b in zip(grads, grads0):
            assert torch.equal(a, b)
    for out in forward_only:
        assert torch.equal(out, out0)
    if masks:
        assert (out0[1, :, :40] == 0).all()  # fully masked query rows stay zero


@pytest.mark.parametrize("budget_index", [1, 2])
def test_cached_rounds_match_float64_reference(budget_index, monkeypatch):
    (q, k, v), km, qm = _inputs(torch.float64, seed=3)
    budget = _budgets(torch.float64)[budget_index]
    out, grads = _run(q, k, v, km, qm, 3, 0.0, budget, monkeypatch, grad=True)
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    ref, _ = ref_attention(qr, kr, vr, "sinkhorn", key_mask=km, query_mask=qm, iters=3, scale=0.3)
    ref = ref * qm[:, None, :, None]
    torch.testing.assert_close(out, ref.detach(), atol=1e-11, rtol=1e-9)
    do = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=ref.dtype)
    want = torch.autograd.grad(ref, (qr, kr, vr), do)
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


# Several threads: a head whose kept scores need more than one thread's share of the budget runs after the
# others, alone, with its query chunks spread over the threads and the whole budget (csrc: run_balanced); the
# others are dealt to the threads. In _inputs the first element's heads have 300 queries (they can be spread),
# the second's about 200 (they cannot): with the middle budget the two kinds take the two routes.
@pytest.mark.parametrize("threads", [2, 3])
def test_heads_that_need_the_whole_budget_get_it_with_the_same_results(threads, num_threads, monkeypatch):
    num_threads(threads)
    (q, k, v), km, qm = _inputs(torch.float64, seed=4)
    runs = [_run(q, k, v, km, qm, 3, 0.0, b, monkeypatch, grad=True) for b in _budgets(torch.float64)]
    (out, grads), rest = runs[1], runs[:1] + runs[2:]
    for other, other_grads in rest:  # the same bits with no strip kept, or every strip kept by every thread
        assert torch.equal(out, other)
        for a, b in zip(grads, other_grads):
            assert torch.equal(a, b)
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    ref, _ = ref_attention(qr, kr, vr, "sinkhorn", key_mask=km, query_mask=qm, iters=3, scale=0.3)
    ref = ref * qm[:, None, :, None]
    torch.testing.assert_close(out, ref.detach(), atol=1e-11, rtol=1e-9)
    do = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=ref.dtype)
    for a, b in zip(grads, torch.autograd.grad(ref, (qr, kr, vr), do)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize(
    "raw, expected", [(None, 64 * 2**20), ("", 64 * 2**20), ("0", 0), (" 256 ", 256 * 2**20)]
)
def test_the_budget_comes_from_the_environment_in_mib(raw, expected, monkeypatch):
    if raw is not None:
        monkeypatch.setenv(cpp_potentials.SCORE_CACHE_ENV, raw)
    assert cpp_potentials.score_cache_bytes() == expected


# 99999999999999 overflowed int64; int() reads "1_0" as 10, "+8" as 8 and an Arabic-Indic 7 as 7, and 5000
# digits got int()'s own message
NOT_WHOLE_MIB = ["-1", "1.5", "lots", "64MB", "99999999999999", "1_0", "+8", "\u0667", "9" * 5000]


@pytest.mark.parametrize("raw", NOT_WHOLE_MIB)
def test_a_budget_in_the_environment_that_is_not_whole_mib_is_named(raw, monkeypatch):
    monkeypatch.setenv(cpp_potentials.SCORE_CACHE_ENV, raw)
    (q, k, v), km, qm = _inputs(torch.float32)
    message = re.escape(f"ATTNKIT_SCORE_CACHE_MB={raw!r}; expected a whole number of MiB")
    with pytest.raises(ValueError, match=message):
        ak.attention(q, k, v, "sinkhorn", key_mask=km, query_mask=qm, backend="efficient")


def test_a_budget_set_in_the_environment_reaches_the_kernels_and_gives_the_same_bits(monkeypatch):
    """No strip kept, or every strip (1 MiB holds this head's): the same outputs and gradients."""
    (q, k, v), km, qm = _inputs(torch.float32, seed=3)
    seen, results = [], []
    for name in ("potentials_forward", "potentials_backward"):
        op = getattr(torch.ops.attnkit_cpu, name)
        monkeypatch.setattr(
            torch.ops.attnkit_cpu, name, lambda *a, _op=op: seen.append(a[-2]) or _op(*a), raising=False
        )
    for raw in ("0", "1"):
        monkeypatch.setenv(cpp_potentials.SCORE_CACHE_ENV, raw)
        budget = cpp_potentials.SCORE_CACHE_BYTES
        results.append(_run(q, k, v, km, qm, 3, 0.0, budget, monkeypatch, grad=True))
    assert seen == [0, 0, 2**20, 2**20]  # forward and backward of each run
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)


def test_negative_budget_is_refused(monkeypatch):
    (q, k, v), _, _ = _inputs(torch.float32)
    monkeypatch.setattr(cpp_potentials, "SCORE_CACHE_BYTES", -1)
    with pytest.raises(RuntimeError, match="score_cache_bytes"):
        with torch.no_grad():
            fused_cpu_attention(q, k, v, key_mask=None, query_mask=None, scale=0.3, iters=3)


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_sinkhorn_with_a_softmax_half_matches_reference_gradients(dropout_p, monkeypatch):
    """u * Sinkhorn-3 + (1 - u) * softmax in one call (the backward path that keeps the dO V^T product for the
    softmax half); without dropout against the float64 reference, with dropout budget-independent."""
    (q, k, v), km, qm = _inputs(torch.float64, seed=4)
    u = torch.tensor(0.7, dtype=torch.float64)
    do = torch.randn(2, 2, LQ, 7, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    grads = []
    for budget in _budgets(torch.float64):
        monkeypatch.setattr(cpp_potentials, "SCORE_CACHE_BYTES", budget)
        qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
        torch.manual_seed(5)
        out = fused_cpu_attention(qr, kr, vr, key_mask=km, query_mask=qm, scale=0.3, iters=3, u=u,
                                  dropout_p=dropout_p)
        grads.append(torch.autograd.grad(out, (qr, kr, vr), do))
    for got in grads[1:]:
        for a, b in zip(got, grads[0]):
            assert torch.equal(a, b)
    if dropout_p > 0:
        return
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    sink, _ = ref_attention(qr, kr, vr, "sinkhorn", key_mask=km, query_mask=qm, iters=3, scale=0.3)
    soft, _ = ref_attention(qr, kr, vr, "softmax", key_mask=km, query_mask=qm, scale=0.3)
    ref = (0.7 * sink + 0.3 * soft) * qm[:, None, :, None]
    want = torch.autograd.grad(ref, (qr, kr, vr), do)
    for a, b in zip(grads[0], want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


def _dominated(big):
    """Query 0 outscores every other query on every key by ~big / sqrt(8): the first row step's potentials
    a^1 spread over ~big, so the bound on round 2's column maxima is that far above them."""
    g = torch.Generator().manual_seed(9)
    q = torch.randn(1, 2, 150, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 300, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 300, 8, generator=g, dtype=torch.float64)
    k[..., 0] = k[..., 0].abs() + 1.0
    q[..., 0, :] = 0.0
    q[..., 0, 0] = big
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("big", [0.0, 80.0, 400.0])
def test_column_bounds_of_later_rounds_match_reference(dtype, big):
    """From round 2 on the forward takes its exponentials against a bound on the column maxima
    (-b^{t-1} + max_i (a^{t-1} - a^{t-2})) when it is within 25 (float32) / 300 (float64) of them, else
    against the maxima: both give the float64 reference, including rows far below the others."""
    q, k, v = _dominated(big)
    ref, _ = ref_attention(q, k, v, "sinkhorn", iters=3, scale=8**-0.5)
    x = [t.to(dtype).reshape(2, -1, 8) for t in (q, k, v)]
    out, a_all, _, _, _ = torch.ops.attnkit_cpu.potentials_forward(
        *x, None, None, 2, 8**-0.5, 3, False, 0.0, 0, 2**30, 256
    )  # (B*H, Lq, Dv), (k + 1, B*H, Lq)
    d = (a_all[1] - a_all[0]).double()  # round 2's gap above the column maxima: log(n) + max d - min d
    gap = (torch.log(torch.tensor(150.0)) + d.amax(-1) - d.amin(-1)).max().item()
    if big == 80.0:
        assert gap > 25  # float32 takes the maxima in round 2, float64 the bound
    # float32 scores of a few hundred (big=400) carry rounding errors of ~1e-5 into the exponents
    tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-12, "rtol": 1e-10}
    torch.testing.assert_close(out.double().view(1, 2, 150, 8), ref, **tol)


def test_scratch_is_kept_between_calls_bounded_and_released(monkeypatch):
    """Blocks of 2 MiB and more (here the kept exponentials of a 1024 x 1024 head, 4 MiB) stay allocated for
    the next call, which reuses them without their old contents leaking into its results."""
    from attnkit.kernels.cpp_potentials import release_scratch, scratch_bytes

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 1024, 16, generator=g) for _ in range(3))
    other = [torch.randn(1, 2, 1024, 16, generator=g) * 3 for _ in range(3)]
    sink = ak.Sinkhorn(iters=3)
    release_scratch()
    assert scratch_bytes() == 0
    first = ak.attention(q, k, v, sink, backend="efficient")
    kept = scratch_bytes()
    assert 4 * 2**20 <= kept <= 128 * 2**20
    ak.attention(*other, sink, backend="efficient")  # dirties the kept blocks
    assert torch.equal(ak.attention(q, k, v, sink, backend="efficient"), first)
    monkeypatch.setattr(cpp_potentials, "SCORE_CACHE_BYTES", 256 * 2**20)
    for L in (2048, 4096, 6144):  # 16 + 64 + 144 MiB of kept values: the pool stays within its bound
        x = torch.randn(1, 1, L, 16, generator=g)
        ak.attention(x, x, x, sink, backend="efficient")
        assert scratch_bytes() <= 128 * 2**20
    release_scratch()
    assert scratch_bytes() == 0
    assert torch.equal(ak.attention(q, k, v, sink, backend="efficient"), first)


# A head alone (B * H = 1 < 2 threads) has its query chunks spread over the threads; the same head
# dealt to one thread (two heads, one per thread) runs every chunk itself. With chunks of 128 rows, 600
# queries make 5 chunks, 3 on one thread and 2 on the other, the last one short. The bits agree: dK / dV are
# added up per chunk in chunk order (not per thread), and the products a spread head makes outside the
# parallel loop (the chunks' score bounds, robust rows and columns) are loops, not BLAS calls (MKL split the
# bounds' few-row product over its own threads and rounded the short chunk's row differently on AMD EPYC).
@pytest.mark.parametrize("iters,hybrid", [(0, False), (1, False), (1, True), (3, False)])
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_a_head_gives_the_same_bits_spread_over_the_threads_or_on_one(iters, hybrid, dropout_p, num_threads,
                                                                       monkeypatch):
    num_threads(2)
    monkeypatch.setattr(cpp_potentials, "QUERY_CHUNK_ROWS", 128)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 1, L, 16, generator=g) for L in (600, 290, 290))
    km = torch.arange(290)[None] < 270
    u = torch.tensor(0.7) if hybrid else None

    def run(copies):
        x = [t.expand(1, copies, -1, -1).clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(5)  # the dropout seed; the hash covers (head, query, key): head 0 is the same
        out = fused_cpu_attention(*x, key_mask=km, query_mask=None, scale=0.25, iters=iters, u=u,
                                  dropout_p=dropout_p)
        do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        grads = torch.autograd.grad(out, x, do)
        return [t[:, :1] for t in (out.detach(), *grads)]

    for a, b in zip(run(1), run(2)):  # spread over the threads, then dealt to one
        assert torch.equal(a, b)
