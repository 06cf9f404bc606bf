"""``attnkit bench`` through the CLI: a quick run writes JSON with ratios and peak memory."""

from __future__ import annotations

import json

import pytest

from attnkit.cli import main


@pytest.mark.slow
def test_bench_quick_writes_json_with_ratios_and_memory(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    main(["bench", "--quick", "--memory", "--mechanisms", "dnas", "--backends", "efficient", "--repeats", "2",
          "--out", str(out)])
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {r["L"] for r in rows} == {256, 1024}
    assert {(r["mechanism"], r["backend"]) for r in rows} == {("softmax", "sdpa"), ("dnas", "efficient")}
    for r in rows:
        assert r["fwd_bwd_ratio"] > 0 and r["fwd_ratio"] > 0
        assert r["peak_extra_mb"] is not None and r["peak_extra_mb"] >= 0
        if r["backend"] != "sdpa":
            fb = r["fwd_bwd_spread_s"]
            assert fb["min"] <= fb["median"] == r["fwd_bwd_s"] <= fb["max"]
    assert len(data["meta"]["load_average_before"]) == 3 and data["meta"]["cores"] >= 1
    out_text = capsys.readouterr().out
    assert "x sdpa" in out_text and "min / max" in out_text and "load average" in out_text


def test_load_warning_only_when_load_exceeds_cores():
    from attnkit.benchmark import load_warning, spread

    assert load_warning(load=1.5, cores=2) is None
    assert "load average 9.0 > 2 cores" in load_warning(load=9.0, cores=2)
    assert spread([3.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0}


def test_bad_lengths_reported_before_the_existing_out_file(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    out.write_text("{}")
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--lengths", "abc", "--out", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--lengths 'abc'" in err and "--overwrite" not in err


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


def test_bench_rejects_zero_heads(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--heads", "0", "--out", str(tmp_path / "x.json")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "heads=0" in err and "Traceback" not in err


@pytest.mark.parametrize("flag,value", [("--dropout", "1.0"), ("--padding", "-0.1")])
def test_bench_rejects_dropout_and_padding_outside_zero_one(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as exc:
        main(["bench", flag, value, "--out", str(tmp_path / "x.json")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag[2:]}={float(value)!r}" in err and "[0, 1)" in err and "Traceback" not in err


def test_bench_passes_dropout_and_padding_to_the_run(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    main(["bench", "--lengths", "16", "--mechanisms", "softmax", "--backends", "efficient", "--repeats", "1",
          "--no-memory", "--batch", "2", "--dropout", "0.2", "--padding", "0.5", "--out", str(out)])
    meta = json.loads(out.read_text())["meta"]
    assert (meta["dropout"], meta["padding"], meta["valid_lengths"]) == (0.2, 0.5, {"16": [16, 8]})
    assert "dropout 0.2, padded (valid lengths from L to 0.5 L)" in capsys.readouterr().out


@pytest.mark.parametrize("args,needle", [
    (["--sinkhorn-iters", "-1"], "sinkhorn_iters=-1"),
    (["--max-reference-length", "-1"], "max_reference_length=-1"),
    (["--mechanisms", ""], "--mechanisms '' names nothing"),
    (["--lengths", ","], "--lengths ',' names nothing"),
    (["--backends", "naive", "--mechanisms", "coda"], "naive implements only dnas, hnas, sinkhorn"),
    (["--backends", "reference", "--lengths", "4096", "--max-reference-length", "2048"],
     "reference run only L <= max_reference_length=2048"),
])
def test_bench_that_would_time_nothing_or_has_bad_values_fails_before_running(args, needle, tmp_path, capsys):
    out = tmp_path / "x.json"
    with pytest.raises(SystemExit) as exc:
        main(["bench", *args, "--repeats", "1", "--no-memory", "--out", str(out)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err
    assert "L=" not in err and not out.exists()  # nothing was timed
