"""Aggregation over seeds, step-time ratios, the batch order, and the results table formatting."""

from __future__ import annotations

import statistics

import pytest
import torch

from attnkit.runner.compare import aggregate
from attnkit.runner.report import format_value
from attnkit.runner.tasks import macro_f1
from attnkit.runner.train import batch_indices


def _run(mech, seed, acc, time_s, u=None, ea=1.0):
    return {
        "mechanism": mech,
        "seed": seed,
        "metrics": {"accuracy": acc},
        "step_time_s": time_s,
        "hybrid_u": u,
        "explain_away": {"min": ea / 10, "min_normalized": ea, "fraction_below_eps": 0.0, "calls": 1},
    }


def test_mean_std_over_seeds_and_time_relative_to_softmax():
    runs = [
        _run("softmax", 0, 0.80, 0.10),
        _run("softmax", 1, 0.90, 0.30),
        _run("hnas", 0, 0.70, 0.40, [[0.2, 0.4]], ea=2.0),
        _run("hnas", 1, 0.75, 0.40, [[0.4, 0.6]], ea=1.5),
    ]
    soft, hnas = aggregate(runs, ("softmax", "hnas"))
    assert soft["accuracy_mean"] == pytest.approx(0.85)
    assert soft["accuracy_std"] == pytest.approx(statistics.stdev([0.8, 0.9]))
    assert soft["step_time_rel"] == pytest.approx(1.0)
    assert hnas["step_time_rel"] == pytest.approx(0.40 / 0.20)
    assert hnas["hybrid_u"] == [pytest.approx([0.3, 0.5])]
    assert hnas["hybrid_u_mean"] == pytest.approx(0.4)
    assert hnas["explain_away_min_normalized"] == 1.5 and soft["hybrid_u"] is None


def test_step_time_ratio_uses_each_runs_median_step():
    """One slow step (a pause) moves a run's mean but not the ratio; runs without recorded steps use the
    mean."""
    steps = {"min": 0.1, "median": 0.1, "max": 5.0}
    slow = {**_run("softmax", 0, 0.8, (9 * 0.1 + 5.0) / 10), "step_times_s": steps}
    dnas = {**_run("dnas", 0, 0.8, 0.12), "step_times_s": {"min": 0.11, "median": 0.12, "max": 0.13}}
    soft, other = aggregate([slow, dnas], ("softmax", "dnas"))
    assert other["step_time_rel"] == pytest.approx(1.2)  # 0.12 / 0.10, not 0.12 / 0.59
    assert soft["step_time_s"] == pytest.approx(0.59) and soft["step_time_median_s"] == pytest.approx(0.1)
    legacy = aggregate([_run("softmax", 0, 0.8, 0.2), dnas], ("softmax", "dnas"))
    assert legacy[1]["step_time_rel"] == pytest.approx(0.6)


def test_step_time_ratio_is_the_median_over_seeds_as_in_the_summary_timing():
    """One slow run among three seeds moves neither the results table's ratio nor the summary's timing, and
    the two give the same number."""
    from attnkit.runner.summary import _timing

    def run(mech, seed, median):
        steps = {"min": median, "median": median, "max": median}
        return {**_run(mech, seed, 0.8, median), "step_times_s": steps}

    runs = [run("softmax", 0, 0.10), run("softmax", 1, 0.11), run("softmax", 2, 0.90),
            run("dnas", 0, 0.12), run("dnas", 1, 0.12), run("dnas", 2, 0.13)]
    soft, dnas = aggregate(runs, ("softmax", "dnas"))
    assert soft["step_time_median_s"] == pytest.approx(0.11)
    assert dnas["step_time_rel"] == pytest.approx(0.12 / 0.11)
    timing = _timing(runs, ("softmax", "dnas"), "softmax")
    assert timing["dnas"]["median_rel"] == pytest.approx(dnas["step_time_rel"])


def test_first_mechanism_is_the_baseline_without_softmax():
    records = aggregate([_run("dnas", 0, 0.5, 0.2), _run("coda", 0, 0.6, 0.1)], ("dnas", "coda"))
    assert [r["step_time_baseline"] for r in records] == ["dnas", "dnas"]
    assert records[1]["step_time_rel"] == pytest.approx(0.5)
    assert records[0]["accuracy_std"] is None  # one seed: no spread to report


