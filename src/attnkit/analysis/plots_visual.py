"""Pictures of ``lecture-visual``: attention per word, glimpse paths, DRAW windows, memory hops."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

__all__ = [
    "plot_caption_attention",
    "plot_draw_steps",
    "plot_draw_windows",
    "plot_glimpse_paths",
    "plot_memory_hops",
]


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("plots need matplotlib; pip install 'attnkit[plot]'") from exc
    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def _panel_words(vocab, ids) -> list[str]:
    """The titles of one caption's panels: its generated words through ``<eos>``, a pad or bos it generated
    shown as ``GENERATED_PAD`` / ``GENERATED_BOS`` as the scored caption shows it
    (``vocab.decode(generated=True)``); the padding after ``<eos>`` gets no panel."""
    from ..data.tokenizers import GENERATED_BOS, GENERATED_PAD

    words = []
    for i in ids:
        i = int(i)
        words.append({vocab.PAD: GENERATED_PAD, vocab.BOS: GENERATED_BOS}.get(i, vocab.words[i]))
        if i == vocab.EOS:
            break
    return words


def plot_caption_attention(model, data, indices, path: Path, max_len: int) -> Path:
    """Per test canvas: the image, then one panel per generated word with alpha upsampled over the image."""
    plt = _plt()
    indices = list(indices)
    H, W = data.images.shape[-2:]
    Hf, Wf = model.feature_grid(H, W)
    tokens, alphas = model.greedy(data.images[indices], max_len)
    cols = max_len + 1
    fig, axes = plt.subplots(len(indices), cols, figsize=(2.0 * cols, 1.6 * len(indices)), squeeze=False)
    for r, i in enumerate(indices):
        img = data.images[i, 0].numpy()
        axes[r, 0].imshow(img, cmap="gray")
        axes[r, 0].set_title(f"ref: {data.captions[i]}", fontsize=7)
        words = _panel_words(data.vocab, tokens[r])
        for t in range(max_len):
            ax = axes[r, t + 1]
            if t < len(words):
                att = alphas[r, t].view(1, 1, Hf, Wf)
                att = torch.nn.functional.interpolate(att, size=(H, W), mode="nearest")[0, 0].numpy()
                ax.imshow(img, cmap="gray")
                ax.imshow(att, cmap="jet", alpha=0.5)
                ax.set_title(words[t], fontsize=8)
        for ax in axes[r]:
            ax.axis("off")
    # hard attention reads one location (greedy returns it, one-hot); soft attention reads the alpha mix
    what = "alpha" if model.attention_mode in ("soft", "none") else "location read (argmax of alpha)"
    fig.suptitle(f"Show-Attend-Tell, {model.attention_mode} attention: {what} per generated word", fontsize=9)
    return _save(fig, path)


def plot_glimpse_paths(images, locations, glimpses, labels, predictions, path: Path) -> Path:
    """RAM, as the paper's Fig. 3: the canvas with the glimpse path, then the glimpses (finest scale in the
    centre, coarser scales upsampled around it)."""
    plt = _plt()
    B, T = locations.shape[:2]
    H, W = images.shape[-2:]
    fig, axes = plt.subplots(B, T + 1, figsize=(1.6 * (T + 1), 1.6 * B), squeeze=False)
    for b in range(B):
        ax = axes[b, 0]
        ax.imshow(images[b, 0].numpy(), cmap="gray")
        pix = ((locations[b] + 1) / 2 * torch.tensor([H - 1, W - 1])).numpy()
        ax.plot(pix[:, 1], pix[:, 0], "-o", color="lime", markersize=3, linewidth=1)
        ax.plot(pix[0, 1], pix[0, 0], "o", color="red", markersize=4)
        ax.set_title(f"label {int(labels[b])}, pred {int(predictions[b])}", fontsize=7)
        for t in range(T):
            k = glimpses.shape[2]
            size = glimpses.shape[-1]
            full = size * 2 ** (k - 1)
            canvas = np.zeros((full, full))
            for s in reversed(range(k)):  # coarse first, finer scales pasted in the centre
                side = size * 2**s
                patch = np.kron(glimpses[b, t, s, 0].numpy(), np.ones((2**s, 2**s)))
                o = full // 2 - side // 2  # where glimpse_sensor cuts it (odd sizes: not (full - side) // 2)
                canvas[o : o + side, o : o + side] = patch
            axes[b, t + 1].imshow(canvas, cmap="gray")
            axes[b, t + 1].set_title(f"glimpse {t + 1}", fontsize=7)
        for ax in axes[b]:
            ax.axis("off")
    return _save(fig, path)


def _rect(ax, window, b, N, color) -> tuple[float, float, float, float]:
    """Draw sample ``b``'s ``N x N`` window; return its box ``(x0, y0, x1, y1)`` in pixel coordinates."""
    from matplotlib import patches

    gx, gy, d = float(window.gx[b]) - 1, float(window.gy[b]) - 1, float(window.stride[b])
    half = d * N / 2
    ax.add_patch(
        patches.Rectangle(
            (gx - half, gy - half),
            2 * half,
            2 * half,
            fill=False,
            edgecolor=color,
            linewidth=max(0.5, 2.0 / (1 + float(window.sigma2[b]) ** 0.5)),
        )
    )
    return gx - half, gy - half, gx + half, gy + half


