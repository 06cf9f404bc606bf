"""Hugging Face hub datasets (SST-2, MRPC, SNLI) through ``datasets.load_dataset``.

``fetch`` loads the hub dataset (network needed), maps its columns to texts, second texts and labels,
drops unlabeled rows (label ``-1``), and stores the result in the attnkit cache as JSON lines with a
manifest, so that later loads run offline. Local files in the hub's column layout (``train.jsonl`` /
``test.jsonl``, ``.json``, ``.parquet`` or ``.csv``) go through the same mapping with ``source=DIR``.

Without network the hub is never waited on: ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` make the
loader fail at once, otherwise a connection to the hub is tried with a short timeout first.
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import json
import logging
import math
import os
import re
import socket
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

from .._files import NO_LOCKS, json_loads, wide_csv_fields
from .cache import PathLike, verify_manifest, write_bytes_atomic, write_manifest
from .containers import DatasetChecksumError, DatasetUnavailableError, TextClassificationData

__all__ = ["HubSpec", "HUB_SPECS", "fetch_hub", "load_hub_cached", "load_hub_source", "hub_reachable"]

CONNECT_TIMEOUT_S = 3.0
MAX_LINE_BYTES = 64 << 20  # a longer line (or CSV field) of a text split is refused, not read into memory
_READ_CHUNK = 1 << 20  # text splits are checked in chunks of this many bytes
_LOCK_ERRNOS = NO_LOCKS  # what flock raises where a file system has no locks
_EXTENSIONS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass(frozen=True)
class HubSpec:
    """Where a hub dataset lives and which columns hold the texts and the label."""

    name: str
    path: str
    config: Optional[str]
    text_columns: tuple[str, ...]
    label_column: str
    label_names: tuple[str, ...]
    train_split: str = "train"
    test_split: str = "validation"

    @property
    def hub_id(self) -> str:
        return self.path if self.config is None else f"{self.path}/{self.config}"


HUB_SPECS: dict[str, HubSpec] = {
    "sst2": HubSpec("sst2", "nyu-mll/glue", "sst2", ("sentence",), "label", ("negative", "positive")),
    "mrpc": HubSpec(
        "mrpc", "nyu-mll/glue", "mrpc", ("sentence1", "sentence2"), "label", ("not_equivalent", "equivalent")
    ),
    "snli": HubSpec(
        "snli",
        "stanfordnlp/snli",
        None,
        ("premise", "hypothesis"),
        "label",
        ("entailment", "neutral", "contradiction"),
        test_split="test",
    ),
}


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def hub_reachable(timeout: float = CONNECT_TIMEOUT_S) -> Optional[str]:
    """``None`` when a TCP connection to the hub opens within ``timeout`` seconds, else why not."""
    if _truthy("HF_HUB_OFFLINE") or _truthy("HF_DATASETS_OFFLINE"):
        return "HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # through a proxy a direct connection says nothing; the hub client's own timeouts apply
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        url = urlparse(endpoint)
        host, port = url.hostname, url.port or (443 if url.scheme != "http" else 80)
    except ValueError as exc:  # a port out of range
        return f"HF_ENDPOINT={endpoint!r} is not a usable URL ({exc})"
    if not host:
        return f"HF_ENDPOINT={endpoint!r} names no host; expected a URL such as https://huggingface.co"
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return f"cannot connect to {host}:{port} ({exc.__class__.__name__}: {exc})"


def _import_datasets():
    try:
        import datasets
    except ImportError:
        raise DatasetUnavailableError(
            "Hugging Face datasets need the 'datasets' package: pip install 'attnkit[data]'"
        ) from None
    return datasets


def _label_value(y: Any) -> Any:
    """A label as read: an empty cell (``None``, or NaN from a CSV column that pandas read as floats) is
    ``None``, and a whole float of such a column (``1.0``) is its integer."""
    if isinstance(y, float) and not isinstance(y, bool):
        if math.isnan(y):
            return None
        if y.is_integer():
            return int(y)
    return y


def _class_names(table: Any, column: str) -> Optional[list[str]]:
    """The class names of a ClassLabel column, or ``None`` (plain integers, or no features)."""
    features = getattr(table, "features", None)
    feature = features.get(column) if features is not None else None
    names = getattr(feature, "names", None)
    return list(names) if names else None


def _to_data(spec: HubSpec, train: Any, test: Any) -> TextClassificationData:
    """Map hub columns to a ``TextClassificationData``; rows with label ``-1`` or no label (unlabeled) are
    dropped. The classes are the catalog's (``spec.label_names``): a split whose ClassLabel orders them
    otherwise (or names only some of them) is re-mapped to them, one that names another class is refused."""
    columns = [*spec.text_columns, spec.label_column]
    label_names = list(spec.label_names)
    splits = {}
    for split, table in (("train", train), ("test", test)):
        missing = [c for c in columns if c not in table.column_names]
        if missing:
            raise ValueError(
                f"{spec.name}: the {split} split has columns {table.column_names}, expected {columns} "
                f"(the layout of {spec.hub_id} on the hub)"
            )
        # a split's ClassLabel names its own ids: a test split encoded on its own (datasets'
        # class_encode_column per split) may number the classes otherwise than the train split
        names = _class_names(table, spec.label_column) or label_names
        unknown = [n for i, n in enumerate(names) if n not in label_names or n in names[:i]]
        if unknown:  # a source must not redefine the catalog dataset's classes
            raise ValueError(
                f"{spec.name}: the {split} split's ClassLabel classes {names} are not {spec.name}'s classes "
                f"{label_names} ({unknown} not among them); label the rows with these classes (datasets' "
                f"cast_column with ClassLabel(names={label_names})) or with integer ids into them"
            )
        labels = [_label_value(y) for y in table[spec.label_column]]
        keep = [i for i, y in enumerate(labels) if y is not None and y != -1]
        bad = [
            labels[i]
            for i in keep
            if isinstance(labels[i], bool)
            or not isinstance(labels[i], int)
            or not 0 <= labels[i] < len(names)
        ]
        if bad:
            raise ValueError(
                f"{spec.name}: {split} label {bad[0]!r} is not an integer in [0, {len(names)}) "
                f"(classes {names}) or -1 for unlabeled"
            )
        to_train_id = [label_names.index(n) for n in names]
        if not keep:
            raise ValueError(
                f"{spec.name}: the {split} split has no labeled row ({len(labels)} rows, all labels -1 or "
                "missing); a hub test split without labels cannot be the test set, use the validation split"
            )
        texts = [list(table[c]) for c in spec.text_columns]
        for column, values in zip(spec.text_columns, texts):
            odd = next((values[i] for i in keep if not isinstance(values[i], str)), "")
            if not isinstance(odd, str):
                raise ValueError(f"{spec.name}: {split} {column!r} holds {odd!r}; expected text in every row")
        splits[split] = (
            [str(texts[0][i]) for i in keep],
            [str(texts[1][i]) for i in keep] if len(texts) > 1 else None,
            [to_train_id[labels[i]] for i in keep],
        )
    return TextClassificationData(
        name=spec.name,
        train_texts=splits["train"][0],
        train_labels=splits["train"][2],
        test_texts=splits["test"][0],
        test_labels=splits["test"][2],
        label_names=label_names,
        train_text_pairs=splits["train"][1],
        test_text_pairs=splits["test"][1],
    )


def _not_a_file_kind(path: Path) -> Optional[str]:
    """What stands at ``path`` when it exists and is not a regular file (a folder, a FIFO, ...), else None."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    kinds = {stat.S_ISDIR: "a folder", stat.S_ISFIFO: "a named pipe (FIFO)", stat.S_ISSOCK: "a socket",
             stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device"}
    return next((kind for test, kind in kinds.items() if test(mode)), "not a regular file")


