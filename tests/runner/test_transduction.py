"""``attnkit compare`` on the lecture's transduction tasks: model names, presets, and an end-to-end tiny
run."""

from __future__ import annotations

import json

import pytest

from attnkit.runner import build_config, get_task, run_compare
from attnkit.runner.transduction import DEFAULT_MODELS, MODELS, TransductionTask


def test_transduction_tasks_take_model_names():
    config = build_config({"task": "g2p"})
    assert config.mechanisms == DEFAULT_MODELS
    config = build_config({"task": "numbers", "mechanisms": "vanilla,gmm,ctc"})
    assert config.mechanisms == ("vanilla", "gmm", "ctc")
    assert isinstance(get_task("copy"), TransductionTask)


def test_unknown_model_lists_the_valid_ones():
    with pytest.raises(ValueError, match="expected names from") as exc:
        build_config({"task": "g2p", "mechanisms": "softmax"})
    assert all(m in str(exc.value) for m in MODELS)
    with pytest.raises(ValueError, match="unknown mechanism"):
        build_config({"task": "mlu", "mechanisms": "gmm"})


@pytest.mark.slow
def test_compare_runs_models_on_copy(tmp_path):
    overrides = dict(
        task="copy",
        mechanisms="gmm,ctc",
        seeds=1,
        steps=3,
        eval_every=3,
        checkpoint_every=3,
        batch_size=8,
        max_train=64,
        max_eval=8,
        d_model=16,
        out=str(tmp_path / "run"),
        progress="none",
        plots=False,
    )
    result = run_compare(build_config(overrides))
    assert [r["mechanism"] for r in result.records] == ["gmm", "ctc"]
    for record in result.records:
        assert 0.0 <= record["sequence_error_rate_mean"] <= 1.0
        assert record["token_error_rate_mean"] >= 0.0
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved
    # the models not run, which --mechanisms takes (it listed softmax, dnas, ..., which it refuses here)
    skipped = {"vanilla", "additive", "bilinear", "dot", "scaled_dot", "mixed"}
    assert set(saved["skipped_mechanisms"]) == skipped
