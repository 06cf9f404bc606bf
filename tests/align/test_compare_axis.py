"""``attnkit compare --align``: alignment attention as one more axis of the comparison."""

from __future__ import annotations

import json

import pytest

from attnkit.runner import build_config, run_compare
from tests.runner._fixtures import tiny_overrides, write_classification_file


@pytest.mark.slow  # four short training runs with evaluation and the report: over 20 s on a shared machine
def test_compare_runs_each_mechanism_with_each_alignment(tmp_path):
    data = write_classification_file(tmp_path / "topics.json")
    config = build_config(
        tiny_overrides(
            data,
            tmp_path / "out",
            mechanisms="softmax,dnas",
            align="none,ct",
            steps=4,
            eval_every=4,
            checkpoint_every=4,
            plots=False,
        )
    )
    assert config.variants == ("softmax", "softmax+ct", "dnas", "dnas+ct")
    result = run_compare(config)
    assert [r["mechanism"] for r in result.records] == list(config.variants)
    saved = json.loads((tmp_path / "out" / "runs" / "dnas+ct-seed0" / "result.json").read_text())
    assert saved["mechanism"] == "dnas+ct" and saved["steps"] == 4
    # the same seed and data: alignment changes the training, so the trained weights differ from plain dnas
    plain = json.loads((tmp_path / "out" / "runs" / "dnas-seed0" / "result.json").read_text())
    assert saved["history"][-1]["train_loss"] != plain["history"][-1]["train_loss"]


@pytest.mark.parametrize("align, match", [("none,wgan", "'wgan'"), ("ct,ct", "twice"), ("", "non-empty")])
def test_bad_align_axis_raises(tmp_path, align, match):
    with pytest.raises(ValueError, match=match):
        build_config(
            tiny_overrides(write_classification_file(tmp_path / "x.json"), tmp_path / "o", align=align)
        )


def test_the_no_attention_baseline_runs_once_whatever_the_alignment_methods():
    from attnkit.runner import build_config

    config = build_config(dict(task="reuters8", mechanisms="softmax,none", align="ct,mmd", progress="none"))
    assert config.variants == ("softmax+ct", "softmax+mmd", "none")
    config = build_config(dict(task="reuters8", mechanisms="none,dnas", align="none,ct", progress="none"))
    assert config.variants == ("none", "dnas", "dnas+ct")
