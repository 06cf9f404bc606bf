"""Tokenizers for the small models: a word vocabulary for text classification, characters for MLU.

Both return ``(ids, mask)``: ``ids`` a ``LongTensor (B, L)`` padded with ``pad_id``, ``mask`` a
``BoolTensor (B, L)`` with True = real token, padded to the longest sequence of the batch (at most
``max_length``); an empty text keeps one all-padding position so that ``L >= 1``.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Iterable, Optional, Sequence

import torch

__all__ = ["WordTokenizer", "CharTokenizer", "pad_batch"]

_WORD = re.compile(r"\w+|[^\w\s]", re.UNICODE)


def pad_batch(
    sequences: Sequence[Sequence[int]], pad_id: int, max_length: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad id lists into ``ids (B, L)``, ``mask (B, L)`` (True = real); truncate at ``max_length``."""
    if max_length is not None and (
        isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1
    ):
        raise ValueError(f"max_length={max_length!r}: expected an integer >= 1 or None")
    if max_length is not None:
        sequences = [list(s)[:max_length] for s in sequences]
    L = max([len(s) for s in sequences] + [1])
    B = len(sequences)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.bool)
    for b, seq in enumerate(sequences):
        if len(seq):
            ids[b, : len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
            mask[b, : len(seq)] = True
    return ids, mask


def _check_texts(texts) -> list[str]:
    if isinstance(texts, str):
        raise ValueError("expected a list of strings, got one string; wrap it: [text]")
    texts = list(texts)
    bad = [t for t in texts if not isinstance(t, str)]
    if bad:
        raise ValueError(f"expected strings, got {type(bad[0]).__name__} {bad[0]!r}")
    return texts


class WordTokenizer:
    """Lower-cased words and punctuation marks; ``<pad>`` = 0, ``<unk>`` = 1, then words by frequency."""

    PAD, UNK = "<pad>", "<unk>"

    def __init__(self, vocab: Sequence[str], lowercase: bool = True) -> None:
        vocab = list(vocab)
        if vocab[:2] != [self.PAD, self.UNK]:
            raise ValueError(f"vocab must start with {[self.PAD, self.UNK]}, got {vocab[:2]}")
        if len(set(vocab)) != len(vocab):
            raise ValueError("vocab has repeated entries")
        self.vocab = vocab
        self.lowercase = lowercase
        self.index = {w: i for i, w in enumerate(vocab)}
        self.pad_id, self.unk_id = 0, 1

    @classmethod
    def fit(
        cls, texts: Iterable[str], max_vocab: Optional[int] = 20000, min_freq: int = 1, lowercase: bool = True
    ) -> "WordTokenizer":
        """The ``max_vocab`` most frequent words seen at least ``min_freq`` times (ties: first seen)."""
        if max_vocab is not None and (
            isinstance(max_vocab, bool) or not isinstance(max_vocab, int) or max_vocab < 2
        ):
            raise ValueError(
                f"max_vocab={max_vocab!r}: expected an integer >= 2 (it counts <pad> and <unk>) or None"
            )
        if isinstance(min_freq, bool) or not isinstance(min_freq, int) or min_freq < 1:
            raise ValueError(f"min_freq={min_freq!r}: expected an integer >= 1")
        counts: Counter = Counter()
        for text in _check_texts(texts):
            counts.update(cls._split(text, lowercase))
        words = [w for w, c in counts.most_common() if c >= min_freq and w not in (cls.PAD, cls.UNK)]
        if max_vocab is not None:
            words = words[: max_vocab - 2]
        return cls([cls.PAD, cls.UNK, *words], lowercase=lowercase)

    @staticmethod
    def _split(text: str, lowercase: bool) -> list[str]:
        return _WORD.findall(text.lower() if lowercase else text)

    def __len__(self) -> int:
        return len(self.vocab)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def tokenize(self, text: str) -> list[str]:
        return self._split(text, self.lowercase)

    def encode_ids(self, text: str) -> list[int]:
        return [self.index.get(w, self.unk_id) for w in self.tokenize(text)]

    def encode(
        self, texts: Sequence[str], max_length: Optional[int] = 256
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids (B, L)``, ``mask (B, L)`` True = real; ``L`` = longest text, at most ``max_length``."""
        return pad_batch([self.encode_ids(t) for t in _check_texts(texts)], self.pad_id, max_length)

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(
            self.vocab[i] for i in (ids.tolist() if torch.is_tensor(ids) else ids) if i != self.pad_id
        )

    def to_dict(self) -> dict:
        return {"type": "word", "vocab": self.vocab, "lowercase": self.lowercase}

    @classmethod
    def from_dict(cls, state: dict) -> "WordTokenizer":
        if state.get("type") != "word":
            raise ValueError(f"not a WordTokenizer state (type={state.get('type')!r})")
        return cls(state["vocab"], lowercase=state["lowercase"])

    def __repr__(self) -> str:
        return f"WordTokenizer(vocab_size={len(self)}, lowercase={self.lowercase})"


class CharTokenizer:
    """Characters; ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2, ``<unk>`` = 3, then the alphabet."""

    SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
    MLU_ALPHABET = "0123456789-+*/%=,xy"

    def __init__(self, alphabet: Iterable[str] = MLU_ALPHABET) -> None:
        chars = list(dict.fromkeys(alphabet))
        if any(len(c) != 1 for c in chars):
            raise ValueError(
                f"alphabet must be single characters, got {[c for c in chars if len(c) != 1][:3]}"
            )
        self.chars = chars
        self.vocab = [*self.SPECIALS, *chars]
        self.index = {c: i + len(self.SPECIALS) for i, c in enumerate(chars)}
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = 0, 1, 2, 3

    @classmethod
    def fit(cls, texts: Iterable[str]) -> "CharTokenizer":
        """The characters of ``texts`` in sorted order."""
        return cls(sorted({c for t in _check_texts(texts) for c in t}))

    def __len__(self) -> int:
        return len(self.vocab)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode_ids(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = [self.index.get(c, self.unk_id) for c in text]
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def encode(
        self,
        texts: Sequence[str],
        max_length: Optional[int] = None,
        add_bos: bool = False,
        add_eos: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids (B, L)``, ``mask (B, L)`` True = real, with optional ``<bos>``/``<eos>`` around each text."""
        seqs = [self.encode_ids(t, add_bos, add_eos) for t in _check_texts(texts)]
        return pad_batch(seqs, self.pad_id, max_length)

    def decode(self, ids) -> list[str]:
        """Strings of a batch ``(B, L)`` or one sequence ``(L,)``: stop at ``<eos>``, skip pad/bos."""
        rows = ids.tolist() if torch.is_tensor(ids) else list(ids)
        single = bool(rows) and not isinstance(rows[0], (list, tuple))
        out = []
        for row in [rows] if single else rows:
            chars = []
            for i in row:
                if i == self.eos_id:
                    break
                if i in (self.pad_id, self.bos_id):
                    continue
                chars.append(self.vocab[i] if i != self.unk_id else "?")
            out.append("".join(chars))
        return out

    def to_dict(self) -> dict:
        return {"type": "char", "alphabet": "".join(self.chars)}

    @classmethod
    def from_dict(cls, state: dict) -> "CharTokenizer":
        if state.get("type") != "char":
            raise ValueError(f"not a CharTokenizer state (type={state.get('type')!r})")
        return cls(state["alphabet"])

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={len(self)})"
