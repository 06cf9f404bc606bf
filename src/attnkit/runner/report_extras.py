"""Sections of ``report.html`` built from ``runner.summary.summarize``: what the differences mean, timing and
load, per-class scores and confusion matrices, sample predictions that differ, mechanisms not run,
environment. Also the learning-curve figure with a band over seeds. Every piece of text goes through
``html.escape``.
"""

from __future__ import annotations

import html
import re
import json
from pathlib import Path

from .._files import save_figure

__all__ = ["extra_sections", "marks_legend", "plot_learning_curves_band", "plot_confusions", "CSS"]

CSS = (
    "body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1180px;padding:0 1em;"
    "box-sizing:border-box;overflow-wrap:break-word}"  # a long --task path in <h1> wraps at a narrow width
    "table{border-collapse:collapse;margin:1em 0;max-width:100%}"
    "th,td{border:1px solid #ccc;padding:4px 8px;text-align:left;font-size:14px;overflow-wrap:break-word}"
    "td{max-width:44em}"
    "th{background:#f3f3f3}img{max-width:100%;height:auto}code{background:#f3f3f3;padding:1px 4px}"
    ".wide{overflow-x:auto;max-width:100%}"
    ".note{background:#fff6dd;border-left:4px solid #e0a800;padding:6px 10px}"
    "ul.verdicts li{margin:4px 0}"
)


def _table(header: list, rows: list, table_id: str = "") -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    id_attr = f' id="{table_id}"' if table_id else ""
    return (
        f'<div class="wide"><table{id_attr}><thead><tr>{head}</tr></thead>'
        f"<tbody>{body}</tbody></table></div>"
    )


def marks_legend(cells: list) -> list[str]:
    """A one-line legend (``[]`` or one ``<p>``) for the display marks (``data.tokenizers.DISPLAY_MARKS``)
    that some of ``cells`` (a sample table's predicted outputs: a source text or a reference may hold the
    same characters as data, which the legend must not explain) holds; none when no cell holds one."""
    from ..data.tokenizers import _MARK_SHOWS, DISPLAY_MARKS

    cells = [str(c) for c in cells]
    shown = [m for m in DISPLAY_MARKS if any(m in c for c in cells)]
    if not shown:
        return []
    marks = ", ".join(f"{m} {_MARK_SHOWS[m]}" for m in shown)
    return [f"<p>Marks: {html.escape(marks)}.</p>"]


def _moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _seeds_note(runs: list[dict], mechanisms: tuple[str, ...]) -> str:
    """What the lines and bands of the learning curves are over: ``"one seed"`` (no band is drawn), else
    ``"mean; band: range over 3 seeds"`` (``"2-3 seeds"`` when the mechanisms ran different numbers)."""
    counts = [c for c in (sum(1 for r in runs if r["mechanism"] == m) for m in mechanisms) if c]
    lo, hi = min(counts, default=1), max(counts, default=1)
    if hi <= 1:
        return "one seed"
    return f"mean; band: range over {hi if lo == hi else f'{lo}-{hi}'} seeds"


