"""``compare --resume`` on hostile or broken run directories: nothing is unpickled, a bad checkpoint file is
one line and exit 2, two processes never continue one run at once, a rejected configuration leaves nothing
behind."""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from attnkit.cli import main
from attnkit.runner import build_config, get_task, run_compare
from tests.runner._fixtures import (
    Killed, assert_one_line, kill_at, resume_cli, resume_with_edited_result, tiny_overrides,
    write_classification_file, write_finished_run,
)

COMMON = dict(mechanisms="softmax", seeds=1, steps=6, checkpoint_every=2, eval_every=3)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A run directory whose only run stopped after its checkpoint of step 4, and its dataset."""
    root = tmp_path_factory.mktemp("resume")
    data = write_classification_file(root / "topics.json")
    with pytest.raises(Killed):
        run_compare(build_config(tiny_overrides(data, root / "cut", **COMMON)), on_step=kill_at(5))
    checkpoint = root / "cut" / "runs" / "softmax-seed0" / "checkpoints" / "step-0000004"
    assert (checkpoint / "trainer.json").is_file()
    return root, data


def _copy_run(interrupted, tmp_path):
    import shutil

    root, data = interrupted
    shutil.copytree(root / "cut", tmp_path / "cut")
    return (
        tmp_path / "cut", data, tmp_path / "cut" / "runs" / "softmax-seed0" / "checkpoints" / "step-0000004"
    )


class _Payload:
    """Unpickling this runs a shell command that creates a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_checkpoint_files_hold_no_pickled_objects(interrupted):
    root, _ = interrupted
    checkpoint = root / "cut" / "runs" / "softmax-seed0" / "checkpoints" / "step-0000004"
    names = sorted(p.name for p in checkpoint.iterdir())
    assert names == ["rng-rank0.safetensors", "state.pt", "trainer.json"]
    state = torch.load(checkpoint / "state.pt", weights_only=True)  # raises on any non-tensor object
    assert set(state) == {"model", "optimizer", "scheduler"}


@pytest.mark.parametrize("target", ["state.pt", "rng-rank0.safetensors", "rng-rank0.pt"])
@pytest.mark.parametrize("form", ["torch.save", "pickle"])
def test_planted_pickle_never_runs(interrupted, tmp_path, capsys, target, form):
    out, _, checkpoint = _copy_run(interrupted, tmp_path)
    marker = tmp_path / "PWNED"
    payload = {"model": _Payload(marker)}
    if form == "torch.save":
        torch.save(payload, checkpoint / target)
    else:
        (checkpoint / target).write_bytes(pickle.dumps(payload))
    if target == "rng-rank0.pt":  # the old file name: ignored, and the safetensors file is missing
        (checkpoint / "rng-rank0.safetensors").unlink()
    code, err = resume_cli(out, capsys)
    assert not marker.exists(), "a pickled payload in the run directory was executed"
    assert code == 2
    expected = "rng-rank0.safetensors" if target != "state.pt" else "state.pt"
    assert_one_line(err, expected, "--overwrite")
    if target == "state.pt" and form == "torch.save":  # a bare pickle is "not a valid checkpoint"
        assert "pickled objects other than tensors" in err


@pytest.mark.parametrize("case", ["empty state", "truncated state", "garbage state", "garbage rng",
                                  "bad trainer json",
                                  "trainer not a dict", "wrong model state"])