def _split_file(folder: Path, names: tuple[str, ...]) -> Optional[Path]:
    """The file of the first of the split ``names`` found in ``folder`` (``train.jsonl``, ...), or None; a
    symbolic link to nothing at such a name is refused by name (it read as no file, while the error listed
    it among the files found), and so is a folder or a FIFO there (it read as no file too)."""
    for name in names:
        for path in (folder / f"{name}{ext}" for ext in _EXTENSIONS):
            if path.is_symlink() and not path.exists():
                raise DatasetUnavailableError(
                    f"{path} is a symbolic link to {os.readlink(path)}, which does not exist; point it at "
                    f"the {name} split's file, or remove it"
                )
            kind = _not_a_file_kind(path)
            if kind is not None:
                raise DatasetUnavailableError(
                    f"{path} is {kind}, not a regular file; put the {name} split's file there, or remove it"
                )
        found = [folder / f"{name}{ext}" for ext in _EXTENSIONS if (folder / f"{name}{ext}").is_file()]
        if len(found) > 1:
            raise ValueError(
                f"{folder} holds {' and '.join(p.name for p in found)}: it is ambiguous which is the {name} "
                "split; keep one of them in the folder"
            )
        if found:
            return found[0]
    return None


def load_hub_source(spec: HubSpec, source: PathLike) -> TextClassificationData:
    """Load local files in the hub layout: ``source`` is a folder with ``train.*`` and ``<test split>.*``
    (or ``test.*``), each ``.jsonl``/``.json``/``.parquet``/``.csv``. The catalog's test split comes first,
    as a download takes it: a full copy of SST-2 or MRPC holds an unlabeled ``test`` beside ``validation``."""
    folder = Path(source).expanduser()
    if not folder.is_dir():
        raise DatasetUnavailableError(
            f"{spec.name}: source {folder} is not a folder; pass a folder with train.<ext> and "
            f"{spec.test_split}.<ext>{'' if spec.test_split == 'test' else ' (or test.<ext>)'} files"
        )
    train = _split_file(folder, ("train",))
    test = _split_file(folder, tuple(dict.fromkeys((spec.test_split, "test"))))
    if train is None or test is None:
        either = "" if spec.test_split == "test" else " (or test.<ext>)"
        raise DatasetUnavailableError(
            f"{spec.name}: {folder} needs train.<ext> and {spec.test_split}.<ext>{either} with ext in "
            f"{tuple(_EXTENSIONS)}; found {sorted(p.name for p in folder.iterdir())}"
        )
    if _EXTENSIONS[train.suffix] != _EXTENSIONS[test.suffix]:
        raise ValueError(f"{spec.name}: {train.name} and {test.name} must have the same format")
    datasets = _import_datasets()
    with tempfile.TemporaryDirectory(
        prefix="attnkit-hf-"
    ) as scratch:  # nothing is written beside the user's files
        tables = [_read_source_file(datasets, spec, path, scratch) for path in (train, test)]
        return _to_data(spec, *tables)


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n} bytes"


