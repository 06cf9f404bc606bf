"""Reading the dataset files of ``attnkit compare --task my_data.json`` (format in ``attnkit.runner.tasks``).

Kept apart from the tasks so that the run configuration can tell a file's kind without importing them.
"""

from __future__ import annotations

import json
import json.scanner
from pathlib import Path
from typing import Optional

from .._files import json_loads
from ..data.hub import _unique_keys

__all__ = ["read_dataset_file", "file_task_kind", "is_dataset_file_name"]

_FILE_SUFFIXES = (".json", ".jsonl")


def read_dataset_file(path: str) -> dict:
    """The object of a dataset file (``.json``, or ``.jsonl`` with a first ``{"kind": ...}`` line)."""
    p = Path(path)
    _refuse_folder(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"dataset file {path!r} not found; give a built-in task (reuters8, mlu, ...) or an existing "
            ".json/.jsonl file"
        )
    try:
        text = p.read_text(encoding="utf-8-sig")  # a byte-order mark (Notepad's UTF-8) is allowed
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"dataset file {path!r} is not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None
    if p.suffix.lower() == ".jsonl":
        return _read_jsonl(path, text)
    try:
        data = json_loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise ValueError(f"dataset file {path!r} is not valid JSON: {exc}") from None
    except ValueError as exc:  # a repeated key: json would keep its last value
        line = _repeated_key_line(text)
        raise ValueError(f"dataset file {path!r}{'' if line is None else f', line {line}'}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"dataset file {path!r} must hold an object with keys kind, train, test")
    return data


def _repeated_key_line(text: str) -> Optional[int]:
    """The line where the object that repeats a key opens (None if it cannot be told): json's C reader
    gives no position, so the text is read again by its Python reader, whose object parser is wrapped to
    keep the start of each object still open when ``_unique_keys`` refuses one."""
    open_at: list[int] = []

    def parse_object(s_and_end, *args):
        open_at.append(s_and_end[1])
        result = json.decoder.JSONObject(s_and_end, *args)
        open_at.pop()
        return result

    decoder = json.JSONDecoder(object_pairs_hook=_unique_keys)
    decoder.parse_object = parse_object
    decoder.scan_once = json.scanner.py_make_scanner(decoder)
    try:
        decoder.decode(text)
    except (ValueError, RecursionError):
        pass
    return text.count("\n", 0, open_at[-1]) + 1 if open_at else None


def _refuse_folder(path: str) -> None:
    if Path(path).is_dir():
        raise ValueError(
            f"dataset file {path!r} is a folder, not a file; pass the path of the .json/.jsonl file"
        )


def _read_jsonl(path: str, text: str) -> dict:
    """A ``.jsonl`` dataset file: a first ``{"kind": ...}`` line, then one
    ``{"split": "train" | "test", ...}`` object per line. Errors name the file's line number;
    ``data["lines"]`` keeps each example's line."""
    data: dict = {}
    lines: dict[str, list[int]] = {"train": [], "test": []}
    # "\n" alone ends a line: str.splitlines() also splits at U+2028, U+0085, \x0c, ... which JSON allows
    # inside a string (and then counts the lines wrong); a "\r\n" file leaves a "\r" that JSON skips
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        try:
            row = json_loads(line, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as exc:
            raise ValueError(f"dataset file {path!r}, line {number}: not valid JSON ({exc.msg} at column "
                             f"{exc.colno})") from None
        except ValueError as exc:  # a repeated key: json would keep its last value
            raise ValueError(f"dataset file {path!r}, line {number}: {exc}") from None
        if not data:  # the header
            if not isinstance(row, dict) or "kind" not in row:
                raise ValueError(f'dataset file {path!r}, line {number}: the first line must be '
                                 '{"kind": "classification"} or {"kind": "seq2seq"}')
            extra = sorted(set(row) - {"kind", "label_names"})
            if extra:
                raise ValueError(
                    f"dataset file {path!r}, line {number}: the first line holds "
                    f"{', '.join(map(repr, extra))}; it takes \"kind\" (and \"label_names\"), and each "
                    'example is a line of its own with "split"'
                )
            data = {**row, "train": [], "test": []}
            continue
        split = row.get("split") if isinstance(row, dict) else None
        if split not in ("train", "test"):
            raise ValueError(f"dataset file {path!r}, line {number}: {line.strip()[:80]!r}; expected an "
                             'object with "split": "train" or "test" and the example\'s keys')
        data[split].append(row)
        lines[split].append(number)
    if not data:
        raise ValueError(f"dataset file {path!r} is empty; its first line must be "
                         '{"kind": "classification"} or {"kind": "seq2seq"}')
    data["lines"] = lines
    return data


def is_dataset_file_name(path: str) -> bool:
    """Whether ``path`` ends in ``.json`` or ``.jsonl`` (in any case: ``DATA.JSON`` too)."""
    return str(path).lower().endswith(_FILE_SUFFIXES)


def file_task_kind(path: str) -> str:
    """The ``kind`` a dataset file declares (``classification`` or ``seq2seq``)."""
    _refuse_folder(path)
    if not is_dataset_file_name(path):
        from ..data import DATASETS
        from .transduction import TRANSDUCTION_TASKS

        raise ValueError(
            f"unknown task {path!r}; expected one of {', '.join(DATASETS)}, one of the recurrent tasks "
            f"{', '.join(TRANSDUCTION_TASKS)}, or a dataset file ending in .json/.jsonl"
        )
    kind = read_dataset_file(path).get("kind")
    if kind not in ("classification", "seq2seq"):
        raise ValueError(f"dataset file {path!r}: kind={kind!r}; expected 'classification' or 'seq2seq'")
    return kind
