"""``attnkit bench`` through the CLI: a quick run writes JSON with ratios and peak memory."""

from __future__ import annotations

import json

import pytest

from attnkit.cli import main
from tests.cli._fixtures import save_during_bench


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
    assert spread([3.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0, "rounds": 3}


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


def test_mechanisms_and_backends_are_read_in_any_case_and_by_alias():
    """compare took --mechanisms DNAS and finetune --mechanism DNAS; bench refused them."""
    from attnkit.benchmark import BenchConfig

    config = BenchConfig(mechanisms=["DNAS", "lnas", "Sinkhorn"], backends=["Efficient"])
    assert config.mechanisms == ("dnas", "softmax", "sinkhorn") and config.backends == ("efficient",)


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
    (["--threads", "100000"], "threads=100000; expected an integer in [1, 1024]"),  # segfaulted in OpenMP
    (["--max-reference-length", "-1"], "max_reference_length=-1"),
    (["--mechanisms", ""], "--mechanisms '' names nothing"),
    (["--lengths", ","], "--lengths ',' names nothing"),
    (["--lengths", "256,1024,256"], "--lengths '256,1024,256' names 256 more than once"),
    (["--mechanisms", "dnas, dnas"], "--mechanisms 'dnas, dnas' names dnas more than once"),
    (["--mechanisms", "DNAS,dnas"], "mechanisms names ['dnas'] more than once"),
    (["--mechanisms", "softmax,lnas"], "mechanisms names ['lnas'] more than once"),
    (["--mechanisms", "dnas", "--sinkhorn-iters", "7"], "--sinkhorn-iters 7 is for the sinkhorn mechanism"),
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


def test_a_file_that_appears_during_the_run_is_kept(tmp_path, capsys, monkeypatch):
    """The --out check runs before the bench and the bench can take minutes: a file saved there meanwhile
    is not overwritten without --overwrite (the result is linked into place only if the path is free)."""
    out = tmp_path / "kernels.json"
    save_during_bench(monkeypatch, out)
    args = ["bench", "--lengths", "16", "--mechanisms", "dnas", "--backends", "efficient", "--repeats", "1",
            "--no-memory", "--out", str(out)]
    with pytest.raises(SystemExit) as exc:
        main(args)
    captured = capsys.readouterr()
    assert exc.value.code == 2 and "appeared while this was running and is kept" in captured.err
    assert "dnas" in captured.out  # the table was printed before the write
    assert out.read_text() == '{"user": "precious"}'
    spare = tmp_path / "kernels-1.json"  # the measurements, beside it; no temporary file left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kernels-1.json", "kernels.json"]
    assert json.loads(spare.read_text())["meta"]["lengths"] == [16]
    main([*args, "--overwrite"])
    assert json.loads(out.read_text())["meta"]["lengths"] == [16]


def test_a_failed_memory_measurement_is_a_footnote_with_its_cause(monkeypatch):
    from attnkit import benchmark

    monkeypatch.setattr(
        benchmark.subprocess, "run",
        lambda *a, **k: benchmark.subprocess.CompletedProcess(a, -9, stdout="", stderr=""),
    )
    cfg = benchmark.BenchConfig(lengths=(16,), mechanisms=("dnas",), backends=("efficient",), repeats=1)
    result = benchmark.run_bench(cfg)
    table = benchmark.format_table(result)
    why = "the memory subprocess failed (killed by signal 9)"
    assert all(r["memory_error"] == why for r in result["rows"])
    assert f"(1) {why}" in table
    assert result["meta"]["memory"] is not None


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--sinkhorn-iters", "1000000000", "--mechanisms", "sinkhorn"], "integer in [0, 1000]"),
        (["--lengths", "99999999999999999999"], "GiB for q, k, v"),
        (["--head-dim", "99999999999999999999"], "GiB for q, k, v"),
        (["--batch", "99999999999"], "GiB for q, k, v"),
        # 32 GiB per (B, H, L, L) float32 matrix: an allocator traceback, and no row kept
        (["--lengths", "32768", "--max-reference-length", "32768", "--backends", "reference"],
         "GiB of (B, H, L, L) matrices"),
    ],
)
def test_sizes_beyond_the_machine_are_refused_before_running(args, needle, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--no-memory", "--out", str(tmp_path / "x.json"), *args])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.json").exists()


def test_meta_records_what_was_run_and_no_memory_method_without_memory():
    from attnkit.benchmark import BenchConfig, run_bench

    cfg = BenchConfig(lengths=(16, 8), mechanisms=("dnas",), backends=("efficient",), repeats=2, memory=False)
    result = run_bench(cfg)
    meta = result["meta"]
    assert (meta["lengths"], meta["mechanisms"], meta["backends"]) == ([16, 8], ["dnas"], ["efficient"])
    assert meta["memory"] is None
    assert all(r["fwd_bwd_spread_s"]["rounds"] == 2 for r in result["rows"] if r["backend"] == "efficient")


def test_results_are_written_through_a_symbolic_link(tmp_path):
    import os

    from attnkit._files import write_text_file

    target = tmp_path / "target.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    os.symlink(target, link)
    write_text_file(link, "new", overwrite=True)
    assert link.is_symlink() and target.read_text() == "new"


