"""attnkit.hf.attention_forward with a float additive attention_mask of 0 and small negative values.

Such a mask (ALiBi-like position biases, a user's soft mask) is a bias, not padding: only transformers' own
masks of 0 and ``finfo(dtype).min`` may be read as boolean. References are float64 ``ak.attention``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import attnkit as ak
from attnkit.hf import attention_forward

pytestmark = pytest.mark.hf


def _module(mechanism):
    m = nn.Module()
    m.is_causal = False
    m.attnkit_mechanism = ak.resolve_mechanism(mechanism)
    m.attnkit_self_attention = True
    return m


@pytest.mark.parametrize("mechanism", ["softmax", "dnas"])
def test_a_float_mask_of_zero_and_small_negatives_is_an_additive_bias(mechanism):
    """A float mask with 0 on the diagonal and -0.5 |i - j| elsewhere was read as boolean when every value
    >= 0 counted as allowed (the diagonal only): DNAS was 2.20 off the float64 reference instead of 4e-16."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))  # (B, H, L, D)
    i = torch.arange(4.0, dtype=torch.float64)
    alibi = (-0.5 * (i[:, None] - i[None, :]).abs())[None, None]  # (1, 1, 4, 4), all <= 0
    out, _ = attention_forward(_module(mechanism), q, k, v, alibi, scaling=8**-0.5)  # (B, L, H, D)
    ref = ak.attention(q, k, v, mechanism, attn_mask=alibi, backend="reference")  # (B, H, L, D)
    torch.testing.assert_close(out.transpose(1, 2), ref, atol=1e-12, rtol=1e-10)