def _show_whole(ax, boxes, height: int, width: int) -> None:
    """Widen the view past the canvas to every window in ``boxes`` (``imshow`` limits it to the image, so
    a window larger than the canvas, as DRAW's first reads often are, was cut off), with the canvas framed."""
    from matplotlib import patches

    x0 = min([-0.5] + [box[0] for box in boxes]) - 0.5
    y0 = min([-0.5] + [box[1] for box in boxes]) - 0.5
    x1 = max([width - 0.5] + [box[2] for box in boxes]) + 0.5
    y1 = max([height - 0.5] + [box[3] for box in boxes]) + 0.5
    if (x0, y0, x1, y1) != (-1.0, -1.0, width, height):
        frame = patches.Rectangle((-0.5, -0.5), width, height, fill=False, edgecolor="0.6", linewidth=0.5)
        ax.add_patch(frame)
    ax.set_xlim(x0, x1)
    ax.set_ylim(y1, y0)  # image rows grow downwards


def plot_draw_windows(images, windows, path: Path) -> Path:
    """DRAW-read classifier: the read window of every step (line width ~ 1 / sigma) over the canvas."""
    plt = _plt()
    B, T = images.shape[0], len(windows)
    fig, axes = plt.subplots(B, T, figsize=(1.6 * T, 1.6 * B), squeeze=False)
    for b in range(B):
        for t, w in enumerate(windows):
            ax = axes[b, t]
            ax.imshow(images[b, 0].numpy(), cmap="gray")
            _show_whole(ax, [_rect(ax, w, b, 6, "lime")], *images.shape[-2:])
            ax.set_title(f"read {t + 1}", fontsize=7)
            ax.axis("off")
    return _save(fig, path)


def plot_draw_steps(images, out, path: Path) -> Path:
    """DRAW: the target, then the canvas after every step with its write (red) and read (green) window."""
    plt = _plt()
    B, T = images.shape[0], out.canvases.shape[1]
    fig, axes = plt.subplots(B, T + 1, figsize=(1.3 * (T + 1), 1.3 * B), squeeze=False)
    for b in range(B):
        axes[b, 0].imshow(images[b, 0].numpy(), cmap="gray", vmin=0, vmax=1)
        axes[b, 0].set_title("target", fontsize=7)
        for t in range(T):
            ax = axes[b, t + 1]
            ax.imshow(out.canvases[b, t, 0].numpy(), cmap="gray", vmin=0, vmax=1)
            boxes = [_rect(ax, out.write_windows[t], b, 4, "red"),
                     _rect(ax, out.read_windows[t], b, 4, "lime")]
            _show_whole(ax, boxes, *images.shape[-2:])
            ax.set_title(f"t={t + 1}", fontsize=7)
        for ax in axes[b]:
            ax.axis("off")
    return _save(fig, path)


def plot_memory_hops(samples, attention, vocab, predictions, path: Path) -> Path:
    """MemN2N: per story, the attention of every hop over its sentences (supporting facts marked *)."""
    plt = _plt()
    n = len(samples)
    fig, axes = plt.subplots(
        n, 1, figsize=(7.5, 0.45 * sum(len(s.story) for s in samples) + 1.2 * n), squeeze=False
    )
    for i, s in enumerate(samples):
        M = len(s.story)
        att = attention[i, :, :M].T.numpy()  # (M, K)
        ax = axes[i, 0]
        ax.imshow(att, cmap="Blues", vmin=0, vmax=1, aspect="auto")
        ax.set_yticks(range(M))
        ax.set_yticklabels(
            [("* " if m in s.supporting else "") + t for m, t in enumerate(s.story)], fontsize=7
        )
        ax.set_xticks(range(att.shape[1]))
        ax.set_xticklabels([f"hop {k + 1}" for k in range(att.shape[1])], fontsize=7)
        for m in range(M):
            for k in range(att.shape[1]):
                ax.text(k, m, f"{att[m, k]:.2f}", ha="center", va="center", fontsize=6)
        ax.set_title(f"{s.question}? answer {s.answer}, predicted {vocab[int(predictions[i])]}", fontsize=8)
    return _save(fig, path)
