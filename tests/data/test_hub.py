"""Hugging Face hub datasets: column mapping on local fixture files, the offline cache, fast failure."""

from __future__ import annotations

import json
import logging
import re
import time

import pytest

from attnkit.data import DatasetUnavailableError, fetch, hub, is_cached, load_dataset

pytest.importorskip("datasets")


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def sst2_dir(tmp_path):
    folder = tmp_path / "sst2"
    folder.mkdir()
    _jsonl(
        folder / "train.jsonl",
        [
            {"sentence": "a gripping film", "label": 1, "idx": 0},
            {"sentence": "dull and long", "label": 0, "idx": 1},
            {"sentence": "unlabeled row", "label": -1, "idx": 2},
        ],
    )
    _jsonl(folder / "validation.jsonl", [{"sentence": "fine work", "label": 1, "idx": 0}])
    return folder


def test_single_text_columns_map_to_texts_and_unlabeled_rows_drop(sst2_dir):
    data = load_dataset("sst2", source=sst2_dir)
    assert data.train_texts == ["a gripping film", "dull and long"] and data.train_labels == [1, 0]
    assert data.test_texts == ["fine work"] and data.test_labels == [1]
    assert data.label_names == ["negative", "positive"] and not data.is_pair


def test_pair_columns_from_parquet_map_to_text_pairs(tmp_path):
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "mrpc"
    folder.mkdir()
    for split, n in (("train", 3), ("test", 2)):
        rows = {
            "sentence1": [f"s1 {split} {i}" for i in range(n)],
            "sentence2": [f"s2 {split} {i}" for i in range(n)],
            "label": [i % 2 for i in range(n)],
            "idx": list(range(n)),
        }
        datasets.Dataset.from_dict(rows).to_parquet(str(folder / f"{split}.parquet"))
    data = load_dataset("mrpc", source=folder)
    assert data.is_pair and data.train_text_pairs == ["s2 train 0", "s2 train 1", "s2 train 2"]
    assert data.test_labels == [0, 1]
    assert data.joined_texts("test", sep=" || ") == ["s1 test 0 || s2 test 0", "s1 test 1 || s2 test 1"]


def test_fetch_from_source_writes_cache_that_loads_offline(sst2_dir, tmp_path, monkeypatch):
    fetch("sst2", cache_dir=tmp_path / "cache", source=sst2_dir)
    assert is_cached("sst2", tmp_path / "cache")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cached = load_dataset("sst2", cache_dir=tmp_path / "cache")
    direct = load_dataset("sst2", source=sst2_dir)
    assert (cached.train_texts, cached.train_labels, cached.test_texts) == (
        direct.train_texts,
        direct.train_labels,
        direct.test_texts,
    )


def test_a_relative_source_is_recorded_as_an_absolute_path(sst2_dir, tmp_path, monkeypatch):
    """The manifest recorded "--source data" as given: meaningless from any other working directory."""
    import json

    monkeypatch.chdir(sst2_dir.parent)
    fetch("sst2", cache_dir=tmp_path / "cache", source=sst2_dir.name)
    manifest = next((tmp_path / "cache").rglob("manifest.json"))
    assert json.loads(manifest.read_text())["source"] == str(sst2_dir.resolve())


def test_snli_pairs_from_csv_keep_three_classes(tmp_path):
    folder = tmp_path / "snli"
    folder.mkdir()
    header = "premise,hypothesis,label\n"
    (folder / "train.csv").write_text(
        header + "a man sleeps,a person rests,0\na dog runs,a cat sits,2\nx,y,-1\n"
    )
    (folder / "test.csv").write_text(header + "kids play,children play,1\n")
    data = load_dataset("snli", source=folder)
    assert data.train_labels == [0, 2] and data.test_text_pairs == ["children play"]
    assert data.label_names == ["entailment", "neutral", "contradiction"]


def test_wrong_columns_raise_clear_error(tmp_path):
    folder = tmp_path / "bad"
    folder.mkdir()
    _jsonl(folder / "train.jsonl", [{"text": "x", "label": 0}])
    _jsonl(folder / "test.jsonl", [{"text": "y", "label": 1}])
    with pytest.raises(ValueError, match=r"expected \['sentence', 'label'\]"):
        load_dataset("sst2", source=folder)


def test_out_of_range_label_raises(tmp_path):
    folder = tmp_path / "bad"
    folder.mkdir()
    _jsonl(folder / "train.jsonl", [{"sentence": "x", "label": 5}])
    _jsonl(folder / "test.jsonl", [{"sentence": "y", "label": 1}])
    with pytest.raises(ValueError, match="label 5 is not an integer in"):
        load_dataset("sst2", source=folder)