def _line_too_long(spec: HubSpec, path: Path, number: int) -> ValueError:
    return ValueError(
        f"{spec.name}: {path} line {number} is longer than {_size(MAX_LINE_BYTES)}; a split file holds "
        "one example per line (JSON lines) or row (CSV): check that it is the right file"
    )


def _check_utf8(spec: HubSpec, path: Path) -> None:
    """Text files must be UTF-8 (a byte-order mark allowed), not UTF-16, not binary (NUL bytes through the
    text) and, but for a ``.json`` document, without a line over ``MAX_LINE_BYTES``: a ``ValueError`` naming
    the file and line. The file is read in chunks of
    ``_READ_CHUNK`` bytes (a file without a newline was one line, read whole into memory)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    size = max(1, min(_READ_CHUNK, MAX_LINE_BYTES))  # a line inside one chunk is within the cap
    number, offset, line_start = 1, 0, 0  # line number, file offset of the chunk, of the current line
    # a .json split may be one array on one line (json.dump's default): no cap on its lines, its reading is
    # bounded by the memory check around it
    capped = path.suffix.lower() != ".json"
    with open(path, "rb") as f:
        while chunk := f.read(size):
            if offset == 0 and chunk[:2] in (b"\xff\xfe", b"\xfe\xff"):  # NULs of every ASCII character
                raise ValueError(
                    f"{spec.name}: {path} is UTF-16 (its byte-order mark), not UTF-8; save the file as UTF-8"
                )
            nul = chunk.find(b"\0")
            # NULs through the text (more than 16, and more than 1 byte in 100) are a binary file; a stray one
            # in a cell is the reader's to judge, as before
            if nul >= 0 and chunk.count(b"\0") > max(16, len(chunk) // 100):
                raise ValueError(
                    f"{spec.name}: {path} is binary (a NUL byte at offset {offset + nul}), not a UTF-8 text "
                    "file; give the split as UTF-8 .jsonl, .json or .csv text, or as .parquet"
                )
            pending = len(decoder.getstate()[0])  # bytes of a character begun in the previous chunk
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as exc:
                at = max(0, exc.start - pending)  # in the chunk; the character began at offset + at
                number += chunk.count(b"\n", 0, at)
                start = chunk.rfind(b"\n", 0, at)
                line_start = offset + start + 1 if start >= 0 else line_start
                raise ValueError(
                    f"{spec.name}: {path} line {number} is not UTF-8 ({exc.reason} at byte "
                    f"{offset + exc.start - pending - line_start} of the line); save the file as UTF-8"
                ) from None
            first, last = chunk.find(b"\n"), chunk.rfind(b"\n")
            if capped and (offset + (first if first >= 0 else len(chunk))) - line_start > MAX_LINE_BYTES:
                raise _line_too_long(spec, path, number)
            if last >= 0:
                number += chunk.count(b"\n")
                line_start = offset + last + 1
            offset += len(chunk)
    pending = len(decoder.getstate()[0])  # a character cut off by the end of the file
    if pending:
        raise ValueError(
            f"{spec.name}: {path} line {number} is not UTF-8 (unexpected end of data at byte "
            f"{offset - pending - line_start} of the line); save the file as UTF-8"
        )


def _check_label_type(spec: HubSpec, path: Path, where: str, row: dict) -> None:
    """A row of a JSON file has a label, a finite number or null: the JSON reader would otherwise read a
    column that mixes numbers and strings by guessing (``"0"`` as 0, ``" 1 "`` as 1), while a column of
    strings is refused; and a row without the key, or with ``NaN``, was dropped as unlabeled (only -1 and
    null mean unlabeled), ``Infinity`` failed in the reader."""
    if spec.label_column not in row:
        raise ValueError(
            f"{spec.name}: {path} {where} has no {spec.label_column!r} key; give every row its label, an "
            "integer class index (or -1 / null for unlabeled)"
        )
    label = row[spec.label_column]
    if label is None or isinstance(label, int) and not isinstance(label, bool):
        return
    if isinstance(label, float) and math.isfinite(label):
        return  # 1.0 is the class 1; 1.5 is refused with the other labels of the split
    shown = json.dumps(label) if isinstance(label, float) else repr(label)  # NaN, Infinity as written
    raise ValueError(
        f"{spec.name}: {path} {where}: label {shown} is not an integer class index (or -1 / null for "
        "unlabeled)"
    )


def _check_text_types(spec: HubSpec, path: Path, where: str, row: dict) -> None:
    """The text columns of a JSON row hold strings (or null, refused later in a labeled row): the JSON reader
    reads a file in 10 MiB chunks, and a chunk whose text column holds a number or an object is read
    JSON-encoded, every text of it wrapped in quotes, silently (a small file was refused in ``_to_data``)."""
    for column in spec.text_columns:
        value = row.get(column)
        if value is not None and not isinstance(value, str):
            raise ValueError(
                f"{spec.name}: {path} {where}: {column!r} holds {json.dumps(value)[:40]}; expected text (a "
                "JSON string) in every row"
            )


def _check_row(spec: HubSpec, path: Path, where: str, row: dict) -> None:
    """One row of a JSON file: its label (``_check_label_type``) and its texts (``_check_text_types``)."""
    _check_label_type(spec, path, where, row)
    _check_text_types(spec, path, where, row)


def _no_rows(spec: HubSpec, path: Path) -> ValueError:
    return ValueError(f"{spec.name}: {path} has no rows; a split file needs at least one example")


def _not_rows(spec: HubSpec, path: Path, got: str) -> ValueError:
    return ValueError(f"{spec.name}: {path} holds {got}; expected an array of objects (one per row)")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """A JSON object whose keys are distinct (the JSON reader refuses a repeated key with an unreadable
    error, while ``json`` keeps the last value)."""
    keys = [k for k, _ in pairs]
    twice = next((k for i, k in enumerate(keys) if k in keys[:i]), None)
    if twice is not None:
        raise ValueError(f"the key {twice!r} appears twice in one object; keep one")
    return dict(pairs)


def _check_json_lines(spec: HubSpec, path: Path) -> None:
    """JSON lines: one object per line, each naming its line number when it is not one."""
    rows = 0
    with open(path, encoding="utf-8-sig") as f:
        for number, line in enumerate(f, start=1):
            try:
                row = json_loads(line, object_pairs_hook=_unique_keys) if line.strip() else {}
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{spec.name}: {path} line {number} is not JSON ({exc.msg} at column {exc.colno})"
                ) from None
            except ValueError as exc:
                raise ValueError(f"{spec.name}: {path} line {number}: {exc}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{spec.name}: {path} line {number} is not a JSON object")
            if line.strip():  # a blank line is no row
                _check_row(spec, path, f"line {number}", row)
                rows += 1
    if not rows:
        raise _no_rows(spec, path)


_JSON_TYPES = {str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def _check_json_document(spec: HubSpec, path: Path, whole: Any) -> None:
    """A whole ``.json`` document: an array of objects, or one object (JSON lines of one line)."""
    if isinstance(whole, dict):
        if not whole:
            raise _no_rows(spec, path)
        _check_row(spec, path, "line 1", whole)
        return
    if not isinstance(whole, list):
        raise _not_rows(spec, path, f"a JSON {_JSON_TYPES[type(whole)]} ({json.dumps(whole)[:40]})")
    if not whole:
        raise _no_rows(spec, path)
    for number, row in enumerate(whole):
        if not isinstance(row, dict):
            raise _not_rows(spec, path, f"{json.dumps(row)[:40]} as row {number}")
        _check_row(spec, path, f"row {number}", row)


def _check_json(spec: HubSpec, path: Path) -> None:
    """A ``.json`` file: a JSON array of objects (one per row), or JSON lines under another name."""
    text = path.read_text(encoding="utf-8-sig")
    if not text.strip():
        raise _no_rows(spec, path)
    try:
        whole = json_loads(text)
    except json.JSONDecodeError as exc:
        first = text.lstrip().split("\n", 1)[0]
        try:
            lines = isinstance(json_loads(first), dict)
        except ValueError:
            lines = False
        if lines:  # JSON lines: name the line that is not
            _check_json_lines(spec, path)
            return
        raise ValueError(
            f"{spec.name}: {path} is not JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); expected "
            "an array of objects (one per row) or one object per line"
        ) from None
    try:
        json_loads(text, object_pairs_hook=_unique_keys)
    except ValueError as exc:
        raise ValueError(f"{spec.name}: {path}: {exc}") from None
    _check_json_document(spec, path, whole)


_CSV_INTEGER = re.compile(r"[+-]?\d+(\.0*)?")  # pandas reads "1" and "1.0" as the class id 1


def _check_csv(spec: HubSpec, path: Path) -> None:
    """A ``.csv`` file: a header line and at least one row (a quoted field may span lines)."""
    try:
        with open(path, encoding="utf-8-sig", newline="") as f, wide_csv_fields():  # a long document too
            csv.field_size_limit(MAX_LINE_BYTES)  # but not a 2 GB field (restored on leaving the block)
            reader = csv.reader(f)
            lines = (row for row in reader if row)  # a blank line is no row
            header, first = next(lines, None), next(lines, None)
            column = header.index(spec.label_column) if header and spec.label_column in header else None
            row = first
            while row is not None and header is not None:
                if len(row) != len(header):  # pandas: a missing cell reads as unlabeled, an extra one shifts
                    raise ValueError(
                        f"{spec.name}: {path} line {reader.line_num}: {len(row)} field(s) where the header "
                        f"names {len(header)} ({', '.join(header)}); quote fields that hold commas, and "
                        "remove a trailing comma"
                    )
                if column is None:
                    row = next(lines, None)
                    continue
                cell = row[column].strip()
                if row[column] and not cell:  # pandas reads it as text, and the whole column as strings
                    raise ValueError(
                        f"{spec.name}: {path} line {reader.line_num}: the label cell holds only spaces "
                        f"({row[column]!r}); leave it empty for an unlabeled row, or write the class id"
                    )
                if cell and not _CSV_INTEGER.fullmatch(cell):
                    raise ValueError(
                        f"{spec.name}: {path} line {reader.line_num}: label {cell!r} is not an integer; "
                        "expected a class id, or -1 or an empty cell for an unlabeled row"
                    )
                row = next(lines, None)
    except csv.Error as exc:
        if "field larger than field limit" in str(exc):  # a quoted field spanning lines, over the cap
            raise ValueError(
                f"{spec.name}: {path} line {reader.line_num}: a field is longer than "
                f"{_size(MAX_LINE_BYTES)}; check the file's quotes (a quote left open reads the rest of the "
                "file as one field)"
            ) from None
        return  # the reader names the problem
    if header is None:
        raise ValueError(
            f"{spec.name}: {path} is empty; expected a header line naming the columns "
            f"{[*spec.text_columns, spec.label_column]} and one row per example"
        )
    if first is None:
        raise _no_rows(spec, path)


def _check_parquet(spec: HubSpec, path: Path) -> None:
    """A ``.parquet`` file: at least one row, and no NaN or infinite label in a float label column (NaN was
    dropped as unlabeled; only -1 and null mean unlabeled), named by its row, as in JSON."""
    try:
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
        import pyarrow.types as pa_types

        count = pq.read_metadata(path).num_rows
        labels = pq.read_table(path, columns=[spec.label_column]).column(0) if count else None
    except Exception:  # not parquet, no pyarrow, or no label column: the reader or _to_data names the problem
        return
    if count == 0:
        raise _no_rows(spec, path)
    if pa_types.is_floating(labels.type):
        finite = pc.fill_null(pc.is_finite(labels), True)  # null is an unlabeled row
        row = pc.index(finite, False).as_py()
        if row >= 0:
            _check_label_type(spec, path, f"row {row}", {spec.label_column: labels[row].as_py()})


_CHECKS = {".jsonl": _check_json_lines, ".json": _check_json, ".csv": _check_csv, ".parquet": _check_parquet}


@contextlib.contextmanager
def _quiet(datasets):
    """Hide the ``datasets`` progress bars and log lines of a local read (it takes moments, and a failure
    is reported by one ``ValueError``); the user's own settings are restored afterwards."""
    bars_were_off = datasets.utils.are_progress_bars_disabled()
    verbosity = datasets.utils.logging.get_verbosity()
    datasets.utils.disable_progress_bars()
    datasets.utils.logging.set_verbosity(logging.CRITICAL)
    try:
        yield
    finally:
        datasets.utils.logging.set_verbosity(verbosity)
        if not bars_were_off:
            datasets.utils.enable_progress_bars()


