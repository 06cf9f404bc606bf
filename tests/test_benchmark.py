"""``attnkit.benchmark``: the peers appear as extra rows, each a ratio to SDPA in the same process."""

from __future__ import annotations

import pytest

from attnkit import benchmark
from attnkit.benchmark import BenchConfig, default_backends, format_table, run_bench
from attnkit.kernels.xtransformers_peer import xtransformers_available


def test_peer_rows_for_the_mechanisms_they_implement():
    backends = default_backends("cpu")
    assert backends[:3] == ("reference", "efficient", "naive")
    assert ("xtransformers" in backends) == xtransformers_available()
    cfg = BenchConfig(lengths=(8,), mechanisms=("dnas", "hnas", "sinkhorn", "coda"), backends=backends,
                      repeats=1, memory=False)
    result = run_bench(cfg)
    pairs = {(r["mechanism"], r["backend"]) for r in result["rows"]}
    assert {("dnas", "naive"), ("hnas", "naive"), ("sinkhorn", "naive")} <= pairs
    assert ("coda", "naive") not in pairs and ("coda", "efficient") in pairs
    if xtransformers_available():
        assert {p for p in pairs if p[1] == "xtransformers"} == {("dnas", "xtransformers")}
    for r in result["rows"]:
        if r["backend"] in ("naive", "xtransformers"):
            assert r["route"] == r["backend"]
            assert r["fwd_ratio"] > 0 and r["fwd_bwd_ratio"] > 0
    table = format_table(result)
    assert "naive" in table and ("xtransformers" in table) == xtransformers_available()


def test_materializing_peers_skip_above_max_reference_length():
    cfg = BenchConfig(lengths=(16,), mechanisms=("dnas",), backends=("efficient", "naive"), repeats=1,
                      memory=False, max_reference_length=8)
    result = run_bench(cfg)
    rows = {r["backend"]: r for r in result["rows"]}
    assert "max_reference_length" in rows["naive"]["skipped"] and "skipped" not in rows["efficient"]
    lines = format_table(result).splitlines()
    naive = next(line for line in lines if " naive " in line)
    assert "skipped (1)" in naive and "sdpa" not in naive  # the reason, not a route that never ran
    assert "(1) L > max_reference_length=8" in lines
    widths = {len(line) for line in lines[:2]} | {len(naive)}
    assert len(widths) == 1  # a skipped row keeps the columns aligned


def test_xtransformers_backend_needs_the_package(monkeypatch):
    monkeypatch.setattr(benchmark, "_xtransformers_available", lambda: False)
    assert "xtransformers" not in default_backends("cpu")
    with pytest.raises(ValueError, match=r"attnkit\[bench\]"):
        BenchConfig(backends=("xtransformers",))


def test_shape_and_threads_are_configurable_and_reach_the_memory_subprocess():
    import torch

    threads = torch.get_num_threads()
    cfg = BenchConfig(lengths=(16,), mechanisms=("dnas",), backends=("efficient",), repeats=1, memory=True,
                      batch=2, heads=3, head_dim=8, threads=1)
    result = run_bench(cfg)
    assert torch.get_num_threads() == threads  # restored
    meta = result["meta"]
    assert (meta["B"], meta["H"], meta["D"], meta["threads"]) == (2, 3, 8, 1)
    for row in result["rows"]:
        assert "memory_error" not in row and row["peak_extra_mb"] is not None
    assert "B=2 H=3 D=8 float32, 1 thread;" in format_table(result)


@pytest.mark.parametrize("field", ["batch", "heads", "head_dim", "threads"])
def test_shape_and_threads_must_be_positive(field):
    with pytest.raises(ValueError, match=f"{field}=0"):
        BenchConfig(**{field: 0})
