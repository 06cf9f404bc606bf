"""``attnkit reproduce``: targets write their files, check the papers' claims, and never overwrite."""

from __future__ import annotations

import json

import pytest

from attnkit.analysis.reproduce import TARGETS, reproduce
from attnkit.cli import main


def test_cli_mode_collapse_curves_writes_files_and_claims_hold(tmp_path, capsys):
    out = tmp_path / "curves"
    main(["reproduce", "mode-collapse-curves", "--out", str(out), "--quick"])
    printed = capsys.readouterr().out
    assert "paper claims" in printed and "NO" not in printed
    names = {p.name for p in out.iterdir()}
    assert {"center_distance.png", "closed_form.csv", "simulated.csv", "summary.json"} <= names
    summary = json.loads((out / "summary.json").read_text())
    assert summary["claims"] and all(c["held"] for c in summary["claims"])


def test_cli_refuses_non_empty_output_dir(tmp_path, capsys):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "lemma1", "--out", str(out), "--quick"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--overwrite" in err and len(err.strip().splitlines()) == 1
    assert (out / "mine.txt").read_text() == "keep me"


def test_cli_unknown_target_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "figure-9"])
    assert exc.value.code == 2
    assert "mode-collapse-curves" in capsys.readouterr().err


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
    assert rows["dnas"]["min n_k*sum"] >= 1 - 1e-6
    assert set(rows) == {"uniform", "softmax", "dnas", "hnas"}
    sources = [c.source for c in result.claims]
    assert "later version Fig. 1 (caption)" in sources and "later version Fig. 3 / sec. 6.1" in sources
    paper_fig1 = next(c for c in result.claims if c.source == "later version Fig. 1 (caption)")
    assert paper_fig1.criterion == "paper" and "-20" in paper_fig1.paper
    assert {p.name for p in result.files} >= {"log_sum_histogram.png", "min_weight_sum.png", "hybrid_weight.png",
                                             "training_curves.csv"}


def test_every_target_is_registered():
    assert set(TARGETS) >= {"mode-collapse-curves", "mode-collapse-2d", "explain-away", "lemma1", "coda-matrices"}
