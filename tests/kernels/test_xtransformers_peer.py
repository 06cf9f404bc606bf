"""x-transformers' inverted attention (kernels/xtransformers_peer.py) is DNAS: it matches attnkit's."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.kernels.xtransformers_peer import xtransformers_available, xtransformers_call


@pytest.mark.skipif(not xtransformers_available(), reason="x-transformers is not installed ([bench] extra)")
def test_inverted_attention_matches_dnas_reference():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g, dtype=torch.float64) for n in (9, 11, 11))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = xtransformers_call("dnas")(q, k, v)
    ref = ak.attention(q, k, v, "dnas", backend="reference")
    # its softmax runs in float32 (dtype=torch.float32), hence the float32-sized tolerance
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    gq, gk, gv = torch.autograd.grad(out.sum(), (q, k, v))
    rq, rk, rv = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in ((gq, rq), (gk, rk), (gv, rv)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_mechanisms_without_an_option_are_refused():
    for mechanism in ("hnas", "sinkhorn", "coda"):
        with pytest.raises(ValueError, match="no option"):
            xtransformers_call(mechanism)
