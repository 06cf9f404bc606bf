"""GMMLocationAttention builds on the meta device (its initial bias is computed with Python math)."""

import torch

from attnkit.nn.location import GMMLocationAttention


def test_builds_on_meta_device():
    with torch.device("meta"):
        m = GMMLocationAttention(8, 2)
    assert m.proj.weight.is_meta