def test_corrupt_checkpoint_is_one_line_exit_2(interrupted, tmp_path, capsys, case):
    out, _, checkpoint = _copy_run(interrupted, tmp_path)
    if case == "empty state":
        (checkpoint / "state.pt").write_bytes(b"")
        needle = "state.pt"
    elif case == "truncated state":
        blob = (checkpoint / "state.pt").read_bytes()
        (checkpoint / "state.pt").write_bytes(blob[: len(blob) // 2])
        needle = "state.pt"
    elif case == "garbage state":  # not a pickle of anything: named as no checkpoint, not as a payload
        (checkpoint / "state.pt").write_bytes(b"garbage, not a checkpoint")
        needle = "not a valid checkpoint"
    elif case == "garbage rng":
        (checkpoint / "rng-rank0.safetensors").write_bytes(os.urandom(300))
        needle = "rng-rank0.safetensors"
    elif case == "bad trainer json":
        (checkpoint / "trainer.json").write_text("{not json")
        needle = "trainer.json"
    elif case == "trainer not a dict":
        (checkpoint / "trainer.json").write_text("[1, 2]")
        needle = "trainer.json"
    else:
        torch.save(
            {"model": {"nope": torch.zeros(2)}, "optimizer": {}, "scheduler": {}}, checkpoint / "state.pt"
        )  # it said "cannot be read (RuntimeError: Error(s) in loading state_dict for ...:)": nothing more
        needle = "state.pt' does not fit this run's model (missing "
    code, err = resume_cli(out, capsys)
    assert code == 2
    assert_one_line(err, needle)


_HOLD_RUN_DIR = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from attnkit.runner.compare import _lock_run_dir\n"
    "fd = _lock_run_dir(Path(sys.argv[1]))\n"
    "print('held', flush=True)\n"
    "time.sleep(600)\n"
)


def test_second_resume_of_a_running_compare_is_refused(interrupted, tmp_path, capsys):
    """While another process holds the run directory, --resume is one line and exit 2; once that process is
    SIGKILLed its lock is gone and the run continues to the end."""
    out, _, checkpoint = _copy_run(interrupted, tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_RUN_DIR, str(out)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        code, err = resume_cli(out, capsys)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert code == 2
    assert_one_line(err, "in use by another attnkit compare")
    assert (checkpoint / "trainer.json").is_file()  # untouched
    main(["compare", "--out", str(out), "--resume", "--progress", "none"])
    assert (out / "results.json").is_file()


def test_a_running_compare_holds_its_run_dir(interrupted, tmp_path):
    out, data, _ = _copy_run(interrupted, tmp_path)
    seen = []

    def try_second(mechanism, seed, step):  # a second process's attempt, made while the first one trains
        fd = os.open(out, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            seen.append(step)
        finally:
            os.close(fd)

    run_compare(build_config(tiny_overrides(data, out, resume=True, **COMMON)), on_step=try_second)
    assert seen == [5, 6]


def test_resume_reproduces_the_uninterrupted_run(interrupted, tmp_path):
    out, data, _ = _copy_run(interrupted, tmp_path)
    task = get_task(str(data))
    full = run_compare(build_config(tiny_overrides(data, tmp_path / "full", **COMMON)), task=task)
    resumed = run_compare(build_config(tiny_overrides(data, out, resume=True, **COMMON)), task=task)
    assert [r["metrics"] for r in full.runs] == [r["metrics"] for r in resumed.runs]
    assert [r["history"] for r in full.runs] == [r["history"] for r in resumed.runs]


def test_batch_larger_than_the_training_set_leaves_no_run_dir(tmp_path, capsys):
    data = write_classification_file(tmp_path / "topics.json", n_train=10)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="batch_size=16 is larger than the training set"):
        run_compare(build_config(tiny_overrides(data, out, batch_size=16, **COMMON)))
    assert not (out / "config.json").exists()
    run_compare(build_config(tiny_overrides(data, out, batch_size=4, **COMMON)))  # the rerun is not refused
    assert (out / "results.json").is_file()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    return write_finished_run(tmp_path_factory.mktemp("finished"))


@pytest.mark.parametrize("content, needle", [
    ('{"mechanism"', "cannot be read (JSONDecodeError"),
    ("[]", "holds a JSON list, not a run result"),
    ('{"mechanism": "softmax", "seed": 0}', "has no valid 'steps'"),
    (None, "is the result of dnas seed 0, not softmax seed 0"),
])
def test_a_damaged_run_result_is_one_line_naming_it(finished_run, tmp_path, capsys, content, needle):
    """A truncated result.json gave a JSON error naming no file; one of another shape a traceback."""
    import json
    import shutil

    out = tmp_path / "done"
    shutil.copytree(finished_run, out)
    result = out / "runs" / "softmax-seed0" / "result.json"
    if content is None:
        content = json.dumps({**json.loads(result.read_text()), "mechanism": "dnas"})
    result.write_text(content)
    code, err = resume_cli(out, capsys)
    assert code == 2
    assert_one_line(err, str(result), needle, f"delete {str(result.parent)!r}")


def test_checkpoints_left_beside_a_finished_result_are_removed_on_resume(finished_run, tmp_path):
    """A process killed between writing result.json and deleting its checkpoints left them there for good."""
    import shutil

    out = tmp_path / "done"
    shutil.copytree(finished_run, out)
    left = out / "runs" / "softmax-seed0" / "checkpoints" / "step-0000002"
    left.mkdir(parents=True)
    (left / "state.pt").write_bytes(b"partial")
    before = (out / "runs" / "softmax-seed0" / "result.json").read_text()
    data = finished_run.parent / "topics.json"
    run_compare(build_config(tiny_overrides(data, out, resume=True, **{**COMMON, "steps": 3})))
    assert not left.parent.exists()
    assert (out / "runs" / "softmax-seed0" / "result.json").read_text() == before


@pytest.mark.parametrize("edit", ["drop time_sum", "step_times", "step_losses", "load_max"])
def test_a_trainer_state_without_its_counters_is_one_line(interrupted, tmp_path, capsys, edit):
    """A hand-edited ``"step_times": "x"`` (and the other optional records) gave an AttributeError."""
    import json

    out, _, checkpoint = _copy_run(interrupted, tmp_path)
    state = json.loads((checkpoint / "trainer.json").read_text())
    if edit == "drop time_sum":
        del state["time_sum"]
    else:
        state[edit] = "x" if edit != "step_losses" else [0.5, "x"]
    (checkpoint / "trainer.json").write_text(json.dumps(state))
    code, err = resume_cli(out, capsys)
    assert code == 2
    assert_one_line(err, "trainer.json", "is not an attnkit trainer state")


def test_a_relative_task_path_is_saved_absolute_so_resume_works_from_elsewhere(tmp_path, monkeypatch, capsys):
    """``--task data.json`` was saved as given: show and --resume from another directory did not find it."""
    import json

    data_dir = tmp_path / "project"
    data_dir.mkdir()
    write_classification_file(data_dir / "topics.json")
    monkeypatch.chdir(data_dir)
    config = build_config(tiny_overrides("topics.json", tmp_path / "run", **{**COMMON, "steps": 3}))
    assert config.task == str(data_dir / "topics.json")
    with pytest.raises(Killed):
        run_compare(config, on_step=kill_at(3))
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["config"]
    assert saved["task"] == str(data_dir / "topics.json")
    monkeypatch.chdir(tmp_path)
    main(["compare", "--out", str(tmp_path / "run"), "--resume", "--progress", "none"])  # from elsewhere
    assert (tmp_path / "run" / "results.json").is_file()


def test_a_run_saved_with_a_relative_task_path_still_resumes_from_its_directory(interrupted, tmp_path,
                                                                                  monkeypatch, capsys):
    import json

    out, data, _ = _copy_run(interrupted, tmp_path)
    payload = json.loads((out / "config.json").read_text())
    payload["config"]["task"] = data.name  # as runs were saved before
    (out / "config.json").write_text(json.dumps(payload))
    monkeypatch.chdir(data.parent)
    result = run_compare(build_config(tiny_overrides(data.name, out, resume=True, **COMMON)))
    assert len(result.runs) == 1


def test_a_resumed_run_counts_as_the_share_it_trained_in_the_time_estimate(interrupted, tmp_path,
                                                                             monkeypatch):
    """The estimate of the time left took a resumed run's few remaining steps as a whole run's time."""
    from attnkit.runner.summary import RunClock

    out, data, _ = _copy_run(interrupted, tmp_path)
    shares = []
    original = RunClock.add
    monkeypatch.setattr(RunClock, "add", lambda self, seconds, share=1.0: (shares.append(share),
                                                                           original(self, seconds, share)))
    run_compare(build_config(tiny_overrides(data, out, resume=True, **COMMON)))
    assert shares == [pytest.approx(2 / 6)]  # steps 5 and 6 of 6, from the checkpoint of step 4


def test_each_process_of_a_run_draws_from_its_own_stream():
    """All processes of a run drew the same dropout masks (one seed for all) for their different shares of
    the batch; their streams are now distinct, and none is another run's (seed + rank would be)."""
    from attnkit.runner.train import rank_seed

    seeds = [rank_seed(s, r) for s in range(5) for r in range(4)]
    assert len(set(seeds)) == len(seeds) and all(0 <= x < 2**32 for x in seeds)
    assert not set(seeds) & set(range(10))
    assert rank_seed(2**32 - 1, 3) < 2**32


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d["metrics"].update(accuracy=float("nan")), "'accuracy' that is not a finite number (nan)"),
    (lambda d: d["metrics"].update(accuracy="x"), "'accuracy' that is not a finite number ('x')"),
    (lambda d: d["metrics"].pop("accuracy"), "has no metric 'accuracy'"),
    (lambda d: d.update(explain_away=None), "has no valid 'explain_away'"),
    (lambda d: d.update(hybrid_u=[["a"]]), "has no valid 'hybrid_u'"),
])
def test_an_edited_run_result_is_one_line_naming_it(finished_run, tmp_path, capsys, edit, needle):
    # the report read these fields unchecked: a NaN metric, a deleted one or a null explain_away ended the
    # rebuilt report in a traceback (exit code 1)
    import shutil

    out = tmp_path / "done"
    shutil.copytree(finished_run, out)
    result, code, err = resume_with_edited_result(out, edit, capsys)
    assert code == 2
    assert_one_line(err, str(result), needle, f"delete {str(result.parent)!r}")


