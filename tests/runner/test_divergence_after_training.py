"""A run whose last optimizer step diverges is an error naming the run and "lower lr", as one that diverges
mid-training: never a score computed from NaN outputs, nor a kernel's input check that names no run."""

from __future__ import annotations

import pytest
import torch

import attnkit.runner.train as train
from attnkit.runner import build_config, run_compare
from tests.runner._fixtures import tiny_overrides, write_classification_file, write_seq2seq_jsonl

ONE_RUN = dict(seeds=1, warmup_steps=0, eval_every=1, checkpoint_every=50, plots=False)


def _config(task, out, mechanism: str, lr: float, steps: int, **extra):
    return build_config(tiny_overrides(task, out, **{**ONE_RUN, "mechanisms": mechanism, "lr": lr,
                                                      "steps": steps, **extra}))


def test_a_last_step_that_diverges_is_an_error_and_no_result_is_saved(tmp_path):
    """The only (last) step at lr=1e30 made every logit NaN (weights of 1e30, finite themselves); the loop
    read the loss computed before that step, the evaluation took the arg-max of NaN, class 0, and compare
    saved class 0's share as the accuracy (0.65625 on the reviewer's tiny task), exit 0."""
    data = write_classification_file(tmp_path / "topics.json")
    out = tmp_path / "out"
    with pytest.raises(ValueError) as exc:
        run_compare(_config(data, out, "none", lr=1e30, steps=1))
    message = str(exc.value)
    assert message.startswith("none seed 0: the model's outputs became nan after step 1")
    assert message.endswith("lower lr or raise warmup_steps")
    assert not out.exists()  # no result.json, no model.pt: the corrected command is not refused


def test_a_sequence_to_sequence_last_step_that_diverges_is_an_error(tmp_path):
    """The Transformer encoder-decoder's greedy decoding of NaN logits gave strings of token 0, scored as
    the sequence and token accuracy."""
    data = write_seq2seq_jsonl(tmp_path / "reverse.jsonl")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"^softmax seed 0: the model's outputs became nan after step 1"):
        run_compare(_config(data, out, "softmax", lr=1e30, steps=1, max_target_len=8))
    assert not out.exists()


@pytest.mark.parametrize("model", ["vanilla", "dot"])
def test_a_recurrent_last_step_that_diverges_is_an_error_naming_lr(tmp_path, model):
    """The lecture tasks' recurrent models: vanilla's NaN logits were decoded and scored; dot attention's
    NaN scores stopped the run with the score function's input check ("scores contain NaN or +inf ...
    check the score function's inputs"), which names neither the run nor lr."""
    out = tmp_path / "out"
    config = build_config(dict(task="copy", mechanisms=model, seeds=1, steps=1, lr=1e30, warmup_steps=0,
                               max_train=16, max_eval=8, batch_size=8, out=str(out),
                               progress="none", plots=False))
    with pytest.raises(ValueError, match=rf"^{model} seed 0: .*(after|at) step 1\b") as exc:
        run_compare(config)
    assert str(exc.value).endswith("lower lr or raise warmup_steps")
    assert not out.exists()


def test_non_finite_attention_weights_after_the_last_step_are_named_as_the_divergence(tmp_path):
    """softmax at lr=1e6 for one step: the run failed after training in the explain-away diagnostic, "weights
    hold ... non-finite values ...; mask padded queries and keys", as if the user's masks were wrong."""
    data = write_classification_file(tmp_path / "topics.json")
    with pytest.raises(ValueError) as exc:
        run_compare(_config(data, tmp_path / "out", "softmax", lr=1e6, steps=1))
    assert "after step 1" in str(exc.value) and "lower lr or raise warmup_steps" in str(exc.value)
    assert "mask padded" not in str(exc.value)


def test_scores_that_overflow_after_training_steps_name_the_run_step_and_lr(tmp_path):
    """lr=1e12: the second step's forward stopped with functional's score-range check ("the scores scale *
    q . k may reach 2.4e+52 ...; scale q and k down"), naming no run, step or lr."""
    data = write_classification_file(tmp_path / "topics.json")
    with pytest.raises(ValueError) as exc:  # no evaluation after step 1: step 2's training forward stops
        run_compare(_config(data, tmp_path / "out", "softmax", lr=1e12, steps=3, eval_every=50))
    message = str(exc.value)
    assert message.startswith("softmax seed 0: training diverged at step 2 with lr=1e+12 (the scores")
    assert "would overflow to inf" in message  # the kernel's reason is kept
    assert message.endswith("lower lr or raise warmup_steps")


def test_an_overflow_of_a_model_not_trained_yet_is_raised_as_it_is():
    """Before any optimizer step the weights are the initialisation's: lr is no cause to name."""
    reason = "the scores scale * q . k may reach 1e+50 ...: they would overflow to inf"
    with pytest.raises(ValueError) as exc:
        with train._divergence_named("softmax", 0, 1, 1e-3, trained=False):
            raise ValueError(reason)
    assert str(exc.value) == reason
    with pytest.raises(ValueError, match="mask"):  # another check's error: not a divergence
        with train._divergence_named("softmax", 0, 3, 1e-3):
            raise ValueError("key_mask has shape (2, 3), expected (B, Lk) = (2, 4)")


def test_the_check_after_the_last_step_is_one_forward_per_run_and_draws_no_random_numbers(tmp_path,
                                                                                        monkeypatch):
    """The check must cost nothing per step and leave the results as they were: one more forward of the
    last batch per run, in evaluation mode, with the random state restored (dropout is on here)."""
    from attnkit.runner.tasks import ClassificationTask

    calls, states = [], []
    original = ClassificationTask.loss_sum

    def counted(self, model, *args, **kwargs):
        calls.append(model.training)
        return original(self, model, *args, **kwargs)

    real_check = train._check_outputs_after_last_step

    def watched(*args, **kwargs):
        states.append(torch.get_rng_state())
        real_check(*args, **kwargs)
        states.append(torch.get_rng_state())

    monkeypatch.setattr(ClassificationTask, "loss_sum", counted)
    monkeypatch.setattr(train, "_check_outputs_after_last_step", watched)
    data = write_classification_file(tmp_path / "topics.json")
    result = run_compare(_config(data, tmp_path / "out", "softmax", lr=1e-2, steps=4, dropout=0.3))
    assert calls == [True, True, True, True, False]  # four training steps, then the check in eval mode
    assert len(states) == 2 and torch.equal(states[0], states[1])
    assert result.runs[0]["metrics"]["accuracy"] is not None


def test_a_forward_that_fails_before_any_update_keeps_its_own_message(tmp_path, monkeypatch):
    """Step 1's forward runs on the initial weights: an out-of-range error there is no matter of lr, and the
    training loop must not rename it "training diverged at step 1 with lr"."""
    from attnkit.runner import tasks

    def overflowing(self, *args, **kwargs):
        raise ValueError("the scores of this call may reach 1e+40, which would overflow to inf")

    monkeypatch.setattr(tasks.ClassificationTask, "loss_sum", overflowing)
    data = write_classification_file(tmp_path / "topics.json")
    with pytest.raises(ValueError) as exc:
        run_compare(_config(data, tmp_path / "out", "softmax", lr=1e-3, steps=2))
    assert "training diverged" not in str(exc.value) and "would overflow to inf" in str(exc.value)