def _check_source_file(spec: HubSpec, path: Path) -> None:
    """The checks of one split file before the reader; memory running out in them is a ``ValueError``."""
    try:
        if path.suffix in (".jsonl", ".json", ".csv"):
            _check_utf8(spec, path)
        _CHECKS[path.suffix](spec, path)
    except MemoryError:
        raise ValueError(
            f"{spec.name}: {path} ({path.stat().st_size} bytes) does not fit in memory while being checked; "
            "split it into smaller files, or run where more memory is free"
        ) from None


def _reader_error(spec: HubSpec, path: Path, scratch: str, exc: BaseException) -> ValueError:
    """One line for a reader's failure: the file it could not read, or its scratch folder without locks."""
    if isinstance(exc, MemoryError):
        return ValueError(
            f"{spec.name}: cannot read {path} (MemoryError: out of memory); split it into smaller files, or "
            "run where more memory is free"
        )
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if isinstance(exc, OSError) and exc.errno in _LOCK_ERRNOS:  # the reader locks files in its scratch
        return ValueError(
            f"{spec.name}: the datasets reader cannot lock files in its scratch folder {scratch} "
            f"({type(exc).__name__}: {first}): that file system has no file locks; set TMPDIR to a local "
            "folder (e.g. TMPDIR=$HOME/tmp) and run again"
        )
    return ValueError(f"{spec.name}: cannot read {path} ({type(exc).__name__}: {first})")


