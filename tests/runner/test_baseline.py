"""The no-attention baseline row of ``attnkit compare``: uniform weights over the real tokens."""

from __future__ import annotations

import pytest
import torch

from attnkit.runner.baseline import MeanPoolClassifier
from attnkit.runner.config import CompareConfig
from tests.runner._fixtures import write_classification_file, write_seq2seq_jsonl


def test_baseline_logits_ignore_padding_and_token_order():
    torch.manual_seed(0)
    model = MeanPoolClassifier(
        vocab_size=20, num_classes=3, d_model=8, dim_feedforward=16, dropout=0.0
    ).eval()
    ids = torch.tensor([[3, 5, 7, 0, 0], [7, 3, 5, 9, 9]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    logits = model(ids, mask)  # padded positions hold different ids in the two rows
    torch.testing.assert_close(logits[0], logits[1])
    assert logits.shape == (2, 3)


def test_baseline_mean_is_uniform_attention():
    model = MeanPoolClassifier(vocab_size=10, num_classes=2, d_model=4, dim_feedforward=8, dropout=0.0).eval()
    ids = torch.tensor([[1, 2, 3]])
    expected = model.ff(model.norm(model.embed(ids).mean(1)))
    torch.testing.assert_close(model(ids), expected)


def test_config_accepts_none_for_classification_and_rejects_it_for_seq2seq(tmp_path):
    assert CompareConfig(mechanisms="softmax,none").mechanisms == ("softmax", "none")
    with pytest.raises(ValueError, match="classification"):
        CompareConfig(task="mlu", mechanisms="softmax,none")
    # a seq2seq dataset file too: it was accepted, and the run failed after the softmax runs had trained
    path = str(write_seq2seq_jsonl(tmp_path / "reverse.jsonl"))
    with pytest.raises(ValueError, match="is for classification tasks; drop it"):
        CompareConfig(task=path, mechanisms="softmax,none")
    assert CompareConfig(task=str(write_classification_file(tmp_path / "t.json")), mechanisms="none")


def test_alignment_on_a_recurrent_transduction_task_is_refused_up_front():
    """It failed inside the first run ("RNNSeq2Seq has no self-attention layer"), leaving a run folder."""
    with pytest.raises(ValueError, match="recurrent encoder-decoders without self-attention"):
        CompareConfig(task="copy", mechanisms="vanilla,additive", align="none,ct")
    assert CompareConfig(task="copy", mechanisms="additive").align == ("none",)


def test_compare_reports_a_no_attention_row(tmp_path):
    from attnkit.runner import build_config, run_compare
    from tests.runner._fixtures import tiny_overrides, write_classification_file

    data = write_classification_file(tmp_path / "topics.json")
    overrides = tiny_overrides(data, tmp_path / "out")
    overrides["mechanisms"] = "softmax,none"
    result = run_compare(build_config(overrides))
    rows = {r["mechanism"]: r for r in result.records}
    assert set(rows) == {"softmax", "none"}
    assert rows["none"]["explain_away_min_normalized"] is None and rows["none"]["n_seeds"] >= 1
    assert "none" in (result.out / "report.html").read_text()
