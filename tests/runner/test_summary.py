"""What ``attnkit compare`` reports beyond mean +- std: progress lines, environment, per-class scores, paired
comparisons in words, timing spread, diverse sample predictions, mechanisms not run, TensorBoard logs."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from attnkit.runner import build_config, run_compare
from attnkit.runner.stats import (
    load_note,
    mcnemar,
    paired_seed_interval,
    per_class,
    t975,
    token_accuracy,
    verdict,
)
from tests.runner._fixtures import tiny_overrides, write_classification_file, write_seq2seq_jsonl


def test_per_class_known_answer():
    result = per_class([0, 0, 1, 1, 2], [0, 1, 1, 1, 0], ["a", "b", "c"])
    assert result["confusion"] == [[1, 1, 0], [0, 2, 0], [1, 0, 0]]
    a, b, c = result["classes"]
    assert (a["precision"], a["recall"], a["f1"], a["support"]) == (0.5, 0.5, 0.5, 2)
    assert b["precision"] == pytest.approx(2 / 3) and b["recall"] == 1.0 and b["f1"] == pytest.approx(0.8)
    assert (c["precision"], c["recall"], c["f1"], c["support"]) == (0.0, 0.0, 0.0, 1)


def test_mcnemar_exact_known_answer():
    # 5 examples only A got right, 0 only B: two-sided p = 2 * (1/2)^5
    result = mcnemar([True] * 5 + [True, False], [False] * 5 + [True, False])
    assert (result["only_a"], result["only_b"]) == (5, 0) and result["p"] == pytest.approx(2 / 32)
    assert mcnemar([True, False], [True, False])["p"] == 1.0


def test_paired_interval_and_verdict():
    interval = paired_seed_interval([0.80, 0.82, 0.81], [0.70, 0.71, 0.72])
    assert interval["mean"] == pytest.approx(0.1) and interval["low"] > 0  # 4.303 * 0.01 / sqrt(3) = 0.025
    assert "larger than the spread over seeds" in verdict("dnas", "softmax", "accuracy", interval, None)
    wide = paired_seed_interval([0.80, 0.70], [0.75, 0.74])
    assert wide["low"] < 0 < wide["high"]
    assert "within the spread over seeds" in verdict(
        "dnas", "softmax", "accuracy", wide, mcnemar([True], [False])
    )
    assert paired_seed_interval([0.8], [0.7])["low"] is None


def test_stats_known_answers_at_their_edges():
    """Mutations that passed every test: McNemar's p above 1 (1.5 for one discordant pair each way), a
    prediction longer than its target scored by the target's positions alone (0.75 -> 1.0), the one-seed
    verdict printing "+0.0 points" for a 10-point difference, the no-shared-seed sentence, and the load note
    at load == cores."""
    assert mcnemar([True, False], [False, True])["p"] == 1.0  # b = c = 1: 2 * 3/4 capped at 1
    assert mcnemar([True] * 3 + [False] * 3, [False] * 3 + [True] * 3)["p"] == 1.0
    assert token_accuracy(["1234"], ["123"]) == pytest.approx(3 / 4)  # the end position is wrong
    one = verdict("dnas", "softmax", "accuracy", paired_seed_interval([0.80], [0.70]), None)
    assert one == "dnas vs softmax: accuracy +10.0 points (one seed: no spread over seeds to compare with)."
    none = verdict("dnas", "softmax", "accuracy", paired_seed_interval([], []), None)
    assert none == "dnas: no seed shared with softmax, no paired comparison."
    assert load_note(2.0, 2) is None and load_note(2.01, 2) is not None


def test_an_interval_that_reaches_zero_as_printed_is_within_the_spread():
    """The printed bounds are what the verdict judges: [+0.0, +1.0] (a low end of +0.04 points, printed as
    +0.0) says "within", as does an interval that ends exactly at 0; one wholly above 0.05 points does not."""
    for low in (0.0, 0.0004, -0.0004):
        interval = {"n": 3, "mean": 0.005, "low": low, "high": 0.01}
        text = verdict("dnas", "softmax", "accuracy", interval, None)
        assert "[+0.0, +1.0]: within the spread over seeds" in text, low
    above = {"n": 3, "mean": 0.005, "low": 0.0006, "high": 0.01}
    assert "[+0.1, +1.0]: larger than the spread" in verdict("dnas", "softmax", "accuracy", above, None)
    below = {"n": 3, "mean": -0.005, "low": -0.01, "high": 0.0}
    assert "[-1.0, +0.0]: within the spread over seeds" in verdict("dnas", "softmax", "accuracy", below, None)


def test_paired_interval_known_answer_with_students_t():
    """The half-width is t_{0.975, n-1} * sample std / sqrt(n) (mutating the quantile's index, the std's
    denominator or sqrt(n) passed the test above)."""
    interval = paired_seed_interval([0.80, 0.83, 0.81], [0.70, 0.71, 0.72])  # diffs 0.10, 0.12, 0.09
    half = 4.303 * statistics.stdev([0.10, 0.12, 0.09]) / math.sqrt(3)  # 0.0379
    assert interval["mean"] == pytest.approx(0.31 / 3)
    assert (interval["low"], interval["high"]) == pytest.approx((0.31 / 3 - half, 0.31 / 3 + half))
    diffs = [0.01 * (i % 7) for i in range(41)]  # 41 seeds: df 40 is past the table
    wide = paired_seed_interval([0.5 + d for d in diffs], [0.5] * 41)
    half = 2.021075 * statistics.stdev(diffs) / math.sqrt(41)
    assert wide["high"] - wide["mean"] == pytest.approx(half, rel=1e-6)


def test_students_t_quantiles_match_the_published_values():
    # t_{0.975, df}: df 1-30 from the table, 40, 60 and 120 as printed in t tables, then the normal's
    expected = {1: 12.706, 5: 2.571, 30: 2.042, 31: 2.0395, 40: 2.0211, 60: 2.0003, 120: 1.9799, 10**6: 1.96}
    for df, value in expected.items():
        assert t975(df) == pytest.approx(value, abs=1e-3), df
    for df in (0, -1, 2.0, True):  # T975[-2] would read the table from its end
        with pytest.raises(ValueError, match="expected an integer >= 1"):
            t975(df)


def test_token_accuracy_counts_positions_and_the_end():
    assert token_accuracy(["123"], ["123"]) == 1.0
    assert token_accuracy(["124"], ["123"]) == pytest.approx(3 / 4)  # 2 chars + right length
    assert token_accuracy(["12"], ["123"]) == pytest.approx(2 / 4)


def test_load_note_only_when_loaded():
    assert load_note(1.0, 2) is None and "loaded" in load_note(7.5, 2)


@pytest.fixture(scope="module")
def two_seeds(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("summary")
    data = write_classification_file(tmp / "topics.json")
    config = build_config(
        tiny_overrides(data, tmp / "out", seeds=2, mechanisms="softmax,dnas", log_with="tensorboard")
    )
    return run_compare(config)


def test_results_json_has_environment_per_class_and_comparisons(two_seeds):
    payload = json.loads((two_seeds.out / "results.json").read_text())
    env = payload["environment"]
    for key in ("attnkit", "torch", "git_commit", "started", "finished", "wall_time_s", "threads", "cores",
                "load_average_end"):
        assert key in env
    assert env["wall_time_s"] > 0
    dnas = payload["per_class"]["dnas"]
    assert [c["name"] for c in dnas["classes"]] == ["sport", "money", "<b>&tag"]
    assert sum(map(sum, dnas["confusion"])) == 2 * 32  # two seeds x 32 test examples
    (comparison,) = payload["comparisons"]
    assert comparison["mechanism"] == "dnas" and comparison["seeds"] == [0, 1]
    assert "95% interval over 2 paired seeds" in comparison["text"] and "McNemar" in comparison["text"]
    assert set(payload["skipped_mechanisms"]) == {"hnas", "sinkhorn", "coda"}
    assert payload["timing"]["softmax"]["median_rel"] == pytest.approx(1.0)
    for run in payload["runs"]:
        assert len(run["step_losses"]) == 12 and run["step_times_s"]["min"] <= run["step_times_s"]["max"]


def test_report_says_the_comparison_in_words_and_shows_no_duplicate_samples(two_seeds):
    html = (two_seeds.out / "report.html").read_text()
    for needle in ("Are the differences real?", "Per class", "Time per optimizer step", "Mechanisms not run",
                   "Environment", 'id="per-class"', 'alt="confusion_matrices"'):
        assert needle in html
    samples = json.loads((two_seeds.out / "results.json").read_text())["samples"]
    texts = [row[0] for row in samples["rows"]]
    assert len(texts) == len(set(texts))
    assert samples["header"][:2] == ["text", "label"] and len(samples["header"]) == 4
    assert "<script>alert" not in html  # dataset text stays escaped


def test_tensorboard_event_files_are_written(two_seeds):
    events = list((two_seeds.out / "tensorboard").rglob("events.out.tfevents.*"))
    assert events and all(e.stat().st_size > 0 for e in events)


def test_progress_lines_count_runs_and_estimate_time(tmp_path, capsys):
    data = write_classification_file(tmp_path / "topics.json")
    run_compare(build_config(tiny_overrides(data, tmp_path / "out", steps=2, eval_every=2, seeds=2,
                                            mechanisms="softmax")))
    err = capsys.readouterr().err
    assert "run 1 of 2: softmax seed 0 (elapsed" in err and "time left estimated after the first run" in err
    assert "run 2 of 2: softmax seed 1 (elapsed" in err and "left)" in err and "done: 2 runs in" in err


def test_seq2seq_reports_token_accuracy_and_why_mechanisms_were_skipped(tmp_path):
    data = write_seq2seq_jsonl(tmp_path / "rev.jsonl")
    result = run_compare(build_config(tiny_overrides(data, tmp_path / "out", mechanisms="softmax,coda",
                                                     steps=4, eval_every=2, max_target_len=8)))
    payload = json.loads((result.out / "results.json").read_text())
    assert payload["metrics"] == ["sequence_accuracy", "token_accuracy"]
    for record in payload["results"]:
        assert 0.0 <= record["token_accuracy_mean"] <= 1.0
    assert "normalizes over queries" in payload["skipped_mechanisms"]["dnas"]
    assert "token_accuracy" in (result.out / "report.html").read_text()


def test_time_left_scales_a_resumed_run_to_a_whole_one(monkeypatch):
    from attnkit.runner import summary

    clock = summary.RunClock(total=4)
    monkeypatch.setattr(summary.time, "time", lambda: clock.started + 30.0)
    clock.add(10.0, share=0.25)  # a quarter of a run (resumed) in 10 s: a whole run takes about 40 s
    assert clock.line(2, "dnas", 0, finished=False).endswith("(elapsed 30s; about 2m00s left)")  # 3 runs
    clock.add(40.0)
    assert clock.line(3, "dnas", 1, finished=False).endswith("about 1m20s left)")  # 50 s / 1.25 runs x 2


def test_class_labels_with_dollar_signs_are_drawn_as_written(tmp_path, monkeypatch):
    """A label pair of ``$`` was read as math: "$x^$" made compare fail after training (no report.html) and
    "cost $5 to $10" was drawn as "cost 5to10"."""
    from tests.runner._figures import assert_drawn_as_written, record_figures

    labels = ["$x^$", "cost $5 to $10"]
    rows = [{"text": f"goal {i}" if i % 2 else f"vote {i}", "label": labels[i % 2]} for i in range(20)]
    data = tmp_path / "dollar.json"
    data.write_text(json.dumps({"kind": "classification", "train": rows, "test": rows[:6]}))
    figures = record_figures(monkeypatch)
    result = run_compare(build_config(tiny_overrides(data, tmp_path / "run", mechanisms="softmax", steps=2,
                                                     batch_size=4, eval_every=2, checkpoint_every=2)))
    page = result.files["html"].read_text(encoding="utf-8")
    assert 'alt="confusion_matrices"' in page and "cost $5 to $10" in page
    assert_drawn_as_written(figures, labels)


def test_report_heading_wraps_a_long_task_path():
    """The <h1> with a long --task path ran past the right edge of a 400 px window."""
    import re

    from attnkit.runner.report_extras import CSS

    body = re.search(r"body\{([^}]*)\}", CSS).group(1)
    assert "overflow-wrap:break-word" in body and "padding:0 1em" in body and "box-sizing:border-box" in body


def test_confusion_plot_cuts_long_class_names_in_its_ticks(tmp_path, monkeypatch):
    """Names over about 30 characters ran over the caption; the per-class table keeps them whole."""
    import matplotlib.figure

    from attnkit.runner.report_extras import plot_confusions

    ticks = []
    real = matplotlib.figure.Figure.savefig

    def keep(fig, *args, **kwargs):
        ticks.extend(t.get_text() for t in fig.axes[0].get_xticklabels())
        return real(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    long = "a class name far longer than the ticks have room for"
    per_class = {"softmax": {"classes": [{"name": long}, {"name": "short"}], "confusion": [[1, 0], [0, 1]]}}
    assert plot_confusions(tmp_path / "c.png", per_class)
    assert ticks == [long[:23] + "\u2026", "short"]


def test_hybrid_weights_are_plotted_for_aligned_hnas_too(tmp_path):
    """plot_hybrid looked for mechanism == "hnas" only: a run of hnas+ct drew no hybrid_weights.png."""
    from attnkit.runner.report import plot_hybrid

    history = [{"step": s, "hybrid_u": [[0.5, 0.4 + 0.01 * s]]} for s in (3, 6)]
    runs = [{"mechanism": "softmax", "seed": 0, "history": [{"step": 3, "hybrid_u": None}]},
            {"mechanism": "hnas+ct", "seed": 0, "history": history}]
    assert plot_hybrid(tmp_path / "u.png", runs) and (tmp_path / "u.png").stat().st_size > 0
    assert not plot_hybrid(tmp_path / "none.png", runs[:1])


def test_cpp_kernels_says_whether_the_extension_or_the_fallback_ran(monkeypatch):
    """results.json did not say whether the C++ kernels or their PyTorch fallback ran (ATTNKIT_NO_CPP=1, no
    compiler), on which the step-time ratios depend."""
    import attnkit.runner.summary as summary
    from attnkit.kernels import cpu_ext

    monkeypatch.setattr(cpu_ext, "load_error", lambda: "disabled by ATTNKIT_NO_CPP")
    assert summary.cpp_kernels() == (False, "disabled by ATTNKIT_NO_CPP")
    monkeypatch.setattr(cpu_ext, "load_error", lambda: None)
    assert summary.cpp_kernels() in ((True, None), (None, None))
    if cpu_ext.load(warn=False):  # built here: loaded now
        assert summary.cpp_kernels() == (True, None)


class _Stop(Exception):
    pass


def test_a_resume_that_mixes_cpp_kernels_and_fallback_says_so(tmp_path, monkeypatch):
    import attnkit.runner.compare as rc
    import attnkit.runner.summary as summary

    data = write_classification_file(tmp_path / "topics.json")
    values = tiny_overrides(data, tmp_path / "out", mechanisms="softmax,hnas", seeds=1, steps=2, plots=False)
    monkeypatch.setattr(rc, "cpp_kernels", lambda: (True, None))

    def stop_in_hnas(mechanism, seed, step):
        if mechanism == "hnas":
            raise _Stop

    with pytest.raises(_Stop):
        run_compare(build_config(values), on_step=stop_in_hnas)
    fallback = (False, "disabled by ATTNKIT_NO_CPP")
    monkeypatch.setattr(rc, "cpp_kernels", lambda: fallback)  # the resume runs elsewhere
    monkeypatch.setattr(summary, "cpp_kernels", lambda: fallback)
    result = run_compare(build_config({**values, "resume": True}))
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["environment"]["cpp_kernels"] is False
    assert saved["environment"]["cpp_kernels_fallback"] == "disabled by ATTNKIT_NO_CPP"
    assert [r["cpp_kernels"] for r in saved["runs"]] == [True, False]
    assert "mix the C++ CPU kernels and their PyTorch fallback (hnas seed 0" in saved["load_note"]
    assert result.extras["load_note"] == saved["load_note"]


def _hand_runs():
    """Two mechanisms x two seeds with known step times, per-class scores and predictions."""
    runs = []
    for mech, times in (("softmax", {0: (0.010, 0.008, 0.020), 1: (0.012, 0.009, 0.030)}),
                        ("dnas", {0: (0.011, 0.010, 0.015), 1: (0.013, 0.0095, 0.040)})):
        for seed, (med, lo, hi) in times.items():
            runs.append({
                "mechanism": mech, "seed": seed, "step_times_s": {"median": med, "min": lo, "max": hi},
                "classes": [
                    {"name": "a", "support": 2, "precision": 0.5 + 0.25 * seed, "recall": 1.0, "f1": 0.6},
                    {"name": "b", "support": 2, "precision": 1.0, "recall": 0.5, "f1": 0.7 - 0.1 * seed},
                ],
                "confusion": [[2, 0], [1, 1]],
                "metrics": {"accuracy": 0.75 - 0.05 * seed + (0.1 if mech == "dnas" else 0)},
                "predictions": ([0, 1, 1, 0, 1] if mech == "dnas" else [0, 0, 1, 1, 1]) if seed == 0 else
                               ([1, 1, 0, 0, 1] if mech == "dnas" else [0, 1, 0, 1, 1]),
            })
    return runs


def test_summary_numbers_known_answers_on_hand_made_runs():
    """The step-time spread taken from the medians (8 -> 10 ms), per-class scores of one seed (0.625 ->
    0.75), McNemar over the first seed only (3/1 -> 2/0), and the count of examples whose predictions
    differ (2 -> 3) passed every test."""
    from types import SimpleNamespace

    from attnkit.runner import summary

    runs = _hand_runs()
    timing = summary._timing(runs, ("softmax", "dnas"), "softmax")
    softmax, dnas = timing["softmax"], timing["dnas"]
    assert softmax["median_ms"] == pytest.approx(11.0) and softmax["min_ms"] == pytest.approx(8.0)
    assert softmax["max_ms"] == pytest.approx(30.0) and dnas["max_ms"] == pytest.approx(40.0)
    assert dnas["median_rel"] == pytest.approx(12.0 / 11.0)
    per_class = summary._per_class(runs, ("softmax", "dnas"))
    assert per_class["softmax"]["classes"][0]["precision"] == pytest.approx(0.625)
    assert per_class["softmax"]["classes"][1]["f1"] == pytest.approx(0.65)
    assert per_class["softmax"]["confusion"] == [[4, 0], [2, 2]]
    gold = [0, 1, 1, 0, 0]
    task = SimpleNamespace(metric_names=("accuracy",), show_prediction=lambda data, p: str(p),
                           correct=lambda data, preds: [p == g for p, g in zip(preds, gold)],
                           example=lambda data, i: {"text": f"ex{i}", "label": gold[i]})
    config = SimpleNamespace(variants=("softmax", "dnas"), seed_list=[0, 1])
    (comparison,) = summary._comparisons(task, None, runs, config, "softmax")
    # seed 0: dnas alone right on 1 and 3, softmax alone on none; seed 1: dnas alone on 0, softmax on 2
    assert (comparison["mcnemar"]["only_a"], comparison["mcnemar"]["only_b"]) == (3, 1)
    assert comparison["mcnemar"]["p"] == pytest.approx(0.625)
    samples = summary.diverse_samples(task, None, runs, ("softmax", "dnas"))
    assert samples["differing"] == 2  # seed 0's predictions differ on examples 1 and 3 only
    assert [row[0] for row in samples["rows"]][:2] == ["ex1", "ex3"]  # one right, one wrong: first
    same_text = SimpleNamespace(**{**vars(task), "example": lambda data, i: {"text": f"ex{min(i, 1)}",
                                                                              "label": gold[min(i, 1)]}})
    shown = [row[0] for row in summary.diverse_samples(same_text, None, runs, ("softmax", "dnas"))["rows"]]
    assert len(shown) == len(set(shown))  # an example met twice (a duplicated text) is shown once


def test_the_load_recorded_is_the_largest_seen(monkeypatch):
    """results.json's load_average_max took the last run's load (or ignored the load at the end) under
    mutations no test caught."""
    import os

    from attnkit.runner import stats

    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.4, 0.3))
    assert stats.environment(0.0, 1.0, load_max=3.25)["load_average_max"] == 3.25
    assert stats.environment(0.0, 1.0, load_max=0.25)["load_average_max"] == 0.5  # the end's own
    assert stats.environment(0.0, 1.0)["load_average_max"] is None


def test_the_comparisons_load_is_the_largest_any_run_saw():
    """summarize() took the maximum over the runs' loads; taking the last run's (or the first's) passed every
    test."""
    from attnkit.runner import summary

    runs = [{"load_average_max": 1.5}, {"load_average_max": 4.25}, {}, {"load_average_max": None},
            {"load_average_max": 2.0}]
    assert summary.runs_load_max(runs) == 4.25
    assert summary.runs_load_max([{}, {"load_average_max": None}]) is None
    assert summary.runs_load_max([]) is None


def test_summarize_records_the_largest_load_any_run_saw(monkeypatch):
    """summarize() reading the last run's load (not the helper's maximum) passed every test."""
    import os
    from types import SimpleNamespace

    from attnkit.runner import summary

    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.4, 0.3))
    for name in ("_per_class", "_comparisons", "_timing", "skipped_mechanisms", "diverse_samples"):
        monkeypatch.setattr(summary, name, lambda *args, **kwargs: None)
    monkeypatch.setattr(summary, "cpp_kernels", lambda: (True, None))
    runs = [{"load_average_max": 1.5}, {"load_average_max": 4.25}, {"load_average_max": 2.0}]
    config = SimpleNamespace(variants=("softmax",), resume=False)
    result = summary.summarize(None, None, config, runs, [], started=0.0)
    assert result["environment"]["load_average_max"] == 4.25
