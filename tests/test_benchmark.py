"""``attnkit.benchmark``: the peers appear as extra rows, each a ratio to SDPA in the same process."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
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


def test_every_ratio_is_the_median_of_interleaved_rounds_against_sdpa(monkeypatch):
    """Rounds of the row and of SDPA alternate (the order flipped every round) and the ratio is the median
    of the per-round ratios; it divided by the mean of an SDPA time taken at the start of the length and
    one taken after the row, all rounds of each in a block."""
    from attnkit import benchmark

    calls = []
    real = benchmark._one_round

    def record(fn, n, device):
        calls.append(fn)
        return real(fn, n, device)

    monkeypatch.setattr(benchmark, "_one_round", record)
    cfg = BenchConfig(lengths=(8,), mechanisms=("dnas",), backends=("efficient",), repeats=4, memory=False)
    rows = run_bench(cfg)["rows"]
    sdpa, row = rows
    assert sdpa["backend"] == "sdpa" and sdpa["fwd_ratio"] == 1.0 and sdpa["sdpa_fwd_s"] == sdpa["fwd_s"]
    forward = calls[:8]  # 4 rounds of each, forward first
    assert forward[0] is forward[3] is forward[4] is forward[7] and forward[1] is forward[2] is forward[5]
    assert forward[0] is not forward[1]
    for mode in ("fwd", "fwd_bwd"):
        ratios = row[f"{mode}_ratio_spread"]
        assert ratios["rounds"] == 4 and ratios["min"] <= row[f"{mode}_ratio"] <= ratios["max"]
        assert row[f"{mode}_ratio"] == ratios["median"]
        assert row[f"sdpa_{mode}_s"] == row[f"sdpa_{mode}_spread_s"]["median"]


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


def test_the_memory_subprocess_does_not_import_from_the_current_folder(tmp_path, monkeypatch):
    """Started with ``python -c``, the child put the current folder first on its import path: a random.py
    there ran in every row's child and failed its measurement."""
    (tmp_path / "random.py").write_text("raise SystemExit('a random.py of the current folder ran')\n")
    monkeypatch.chdir(tmp_path)
    cfg = BenchConfig(lengths=(16,), mechanisms=("softmax",), backends=("reference",), repeats=1, memory=True,
                      batch=1, heads=1, head_dim=4, threads=1)
    row = run_bench(cfg)["rows"][0]
    assert "memory_error" not in row and row["peak_extra_mb"] is not None


@pytest.mark.parametrize("field", ["batch", "heads", "head_dim", "threads"])
def test_shape_and_threads_must_be_positive(field):
    with pytest.raises(ValueError, match=f"{field}=0"):
        BenchConfig(**{field: 0})


def test_valid_lengths_fall_evenly_from_L_to_the_padded_length():
    assert benchmark.valid_lengths(100, 1, 0.25) == [75]
    assert benchmark.valid_lengths(100, 5, 0.5) == [100, 88, 75, 62, 50]
    assert benchmark.valid_lengths(4, 3, 0.99) == [4, 2, 1]  # never below one token
    assert benchmark.valid_lengths(64, 4, 0.0) == [64] * 4


@pytest.mark.parametrize("field,value", [("dropout", 1.0), ("padding", -0.1), ("dropout", True)])
def test_dropout_and_padding_must_be_in_zero_one(field, value):
    with pytest.raises(ValueError, match=rf"{field}={value!r}; expected a number in \[0, 1\)"):
        BenchConfig(**{field: value})


