"""The L1 distances of CoDA's gate (kernels/l1_distance.py, csrc/l1_distance_cpu.cpp) against
torch.cdist(p=1)."""

from __future__ import annotations

import pytest
import torch

from attnkit.kernels import cpu_ext
from attnkit.kernels.l1_distance import l1_distance

pytestmark = pytest.mark.skipif(not cpu_ext.load(warn=False), reason="C++ CPU kernels not built")


def _xy(N, n, m, D, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, n, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    y = torch.randn(N, m, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    return x, y


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "shape", [(1, 1, 1, 1), (3, 7, 5, 3), (2, 130, 37, 64), (1, 5, 100, 17), (2, 67, 16, 8)]
)
def test_matches_cdist_and_its_gradients(dtype, shape):
    """Shapes that leave partial register tiles (queries % 4, keys % 16) and several query chunks."""
    x, y = _xy(*shape, dtype=dtype)
    mine, theirs = l1_distance(x, y), torch.cdist(x, y, p=1)
    tol = dict(atol=1e-12, rtol=1e-12) if dtype == torch.float64 else dict(atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(mine, theirs, **tol)
    g = torch.randn(mine.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    for a, b in zip(torch.autograd.grad(mine, (x, y), g), torch.autograd.grad(theirs, (x, y), g)):
        torch.testing.assert_close(a, b, **tol)


def test_gradcheck_float64():
    x, y = _xy(2, 6, 9, 5)
    assert torch.autograd.gradcheck(l1_distance, (x, y))


def test_ties_have_zero_gradient():
    x = torch.tensor([[[1.0, 2.0]]], dtype=torch.float64, requires_grad=True)
    y = torch.tensor([[[1.0, 0.0], [3.0, 2.0]]], dtype=torch.float64, requires_grad=True)
    d = l1_distance(x, y)
    torch.testing.assert_close(d, torch.tensor([[[2.0, 2.0]]], dtype=torch.float64))
    dx, dy = torch.autograd.grad(d.sum(), (x, y))
    torch.testing.assert_close(dx, torch.tensor([[[-1.0, 1.0]]], dtype=torch.float64))  # ties add 0
    torch.testing.assert_close(dy, torch.tensor([[[0.0, -1.0], [1.0, 0.0]]], dtype=torch.float64))


def test_one_problem_split_over_threads_matches_cdist():
    """N = 1 < threads: the backward pass gives each query range its own dy partial."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 3))
    try:
        x, y = _xy(1, 300, 45, 12)
        g = torch.randn(1, 300, 45, dtype=torch.float64)
        mine = torch.autograd.grad(l1_distance(x, y), (x, y), g)
        theirs = torch.autograd.grad(torch.cdist(x, y, p=1), (x, y), g)
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b)
    finally:
        torch.set_num_threads(threads)


def test_empty_and_mismatched_shapes():
    x, y = _xy(2, 0, 4, 3)
    assert l1_distance(x, y).shape == (2, 0, 4)
    with pytest.raises(ValueError, match=r"expected \(N, n, D\)"):
        l1_distance(torch.zeros(2, 3, 4), torch.zeros(2, 3, 5))


def test_the_gradient_under_create_graph_equals_the_kernels_and_is_differentiable():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(3, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    plain = torch.autograd.grad((l1_distance(x, y) * w).sum(), (x, y))
    graph = torch.autograd.grad((l1_distance(x, y) * w).sum(), (x, y), create_graph=True)
    for a, b in zip(plain, graph):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    (dw,) = torch.autograd.grad(graph[0].pow(2).sum(), w)  # the gradient depends on w through G
    assert dw.abs().sum() > 0
