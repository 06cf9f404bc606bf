"""The explaining-away numbers of a compare run are the mechanism's self-attention's."""

from __future__ import annotations

from types import SimpleNamespace

import torch

import attnkit as ak
from attnkit.runner.train import _explain_away


class _Seq2Seq(torch.nn.Module):
    """A DNAS encoder self-attention and a softmax cross-attention whose weights all go to key 0."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = ak.nn.MultiheadAttention(4, 1, mechanism="dnas", batch_first=True)
        self.cross = ak.nn.MultiheadAttention(4, 1, batch_first=True)

    def forward(self, src, tgt):
        memory, _ = self.encoder(src, src, src)
        hot = torch.zeros_like(memory)
        hot[:, 0] = 50.0  # the cross-attention's keys: key 0 takes every query's weight
        return self.cross(tgt, hot, memory)[0]


def test_a_softmax_cross_attention_does_not_count_as_the_mechanisms_explaining_away():
    # counted in, the cross-attention's keys 1..5 (weight ~0) put a DNAS run below its Lemma 1 bound (0.518)
    torch.manual_seed(0)
    model = _Seq2Seq()
    with torch.no_grad():
        model.cross.in_proj_weight.copy_(torch.eye(4).repeat(3, 1))
        model.cross.in_proj_bias.zero_()
    src, tgt = torch.randn(2, 6, 4), torch.ones(2, 3, 4)
    task = SimpleNamespace(
        num_eval=lambda data: 2,
        forward_for_diagnostics=lambda net, data, idx, config, device: net(src[idx], tgt[idx]),
    )
    accelerator = SimpleNamespace(unwrap_model=lambda m: m, device=torch.device("cpu"))
    config = SimpleNamespace(explain_away_samples=2, batch_size=2)
    stats = _explain_away(accelerator, task, None, model, config)
    assert stats["calls"] == 1 and stats["min_normalized"] >= 1 - 1e-5
