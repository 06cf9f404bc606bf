"""The in-memory form of a dataset and the errors a dataset can raise.

A text-classification dataset is two lists of strings with integer labels into ``label_names``
(sentence-pair tasks carry the second sentence in ``*_text_pairs``); a sequence-to-sequence dataset
is four lists of strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

__all__ = [
    "TextClassificationData",
    "Seq2SeqData",
    "DatasetUnavailableError",
    "DatasetChecksumError",
]


class DatasetUnavailableError(FileNotFoundError):
    """A dataset cannot be had here: not in the cache, no network, or no such source file.

    The message says what is missing and the command or argument that fixes it.
    """


class DatasetChecksumError(DatasetUnavailableError):
    """A cached or freshly extracted file does not have the SHA-256 it should have."""


def _check_split(
    name: str, split: str, texts: list, labels: list, pairs: Optional[list], n_classes: int
) -> None:
    if len(texts) != len(labels):
        raise ValueError(
            f"{name}: {split} has {len(texts)} texts but {len(labels)} labels; expected one label per text"
        )
    if pairs is not None and len(pairs) != len(texts):
        raise ValueError(f"{name}: {split} has {len(texts)} texts but {len(pairs)} second texts of the pairs")
    bad = [y for y in labels if isinstance(y, bool) or not isinstance(y, int) or not 0 <= y < n_classes]
    if bad:
        raise ValueError(
            f"{name}: {split} label {bad[0]!r} is not an integer in [0, {n_classes}) "
            f"(label_names has {n_classes} entries)"
        )


@dataclass
class TextClassificationData:
    """Train/test texts with integer labels indexing ``label_names``.

    ``train_text_pairs`` / ``test_text_pairs`` hold the second sentence of sentence-pair tasks
    (MRPC, SNLI) and are ``None`` for single-text tasks.
    """

    name: str
    train_texts: list[str]
    train_labels: list[int]
    test_texts: list[str]
    test_labels: list[int]
    label_names: list[str]
    train_text_pairs: Optional[list[str]] = field(default=None, repr=False)
    test_text_pairs: Optional[list[str]] = field(default=None, repr=False)

    kind = "text-classification"

    def __post_init__(self) -> None:
        if not self.label_names:
            raise ValueError(
                f"{self.name}: label_names is empty; a classification dataset needs at least one class"
            )
        if (self.train_text_pairs is None) != (self.test_text_pairs is None):
            raise ValueError(
                f"{self.name}: give the second texts of the pairs for both splits or for neither"
            )
        n = len(self.label_names)
        _check_split(self.name, "train", self.train_texts, self.train_labels, self.train_text_pairs, n)
        _check_split(self.name, "test", self.test_texts, self.test_labels, self.test_text_pairs, n)

    @property
    def num_classes(self) -> int:
        return len(self.label_names)

    @property
    def is_pair(self) -> bool:
        return self.train_text_pairs is not None

    def joined_texts(self, split: str, sep: str = " | ") -> list[str]:
        """The texts of ``split`` (``"train"``/``"test"``), pairs joined by ``sep`` (for one-input models)."""
        if split not in ("train", "test"):
            raise ValueError(f"split={split!r}: expected 'train' or 'test'")
        texts = getattr(self, f"{split}_texts")
        pairs = getattr(self, f"{split}_text_pairs")
        if pairs is None:
            return list(texts)
        return [f"{a}{sep}{b}" for a, b in zip(texts, pairs)]

    def __repr__(self) -> str:
        return (
            f"TextClassificationData(name={self.name!r}, train={len(self.train_texts)}, "
            f"test={len(self.test_texts)}, "
            f"classes={self.num_classes}, pairs={self.is_pair})"
        )


@dataclass
class Seq2SeqData:
    """Train/test source and target strings (character-level tasks such as MLU)."""

    name: str
    train_src: list[str]
    train_tgt: list[str]
    test_src: list[str]
    test_tgt: list[str]

    kind = "seq2seq"

    def __post_init__(self) -> None:
        for split in ("train", "test"):
            src, tgt = getattr(self, f"{split}_src"), getattr(self, f"{split}_tgt")
            if len(src) != len(tgt):
                raise ValueError(f"{self.name}: {split} has {len(src)} sources but {len(tgt)} targets")

    def __repr__(self) -> str:
        return f"Seq2SeqData(name={self.name!r}, train={len(self.train_src)}, test={len(self.test_src)})"
