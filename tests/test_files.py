"""Files written for the user get the mode ``open()`` would give them (safetensors itself writes 0600); a
folder another attnkit command holds is refused naming that command."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from attnkit._files import match_umask


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_safetensors_files_follow_the_umask(tmp_path, mask):
    from safetensors.torch import save_file

    old = os.umask(mask)
    try:
        save_file({"a": torch.zeros(1)}, str(tmp_path / "w.safetensors"))
        (tmp_path / "sub").mkdir()
        match_umask(tmp_path)  # a folder: its files
    finally:
        os.umask(old)
    assert (tmp_path / "w.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask
    assert os.umask(old) == old  # the umask is left as it was


def test_convert_writes_a_model_others_can_read(tmp_path):
    pytest.importorskip("transformers")
    from transformers import BertConfig, BertModel

    from attnkit.cli.hf import convert_directory

    BertModel(BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=16)).save_pretrained(tmp_path / "stock")
    old = os.umask(0o022)
    try:
        convert_directory(str(tmp_path / "stock"), str(tmp_path / "out"), "dnas")
    finally:
        os.umask(old)
    assert (tmp_path / "out" / "model.safetensors").stat().st_mode & 0o777 == 0o644


def test_json_nested_past_the_recursion_limit_is_a_json_error_naming_no_traceback(tmp_path):
    """A deeply nested file (not ours) gave a 50-line RecursionError traceback in the dataset, manifest,
    config and run readers; it is a JSONDecodeError (a ValueError) that each reader names in one line."""
    import json

    from attnkit._files import json_loads
    from attnkit.runner.dataset_file import read_dataset_file

    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(json.JSONDecodeError, match="nested deeper than can be read"):
        json_loads(deep)
    path = tmp_path / "deep.json"
    path.write_text(deep)
    with pytest.raises(ValueError, match="deep.json' is not valid JSON"):
        read_dataset_file(str(path))


def test_remove_stale_removes_only_old_scratch(tmp_path):
    from attnkit._files import remove_stale

    old_dir, new_dir, old_file, other = (tmp_path / n for n in (".pip-a", ".pip-b", ".pip-c", "keep.whl"))
    old_dir.mkdir()
    (old_dir / "part.whl").write_bytes(b"x")
    new_dir.mkdir()
    old_file.write_bytes(b"x")
    other.write_bytes(b"x")
    for path in (old_dir, old_file, other):
        os.utime(path, (0, 0))
    remove_stale(tmp_path, ".pip-*", older_than_s=60)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".pip-b", "keep.whl"]


def test_an_atomic_write_clears_what_a_killed_writer_of_that_file_left(tmp_path):
    from attnkit.data.cache import write_bytes_atomic

    stale, fresh, other = (tmp_path / n for n in (".a.json.k1.tmp", ".a.json.k2.tmp", ".b.json.k3.tmp"))
    for path in (stale, fresh, other):
        path.write_bytes(b"half")
    os.utime(stale, (0, 0))
    os.utime(other, (0, 0))
    write_bytes_atomic(tmp_path / "a.json", b"{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".a.json.k2.tmp", ".b.json.k3.tmp", "a.json"]


def test_a_writer_that_fails_leaves_the_old_file_and_no_scratch(tmp_path):
    from attnkit._files import save_figure, write_file_with

    path = tmp_path / "report.html"
    path.write_text("old")

    def fails(tmp):
        with open(tmp, "w") as f:
            f.write("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_file_with(path, fails, overwrite=True)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["report.html"]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure()
    save_figure(fig, tmp_path / "curves.png", dpi=20)
    plt.close(fig)
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_full_disk_names_the_file_and_is_one_cli_line(tmp_path, capsys, monkeypatch):
    """write()/close() raise ENOSPC without a file name, which the CLI reads as a defect: ``bench --out`` on a
    full disk ended in a traceback and exit code 1 after the whole run."""
    import errno

    from attnkit import _files
    from attnkit.cli import main

    def full(tmp):
        raise OSError(errno.ENOSPC, "No space left on device")

    path = tmp_path / "report.json"
    with pytest.raises(OSError) as exc:
        _files.write_file_with(path, full, overwrite=False)
    assert exc.value.errno == errno.ENOSPC and exc.value.filename == str(path)
    assert list(tmp_path.iterdir()) == []
    real = _files.write_file_with
    monkeypatch.setattr(_files, "write_file_with", lambda p, w, **kw: real(p, full, **kw))
    with pytest.raises(SystemExit) as code:
        main(["bench", "--lengths", "16", "--mechanisms", "softmax", "--backends", "reference",
              "--repeats", "1", "--heads", "1", "--head-dim", "4", "--no-memory",
              "--out", str(tmp_path / "k.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code.value.code == 2 and err[-1].startswith("error: No space left on device: ")
    assert "Traceback" not in "\n".join(err)


def test_a_write_with_overwrite_never_replaces_a_device_a_pipe_or_a_folder(tmp_path):
    """``bench --out NODE --overwrite`` renamed its file over a device node (as root: /dev/null gone)."""
    import os
    import stat

    from attnkit._files import write_text_file

    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    with pytest.raises(ValueError, match="not a regular file"):
        write_text_file(pipe, "{}", overwrite=True)
    assert stat.S_ISFIFO(os.stat(pipe).st_mode)
    with pytest.raises(ValueError, match="is a folder"):
        write_text_file(tmp_path, "{}", overwrite=True)


def _hold_lock_as(folder, script, argv_tail):
    """A process running ``python <script> <argv_tail>`` that holds the lock on ``folder`` (the last
    argument)."""
    import subprocess
    import sys

    script.parent.mkdir(exist_ok=True)
    script.write_text("import fcntl, os, sys, time\nfd = os.open(sys.argv[-1], os.O_RDONLY)\n"
                      "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, str(script), *argv_tail, str(folder)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="the holder is read from /proc/locks (Linux)")
def test_a_folder_locked_by_another_command_names_that_command(tmp_path):
    """A reproduce into a folder a compare was running in said "in use by another attnkit reproduce
    process": the refusal named the refused command, not the one holding the folder."""
    from attnkit._files import lock_folder

    out = tmp_path / "out"
    out.mkdir()
    holder = _hold_lock_as(out, tmp_path / "bin" / "attnkit", ["compare", "--out"])
    try:
        with pytest.raises(ValueError, match=rf"in use by another attnkit process \(attnkit compare, pid "
                                             rf"{holder.pid}\): wait for it to finish"):
            lock_folder(out, "attnkit reproduce process: wait for it to finish (or stop it)")
        # the same command holding it: the caller's own wording
        with pytest.raises(ValueError, match=r"in use by another attnkit compare process: wait"):
            lock_folder(out, "attnkit compare process: wait for it to finish (or stop it)")
        with pytest.raises(ValueError, match=r"in use by another attnkit process \(attnkit compare"):
            lock_folder(out, "attnkit convert or finetune process writing into it: wait")
    finally:
        holder.kill()
        holder.wait()