def test_source_without_split_files_names_what_is_needed(tmp_path):
    with pytest.raises(DatasetUnavailableError, match=r"needs train.<ext> and validation.<ext> \(or test"):
        load_dataset("sst2", source=tmp_path)


def test_offline_mode_fails_at_once_with_one_message(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(DatasetUnavailableError, match="HF_HUB_OFFLINE") as info:
        load_dataset("sst2", cache_dir=tmp_path, download=True)
    assert time.monotonic() - start < 2
    assert "attnkit data fetch sst2" in str(info.value) and "\n" not in str(info.value)
    # the command that takes a local copy ("--source DIR" alone named an option finetune and compare lack)
    assert "`attnkit data fetch sst2 --source DIR`" in str(info.value)


def test_unreachable_hub_fails_fast(tmp_path, monkeypatch):
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: connection refused at once
    start = time.monotonic()
    with pytest.raises(DatasetUnavailableError, match="cannot connect to 127.0.0.1:9"):
        fetch("mrpc", cache_dir=tmp_path)
    assert time.monotonic() - start < hub.CONNECT_TIMEOUT_S + 2
    assert not is_cached("mrpc", tmp_path)


@pytest.mark.parametrize("endpoint, message", [
    ("http://x:99999", r"HF_ENDPOINT='http://x:99999' is not a usable URL \(Port out of range"),
    ("::::", "HF_ENDPOINT='::::' names no host"),
])
def test_a_broken_hf_endpoint_is_named(tmp_path, monkeypatch, endpoint, message):
    """"Port out of range 0-65535" named no variable, and "::::" was reported as huggingface.co."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    with pytest.raises(DatasetUnavailableError, match=message):
        fetch("mrpc", cache_dir=tmp_path)


def test_hub_dataset_not_cached_names_fetch(tmp_path):
    with pytest.raises(DatasetUnavailableError, match="attnkit data fetch snli") as info:
        load_dataset("snli", cache_dir=tmp_path)
    assert "download=True" not in str(info.value)  # compare has no such option; its fix is data fetch


_GOOD = '{"sentence": "fine", "label": 1}\n{"sentence": "dull", "label": 0}\n'


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("train.jsonl", _GOOD + "{not json\n", r"train\.jsonl line 3 is not JSON"),
        ("train.jsonl", _GOOD + "[1, 2]\n", r"train\.jsonl line 3 is not a JSON object"),
        ("train.jsonl", "", r"train\.jsonl has no rows"),
        ("train.csv", "sentence,label\nfine,1\nx,1,2,3\n", r"train\.csv line 3: 4 field\(s\) where"),
        ("train.parquet", "garbage", r"cannot read .*train\.parquet"),
    ],
)
def test_unreadable_source_file_is_one_error_naming_file_and_line(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    test_text = _GOOD if name.endswith(".jsonl") else "sentence,label\nfine,1\n"
    if name.endswith(".parquet"):
        (tmp_path / "test.parquet").write_text("garbage")
    else:
        (tmp_path / f"test{name[5:]}").write_text(test_text)
    with pytest.raises(ValueError, match=message):
        load_dataset("sst2", source=tmp_path)


@pytest.mark.parametrize(
    "row, message",
    [
        ({"sentence": "x", "label": True}, "label True is not an integer"),
        ({"sentence": None, "label": 1}, "'sentence' holds None"),
        ({"sentence": 5, "label": 1}, "'sentence' holds 5"),
    ],
)
def test_labels_and_texts_of_the_wrong_type_are_not_converted(tmp_path, row, message):
    _jsonl(tmp_path / "train.jsonl", [row])
    (tmp_path / "test.jsonl").write_text(_GOOD)
    with pytest.raises(ValueError, match=message):
        load_dataset("sst2", source=tmp_path)


def test_test_split_without_labels_is_an_error_not_an_empty_test_set(tmp_path):
    (tmp_path / "train.jsonl").write_text(_GOOD)
    _jsonl(tmp_path / "test.jsonl", [{"sentence": "hidden", "label": -1}])  # GLUE's test split
    with pytest.raises(ValueError, match="test split has no labeled row"):
        load_dataset("sst2", source=tmp_path)


def test_a_full_local_copy_uses_the_catalogs_test_split_as_a_download_does(sst2_dir):
    """A copy of the whole hub dataset (train, validation and GLUE's unlabeled test) was refused: the
    unlabeled test split came first, though the catalog (and a download) take validation as the test set."""
    _jsonl(sst2_dir / "test.jsonl", [{"sentence": "hidden", "label": -1, "idx": 0}])
    data = load_dataset("sst2", source=sst2_dir)
    assert data.test_texts == ["fine work"] and data.test_labels == [1]


def test_csv_label_column_with_an_empty_cell_drops_that_row_and_keeps_the_integers(tmp_path):
    # pandas reads the label column as 1.0, NaN, 0.0
    (tmp_path / "train.csv").write_text("sentence,label\ngood film,1\nbad film,\nok,0\n")
    (tmp_path / "test.csv").write_text("sentence,label\nfine,1\n")
    data = load_dataset("sst2", source=tmp_path)
    assert data.train_texts == ["good film", "ok"] and data.train_labels == [1, 0]
    assert all(type(y) is int for y in data.train_labels)


@pytest.mark.parametrize("row, fields", [("shares fell,1", 2), ("a b,c d,1,", 4)])
def test_a_csv_row_with_fields_missing_or_extra_is_refused_by_its_line(tmp_path, row, fields):
    """A pair row that lost a field ("shares fell,1") was dropped as unlabeled without a word (pandas reads
    the missing label cell as empty), and a trailing comma shifted every column by one."""
    header = "sentence1,sentence2,label\n"
    (tmp_path / "train.csv").write_text(header + f"a b,c d,1\n{row}\ne f,g h,0\n")
    (tmp_path / "validation.csv").write_text(header + "q r,s t,1\n")
    with pytest.raises(ValueError, match=rf"train\.csv line 3: {fields} field\(s\) where the header names 3"):
        load_dataset("mrpc", source=tmp_path)
    (tmp_path / "train.csv").write_text(header + 'a b,"c, d",1\n"e\nf",g h,0\n')  # quoted: one field each
    data = load_dataset("mrpc", source=tmp_path)
    assert data.train_text_pairs == ["c, d", "g h"] and data.train_labels == [1, 0]


def test_a_csv_with_a_long_first_row_still_has_its_labels_checked(tmp_path):
    """A first row over csv's 131072-character field limit made the label check give up: the error named
    the valid label '1' of that row instead of 'pos' on line 3."""
    (tmp_path / "train.csv").write_text(f"sentence,label\n{'long ' * 40_000},1\nbad film,pos\n")
    (tmp_path / "test.csv").write_text("sentence,label\nfine,1\n")
    with pytest.raises(ValueError, match=r"line 3: label 'pos' is not an integer"):
        load_dataset("sst2", source=tmp_path)


def test_csv_cells_reading_na_or_null_are_text_not_missing(tmp_path):
    """pandas' default missing-value strings: a sentence "null" was refused as None, and a label "NA"
    dropped its row as unlabeled; only an empty cell is missing."""
    (tmp_path / "train.csv").write_text("sentence,label\nnull,1\nNA,0\nnan,1\n")
    (tmp_path / "test.csv").write_text("sentence,label\nNone,0\n")
    data = load_dataset("sst2", source=tmp_path)
    assert data.train_texts == ["null", "NA", "nan"] and data.test_texts == ["None"]
    (tmp_path / "train.csv").write_text("sentence,label\ngood,1\nbad,NA\n")
    with pytest.raises(ValueError, match=r"train\.csv line 3: label 'NA' is not an integer"):
        load_dataset("sst2", source=tmp_path)


def test_a_fractional_label_is_still_refused(tmp_path):
    _jsonl(tmp_path / "train.jsonl", [{"sentence": "x", "label": 1.5}])
    (tmp_path / "test.jsonl").write_text(_GOOD)
    with pytest.raises(ValueError, match="label 1.5 is not an integer"):
        load_dataset("sst2", source=tmp_path)


def test_two_files_for_one_split_are_named_as_ambiguous(tmp_path):
    (tmp_path / "train.jsonl").write_text(_GOOD)
    (tmp_path / "train.csv").write_text("sentence,label\nfine,1\n")
    (tmp_path / "test.jsonl").write_text(_GOOD)
    with pytest.raises(ValueError, match=r"train\.jsonl and train\.csv: it is ambiguous which is the train"):
        load_dataset("sst2", source=tmp_path)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv"])
def test_a_file_that_is_not_utf8_is_named_with_its_line(tmp_path, suffix):
    body = {
        ".jsonl": b'{"sentence": "fine", "label": 1}\n{"sentence": "caf\xe9", "label": 0}\n',
        ".json": b'{"sentence": "fine", "label": 1}\n{"sentence": "caf\xe9", "label": 0}\n',
        ".csv": b"sentence,label\nfine,1\ncaf\xe9,0\n",
    }[suffix]
    (tmp_path / f"train{suffix}").write_bytes(body)
    (tmp_path / f"test{suffix}").write_bytes(body.replace(b"\xe9", b"e"))
    with pytest.raises(ValueError, match=rf"train\{suffix} line \d is not UTF-8"):
        load_dataset("sst2", source=tmp_path)


@pytest.mark.parametrize("labels", [[1, "0"], [1, "1.0"], [0, " 1 "], [1, "-1"]])
@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_label_column_mixing_numbers_and_strings_is_refused_not_guessed(tmp_path, labels, suffix):
    rows = [{"sentence": f"t{i}", "label": y} for i, y in enumerate(labels)]
    if suffix == ".json":
        (tmp_path / "train.json").write_text(json.dumps(rows))
        (tmp_path / "test.json").write_text(json.dumps([{"sentence": "x", "label": 1}]))
    else:
        _jsonl(tmp_path / "train.jsonl", rows)
        (tmp_path / "test.jsonl").write_text(_GOOD)
    with pytest.raises(ValueError, match=rf"train\{suffix} (line|row) \d: label '.*' is not an integer"):
        load_dataset("sst2", source=tmp_path)


def test_a_json_file_of_one_object_is_one_row_and_its_label_is_checked(tmp_path):
    """A ``.json`` holding one object is read as one row; an object of columns (lists) is refused with the
    file named, before the reader turns its strings into numbers."""
    (tmp_path / "train.json").write_text(json.dumps({"sentence": "fine", "label": 1}))
    (tmp_path / "test.json").write_text(json.dumps([{"sentence": "x", "label": 0}]))
    data = load_dataset("sst2", source=tmp_path)
    assert data.train_texts == ["fine"] and data.train_labels == [1]
    (tmp_path / "train.json").write_text(json.dumps({"sentence": ["a", "b"], "label": [1, "0"]}))
    with pytest.raises(ValueError, match=r"train\.json line 1: label \[1, '0'\] is not an integer"):
        load_dataset("sst2", source=tmp_path)


def test_a_byte_order_mark_is_accepted_in_json_lines(tmp_path):
    (tmp_path / "train.jsonl").write_bytes(b"\xef\xbb\xbf" + _GOOD.encode())
    (tmp_path / "test.jsonl").write_text(_GOOD)
    data = load_dataset("sst2", source=tmp_path)
    assert data.train_texts == data.test_texts


def test_source_for_a_dataset_already_cached_needs_force(sst2_dir, tmp_path):
    cache = tmp_path / "cache"
    fetch("sst2", cache_dir=cache, source=sst2_dir)
    before = (cache / "datasets" / "sst2" / "train.jsonl").read_bytes()
    with pytest.raises(ValueError, match="already in the cache.*--force"):
        fetch("sst2", cache_dir=cache, source=tmp_path / "elsewhere")
    assert (cache / "datasets" / "sst2" / "train.jsonl").read_bytes() == before
    assert fetch("sst2", cache_dir=cache) == cache / "datasets" / "sst2"  # no source: the cached copy


def _csv_source(folder, train="sentence,label\ngood,1\nbad,0\n"):
    folder.mkdir(exist_ok=True)
    (folder / "train.csv").write_text(train)
    (folder / "test.csv").write_text("sentence,label\nok,1\n")
    return folder


def test_a_local_fetch_prints_no_progress_bar_or_log_line(tmp_path, capfd, caplog):
    """Reading local files printed the datasets library's "Generating train split" bars and, for a file its
    JSON reader refuses, a "Failed to load JSON" log line, before attnkit's own result or error."""
    caplog.set_level(logging.DEBUG)
    fetch("sst2", cache_dir=tmp_path / "cache", source=_csv_source(tmp_path / "ok"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "train.json").write_text('{"sentence": "\\ud800", "label": 1}\n' + _GOOD)  # a lone surrogate
    (bad / "test.json").write_text(_GOOD)
    with pytest.raises(ValueError, match=r"cannot read .*train\.json"):
        load_dataset("sst2", source=bad)
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")
    assert [r.getMessage() for r in caplog.records if r.name.startswith("datasets")] == []


def test_the_cli_fetch_error_is_one_line(tmp_path, capfd):
    from attnkit.cli import main

    source = _csv_source(tmp_path / "h", train="sentence,label\ngood,7\nbad,0\n")
    capfd.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["data", "fetch", "sst2", "--source", str(source), "--cache-dir", str(tmp_path / "c")])
    out, err = capfd.readouterr()
    assert exc.value.code == 2 and out == ""
    expected = "sst2: train label 7 is not an integer in [0, 2) (classes ['negative', 'positive']) or -1"
    assert err == f"error: {expected} for unlabeled\n"


def test_a_local_fetch_restores_the_users_datasets_settings(tmp_path):
    datasets = pytest.importorskip("datasets")
    verbosity = datasets.utils.logging.get_verbosity()
    bars_off = datasets.utils.are_progress_bars_disabled()
    try:
        for off, level in ((False, logging.INFO), (True, logging.WARNING)):
            (datasets.utils.disable_progress_bars if off else datasets.utils.enable_progress_bars)()
            datasets.utils.logging.set_verbosity(level)
            load_dataset("sst2", source=_csv_source(tmp_path / f"s{level}"))
            assert datasets.utils.are_progress_bars_disabled() is off
            assert datasets.utils.logging.get_verbosity() == level
    finally:
        datasets.utils.logging.set_verbosity(verbosity)
        (datasets.utils.disable_progress_bars if bars_off else datasets.utils.enable_progress_bars)()


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("train.csv", "sentence,label\n", r"train\.csv has no rows"),
        ("train.csv", "sentence,label\n\n\n", r"train\.csv has no rows"),
        ("train.csv", "", r"train\.csv is empty; expected a header line naming the columns"),
        ("train.json", "[]", r"train\.json has no rows"),
        ("train.json", "{}", r"train\.json has no rows"),
        ("train.json", "  \n", r"train\.json has no rows"),
        ("train.json", '"str"', r'train\.json holds a JSON string \("str"\); expected an array of objects '
                                r"\(one per row\)"),
        ("train.json", "null", r"train\.json holds a JSON null .*expected an array of objects"),
        ("train.json", "3", r"train\.json holds a JSON number .*expected an array of objects"),
        ("train.json", "[1, 2]", r"train\.json holds 1 as row 0; expected an array of objects"),
        ("train.json", '[{"sentence": "a", "label": 1}, "b"]', r'train\.json holds "b" as row 1'),
        ("train.json", '[{"sentence": "a", "label": 1},\n{"sentence": ', r"train\.json is not JSON \(.* "
                                                                         r"line 2 column"),
        ("train.json", _GOOD + "{oops\n", r"train\.json line 3 is not JSON \(Expecting property name .* at "
                                         r"column 2\)"),
        ("train.json", '{"sentence": "a", "label": 1, "sentence": "b"}\n' + _GOOD,
         r"train\.json line 1: the key 'sentence' appears twice"),
        ("train.json", '[{"sentence": "a", "label": 1, "label": 0}]', r"train\.json: the key 'label'"),
    ],
)
def test_a_split_file_without_rows_or_of_the_wrong_shape_is_named(tmp_path, name, text, message):
    """These were "Instruction "train" corresponds to no data!", "DataFrame constructor not properly
    called!", "No columns to parse from file", a list of numbers read as a column 'text', and for ``null``
    a crash of the JSON reader."""
    (tmp_path / name).write_text(text)
    (tmp_path / f"test{name[5:]}").write_text("sentence,label\nok,1\n" if name.endswith(".csv") else _GOOD)
    with pytest.raises(ValueError, match=message):
        load_dataset("sst2", source=tmp_path)