def test_batch_order_is_a_permutation_per_epoch_and_depends_on_the_seed():
    n, b = 20, 6  # 3 full batches per epoch, 2 examples dropped
    epoch = torch.cat([batch_indices(s, n, b, seed=0) for s in range(3)])
    assert len(set(epoch.tolist())) == 18
    assert torch.equal(batch_indices(4, n, b, seed=0), batch_indices(4, n, b, seed=0))
    assert not torch.equal(batch_indices(0, n, b, seed=0), batch_indices(0, n, b, seed=1))
    assert not torch.equal(
        batch_indices(0, n, b, seed=0), batch_indices(3, n, b, seed=0)
    )  # a new epoch reshuffles


def test_batch_larger_than_the_training_set_is_rejected():
    with pytest.raises(ValueError, match="batch_size=64 is larger than the training set \\(10 examples\\)"):
        batch_indices(0, 10, 64, seed=0)


def test_macro_f1_known_answer():
    # class 0: tp=1 fp=1 fn=1 -> F1 0.5; class 1: tp=1 fp=1 fn=1 -> 0.5; class 2: tp=1 -> 1.0
    assert macro_f1([0, 0, 1, 1, 2], [0, 1, 1, 0, 2]) == pytest.approx((0.5 + 0.5 + 1.0) / 3)
    # a class only predicted counts with F1 0, as sklearn's f1_score(average='macro'): (2/3 + 1 + 0) / 3
    assert macro_f1([0, 0, 1, 1], [0, 2, 1, 1]) == pytest.approx(5 / 9)


def test_format_value_shows_std_only_with_several_seeds():
    assert format_value(0.843, 0.012, 100.0) == "84.3 ± 1.2"
    assert format_value(0.761, None, 100.0) == "76.1"
    assert format_value(None) == "-"


def _record(mechanism: str, u=None) -> dict:
    return {
        "mechanism": mechanism, "n_seeds": 2, "accuracy_mean": 0.93, "accuracy_std": 0.007,
        "macro_f1_mean": 0.689, "macro_f1_std": 0.013, "step_time_rel": 1.41, "step_time_baseline": "softmax",
        "explain_away_min_normalized": -182.7 if mechanism == "coda" else 3.046,
        "hybrid_u": u, "hybrid_u_mean": None if u is None else 0.485,
    }


def test_terminal_table_fits_80_columns_and_its_legend_explains_the_short_headers():
    from rich.console import Console
    from rich.table import Table

    from attnkit.runner.report import table_legend, table_rows

    records = [
        _record("softmax"),
        _record("hnas", [[0.5, 0.47], [0.49, 0.48]]),
        _record("sinkhorn"),
        _record("coda"),
    ]
    header, rows = table_rows(records, ("accuracy", "macro_f1"), detail=False)
    table = Table()
    for h in header:
        table.add_column(h, no_wrap=h != "mechanism")
    for row in rows:
        table.add_row(*row)
    console = Console(width=80, record=True)
    console.print(table)
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    assert not any("…" in line for line in lines)  # nothing cut off
    legend = table_legend(records)
    assert "softmax's" in legend and "Lemma 1" in legend and "CoDA" in legend
    assert rows[3][5].endswith("*")


def test_report_table_lists_every_hybrid_weight():
    from attnkit.runner.report import table_rows

    header, rows = table_rows([_record("hnas", [[0.5, 0.47], [0.49, 0.48]])], ("accuracy",), detail=True)
    assert header[-1] == "final hybrid u (mean)"
    assert rows[0][-1] == "0.485  [0.50, 0.47; 0.49, 0.48]"


def test_median_step_time_is_the_middle_of_the_steps(tmp_path):
    """The "median" step time was the upper middle value: with two steps it equalled the slower one."""
    from attnkit.runner import build_config, run_compare
    from attnkit.runner.train import _spread
    from tests.runner._fixtures import tiny_overrides, write_classification_file

    assert _spread([0.1, 0.3]) == {"min": 0.1, "median": pytest.approx(0.2), "max": 0.3}
    assert _spread([0.4, 0.1, 0.3, 0.2])["median"] == pytest.approx(0.25)
    assert _spread([0.3, 0.1, 0.2])["median"] == 0.2 and _spread([]) is None
    data = write_classification_file(tmp_path / "topics.json")
    result = run_compare(build_config(tiny_overrides(data, tmp_path / "run", mechanisms="softmax", steps=2,
                                                     eval_every=2, checkpoint_every=2)))
    times = result.runs[0]["step_times_s"]
    assert times["min"] < times["max"] and times["median"] == pytest.approx((times["min"] + times["max"]) / 2)
    assert result.records[0]["step_time_median_s"] == pytest.approx(times["median"])