@pytest.mark.parametrize("edit, needles", [
    ({"seed": 1}, ("is of softmax seed 1, not softmax seed 0",)),
    ({"mechanism": "dnas"}, ("is of dnas seed 0, not softmax seed 0",)),
    ({"step": 1000}, ("trainer.json", "records step 1000 of a 6-step run")),
    ({"step": -3}, ("trainer.json", "records step -3 of a 6-step run")),
    ({"step": 2}, ("trainer.json", "records step 2 of a 6-step run")),  # in folder step-0000004
])
def test_a_checkpoint_of_another_run_or_step_is_refused(interrupted, tmp_path, capsys, edit, needles):
    """Another seed's checkpoint copied in trained a duplicate run reported as two seeds; a step edited to
    1000 reported a 4-step model as the finished 6-step run, one of -3 trained 9 steps."""
    import json

    out, _, checkpoint = _copy_run(interrupted, tmp_path)
    state = json.loads((checkpoint / "trainer.json").read_text())
    assert (state["mechanism"], state["seed"], state["step"]) == ("softmax", 0, 4)
    (checkpoint / "trainer.json").write_text(json.dumps({**state, **edit}))
    code, err = resume_cli(out, capsys)
    assert code == 2
    assert_one_line(err, *needles)
    assert not (out / "runs" / "softmax-seed0" / "result.json").exists()