def test_a_parquet_file_without_rows_is_named(tmp_path):
    datasets = pytest.importorskip("datasets")
    for split, n in (("train", 0), ("test", 1)):
        rows = {"sentence": ["ok"] * n, "label": [1] * n}
        datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / f"{split}.parquet"))
    with pytest.raises(ValueError, match=r"train\.parquet has no rows"):
        load_dataset("sst2", source=tmp_path)


@pytest.mark.parametrize("suffix", [".csv", ".json", ".jsonl"])
def test_a_byte_order_mark_is_accepted_in_every_text_format(tmp_path, suffix):
    rows = [{"sentence": "good", "label": 1}, {"sentence": "bad", "label": 0}]
    body = {
        ".csv": "sentence,label\ngood,1\nbad,0\n",
        ".json": json.dumps(rows),
        ".jsonl": "".join(json.dumps(r) + "\n" for r in rows),
    }[suffix]
    (tmp_path / f"train{suffix}").write_bytes(b"\xef\xbb\xbf" + body.encode())
    (tmp_path / f"test{suffix}").write_bytes(b"\xef\xbb\xbf" + body.encode())
    data = load_dataset("sst2", source=tmp_path)
    assert data.train_texts == ["good", "bad"] and data.test_labels == [1, 0]


def _class_encoded_split(folder, split, premises, labels):
    datasets = pytest.importorskip("datasets")
    rows = {"premise": premises, "hypothesis": [f"h {p}" for p in premises], "label": labels}
    table = datasets.Dataset.from_dict(rows).class_encode_column("label")
    table.to_parquet(str(folder / f"{split}.parquet"))
    return table.features["label"].names


