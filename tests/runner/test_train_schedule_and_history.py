"""runner.train: the learning-rate schedule (linear warmup, then linear decay to 0), gradient clipping of the
model, and what each history entry records (the mean training loss of its own interval, the scheduler's
lr)."""

from __future__ import annotations

import pytest
import torch

from attnkit.runner import build_config, run_compare
from attnkit.runner.train import _schedule
from tests.runner._fixtures import tiny_overrides, write_classification_file

LR, WARMUP, STEPS, EVERY = 1e-2, 5, 12, 4


def _softmax_run(tmp_path, name: str, **extra) -> dict:
    data = write_classification_file(tmp_path / "data.json")
    values = dict(mechanisms="softmax", checkpoint_every=100, explain_away_samples=4)
    values.update(extra)
    return run_compare(build_config(tiny_overrides(data, tmp_path / name, **values))).runs[0]


@pytest.fixture(scope="module")
def scheduled(tmp_path_factory) -> dict:
    return _softmax_run(tmp_path_factory.mktemp("schedule"), "out", lr=LR, warmup_steps=WARMUP, steps=STEPS,
                        eval_every=EVERY)


def test_schedule_warms_up_linearly_then_decays_to_zero_at_the_end():
    """Warmup 2 of 6 steps: factors (s + 1) / 2 for s < 2, then (6 - s) / 4. A warmup of s / 2 started at
    lr 0 (a wasted first step), and a decay over all 6 steps, (6 - s) / 6, never reached 1 after warmup."""
    f = _schedule(2, 6)
    assert [f(s) for s in range(7)] == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0])


def test_history_lr_is_the_schedulers_lr_after_each_interval(scheduled):
    """history["lr"] records the lr of the next step: lr * factor(step) (factor(4) = 1 at the end of warmup
    5, factor(8) = (12 - 8) / (12 - 5)). It once recorded config.lr, whatever the schedule."""
    steps = [h["step"] for h in scheduled["history"]]
    lrs = [h["lr"] for h in scheduled["history"]]
    assert steps == [4, 8, 12]
    assert lrs == pytest.approx([LR * 1.0, LR * 4 / 7, 0.0])


def test_history_train_loss_is_the_mean_over_its_own_interval(scheduled):
    """Each entry's train_loss is the mean step loss since the previous entry: it was once the sum (4x),
    and once the running mean since step 1 (the accumulators not reset)."""
    losses = scheduled["step_losses"]
    assert len(losses) == STEPS
    expected = [sum(losses[i:i + EVERY]) / EVERY for i in range(0, STEPS, EVERY)]
    got = [h["train_loss"] for h in scheduled["history"]]
    assert got == pytest.approx(expected, rel=1e-6)
    assert abs(expected[2] - sum(losses) / STEPS) > 1e-3  # the intervals differ from the mean since step 1


def test_grad_clip_bounds_every_model_update(tmp_path):
    """grad_clip=1e-12 clips the model's gradient to norm 1e-12, below AdamW's eps: the model barely moves,
    and its step losses match a run at lr 1e-12 (within 2e-6). Without the clip it trained at lr 1e-2
    (losses off by up to 0.4 within 4 steps)."""
    # no weight decay: AdamW's decay (lr * 0.01 a step) moves a clipped model too
    common = dict(steps=4, eval_every=4, warmup_steps=1, weight_decay=0.0)
    clipped = _softmax_run(tmp_path, "clipped", lr=LR, grad_clip=1e-12, **common)["step_losses"]
    frozen = _softmax_run(tmp_path, "frozen", lr=1e-12, **common)["step_losses"]
    trained = _softmax_run(tmp_path, "trained", lr=LR, **common)["step_losses"]
    torch.testing.assert_close(torch.tensor(clipped), torch.tensor(frozen), rtol=0, atol=1e-4)
    assert max(abs(a - b) for a, b in zip(trained, frozen)) > 1e-2  # lr 1e-2 moves the losses
