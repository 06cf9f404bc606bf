"""Plots of the papers' diagnostics, one fixed colour per mechanism.

"Doubly-Normalized Attention": Fig. 1 (minimum weight sum during training), Fig. 2 (center distance
vs ``r``), Fig. 3/4 (hybrid weight ``u`` over training); "Attention that does not Explain Away"
(arXiv:2009.14308): Fig. 1
(histogram of log weight sums), Figs. 6/8/9 (2-D mode collapse); CoDA: Fig. 2 (histograms of
``sigmoid(N)``, ``tanh(E)``, ``M``). matplotlib (the ``plot`` extra) is imported inside each function
with the Agg backend; every function writes a PNG and returns its path. Every text a caller passes (titles,
names) is drawn as written: ``$`` is a dollar sign, not the start of matplotlib's math mode
(:func:`literal_text`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

import numpy as np

from ..registry import SPECS, mechanism_color, spec_of

__all__ = [
    "MECHANISM_COLORS",
    "MECHANISM_LABELS",
    "mechanism_color",
    "series_colors",
    "mechanism_label",
    "literal_text",
    "plot_hybrid_trajectories",
    "plot_center_distance_curves",
    "plot_mode_collapse_2d",
    "plot_log_sum_histograms",
    "plot_min_weight_sum",
    "plot_coda_histograms",
    "plot_lemma1",
]

MECHANISM_COLORS: dict[str, str] = {name: spec.color for name, spec in SPECS.items()}  # from the registry
MECHANISM_LABELS: dict[str, str] = {name: spec.label for name, spec in SPECS.items()}
BASELINE_COLOR = "#7f7f7f"  # the no-attention baseline rows ("none", "uniform")
_EXTRA_COLORS = ("#17becf", "#bcbd22", "#8c564b", "#e377c2", "#9edae5", "#c5b0d5", "#ff9896", "#98df8a")


def series_colors(names: Sequence[str]) -> dict[str, str]:
    """One distinct colour per series: a mechanism's registry colour, grey for the no-attention baseline,
    and unused colours for anything else (e.g. ``dnas+ct`` runs with alignment attention)."""
    colors: dict[str, str] = {}
    for name in names:
        if name in MECHANISM_COLORS:
            colors[name] = MECHANISM_COLORS[name]
        elif name in ("none", "uniform"):
            colors[name] = BASELINE_COLOR
    free = [c for c in _EXTRA_COLORS if c not in colors.values()]
    for i, name in enumerate(n for n in names if n not in colors):
        colors[name] = free[i % len(free)]
    return colors

PathLike = Union[str, Path]


def mechanism_label(name: str) -> str:
    """The label of mechanism ``name`` in plots (aliases accepted; other names are returned as given)."""
    try:
        return spec_of(name).label
    except ValueError:
        return name


def literal_text(text: object) -> str:
    """``text`` as a matplotlib string that is drawn exactly as written.

    matplotlib reads the text between two unescaped ``$`` as math: a class label ``"cost $5 to $10"`` was
    drawn as "cost 5to10" and ``"$x^$"`` made the whole figure fail. Every ``$`` is escaped (``\\$`` is
    drawn as ``$``), so no user text (class names, tokens, mechanism and case names, titles) enters math mode.
    """
    return str(text).replace("$", r"\$")


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(
            "plotting needs matplotlib, which is in the 'plot' extra: pip install 'attnkit[plot]'"
        ) from exc
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: PathLike, tight: bool = True) -> Path:
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"plot path {str(path)!r} must end in .png")
    path.parent.mkdir(parents=True, exist_ok=True)
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def plot_hybrid_trajectories(
    steps: Sequence[float],
    u: np.ndarray,
    path: PathLike,
    title: str = "Hybrid weight u per layer and head",
    line_labels: Optional[Sequence[str]] = None,
    xlabel: str = "training step",
) -> Path:
    """Plot ``u`` (``(T, layers, heads)``, values in [0, 1]) against the training ``steps`` (``(T,)``).

    One panel per layer, one line per head (``line_labels`` names the lines otherwise, e.g. seeds of a
    one-head model); ``u = 1`` is DNAS, ``u = 0`` softmax ("Doubly-Normalized Attention" Figs. 3, 4).
    ``xlabel`` names the steps (compare's report says "optimizer step", as its other figures do).
    """
    u = np.asarray(u, dtype=np.float64)
    steps = np.asarray(steps, dtype=np.float64)
    if u.ndim != 3:
        raise ValueError(f"u has shape {u.shape}; expected (T, layers, heads)")
    if steps.shape != (u.shape[0],):
        raise ValueError(
            f"steps has shape {steps.shape}; expected (T,) = ({u.shape[0]},) to match u "
            f"{u.shape}"
        )
    if u.shape[0] == 0 or not np.all(np.isfinite(u)) or u.min() < 0 or u.max() > 1:
        raise ValueError("u must hold at least one step of finite values in [0, 1] (u = sigmoid(theta))")
    T, n_layers, n_heads = u.shape
    labels = [f"head {h}" for h in range(n_heads)] if line_labels is None else [str(x) for x in line_labels]
    if len(labels) != n_heads:
        raise ValueError(f"line_labels has {len(labels)} names; expected one per line ({n_heads})")
    plt = _pyplot()
    cols = min(n_layers, 4)
    rows = int(np.ceil(n_layers / cols))
    fig, axes = plt.subplots(
        rows, cols, figsize=(max(6.4, 3.6 * cols), 3.2 * rows), squeeze=False, sharey=True
    )
    cmap = plt.get_cmap("viridis")
    for layer in range(rows * cols):
        ax = axes[layer // cols][layer % cols]
        if layer >= n_layers:
            ax.axis("off")
            continue
        for head in range(n_heads):
            colour = cmap(head / max(n_heads - 1, 1))
            ax.plot(
                steps, u[:, layer, head], color=colour, marker="." if T < 30 else None,
                label=literal_text(labels[head]),
            )
        ax.axhline(0.5, color="grey", lw=0.8, ls=":")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"layer {layer}")
        ax.set_xlabel(literal_text(xlabel))
        if layer % cols == 0:
            ax.set_ylabel("u  (1 = DNAS, 0 = softmax)")
        if layer == 0 and n_heads <= 12:
            ax.legend(fontsize=7, loc="best")
    fig.suptitle(literal_text(title))
    return _save(fig, path)


def plot_center_distance_curves(
    r: np.ndarray,
    curves: Mapping[float, Mapping[str, np.ndarray]],
    path: PathLike,
    simulated: Optional[Mapping[float, Mapping[str, tuple[np.ndarray, np.ndarray]]]] = None,
    title: str = "Center distance after one self-attention step",
) -> Path:
    """DNA Fig. 2: ``curves[a][mechanism]`` against ``r`` (log x axis); ``simulated[a][mechanism] = (r, d)``
    drawn as markers on the same axes. One panel per ``a``; LNAS solid, DNAS dashed."""
    plt = _pyplot()
    values = list(curves)
    fig, axes = plt.subplots(1, len(values), figsize=(4.2 * len(values), 4.0), squeeze=False)
    for ax, a in zip(axes[0], values):
        for name, d in curves[a].items():
            ls = "--" if name == "dnas" else "-"
            ax.plot(r, d, ls, color=mechanism_color(name),
                    label=literal_text(f"{mechanism_label(name)} closed form"))
            if simulated and a in simulated and name in simulated[a]:
                rs, ds = simulated[a][name]
                marker = "s" if name == "dnas" else "o"
                ax.plot(
                    rs,
                    ds,
                    marker,
                    mfc="none",
                    color=mechanism_color(name),
                    label=literal_text(f"{mechanism_label(name)} simulated"),
                )
        ax.axhline(2 * a, color="grey", lw=0.8, ls=":", label="initial distance 2a")
        ax.set_xscale("log")
        ax.set_xlabel("cluster mass ratio r = N0 / N1")
        ax.set_ylabel("center distance after one step")
        ax.set_title(f"a = {a:g}")
        ax.set_ylim(0, 2.1 * a)
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.suptitle(literal_text(title))
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.legend(handles, names, loc="lower center", ncol=len(names), fontsize=8, frameon=False)
    return _save(fig, path, tight=False)


def plot_mode_collapse_2d(
    trajectories: Mapping[str, np.ndarray],
    labels: np.ndarray,
    path: PathLike,
    steps_to_show: Sequence[int] = (0, 1, 2, 4),
    cluster_counts: Optional[Mapping[str, Sequence[int]]] = None,
    title: str = "2-D mode collapse",
) -> Path:
    """Appendix E Figs. 6/8/9: one row per mechanism, one column per step; points coloured by their
    original cluster (``labels``: 0 red, 1 blue, as in the paper). ``trajectories[m]`` is ``(T+1, N, 2)``."""
    plt = _pyplot()
    names = list(trajectories)
    steps_to_show = [s for s in steps_to_show if s < next(iter(trajectories.values())).shape[0]]
    fig, axes = plt.subplots(
        len(names), len(steps_to_show), figsize=(2.8 * len(steps_to_show), 2.7 * len(names)), squeeze=False
    )
    labels = np.asarray(labels)
    all_points = np.concatenate([np.asarray(t)[0] for t in trajectories.values()])
    lo, hi = all_points.min(axis=0) - 0.3, all_points.max(axis=0) + 0.3
    for row, name in enumerate(names):
        traj = np.asarray(trajectories[name])
        for col, step in enumerate(steps_to_show):
            ax = axes[row][col]
            x = traj[step]
            ax.scatter(
                x[labels == 0, 0], x[labels == 0, 1], s=5, color="#d62728", alpha=0.6, label="cluster 0"
            )
            ax.scatter(
                x[labels == 1, 0], x[labels == 1, 1], s=5, color="#1f5fbf", alpha=0.6, label="cluster 1"
            )
            ax.set_xlim(lo[0], hi[0])
            ax.set_ylim(lo[1], hi[1])
            count = f", {cluster_counts[name][step]} cluster(s)" if cluster_counts else ""
            ax.set_title(
                literal_text(f"{mechanism_label(name)}, step {step}{count}"), fontsize=9,
                color=mechanism_color(name),
            )
            ax.set_xlabel("x1", fontsize=8)
            ax.set_ylabel("x2", fontsize=8)
            ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=7, loc="lower right", markerscale=2)
    fig.suptitle(literal_text(title))
    return _save(fig, path)


def plot_log_sum_histograms(
    log_sums: Mapping[str, np.ndarray],
    path: PathLike,
    eps: float = 1e-3,
    bound: Optional[float] = None,
    floor: float = -50.0,
    title: str = "Distribution of log key weight sums",
) -> Path:
    """AEA Fig. 1: histograms of ``log sum_i pi_ij`` per mechanism, with ``log eps`` and
    ``log(1/n_k)`` marked. Sums of 0 (log = -inf) are drawn at ``floor``; every finite log where it is, below
    ``floor`` too."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    arrays = {k: np.asarray(v, dtype=np.float64) for k, v in log_sums.items()}
    clipped = {k: np.where(np.isneginf(v), floor, v) for k, v in arrays.items()}  # only log 0 = -inf
    lo = min(float(v.min()) for v in clipped.values())
    hi = max(float(v.max()) for v in clipped.values())
    edges = np.linspace(lo, hi if hi > lo else lo + 1, 50)
    for name, values in clipped.items():
        ax.hist(values, bins=edges, color=mechanism_color(name), alpha=0.55,
                label=literal_text(mechanism_label(name)))
    ax.axvline(np.log(eps), color="black", ls="--", lw=1, label=f"log eps = log {eps:g}")
    if bound is not None:
        ax.axvline(np.log(bound), color="grey", ls=":", lw=1.2, label=f"log(1/n_k) = {np.log(bound):.2f}")
    ax.set_xlabel("log sum_i pi_ij  (natural log, per key)")
    ax.set_ylabel("number of keys")
    ax.set_title(literal_text(title))
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_min_weight_sum(
    steps: Sequence[float],
    minima: Mapping[str, Sequence[float]],
    path: PathLike,
    bound: Optional[float] = None,
    title: str = "Minimum key weight sum during training",
) -> Path:
    """DNA Fig. 1: ``min_j sum_i pi_ij`` per mechanism against training steps (log y), with ``1/n_k``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for name, values in minima.items():
        values = np.maximum(np.asarray(values, dtype=np.float64), 1e-300)
        ax.plot(steps, values, color=mechanism_color(name), label=literal_text(mechanism_label(name)))
    if bound is not None:
        ax.axhline(bound, color="grey", ls=":", label=f"Lemma 1 bound 1/n_k = {bound:.3g}")
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("min_j sum_i pi_ij")
    ax.set_title(literal_text(title))
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_coda_histograms(
    matrices: Mapping[str, np.ndarray],
    path: PathLike,
    title: str = "CoDA matrices of a trained model",
) -> Path:
    """CoDA Fig. 2: one histogram per matrix (e.g. ``{"sigmoid(N)": ..., "tanh(E)": ..., "M": ...}``)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(matrices), figsize=(4.0 * len(matrices), 3.4), squeeze=False)
    for ax, (name, values) in zip(axes[0], matrices.items()):
        ax.hist(np.asarray(values).ravel(), bins=60, color=mechanism_color("coda"), alpha=0.85)
        ax.set_title(literal_text(name))
        ax.set_xlabel("value")
        ax.set_ylabel("number of entries")
    fig.suptitle(literal_text(title))
    return _save(fig, path)