def test_test_labels_follow_their_own_class_names_not_the_train_splits_ids(tmp_path):
    """Splits encoded one by one (class_encode_column per split) number the classes each in their own way:
    a test split without 'entailment' calls 'neutral' 1, which the train split calls 'entailment'."""
    train_names = _class_encoded_split(tmp_path, "train", ["p1", "p2", "p3"],
                                       ["contradiction", "entailment", "neutral"])
    test_names = _class_encoded_split(tmp_path, "test", ["q1", "q2"], ["contradiction", "neutral"])
    assert test_names == ["contradiction", "neutral"] and train_names[1] == "entailment"
    data = load_dataset("snli", source=tmp_path)
    assert [data.label_names[y] for y in data.test_labels] == ["contradiction", "neutral"]
    assert [data.label_names[y] for y in data.train_labels] == ["contradiction", "entailment", "neutral"]


def test_the_classes_are_the_catalogs_whatever_order_a_split_encodes_them_in(tmp_path):
    """A split's ClassLabel that names some of the catalog's classes, in its own order, is re-mapped to them
    (a test class the train split lacks is still one of the catalog's classes)."""
    _class_encoded_split(tmp_path, "train", ["p1", "p2"], ["contradiction", "neutral"])
    _class_encoded_split(tmp_path, "test", ["q1", "q2"], ["contradiction", "entailment"])
    data = load_dataset("snli", source=tmp_path)
    assert data.label_names == ["entailment", "neutral", "contradiction"]  # hub.HUB_SPECS["snli"]
    assert [data.label_names[y] for y in data.train_labels] == ["contradiction", "neutral"]
    assert [data.label_names[y] for y in data.test_labels] == ["contradiction", "entailment"]


