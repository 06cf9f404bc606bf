"""The alignment figures: what they write, where, and what they refuse."""

from __future__ import annotations

import pytest
import torch

from attnkit.align.plots import plot_mmd_heads, plot_reliability
from attnkit.metrics import reliability

PNG = b"\x89PNG\r\n\x1a\n"


def test_the_returned_path_is_the_file_written_even_without_a_suffix(tmp_path):
    # matplotlib adds .png to a name without one, and the path returned named a file that did not exist
    torch.manual_seed(0)
    probs, labels = torch.softmax(torch.randn(50, 3), -1), torch.randint(0, 3, (50,))
    written = plot_reliability({"softmax": reliability(probs, labels)}, tmp_path / "reliability")
    assert written == tmp_path / "reliability.png" and written.read_bytes()[:8] == PNG
    heads = {"before": [torch.rand(4), torch.rand(4)], "after": [torch.rand(4), torch.rand(4)]}
    written = plot_mmd_heads(heads, tmp_path / "mmd.png")
    assert written == tmp_path / "mmd.png" and written.read_bytes()[:8] == PNG


def test_empty_or_ragged_panels_are_named():
    # matplotlib's "Number of columns must be a positive integer" or a torch.stack error before
    with pytest.raises(ValueError, match="diagrams is empty"):
        plot_reliability({}, "x.png")
    with pytest.raises(ValueError, match="panels is empty"):
        plot_mmd_heads({}, "x.png")
    with pytest.raises(ValueError, match=r"holds 2 layer\(s\) of shapes \[\(3,\), \(4,\)\]"):
        plot_mmd_heads({"after": [torch.rand(4), torch.rand(3)]}, "x.png")
    with pytest.raises(ValueError, match=r"panels\['after'\] holds 0 layer"):
        plot_mmd_heads({"after": []}, "x.png")


def test_mmd_heads_accepts_lists_and_numpy_arrays_like_tensors(tmp_path):
    # the panels were validated with torch.as_tensor, then drawn with v.float(): AttributeError on a list
    np = pytest.importorskip("numpy")
    panels = {"lists": [[0.1, 0.2], [0.3, 0.4]], "numpy": [np.array([0.1, 0.2]), np.array([0.3, 0.4])]}
    written = plot_mmd_heads(panels, tmp_path / "mmd")
    assert written == tmp_path / "mmd.png" and written.read_bytes()[:8] == PNG


def _closed_figure(monkeypatch, draw):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # kept open to measure; closed by the test
    draw()
    return figures[0]


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.parametrize("figure", ["mmd", "reliability"])
def test_the_figure_title_overlaps_no_panel_title_or_axes(monkeypatch, tmp_path, figure):
    """The MMD figure's suptitle stood over its middle panels' titles, and each panel's "layer" label ran
    into the panel to its left."""

    g = torch.Generator().manual_seed(0)
    if figure == "mmd":
        names = ("pretrained", "gan", "ot", "ct")
        panels = {n: [torch.rand(12, generator=g) for _ in range(6)] for n in names}
        fig = _closed_figure(monkeypatch, lambda: plot_mmd_heads(
            panels, tmp_path / "m", title="MiniLM-L6 on R8: MMD(q, k) per layer and head (seed 0)"))
    else:
        probs = torch.softmax(torch.randn(64, 3, generator=g), -1)
        diagrams = {n: reliability(probs, torch.randint(0, 3, (64,), generator=g)) for n in ("a", "b", "c")}
        fig = _closed_figure(monkeypatch, lambda: plot_reliability(diagrams, tmp_path / "r",
                                                                   title="calibration of every method"))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    suptitle = fig._suptitle.get_window_extent(renderer)
    axes = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    for ax in axes:
        assert not _overlap(suptitle, ax.title.get_window_extent(renderer)), ax.get_title()
        assert not _overlap(suptitle, ax.get_window_extent(renderer))
    for left, right in zip(axes, axes[1:]):
        labels = right.yaxis.label.get_window_extent(renderer) if right.get_ylabel() else None
        assert labels is None or not _overlap(labels, left.get_window_extent(renderer))
    monkeypatch.undo()
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_names_and_titles_with_dollar_signs_are_drawn_as_written(monkeypatch, tmp_path):
    """Panel names and titles went to matplotlib as they were: "$5 to $10" entered math mode."""
    panels = {"cost $5 to $10": [torch.rand(3)], "b": [torch.rand(3)]}
    fig = _closed_figure(monkeypatch, lambda: plot_mmd_heads(panels, tmp_path / "m", title="MMD $x^$"))
    fig.canvas.draw()  # "$x^$" as math fails to draw
    assert fig.axes[0].get_title().startswith(r"cost \$5 to \$10: total ")
    assert fig._suptitle.get_text() == r"MMD \$x^\$"
    probs = torch.softmax(torch.randn(16, 3), -1)
    diagrams = {"cost $5 to $10": reliability(probs, torch.randint(0, 3, (16,)))}
    fig2 = _closed_figure(monkeypatch, lambda: plot_reliability(diagrams, tmp_path / "r", title="ECE $x^$"))
    fig2.canvas.draw()
    assert fig2.axes[0].get_title().startswith(r"cost \$5 to \$10: ECE ")
    assert fig2._suptitle.get_text() == r"ECE \$x^\$"
    import matplotlib.pyplot as plt

    monkeypatch.undo()
    plt.close(fig)
    plt.close(fig2)
