"""Figures of ``report.html``: every text inside the picture, titles that say what is drawn, and the hybrid
weight's trajectory from where training starts."""

from __future__ import annotations

import pytest

from tests.runner._figures import record_figures

MECHS = ["softmax", "dnas", "hnas", "sinkhorn", "coda", "none"]
NEWSGROUPS = ["comp.os.ms-windows.misc", "comp.sys.ibm.pc.hardware", "soc.religion.christian",
              "talk.politics.mideast", "talk.politics.misc", "talk.religion.misc", "rec.sport.baseball",
              "sci.electronics"]


def record_drawn_texts(monkeypatch) -> list:
    """``(text, window extent, figure box)`` of every text of the latest figure draw, in the pixels of that
    draw: the one a file was written from (``bbox_inches="tight"`` draws once to measure, then crops the
    figure box). A tick label the axis does not draw, beyond its limits, is left out."""
    from matplotlib.figure import Figure
    from matplotlib.text import Text

    drawn: list = []
    draw_text, draw_figure = Text.draw, Figure.draw

    def text(self, renderer):
        if self.get_visible() and self.get_text() and self.figure is not None:
            box = self.figure.bbox
            drawn.append((self.get_text(), self.get_window_extent(renderer).frozen(), box.frozen()))
        return draw_text(self, renderer)

    def figure(self, renderer):
        drawn.clear()
        return draw_figure(self, renderer)

    monkeypatch.setattr(Text, "draw", text)
    monkeypatch.setattr(Figure, "draw", figure)
    return drawn


def texts_outside(drawn: list) -> list:
    """The ``(text, extents)`` of ``drawn`` (``record_drawn_texts``) not wholly inside their figure."""
    out = []
    for text, e, box in drawn:
        if e.x0 < box.x0 - 0.5 or e.y0 < box.y0 - 0.5 or e.x1 > box.x1 + 0.5 or e.y1 > box.y1 + 0.5:
            out.append((text, tuple(round(v) for v in e.extents), tuple(round(v) for v in box.extents)))
    return out


def _per_class(names: list[str], mechs: list[str]) -> dict:
    k = len(names)
    return {m: {"classes": [{"name": n} for n in names], "confusion": [[5] * k for _ in range(k)]}
            for m in mechs}


@pytest.mark.parametrize("names, mechs", [
    (["negative", "positive"], MECHS),
    (["entailment", "neutral", "contradiction", "other"], MECHS[:4]),
    (NEWSGROUPS, MECHS[:2]),
])
def test_confusion_matrices_keep_every_text_inside_the_figure(tmp_path, monkeypatch, names, mechs):
    """With 2 classes and 6 mechanisms the mechanism titles stood 4 px above the top of the picture (hnas
    read as "nnas"); tight_layout laid the panels out before imshow's equal aspect moved their tops."""
    from attnkit.runner.report_extras import plot_confusions

    figures, drawn = record_figures(monkeypatch), record_drawn_texts(monkeypatch)
    assert plot_confusions(tmp_path / "c.png", _per_class(names, mechs))
    assert drawn
    assert texts_outside(drawn) == []
    titles = [ax.get_title() for ax in figures[-1].axes]
    assert titles == mechs


def _runs(metric: str, seeds: int) -> list[dict]:
    runs = []
    for mech in ("softmax", "hnas"):
        for seed in range(seeds):
            history = [{"step": s, metric: 0.1 * s + 0.01 * seed} for s in (1, 2, 3)]
            runs.append({"mechanism": mech, "seed": seed, "history": history,
                         "step_losses": [1.0, 0.9, 0.8, 0.7, 0.6, 0.5]})
    return runs


@pytest.mark.parametrize("metric", ["accuracy", "sequence_error_rate", "sequence_accuracy"])
def test_learning_curve_titles_stay_inside_the_figure(tmp_path, monkeypatch, metric):
    """"evaluation sequence_error_rate (mean; band: range over 2 seeds)" ran 28 px past the right edge."""
    from attnkit.runner.report_extras import plot_learning_curves_band

    figures, drawn = record_figures(monkeypatch), record_drawn_texts(monkeypatch)
    plot_learning_curves_band(tmp_path / "lc.png", _runs(metric, 2), ("softmax", "hnas"), metric)
    fig = figures[-1]
    assert drawn
    assert texts_outside(drawn) == []
    titles = " ".join(ax.get_title() for ax in fig.axes)
    assert metric in titles and "range over 2 seeds" in titles


def test_learning_curve_titles_name_no_band_at_one_seed(tmp_path, monkeypatch):
    """One seed per mechanism drew no band but the titles said "band: range over 1 seeds"."""
    from attnkit.runner.report_extras import plot_learning_curves_band

    figures = record_figures(monkeypatch)
    plot_learning_curves_band(tmp_path / "lc.png", _runs("accuracy", 1), ("softmax", "hnas"), "accuracy")
    titles = [ax.get_title() for ax in figures[-1].axes]
    assert not any("band" in t or "seeds" in t for t in titles), titles
    assert any("one seed" in t for t in titles), titles


def test_hybrid_weights_start_at_step_zero_with_u0(tmp_path, monkeypatch):
    """The curve began at the first evaluation (step 15 of 30): u0 = 0.5 at step 0 was not drawn."""
    from attnkit.registry import resolve_mechanism
    from attnkit.runner.report import plot_hybrid

    figures = record_figures(monkeypatch)
    history = [{"step": s, "hybrid_u": [[0.4, 0.6], [0.3, 0.7]]} for s in (15, 30)]
    runs = [{"mechanism": "hnas+ct", "seed": 1, "history": history}]
    assert plot_hybrid(tmp_path / "u.png", runs)
    u0 = resolve_mechanism("hnas").u0
    lines = [line for ax in figures[-1].axes for line in ax.get_lines() if len(line.get_xdata()) > 2]
    assert len(lines) == 4  # 2 layers x 2 heads
    for line in lines:
        assert list(line.get_xdata()) == [0, 15, 30]
        assert line.get_ydata()[0] == pytest.approx(u0)
    # the same step axis as the learning curves beside it ("training step" before)
    assert {ax.get_xlabel() for ax in figures[-1].axes if ax.get_visible() and ax.lines} == {"optimizer step"}


def test_compare_models_start_at_the_registry_u0():
    """plot_hybrid draws u0 from the registry at step 0: results.json does not record it, and compare
    builds hnas by name, so every hybrid weight starts at ``resolve_mechanism("hnas").u0``."""
    import torch

    from attnkit.models import TransformerClassifier
    from attnkit.registry import resolve_mechanism
    from attnkit.runner.train import hybrid_u

    torch.manual_seed(0)
    model = TransformerClassifier(vocab_size=20, num_classes=2, d_model=16, nhead=2, num_layers=2,
                                  dim_feedforward=16, dropout=0.0, mechanism="hnas", max_len=8, pad_id=0)
    u = hybrid_u(model)  # (layers, heads)
    assert len(u) == 2 and all(row == pytest.approx([resolve_mechanism("hnas").u0] * 2) for row in u)
