"""``attnkit.analysis.reproduce``: targets write their files and check the papers' claims (the command:
tests/cli)."""

from __future__ import annotations


import pytest

from attnkit.analysis.reproduce import TARGETS, reproduce


def test_lemma1_target_observed_minimum_is_at_least_one(tmp_path):
    result = reproduce("lemma1", tmp_path / "l1", quick=True)
    by_mech = {row["mechanism"]: row["min n_k*sum"] for row in result.rows}
    assert by_mech["dnas"] >= 1 - 1e-9 and by_mech["sinkhorn"] >= 1 - 1e-9
    assert by_mech["softmax"] < 1e-3
    assert all(c.held for c in result.claims)
    assert (tmp_path / "l1" / "lemma1.png").stat().st_size > 0


@pytest.mark.slow
def test_explain_away_target_quick(tmp_path):
    result = reproduce("explain-away", tmp_path / "ea", quick=True)
    rows = {row["mechanism"]: row for row in result.rows}
    assert rows["dnas"]["min n_k*sum (all evals)"] >= 1 - 1e-6
    assert 0 <= rows["hnas"]["final u"] <= 1
    assert {p.name for p in result.files} >= {
        "log_sum_histogram.png",
        "min_weight_sum.png",
        "hybrid_weight.png",
        "training_curves.csv",
    }


def test_every_target_is_registered():
    assert set(TARGETS) == {
        "mode-collapse-curves",
        "mode-collapse-2d",
        "explain-away",
        "lemma1",
        "coda-matrices",
        "lecture-visual",
    }
