"""Dataset files of ``attnkit compare --task FILE``: errors name the file and, for ``.jsonl``, the line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from attnkit.runner.tasks import load_file_dataset

HEAD = json.dumps({"kind": "classification"})
TRAIN = json.dumps({"split": "train", "text": "goal team", "label": "sport"})
TEST = json.dumps({"split": "test", "text": "bank rates", "label": "money"})
TRAIN2 = json.dumps({"split": "train", "text": "loan bank", "label": "money"})  # a test label needs training


def _write(tmp_path, *lines: str, name: str = "data.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_a_jsonl_file_reads_both_splits(tmp_path):
    data = load_file_dataset(_write(tmp_path, HEAD, TRAIN, TRAIN2, "", TEST, TRAIN))
    assert data.train_texts == ["goal team", "loan bank", "goal team"] and data.test_texts == ["bank rates"]
    assert data.label_names == ["money", "sport"]


@pytest.mark.parametrize("lines,needle", [
    ((HEAD, TRAIN, '{"split": "train", "text": "x", '), "line 3: not valid JSON"),
    ((TRAIN, TEST), 'line 1: the first line must be {"kind"'),
    (("[1, 2]", TRAIN), "line 1: the first line must be"),
    ((HEAD, TRAIN, '{"split": "dev", "text": "x", "label": "a"}', TEST), 'line 3:'),
    ((HEAD, TRAIN, "[1]", TEST), "line 3:"),
    ((HEAD, TRAIN, TRAIN, json.dumps({"split": "train", "txt": "x", "label": "a"}), TEST), "line 4:"),
    ((HEAD, TRAIN, "", json.dumps({"split": "test", "text": "x"})), "line 4:"),
    (("",), "is empty"),
])
def test_a_bad_jsonl_file_names_the_file_and_the_line(tmp_path, lines, needle):
    path = _write(tmp_path, *lines)
    with pytest.raises(ValueError) as exc:
        load_file_dataset(path)
    assert needle in str(exc.value) and path in str(exc.value), str(exc.value)


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "data.json"
    path.write_bytes(b'{"kind": "classification", "train": ["\xff"]}')
    with pytest.raises(ValueError, match=r"data.json' is not UTF-8 text"):
        load_file_dataset(str(path))


def _classification(tmp_path, labels, **extra):
    rows = [{"text": f"doc {i}", "label": y} for i, y in enumerate(labels)]
    path = tmp_path / "data.json"
    path.write_text(json.dumps({"kind": "classification", "train": rows, "test": rows, **extra}))
    return str(path)


@pytest.mark.parametrize("labels", [[1, 2, 3, 3, 2, 1, 3], [0, 10, 2, 1, 10, 9]])
def test_integer_labels_without_label_names_are_their_own_classes(tmp_path, labels):
    """Labels 1/2/3 were names sorted as strings, then read as indices into them: "3" fell out and the
    classes merged; labels 0..10 got the names of other classes ('10' for class 2)."""
    data = load_file_dataset(_classification(tmp_path, labels))
    distinct = sorted(set(labels))
    assert data.label_names == [str(y) for y in distinct]
    assert [data.label_names[i] for i in data.train_labels] == [str(y) for y in labels]
    assert data.test_labels == data.train_labels


def test_integer_labels_index_the_given_label_names(tmp_path):
    data = load_file_dataset(_classification(tmp_path, [0, 1, "sport"], label_names=["money", "sport"]))
    assert data.label_names == ["money", "sport"] and data.train_labels == [0, 1, 1]


@pytest.mark.parametrize("bad", [None, [1], 1.5, True, {"a": 1}])
def test_a_label_that_is_not_a_name_or_an_integer_is_refused(tmp_path, bad):
    expected = r"train\[1\]: label .*expected a class name \(a string\) or an integer"
    with pytest.raises(ValueError, match=expected):
        load_file_dataset(_classification(tmp_path, ["a", bad, "b"]))


def test_the_same_label_as_a_number_and_a_string_is_one_class(tmp_path):
    data = load_file_dataset(_classification(tmp_path, [1, "1", 2]))
    assert data.label_names == ["1", "2"] and data.train_labels == [0, 0, 1]


@pytest.mark.parametrize("names, message", [
    (["x", "x"], r"label_names \['x', 'x'\] holds 'x' twice; give each class one name"),
    (["a", 1, "1"], r"label_names \['a', '1', '1'\] holds '1' twice"),
    (["x"], r"label_names \['x'\] names 1 class\(es\); a classification task needs at least 2"),
    ([], r"label_names \[\] names 0 class\(es\)"),
    ("ab", r"label_names='ab'; expected a list of class names"),
    (["a", 1.5], r"label_names=\['a', 1\.5\]; expected a list of class names"),
])
def test_label_names_are_at_least_two_distinct_names(tmp_path, names, message):
    """``["x", "x"]`` was accepted and the report showed two classes both called "x"."""
    path = _classification(tmp_path, [0, 1, 0], label_names=names)
    with pytest.raises(ValueError, match=message) as exc:
        load_file_dataset(path)
    assert path in str(exc.value)


def test_a_file_whose_labels_are_all_one_class_is_refused(tmp_path):
    path = _classification(tmp_path, ["spam", "spam"])
    with pytest.raises(ValueError, match=r"data\.json': every label is 'spam'; .* at least 2 classes"):
        load_file_dataset(path)


@pytest.mark.parametrize("name", ["data.json", "data.jsonl"])
def test_a_byte_order_mark_is_accepted(tmp_path, name):
    """Notepad saves UTF-8 with a byte-order mark; it was refused as "Unexpected UTF-8 BOM"."""
    if name.endswith(".jsonl"):
        text = "\n".join([HEAD, TRAIN, TRAIN2, TEST]) + "\n"
    else:
        rows = {"train": [json.loads(TRAIN), json.loads(TRAIN2)], "test": [json.loads(TEST)]}
        text = json.dumps({"kind": "classification", **rows})
    path = tmp_path / name
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    data = load_file_dataset(str(path))
    assert data.train_texts == ["goal team", "loan bank"] and data.label_names == ["money", "sport"]


@pytest.mark.parametrize("name", ["d.json", "data"])
def test_a_folder_given_as_the_dataset_file_is_named_as_a_folder(tmp_path, name):
    """A folder named ``d.json`` was reported as "not found", one named ``data`` as an unknown task."""
    folder = tmp_path / name
    folder.mkdir()
    with pytest.raises(ValueError, match=rf"{name}' is a folder, not a file; pass the path of the \.json"):
        load_file_dataset(str(folder))


def _seq2seq(tmp_path, train: list, test: list, name: str = "pairs.jsonl") -> str:
    """A seq2seq dataset file; ``train``/``test`` hold ``(source, target)`` pairs (in a .jsonl file the
    train rows are lines 2.., then the test rows)."""
    if name.endswith(".jsonl"):
        rows = [{"split": split, "source": s, "target": t}
                for split, pairs in (("train", train), ("test", test)) for s, t in pairs]
        return _write(tmp_path, json.dumps({"kind": "seq2seq"}), *map(json.dumps, rows), name=name)
    path = tmp_path / name
    splits = {split: [{"source": s, "target": t} for s, t in pairs]
              for split, pairs in (("train", train), ("test", test))}
    path.write_text(json.dumps({"kind": "seq2seq", **splits}))
    return str(path)


def _prepare(path: str, **settings):
    from attnkit.runner.config import CompareConfig
    from attnkit.runner.tasks import get_task

    task = get_task(path)
    return task, task.prepare(CompareConfig(task=path, **settings))


@pytest.mark.parametrize("n", [13, 60])
def test_a_target_longer_than_max_target_len_is_refused_and_the_named_fix_scores_it_whole(tmp_path, n):
    """A 60-character target was cut to 13 (one more than max_target_len=12, its <eos> lost in training);
    exact match then scored 'L' * 13 right and the true 60-character output wrong."""
    path = _seq2seq(tmp_path, [("ab", "ba"), ("ab", "L" * n)], [("ab", "L" * (n - 1))])
    with pytest.raises(ValueError) as exc:
        _prepare(path, max_target_len=12)
    message = str(exc.value)
    assert path in message and "line 3: the target has" in message and f"has {n} characters" in message
    assert "more than max_target_len=12" in message and f"--set max_target_len={n}" in message, message
    task, data = _prepare(path, max_target_len=n)
    assert task._targets(data) == ["L" * (n - 1)]
    assert task.metrics(data, ["L" * (n - 1)])["sequence_accuracy"] == 1.0
    assert task.metrics(data, ["L" * (n - 2)])["sequence_accuracy"] == 0.0
    eos = data.tokenizer.eos_id
    assert [row[mask].tolist()[-1] for row, mask in zip(data.train_tgt, data.train_tgt_mask)] == [eos, eos]


def test_the_fix_for_a_long_target_fits_the_longest_one_and_names_the_first_line(tmp_path):
    path = _seq2seq(tmp_path, [("ab", "x" * 14)], [("ab", "x" * 20)], name="pairs.json")
    with pytest.raises(ValueError, match=r"pairs\.json', train\[0\]: the target has 14 characters, .*"
                                         r"the longest target has 20: pass --set max_target_len=20"):
        _prepare(path, max_target_len=12)


def test_a_source_longer_than_max_len_is_refused_with_the_line_and_the_fix(tmp_path):
    """The encoder silently saw only the first max_len characters of a longer source."""
    path = _seq2seq(tmp_path, [("a" * 8, "b"), ("a" * 30, "b")], [("a" * 9, "b")])
    with pytest.raises(ValueError) as exc:
        _prepare(path, max_len=8)
    message = str(exc.value)
    assert path in message and "line 3: the source has 30 characters, more than max_len=8" in message
    assert "--set max_len=30" in message and "target" not in message, message
    _, data = _prepare(path, max_len=30)
    assert data.tokenizer.decode(data.train_src) == ["a" * 8, "a" * 30]


@pytest.mark.parametrize("name", ["pairs.jsonl", "pairs.json"])
@pytest.mark.parametrize("field", ["source", "target"])
@pytest.mark.parametrize("bad, shown", [(None, "null"), (["x", "y"], '["x", "y"]'), (12, "12"),
                                        (True, "true"), ({"a": 1}, '{"a": 1}')])
def test_a_seq2seq_source_or_target_that_is_not_text_is_refused(tmp_path, name, field, bad, shown):
    """null, lists and numbers were turned into the text "None", "['x', 'y']", "12" and trained on."""
    row = {"source": "ab", "target": "ba", field: bad}
    path = _seq2seq(tmp_path, [("ab", "ba")], [("ab", "ba"), (row["source"], row["target"])], name=name)
    where = "line 4" if name.endswith(".jsonl") else r"test\[1\]"
    with pytest.raises(ValueError, match=rf"{where}: the {field} of a test example is {re.escape(shown)}, "
                                         r"not text; write it as a JSON string") as exc:
        load_file_dataset(path)
    assert path in str(exc.value)


@pytest.mark.parametrize("bad, shown", [(None, "null"), (["good", "match"], '["good", "match"]'),
                                        (12.5, "12.5"), ({"k": 1}, '{"k": 1}')])
def test_a_classification_text_that_is_not_text_is_refused(tmp_path, bad, shown):
    """null, lists and numbers were turned into the texts "None", "['good', 'match']", "12.5"."""
    rows = [{"text": "goal team", "label": "sport"}, {"text": bad, "label": "money"}]
    path = tmp_path / "data.json"
    path.write_text(json.dumps({"kind": "classification", "train": rows, "test": rows[:1]}))
    with pytest.raises(ValueError, match=rf"train\[1\]: the text of a train example is {re.escape(shown)}, "
                                         r"not text"):
        load_file_dataset(str(path))


@pytest.mark.parametrize("char", ["\u2028", "\u2029", "\x85"])
@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_a_jsonl_line_ends_at_a_newline_only_not_at_unicode_line_separators(tmp_path, char, newline):
    """``str.splitlines()`` cut a line at U+2028/U+2029/U+0085 inside a JSON string: the row was refused as
    "Unterminated string" and every later line number was off."""
    row = {"split": "train", "text": f"goal{char}team", "label": "sport"}
    no_label = json.dumps({"split": "test", "text": "x"})  # refused: its line number must be 5
    rows = [HEAD, json.dumps(row, ensure_ascii=False), TRAIN2, TEST, no_label]
    path = tmp_path / "data.jsonl"
    path.write_bytes(newline.join(rows).encode() + newline.encode())
    with pytest.raises(ValueError, match=r"data\.jsonl', line 5: ") as exc:
        load_file_dataset(str(path))
    assert "not valid JSON" not in str(exc.value)
    del rows[-1]
    path.write_bytes(newline.join(rows).encode() + newline.encode())
    data = load_file_dataset(str(path))
    assert data.train_texts == [f"goal{char}team", "loan bank"] and data.test_texts == ["bank rates"]


@pytest.mark.parametrize("name", ["data.jsonl", "data.json"])
def test_a_label_only_in_the_test_split_is_refused_naming_it(tmp_path, name):
    """A typo ("Neg" for "neg") in a test label became a third class that no training example has: it
    was scored as a class the model could never predict, without a word."""
    rows = [("train", "goal team", "sport"), ("train", "loan bank", "money"), ("test", "bank rates", "money"),
            ("test", "match", "Sport"), ("test", "cup", "sport"), ("test", "fund", "monye")]
    path = tmp_path / name
    if name.endswith(".jsonl"):
        lines = [json.dumps({"split": s, "text": t, "label": y}) for s, t, y in rows]
        path.write_text("\n".join([HEAD, *lines]))
    else:
        splits = {s: [{"text": t, "label": y} for s2, t, y in rows if s2 == s] for s in ("train", "test")}
        path.write_text(json.dumps({"kind": "classification", **splits}))
    where = "line 5" if name.endswith(".jsonl") else r"test\[1\]"
    expected = (rf"{name}': label\(s\) 'Sport', 'monye' occur only in the test split \(first at {where}\); "
                r".*correct the label, or add training examples")
    with pytest.raises(ValueError, match=expected):
        load_file_dataset(str(path))


def test_a_test_only_class_listed_in_label_names_is_kept(tmp_path):
    """``label_names`` declares the classes: a class without training examples is the user's choice."""
    path = Path(_classification(tmp_path, ["a", "b"], label_names=["a", "b", "c"]))
    raw = json.loads(path.read_text())
    raw["test"] = raw["test"] + [{"text": "new", "label": "c"}]
    path.write_text(json.dumps(raw))
    data = load_file_dataset(str(path))
    assert data.label_names == ["a", "b", "c"] and data.test_labels == [0, 1, 2]


