"""``attnkit reproduce NAME``: a target writes its files and claims, refuses to overwrite, names the valid
targets."""

from __future__ import annotations

import json

import pytest

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
