"""``attnkit.hf.finetune``: ``FinetuneConfig`` refuses bad values when it is built (before any model loads),
and dataset folders (``train.tsv``/``test.tsv``) are read as UTF-8 with errors that name the file and line."""

from __future__ import annotations

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
