"""``compare --overwrite`` and ``--resume`` on an earlier run that cannot be deleted or written, or whose
deletion was stopped: nothing is deleted before the refusal, the refusal names the folder, and a stopped
deletion never leaves a run that --resume keeps as finished without its model."""

from __future__ import annotations

import os

import pytest

import attnkit.runner.compare as rc
from attnkit.runner import build_config, run_compare
from tests.runner._fixtures import ctrl_c_at, tiny_overrides, write_classification_file

COMMON = dict(mechanisms="softmax", seeds=1, steps=6, checkpoint_every=2, eval_every=3)


def _earlier_run(tmp_path):
    """A run directory of ours with two finished runs, a report and a plot, and its dataset."""
    data = write_classification_file(tmp_path / "topics.json")
    out = tmp_path / "out"
    rc.prepare_run_dir(build_config(tiny_overrides(data, out, **COMMON)))
    for name in ("hnas-seed0", "softmax-seed0"):
        (out / "runs" / name).mkdir(parents=True)
        (out / "runs" / name / "model.pt").write_bytes(b"weights")
        (out / "runs" / name / "result.json").write_text("{}")
    (out / "results.json").write_text("{}")
    (out / "report.html").write_text("<html></html>")
    return data, out


def _tree(out):
    return sorted(str(p.relative_to(out)) for p in out.rglob("*"))


def _refuse_access_to(monkeypatch, folder):
    """``folder`` cannot be written, as a folder of another user's (mode 0555) for a non-root user."""
    real = os.access

    def access(path, mode, *args, **kwargs):
        if os.path.abspath(path) == os.path.abspath(folder) and mode & os.W_OK:
            return False
        return real(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)


def test_an_overwrite_that_cannot_delete_a_folder_deletes_nothing_and_names_it(tmp_path, monkeypatch):
    """runs/hnas-seed0 of another user's: --overwrite deleted the report, the plots and the other run, then
    failed on "[Errno 13] Permission denied: 'model.pt'" (a bare name)."""
    data, out = _earlier_run(tmp_path)
    before = _tree(out)
    locked = out / "runs" / "hnas-seed0"
    _refuse_access_to(monkeypatch, locked)
    with pytest.raises(PermissionError, match="choose another --out") as exc:
        rc.prepare_run_dir(build_config(tiny_overrides(data, out, overwrite=True, **COMMON)))
    assert str(locked) in str(exc.value)
    assert _tree(out) == before


def test_an_overwrite_stopped_while_deleting_leaves_no_finished_run_without_its_model(tmp_path, monkeypatch):
    """Ctrl-C while --overwrite deleted runs/ left runs/hnas-seed0/result.json without model.pt: --resume
    kept the run as finished, and `attnkit show` then found no model for it."""
    data, out = _earlier_run(tmp_path)
    real_unlink = os.unlink
    seen = []

    def unlink(path, *args, **kwargs):
        if os.path.basename(path) == "model.pt":  # when a model goes, no run may still read as finished
            seen.append(sorted(str(p.relative_to(out)) for p in out.glob("runs/*/result.json")))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    rc.prepare_run_dir(build_config(tiny_overrides(data, out, overwrite=True, **COMMON)))
    assert seen == [[], []]


def test_a_resume_refuses_a_checkpoint_folder_it_cannot_write_before_training(tmp_path, monkeypatch):
    """A read-only checkpoints/step-* folder: --resume trained on and then failed on "[Errno 13] Permission
    denied: 'rng-rank0.safetensors'", naming neither the folder nor the fix."""
    data = write_classification_file(tmp_path / "topics.json")
    out = tmp_path / "out"
    settings = {**COMMON, "steps": 6, "checkpoint_every": 2}

    with pytest.raises(KeyboardInterrupt):
        run_compare(build_config(tiny_overrides(data, out, **settings)), on_step=ctrl_c_at(3))
    (step,) = out.glob("runs/softmax-seed0/checkpoints/step-*")
    _refuse_access_to(monkeypatch, step)
    with pytest.raises(PermissionError, match="make it writable or choose another --out") as exc:
        rc.prepare_run_dir(build_config(tiny_overrides(data, out, resume=True, **settings)))
    assert str(step) in str(exc.value)