def plot_learning_curves_band(path: Path, runs: list[dict], mechanisms: tuple[str, ...], metric: str) -> None:
    """Training loss per step (moving average) and the evaluation metric at every evaluation: the mean over
    seeds as a line, the range over seeds (min to max) as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from ..analysis.plots import literal_text, series_colors

    fig, (ax_loss, ax_metric) = plt.subplots(1, 2, figsize=(11, 4))
    colors = series_colors(list(mechanisms))
    for mech in mechanisms:
        group = [r for r in runs if r["mechanism"] == mech]
        color = colors.get(mech)
        losses = [r.get("step_losses") or [] for r in group]
        n = min((len(x) for x in losses), default=0)
        if n:
            window = max(1, n // 20)
            curves = np.array([_moving_average(x[:n], window) for x in losses])  # (seeds, steps)
            steps = np.arange(1, n + 1)
            ax_loss.plot(steps, curves.mean(0), color=color, label=literal_text(mech))
            ax_loss.fill_between(steps, curves.min(0), curves.max(0), color=color, alpha=0.2, linewidth=0)
        by_step: dict[int, list[float]] = {}
        for r in group:
            for h in r["history"]:
                if h.get(metric) is not None:
                    by_step.setdefault(h["step"], []).append(h[metric])
        steps_m = sorted(s for s, v in by_step.items() if len(v) == len(group))
        if steps_m:
            values = [np.array(by_step[s]) * 100 for s in steps_m]
            ax_metric.plot(steps_m, [v.mean() for v in values], marker="o", ms=3, color=color,
                           label=literal_text(mech))
            ax_metric.fill_between(steps_m, [v.min() for v in values], [v.max() for v in values], color=color,
                                   alpha=0.2, linewidth=0)
    seeds = _seeds_note(runs, mechanisms)
    ax_loss.set(xlabel="optimizer step", ylabel="training loss",
                title=f"training loss, moving average\n({seeds})")
    ax_metric.set(xlabel="optimizer step", ylabel=literal_text(f"{metric} (%)"),
                  title=literal_text(f"evaluation {metric}\n({seeds})"))
    for ax in (ax_loss, ax_metric):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
    plt.close(fig)


def plot_confusions(path: Path, per_class: dict) -> bool:
    """One confusion matrix per mechanism (rows: true class, columns: predicted; summed over seeds)."""
    if not per_class:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from ..analysis.plots import literal_text

    mechs = list(per_class)
    # drawn as written, a long name cut to 24 characters (the table above the plot has it whole): longer
    # tick labels ran over the caption
    names = [literal_text(n if len(n) <= 24 else n[:23] + "\u2026")
             for n in (c["name"] for c in per_class[mechs[0]]["classes"])]
    k = len(names)
    width = max(2.3 * len(mechs) + 1.5, 4.8)  # the caption below fits one mechanism's figure too
    fig, axes = plt.subplots(1, len(mechs), figsize=(width, 2.6 + 0.12 * k), squeeze=False,
                             layout="constrained")
    for ax, mech in zip(axes[0], mechs):
        m = np.array(per_class[mech]["confusion"], dtype=float)
        rows = m / np.maximum(m.sum(1, keepdims=True), 1)  # share of each true class
        ax.imshow(rows, cmap="Blues", vmin=0, vmax=1)
        ax.set_title(literal_text(mech), fontsize=9)
        ax.set_xticks(range(k), names, rotation=90, fontsize=6)
        ax.set_yticks(range(k), names if ax is axes[0][0] else [""] * k, fontsize=6)
        for i in range(k):
            for j in range(k):
                if m[i, j]:
                    ax.text(j, i, int(m[i, j]), ha="center", va="center", fontsize=5,
                            color="white" if rows[i, j] > 0.5 else "black")
    axes[0][0].set_ylabel("true class", fontsize=8)
    fig.supxlabel("predicted class\n(counts summed over seeds; colour: share of the true class)", fontsize=8)
    # saved with the box of every text: a layout pass runs before imshow's equal aspect moves the panels, and
    # with few classes and several mechanisms the titles stood above the picture ("hnas" drawn as "nnas")
    save_figure(fig, path, dpi=100, bbox_inches="tight", pad_inches=0.05)
    plt.close(fig)
    return True


def extra_sections(extras: dict, images: dict) -> list[str]:
    """HTML blocks, in reading order, from ``summarize``'s dict; ``images``: ``{name: <img> html}``."""
    parts: list[str] = []
    comparisons = extras.get("comparisons") or []
    if comparisons:
        parts.append("<h2>Are the differences real?</h2>")
        parts.append("<p>Each mechanism against the baseline on the first metric: the mean difference over "
                     "the seeds both ran (same data order), with a 95% Student-t interval over those paired "
                     "seeds, and an exact McNemar test on the evaluation examples (pooled over seeds).</p>")
        parts.append('<ul class="verdicts">'
                     + "".join(f"<li>{html.escape(c['text'])}</li>" for c in comparisons)
                     + "</ul>")
    timing = extras.get("timing") or {}
    if timing:
        parts.append("<h2>Time per optimizer step</h2>")
        rows = [[m, f"{t['median_ms']:.1f}", f"{t['min_ms']:.1f} – {t['max_ms']:.1f}",
                 "-" if t.get("median_rel") is None else f"{t['median_rel']:.2f}"] for m, t in timing.items()]
        parts.append(_table(["mechanism", "median ms / step", "min – max ms (all steps, all seeds)",
                             "median × baseline"], rows, "timing"))
        if extras.get("load_note"):
            parts.append(f'<p class="note">{html.escape(extras["load_note"])}</p>')
    per_class = extras.get("per_class") or {}
    if per_class:
        mechs = list(per_class)
        first = per_class[mechs[0]]["classes"]
        rows = []
        for c, entry in enumerate(first):
            cells = [entry["name"], entry["support"]]
            for m in mechs:
                x = per_class[m]["classes"][c]
                cells.append(f"{100 * x['f1']:.1f} ({100 * x['precision']:.0f} / {100 * x['recall']:.0f})")
            rows.append(cells)
        parts.append("<h2>Per class</h2>")
        parts.append("<p>F1 (precision / recall) in %, mean over seeds. Macro-F1 is, per run, the unweighted "
                     "mean of F1 over the classes that occur in the test labels or in that run's predictions "
                     "(scikit-learn's default): a class with support 0 that the run never predicted is left "
                     "out, so it can differ from the mean of this column. Rare classes that a short run "
                     "never predicts pull it far below accuracy.</p>")
        parts.append(_table(["class", "support", *mechs], rows, "per-class"))
        if "confusion_matrices" in images:
            parts.append(images["confusion_matrices"])
    samples = extras.get("samples") or {}
    if samples.get("rows"):
        parts.append("<h2>Sample predictions</h2>")
        parts.append("<p>Evaluation examples on which the mechanisms disagree "
                     f"({samples['differing']} of them "
                     "in all; each example once; ✓ right, ✗ wrong); then, if space is left, examples every "
                     "mechanism got wrong.</p>")
        parts.append(_table(samples["header"], samples["rows"], "samples"))
        predicted = [i for i, h in enumerate(samples["header"]) if re.search(r" \(seed \d+\)$", str(h))]
        parts += marks_legend([row[i] for row in samples["rows"] for i in predicted])
    skipped = extras.get("skipped_mechanisms") or {}
    if skipped:
        parts.append("<h2>Mechanisms not run</h2><ul>" + "".join(
            f"<li><code>{html.escape(m)}</code>: {html.escape(why)}</li>" for m, why in skipped.items()
        ) + "</ul>")
    env = extras.get("environment") or {}
    if env:
        parts.append("<h2>Environment</h2>")
        parts.append(_table(["key", "value"], [[k, json.dumps(v)] for k, v in env.items()], "environment"))
    return parts
