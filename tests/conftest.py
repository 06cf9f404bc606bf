"""Shared fixtures: the ``backend`` fixture runs every attention test on each backend."""

from __future__ import annotations

import os

# Triton kernels run in Triton's interpreter on the CPU; it must be chosen before triton is first imported,
# and importing torch imports triton where it is installed (torch 2.13), so before torch. On a GPU machine,
# TRITON_INTERPRET=0 in the environment compiles them instead (tests/cuda).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import attnkit as ak  # noqa: E402
from tests._reference import random_qkv, ref_attention  # noqa: E402

BACKENDS_UNDER_TEST = ("reference", "efficient")


@pytest.fixture(scope="session", params=BACKENDS_UNDER_TEST)
def backend(request) -> str:
    """Each attention backend by name (``"efficient"`` is ``attnkit.kernels``, which ships with the
    package)."""
    return request.param


def _masks(B: int, Lq: int, Lk: int, seed: int) -> dict:
    """Padding on both sides plus a random boolean attn_mask (some rows/columns end up empty)."""
    g = torch.Generator().manual_seed(seed)
    key_mask = torch.arange(Lk)[None, :] < torch.randint(1, Lk + 1, (B, 1), generator=g)
    key_mask[0] = True
    query_mask = torch.arange(Lq)[None, :] < torch.randint(1, Lq + 1, (B, 1), generator=g)
    query_mask[0] = True
    attn_mask = torch.rand(B, 1, Lq, Lk, generator=g) < 0.8
    return {"key_mask": key_mask, "query_mask": query_mask, "attn_mask": attn_mask}


@pytest.fixture
def compare_with_reference():
    """``check(case, backend, ...)``: ``ak.attention`` outputs and gradients wrt q, k, v (and a tensor
    ``hybrid_weight`` that requires grad) equal the float64 reference of ``tests/_reference.py``."""

    def check(case, backend, *, B=2, H=2, Lq=5, Lk=6, D=4, Dv=3, seed=0, masked=True):
        q, k, v = random_qkv(B, H, Lq, Lk, D=D, Dv=Dv, seed=seed, requires_grad=True)
        masks = _masks(B, Lq, Lk, seed) if masked else {}
        call, ref = dict(case.call), dict(case.ref)
        inputs = [q, k, v]
        u = call.get("hybrid_weight")
        if isinstance(u, torch.Tensor):
            u = u.detach().clone().requires_grad_()
            call["hybrid_weight"], ref["u"] = u, u
            inputs.append(u)
        out = ak.attention(q, k, v, case.attnkit_mechanism(ak), backend=backend, **call, **masks)
        expected, _ = ref_attention(q, k, v, case.ref_mechanism, **ref, **masks)
        torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-8)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=out.dtype)
        mine = torch.autograd.grad((out * g).sum(), inputs)
        theirs = torch.autograd.grad((expected * g).sum(), inputs)
        for name, a, b in zip(("q", "k", "v", "u"), mine, theirs):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8, msg=lambda m, name=name: f"d{name}: {m}")
        return out

    return check


@pytest.fixture
def gradcheck_attention():
    """``check(case, backend)``: ``torch.autograd.gradcheck`` in float64 on a small masked problem.

    The problem is the smallest that reaches every branch: batch element 0 unpadded, element 1 padded on
    both sides, a random boolean ``attn_mask`` that empties some rows and columns, two heads (per-head ``u``).
    ``fast_mode=True`` checks a random projection ``v^T J u`` of the Jacobian (PyTorch's fast gradcheck)
    instead of every entry: for variants of a mechanism whose branches a full check already covers."""

    def check(case, backend, *, B=2, H=2, Lq=3, Lk=4, D=3, seed=0, fast_mode=False, **extra):
        q, k, v = random_qkv(B, H, Lq, Lk, D=D, Dv=2, seed=seed, requires_grad=True)
        masks = _masks(B, Lq, Lk, seed)
        mechanism = case.attnkit_mechanism(ak)
        call = dict(case.call)
        inputs = [q, k, v]
        u = call.pop("hybrid_weight", None)
        if isinstance(u, torch.Tensor):
            inputs.append(u.detach().clone().requires_grad_())

            def fn(q, k, v, u):
                return ak.attention(
                    q, k, v, mechanism, backend=backend, hybrid_weight=u, **call, **masks, **extra
                )
        else:
            if u is not None:
                call["hybrid_weight"] = u

            def fn(q, k, v):
                return ak.attention(q, k, v, mechanism, backend=backend, **call, **masks, **extra)

        assert torch.autograd.gradcheck(
            fn, tuple(inputs), eps=1e-6, atol=1e-6, rtol=1e-4, fast_mode=fast_mode
        )

    return check
