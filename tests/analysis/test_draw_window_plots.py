"""The DRAW pictures show each window whole, also where it is larger than the canvas."""

from __future__ import annotations

from types import SimpleNamespace

import torch

import attnkit.analysis.plots_visual as plots_visual


def _window(gx, gy, stride, sigma2=1.0):
    return SimpleNamespace(gx=torch.tensor([gx]), gy=torch.tensor([gy]), stride=torch.tensor([stride]),
                           sigma2=torch.tensor([sigma2]))


def _drawn_axes(monkeypatch, plot, *args):
    figures = []
    monkeypatch.setattr(plots_visual, "_save", lambda fig, path: figures.append(fig) or path)
    plot(*args)
    return figures[0].axes


def _inside(ax, box) -> bool:
    (x0, x1), (y1, y0) = ax.get_xlim(), ax.get_ylim()  # y inverted: rows grow downwards
    return x0 <= box[0] and box[2] <= x1 and y0 <= box[1] and box[3] <= y1


def test_a_read_window_larger_than_the_canvas_is_shown_whole(monkeypatch, tmp_path):
    """imshow limited the view to the 28-pixel canvas: the first reads of lecture-visual's DRAW classifier
    (stride ~ 8, a 48-pixel window of 6 x 6 filters) were cut off at the canvas edges."""
    images = torch.rand(1, 1, 28, 28)
    big, small = _window(14.5, 14.5, 8.0), _window(10.0, 20.0, 1.0)
    (ax_big, ax_small) = _drawn_axes(monkeypatch, plots_visual.plot_draw_windows, images, [big, small],
                                     tmp_path / "w.png")
    half = 8.0 * 6 / 2
    assert _inside(ax_big, (13.5 - half, 13.5 - half, 13.5 + half, 13.5 + half))
    assert _inside(ax_big, (-0.5, -0.5, 27.5, 27.5))
    assert ax_small.get_xlim() == (-1.0, 28.0) and ax_small.get_ylim() == (28.0, -1.0)  # the canvas alone


def test_draw_steps_show_both_windows_whole(monkeypatch, tmp_path):
    images = torch.rand(1, 1, 28, 28)
    out = SimpleNamespace(canvases=torch.rand(1, 1, 1, 28, 28), write_windows=[_window(2.0, 2.0, 6.0)],
                          read_windows=[_window(27.0, 27.0, 5.0)])
    axes = _drawn_axes(monkeypatch, plots_visual.plot_draw_steps, images, out, tmp_path / "s.png")
    assert _inside(axes[1], (1.0 - 12.0, 1.0 - 12.0, 1.0 + 12.0, 1.0 + 12.0))
    assert _inside(axes[1], (26.0 - 10.0, 26.0 - 10.0, 26.0 + 10.0, 26.0 + 10.0))