def test_dropout_and_padding_reach_every_call_and_the_memory_subprocess(monkeypatch):
    """SDPA gets the dropout and a key mask of the valid lengths, attnkit's calls the dropout and both masks
    (so softmax takes cpp_softmax, DNAS the C++ kernels), the peers are skipped with the reason, and the
    memory subprocess runs the same calls."""
    import torch.nn.functional as F

    from attnkit.kernels import cpu_ext

    if not cpu_ext.load(warn=False):
        pytest.skip("C++ CPU kernels not built")
    seen = []
    real = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, **kw):
        seen.append((None if attn_mask is None else attn_mask.sum(-1).flatten().tolist(), dropout_p))
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, **kw)

    monkeypatch.setattr(benchmark.F, "scaled_dot_product_attention", sdpa)
    cfg = BenchConfig(lengths=(16,), mechanisms=("softmax", "dnas"), backends=("efficient", "naive"),
                      repeats=1, memory=True, batch=3, heads=2, head_dim=8, dropout=0.2, padding=0.5)
    result = run_bench(cfg)
    assert seen and all(s == ([16, 12, 8], 0.2) for s in seen)
    rows = {(r["mechanism"], r["backend"]): r for r in result["rows"]}
    assert rows[("softmax", "efficient")]["route"] == "cpp_softmax"
    assert rows[("dnas", "efficient")]["route"] == "cpp"
    assert rows[("dnas", "naive")]["skipped"] == "the peers take no dropout=0.2 or padding=0.5"
    for key in (("softmax", "sdpa"), ("softmax", "efficient"), ("dnas", "efficient")):
        assert "memory_error" not in rows[key] and rows[key]["peak_extra_mb"] is not None, rows[key]
    assert result["meta"]["valid_lengths"] == {16: [16, 12, 8]}


def test_a_backend_that_cannot_apply_the_dropout_gets_a_skipped_row(monkeypatch):
    """Without the C++ kernels DNAS' efficient route (the ATen op) cannot replay dropout: the row says why."""
    from attnkit.kernels import cpu_ext

    monkeypatch.setattr(cpu_ext, "_state", {"loaded": True, "ok": False, "error": "off in this test"})
    cfg = BenchConfig(lengths=(16,), mechanisms=("dnas",), backends=("efficient",), repeats=1, memory=False,
                      dropout=0.1)
    row = next(r for r in run_bench(cfg)["rows"] if r["backend"] == "efficient")
    assert "dropout_p=0.1 is not supported by backend='efficient'" in row["skipped"]


def test_a_peer_that_fails_costs_its_row_and_the_bench_goes_on(monkeypatch):
    """A peer breaking at run time (seen: torch.compile's recompilation of FlexAttention's score_mod on one
    torch version) leaves a row that says why; the other rows are timed."""
    from attnkit.kernels import naive_peer

    def broken(mechanism, *args, **kwargs):
        def call(q, k, v):
            raise AttributeError("'NoneType' object has no attribute '__closure__'\nmore lines")
        return call

    monkeypatch.setattr(naive_peer, "naive_call", broken)
    cfg = BenchConfig(lengths=(8,), mechanisms=("dnas", "hnas"), backends=("efficient", "naive"), repeats=1,
                      memory=False)
    rows = run_bench(cfg)["rows"]
    naive = [r for r in rows if r["backend"] == "naive"]
    assert len(naive) == 2
    assert all(r["skipped"] == "failed: AttributeError: 'NoneType' object has no attribute '__closure__'"
               for r in naive)
    assert all(r["fwd_ratio"] > 0 for r in rows if r["backend"] == "efficient")


def test_a_failing_attnkit_backend_is_not_hidden(monkeypatch):
    from attnkit import functional

    def broken(*args, **kwargs):
        raise RuntimeError("kernel bug")

    monkeypatch.setattr(functional, "attention", broken)
    cfg = BenchConfig(lengths=(8,), mechanisms=("dnas",), backends=("efficient",), repeats=1, memory=False)
    with pytest.raises(RuntimeError, match="kernel bug"):
        run_bench(cfg)