def test_a_run_moved_with_its_dataset_file_resumes_from_the_new_path(interrupted, tmp_path):
    """The task was compared by path: a project folder moved (same file, SHA-256 recorded) could only be
    started over with --overwrite, which deletes the runs."""
    import json
    import shutil

    out, data, _ = _copy_run(interrupted, tmp_path)
    moved = tmp_path / "elsewhere" / "renamed.json"
    moved.parent.mkdir()
    shutil.copy(data, moved)
    result = run_compare(build_config(tiny_overrides(moved, out, resume=True, **COMMON)))
    assert len(result.runs) == 1
    assert json.loads((out / "config.json").read_text())["config"]["task"] == str(moved)
    other = tmp_path / "other.json"  # another file under another path is still another task
    write_classification_file(other, n_train=12)
    out2, _, _ = _copy_run(interrupted, tmp_path / "second")
    with pytest.raises(ValueError, match="other settings \\(task: saved"):
        run_compare(build_config(tiny_overrides(other, out2, resume=True, **COMMON)))


def test_resume_of_a_run_whose_dataset_file_is_gone_names_the_new_path_option(interrupted, tmp_path, capsys):
    """The error named built-in tasks ("give a built-in task (reuters8, mlu, ...)"), not --task NEW_PATH."""
    import json

    out, _, _ = _copy_run(interrupted, tmp_path)
    saved = json.loads((out / "config.json").read_text())
    saved["config"]["task"] = str(tmp_path / "gone" / "topics.json")  # the file as if moved away
    (out / "config.json").write_text(json.dumps(saved))
    code, err = resume_cli(out, capsys)
    assert code == 2
    assert_one_line(err, "gone/topics.json' is not there any more", "--resume --task NEW_PATH")