def _class_label_split(folder, split, names, labels):
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"sentence": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=names)})
    rows = {"sentence": [f"s{i}" for i in range(len(labels))], "label": labels}
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(folder / f"{split}.parquet"))


@pytest.mark.parametrize("splits", [("train", "validation"), ("train",), ("validation",)])
@pytest.mark.parametrize("names", [["neg", "neu", "pos"], ["negative", "positive", "neutral"],
                                   ["negative", "good"]])
def test_a_source_cannot_redefine_the_catalog_datasets_classes(tmp_path, splits, names):
    """A ClassLabel of the source's own became sst2's classes: ``--source`` whose splits both say
    ["neg", "neu", "pos"] made a three-class "sst2" (the train split's names were taken, the catalog's
    ignored)."""
    catalog = ["negative", "positive"]
    for split in ("train", "validation"):
        _class_label_split(tmp_path, split, names if split in splits else catalog, [0, 1, 0])
    role = "train" if "train" in splits else "test"  # the catalog's test split is sst2's validation split
    message = (rf"^sst2: the {role} split's ClassLabel classes {re.escape(str(names))} are not sst2's "
               rf"classes {re.escape(str(catalog))} \(.*not among them\); label the rows with these classes")
    with pytest.raises(ValueError, match=message):
        load_dataset("sst2", source=tmp_path)
    for split in splits:  # another order of the catalog's classes maps cleanly
        _class_label_split(tmp_path, split, ["positive", "negative"], [0, 1, 0])
    data = load_dataset("sst2", source=tmp_path)
    assert data.label_names == catalog
    assert [data.train_labels, data.test_labels] == [[1, 0, 1] if s in splits else [0, 1, 0]
                                                     for s in ("train", "validation")]


