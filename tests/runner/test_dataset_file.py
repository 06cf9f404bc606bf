"""Dataset files of ``attnkit compare --task FILE``: errors name the file and, for ``.jsonl``, the line."""

from __future__ import annotations

import json

import pytest

from attnkit.runner.tasks import load_file_dataset

HEAD = json.dumps({"kind": "classification"})
TRAIN = json.dumps({"split": "train", "text": "goal team", "label": "sport"})
TEST = json.dumps({"split": "test", "text": "bank rates", "label": "money"})


def _write(tmp_path, *lines: str, name: str = "data.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_a_jsonl_file_reads_both_splits(tmp_path):
    data = load_file_dataset(_write(tmp_path, HEAD, TRAIN, "", TEST, TRAIN))
    assert data.train_texts == ["goal team", "goal team"] and data.test_texts == ["bank rates"]
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
