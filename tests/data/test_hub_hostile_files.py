"""Hub ``--source`` folders holding hostile files: binary or newline-less files, lockless scratch, FIFOs."""

from __future__ import annotations

import errno
import fcntl
import os
import re
import tempfile
import tracemalloc

import pytest

from attnkit.data import DatasetUnavailableError, hub, load_dataset

pytest.importorskip("datasets")

_VALID = {".jsonl": '{"sentence": "fine work", "label": 1}\n', ".csv": "sentence,label\nfine work,1\n"}


def _source(folder, suffix, train: bytes):
    """A source folder with ``train`` as the train split's bytes and a valid validation split."""
    folder.mkdir(exist_ok=True)
    (folder / f"train{suffix}").write_bytes(train)
    (folder / f"validation{suffix}").write_text(_VALID[suffix])
    return folder


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_a_nul_file_is_refused_as_binary_without_reading_it_whole(tmp_path, suffix):
    """An all-NUL (sparse) train file was checked line by line in binary: with no newline the whole file was
    one line in memory (a 2 GB file peaked at 4.7 GB, then a MemoryError traceback), and a NUL CSV built one
    2 GB field; then it was refused as "not JSON". It is now refused at its first NUL byte, in chunks."""
    source = _source(tmp_path / "s", suffix, b'{"sentence": "a", "label": 0}\n' * 2 + bytes(8 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"is binary \(a NUL byte at offset 60\), not a UTF-8 text file"):
            load_dataset("sst2", source=source)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20  # the 8 MiB line was never held whole


def test_a_line_over_the_cap_is_refused_by_its_number(tmp_path, monkeypatch):
    """A newline-less text file (no NUL) was read as one line of its whole size: a line over
    ``MAX_LINE_BYTES`` is now refused, naming the file and the line, as soon as the cap is passed."""
    monkeypatch.setattr(hub, "MAX_LINE_BYTES", 1 << 20, raising=False)
    monkeypatch.setattr(hub, "_READ_CHUNK", 64 << 10, raising=False)
    source = _source(tmp_path / "s", ".jsonl", b'{"sentence": "a", "label": 0}\n' + b"a" * (3 << 20))
    with pytest.raises(ValueError, match=r"train\.jsonl line 2 is longer than 1 MiB"):
        load_dataset("sst2", source=source)


def test_a_csv_field_over_the_cap_is_refused_by_its_line(tmp_path, monkeypatch):
    """A quote left open makes the rest of a CSV file one field, however long (the field limit was 2**31 - 1):
    a field over ``MAX_LINE_BYTES`` is now refused with the line where the reader stopped."""
    monkeypatch.setattr(hub, "MAX_LINE_BYTES", 4096, raising=False)
    text = 'sentence,label\n"open quote,1\n' + "more text on a short line\n" * 400
    source = _source(tmp_path / "s", ".csv", text.encode())
    with pytest.raises(ValueError, match=r"train\.csv line \d+: a field is longer than 4096 bytes; check"):
        load_dataset("sst2", source=source)


def test_utf8_errors_name_the_same_line_and_byte_when_read_in_chunks(tmp_path, monkeypatch):
    """Reading in chunks must not move the reported place of a bad byte (a chunk border inside a line, or
    inside a multi-byte character, is invisible in the message)."""
    monkeypatch.setattr(hub, "_READ_CHUNK", 3, raising=False)
    good = '{"sentence": "caf\u00e9 \u20ac", "label": 0}\n'.encode()
    source = _source(tmp_path / "s", ".jsonl", good + b'{"sentence": "b\xff"}\n')
    bad_byte = r"line 2 is not UTF-8 \(invalid start byte at byte 15 of the line\)"
    with pytest.raises(ValueError, match=bad_byte):
        load_dataset("sst2", source=source)
    (source / "train.jsonl").write_bytes(good)
    assert load_dataset("sst2", source=source).train_texts == ["caf\u00e9 \u20ac"]


def test_memory_running_out_while_checking_is_one_line(tmp_path, monkeypatch):
    """A MemoryError while checking a split file escaped as a traceback; it is now a ValueError naming the
    file and what to do."""

    def out_of_memory(spec, path):
        raise MemoryError

    monkeypatch.setitem(hub._CHECKS, ".jsonl", out_of_memory)
    source = _source(tmp_path / "s", ".jsonl", _VALID[".jsonl"].encode())
    with pytest.raises(ValueError, match=r"train\.jsonl \(\d+ bytes\) does not fit in memory while being"):
        load_dataset("sst2", source=source)


@pytest.mark.parametrize("code", ["ENOLCK", "EOPNOTSUPP", "EINVAL", "EBADF"])
def test_a_scratch_folder_without_locks_is_named_with_the_fix(tmp_path, monkeypatch, code):
    """With $TMPDIR on a file system without flock, the error blamed the user's file ("cannot read
    train.csv (OSError: [Errno 37] No locks available)"), which is fine; it now names the scratch folder
    the reader locks in, and says to set TMPDIR to a local folder."""
    scratch_root = tmp_path / "lockless"
    scratch_root.mkdir()
    real_flock = fcntl.flock

    def flock(fd, operation):
        name = os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}")
        if name.startswith(str(scratch_root)):
            raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))
        return real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch_root))
    source = _source(tmp_path / "s", ".csv", _VALID[".csv"].encode())
    with pytest.raises(ValueError) as info:
        load_dataset("sst2", source=source)
    message = str(info.value)
    assert f"scratch folder {scratch_root}{os.sep}attnkit-hf-" in message
    assert "set TMPDIR to a local folder" in message
    assert "\n" not in message


