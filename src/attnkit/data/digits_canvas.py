"""Canvases of scikit-learn's bundled 8x8 digits: captioned multi-digit scenes, cluttered/translated digits.

The images are sklearn's ``load_digits`` (1797 handwritten digits, 8x8, intensities 0-16, scaled here to
[0, 1]); nothing is downloaded. Digits are split by index into train/test pools before any canvas is made,
so test canvases only contain digit images never seen in training.

- :func:`caption_canvases`: ``n`` digits placed in the cells of a ``rows x cols`` grid (with a random
  jitter inside each cell); the caption is the digit words in reading order (row by row, left to right),
  e.g. ``"three seven one"``. With ``relations=True`` the words of two digits in one row are joined by
  ``"left of"`` and a row change by ``"above"``: ``"three left of seven above one"``.
- :func:`cluttered_canvases`: one digit at a random position of a larger canvas plus clutter (random
  4x4 crops of other digits), the translated/cluttered task of "Recurrent Models of Visual Attention"
  (Mnih et al., 2014, arXiv:1406.6247) at the scale of these images.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from torch import Tensor

from ..validators import check_int, check_seed

__all__ = [
    "DIGIT_WORDS",
    "CaptionCanvases",
    "CaptionVocab",
    "caption_canvases",
    "cluttered_canvases",
    "load_digit_images",
]

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


@lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError(
            "the digits canvases need scikit-learn (its bundled digits images); pip install 'attnkit[vision]'"
        ) from exc
    data = load_digits()
    return (data.images / 16.0).astype(np.float32), data.target.astype(np.int64)


def load_digit_images(split: str = "train", test_fraction: float = 0.3) -> tuple[np.ndarray, np.ndarray]:
    """The 8x8 digit images ``(N, 8, 8)`` in [0, 1] and labels ``(N,)`` of one split (a fixed index split)."""
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r}; expected 'train' or 'test'")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction!r}; expected a fraction in (0, 1)")
    images, labels = _digits()
    cut = round(len(images) * (1 - test_fraction))
    return (images[:cut], labels[:cut]) if split == "train" else (images[cut:], labels[cut:])


class CaptionVocab:
    """Word <-> id: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, then the digit words and the relation words."""

    PAD, BOS, EOS = 0, 1, 2

    def __init__(self) -> None:
        self.words = ["<pad>", "<bos>", "<eos>", *DIGIT_WORDS, "left", "of", "above"]
        self.index = {w: i for i, w in enumerate(self.words)}

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, caption: str, max_len: int) -> list[int]:
        """Word ids followed by ``<eos>`` and padding to ``max_len``."""
        ids = [self.index[w] for w in caption.split()] + [self.EOS]
        if len(ids) > max_len:
            raise ValueError(f"caption {caption!r} needs {len(ids)} tokens; max_len={max_len} is too short")
        return ids + [self.PAD] * (max_len - len(ids))

    def decode(self, ids, generated: bool = False) -> str:
        """The words up to ``<eos>``, pad and bos skipped; ``generated=True`` (a model's caption) shows a pad
        or bos it generated as ``GENERATED_PAD`` / ``GENERATED_BOS`` instead (skipped, it scored as exact)."""
        from ..validators import check_bool
        from .tokenizers import GENERATED_BOS, GENERATED_PAD

        check_bool(generated, f"generated={generated!r}")
        words = []
        for i in ids:
            i = int(i)
            if i == self.EOS:
                break
            if i not in (self.PAD, self.BOS):
                words.append(self.words[i])
            elif generated:
                words.append(GENERATED_PAD if i == self.PAD else GENERATED_BOS)
        return " ".join(words)


@dataclass
class CaptionCanvases:
    """``images (N, 1, H, W)``, ``tokens (N, T)`` (word ids + eos + pad), ``captions`` (strings),
    ``digits`` (per canvas: list of ``(label, row, col)`` in reading order), ``vocab``."""

    images: Tensor
    tokens: Tensor
    captions: list[str]
    digits: list[list[tuple[int, int, int]]]
    vocab: CaptionVocab


def _caption(placed: list[tuple[int, int, int]], relations: bool) -> str:
    words = []
    for k, (label, row, _) in enumerate(placed):
        if k and relations:
            words += ["left", "of"] if row == placed[k - 1][1] else ["above"]
        words.append(DIGIT_WORDS[label])
    return " ".join(words)


def caption_canvases(
    num: int,
    *,
    split: str = "train",
    rows: int = 2,
    cols: int = 3,
    min_digits: int = 2,
    max_digits: int = 4,
    cell: int = 12,
    relations: bool = False,
    seed: int = 0,
) -> CaptionCanvases:
    """``num`` canvases of ``rows*cell x cols*cell`` pixels, each with ``min_digits..max_digits`` digits."""
    check_int(num, f"num={num!r}", "expected a positive number of canvases", low=1)
    for name, value in (("rows", rows), ("cols", cols), ("min_digits", min_digits),
                        ("max_digits", max_digits), ("cell", cell)):
        check_int(value, f"{name}={value!r}", "expected an integer")
    if not 1 <= min_digits <= max_digits <= rows * cols:
        raise ValueError(
            f"min_digits={min_digits}, max_digits={max_digits}; "
            f"expected 1 <= min <= max <= rows*cols = {rows * cols}"
        )
    if cell < 8:
        raise ValueError(f"cell={cell}; expected >= 8 (the digits are 8x8)")
    images, labels = load_digit_images(split)
    rng = np.random.default_rng(check_seed(seed))  # None would seed from the OS: different canvases each call
    H, W = rows * cell, cols * cell
    canvases = np.zeros((num, 1, H, W), dtype=np.float32)
    vocab, captions, digits = CaptionVocab(), [], []
    for n in range(num):
        k = int(rng.integers(min_digits, max_digits + 1))
        slots = np.sort(rng.choice(rows * cols, size=k, replace=False))  # reading order = slot order
        placed = []
        for slot in slots:
            r, c = divmod(int(slot), cols)
            i = int(rng.integers(len(images)))
            dy, dx = rng.integers(0, cell - 8 + 1, size=2)
            y, x = r * cell + int(dy), c * cell + int(dx)
            canvases[n, 0, y : y + 8, x : x + 8] = np.maximum(canvases[n, 0, y : y + 8, x : x + 8], images[i])
            placed.append((int(labels[i]), r, c))
        captions.append(_caption(placed, relations))
        digits.append(placed)
    words_per_digit = 3 if relations else 1
    max_len = max_digits * words_per_digit + 1
    tokens = torch.tensor([vocab.encode(c, max_len) for c in captions], dtype=torch.long)
    return CaptionCanvases(torch.from_numpy(canvases), tokens, captions, digits, vocab)


def cluttered_canvases(
    num: int,
    *,
    split: str = "train",
    size: int = 28,
    clutter: int = 4,
    seed: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """``num`` canvases ``(num, 1, size, size)`` with one digit at a random position and ``clutter`` random
    4x4 fragments of other digits; returns ``(images, labels (num,), centres (num, 2) as (y, x) pixels)``."""
    check_int(num, f"num={num!r}", "expected a positive number of canvases", low=1)
    for name, value in (("size", size), ("clutter", clutter)):
        check_int(value, f"{name}={value!r}", "expected an integer")
    if size < 8:
        raise ValueError(f"size={size}; expected >= 8 (the digits are 8x8)")
    if clutter < 0:
        raise ValueError(f"clutter={clutter}; expected >= 0")
    images, labels = load_digit_images(split)
    rng = np.random.default_rng(check_seed(seed))  # None would seed from the OS: different canvases each call
    out = np.zeros((num, 1, size, size), dtype=np.float32)
    ys = np.zeros(num, dtype=np.int64)
    centres = np.zeros((num, 2), dtype=np.float32)
    for n in range(num):
        for _ in range(clutter):
            j = int(rng.integers(len(images)))
            fy, fx = rng.integers(0, 5, size=2)
            py, px = rng.integers(0, size - 4 + 1, size=2)
            patch = images[j, fy : fy + 4, fx : fx + 4]
            out[n, 0, py : py + 4, px : px + 4] = np.maximum(out[n, 0, py : py + 4, px : px + 4], patch)
        i = int(rng.integers(len(images)))
        y, x = rng.integers(0, size - 8 + 1, size=2)
        out[n, 0, y : y + 8, x : x + 8] = np.maximum(out[n, 0, y : y + 8, x : x + 8], images[i])
        ys[n] = labels[i]
        centres[n] = (y + 3.5, x + 3.5)
    return torch.from_numpy(out), torch.from_numpy(ys), torch.from_numpy(centres)