def test_a_label_outside_label_names_names_its_line(tmp_path):
    """The README promises that an error in a .jsonl file names the line; this one named none."""
    head = json.dumps({"kind": "classification", "label_names": ["sport", "money"]})
    bad = json.dumps({"split": "test", "text": "x", "label": 5})
    with pytest.raises(ValueError, match=r"data.jsonl', line 4: label 5 is not in label_names"):
        load_file_dataset(_write(tmp_path, head, TRAIN, TRAIN2, bad))


@pytest.mark.parametrize("names", [[1, 2, 3, 4, 5], ["1", "2", "3", "4", "5"]])
def test_integer_labels_that_are_the_label_names_keep_their_class(tmp_path, names):
    """Star ratings 1..5 were read as indices: 1 became "2", ..., 4 became "5", and 5 (no index) "5"."""
    data = load_file_dataset(_classification(tmp_path, [1, 2, 3, 4, 5, "3"], label_names=names))
    assert [data.label_names[i] for i in data.train_labels] == ["1", "2", "3", "4", "5", "3"]


def test_integer_labels_that_name_the_class_they_index_are_read_either_way(tmp_path):
    data = load_file_dataset(_classification(tmp_path, [0, 1, 1, "0"], label_names=[0, 1]))
    assert data.label_names == ["0", "1"] and data.train_labels == [0, 1, 1, 0]