def test_a_checkpoint_that_cannot_be_deleted_is_named_by_its_full_path(tmp_path, monkeypatch):
    """The refusal of shutil.rmtree named the entry relative to its folder ('rng-rank0.safetensors')."""
    from attnkit._files import rmtree_named

    folder = tmp_path / "checkpoints" / "step-0000002"
    folder.mkdir(parents=True)
    (folder / "rng-rank0.safetensors").write_bytes(b"rng")
    real_unlink = os.unlink

    def unlink(path, *args, **kwargs):
        if os.path.basename(path) == "rng-rank0.safetensors":
            raise PermissionError(13, "Permission denied", os.path.basename(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(PermissionError, match="make it writable") as exc:
        rmtree_named(folder)
    assert str(folder / "rng-rank0.safetensors") in str(exc.value)
    # as a run meets it: the superseded checkpoint of step 2 cannot be deleted when step 4's is saved
    data = write_classification_file(tmp_path / "topics.json")
    out = tmp_path / "out"
    with pytest.raises(PermissionError, match="make it writable or choose another --out") as exc:
        run_compare(build_config(tiny_overrides(data, out, **{**COMMON, "steps": 6, "checkpoint_every": 2})))
    step2 = out / "runs" / "softmax-seed0" / "checkpoints" / "step-0000002"
    assert str(step2 / "rng-rank0.safetensors") in str(exc.value)


def test_a_compare_stopped_early_in_an_out_made_beforehand_leaves_it_as_it_was(tmp_path):
    """--out made empty beforehand (mkdir in a job script), Ctrl-C before the first checkpoint: config.json
    and an empty runs/softmax-seed0/ stayed, and the same command was refused ("exists and is not empty")."""
    data = write_classification_file(tmp_path / "topics.json")
    out = tmp_path / "pre"
    out.mkdir()
    settings = {**COMMON, "steps": 6, "checkpoint_every": 4}

    with pytest.raises(KeyboardInterrupt):
        run_compare(build_config(tiny_overrides(data, out, **settings)), on_step=ctrl_c_at(2))
    assert list(out.iterdir()) == []
    run_compare(build_config(tiny_overrides(data, out, **settings)))  # the same command again runs
    assert (out / "results.json").is_file()


def test_a_compare_stopped_early_keeps_the_users_files_in_an_out_made_beforehand(tmp_path):
    """A file of the user's beside the run (their --config file): the stopped run removed its config.json,
    and the same --overwrite command was then refused ("not an attnkit compare run directory")."""
    data = write_classification_file(tmp_path / "topics.json")
    out = tmp_path / "pre"
    out.mkdir()
    settings = {**COMMON, "steps": 6, "checkpoint_every": 4, "overwrite": True}
    rc.prepare_run_dir(build_config(tiny_overrides(data, out, **settings)))
    (out / "mine.txt").write_text("mine")

    with pytest.raises(KeyboardInterrupt):
        run_compare(build_config(tiny_overrides(data, out, **settings)), on_step=ctrl_c_at(2))
    assert _tree(out) == ["config.json", "mine.txt"]
    run_compare(build_config(tiny_overrides(data, out, **settings)))  # the same command again runs
    assert (out / "results.json").is_file() and (out / "mine.txt").read_text() == "mine"


@pytest.mark.parametrize("linked", ["runs", "runs/softmax-seed0"])
def test_an_overwrite_deletes_links_in_runs_not_what_they_point_to(tmp_path, linked):
    """runs/ or a run's folder as a symbolic link to another run directory: --overwrite deleted the
    result.json files it found through the link, outside --out (it deletes each result.json first)."""
    data = write_classification_file(tmp_path / "topics.json")
    out = tmp_path / "out"
    rc.prepare_run_dir(build_config(tiny_overrides(data, out, **COMMON)))
    elsewhere = tmp_path / "elsewhere"
    for name in ("softmax-seed0", "dnas-seed0"):
        (elsewhere / name).mkdir(parents=True)
        (elsewhere / name / "result.json").write_text("{}")
    if linked == "runs":
        (out / "runs").symlink_to(elsewhere)
    else:
        (out / "runs").mkdir()
        (out / "runs" / "softmax-seed0").symlink_to(elsewhere / "softmax-seed0")
    rc.prepare_run_dir(build_config(tiny_overrides(data, out, overwrite=True, **COMMON)))
    assert sorted(p.name for p in elsewhere.glob("*/result.json")) == ["result.json", "result.json"]
    assert not os.path.lexists(out / "runs")


def test_a_stopped_compare_keeps_config_json_while_another_output_of_its_stays(tmp_path):
    """config.json is what --overwrite knows the folder by: removed with a tracker's logs left, the folder
    would be refused by --overwrite as not a run directory of ours."""
    data = write_classification_file(tmp_path / "topics.json")
    out = tmp_path / "pre"
    out.mkdir()
    rc.prepare_run_dir(build_config(tiny_overrides(data, out, **COMMON)))
    (out / "runs" / "softmax-seed0").mkdir(parents=True)
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events.out").write_text("logged")
    rc._remove_started(out)
    assert _tree(out) == ["config.json", "tensorboard", "tensorboard/events.out"]