@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="the holder is read from /proc/locks (Linux)")
def test_a_folder_locked_by_a_script_that_merely_names_attnkit_keeps_the_callers_wording(tmp_path):
    """A user's script run as ``python train.py --data ~/attnkit --epochs 3`` holding the lock was named
    "attnkit --epochs"."""
    from attnkit._files import lock_folder

    out = tmp_path / "out"
    out.mkdir()
    holder = _hold_lock_as(out, tmp_path / "train.py", ["--data", str(tmp_path / "attnkit"), "--epochs", "3"])
    try:
        with pytest.raises(ValueError, match=r"in use by another attnkit reproduce process: wait"):
            lock_folder(out, "attnkit reproduce process: wait for it to finish (or stop it)")
    finally:
        holder.kill()
        holder.wait()


def test_an_out_still_to_be_made_under_a_read_only_folder_is_refused_naming_out(tmp_path, monkeypatch):
    """check_out_writable judges an --out that does not exist yet by the nearest folder above it (the
    check that replaced errors naming a hidden temporary folder after the model work)."""
    from attnkit._files import check_out_writable

    real = os.access
    monkeypatch.setattr(os, "access", lambda p, m, *a, **k: False if str(p) == str(tmp_path) else real(p, m))
    out = tmp_path / "new" / "view"
    with pytest.raises(PermissionError) as exc:
        check_out_writable(out)
    assert str(exc.value) == f"--out {out} cannot be written (Permission denied); choose another --out"
    assert not (tmp_path / "new").exists()
    check_out_writable(tmp_path.parent / "other")  # a writable folder above: no error, nothing made
    assert not (tmp_path.parent / "other").exists()