def test_a_peer_failing_without_a_message_is_named_by_its_type(monkeypatch):
    from attnkit.kernels import naive_peer

    def broken(mechanism, *args, **kwargs):
        def call(q, k, v):
            raise AssertionError()
        return call

    monkeypatch.setattr(naive_peer, "naive_call", broken)
    cfg = BenchConfig(lengths=(8,), mechanisms=("dnas",), backends=("efficient", "naive"), repeats=1,
                      memory=False)
    rows = run_bench(cfg)["rows"]
    assert [r["skipped"] for r in rows if r["backend"] == "naive"] == ["failed: AssertionError"]


def test_cuda_rounds_are_calibrated_after_a_warm_up_call(monkeypatch):
    """CUDA rounds time back-to-back calls: the number per round comes from warm calls, not from the first
    one (which compiles kernels), so a 0.2 ms call is timed in rounds of many calls."""
    clock = [0.0]

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = clock[0]

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3  # milliseconds, as torch.cuda.Event

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls = []

    def fn():
        clock[0] += 1.0 if not calls else 2e-4  # the first call compiles
        calls.append(1)

    times = benchmark._round_times(fn, 3, "cuda", limit=60.0)
    assert len(times) == 3 and all(t == pytest.approx(2e-4) for t in times)
    assert len(calls) > 3 * int(benchmark.CUDA_ROUND_S / 2e-4) // 2  # many calls per round, not one


@pytest.mark.parametrize("L", [1, 2, 4, 7, 8, 9])
@pytest.mark.parametrize("batch,padding", [(1, 0.0), (1, 0.5), (3, 0.5)])
def test_memory_warm_up_fits_every_length_and_pads_where_the_measured_call_does(L, batch, padding,
                                                                               monkeypatch):
    """The warm-up before the baseline runs on the first min(L, 8) positions, with a mask of that many
    columns that pads (has a False) exactly where the measured call's mask does: a length below 8 once
    gave a warm-up mask of 8 columns for q of L rows, and the bench no memory figure."""
    masks = []
    call = benchmark._call

    def spy(mechanism, backend, sinkhorn_iters, dropout=0.0, mask=None):
        masks.append(mask)
        return call(mechanism, backend, sinkhorn_iters, dropout, mask)

    monkeypatch.setattr(benchmark, "_call", spy)
    for backend in ("efficient", "reference", "sdpa"):
        masks.clear()
        peak = benchmark.measure_peak("dnas", backend, L, "cpu", 3, shape=(batch, 2, 8), padding=padding)
        assert peak["peak_extra_mb"] >= 0.0
        measured, small = masks
        if padding == 0.0:
            assert measured is None and small is None
        else:
            assert tuple(small.shape) == (batch, min(L, 8))
            assert bool(small.all()) == bool(measured.all())
            assert bool(small[:, 0].all())  # no sequence without a token


def test_a_ratio_is_the_median_of_the_same_rounds_row_over_sdpa_times(monkeypatch):
    """Known answer from scripted round times (the ratio inverted, or rounds paired with another round's
    SDPA time, passed every test). Even rounds time the row first, odd ones SDPA first."""
    row, sdpa = [2.0, 9.0, 4.0, 1.0, 6.0], [1.0, 3.0, 1.0, 1.0, 2.0]  # per round 2, 3, 4, 1, 3: median 3
    seq = [t for r in range(5) for t in ((row[r], sdpa[r]) if r % 2 == 0 else (sdpa[r], row[r]))]
    calls = iter(range(10**6))

    def scripted(fn, n, device):
        fn()
        return seq[next(calls) % len(seq)]

    monkeypatch.setattr(benchmark, "_one_round", scripted)
    cfg = BenchConfig(lengths=(8,), mechanisms=("dnas",), backends=("efficient",), repeats=5, memory=False)
    result = run_bench(cfg)["rows"][1]
    for mode in ("fwd", "fwd_bwd"):
        assert result[f"{mode}_ratio"] == 3.0, mode
        assert (result[f"{mode}_ratio_spread"]["min"], result[f"{mode}_ratio_spread"]["max"]) == (1.0, 4.0)
        # the rounds are in the JSON: the ratios recomputed from its times
        assert result[f"{mode}_spread_s"]["times_s"] == row
        assert result[f"sdpa_{mode}_spread_s"]["times_s"] == sdpa
        assert result[f"{mode}_ratio_spread"]["per_round"] == [a / b for a, b in zip(row, sdpa)]