@pytest.mark.parametrize("names, labels", [
    ([1, 0], [0, 1]),
    ([1, 0], [1, 1]),
    (["1", "0"], [0, 1]),
    (["a", "0"], [0, "a"]),
])
def test_an_integer_label_that_is_one_name_and_another_index_is_refused(tmp_path, names, labels):
    """Names ["1", "0"] read the integer 0 as index 0 ("1") but the string "0" as "0": now refused."""
    path = _classification(tmp_path, labels, label_names=names)
    expected = r"train\[0\]: label \d is the name '\w' and the index of '\w' in label_names .* write the"
    with pytest.raises(ValueError, match=expected):
        load_file_dataset(path)


def test_string_labels_are_names_when_integer_names_are_ambiguous(tmp_path):
    data = load_file_dataset(_classification(tmp_path, ["0", "1", "0"], label_names=[1, 0]))
    assert data.label_names == ["1", "0"] and data.train_labels == [1, 0, 1]


def test_an_ambiguous_integer_label_in_a_jsonl_file_names_its_line(tmp_path):
    head = json.dumps({"kind": "classification", "label_names": ["1", "0"]})
    rows = [json.dumps({"split": s, "text": "x", "label": y}) for s, y in (("train", "1"), ("test", 0))]
    with pytest.raises(ValueError, match=r"data.jsonl', line 3: label 0 is the name '0' and the index of"):
        load_file_dataset(_write(tmp_path, head, *rows))


