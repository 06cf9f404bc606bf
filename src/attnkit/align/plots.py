"""Figures of the alignment diagnostics: a reliability diagram and MMD(q, k) per layer and head, before/after.

Both write a PNG with matplotlib's Agg backend (extra ``[plot]``) and return its path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence, Union

import torch

from ..metrics import Reliability

__all__ = ["plot_reliability", "plot_mmd_heads"]

PathLike = Union[str, Path]


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("plots need matplotlib; install it with `pip install 'attnkit[plot]'`") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def literal_text(text: object) -> str:
    """``text`` drawn as written (``$`` escaped: matplotlib reads text between two as math)."""
    from ..analysis.plots import literal_text as literal

    return literal(text)


def _png_path(path: PathLike) -> Path:
    """``path`` as written: matplotlib adds ``.png`` to a name without a suffix, so the name returned does."""
    path = Path(path)
    return path if path.suffix else path.with_name(path.name + ".png")


def plot_reliability(diagrams: Mapping[str, Reliability], path: PathLike, title: str = "Reliability") -> Path:
    """One panel per entry: accuracy per confidence bin (bars) against the diagonal, with the ECE in the
    title. Returns the path written (``.png`` added to a name without a suffix)."""
    if not isinstance(diagrams, Mapping) or not diagrams:
        raise ValueError("diagrams is empty; pass {name: attnkit.metrics.reliability(probs, labels)}")
    plt = _pyplot()
    n = len(diagrams)
    fig, axes = plt.subplots(1, n, figsize=(3.4 * n, 3.4), squeeze=False, layout="constrained")
    for ax, (name, r) in zip(axes[0], diagrams.items()):
        edges = r.edges.numpy()
        width = edges[1] - edges[0]
        filled = (r.counts > 0).numpy()
        ax.bar(
            edges[:-1][filled],
            r.accuracy.numpy()[filled],
            width=width,
            align="edge",
            color="#4c72b0",
            edgecolor="black",
            linewidth=0.5,
            label="accuracy",
        )
        ax.bar(
            edges[:-1][filled],
            (r.confidence - r.accuracy).numpy()[filled],
            bottom=r.accuracy.numpy()[filled],
            width=width,
            align="edge",
            color="#dd8452",
            alpha=0.5,
            label="gap to confidence",
        )
        ax.plot([0, 1], [0, 1], "k--", linewidth=0.8)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("confidence")
        ax.set_title(f"{literal_text(name)}: ECE {100 * r.ece:.2f}%", fontsize=9)
    axes[0][0].set_ylabel("accuracy")
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.suptitle(literal_text(title), fontsize=10)
    path = _png_path(path)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_mmd_heads(
    panels: Mapping[str, Sequence[torch.Tensor]], path: PathLike, title: str = "MMD(q, k)"
) -> Path:
    """Heat maps (layers x heads) of MMD(q, k), one panel per entry (e.g. before / after), on one color
    scale: each entry a sequence over layers of ``(H,)`` tensors. Returns the path written (``.png`` added to
    a name without a suffix)."""
    if not isinstance(panels, Mapping) or not panels:
        raise ValueError("panels is empty; pass {name: [MMD per head (H,) for each layer]}")
    for name, values in panels.items():
        shapes = {tuple(torch.as_tensor(v).shape) for v in values}
        if len(values) == 0 or len(shapes) != 1 or len(next(iter(shapes))) != 1:
            raise ValueError(
                f"panels[{name!r}] holds {len(values)} layer(s) of shapes {sorted(shapes)}; expected one "
                "(H,) tensor per layer, every layer with the same H"
            )
    plt = _pyplot()
    grids = {  # (layers, H) per panel; lists and NumPy arrays as well as tensors
        name: torch.stack([torch.as_tensor(v).detach().float().cpu() for v in values])
        for name, values in panels.items()
    }
    vmax = max(float(g.max()) for g in grids.values()) or 1.0
    n = len(grids)
    # constrained: the suptitle stood over the middle panels' titles and each "layer" label in the panel to
    # its left
    fig, axes = plt.subplots(1, n, figsize=(3.6 * n, 3.0), squeeze=False, layout="constrained")
    image = None
    for ax, (name, grid) in zip(axes[0], grids.items()):
        image = ax.imshow(grid.numpy(), vmin=0, vmax=vmax, cmap="viridis", aspect="auto")
        ax.set_xlabel("head")
        ax.set_title(f"{literal_text(name)}: total {float(grid.sum()):.3g}", fontsize=9)
    axes[0][0].set_ylabel("layer")
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8)
    fig.suptitle(literal_text(title), fontsize=10)
    path = _png_path(path)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
