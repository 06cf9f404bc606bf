"""Outputs of ``attnkit compare``: ``results.json``, ``results.csv``, plots, and a self-contained
``report.html``.

The HTML report embeds its plots as base64 PNGs (it opens in a browser from anywhere, with no other file)
and passes every piece of dataset text it shows through ``html.escape``.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
from pathlib import Path
from typing import Optional

from .._files import save_figure, write_text_file
from .config import CompareConfig
from .report_extras import marks_legend, plot_confusions, plot_learning_curves_band

__all__ = ["write_report", "write_results_json", "write_results_csv", "format_value", "table_rows",
           "table_legend", "render_html"]

def _base(mechanism: str) -> str:
    """The attention mechanism of a variant: ``"coda"`` for ``"coda+mmd"`` (CoDA with alignment)."""
    return mechanism.partition("+")[0]


def format_value(
    mean: Optional[float], std: Optional[float] = None, scale: float = 1.0, digits: int = 1
) -> str:
    """``"84.3 +- 0.5"`` (``std`` omitted when there is one seed), ``"-"`` when missing."""
    if mean is None:
        return "-"
    text = f"{mean * scale:.{digits}f}"
    if std is not None:
        text += f" ± {std * scale:.{digits}f}"
    return text


def table_rows(
    records: list[dict], metric_names: tuple[str, ...], detail: bool = True
) -> tuple[list[str], list[list[str]]]:
    """The human-readable results table: a header and one row per mechanism.

    ``detail=True`` (the HTML report): long column names, and the final hybrid ``u`` of every layer and
    head besides their mean. ``detail=False`` (the terminal): short column names that fit 80 columns,
    explained by ``table_legend``.
    """
    if detail:
        header = ["mechanism", "seeds", *[f"{m} (%)" for m in metric_names],
                  "step time (× baseline, range over seeds)", "explain-away min n_k·Σπ",
                  "final hybrid u (mean)"]
    else:
        header = ["mechanism", "seeds", *[f"{m} %" for m in metric_names], "step ×", "min n_k·Σπ", "u"]
    rows = []
    for r in records:
        u = "-" if r["hybrid_u"] is None else f"{r['hybrid_u_mean']:.3f}"
        if detail and r["hybrid_u"] is not None:
            u += "  [" + "; ".join(", ".join(f"{x:.2f}" for x in row) for row in r["hybrid_u"]) + "]"
        explain = format_value(r["explain_away_min_normalized"], None, 1.0, 3)
        if _base(r["mechanism"]) == "coda" and r["explain_away_min_normalized"] is not None:
            explain += " (not normalized)" if detail else "*"
        step = format_value(r["step_time_rel"], None, 1.0, 2)
        if detail and r["mechanism"] == r["step_time_baseline"]:
            step += " (baseline)"
        if detail and r.get("step_time_rel_min") is not None and r["n_seeds"] > 1:
            step += f" [{r['step_time_rel_min']:.2f}–{r['step_time_rel_max']:.2f} over seeds]"
        rows.append([
            r["mechanism"], str(r["n_seeds"]),
            *[format_value(r.get(f"{m}_mean"), r.get(f"{m}_std"), 100.0) for m in metric_names],
            step,
            explain,
            u,
        ])
    return header, rows


def table_legend(records: list[dict]) -> str:
    """What the short columns of ``table_rows(..., detail=False)`` mean."""
    baseline = records[0]["step_time_baseline"] if records else "the baseline"
    lines = [
        f"step ×: median time per optimizer step / {baseline}'s;  "
        "min n_k·Σπ: explain-away statistic, min_j of n_k·Σ_i π_ij (Lemma 1: ≥ 1 for DNAS);  "
        "u: final hybrid weight, mean over layers and heads",
    ]
    if any(_base(r["mechanism"]) == "coda" and r["explain_away_min_normalized"] is not None for r in records):
        lines.append(
            "*: CoDA weights are not normalized (they lie in [-1, 1]); the statistic is not comparable"
        )
    return "\n".join(lines)


def write_results_json(path: Path, config: CompareConfig, task, records: list[dict], runs: list[dict],
                       extras: Optional[dict] = None) -> None:
    payload = {
        "task": config.task,
        "kind": task.kind,
        "metrics": list(task.metric_names),
        "config": config.to_dict(),
        "results": records,
        "runs": runs,
        "notes": {
            "step_time_rel": (
                "median time per optimizer step (evaluation excluded; median over seeds of each run's "
                "median) / the baseline mechanism's"
            ),
            "explain_away_min_normalized": (
                "min over non-causal self-attention layers, the first explain_away_samples (config) "
                "evaluation examples and seeds of min_j n_k * sum_i pi_ij "
                "(Lemma 1: >= 1 for DNAS); explain_away_min_raw is min_j sum_i pi_ij"
            ),
            "hybrid_u": "final u = sigmoid(theta) per layer (rows) and head (columns), mean over seeds",
            "std": "sample standard deviation (n - 1) over seeds",
            "step_time_s": "a run's mean time per optimizer step (the ratios use medians)",
            "token_accuracy": (
                "seq2seq: target characters predicted at their own position, plus one for an output of the "
                "target's length, over target length + 1"
            ),
        },
        **(extras or {}),
    }
    # whole or not at all; strict JSON (no bare NaN, which strict parsers refuse)
    write_text_file(path, json.dumps(payload, indent=1, allow_nan=False), overwrite=True)


def write_results_csv(path: Path, records: list[dict], metric_names: tuple[str, ...]) -> None:
    columns = ["mechanism", "n_seeds"]
    for m in metric_names:
        columns += [f"{m}_mean", f"{m}_std"]
    columns += ["step_time_s", "step_time_rel", "step_time_baseline", "explain_away_min_normalized",
                "explain_away_min_raw", "hybrid_u_mean", "hybrid_u"]
    buffer = io.StringIO(newline="")
    writer = csv.writer(buffer)
    writer.writerow(columns)
    for r in records:
        writer.writerow(
            ["" if r.get(c) is None else (json.dumps(r[c]) if c == "hybrid_u" else r[c]) for c in columns]
        )
    write_text_file(path, buffer.getvalue(), overwrite=True)


def _history_mean(runs: list[dict], key: str) -> tuple[list[int], list[float]]:
    """Mean over seeds of ``key`` at each logged step (steps logged by every seed)."""
    by_step: dict[int, list[float]] = {}
    for r in runs:
        for h in r["history"]:
            if h.get(key) is not None:
                by_step.setdefault(h["step"], []).append(h[key])
    steps = sorted(s for s, v in by_step.items() if len(v) == len(runs))
    return steps, [sum(by_step[s]) / len(by_step[s]) for s in steps]


def plot_learning_curves(path: Path, runs: list[dict], mechanisms: tuple[str, ...], metric: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..analysis.plots import literal_text, series_colors

    fig, (ax_loss, ax_metric) = plt.subplots(1, 2, figsize=(10, 3.8))
    colors = series_colors(list(mechanisms))
    for mech in mechanisms:
        group = [r for r in runs if r["mechanism"] == mech]
        for ax, key in ((ax_loss, "train_loss"), (ax_metric, metric)):
            steps, values = _history_mean(group, key)
            if steps:
                ax.plot(steps, values, marker="o", ms=3, label=literal_text(mech), color=colors.get(mech))
    ax_loss.set(xlabel="step", ylabel="training loss", title="training loss (mean over seeds)")
    ax_metric.set(xlabel="step", ylabel=literal_text(metric),
                  title=literal_text(f"eval {metric} (mean over seeds)"))
    for ax in (ax_loss, ax_metric):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)


def _initial_u(mechanism: str) -> Optional[float]:
    """``u`` before the first optimizer step of a compare run of ``mechanism`` (``"hnas"``, ``"hnas+ct"``).

    results.json does not record it: compare builds each model from the mechanism's name, so every hybrid
    weight starts at that config's ``u0`` (``theta = logit(u0)``). ``None`` for a name without one."""
    from ..registry import resolve_mechanism

    try:
        config = resolve_mechanism(_base(mechanism))
    except ValueError:  # "none" or a transduction model's name
        return None
    return getattr(config, "u0", None)