def _read_source_file(datasets, spec: HubSpec, path: Path, scratch: str):
    """One local split file as a ``datasets.Dataset``; a file it cannot read is a ``ValueError`` naming it."""
    _check_source_file(spec, path)
    # a CSV label cell is missing only when empty: pandas' default missing-value strings ("NA", "null",
    # "None", "nan", ...) are an error there, not an unlabeled row; a text cell is text as written, as in
    # JSON: "null" and "42" are not None and 42, an empty cell is "" (it was None, refused)
    options = {}
    if path.suffix == ".csv":
        options = {"keep_default_na": False, "na_values": {spec.label_column: [""]},
                   "converters": {column: str for column in spec.text_columns}}
    try:
        with _quiet(datasets):
            return datasets.load_dataset(
                _EXTENSIONS[path.suffix], data_files={"train": str(path)}, split="train",
                cache_dir=scratch, keep_in_memory=True, **options,
            )
    except Exception as exc:  # the readers' errors are many (pyarrow, pandas, empty file): one line
        raise _reader_error(spec, path, scratch, exc) from None


def _load_from_hub(spec: HubSpec) -> TextClassificationData:
    reason = hub_reachable()
    if reason is not None:
        raise DatasetUnavailableError(
            f"{spec.name}: the Hugging Face hub dataset {spec.hub_id} cannot be downloaded here: {reason}. "
            f"Run `attnkit data fetch {spec.name}` where the hub is reachable and copy the attnkit cache "
            f"($ATTNKIT_CACHE), or run `attnkit data fetch {spec.name} --source DIR` (source=DIR in Python) "
            f"with a folder DIR of train.<ext> and "
            f"{spec.test_split}.<ext> files (ext jsonl, json, parquet or csv) in the hub's columns "
            f"{list(spec.text_columns)} + [{spec.label_column!r}]"
        )
    datasets = _import_datasets()
    try:
        loaded = datasets.load_dataset(spec.path, spec.config)
    except Exception as exc:  # the hub's errors are many (HTTP, auth, missing config); report one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DatasetUnavailableError(
            f"{spec.name}: datasets.load_dataset({spec.hub_id!r}) failed: {first}"
        ) from None
    return _to_data(spec, loaded[spec.train_split], loaded[spec.test_split])


