"""What a stopped or failed ``compare`` leaves in its run directory: never a folder that --overwrite and
--resume no longer recognise, nor one that refuses the corrected command."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest

import attnkit.runner.compare as rc
from attnkit.runner import build_config, run_compare
from tests.runner._fixtures import tiny_overrides, write_classification_file

COMMON = dict(mechanisms="softmax", seeds=1, steps=6, checkpoint_every=2, eval_every=3)


def test_an_overwrite_stopped_while_deleting_leaves_a_folder_overwrite_still_replaces(tmp_path, monkeypatch):
    """Ctrl-C while --overwrite deleted runs/ (the longest part) stranded the folder when config.json, the
    mark --overwrite and --resume look for, had already gone: both then refused the folder."""
    data = write_classification_file(tmp_path / "topics.json")
    out = tmp_path / "out"
    rc.prepare_run_dir(build_config(tiny_overrides(data, out, **COMMON)))
    (out / "runs" / "softmax-seed0").mkdir(parents=True)
    (out / "runs" / "softmax-seed0" / "model.pt").write_bytes(b"weights")
    (out / "results.json").write_text("{}")
    overwrite = build_config(tiny_overrides(data, out, overwrite=True, **COMMON))

    listed = pathlib.Path.iterdir
    monkeypatch.setattr(pathlib.Path, "iterdir", lambda self: iter(sorted(listed(self))))  # config.json first

    def interrupted_rmtree(path, *args, **kwargs):
        raise KeyboardInterrupt  # the user presses Ctrl-C while runs/ is deleted

    real_rmtree = shutil.rmtree
    monkeypatch.setattr(rc.shutil, "rmtree", interrupted_rmtree)
    with pytest.raises(KeyboardInterrupt):
        rc.prepare_run_dir(overwrite)
    assert (out / "config.json").is_file() and (out / "runs").is_dir()
    monkeypatch.setattr(rc.shutil, "rmtree", real_rmtree)
    rc.prepare_run_dir(overwrite)  # the same command again is not refused
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]


def _diverging(data, out, **extra):
    return build_config(tiny_overrides(data, out, **{**COMMON, "lr": 1e30, "warmup_steps": 0, **extra}))


def test_a_compare_that_fails_before_any_run_finished_removes_the_run_dir_it_created(tmp_path):
    """The failed run left config.json and runs/: the corrected command with the same --out was refused, and
    --resume refused it too (lr changed)."""
    data = write_classification_file(tmp_path / "topics.json")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="became nan") as exc:
        run_compare(_diverging(data, out))
    assert not out.exists() and "--overwrite" not in str(exc.value)
    run_compare(build_config(tiny_overrides(data, out, **{**COMMON, "steps": 2})))  # the corrected command
    assert (out / "results.json").is_file()



def test_a_failed_compare_removes_the_empty_parent_folders_it_made_for_out(tmp_path):
    """--out a/b/run with a/ and b/ new: the failed run removed run/ but left a/b/ behind, empty."""
    data = write_classification_file(tmp_path / "topics.json")
    out = tmp_path / "a" / "b" / "run"
    with pytest.raises(ValueError, match="became nan"):
        run_compare(_diverging(data, out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["topics.json"]


def test_a_failed_compare_keeps_a_parent_folder_that_holds_another_file(tmp_path, monkeypatch):
    data = write_classification_file(tmp_path / "topics.json")
    out = tmp_path / "a" / "b" / "run"
    real_rmtree = rc.shutil.rmtree

    def rmtree_while_another_writes(path, *args, **kwargs):  # another program writes into a/ meanwhile
        (tmp_path / "a" / "notes.txt").write_text("mine")
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(rc.shutil, "rmtree", rmtree_while_another_writes)
    with pytest.raises(ValueError, match="became nan"):
        run_compare(_diverging(data, out))
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["notes.txt"]  # b/ was empty: removed

@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
def test_a_compare_stopped_before_its_first_checkpoint_removes_the_folders_it_made(tmp_path, stop):
    """Ctrl-C or SIGTERM (SystemExit in the CLI) before the first checkpoint left --out with config.json and
    an empty run folder, and its new parents: the same command was then refused ("exists and is not
    empty"), though the README says a stopped command removes the folders it made for --out."""
    data = write_classification_file(tmp_path / "topics.json")
    out = tmp_path / "a" / "run"
    settings = {**COMMON, "steps": 6, "checkpoint_every": 4}

    def stop_at(mech, seed, step):
        if step == 2:
            raise stop(143) if stop is SystemExit else stop()

    with pytest.raises(stop):
        run_compare(build_config(tiny_overrides(data, out, **settings)), on_step=stop_at)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["topics.json"]
    run_compare(build_config(tiny_overrides(data, out, **settings)))  # the same command again runs
    assert (out / "results.json").is_file()


def test_a_compare_stopped_before_training_starts_removes_the_folders_it_made(tmp_path, monkeypatch):
    """Ctrl-C while the progress display or a tracker started (after --out was made, before the training
    loop) left config.json, and the same command was refused."""
    import attnkit.runner.progress as progress

    data = write_classification_file(tmp_path / "topics.json")
    out = tmp_path / "a" / "run"

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(progress, "make_progress", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_compare(build_config(tiny_overrides(data, out, **COMMON)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["topics.json"]


def test_a_compare_stopped_after_a_checkpoint_keeps_it_for_resume(tmp_path):
    data = write_classification_file(tmp_path / "topics.json")
    out = tmp_path / "a" / "run"
    settings = {**COMMON, "steps": 6, "checkpoint_every": 2}

    def stop_at(mech, seed, step):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_compare(build_config(tiny_overrides(data, out, **settings)), on_step=stop_at)
    assert list(out.glob("runs/softmax-seed0/checkpoints/step-*"))


def test_a_failed_compare_keeps_a_folder_it_did_not_create_and_says_to_overwrite(tmp_path):
    data = write_classification_file(tmp_path / "topics.json")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError, match="became nan") as exc:
        run_compare(_diverging(data, out))
    assert out.is_dir() and json.loads((out / "config.json").read_text())["config"]["lr"] == 1e30
    assert str(exc.value).endswith("pass --overwrite with the corrected settings to start it over")


def test_a_failed_compare_keeps_the_runs_that_finished(tmp_path):
    data = write_classification_file(tmp_path / "topics.json")
    out = tmp_path / "out"
    config = build_config(tiny_overrides(data, out, **{**COMMON, "mechanisms": "softmax,hnas", "steps": 2}))
    with pytest.raises(ValueError, match="with its finished runs: pass --overwrite"):
        run_compare(config, on_step=_fail_in("hnas"))
    assert (out / "runs" / "softmax-seed0" / "result.json").is_file()


def test_a_failure_after_a_checkpoint_keeps_the_folder_it_created_for_resume(tmp_path):
    """Any ValueError in training (a defect too: "too many values to unpack") removed the run directory this
    call had made, checkpoints and all, although --resume could go on from them."""
    data = write_classification_file(tmp_path / "topics.json")
    out = tmp_path / "out"
    settings = {**COMMON, "mechanisms": "softmax", "steps": 4, "checkpoint_every": 2, "eval_every": 2}

    def bug(mech, seed, step):
        if step == 3:  # after the checkpoint of step 2
            raise ValueError("too many values to unpack (expected 2)")

    with pytest.raises(ValueError, match="kept with its checkpoints: pass --overwrite") as exc:
        run_compare(build_config(tiny_overrides(data, out, **settings)), on_step=bug)
    assert "too many values to unpack" in str(exc.value)
    assert list(out.glob("runs/softmax-seed0/checkpoints/step-*"))
    resumed = run_compare(build_config(tiny_overrides(data, out, resume=True, **settings)))
    assert resumed.runs[0]["history"]  # went on from the checkpoint


def _fail_in(mechanism: str):
    def hook(mech, seed, step):
        if mech == mechanism:
            raise ValueError(f"{mech} seed {seed}: the training loss became nan at step {step}")

    return hook


def test_a_model_save_that_fails_leaves_no_truncated_model_file(tmp_path, monkeypatch):
    """torch.save on a full disk left a truncated model.pt in the run directory."""
    from attnkit.runner import build_config, run_compare
    from attnkit.runner import train as train_module
    from tests.runner._fixtures import tiny_overrides, write_classification_file

    import torch

    data = write_classification_file(tmp_path / "d.json")
    save = torch.save

    def full(obj, f, *args, **kwargs):
        if "model.pt" in str(f):  # the final weights (checkpoints are state.pt)
            with open(f, "wb") as handle:
                handle.write(b"PK\x03\x04 half")
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 11456 vs 11408")
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(train_module.torch, "save", full)
    with pytest.raises(RuntimeError, match="unexpected pos"):
        run_compare(build_config(tiny_overrides(data, tmp_path / "run", mechanisms="softmax", steps=2,
                                                eval_every=2, checkpoint_every=2)))
    left = [p.name for p in (tmp_path / "run").rglob("*model.pt*")]
    assert left == []


def test_a_resumed_run_removes_the_temporary_model_file_of_a_killed_save(tmp_path):
    """SIGKILL inside torch.save left .model.pt.<random>.tmp (truncated) in the run directory; the resumed
    run finished beside it and kept it for good (stale files were removed after an hour, by the next save)."""
    data = write_classification_file(tmp_path / "d.json")
    settings = dict(mechanisms="softmax", seeds=1, steps=4, eval_every=2, checkpoint_every=2)

    def kill(mech, seed, step):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_compare(build_config(tiny_overrides(data, tmp_path / "run", **settings)), on_step=kill)
    run_dir = tmp_path / "run" / "runs" / "softmax-seed0"
    (run_dir / ".model.pt.k1lled.tmp").write_bytes(b"PK\x03\x04 half")  # as the killed save left it
    run_compare(build_config(tiny_overrides(data, tmp_path / "run", resume=True, **settings)))
    assert sorted(p.name for p in run_dir.iterdir()) == ["model.pt", "result.json"]


def test_an_out_that_is_a_dangling_link_is_named_as_one(tmp_path):
    """mkdir through a link to nothing said "cannot write to the run directory 'dang' (File exists)"."""
    data = write_classification_file(tmp_path / "d.json")
    (tmp_path / "dang").symlink_to(tmp_path / "missing" / "dir")
    with pytest.raises(FileNotFoundError, match=r"--out .*dang is a symbolic link to .*missing/dir, which"):
        run_compare(build_config(tiny_overrides(data, tmp_path / "dang", **COMMON)))
    assert not (tmp_path / "missing").exists()
