"""``runner/tasks.py``: the built-in seq2seq task keeps to the configured lengths."""

from __future__ import annotations

import pytest
import torch

from attnkit.runner.config import CompareConfig
from attnkit.runner.tasks import get_task


def test_a_builtin_target_longer_than_max_target_len_is_refused_not_cut():
    """mlu with a max_target_len below its longest answer was cut silently (and scored cut)."""
    with pytest.raises(ValueError, match=r"task 'mlu', train\[\d+\]: the target has \d characters, more than "
                                         r"max_target_len=2 .* pass --set max_target_len=\d"):
        get_task("mlu").prepare(CompareConfig(task="mlu", max_train=50, max_eval=10, max_target_len=2))
    task = get_task("mlu")  # the preset's limits fit mlu: its targets are scored whole
    data = task.prepare(CompareConfig(task="mlu", max_train=200, max_eval=50, max_len=24, max_target_len=12))
    assert task._targets(data) == data.test_tgt_texts


class _NeverEnds(torch.nn.Module):
    """A decoder that never emits <eos>: it writes character id ``char`` until the cap."""

    def __init__(self, char: int) -> None:
        super().__init__()
        self.char = char

    def greedy_decode(self, src, src_mask, max_len, bos_id, eos_id):
        return torch.full((src.shape[0], max_len), self.char, dtype=torch.long)  # (B, T)


def test_decoding_has_room_for_the_longest_target_and_its_eos_only():
    """Decoding was capped at max_target_len + 2 tokens: one more than the longest target and its <eos>."""
    config = CompareConfig(task="mlu", max_train=50, max_eval=10, max_len=24, max_target_len=12)
    task = get_task("mlu")
    data = task.prepare(config)
    char = data.tokenizer.index["1"]
    preds = task.predict(_NeverEnds(char), data, torch.arange(3), config, "cpu")
    assert [len(p) for p in preds] == [config.max_target_len + 1] * 3
