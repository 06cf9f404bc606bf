"""When one process of a multi-process ``compare`` fails, the others stop with one line and the run
directory keeps nothing that refuses the next command: only a finished run or a checkpoint stays."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from attnkit.cli import main
from attnkit.runner import build_config, run_compare
from tests.runner._fixtures import tiny_overrides, write_classification_file

COMMON = dict(mechanisms="softmax", seeds=1, steps=6, checkpoint_every=4, eval_every=3, plots=False)
# what rank 0 met when rank 1 stopped: gloo's error in backward's all-reduce
GLOO = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:15062. This is typically caused by a remote worker crashing.")


def _peer_lost_at(step_to_fail: int, error: BaseException = RuntimeError(GLOO)):
    def hook(mechanism, seed, step):
        if step == step_to_fail:
            raise error

    return hook


def test_a_compare_that_loses_another_process_removes_the_run_dir_it_created(tmp_path):
    """Rank 0 died of gloo's "Connection closed by peer" before the first checkpoint and left config.json
    and an empty runs/softmax-seed0/: the identical rerun was refused ("exists and is not empty; pass
    --resume"). Only Ctrl-C, SIGTERM and ValueErrors cleaned up."""
    data = write_classification_file(tmp_path / "topics.json")
    out = tmp_path / "a" / "run"
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        run_compare(build_config(tiny_overrides(data, out, **COMMON)), on_step=_peer_lost_at(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["topics.json"]  # run/ and the a/ made for it
    run_compare(build_config(tiny_overrides(data, out, **COMMON)))  # the same command again runs
    assert (out / "results.json").is_file()


def test_a_backend_error_in_an_out_that_existed_leaves_it_as_it_was(tmp_path):
    data = write_classification_file(tmp_path / "topics.json")
    out = tmp_path / "out"
    out.mkdir()
    lost = torch.distributed.DistBackendError("NCCL communicator was aborted on rank 0")
    with pytest.raises(torch.distributed.DistBackendError):
        run_compare(build_config(tiny_overrides(data, out, **COMMON)), on_step=_peer_lost_at(1, lost))
    assert out.is_dir() and list(out.iterdir()) == []


def test_a_compare_that_loses_another_process_after_a_checkpoint_keeps_it_for_resume(tmp_path):
    data = write_classification_file(tmp_path / "topics.json")
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        run_compare(build_config(tiny_overrides(data, out, **COMMON)), on_step=_peer_lost_at(5))
    assert list(out.glob("runs/softmax-seed0/checkpoints/step-*")) and (out / "config.json").is_file()


@pytest.mark.parametrize("error", [RuntimeError(GLOO), RuntimeError("Connection reset by peer"),
                                   torch.distributed.DistBackendError("NCCL error: remote process exited")])
def test_a_lost_process_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, error):
    """The 58-line traceback of rank 0 (a RuntimeError is a defect's to the CLI) hid rank 1's one line."""
    import attnkit.runner.compare as rc

    def lost(config):
        raise error

    monkeypatch.setattr(rc, "run_compare", lost)
    monkeypatch.setenv("WORLD_SIZE", "2")  # as accelerate launch / torchrun set it
    data = write_classification_file(tmp_path / "topics.json")
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--task", str(data), "--out", str(tmp_path / "out"), "--progress", "none"])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0] == (
        "error: another process of this launch failed (its error is above); rerun the same command once "
        "that is resolved, with --resume if it kept a checkpoint"
    )


@pytest.mark.parametrize("world", ["1", "2"])
def test_a_backend_error_of_this_process_keeps_its_traceback(tmp_path, monkeypatch, world):
    """Every DistBackendError was read as another process's failure: NCCL's "Duplicate GPU detected" (this
    launch's own mistake, raised on every rank) became "another process failed (its error is above)" on
    every rank, with no error above. And a single process has no other process to lose."""
    import attnkit.runner.compare as rc

    own = torch.distributed.DistBackendError("NCCL error: invalid usage, Duplicate GPU detected : rank 0 and "
                                             "rank 1 both on CUDA device 0")
    errors = {"1": RuntimeError(GLOO), "2": own}

    def failed(config):
        raise errors[world]

    monkeypatch.setattr(rc, "run_compare", failed)
    monkeypatch.setenv("WORLD_SIZE", world)
    data = write_classification_file(tmp_path / "topics.json")
    with pytest.raises(RuntimeError):
        main(["compare", "--task", str(data), "--out", str(tmp_path / "out"), "--progress", "none"])


def test_finetune_is_not_told_to_resume():
    """finetune has no --resume: the line named it for every command."""
    from attnkit.cli import _peer_lost_line

    assert "--resume" in _peer_lost_line(["compare", "--out", "x"])
    assert "--resume" not in _peer_lost_line(["finetune", "--dataset", "d"])


def test_another_runtime_error_keeps_its_traceback(tmp_path, monkeypatch):
    import attnkit.runner.compare as rc

    def defect(config):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x16 and 32x16)")

    monkeypatch.setattr(rc, "run_compare", defect)
    data = write_classification_file(tmp_path / "topics.json")
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        main(["compare", "--task", str(data), "--out", str(tmp_path / "out"), "--progress", "none"])


