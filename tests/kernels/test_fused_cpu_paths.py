"""The C++ CPU kernels' inference path (nothing saved for backward) and their work-balanced threading:
both must give bit-identical results to the training path and to one thread."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.kernels import cpu_ext

pytestmark = pytest.mark.skipif(not cpu_ext.load(warn=False), reason="C++ CPU kernels not built")

MECHS = {
    "dnas": ("dnas", {}), "hnas": ("hnas", {"hybrid_weight": 0.4}),
    "sinkhorn3": ("sinkhorn", {"sinkhorn_iters": 3}),
}


def _padded(lengths, H=3, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, L = len(lengths), max(lengths)
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    mask = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]  # (B, L)
    return q, k, v, mask


@pytest.mark.parametrize("name", list(MECHS))
def test_inference_output_is_bit_identical_to_training(name):
    mech, kw = MECHS[name]
    q, k, v, mask = _padded([37, 20, 5, 37])
    train = ak.attention(
        *(t.clone().requires_grad_() for t in (q, k, v)), mech, key_mask=mask, query_mask=mask, **kw
    )
    assert train.grad_fn is not None
    with torch.no_grad():
        infer = ak.attention(q, k, v, mech, key_mask=mask, query_mask=mask, **kw)
    plain = ak.attention(q, k, v, mech, key_mask=mask, query_mask=mask, **kw)  # no input requires grad
    assert infer.grad_fn is None and plain.grad_fn is None
    assert torch.equal(train.detach(), infer) and torch.equal(infer, plain)


@pytest.mark.parametrize("name", list(MECHS))
def test_uneven_padded_batch_gives_the_same_bits_on_one_and_two_threads(name):
    """Long and short sequences in a batch are split over the threads by work; every (batch, head) problem
    is computed once, independently of the schedule."""
    mech, kw = MECHS[name]
    q, k, v, mask = _padded([96, 70, 40, 10, 0, 3])  # includes an all-padding element

    def run():
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        out = ak.attention(qs, ks, vs, mech, key_mask=mask, query_mask=mask, **kw)
        out.backward(torch.ones_like(out))
        return out.detach(), qs.grad, ks.grad, vs.grad

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two):
        assert torch.equal(a, b)
    assert torch.all(one[0][4] == 0)  # the all-padding element returns zeros