@pytest.mark.parametrize("argv, message", [
    (["show", "RUN", "--text", "goal", "--heads", ","], "--heads ',' names nothing"),
    (["show", "RUN", "--text", "goal", "--layers", "0,x"],
     "--layers '0,x': expected a comma-separated list, e.g. 0,5"),
    (["show", "RUN", "--text", "goal", "--heads", "1,1"], "--heads '1,1' names 1 more than once"),
    (["convert", "RUN", "--mechanism", "dnas", "--layers", "0,0", "--out", "OUT"],
     "--layers '0,0' names 0 more"),
    (["bench", "--lengths", "256,x"], "--lengths '256,x': expected a comma-separated list, e.g. 256,1024"),
])
def test_every_command_parses_its_lists_alike(argv, message, tmp_path, capsys):
    """``show --heads ,`` meant every head and ``--heads 1,1`` drew head 1 twice, where bench refused both."""
    argv = [str(tmp_path / "out") if a == "OUT" else str(tmp_path) if a == "RUN" else a for a in argv]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert capsys.readouterr().err.startswith(f"error: {message}")


@pytest.mark.parametrize("out", ["newdir/", ""])
def test_an_out_that_names_a_folder_is_refused_not_written_as_a_file(out, tmp_path, capsys, monkeypatch):
    """``--out newdir/`` wrote the JSON into a file named ``newdir``."""
    from attnkit.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--quick", "--out", out])
    assert exc.value.code == 2 and "names a folder" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("below", ["x.json", "sub/x.json"])
def test_an_out_below_a_file_names_the_file(below, tmp_path, capsys):
    """``--out afile/x.json`` said "cannot be written (File exists)", which reads as x.json existing."""
    from attnkit.cli import main

    (tmp_path / "afile").write_text("mine")
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--quick", "--out", str(tmp_path / "afile" / below)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"{str(tmp_path / 'afile')!r} is a file, not a directory" in err
    assert (tmp_path / "afile").read_text() == "mine"


def test_an_out_that_is_a_pipe_is_refused_before_the_run(tmp_path, capsys):
    """``--out FIFO --overwrite`` ran the whole benchmark, then refused to write and lost the JSON."""
    import os

    from attnkit.cli import main

    pipe = tmp_path / "fifo"
    os.mkfifo(pipe)
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--quick", "--out", str(pipe), "--overwrite"])
    captured = capsys.readouterr()
    assert exc.value.code == 2 and "not a regular file" in captured.err and "SDPA" not in captured.out


def test_the_footer_of_a_padded_single_sequence_says_its_length(tmp_path, capsys):
    """With --batch 1 the one sequence is (1 - padding) L long; the footer said "from L to 0.5 L"."""
    main(["bench", "--lengths", "16", "--mechanisms", "softmax", "--backends", "efficient", "--repeats", "1",
          "--no-memory", "--batch", "1", "--padding", "0.5", "--out", str(tmp_path / "kernels.json")])
    assert "padded (the one sequence 0.5 L long, SDPA computing all of L)" in capsys.readouterr().out


def _children(pid: int, needle: str) -> list[int]:
    """The pids of the live processes whose parent is ``pid`` and whose command line holds ``needle``."""
    import os

    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and needle in cmdline:
            found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for(predicate, seconds: float) -> bool:
    import time

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self"), reason="reads /proc")
def test_sigterm_to_bench_ends_its_memory_subprocess_and_leaves_no_empty_folder(tmp_path):
    """The memory subprocess ran on with PID 1 as its parent, and the folder made for --out stayed."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "made" / "by-bench" / "k.json"
    bench = subprocess.Popen(
        [sys.executable, "-m", "attnkit.cli", "bench", "--lengths", "64", "--mechanisms", "softmax",
         "--backends", "reference", "--memory", "--repeats", "1", "--heads", "1", "--head-dim", "8",
         "--out", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    try:
        assert _wait_for(lambda: _children(bench.pid, "--peak"), 60), "no memory subprocess started"
        child = _children(bench.pid, "--peak")[0]
        time.sleep(0.5)  # past the child's start
        bench.send_signal(signal.SIGTERM)
        code = bench.wait(timeout=30)
        assert _wait_for(lambda: not _alive(child), 1), "the memory subprocess outlived bench"
        assert not (tmp_path / "made").exists() and code == 128 + signal.SIGTERM
    finally:
        bench.kill()


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self"), reason="reads /proc")
def test_a_memory_subprocess_ends_when_its_parent_is_killed(tmp_path):
    """SIGKILL leaves the parent no handler to run: the kernel ends the subprocess with it."""
    import signal
    import subprocess
    import sys
    import time

    script = (
        "from attnkit.benchmark import BenchConfig, _peak_in_subprocess\n"
        "_peak_in_subprocess('softmax', 'reference', 64, BenchConfig(lengths=(64,), mechanisms=('softmax',), "
        "backends=('reference',), heads=1, head_dim=8, threads=1))\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        assert _wait_for(lambda: _children(parent.pid, "--peak"), 60), "no memory subprocess started"
        child = _children(parent.pid, "--peak")[0]
        time.sleep(0.5)  # past the child's start
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        assert _wait_for(lambda: not _alive(child), 2), "the memory subprocess outlived its parent"
    finally:
        parent.kill()