@pytest.mark.parametrize("name, text, shown", [
    ("test.jsonl", '{"sentence": "x", "label": 1}\n{"sentence": "y", "label": NaN}\n', r"line 2: label NaN"),
    ("test.jsonl", '{"sentence": "x", "label": 1}\n{"sentence": "y", "label": Infinity}\n',
     r"line 2: label Infinity"),
    ("test.jsonl", '{"sentence": "x", "label": 1}\n{"sentence": "y", "label": 1e400}\n',
     r"line 2: label Infinity"),
    ("test.jsonl", '{"sentence": "x", "label": 1}\n{"sentence": "y", "label": -Infinity}\n',
     r"line 2: label -Infinity"),
    ("test.jsonl", '{"sentence": "x", "label": 1}\n\n{"sentence": "y"}\n', r"line 3 has no 'label' key"),
    ("test.json", '[{"sentence": "x", "label": 1}, {"sentence": "y", "label": NaN}]', r"row 1: label NaN"),
    ("test.json", '[{"sentence": "x", "label": 1}, {"sentence": "y"}]', r"row 1 has no 'label' key"),
])
def test_a_json_label_that_is_nan_infinite_or_missing_is_refused_naming_the_row(tmp_path, name, text, shown):
    """A NaN label or a row without the key was dropped as unlabeled (only -1 and null are), Infinity
    failed with pandas' "If using all scalar values, you must pass an index"."""
    (tmp_path / f"train{tmp_path.joinpath(name).suffix}").write_text(
        _GOOD if name.endswith(".jsonl") else json.dumps([json.loads(r) for r in _GOOD.splitlines()]))
    (tmp_path / name).write_text(text)
    expected = rf"^sst2: .*{re.escape(name)} {shown}\b.*\(or -1 / null for unlabeled\)$"
    with pytest.raises(ValueError, match=expected):
        load_dataset("sst2", source=tmp_path)


