"""Helpers for tests of plots: keep every figure a plot function saves, and check that a user's text is drawn
as written (matplotlib reads the text between two ``$`` as math unless told otherwise)."""

from __future__ import annotations

import pytest


def record_figures(monkeypatch) -> list:
    """The matplotlib figures saved from now on, in order (the plot functions close theirs after saving)."""
    from matplotlib.figure import Figure

    saved: list = []
    original = Figure.savefig

    def savefig(self, *args, **kwargs):
        saved.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def assert_drawn_as_written(figures: list, expected: list[str]) -> None:
    """Each string of ``expected`` is drawn in one of ``figures`` at exactly the size of the same string with
    math mode off: "cost $5 to $10" read as math is drawn as the narrower "cost 5to10"."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    for s in expected:
        sizes = []
        for fig in figures:
            renderer = FigureCanvasAgg(fig).get_renderer()  # a closed figure has lost its canvas
            for t in fig.findobj(Text):
                if not t.get_visible() or t.get_text().replace("\\$", "$") != s:
                    continue
                ref = fig.text(0, 0, s, parse_math=False, fontproperties=t.get_fontproperties(),
                               rotation=t.get_rotation())
                sizes.append((tuple(t.get_window_extent(renderer).size),
                              tuple(ref.get_window_extent(renderer).size)))
                ref.remove()
        assert sizes, f"{s!r} is not drawn in any figure"
        for drawn, literal in sizes:
            assert drawn == pytest.approx(literal, abs=0.5), f"{s!r} drawn at {drawn}, as written {literal}"