def plot_hybrid(path: Path, runs: list[dict]) -> bool:
    """Hybrid-weight trajectories ``u`` (one line per layer and head) of the first hnas seed (plain hnas
    first, else an aligned one such as ``hnas+ct``), from ``u0`` at step 0 through every evaluation."""
    hybrid = [r for r in runs if r["history"] and r["history"][0].get("hybrid_u")]
    run = next((r for r in hybrid if r["mechanism"] == "hnas"), hybrid[0] if hybrid else None)
    if run is None:
        return False
    import numpy as np

    from ..analysis.plots import plot_hybrid_trajectories

    steps = [h["step"] for h in run["history"]]
    u = np.array([h["hybrid_u"] for h in run["history"]])  # (T, layers, heads)
    u0 = _initial_u(run["mechanism"])
    if u0 is not None and steps[0] > 0:  # the first evaluation (e.g. step 15) left out where u starts
        steps = [0, *steps]
        u = np.concatenate([np.full_like(u[:1], u0), u])  # (T + 1, layers, heads)
    plot_hybrid_trajectories(
        steps, u, path, title=f"{run['mechanism']}: hybrid weight u per layer and head (seed {run['seed']})",
        xlabel="optimizer step",  # as the learning curves beside it
    )
    return True


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(path.stem)}" src="data:image/png;base64,{data}">'


def _html_table(header: list[str], rows: list[list[str]], table_id: str = "") -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    id_attr = f' id="{table_id}"' if table_id else ""
    return (
        f'<div class="wide"><table{id_attr}><thead><tr>{head}</tr></thead>'
        f"<tbody>{body}</tbody></table></div>"
    )


