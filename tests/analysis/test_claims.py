"""Claims: verdict words, spread over seeds, ``--strict`` and the fidelity page, on constructed cases."""

from __future__ import annotations

import json

import pytest

from attnkit.analysis import reproduce as reproduce_module
from attnkit.analysis.fidelity import reproduce_all
from attnkit.analysis.report import Claim, ReproduceResult, spread
from attnkit.cli import main


def _constructed_target(held: bool):
    def target(result: ReproduceResult, quick: bool, seed: int) -> None:
        result.budget = "constructed"
        result.rows.append({"mechanism": "softmax", "share below -20": 0.1})
        result.claims.append(
            Claim(
                "constructed Fig. 1",
                "most keys are explained away",
                held,
                "share 0.1 (constructed)",
                paper="> 0.5",
                ours="0.1",
            )
        )
        result.claims.append(Claim("constructed Fig. 2", "a claim that holds", True, "always"))

    return target


@pytest.fixture
def constructed_targets(monkeypatch):
    monkeypatch.setitem(reproduce_module.TARGETS, "constructed-fail", _constructed_target(False))
    monkeypatch.setitem(reproduce_module.TARGETS, "constructed-pass", _constructed_target(True))


def test_strict_exits_one_when_a_claim_is_not_held(tmp_path, capsys, constructed_targets):
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "constructed-fail", "--out", str(tmp_path / "a"), "--strict"])
    assert exc.value.code == 1
    printed = capsys.readouterr().out
    assert "not held" in printed and "1 of 2 claims held" in printed
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert [c["verdict"] for c in summary["claims"]] == ["not held", "held"]


def test_without_strict_a_failed_claim_still_exits_zero(tmp_path, capsys, constructed_targets):
    main(["reproduce", "constructed-fail", "--out", str(tmp_path / "a")])
    assert "not held" in capsys.readouterr().out


def test_strict_passes_when_every_claim_holds(tmp_path, capsys, constructed_targets):
    main(["reproduce", "constructed-pass", "--out", str(tmp_path / "a"), "--strict"])
    assert "2 of 2 claims held" in capsys.readouterr().out


def test_fidelity_page_lists_every_claim_with_its_verdict(tmp_path, constructed_targets):
    results, page = reproduce_all(tmp_path / "all", targets=["constructed-fail", "constructed-pass"])
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and text.count("<b>not held</b>") == 1
    assert text.count("<b>held</b>") == 3 and "most keys are explained away" in text and "&gt; 0.5" in text
    assert [r.name for r in results] == ["constructed-fail", "constructed-pass"]
    assert (
        json.loads((tmp_path / "all" / "fidelity.json").read_text())[0]["claims"][0]["verdict"] == "not held"
    )
    markdown = (tmp_path / "all" / "fidelity.md").read_text()
    assert "3 of 4 claims held" in markdown and markdown.count("**not held**") == 1


def test_fidelity_rejects_unknown_targets(tmp_path):
    with pytest.raises(ValueError, match="unknown reproduction targets"):
        reproduce_all(tmp_path / "all", targets=["figure-9"])


def test_spread_reports_mean_std_and_count():
    assert spread([1.0, 2.0, 3.0]) == "2 +- 1 (n=3)"
    assert spread([0.5]) == "0.5 +- 0 (n=1)"
    with pytest.raises(ValueError):
        spread([])


def test_claim_rejects_unknown_criterion():
    with pytest.raises(ValueError, match="criterion"):
        Claim("s", "t", True, "e", criterion="lenient")


def test_rebuild_reads_the_summaries_back(tmp_path, constructed_targets):
    from attnkit.analysis.fidelity import rebuild_fidelity

    reproduce_all(tmp_path / "all", targets=["constructed-fail", "constructed-pass"])
    (tmp_path / "all" / "fidelity.html").unlink()
    page = rebuild_fidelity(tmp_path / "all", quick=True)
    assert page.read_text().count("<b>not held</b>") == 1


def test_rebuild_without_results_is_a_clear_error(tmp_path):
    from attnkit.analysis.fidelity import rebuild_fidelity

    with pytest.raises(FileNotFoundError, match="reproduce all"):
        rebuild_fidelity(tmp_path, quick=True)
