"""Plot helpers: fixed colours per mechanism, readable PNG files, clear errors on bad input."""

from __future__ import annotations

import numpy as np
import pytest

import attnkit as ak
from attnkit.analysis.plots import (
    MECHANISM_COLORS,
    mechanism_color,
    plot_hybrid_trajectories,
    plot_log_sum_histograms,
    plot_min_weight_sum,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_every_mechanism_has_its_own_colour():
    assert set(MECHANISM_COLORS) == set(ak.MECHANISMS)
    assert len(set(MECHANISM_COLORS.values())) == len(MECHANISM_COLORS)
    assert mechanism_color("lnas") == MECHANISM_COLORS["softmax"]
    with pytest.raises(ValueError, match="expected one of"):
        mechanism_color("relu")


def test_hybrid_trajectories_png(tmp_path):
    steps = np.arange(0, 50, 5)
    u = np.clip(
        np.linspace(0.5, 0.9, len(steps))[:, None, None] + np.zeros((1, 3, 4)), 0, 1
    )  # (T, layers, heads)
    path = plot_hybrid_trajectories(steps, u, tmp_path / "u.png", title="u over training")
    assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 5000


def test_hybrid_trajectories_name_their_lines_as_told(tmp_path, monkeypatch):
    """The explain-away target plots seeds of a one-head model: its legend said "head 0/1/2"."""
    import matplotlib.figure

    legends = []
    real = matplotlib.figure.Figure.savefig

    def keep(fig, *args, **kwargs):
        shown = [ax.get_legend() for ax in fig.axes if ax.get_legend()]
        legends.extend(t.get_text() for legend in shown for t in legend.get_texts())
        return real(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    u = np.full((4, 1, 3), 0.5)
    plot_hybrid_trajectories(np.arange(4), u, tmp_path / "u.png", line_labels=["seed 0", "seed 1", "seed 2"])
    assert legends == ["seed 0", "seed 1", "seed 2"]
    with pytest.raises(ValueError, match="line_labels has 2 names; expected one per line"):
        plot_hybrid_trajectories(np.arange(4), u, tmp_path / "u.png", line_labels=["a", "b"])


def test_hybrid_trajectories_reject_bad_shapes(tmp_path):
    with pytest.raises(ValueError, match="layers, heads"):
        plot_hybrid_trajectories(np.arange(3), np.zeros((3, 2)), tmp_path / "u.png")
    with pytest.raises(ValueError, match="steps has shape"):
        plot_hybrid_trajectories(np.arange(4), np.zeros((3, 1, 1)), tmp_path / "u.png")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        plot_hybrid_trajectories(np.arange(3), np.full((3, 1, 1), 1.5), tmp_path / "u.png")
    with pytest.raises(ValueError, match=".png"):
        plot_hybrid_trajectories(np.arange(3), np.zeros((3, 1, 1)), tmp_path / "u.pdf")


def test_explain_away_plots_write_png(tmp_path):
    log_sums = {"softmax": np.array([-30.0, -5.0, -np.inf, 0.1]), "dnas": np.array([-2.0, -1.0, 0.5])}
    hist = plot_log_sum_histograms(log_sums, tmp_path / "h.png", eps=1e-3, bound=1 / 50)
    curve = plot_min_weight_sum([0, 10, 20], {"softmax": [0.3, 1e-4, 0.0], "dnas": [0.3, 0.05, 0.04]},
                                tmp_path / "m.png", bound=1 / 50)
    assert hist.read_bytes()[:8] == PNG_MAGIC and curve.read_bytes()[:8] == PNG_MAGIC


def test_series_colors_are_distinct_with_baseline_and_alignment_runs():
    from attnkit.analysis.plots import BASELINE_COLOR, MECHANISM_COLORS, series_colors

    names = ["softmax", "dnas", "hnas", "sinkhorn", "coda", "none", "dnas+ct", "softmax+ot"]
    colors = series_colors(names)
    assert set(colors) == set(names)
    assert len(set(colors.values())) == len(names)  # no two series share a colour
    assert colors["none"] == BASELINE_COLOR and colors["softmax"] == MECHANISM_COLORS["softmax"]


def test_lemma1_axis_reaches_the_largest_value(tmp_path, monkeypatch):
    """The x axis stopped at 10 while the values reached 23.3: every bar past 10 ran to the edge alike."""
    from attnkit.analysis.plots import plot_lemma1
    from tests.runner._figures import record_figures

    figures = record_figures(monkeypatch)
    rows = [{"case": "a", "mechanism": "dnas", "min_normalized": 23.3},
            {"case": "b", "mechanism": "dnas", "min_normalized": 1.0},
            {"case": "a", "mechanism": "softmax", "min_normalized": 0.0},
            {"case": "b", "mechanism": "softmax", "min_normalized": 5e4}]  # clipped at 1e3
    plot_lemma1(rows, tmp_path / "l1.png")
    (ax,) = figures[0].axes
    low, high = ax.get_xlim()
    assert low == pytest.approx(1e-12) and high > 1e3  # the clipped bar ends inside the axis too
    assert "above 1000 at 1000" in ax.get_xlabel() and "below 1e-12 drawn at 1e-12" in ax.get_xlabel()
    plot_lemma1(rows[:3], tmp_path / "l2.png")
    assert 23.3 < figures[1].axes[0].get_xlim()[1] < 100


def test_plot_text_with_dollar_signs_is_drawn_as_written(tmp_path, monkeypatch):
    """Text between two ``$`` was read as math: "cost $5 to $10" drawn as "cost 5to10", "$x^$" an error."""
    from attnkit.analysis.plots import plot_coda_histograms, plot_lemma1
    from tests.runner._figures import assert_drawn_as_written, record_figures

    figures = record_figures(monkeypatch)
    rows = [{"case": "$x^$", "mechanism": "dnas", "min_normalized": 1.5},
            {"case": "cost $5 to $10", "mechanism": "dnas", "min_normalized": 2.0}]
    plot_lemma1(rows, tmp_path / "l1.png", title="Lemma 1 at $5")
    plot_coda_histograms({"$a$ and $b$": np.zeros(4)}, tmp_path / "coda.png", title="$x^$")
    assert_drawn_as_written(figures, ["$x^$", "cost $5 to $10", "Lemma 1 at $5", "$a$ and $b$"])


def test_log_sum_histograms_draw_only_sums_of_zero_at_floor(tmp_path, monkeypatch):
    import matplotlib.axes

    drawn = {}
    hist = matplotlib.axes.Axes.hist

    def keep(self, values, *args, label=None, **kwargs):
        drawn[label] = np.asarray(values)
        return hist(self, values, *args, label=label, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "hist", keep)
    plot_log_sum_histograms({"softmax": np.array([-69.0, -np.inf, -1.0])}, tmp_path / "h.png", floor=-50.0)
    (values,) = drawn.values()
    assert values.tolist() == [-69.0, -50.0, -1.0]  # -69 was drawn at floor with the sum of 0
