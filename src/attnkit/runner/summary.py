"""What ``attnkit compare`` says beyond the results table: progress lines, environment, per-class scores,
paired comparisons against the baseline, timing spread, mechanisms not run, and sample predictions that
differ between mechanisms. ``summarize`` gathers them for ``results.json`` and ``report.html``.
"""

from __future__ import annotations

import statistics
import time
from typing import Optional

from ..registry import MECHANISMS, resolve_mechanism
from .config import CompareConfig
from .stats import environment, load_note, mcnemar, paired_seed_interval, verdict

__all__ = [
    "RunClock", "summarize", "diverse_samples", "skipped_mechanisms", "tracker_config", "cpp_kernels",
]


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class RunClock:
    """Elapsed time and an estimate of the time left, from the runs trained so far."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.started = time.time()
        self.seconds = 0.0  # spent training the runs added
        self.runs = 0.0  # how many whole runs that was: a run resumed from a checkpoint counts its share

    def add(self, seconds: float, share: float = 1.0) -> None:
        """A run trained in ``seconds``; ``share``: the part of its steps this process trained (resumed)."""
        self.seconds += seconds
        self.runs += share

    def line(self, k: int, mechanism: str, seed: int, finished: bool) -> str:
        head = f"run {k} of {self.total}: {mechanism} seed {seed}"
        if finished:
            return f"{head}: finished earlier, kept (--resume)"
        elapsed = _duration(time.time() - self.started)
        if self.runs <= 0:
            return f"{head} (elapsed {elapsed}; time left estimated after the first run)"
        left = self.seconds / self.runs * (self.total - k + 1)
        return f"{head} (elapsed {elapsed}; about {_duration(left)} left)"


def tracker_config(config: CompareConfig) -> dict:
    """The configuration as the scalar hyperparameters trackers accept (lists and None as text)."""
    return {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in config.to_dict().items()}


def skipped_mechanisms(config: CompareConfig, task) -> dict:
    """``{mechanism: why it was not run}`` for every mechanism of ``attnkit.MECHANISMS`` not compared (for a
    transduction task: every model of ``runner.transduction.MODELS``, its compared "mechanisms")."""
    if task.kind == "transduction":
        from .transduction import MODELS

        return {name: "not in mechanisms (add it with --mechanisms)" for name in MODELS
                if name not in config.mechanisms}
    reasons = {}
    for name in MECHANISMS:
        if name in config.mechanisms:
            continue
        why = "not in mechanisms (add it with --mechanisms)"
        if task.kind == "seq2seq" and resolve_mechanism(name).query_normalized:
            why = ("normalizes over queries, so it could replace only the encoder attention (the decoder "
                   "would leak future tokens and stays softmax); the seq2seq presets compare the CoDA "
                   "Transformer with softmax everywhere. Add it with --mechanisms to compare encoders")
        reasons[name] = why
    return reasons


def diverse_samples(task, data, runs: list[dict], mechanisms: tuple[str, ...], limit: int = 12) -> dict:
    """Evaluation examples on which the mechanisms' predictions differ (first seed of each), no repeats.

    Examples some mechanisms got right and others wrong come first (more distinct predictions first), then
    disagreements where all are wrong; when fewer than ``limit`` differ, examples every mechanism got wrong
    fill the table. Returns ``{"header", "rows", "differing"}``.
    """
    first = {}
    for r in runs:
        if r["mechanism"] not in first and r.get("predictions") is not None:
            first[r["mechanism"]] = r
    mechs = [m for m in mechanisms if m in first]
    if not mechs:
        return {"header": [], "rows": [], "differing": 0}
    correct = {m: task.correct(data, first[m]["predictions"]) for m in mechs}
    n = len(first[mechs[0]]["predictions"])
    candidates = []
    for i in range(n):
        shown = [task.show_prediction(data, first[m]["predictions"][i]) for m in mechs]
        distinct = len(set(shown))
        wrong = sum(1 for m in mechs if not correct[m][i])
        if distinct > 1 or wrong == len(mechs):
            mixed = 0 < wrong < len(mechs)  # some mechanism right, another wrong: the most telling rows
            candidates.append((-mixed, -(distinct > 1), -distinct, i, shown))
    candidates.sort()
    seen, rows = set(), []
    differing = sum(1 for c in candidates if c[1] == -1)
    for _, _, _, i, shown in candidates:
        example = task.example(data, i)
        key = tuple(example.values())
        if key in seen:
            continue
        seen.add(key)
        marks = [("✓ " if correct[m][i] else "✗ ") + p for m, p in zip(mechs, shown)]
        rows.append([*example.values(), *marks])
        if len(rows) == limit:
            break
    header = [*task.example(data, 0).keys(), *[f"{m} (seed {first[m]['seed']})" for m in mechs]]
    return {"header": header, "rows": rows, "differing": differing}


def _per_class(runs: list[dict], mechanisms: tuple[str, ...]) -> dict:
    """Per mechanism: precision/recall/F1 per class (mean over seeds) and the confusion matrix summed over
    seeds."""
    out = {}
    for mech in mechanisms:
        group = [r for r in runs if r["mechanism"] == mech and r.get("classes")]
        if not group:
            continue
        classes = []
        for c, first in enumerate(group[0]["classes"]):
            entry = {"name": first["name"], "support": first["support"]}
            for key in ("precision", "recall", "f1"):
                entry[key] = statistics.fmean(r["classes"][c][key] for r in group)
            classes.append(entry)
        k = len(classes)
        confusion = [[sum(r["confusion"][i][j] for r in group) for j in range(k)] for i in range(k)]
        out[mech] = {"classes": classes, "confusion": confusion, "seeds": len(group)}
    return out


def _comparisons(task, data, runs: list[dict], config: CompareConfig, baseline: str) -> list[dict]:
    metric = task.metric_names[0]
    by = {(r["mechanism"], r["seed"]): r for r in runs}
    out = []
    for mech in config.variants:
        if mech == baseline:
            continue
        seeds = [s for s in config.seed_list if (mech, s) in by and (baseline, s) in by]
        interval = paired_seed_interval([by[mech, s]["metrics"][metric] for s in seeds],
                                        [by[baseline, s]["metrics"][metric] for s in seeds])
        test = None
        if seeds and all(by[m, s].get("predictions") is not None for s in seeds for m in (mech, baseline)):
            a = [x for s in seeds for x in task.correct(data, by[mech, s]["predictions"])]
            b = [x for s in seeds for x in task.correct(data, by[baseline, s]["predictions"])]
            test = mcnemar(a, b)
        out.append({"mechanism": mech, "baseline": baseline, "metric": metric, "seeds": seeds,
                    "difference": interval, "mcnemar": test,
                    "text": verdict(mech, baseline, metric.replace("_", " "), interval, test)})
    return out


def _timing(runs: list[dict], mechanisms: tuple[str, ...], baseline: str) -> dict:
    """Per mechanism: ms per step (median over seeds of each run's median; min and max over every step)."""
    out = {}
    medians = {}
    for mech in mechanisms:
        spreads = [r["step_times_s"] for r in runs if r["mechanism"] == mech and r.get("step_times_s")]
        if not spreads:
            continue
        medians[mech] = statistics.median(s["median"] for s in spreads)
        out[mech] = {"median_ms": 1000 * medians[mech], "min_ms": 1000 * min(s["min"] for s in spreads),
                     "max_ms": 1000 * max(s["max"] for s in spreads)}
    if baseline in medians:
        for mech, entry in out.items():
            entry["median_rel"] = medians[mech] / medians[baseline]
    return out


def cpp_kernels() -> tuple[Optional[bool], Optional[str]]:
    """Whether this process ran the C++ CPU kernels (``attnkit.kernels.cpu_ext``): ``(True, None)``,
    ``(False, why)`` for the pure-PyTorch fallback (``ATTNKIT_NO_CPP=1``, no compiler, ...), or
    ``(None, None)`` when nothing here called them (on a GPU, or no mechanism that has them). Step times
    depend on it. Nothing is built or loaded here."""
    import torch

    from ..kernels import cpu_ext

    error = cpu_ext.load_error()
    if error is not None:
        return False, error
    try:
        torch.ops.attnkit_cpu.potentials_forward  # noqa: B018  (raises unless the library is loaded)
    except (AttributeError, RuntimeError):
        return None, None
    return True, None


def _kernels_note(runs: list[dict]) -> Optional[str]:
    """A sentence when some runs had the C++ kernels and others the PyTorch fallback (a --resume in another
    environment), else ``None``."""
    used = {r.get("cpp_kernels") for r in runs} - {None}
    if len(used) < 2:
        return None
    fallback = [f"{r['mechanism']} seed {r['seed']}" for r in runs if r.get("cpp_kernels") is False]
    return (f"The runs mix the C++ CPU kernels and their PyTorch fallback ({', '.join(fallback)} ran the "
            "fallback, after a --resume in another environment): their step times are not comparable; rerun "
            "with --overwrite in one environment for timings.")


def runs_load_max(runs: list[dict]) -> Optional[float]:
    """The largest load average any run saw (runs resumed from an older results file may have none), or
    ``None``: the load of the whole comparison, not of its last run."""
    loads = [r["load_average_max"] for r in runs if r.get("load_average_max") is not None]
    return max(loads) if loads else None


def summarize(task, data, config: CompareConfig, runs: list[dict], records: list[dict],
              started: Optional[float] = None) -> dict:
    """Everything ``results.json`` and ``report.html`` say besides the aggregated records."""
    import os

    baseline = records[0]["step_time_baseline"] if records else config.variants[0]
    load_max = runs_load_max(runs)
    kernels, why = cpp_kernels()
    notes = [note for note in (load_note(load_max, os.cpu_count()), _kernels_note(runs)) if note]
    return {
        # started/finished/wall time are those of this invocation (a --resume run counts only its own part)
        "environment": {
            **environment(started or time.time(), time.time(), load_max), "resumed": config.resume,
            "cpp_kernels": kernels, "cpp_kernels_fallback": why,  # C++ CPU kernels, or why not (None: unused)
        },
        "per_class": _per_class(runs, config.variants),
        "comparisons": _comparisons(task, data, runs, config, baseline),
        "timing": _timing(runs, config.variants, baseline),
        "load_note": " ".join(notes) or None,  # what makes the step times unreliable
        "skipped_mechanisms": skipped_mechanisms(config, task),
        "samples": diverse_samples(task, data, runs, config.variants),
    }
