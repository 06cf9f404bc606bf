"""Query-normalized mechanisms (dnas, hnas, sinkhorn) refuse causal orders of any kind, also the shortest
ones that are orders at all: three positions (two hold one chain of two key sets, which is not judged)."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak

QUERY_NORMALIZED = ("dnas", "hnas", "sinkhorn")
LEAK = "attn_mask is a causal pattern"


def _order(L: int, order: list[int]) -> torch.Tensor:
    """``(L, L)`` True = may attend: position ``order[j]`` sees the positions ``order[:j + 1]``."""
    allowed = torch.zeros(L, L, dtype=torch.bool)
    for j, i in enumerate(order):
        allowed[i, order[: j + 1]] = True
    return allowed


PATTERNS = {
    "right-to-left": torch.ones(3, 3, dtype=torch.bool).triu(),  # query i sees keys >= i
    "permuted 0, 2, 1": _order(3, [0, 2, 1]),  # an XLNet-style factorization order
}


def _qkv(L: int):
    torch.manual_seed(0)
    return tuple(torch.randn(1, 1, L, 4) for _ in range(3))  # (B, H, L, D) each


@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED)
@pytest.mark.parametrize("name", list(PATTERNS))
def test_three_position_orders_are_refused(mechanism, name):
    """Orders of three positions were let through (the order check started at four positions): under a
    right-to-left mask dnas's query 1 then moved by 0.95 when query 0, which comes after it, changed."""
    q, k, v = _qkv(3)
    with pytest.raises(ValueError, match=LEAK):
        ak.attention(q, k, v, mechanism, attn_mask=PATTERNS[name])


@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED)
def test_right_to_left_over_three_real_positions_of_five_is_refused(mechanism):
    """Padding does not count as positions of the order: three real positions right-to-left leak as well."""
    q, k, v = _qkv(5)
    real = torch.tensor([[True, True, True, False, False]])  # (B, L)
    with pytest.raises(ValueError, match=LEAK):
        ak.attention(q, k, v, mechanism, attn_mask=torch.ones(5, 5, dtype=torch.bool).triu(), key_mask=real,
                     query_mask=real)


@pytest.mark.parametrize("name", list(PATTERNS))
def test_softmax_and_coda_take_three_position_orders(name):
    """Softmax and CoDA normalize over keys: an order of any length is a mask like any other for them."""
    q, k, v = _qkv(3)
    for mechanism in ("softmax", "coda"):
        out = ak.attention(q, k, v, mechanism, attn_mask=PATTERNS[name])
        assert out.shape == (1, 1, 3, 4) and bool(torch.isfinite(out).all())
