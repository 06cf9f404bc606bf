"""Scoring never counts a display mark (a generated pad / bos / eos, or an ``<unk>``) as a target token, and
sample tables that show one say what it means."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from attnkit.data.tokenizers import DISPLAY_MARKS, GENERATED_BOS, GENERATED_EOS, GENERATED_PAD
from attnkit.data.transduction import TokenVocab
from attnkit.runner.config import build_config
from attnkit.runner.report_extras import extra_sections, marks_legend
from attnkit.runner.tasks import get_task
from attnkit.runner.transduction import TransductionTask


def test_an_all_pad_model_scores_zero_on_targets_holding_the_empty_set(tmp_path):
    # a set-theory file whose targets are "{k}" or "∅": an all-<pad> model scored sequence_accuracy 0.5
    rows = [{"kind": "seq2seq"}]
    for split, n in (("train", 12), ("test", 6)):
        rows += [{"split": split, "source": f"A{k} and B{k % 3}", "target": "\u2205" if k % 2 else f"{{{k}}}"}
                 for k in range(n)]
    path = tmp_path / "sets.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    task = get_task(str(path))
    data = task.prepare(build_config({"task": str(path)}))
    tok = data.tokenizer
    out = torch.tensor([[tok.pad_id, tok.eos_id]] * data.test_tgt.shape[0])  # (N, 2): <pad> then <eos>
    preds = tok.decode(out, generated=True)
    assert preds == [GENERATED_PAD] * 6
    assert task.metrics(data, preds)["sequence_accuracy"] == 0.0
    assert not any(task.correct(data, preds))


def test_a_generated_special_never_matches_a_raw_reference_character():
    # a test target's character outside the vocabulary stays raw in the reference: "a ∅" matched <pad>
    vocab = TokenVocab.fit(["a b"], "words")
    data = SimpleNamespace(tgt_vocab=vocab, test_tgt_texts=["a \u2205", "a \u25b7", "a \u25c1"])
    a = vocab.index["a"]
    preds = [vocab.join(vocab.decode_ids([a, vocab.pad_id, vocab.eos_id], generated=True)),
             vocab.join(vocab.decode_ids([a, vocab.bos_id, vocab.eos_id], generated=True)),
             vocab.join(vocab.decode_ids([a, vocab.eos_id], generated=True, eos_ends=False))]
    assert preds == [f"a {GENERATED_PAD}", f"a {GENERATED_BOS}", f"a {GENERATED_EOS}"]
    task = TransductionTask("copy")
    assert task.correct(data, preds) == [False, False, False]
    assert task.metrics(data, preds) == {"sequence_error_rate": 1.0, "token_error_rate": 0.5}


def test_a_sample_table_showing_a_mark_has_a_legend_naming_it():
    rows = [["12", "12", f"\u2717 1{GENERATED_PAD}"], ["3", "3", "\u2713 3"]]
    legend = marks_legend([row[2] for row in rows])
    assert len(legend) == 1 and f"{GENERATED_PAD} a generated &lt;pad&gt;" in legend[0]
    assert all(m not in legend[0] for m in DISPLAY_MARKS if m != GENERATED_PAD)
    assert marks_legend(["12", "\u2713 12"]) == []
    extras = {"samples": {"header": ["source", "target", "softmax (seed 0)"], "rows": rows, "differing": 1}}
    html = "\n".join(extra_sections(extras, {}))
    assert html.index('id="samples"') < html.index("a generated &lt;pad&gt;")


def test_a_mark_in_the_source_or_reference_text_gets_no_legend():
    # the legend scanned every cell: a source text (or a classification text) holding the empty set as data
    # was explained as "a generated <pad>"
    rows = [[f"A {GENERATED_PAD} B", f"x{GENERATED_PAD}", "\u2713 12"]]
    extras = {"samples": {"header": ["source", "target", "softmax (seed 0)"], "rows": rows, "differing": 1}}
    assert "Marks:" not in "\n".join(extra_sections(extras, {}))
