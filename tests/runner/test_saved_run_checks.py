"""``compare --resume`` reads saved runs strictly: every field of a ``result.json`` that the report reads, a
checkpoint's history and numbers, ``config.json``'s settings and a finished run's step budget are checked,
and a damaged one is one line naming the file with exit 2 (a traceback, or a silently wrong report, before).
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from attnkit.runner import build_config, run_compare
from attnkit.runner.compare import _lock_run_dir
from attnkit.runner.report import table_legend, table_rows, write_results_json
from tests.runner._fixtures import (
    assert_one_line, resume_cli, resume_with_edited_result, tiny_overrides, write_classification_file,
    write_finished_run,
)

COMMON = dict(mechanisms="softmax", seeds=1, steps=6, checkpoint_every=2, eval_every=3)


class _Killed(Exception):
    pass


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    return write_finished_run(tmp_path_factory.mktemp("finished"))


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A run directory whose only run stopped after its checkpoint of step 4."""
    root = tmp_path_factory.mktemp("cut")
    data = write_classification_file(root / "topics.json")

    def kill(mechanism, seed, step):
        if step == 5:
            raise _Killed

    with pytest.raises(_Killed):
        run_compare(build_config(tiny_overrides(data, root / "cut", **COMMON)), on_step=kill)
    return root / "cut"


def _copy(run, tmp_path):
    shutil.copytree(run, tmp_path / run.name)
    return tmp_path / run.name


def _shorten(values: list) -> list:
    return values[:-1]


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d["history"][0].update(accuracy="x"), "has no valid 'history' (entry 0: accuracy 'x'"),
    (lambda d: d["history"][0].pop("train_loss"), "has no valid 'history' (entry 0: train_loss None"),
    (lambda d: d["history"].append(dict(d["history"][0])), "has no valid 'history' (entry 1 is at step"),
    (lambda d: d.update(step_losses=["a"]), "has no valid 'step_losses'"),
    (lambda d: d.update(step_losses=[0.5] * 4), "has no valid 'step_losses'"),  # more than its 3 steps
    (lambda d: d.update(step_times_s={"min": "a"}), "has no valid 'step_times_s'"),
    (lambda d: d.update(predictions=_shorten(d["predictions"])), "has no valid 'predictions'"),
    (lambda d: d.update(predictions=[7] * len(d["predictions"])), "has no valid 'predictions'"),
    (lambda d: d.update(confusion=[[1]]), "has no valid 'confusion'"),
    (lambda d: d["confusion"][0].__setitem__(0, d["confusion"][0][0] + 1), "has no valid 'confusion'"),
    (lambda d: d.update(classes=[]), "has no valid 'classes'"),
    (lambda d: d["classes"][0].update(f1="x"), "has no valid 'classes'"),
    (lambda d: d.update(samples=None), "has no valid 'samples'"),
    (lambda d: d.update(cpp_kernels=[1]), "has no valid 'cpp_kernels'"),
    (lambda d: d.update(eval_examples="32"), "has no valid 'eval_examples'"),
    (lambda d: d["explain_away"].update(fraction_below_eps=float("nan")),
     "holds a number that is not finite at explain_away/fraction_below_eps"),
])
def test_every_result_field_the_report_reads_is_checked(finished_run, tmp_path, capsys, edit, needle):
    """A text accuracy in the history, text step losses, shortened predictions (McNemar's zip dropped the
    examples silently) or a malformed confusion matrix ended the resumed report in a traceback."""
    out = _copy(finished_run, tmp_path)
    result, code, err = resume_with_edited_result(out, edit, capsys)
    assert code == 2
    assert_one_line(err, str(result), needle, f"delete {str(result.parent)!r}")


@pytest.mark.parametrize("edit, needle", [
    ({"steps": 9}, "is of a run with 9 optimizer steps, not this configuration's 3"),
    ({"train_examples": 5}, "is of a run with 5 training examples, not this configuration's 96"),
])
def test_a_finished_result_of_another_configuration_is_refused(finished_run, tmp_path, capsys, edit, needle):
    """A 150-step run's result.json copied into a 40-step comparison was averaged with the 40-step runs,
    the report saying 40 steps each."""
    out = _copy(finished_run, tmp_path)
    result = out / "runs" / "softmax-seed0" / "result.json"
    result.write_text(json.dumps({**json.loads(result.read_text()), **edit}))
    code, err = resume_cli(out, capsys)
    assert code == 2
    assert_one_line(err, str(result), needle)


@pytest.mark.parametrize("history, needle", [
    ([{"step": 3, "accuracy": "x"}], "has no valid 'history' (entry 0: train_loss None"),
    ([{"step": 3, "train_loss": 0.5, "accuracy": "x", "macro_f1": 0.1}], "entry 0: accuracy 'x'"),
])
def test_a_checkpoint_history_that_is_not_numbers_is_one_line(interrupted, tmp_path, capsys, history, needle):
    """The run trained on from such a checkpoint, wrote its history into result.json, and the report and
    every later --resume crashed."""
    out = _copy(interrupted, tmp_path)
    trainer = out / "runs" / "softmax-seed0" / "checkpoints" / "step-0000004" / "trainer.json"
    trainer.write_text(json.dumps({**json.loads(trainer.read_text()), "history": history}))
    code, err = resume_cli(out, capsys)
    assert code == 2
    assert_one_line(err, str(trainer), needle)
    assert not (out / "runs" / "softmax-seed0" / "result.json").exists()