def test_a_catalog_dataset_fetched_again_is_told_apart_from_the_one_a_run_started_on(tmp_path, monkeypatch):
    """A run on a hub dataset recorded no digest: `data fetch sst2 --force` from another source left
    --resume and `attnkit show` working on other data with the old model (show re-fitted its vocabulary)."""
    from attnkit.data.cache import dataset_cache_dir, write_manifest
    from attnkit.runner.compare import _task_digest, check_task_unchanged

    monkeypatch.setenv("ATTNKIT_CACHE", str(tmp_path / "cache"))
    folder = dataset_cache_dir("sst2")
    folder.mkdir(parents=True)
    (folder / "train.jsonl").write_text('{"sentence": "good", "label": 1}\n')
    write_manifest(folder, "local", ["train.jsonl"])
    config = build_config(tiny_overrides("sst2", tmp_path / "run", **COMMON))
    digest = _task_digest(config)
    assert digest is not None and _task_digest(config) == digest
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"task_sha256": digest}))
    check_task_unchanged(config, out, "--resume")
    (folder / "train.jsonl").write_text('{"sentence": "apple", "label": 0}\n')
    write_manifest(folder, "other", ["train.jsonl"])
    with pytest.raises(ValueError, match="the dataset 'sst2' in the cache \\(fetched again\\?\\) changed"):
        check_task_unchanged(config, out, "--resume")
    mlu = dataset_cache_dir("mlu")  # generated from a seed: load_dataset never reads the cached files
    mlu.mkdir()
    (mlu / "train.tsv").write_text("a\tb\n")
    write_manifest(mlu, "generated", ["train.tsv"])
    for task in ("mlu", "copy", "mrpc"):  # generated, a recurrent task, not fetched
        assert _task_digest(SimpleNamespace(task=task)) is None
    monkeypatch.setenv("ATTNKIT_CACHE", str(tmp_path / "empty"))  # not fetched in this cache: not "changed"
    check_task_unchanged(config, out, "--resume")


def test_a_checkpoint_write_that_fails_leaves_the_earlier_checkpoint_and_no_partial_state(tmp_path,
                                                                                           monkeypatch):
    """A full disk during state.pt left the partial file in its step folder (space the user needed) until the
    next run removed it."""
    import errno

    from attnkit.runner import checkpoints

    accelerator = SimpleNamespace(is_main_process=True, process_index=0, wait_for_everyone=lambda: None,
                                  unwrap_model=lambda m: m)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    checkpoints.save_checkpoint(accelerator, tmp_path, 1, model, optimizer, scheduler, {"step": 1})
    real_save = torch.save

    def full_disk(obj, path):
        real_save(obj, path)
        with open(path, "r+b") as f:
            f.truncate(10)
        raise OSError(errno.ENOSPC, "No space left on device")

    def full_disk_text(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    for where, target, replacement in [("state.pt", checkpoints.torch, full_disk),
                                       ("trainer state", type(tmp_path), full_disk_text)]:
        with monkeypatch.context() as patch:
            patch.setattr(target, "save" if where == "state.pt" else "write_text", replacement)
            with pytest.raises(OSError, match="No space left"):
                checkpoints.save_checkpoint(accelerator, tmp_path, 2, model, optimizer, scheduler, {"s": 2})
        folders = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
        assert folders == ["step-0000001"], where
        assert checkpoints.latest_checkpoint(tmp_path).name == "step-0000001"