def render_html(config: CompareConfig, task, records: list[dict], runs: list[dict], images: list[Path],
                extras: Optional[dict] = None) -> str:
    """The report as one HTML string (plots inlined; dataset text escaped)."""
    header, rows = table_rows(records, task.metric_names)
    run_rows = [
        [r["mechanism"], str(r["seed"]),
         *[format_value(r["metrics"].get(m), None, 100.0) for m in task.metric_names],
         f"{r['step_time_s'] * 1000:.1f}", format_value(r["explain_away"]["min_normalized"], None, 1.0, 3),
         format_value(r["explain_away"]["min"], None, 1.0, 4)]
        for r in runs
    ]
    run_header = ["mechanism", "seed", *[f"{m} (%)" for m in task.metric_names], "mean ms / step",
                  "min n_k·Σπ", "min Σπ (raw)"]
    sample_blocks = []
    for mech in config.variants:
        run = next(r for r in runs if r["mechanism"] == mech)
        if run["samples"]:
            keys = list(run["samples"][0])
            sample_blocks.append(f"<h3>{html.escape(mech)} (seed {run['seed']})</h3>"
                                 + _html_table(keys, [[s[k] for k in keys] for s in run["samples"]])
                                 + "".join(marks_legend([s.get("predicted", "") for s in run["samples"]])))
    config_rows = [[k, json.dumps(v)] for k, v in config.to_dict().items()]
    from .report_extras import CSS as css
    from .report_extras import extra_sections

    world = runs[0].get("world_size", 1) if runs else 1  # results from before it was recorded: one
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>attnkit compare: {html.escape(config.task)}</title><style>{css}</style></head><body>",
        f"<h1>attnkit compare: {html.escape(config.task)} ({html.escape(config.preset)} preset)</h1>",
        f"<p>{len(config.variants)} mechanisms × {config.seeds} seed(s), "
        f"{config.total_steps} optimizer steps each, "
        f"global batch {config.batch_size}, {world} process(es). Metrics are mean ± sample std (n − 1) "
        f"over seeds on "
        f"{runs[0]['eval_examples'] if runs else 0} evaluation examples.</p>",
        "<h2>Results</h2>",
        _html_table(header, rows, "results"),
        "<p><b>step time</b>: median time per optimizer step, evaluation excluded (noisy on a shared CPU), "
        "relative to "
        f"<code>{html.escape(records[0]['step_time_baseline'] if records else '')}</code>. "
        "<b>explain-away min</b>: the smallest <code>n_k · Σ_i π_ij</code> over the keys j of the "
        "non-causal attention layers, the first "
        f"{min(config.explain_away_samples, runs[0]['eval_examples']) if runs else 0} evaluation examples "
        "(<code>explain_away_samples</code>) and the seeds (Lemma 1: ≥ 1 for DNAS; near 0 means some key is "
        "explained away; CoDA's quasi-attention is not normalized, so its value is not a weight share). "
        "<b>hybrid u</b>: final share of DNAS per layer "
        "(rows, separated by ;) and head.</p>",
    ]
    inline = {image.stem: _img(image) for image in images}
    for image in images:
        if image.stem != "confusion_matrices":
            parts.append(f"<h2>{html.escape(image.stem.replace('_', ' '))}</h2>{inline[image.stem]}")
    if extras:
        parts += extra_sections(extras, inline)
    parts += ["<h2>Runs</h2>", _html_table(run_header, run_rows, "runs")]
    if sample_blocks and not (extras and extras.get("samples", {}).get("rows")):
        parts += ["<h2>Sample predictions</h2>", *sample_blocks]
    parts += [
        "<h2>Configuration</h2>", _html_table(["key", "value"], config_rows, "config"), "</body></html>"
    ]
    return "\n".join(parts)


def write_report(config: CompareConfig, task, records: list[dict], runs: list[dict], out: Path,
                 extras: Optional[dict] = None) -> dict:
    """Write every output into ``out``; return ``{kind: path}``. ``extras``: ``runner.summary.summarize``'s
    dict."""
    out = Path(out)
    files = {"json": out / "results.json", "csv": out / "results.csv"}
    write_results_json(files["json"], config, task, records, runs, extras)
    write_results_csv(files["csv"], records, task.metric_names)
    images = []
    if config.plots:
        files["learning_curves"] = out / "learning_curves.png"
        plot_learning_curves_band(files["learning_curves"], runs, config.variants, task.metric_names[0])
        images.append(files["learning_curves"])
        if extras and plot_confusions(out / "confusion_matrices.png", extras.get("per_class") or {}):
            files["confusion_matrices"] = out / "confusion_matrices.png"
            images.append(files["confusion_matrices"])
        if plot_hybrid(out / "hybrid_weights.png", runs):
            files["hybrid_weights"] = out / "hybrid_weights.png"
            images.append(files["hybrid_weights"])
    files["html"] = out / "report.html"
    write_text_file(files["html"], render_html(config, task, records, runs, images, extras), overwrite=True)
    return files