@pytest.mark.parametrize("key", ["loss_sum", "time_sum", "step_losses"])
def test_a_non_finite_trainer_number_is_refused(interrupted, tmp_path, capsys, key):
    """A NaN loss_sum was accepted and written into results.json as a bare NaN (not JSON)."""
    out = _copy(interrupted, tmp_path)
    trainer = out / "runs" / "softmax-seed0" / "checkpoints" / "step-0000004" / "trainer.json"
    state = json.loads(trainer.read_text())
    state[key] = [float("nan")] * len(state[key]) if isinstance(state[key], list) else float("nan")
    trainer.write_text(json.dumps(state))
    code, err = resume_cli(out, capsys)
    assert code == 2
    assert_one_line(err, str(trainer), f"not finite in {key!r}")
    assert not (out / "results.json").exists()


def test_nan_weights_in_a_checkpoint_name_the_checkpoint_as_damaged(interrupted, tmp_path, capsys):
    """NaN weights were reported as "the training loss became nan at step 5; lower lr"."""
    out = _copy(interrupted, tmp_path)
    state_file = out / "runs" / "softmax-seed0" / "checkpoints" / "step-0000004" / "state.pt"
    state = torch.load(state_file, weights_only=True)
    for value in state["model"].values():
        if value.is_floating_point():
            value.fill_(float("nan"))
    torch.save(state, state_file)
    code, err = resume_cli(out, capsys)
    assert code == 2
    assert_one_line(err, str(state_file), "holds non-finite values (NaN or infinity) in model/")
    assert "lower lr" not in err


@pytest.mark.parametrize("config", ["drop", None, [1, 2], "x"])
def test_a_config_json_without_a_settings_object_is_named_damaged(finished_run, tmp_path, capsys, config):
    """The run marker with "config" missing or null was a KeyError / AttributeError traceback; a list was
    "unknown configuration key(s) [1, 2]"."""
    out = _copy(finished_run, tmp_path)
    path = out / "config.json"
    payload = json.loads(path.read_text())
    if config == "drop":
        del payload["config"]
    else:
        payload["config"] = config
    path.write_text(json.dumps(payload))
    code, err = resume_cli(out, capsys)
    assert code == 2
    assert_one_line(err, str(path), "is damaged", "not a JSON object of settings")


def _record(mechanism: str) -> dict:
    return {"mechanism": mechanism, "n_seeds": 1, "hybrid_u": None, "hybrid_u_mean": None,
            "explain_away_min_normalized": -15.1, "step_time_rel": 1.0, "step_time_baseline": "coda",
            "accuracy_mean": 0.5, "accuracy_std": None}


@pytest.mark.parametrize("mechanism", ["coda", "coda+mmd", "coda+ct"])
def test_coda_with_alignment_marks_its_explain_away_as_not_normalized(mechanism):
    """coda+mmd showed CoDA's unnormalized value (-15.1) as if it were a weight share."""
    records = [_record(mechanism)]
    _, rows = table_rows(records, ("accuracy",), detail=True)
    assert rows[0][-2].endswith("(not normalized)")
    _, rows = table_rows(records, ("accuracy",), detail=False)
    assert rows[0][-2].endswith("*")
    assert "CoDA weights are not normalized" in table_legend(records)


def test_a_softmax_row_has_no_not_normalized_mark():
    _, rows = table_rows([_record("softmax+mmd")], ("accuracy",), detail=True)
    assert "normalized" not in rows[0][-2]
    assert "CoDA" not in table_legend([_record("softmax+mmd")])


def test_results_json_is_never_written_with_a_bare_nan(tmp_path):
    """Strict JSON parsers refuse NaN: a non-finite number is an error, not an invalid file."""
    from types import SimpleNamespace

    data = write_classification_file(tmp_path / "t.json")
    config = build_config(tiny_overrides(data, tmp_path / "out"))
    task = SimpleNamespace(kind="classification", metric_names=("accuracy",))
    path = tmp_path / "results.json"
    with pytest.raises(ValueError, match="JSON"):
        write_results_json(path, config, task, [{"accuracy_mean": math.nan}], [])
    assert not path.exists()


def test_the_saved_results_are_strict_json(finished_run):
    def refuse(constant):
        raise ValueError(f"{constant} in strict JSON")

    for path in [finished_run / "results.json", *finished_run.glob("runs/*/result.json")]:
        json.loads(path.read_text(), parse_constant=refuse)


def test_the_lock_message_of_overwrite_speaks_of_replacing(tmp_path):
    fd = _lock_run_dir(tmp_path)
    try:
        with pytest.raises(ValueError, match="before replacing this run"):
            _lock_run_dir(tmp_path, overwrite=True)
        with pytest.raises(ValueError, match="before continuing this run"):
            _lock_run_dir(tmp_path)
    finally:
        if fd is not None:
            import os

            os.close(fd)