def _write_jsonl(path: Path, texts: list[str], pairs: Optional[list[str]], labels: list[int]) -> None:
    lines = []
    for i, (text, label) in enumerate(zip(texts, labels)):
        row = {"text": text, "label": label}
        if pairs is not None:
            row["text_pair"] = pairs[i]
        lines.append(json.dumps(row, ensure_ascii=False))
    write_bytes_atomic(path, ("\n".join(lines) + "\n").encode("utf-8"))


def fetch_hub(spec: HubSpec, folder: Path, *, source: Optional[PathLike] = None) -> Path:
    """Load from the hub (or local ``source`` files); write train/test ``.jsonl`` and ``labels.json``."""
    data = load_hub_source(spec, source) if source is not None else _load_from_hub(spec)
    _write_jsonl(folder / "train.jsonl", data.train_texts, data.train_text_pairs, data.train_labels)
    _write_jsonl(folder / "test.jsonl", data.test_texts, data.test_text_pairs, data.test_labels)
    write_bytes_atomic(folder / "labels.json", (json.dumps(data.label_names) + "\n").encode())
    origin = str(Path(source).expanduser().resolve()) if source is not None else f"hf://{spec.hub_id}"
    write_manifest(folder, origin, ["train.jsonl", "test.jsonl", "labels.json"])
    return folder