def test_a_csv_text_cell_is_text_as_written_like_a_json_string(tmp_path):
    """An empty sentence was refused in a CSV file as None ("" in JSON lines is text), and a sentence "42"
    was refused as the number 42 ("007" would have been 7)."""
    (tmp_path / "train.csv").write_text('sentence,label\ngood,1\n,0\n"",1\n')
    (tmp_path / "test.csv").write_text("sentence,label\n42,1\n007,0\n1.50,1\n")
    csv_data = load_dataset("sst2", source=tmp_path)
    assert csv_data.train_texts == ["good", "", ""] and csv_data.test_texts == ["42", "007", "1.50"]
    for split in ("train", "test"):
        (tmp_path / f"{split}.csv").unlink()
    for split, texts in (("train", ["good", "", ""]), ("test", ["42", "007", "1.50"])):
        _jsonl(tmp_path / f"{split}.jsonl", [{"sentence": t, "label": y} for t, y in zip(texts, [1, 0, 1])])
    json_data = load_dataset("sst2", source=tmp_path)
    assert (json_data.train_texts, json_data.test_texts) == (csv_data.train_texts, csv_data.test_texts)


@pytest.mark.parametrize("file, content, message", [
    ("train.jsonl", '{"text": "a"}\n', r"train\.jsonl line 1 is not an object with a text string"),
    ("train.jsonl", '["a", 1]\n', r"train\.jsonl line 1 is not an object"),
    ("train.jsonl", '{"text": "a", "label": 1\n', r"train\.jsonl line 1 is not JSON"),
    ("labels.json", "[" * 50_000 + "]" * 50_000, r"labels\.json is not a JSON list of class names"),
    ("labels.json", '["negative"]', r"labels\.json names the classes \['negative'\], not sst2's"),
    ("labels.json", '["a", "b", "c"]',
     r"names the classes \['a', 'b', 'c'\], not sst2's \['negative', 'positive'\]"),
    ("train.jsonl", '{"text": "a", "label": 5}\n',
     r"cached label 5 is not a class of .*labels\.json \(2 classes\)"),
    ("test.jsonl", "", r"test\.jsonl has no rows"),
    ("train.jsonl", '{"text": "a", "label": 1, "text_pair": "b"}\n{"text": "c", "label": 0}\n',
     r"train\.jsonl gives a text_pair on 1 of its 2 rows"),
])
def test_a_cached_hub_dataset_of_another_shape_is_one_error_naming_the_file(sst2_dir, tmp_path, file, content,
                                                                           message):
    """A cache copied from elsewhere whose manifest matches its files (a KeyError, TypeError or
    RecursionError traceback before; an empty test split loaded as a test set of 0 examples, a labels.json of
    other classes gave SST-2 three classes)."""
    from attnkit.data.cache import write_manifest
    from attnkit.data.containers import DatasetChecksumError

    fetch("sst2", cache_dir=tmp_path / "cache", source=sst2_dir)
    folder = next((tmp_path / "cache").rglob("labels.json")).parent
    (folder / file).write_text(content)
    write_manifest(folder, "test", ["train.jsonl", "test.jsonl", "labels.json"])
    with pytest.raises(DatasetChecksumError, match=message):
        load_dataset("sst2", cache_dir=tmp_path / "cache")


