"""Statistics of ``attnkit compare`` beyond mean +- std: per-class scores, paired comparisons, environment.

- ``per_class``: precision, recall, F1 and support per class, and the confusion matrix (rows = true class).
- ``paired_seed_interval``: the mean difference of a metric between a mechanism and the baseline over the
  seeds they share (the runs of one seed see the same data order), with a Student-t 95% interval.
- ``mcnemar``: the exact two-sided McNemar test on the evaluation examples (pooled over the shared seeds):
  of the examples exactly one of the two got right, is either side right more often than chance?
- ``verdict``: both said in one sentence.
- ``environment``: versions, git commit, date, threads and load average, for ``results.json``.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import subprocess
from pathlib import Path
from typing import Optional, Sequence

__all__ = [
    "per_class",
    "paired_seed_interval",
    "mcnemar",
    "verdict",
    "environment",
    "load_note",
    "token_accuracy",
    "T975",
    "t975",
]

# Two-sided 95% quantiles of Student's t with df = 1..30 (t_{0.975, df}); larger df: t975().
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)


def t975(df: int) -> float:
    """``t_{0.975, df}``, the two-sided 95% quantile of Student's t with ``df >= 1`` degrees of freedom: the
    table for df <= 30, above it the Cornish-Fisher expansion around the normal quantile (Abramowitz and
    Stegun 26.7.5, four terms; within 3e-8 of the exact value from df = 30 on, where 1.96 was 4% low)."""
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"df={df!r}; expected an integer >= 1 (degrees of freedom: seeds - 1)")
    if df <= len(T975):
        return T975[df - 1]
    z = 1.959963984540054  # the normal distribution's 0.975 quantile
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / df + g2 / df**2 + g3 / df**3 + g4 / df**4


def per_class(labels: Sequence[int], preds: Sequence[int], names: Sequence[str]) -> dict:
    """``{"classes": [{name, precision, recall, f1, support}], "confusion": [[...]]}``
    (rows: true, cols: predicted).

    A class never predicted has precision 0 (and F1 0); a class absent from ``labels`` has support 0.
    """
    k = len(names)
    confusion = [[0] * k for _ in range(k)]
    for y, p in zip(labels, preds):
        confusion[y][p] += 1
    classes = []
    for c, name in enumerate(names):
        tp = confusion[c][c]
        predicted = sum(confusion[r][c] for r in range(k))
        support = sum(confusion[c])
        precision = tp / predicted if predicted else 0.0
        recall = tp / support if support else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        classes.append({"name": name, "precision": precision, "recall": recall, "f1": f1, "support": support})
    return {"classes": classes, "confusion": confusion}


def token_accuracy(preds: Sequence[str], golds: Sequence[str]) -> float:
    """Share of target characters (plus one end position per target) predicted right at their position."""
    right = total = 0
    for p, g in zip(preds, golds):
        right += sum(1 for i, ch in enumerate(g) if i < len(p) and p[i] == ch) + int(len(p) == len(g))
        total += len(g) + 1
    return right / total if total else 0.0


def paired_seed_interval(values: Sequence[float], baseline: Sequence[float]) -> dict:
    """Mean difference ``values - baseline`` over paired seeds and its 95% Student-t interval.

    With one pair there is no spread to judge from: ``low``/``high`` are ``None``.
    """
    diffs = [a - b for a, b in zip(values, baseline)]
    n = len(diffs)
    if n == 0:
        return {"n": 0, "mean": None, "low": None, "high": None}
    mean = statistics.fmean(diffs)
    if n < 2:
        return {"n": n, "mean": mean, "low": None, "high": None}
    half = t975(n - 1) * statistics.stdev(diffs) / math.sqrt(n)
    return {"n": n, "mean": mean, "low": mean - half, "high": mean + half}


def mcnemar(correct_a: Sequence[bool], correct_b: Sequence[bool]) -> dict:
    """Exact two-sided McNemar test: ``b`` = only A right, ``c`` = only B right,
    ``p`` = P(as extreme | p=1/2)."""
    b = sum(1 for x, y in zip(correct_a, correct_b) if x and not y)
    c = sum(1 for x, y in zip(correct_a, correct_b) if y and not x)
    n = b + c
    if n == 0:
        return {"only_a": 0, "only_b": 0, "p": 1.0}
    tail = sum(math.comb(n, i) for i in range(0, min(b, c) + 1)) / 2**n
    return {"only_a": b, "only_b": c, "p": min(1.0, 2 * tail)}


def verdict(mechanism: str, baseline: str, metric: str, interval: dict, test: Optional[dict]) -> str:
    """One sentence: the difference in points, whether it exceeds the spread over seeds, and McNemar's p."""
    if interval["mean"] is None:
        return f"{mechanism}: no seed shared with {baseline}, no paired comparison."
    diff = 100 * interval["mean"]
    diff = 0.0 if round(diff, 1) == 0 else diff  # no "-0.0"
    text = f"{mechanism} vs {baseline}: {metric} {diff:+.1f} points"
    if interval["low"] is None:
        text += " (one seed: no spread over seeds to compare with)"
    else:
        low, high = (0.0 if round(x, 1) == 0 else x for x in (100 * interval["low"], 100 * interval["high"]))
        inside = low <= 0 <= high
        text += (f", 95% interval over {interval['n']} paired seeds [{low:+.1f}, {high:+.1f}]: "
                 + ("within the spread over seeds (not a difference at this budget)" if inside
                    else "larger than the spread over seeds"))
    if test is not None:
        text += (f"; per example (McNemar, pooled over seeds): {test['only_a']} right only with {mechanism}, "
                 f"{test['only_b']} only with {baseline}, p = {test['p']:.3g}"
                 + (" (significant at 5%)" if test["p"] < 0.05 else " (not significant at 5%)"))
    return text + "."


def load_note(load: Optional[float], cores: Optional[int]) -> Optional[str]:
    """A sentence when the 1-minute load average exceeded the cores during the runs, else ``None``."""
    if load is None or cores is None or load <= cores:
        return None
    return (f"The machine was loaded during these runs (load average up to {load:.1f} on {cores} cores): "
            "step times are inflated by other processes and their ratios are unreliable; compare them only "
            "within one run and rerun on an idle machine for timings.")


def _git_commit() -> Optional[str]:
    """The commit of the attnkit source tree, when it is a git checkout (``None`` for an installed wheel)."""
    root = Path(__file__).resolve().parents[3]
    if not (root / ".git").exists():
        return None
    try:
        proc = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    commit = proc.stdout.strip()
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=10).stdout.strip()
    return commit + ("+dirty" if dirty else "")


def environment(started: float, finished: float, load_max: Optional[float] = None) -> dict:
    """The environment block of ``results.json``: versions, commit, dates, wall time, threads, load."""
    import torch

    import attnkit

    iso = lambda t: datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="seconds")  # noqa: E731
    load = os.getloadavg()
    return {
        "attnkit": attnkit.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": _git_commit(),
        "started": iso(started),
        "finished": iso(finished),
        "wall_time_s": round(finished - started, 1),
        "threads": torch.get_num_threads(),
        "cores": os.cpu_count(),
        "load_average_end": [round(x, 2) for x in load],
        "load_average_max": None if load_max is None else round(max(load_max, load[0]), 2),
    }
