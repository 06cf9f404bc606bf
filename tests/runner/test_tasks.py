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


def test_sentence_pairs_keep_both_sentences_cut_longest_first(tmp_path, monkeypatch):
    """Pairs were joined as "a | b" and cut at max_len on the right: a first sentence of max_len tokens pushed
    the second one out whole. Both are kept now, the longer one cut first (transformers' "longest_first")."""
    from attnkit.data.containers import TextClassificationData
    from attnkit.runner import build_config
    from attnkit.runner.tasks import ClassificationTask
    from tests.runner._fixtures import tiny_overrides, write_classification_file

    long_first = " ".join(f"w{i}" for i in range(20))
    pairs = TextClassificationData(
        name="pairs", train_texts=[long_first, "short one"], train_labels=[0, 1],
        test_texts=["w0 w1 w2 w3 w4 w5", long_first], test_labels=[1, 0], label_names=["no", "yes"],
        train_text_pairs=["x y z", "p q r s t u v w"], test_text_pairs=["x y", "x y z"],
    )
    config = build_config(tiny_overrides(write_classification_file(tmp_path / "t.json"), tmp_path / "o",
                                         max_len=8))
    task = ClassificationTask("pairs")
    monkeypatch.setattr(task, "load", lambda cfg: pairs)
    data = task.prepare(config)
    words = lambda ids, mask: [data.tokenizer.vocab[i] for i in ids[mask].tolist()]  # noqa: E731
    assert words(data.train_ids[0], data.train_mask[0]) == ["w0", "w1", "w2", "w3", "|", "x", "y", "z"]
    assert words(data.train_ids[1], data.train_mask[1]) == ["short", "one", "|", "p", "q", "r", "s", "t"]
    assert words(data.test_ids[0], data.test_mask[0]) == ["w0", "w1", "w2", "w3", "w4", "|", "x", "y"]
    assert words(data.test_ids[1], data.test_mask[1])[-4:] == ["|", "x", "y", "z"]
    assert data.test_texts == ["w0 w1 w2 w3 w4 w5 | x y", f"{long_first} | x y z"]  # shown whole