def test_a_load_waits_for_a_fetch_of_the_same_dataset(sst2_dir, tmp_path):
    """A loader racing `fetch --force` read train and test from two different fetches: the load takes the
    fetch lock shared, so it waits while another process holds it to write."""
    import fcntl
    import os
    import threading

    fetch("sst2", cache_dir=tmp_path / "cache", source=sst2_dir)
    lock = next((tmp_path / "cache").rglob(".sst2.lock"))
    fd = os.open(lock, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as a fetch in another process holds it
    done = threading.Event()
    thread = threading.Thread(target=lambda: (load_dataset("sst2", cache_dir=tmp_path / "cache"), done.set()))
    thread.start()
    assert not done.wait(1.0)  # waiting for the writer
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    thread.join(30)
    assert done.is_set()


@pytest.mark.parametrize("labels, shown", [
    ([0.0, float("nan"), 1.0], r"row 1: label NaN"),
    ([0.0, 1.0, None, float("inf")], r"row 3: label Infinity"),
    ([float("-inf"), 1.0], r"row 0: label -Infinity"),
])
def test_a_parquet_label_that_is_nan_or_infinite_is_refused_naming_the_row(tmp_path, labels, shown):
    """A NaN label in a parquet file was dropped as unlabeled (only -1 and null are), as in JSON before."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = [f"s{i}" for i in range(len(labels))]
    pq.write_table(pa.table({"sentence": texts, "label": pa.array(labels, pa.float64())}),
                   str(tmp_path / "train.parquet"))
    pq.write_table(pa.table({"sentence": ["a", "b"], "label": [0, 1]}), str(tmp_path / "validation.parquet"))
    expected = rf"^sst2: .*train\.parquet {shown}\b.*\(or -1 / null for unlabeled\)$"
    with pytest.raises(ValueError, match=expected):
        load_dataset("sst2", source=tmp_path)


def test_a_parquet_float_label_column_with_nulls_keeps_the_labeled_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"sentence": ["a", "b", "c"], "label": pa.array([1.0, None, 0.0], pa.float64())})
    pq.write_table(table, str(tmp_path / "train.parquet"))
    pq.write_table(table, str(tmp_path / "validation.parquet"))
    data = load_dataset("sst2", source=tmp_path)
    assert data.train_texts == ["a", "c"] and data.train_labels == [1, 0]


@pytest.mark.parametrize("name, needs", [
    ("snli", r"needs train.<ext> and test.<ext> with ext in"),
    ("sst2", r"needs train.<ext> and validation.<ext> \(or test.<ext>\) with ext in"),
])
def test_the_missing_split_files_are_named_once(tmp_path, name, needs):
    """SNLI's message said "test.<ext> (or test.<ext>)"."""
    with pytest.raises(DatasetUnavailableError, match=needs):
        load_dataset(name, source=tmp_path)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_non_text_value_in_a_later_chunk_is_refused_not_read_quoted(tmp_path, monkeypatch, suffix):
    """A JSON source over datasets' 10 MiB chunk with one number in its text column in a later chunk read
    every text of that chunk JSON-encoded ('"sentence 7"'), the number as '42', silently: only the label was
    checked before reading. The chunk is made small here instead of the file big."""
    datasets = pytest.importorskip("datasets")
    load = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset",
                        lambda kind, **kw: load(kind, **({"chunksize": 256} if kind == "json" else {}), **kw))
    rows = [{"sentence": f"sentence {i}", "label": i % 2} for i in range(40)]
    rows[35] = {"sentence": 42, "label": 1}
    text = "".join(json.dumps(r) + "\n" for r in rows) if suffix == ".jsonl" else json.dumps(rows)
    (tmp_path / f"train{suffix}").write_text(text)
    (tmp_path / f"validation{suffix}").write_text(
        _GOOD if suffix == ".jsonl" else json.dumps([json.loads(r) for r in _GOOD.splitlines()]))
    where = "line 36" if suffix == ".jsonl" else "row 35"
    expected = rf"train{re.escape(suffix)} {where}: 'sentence' holds 42; expected text"
    with pytest.raises(ValueError, match=expected):
        load_dataset("sst2", source=tmp_path)


def test_a_csv_label_cell_of_only_spaces_is_named_not_blamed_on_a_valid_label(tmp_path):
    """A label cell " " passed the check as empty, but pandas read it as text, and with it the whole column:
    the error blamed the valid label '0' ("train label '0' is not an integer in [0, 2)")."""
    (tmp_path / "train.csv").write_text("sentence,label\na,0\nb,1\nc, \nd,1\n")
    (tmp_path / "validation.csv").write_text("sentence,label\na,0\nb,1\n")
    with pytest.raises(ValueError, match=r"^sst2: .*train\.csv line 4: the label cell holds only spaces "
                       r"\(' '\); leave it empty for an unlabeled row"):
        load_dataset("sst2", source=tmp_path)


def test_a_split_file_that_is_a_dangling_link_is_called_a_link(tmp_path):
    """A train.jsonl linking to nothing read "needs train.<ext> and validation.<ext> ...; found
    ['train.jsonl', 'validation.jsonl']"."""
    (tmp_path / "train.jsonl").symlink_to(tmp_path / "gone.jsonl")
    (tmp_path / "validation.jsonl").write_text(_GOOD)
    expected = (rf"^{tmp_path / 'train.jsonl'} is a symbolic link to {tmp_path / 'gone.jsonl'}, which does "
                r"not exist; point it at the train split's file")
    with pytest.raises(DatasetUnavailableError, match=expected):
        load_dataset("sst2", source=tmp_path)
