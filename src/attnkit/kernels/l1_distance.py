"""Batched L1 distances ``||x_i - y_j||_1`` for CoDA's gate (CoDA eq. (10); docs/design.md section 3).

On the CPU, with the C++ extension built, ``csrc/l1_distance_cpu.cpp`` (register tiles over transposed
keys, forward and backward); elsewhere ``torch.cdist(p=1)``. Both avoid an ``(n, m, D)`` temporary.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..validators import EAGER_UNDER_COMPILE
from . import cpu_ext
from .autodiff import unsupported_autodiff

__all__ = ["l1_distance"]


class _L1Distance(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, y: Tensor) -> Tensor:
        ctx.save_for_backward(x, y)
        return torch.ops.attnkit_cpu.l1_distance(x, y)  # (N, n, m)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, y = ctx.saved_tensors
        functorch = torch._C._functorch
        batched = functorch.is_batchedtensor(grad) or functorch.is_legacy_batchedtensor(grad)
        # create_graph=True, or batched cotangents (is_grads_batched): the same gradient in plain operations
        if torch.is_grad_enabled() or batched:
            return _l1_backward_by_feature(grad, x.detach(), y.detach())
        dx, dy = torch.ops.attnkit_cpu.l1_distance_backward(grad, x, y)  # sum_j G sign(x - y), -sum_i ...
        return dx, dy


@torch.compiler.disable(reason=EAGER_UNDER_COMPILE)  # kernels opaque to the tracer: run eagerly
def l1_distance(x: Tensor, y: Tensor) -> Tensor:
    """``dist (N, n, m)`` with ``dist[b, i, j] = sum_d |x[b, i, d] - y[b, j, d]|``; ``x (N, n, D)``, ``y (N,
    m, D)``.

    The gradient is ``sign(x_i - y_j)`` weighted by the incoming gradient (0 at ties, as ``torch.cdist``).
    """
    if x.dim() != 3 or y.dim() != 3 or x.shape[0] != y.shape[0] or x.shape[2] != y.shape[2]:
        raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)}: expected (N, n, D) and (N, m, D)")
    same_float = x.dtype == y.dtype and x.dtype in (torch.float32, torch.float64)
    if unsupported_autodiff(x, y) is not None:  # torch.func transforms, forward-mode AD
        return _l1_by_feature(x, y)
    if x.device.type == "cpu" and same_float and cpu_ext.load():
        return _L1Distance.apply(x.contiguous(), y.contiguous())
    return torch.cdist(x, y, p=1)


def _l1_by_feature(x: Tensor, y: Tensor) -> Tensor:
    """``sum_d |x_id - y_jd|`` one feature at a time, in plain operations: every autodiff mode (torch.func,
    forward-mode AD, which ``torch.cdist`` lacks) supports them, and the memory stays ``(N, n, m)``."""
    dist = x.new_zeros(x.shape[0], x.shape[1], y.shape[1])  # (N, n, m)
    for d in range(x.shape[2]):
        dist = dist + (x[:, :, d, None] - y[:, None, :, d]).abs()
    return dist


def _l1_backward_by_feature(grad: Tensor, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """``dx_i = sum_j G_ij sign(x_i - y_j)``, ``dy_j = -sum_i G_ij sign(x_i - y_j)`` in plain operations (so
    differentiable in ``grad``; the signs are constants), one feature at a time: memory ``(N, n, m)``."""
    dx, dy = [], []
    for d in range(x.shape[2]):
        weighted = grad * torch.sign(x[:, :, d, None] - y[:, None, :, d])  # (N, n, m)
        dx.append(weighted.sum(2))
        dy.append(-weighted.sum(1))
    return torch.stack(dx, dim=2), torch.stack(dy, dim=2)  # (N, n, D), (N, m, D)
