"""Hybrid attention (HNAS), "Doubly-Normalized Attention" section 6 / "Attention that does not Explain Away"
(arXiv:2009.14308) section 5: u * DNAS + (1 - u) * softmax."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attnkit as ak
from attnkit.mechanisms import check_hybrid_weight, sigmoid_weight
from tests._reference import random_qkv, ref_attention


def test_gradient_wrt_per_head_u_matches_closed_form(backend):
    """d out / d u_h = out^D_h - out^L_h (the output is linear in u)."""
    q, k, v = random_qkv(2, 2, 4, 5, seed=2)
    u = torch.tensor([0.3, 0.8], dtype=torch.float64, requires_grad=True)
    out = ak.attention(q, k, v, "hnas", hybrid_weight=u, backend=backend)
    (du,) = torch.autograd.grad(out.sum(), u)
    diff = ak.attention(q, k, v, "dnas", backend=backend) - ak.attention(q, k, v, "softmax", backend=backend)
    torch.testing.assert_close(du, diff.sum(dim=(0, 2, 3)), atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize(
    "u", [0.0, torch.tensor(0.0), torch.zeros(2)], ids=["float", "scalar-tensor", "per-head"]
)
def test_u_zero_equals_softmax(backend, u):
    q, k, v = random_qkv(2, 2, 4, 5, seed=3)
    m = torch.tensor([[True] * 5, [True, True, True, False, False]])
    expected = ak.attention(q, k, v, "softmax", key_mask=m, backend=backend)
    torch.testing.assert_close(
        ak.attention(q, k, v, "hnas", hybrid_weight=u, key_mask=m, backend=backend),
        expected,
        atol=1e-12,
        rtol=0,
    )


@pytest.mark.parametrize(
    "u", [1.0, torch.tensor(1.0), torch.ones(2)], ids=["float", "scalar-tensor", "per-head"]
)
def test_u_one_equals_dnas(backend, u):
    q, k, v = random_qkv(2, 2, 4, 5, seed=4)
    m = torch.tensor([[True] * 5, [True, True, True, False, False]])
    expected = ak.attention(q, k, v, "dnas", key_mask=m, backend=backend)
    torch.testing.assert_close(
        ak.attention(q, k, v, "hnas", hybrid_weight=u, key_mask=m, backend=backend),
        expected,
        atol=1e-12,
        rtol=0,
    )


def test_per_head_u_mixes_each_head_separately(backend):
    q, k, v = random_qkv(2, 2, 4, 5, seed=5)
    u = torch.tensor([0.0, 1.0], dtype=torch.float64)
    out = ak.attention(q, k, v, "hnas", hybrid_weight=u, backend=backend)
    torch.testing.assert_close(
        out[:, 0], ak.attention(q, k, v, "softmax", backend=backend)[:, 0], atol=1e-12, rtol=0
    )
    torch.testing.assert_close(
        out[:, 1], ak.attention(q, k, v, "dnas", backend=backend)[:, 1], atol=1e-12, rtol=0
    )


def test_per_batch_and_head_u(backend):
    q, k, v = random_qkv(2, 2, 3, 4, seed=6)
    u = torch.tensor([[0.1, 0.6], [0.9, 0.4]], dtype=torch.float64).view(2, 2, 1, 1)
    out = ak.attention(q, k, v, "hnas", hybrid_weight=u, backend=backend)
    expected, _ = ref_attention(q, k, v, "hnas", u=u)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-8)


def test_weights_are_the_convex_mix():
    q, k, v = random_qkv(2, 2, 4, 5, seed=7)
    s = ak.scores.scaled_dot(q, k)
    w = ak.normalize(s, "hnas", hybrid_weight=0.3)
    torch.testing.assert_close(
        w, 0.3 * ak.normalize(s, "dnas") + 0.7 * ak.normalize(s, "softmax"), atol=1e-12, rtol=0
    )
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 4, dtype=torch.float64), atol=1e-12, rtol=0)


def test_config_u0_is_the_default_weight():
    q, k, v = random_qkv(1, 2, 3, 4, seed=8)
    torch.testing.assert_close(
        ak.attention(q, k, v, ak.Hybrid(u0=0.1)), ak.attention(q, k, v, "hnas", hybrid_weight=0.1)
    )
    torch.testing.assert_close(
        ak.attention(q, k, v, "hnas"), ak.attention(q, k, v, "hnas", hybrid_weight=0.5)
    )


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _syncs(ops):
    return [op for op in ops if "_local_scalar_dense" in op or "is_nonzero" in op or "item" in op]


def test_module_weight_sigmoid_theta_is_not_read_back_but_a_user_tensor_is():
    """``sigmoid(theta)`` cannot leave [0, 1]: checking its values would cost a host sync on every call."""
    theta = torch.tensor([0.3, -2.0], requires_grad=True)
    like = torch.zeros(1, 2, 3, 4)
    with _RecordOps() as rec:
        check_hybrid_weight(sigmoid_weight(theta), 2, like)
    assert _syncs(rec.ops) == []
    with _RecordOps() as rec:
        check_hybrid_weight(torch.sigmoid(theta), 2, like)
    assert _syncs(rec.ops)  # a tensor the user built is checked
    with pytest.raises(ValueError, match="outside"):
        check_hybrid_weight(torch.tensor([0.5, 1.5]), 2, like)