_RAISE_ON_RANK_1 = textwrap.dedent("""
    import os, sys
    from attnkit.runner import tasks
    calls = [0]
    original = tasks.ClassificationTask.loss_sum
    def loss_sum(self, *args, **kwargs):  # rank 1 alone meets a user error at its 2nd step
        calls[0] += 1
        if os.environ.get("RANK") == "1" and calls[0] == 2:
            raise ValueError("injected error on rank 1")
        return original(self, *args, **kwargs)
    tasks.ClassificationTask.loss_sum = loss_sum
    from attnkit.cli import main
    main(sys.argv[1:])
""")


@pytest.mark.slow
def test_two_processes_where_one_raises_leave_nothing_that_refuses_the_rerun(tmp_path):
    """accelerate launch, 2 CPU processes: rank 1 stopped with its one line, rank 0 printed a 58-line gloo
    traceback, and --out kept config.json and an empty run folder, so the identical rerun was refused."""
    data = write_classification_file(tmp_path / "topics.json")
    script = tmp_path / "raise_on_rank_1.py"
    script.write_text(_RAISE_ON_RANK_1)
    out = tmp_path / "out"
    args = ["compare", "--task", str(data), "--mechanisms", "softmax", "--seeds", "1", "--max-steps", "6",
            "--progress", "none", "--out", str(out)]
    for key, value in dict(batch_size=8, checkpoint_every=4, d_model=16, nhead=2, num_layers=1,
                           dim_feedforward=32, max_len=16, explain_away_samples=8, plots="false").items():
        args += ["--set", f"{key}={value}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", "0", str(script), *args]
    proc = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "[rank 1] error: injected error on rank 1" in proc.stderr, proc.stderr[-2000:]
    # rank 0: the one line (or "terminated", where the launcher's SIGTERM came first), no traceback of ours
    ours = [line for line in proc.stderr.splitlines()
            if "/src/attnkit/" in line or "site-packages/attnkit" in line]
    assert not ours, proc.stderr[-3000:]
    assert not out.exists()


def test_only_the_main_process_says_what_a_failed_run_keeps(tmp_path):
    """Rank 1's ValueError said "the run directory ... is kept: pass --overwrite" while the main process,
    which met the lost peer, removed it: the other ranks now raise their error as it is."""
    from attnkit.runner.compare import _failed_training
    from attnkit.runner.config import CompareConfig

    out = tmp_path / "existing"  # an --out the user made: not this run's to remove
    out.mkdir()
    error = ValueError("injected error on rank 1")
    with pytest.raises(ValueError) as raised:
        _failed_training(error, CompareConfig(), out, made=(), is_main=False)
    assert raised.value is error
    with pytest.raises(ValueError, match="is kept: pass --overwrite"):
        _failed_training(error, CompareConfig(), out, made=(), is_main=True)