def _read_jsonl(name: str, path: Path) -> tuple[list[str], Optional[list[str]], list[int]]:
    """A cached split: one object per line with a ``text`` (and ``text_pair``) string and an integer
    ``label``. The manifest matched, but the cache may have been copied from elsewhere: a line of another
    shape is a ``DatasetChecksumError`` naming the file, the line and the fix."""
    texts, pairs, labels = [], [], []
    with open(path, encoding="utf-8-sig") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json_loads(line)
            except ValueError as exc:
                row, why = None, f"not JSON ({exc})"
            else:
                why = "not an object with a text string and an integer label"
            good = (
                isinstance(row, dict) and isinstance(row.get("text"), str)
                and isinstance(row.get("label"), int) and not isinstance(row.get("label"), bool)
                and isinstance(row.get("text_pair", ""), str)
            )
            if not good:
                raise DatasetChecksumError(
                    f"dataset {name!r}: cached file {path} line {number} is {why}; run `attnkit data fetch "
                    f"{name} --force`"
                )
            texts.append(row["text"])
            labels.append(row["label"])
            if "text_pair" in row:
                pairs.append(row["text_pair"])
    return texts, (pairs if pairs else None), labels


def load_hub_cached(spec: HubSpec, folder: Path) -> TextClassificationData:
    """Load a fetched hub dataset from the attnkit cache (offline) after verifying the manifest."""
    verify_manifest(spec.name, folder, required=("train.jsonl", "test.jsonl", "labels.json"))
    train_texts, train_pairs, train_labels = _read_jsonl(spec.name, folder / "train.jsonl")
    test_texts, test_pairs, test_labels = _read_jsonl(spec.name, folder / "test.jsonl")
    labels_file = folder / "labels.json"
    try:
        label_names = json_loads(labels_file.read_text(encoding="utf-8"))
    except ValueError:
        label_names = None
    if not (isinstance(label_names, list) and label_names and all(isinstance(n, str) for n in label_names)):
        raise DatasetChecksumError(
            f"dataset {spec.name!r}: cached file {labels_file} is not a JSON list of class names; run "
            f"`attnkit data fetch {spec.name} --force`"
        )
    if label_names != list(spec.label_names):  # the catalog's classes, in its order, as fetch writes them
        raise DatasetChecksumError(
            f"dataset {spec.name!r}: cached file {labels_file} names the classes {label_names}, not "
            f"{spec.name}'s {list(spec.label_names)}; run `attnkit data fetch {spec.name} --force`"
        )
    for split, rows in (("train", train_texts), ("test", test_texts)):
        if not rows:  # fetch refuses a split without labeled rows: an empty one was not written by it
            raise DatasetChecksumError(
                f"dataset {spec.name!r}: cached file {folder / f'{split}.jsonl'} has no rows; run "
                f"`attnkit data fetch {spec.name} --force`"
            )
    for split, texts, pairs in (("train", train_texts, train_pairs), ("test", test_texts, test_pairs)):
        if pairs is not None and len(pairs) != len(texts):  # some rows without their second text
            raise DatasetChecksumError(
                f"dataset {spec.name!r}: cached file {folder / f'{split}.jsonl'} gives a text_pair on "
                f"{len(pairs)} of its {len(texts)} rows; run `attnkit data fetch {spec.name} --force`"
            )
    bad = next((y for y in train_labels + test_labels if not 0 <= y < len(label_names)), None)
    if bad is not None:
        raise DatasetChecksumError(
            f"dataset {spec.name!r}: cached label {bad} is not a class of {labels_file} "
            f"({len(label_names)} classes); run `attnkit data fetch {spec.name} --force`"
        )
    return TextClassificationData(
        name=spec.name,
        train_texts=train_texts,
        train_labels=train_labels,
        test_texts=test_texts,
        test_labels=test_labels,
        label_names=label_names,
        train_text_pairs=train_pairs,
        test_text_pairs=test_pairs,
    )
