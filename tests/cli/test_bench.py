"""``attnkit bench`` through the CLI: a quick run writes JSON with ratios and peak memory."""

from __future__ import annotations

import json

import pytest

from attnkit.cli import main


@pytest.mark.slow
def test_bench_quick_writes_json_with_ratios_and_memory(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    main(
        [
            "bench",
            "--quick",
            "--mechanisms",
            "dnas",
            "--backends",
            "efficient",
            "--repeats",
            "1",
            "--out",
            str(out),
        ]
    )
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {r["L"] for r in rows} == {256, 1024}
    assert {(r["mechanism"], r["backend"]) for r in rows} == {("softmax", "sdpa"), ("dnas", "efficient")}
    for r in rows:
        assert r["fwd_bwd_ratio"] > 0 and r["fwd_ratio"] > 0
        assert r["peak_extra_mb"] is not None and r["peak_extra_mb"] >= 0
    assert "x sdpa" in capsys.readouterr().out


def test_bench_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    out.write_text("{}")
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--quick", "--out", str(out)])
    assert exc.value.code == 2
    assert "--overwrite" in capsys.readouterr().err
    assert out.read_text() == "{}"


def test_bench_rejects_unknown_mechanism(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--mechanisms", "dnas,bogus", "--out", str(tmp_path / "x.json")])
    assert exc.value.code == 2
    assert "bogus" in capsys.readouterr().err