@pytest.mark.parametrize("kind", ["a folder", "a named pipe (FIFO)"])
def test_a_split_name_that_is_not_a_regular_file_is_named(tmp_path, kind):
    """A folder or a FIFO at train.jsonl read as no file: "needs train.<ext> ...; found ['train.jsonl',
    ...]", listing the very name it asked for. It is now named as not a regular file."""
    source = _source(tmp_path / "s", ".jsonl", b"")
    (source / "train.jsonl").unlink()
    if kind == "a folder":
        (source / "train.jsonl").mkdir()
    else:
        os.mkfifo(source / "train.jsonl")
    named = rf"train\.jsonl is {re.escape(kind)}, not a regular file; put"
    with pytest.raises(DatasetUnavailableError, match=named):
        load_dataset("sst2", source=source)


def test_a_json_array_on_one_line_is_not_held_to_the_line_cap(tmp_path, monkeypatch):
    """json.dump(rows, f) writes a .json split as one line: the 64 MiB line cap refused such a file (SNLI's
    train split is about 85 MB so), which loaded before; the cap is for .jsonl and .csv lines."""
    import json

    monkeypatch.setattr(hub, "MAX_LINE_BYTES", 64)
    rows = [{"sentence": f"text {i}", "label": i % 2} for i in range(20)]  # one line of ~700 bytes
    source = tmp_path / "s"
    source.mkdir()
    (source / "train.json").write_text(json.dumps(rows))
    (source / "validation.json").write_text(json.dumps(rows[:4]))
    assert len(load_dataset("sst2", source=source).train_texts) == 20


def test_a_stray_nul_in_a_cell_is_the_readers_and_utf16_is_named(tmp_path):
    """A CSV cell holding one NUL loaded before and was refused as "binary"; a UTF-16 file (Excel's "Unicode
    text") was called binary too, where its encoding is what to change."""
    source = _source(tmp_path / "s", ".csv", b'sentence,label\n"fine\x00 work",1\nbad,0\n')
    assert load_dataset("sst2", source=source).train_texts == ["fine\x00 work", "bad"]
    (source / "train.csv").write_bytes("sentence,label\nfine work,1\n".encode("utf-16"))
    with pytest.raises(ValueError, match=r"train\.csv is UTF-16 \(its byte-order mark\), not UTF-8; save"):
        load_dataset("sst2", source=source)


def test_a_character_split_across_chunks_is_placed_where_it_began(tmp_path, monkeypatch):
    """The bad byte of a character begun in the previous chunk is placed at the character's start: with
    3-byte chunks, b'ab\\xe2\\x82' then b'(' is an invalid continuation at byte 2 of line 1."""
    monkeypatch.setattr(hub, "_READ_CHUNK", 3, raising=False)
    source = _source(tmp_path / "s", ".jsonl", b'ab\xe2\x82(\n')
    with pytest.raises(ValueError, match=r"line 1 is not UTF-8 \(invalid continuation byte at byte 2 of"):
        load_dataset("sst2", source=source)
    (source / "train.jsonl").write_bytes(_VALID[".jsonl"].encode() + b'{"a": "\xe2\x82')
    with pytest.raises(ValueError, match=r"line 2 is not UTF-8 \(unexpected end of data at byte 7 of"):
        load_dataset("sst2", source=source)