def test_forward_rounds_run_without_grad_and_backward_rounds_fill_every_input_gradient(monkeypatch):
    """The 'fwd' rows timed with autograd on, or fwd+bwd rows without their backward, passed every test."""
    seen, rounds = [], []
    real_call, real_round = benchmark._call, benchmark._one_round

    def spy_call(mechanism, backend, *args, **kwargs):
        f = real_call(mechanism, backend, *args, **kwargs)

        def call(q, k, v):
            seen.append((torch.is_grad_enabled(), (q, k, v)))
            return f(q, k, v)
        return call

    def checked_round(fn, n, device):
        for x in seen[-1][1] if seen else ():
            x.grad = None
        t = real_round(fn, n, device)
        grad_on, qkv = seen[-1]
        rounds.append((grad_on, [x.grad is not None for x in qkv]))
        return t

    monkeypatch.setattr(benchmark, "_call", spy_call)
    monkeypatch.setattr(benchmark, "_one_round", checked_round)
    cfg = BenchConfig(lengths=(8,), mechanisms=("dnas",), backends=("efficient",), repeats=2, memory=False)
    run_bench(cfg)
    forward, backward = rounds[:4], rounds[4:8]  # 2 rounds x (row, SDPA), the forward ones first
    assert all(not grad_on for grad_on, _ in forward), forward
    assert all(grad_on and all(has) for grad_on, has in backward), backward


def test_the_timed_call_computes_its_rows_mechanism_with_both_padding_masks():
    """Sinkhorn's --sinkhorn-iters ignored (always 3), or the query mask dropped (padded queries entering
    DNAS's column sums), passed every test."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 12, 8) for _ in range(3))
    mask = benchmark._mask(12, 2, 0.5, "cpu")
    real = mask[:, None, :, None]
    got = benchmark._call("sinkhorn", "efficient", 7, 0.0, mask)(q, k, v)
    want = ak.attention(q, k, v, ak.Sinkhorn(iters=7), key_mask=mask, query_mask=mask, backend="reference")
    torch.testing.assert_close(got * real, want * real, atol=1e-5, rtol=0)
    three = ak.attention(q, k, v, ak.Sinkhorn(iters=3), key_mask=mask, query_mask=mask, backend="reference")
    assert not torch.allclose(three * real, want * real, atol=1e-4)
    got = benchmark._call("dnas", "efficient", 3, 0.0, mask)(q, k, v)
    want = ak.attention(q, k, v, "dnas", key_mask=mask, query_mask=mask, backend="reference")
    keys_only = ak.attention(q, k, v, "dnas", key_mask=mask, backend="reference")
    torch.testing.assert_close(got * real, want * real, atol=1e-5, rtol=0)
    assert not torch.allclose(keys_only * real, want * real, atol=1e-4)


def test_the_table_states_sinkhorns_k_and_hnass_u():
    """A table of a --sinkhorn-iters 7 run read like the README's k=3 rows: it stated neither k nor u."""
    cfg = BenchConfig(lengths=(8,), mechanisms=("hnas", "sinkhorn"), backends=("efficient",), repeats=1,
                      memory=False, sinkhorn_iters=7)
    result = run_bench(cfg)
    assert (result["meta"]["sinkhorn_iters"], result["meta"]["hnas_u"]) == (7, 0.5)
    assert ", sinkhorn k=7, hnas u=0.5, " in format_table(result)
    dnas = run_bench(BenchConfig(lengths=(8,), mechanisms=("dnas",), backends=("efficient",), repeats=1,
                                 memory=False))
    assert "k=" not in format_table(dnas) and "u=" not in format_table(dnas)