@pytest.mark.parametrize("name, text, where, key", [
    ("d.json", '{"kind": "classification",\n "train": [{"text": "a", "label": "x",\n "label": "y"}], '
               '"test": []}', "line 2", "label"),
    ("d.json", '{"kind": "seq2seq", "train": [], "test": [],\n "kind": "classification"}', "line 1", "kind"),
    ("d.jsonl", HEAD + "\n" + TRAIN + '\n{"split": "train", "text": "b", "label": "x", "split": "test"}\n',
     "line 3", "split"),
])
def test_a_key_repeated_in_one_object_is_refused_with_its_line(tmp_path, name, text, where, key):
    """json kept the last of two values of a key: the example went to the other split or label."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"{name}', {where}: the key '{key}' appears twice in one object"):
        load_file_dataset(str(path))


def _json_file(tmp_path, data: dict, name: str = "data.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


CLASSIFICATION = {"kind": "classification", "train": [{"text": "goal", "label": "sport"},
                                                      {"text": "loan", "label": "money"}],
                  "test": [{"text": "bank", "label": "money"}]}


@pytest.mark.parametrize("extra,needle", [
    ({"label_name": ["money", "sport"]}, "unknown key(s) 'label_name'"),
    ({"validation": [{"text": "x", "label": "sport"}]}, "unknown key(s) 'validation'"),
])
def test_an_unknown_top_level_key_is_refused(tmp_path, extra, needle):
    """A misspelt label_names or a validation split was left out without a word."""
    with pytest.raises(ValueError, match=re.escape(needle)):
        load_file_dataset(_json_file(tmp_path, {**CLASSIFICATION, **extra}))


@pytest.mark.parametrize("instead", ["validation", "dev", "tset"])
def test_a_file_without_test_names_the_key_it_holds_instead(tmp_path, instead):
    """A file of train and "validation" (or a misspelt "tset") was told only "'test' must be a non-empty
    list of examples", not which key it held instead."""
    data = {k: v for k, v in CLASSIFICATION.items() if k != "test"}
    with pytest.raises(ValueError, match=rf"unknown key\(s\) '{instead}'.*merge it into train or test"):
        load_file_dataset(_json_file(tmp_path, {**data, instead: CLASSIFICATION["test"]}))


