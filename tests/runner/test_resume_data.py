"""``compare --resume`` reuses a saved run only when it was trained on this data: a finished result's test
examples per class, and the data fingerprint that results and checkpoints record, are checked (a run trained
before integer labels meant other classes, with the same sizes, was reused and averaged into the report).
"""

from __future__ import annotations

import json
import shutil

import pytest

from attnkit.data.cache import sha256_file
from attnkit.runner import build_config, get_task, run_compare
from tests.runner._fixtures import (
    Killed, kill_at, tiny_overrides, write_classification_file, write_seq2seq_jsonl,
)

COMMON = dict(mechanisms="softmax", seeds=1, steps=6, checkpoint_every=2, eval_every=3)
RUN = ("runs", "softmax-seed0")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A folder with a dataset file, a finished run on it (``done``) and one stopped after its checkpoint of
    step 4 (``cut``)."""
    root = tmp_path_factory.mktemp("data_runs")
    data = write_classification_file(root / "topics.json")
    run_compare(build_config(tiny_overrides(data, root / "done", **COMMON)))
    with pytest.raises(Killed):
        run_compare(build_config(tiny_overrides(data, root / "cut", **COMMON)), on_step=kill_at(5))
    return root


def _copy(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "copy")
    return tmp_path / "copy", tmp_path / "copy" / "topics.json"


def _edit_json(path, edit) -> None:
    record = json.loads(path.read_text())
    edit(record)
    path.write_text(json.dumps(record))


def _read_otherwise(out, data) -> None:
    """Make the run in ``out`` one started on the dataset file ``data`` as it is now: as if this attnkit read
    the same file into other examples (integer labels read as other classes, a regenerated split)."""
    def edit(payload):
        payload["config"]["task"] = str(data)
        payload["task_sha256"] = sha256_file(data)

    _edit_json(out / "config.json", edit)


def _resume(out, data, **extra):
    return run_compare(build_config(tiny_overrides(data, out, resume=True, **{**COMMON, **extra})))


def _assert_one_line(exc: pytest.ExceptionInfo, *needles: str) -> None:
    message = str(exc.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_a_result_of_other_test_supports_per_class_is_refused(saved, tmp_path):
    """After 9fdef05 changed what integer labels mean, a result without a fingerprint whose classes had
    supports [0, 2, 2, 2, 4] was reused for a dataset of 2 per class: its sizes and class names agree."""
    root, data = _copy(saved, tmp_path)
    result = root / "done" / RUN[0] / RUN[1] / "result.json"
    record = json.loads(result.read_text())
    supports = [c["support"] for c in record["classes"]]
    stale = supports[1:] + supports[:1]  # the labels shifted by one class, the same number of examples
    assert stale != supports

    def edit(r):
        r.pop("data_sha256", None)  # written by an older attnkit
        for c, n in zip(r["classes"], stale):
            c["support"] = n

    _edit_json(result, edit)
    with pytest.raises(ValueError) as exc:
        _resume(root / "done", data)
    _assert_one_line(exc, str(result), "was trained on other data",
                     f"test examples per class {stale}, this dataset's {supports}",
                     f"delete {str(result.parent)!r} to train that run again with --resume")


def _change_example(split: str):
    def change(raw):
        raw[split][1]["text"] = "goal goal team match"  # same sizes, same labels: the same supports

    return change


@pytest.mark.parametrize("split", ["train", "test"])
def test_a_result_trained_on_another_example_is_refused_by_fingerprint(saved, tmp_path, split):
    """An MLU run trained on the previous train split resumed: sizes and classes agree."""
    root, data = _copy(saved, tmp_path)
    _edit_json(data, _change_example(split))
    _read_otherwise(root / "done", data)
    result = root / "done" / RUN[0] / RUN[1] / "result.json"
    with pytest.raises(ValueError) as exc:
        _resume(root / "done", data)
    _assert_one_line(exc, f"run result {str(result)!r} was trained on other data (data SHA-256",
                     f"delete {str(result.parent)!r} to train that run again with --resume")


@pytest.mark.parametrize("split", ["train", "test"])
def test_a_checkpoint_trained_on_another_example_is_refused_by_fingerprint(saved, tmp_path, split):
    root, data = _copy(saved, tmp_path)
    _edit_json(data, _change_example(split))
    _read_otherwise(root / "cut", data)
    checkpoint = root / "cut" / RUN[0] / RUN[1] / "checkpoints" / "step-0000004"
    with pytest.raises(ValueError) as exc:
        _resume(root / "cut", data)
    _assert_one_line(exc, f"checkpoint {str(checkpoint)!r} was trained on other data (data SHA-256",
                     f"delete {str(checkpoint.parent.parent)!r} to train that run again with --resume")
    assert not (checkpoint.parent.parent / "result.json").exists()


def test_an_older_result_and_checkpoint_without_the_fingerprint_still_resume(saved, tmp_path):
    """Runs saved before fingerprints were recorded are checked by their sizes, classes and supports."""
    root, data = _copy(saved, tmp_path)
    result = root / "done" / RUN[0] / RUN[1] / "result.json"
    before = json.loads(result.read_text())
    _edit_json(result, lambda r: r.pop("data_sha256"))
    reused = _resume(root / "done", data)
    assert reused.runs[0]["metrics"] == before["metrics"]
    assert "data_sha256" not in json.loads(result.read_text())  # reused as it was, not trained again
    trainer = root / "cut" / RUN[0] / RUN[1] / "checkpoints" / "step-0000004" / "trainer.json"
    _edit_json(trainer, lambda t: t.pop("data_sha256"))
    finished = _resume(root / "cut", data)
    assert finished.runs[0]["history"] == before["history"]
    assert finished.runs[0]["data_sha256"] == before["data_sha256"]


@pytest.mark.parametrize("kind", ["alignment", "seq2seq"])
def test_a_run_resumes_with_its_fingerprint(tmp_path, kind):
    """A run with an alignment regularizer and one of a seq2seq task record the data fingerprint in their
    checkpoint and result, continue from the checkpoint and are reused when finished."""
    from attnkit.runner.train import data_fingerprint  # here: the other tests also run on older versions

    if kind == "alignment":
        data, extra = write_classification_file(tmp_path / "topics.json"), dict(align="ct")
    else:
        data, extra = write_seq2seq_jsonl(tmp_path / "reverse.jsonl"), dict(max_target_len=6)
    out = tmp_path / "out"
    config = build_config(tiny_overrides(data, out, **{**COMMON, **extra}))
    fingerprint = data_fingerprint(get_task(config.task).prepare(config))
    run = out / "runs" / f"{config.variants[0]}-seed0"
    with pytest.raises(Killed):
        run_compare(config, on_step=kill_at(5))
    trainer = json.loads((run / "checkpoints" / "step-0000004" / "trainer.json").read_text())
    assert trainer["data_sha256"] == fingerprint
    resumed = _resume(out, data, **extra)
    assert resumed.runs[0]["data_sha256"] == fingerprint
    assert json.loads((run / "result.json").read_text())["data_sha256"] == fingerprint
    again = _resume(out, data, **extra)
    assert again.runs[0]["metrics"] == resumed.runs[0]["metrics"]
