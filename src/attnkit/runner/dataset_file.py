"""Reading the dataset files of ``attnkit compare --task my_data.json`` (format in ``attnkit.runner.tasks``).

Kept apart from the tasks so that the run configuration can tell a file's kind without importing them.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["read_dataset_file", "file_task_kind"]

_FILE_SUFFIXES = (".json", ".jsonl")


def read_dataset_file(path: str) -> dict:
    """The object of a dataset file (``.json``, or ``.jsonl`` with a first ``{"kind": ...}`` line)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"dataset file {path!r} not found; give a built-in task (reuters8, mlu, ...) or an existing "
            ".json/.jsonl file"
        )
    try:
        if p.suffix == ".jsonl":
            lines = [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
            if not lines or "kind" not in lines[0]:
                raise ValueError('the first line must be {"kind": "classification"} or {"kind": "seq2seq"}')
            head, rows = lines[0], lines[1:]
            data = {k: v for k, v in head.items()}
            for split in ("train", "test"):
                data[split] = [r for r in rows if r.get("split") == split]
            return data
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"dataset file {path!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"dataset file {path!r} must hold an object with keys kind, train, test")
    return data


def file_task_kind(path: str) -> str:
    """The ``kind`` a dataset file declares (``classification`` or ``seq2seq``)."""
    if not str(path).endswith(_FILE_SUFFIXES):
        from ..data import DATASETS

        raise ValueError(
            f"unknown task {path!r}; expected one of {', '.join(DATASETS)} or a dataset file ending in "
            ".json/.jsonl"
        )
    kind = read_dataset_file(path).get("kind")
    if kind not in ("classification", "seq2seq"):
        raise ValueError(f"dataset file {path!r}: kind={kind!r}; expected 'classification' or 'seq2seq'")
    return kind