def test_an_unknown_example_key_is_refused(tmp_path):
    """A second sentence under another name ("sentence2") was dropped: the model read the first only."""
    data = json.loads(json.dumps(CLASSIFICATION))
    data["train"][1]["sentence2"] = "rates"
    with pytest.raises(ValueError, match=r"train\[1\]: unknown key\(s\) 'sentence2'.*text_pair"):
        load_file_dataset(_json_file(tmp_path, data))


def test_an_example_identifier_is_read_past(tmp_path):
    data = json.loads(json.dumps(CLASSIFICATION))
    data["train"][0]["idx"], data["test"][0]["id"] = 7, "doc-1"  # as GLUE exports carry them
    assert load_file_dataset(_json_file(tmp_path, data)).train_texts == ["goal", "loan"]


def test_text_pair_examples_are_read_as_sentence_pairs(tmp_path):
    """Rows written as Hugging Face writes pairs ({"text", "text_pair", "label"}) lost their second text."""
    data = json.loads(json.dumps(CLASSIFICATION))
    for split in ("train", "test"):
        for i, row in enumerate(data[split]):
            row["text_pair"] = f"{split} second {i}"
    loaded = load_file_dataset(_json_file(tmp_path, data))
    assert loaded.is_pair and loaded.train_text_pairs == ["train second 0", "train second 1"]
    assert loaded.test_text_pairs == ["test second 0"]
    del data["test"][0]["text_pair"]
    with pytest.raises(ValueError, match=r"test\[0\]: no text_pair, which other examples have"):
        load_file_dataset(_json_file(tmp_path, data))


def test_a_jsonl_first_line_with_examples_is_refused(tmp_path):
    """A "train" list on the {"kind": ...} line was replaced by the examples of the later lines."""
    head = json.dumps({"kind": "classification", "train": [{"text": "x", "label": "sport"}]})
    with pytest.raises(ValueError, match=r"line 1: the first line holds 'train'"):
        load_file_dataset(_write(tmp_path, head, TRAIN, TRAIN2, TEST))


@pytest.mark.parametrize("name", ["DATA.JSON", "Data.Jsonl"])
def test_a_dataset_file_suffix_in_any_case_is_a_dataset_file(tmp_path, name):
    """``--task OK.JSON`` (an existing, valid file) was an "unknown task"."""
    from attnkit.runner.tasks import get_task

    path = _write(tmp_path, HEAD, TRAIN, TRAIN2, TEST, name=name) if name.lower().endswith("jsonl") \
        else _json_file(tmp_path, CLASSIFICATION, name=name)
    assert load_file_dataset(path).label_names == ["money", "sport"]
    assert get_task(path).kind == "classification"