def plot_lemma1(
    rows: Sequence[Mapping[str, object]],
    path: PathLike,
    title: str = "Lemma 1: min over keys of n_k * sum_i pi_ij",
    floor: float = 1e-12,
    ceiling: float = 1e3,
) -> Path:
    """One horizontal bar per case (``rows[i]["case"]``) and mechanism (``rows[i]["mechanism"]``) with
    ``rows[i]["min_normalized"]`` on a log axis, clipped to ``[floor, ceiling]``; the Lemma 1 bound (1) as a
    line. The axis reaches the largest bar (at least 10), so no bar runs past its edge."""
    if not 0 < floor < 1 < ceiling:
        raise ValueError(f"floor={floor!r}, ceiling={ceiling!r}; expected 0 < floor < 1 < ceiling "
                         "(the Lemma 1 bound 1 lies between them)")
    plt = _pyplot()
    cases = list(dict.fromkeys(str(r["case"]) for r in rows))
    names = list(dict.fromkeys(str(r["mechanism"]) for r in rows))
    height = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(8.0, 0.32 * len(cases) * max(1, len(names) / 3) + 1.6))
    largest = 5.0  # the axis reaches at least 10
    for k, name in enumerate(names):
        ys, xs = [], []
        for i, case in enumerate(cases):
            for r in rows:
                if str(r["case"]) == case and str(r["mechanism"]) == name:
                    ys.append(i + (k - (len(names) - 1) / 2) * height)
                    xs.append(min(max(float(r["min_normalized"]), floor), ceiling))
        largest = max([largest, *xs])
        ax.barh(ys, xs, height=height, color=mechanism_color(name), label=literal_text(mechanism_label(name)),
                left=floor)
    ax.axvline(1.0, color="black", ls="--", lw=1, label="Lemma 1 bound (= 1)")
    ax.set_xscale("log")
    ax.set_xlim(floor, 2 * largest)  # room beyond the longest bar (it ends at floor + x ~ x)
    ax.set_yticks(range(len(cases)))
    ax.set_yticklabels([literal_text(c) for c in cases], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"min_j n_k * sum_i pi_ij  (values below {floor:g} drawn at {floor:g}, "
                  f"above {ceiling:g} at {ceiling:g})")
    ax.set_title(literal_text(title))
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)
