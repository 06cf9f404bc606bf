"""Tokenizers for the small models: a word vocabulary for text classification, characters for MLU.

Both return ``(ids, mask)``: ``ids`` a ``LongTensor (B, L)`` padded with ``pad_id``, ``mask`` a
``BoolTensor (B, L)`` with True = real token, padded to the longest sequence of the batch (at most
``max_length``); an empty text keeps one all-padding position so that ``L >= 1``.
"""

from __future__ import annotations

import functools
import numbers
import re
import unicodedata
from collections import Counter
from typing import Iterable, Optional, Sequence

import torch

from ..validators import check_bool, check_int

__all__ = ["WordTokenizer", "CharTokenizer", "pad_batch", "UNKNOWN", "GENERATED_PAD", "GENERATED_BOS",
           "GENERATED_EOS", "DISPLAY_MARKS"]

# How a decoded <unk> is shown: U+FFFD, the replacement character, which no vocabulary of ours holds (fit
# leaves it out, so that such a character in a text is <unk> too; "?" was a real token of questions and
# punctuation, and an <unk> output compared equal to it)
UNKNOWN = "\ufffd"
# how a special token a model generates where text belongs is shown (empty set, start and end triangles, which
# the plots' font draws): never skipped, and never the U+FFFD of an <unk> gold, so it cannot score as correct
GENERATED_PAD, GENERATED_BOS, GENERATED_EOS = "\u2205", "\u25b7", "\u25c1"
# Every mark decoded text shows for a special token. Scoring compares decoded text, so no character
# vocabulary (CharTokenizer, TokenVocab) holds one (fit reads them as <unk>, the constructors refuse them) and
# the metrics match them to nothing: a data character equal to a mark ("A ∩ B = ∅") made a generated <pad> an
# exact match. WordTokenizer's words may hold them (its decoded <unk> is the literal "<unk>")
DISPLAY_MARKS = (UNKNOWN, GENERATED_PAD, GENERATED_BOS, GENERATED_EOS)
_MARK_SHOWS = dict(zip(DISPLAY_MARKS, ("<unk>", "a generated <pad>", "a generated <bos>",
                                       "a CTC model's <eos>")))



@functools.cache
def _word_pattern() -> re.Pattern:
    """A word: a word character, then word characters or combining marks (Unicode categories Mn, Mc, Me:
    a vowel sign of Devanagari, an accent of decomposed text), which ``\\w`` leaves out; or one character
    that is neither (punctuation, or a mark with no word before it). Built on first use: the marks are in
    planes 0, 1 and 14 (the others hold ideographs, private use or nothing)."""
    marks, start = [], None
    for cp in [*range(0x20000), *range(0xE0000, 0xF0000), -1]:  # -1 ends the last run
        is_mark = cp >= 0 and unicodedata.category(chr(cp)) in ("Mn", "Mc", "Me")
        if is_mark and start is None:
            start = cp
        elif not is_mark and start is not None:
            marks.append(re.escape(chr(start)) + ("" if cp - 1 == start else "-" + re.escape(chr(cp - 1))))
            start = None
    return re.compile(rf"\w[\w{''.join(marks)}]*|[^\w\s]")


def pad_batch(
    sequences: Sequence[Sequence[int]], pad_id: int, max_length: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad id lists into ``ids (B, L)``, ``mask (B, L)`` (True = real); truncate at ``max_length``."""
    if max_length is not None:
        what = f"max_length={max_length!r}"
        max_length = check_int(max_length, what, "expected an integer >= 1 or None", low=1)
    pad_id = check_int(pad_id, f"pad_id={pad_id!r}", "expected an integer token id")
    sequences = [_id_list(s, f"sequence {b}")[:max_length] for b, s in enumerate(sequences)]
    L = max([len(s) for s in sequences] + [1])
    B = len(sequences)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.bool)
    for b, seq in enumerate(sequences):
        if len(seq):
            ids[b, : len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
            mask[b, : len(seq)] = True
    return ids, mask


def _id_list(ids, what: str) -> list[int]:
    """``ids`` (a list, tuple, 1-D tensor or array of integers) as a list; else a ``ValueError``."""
    values = ids.tolist() if hasattr(ids, "tolist") else ids
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValueError(f"{what} is {ids!r}; expected a sequence of integer token ids")
    values = list(values)
    bad = [i for i in values if isinstance(i, bool) or not isinstance(i, numbers.Integral)]
    if bad:
        raise ValueError(f"{what} holds {bad[0]!r}; expected integer token ids")
    return values


def _check_decode_ids(ids: list[int], vocab_size: int) -> None:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is not in the vocabulary [0, {vocab_size})")


def _refuse_marks(items: Sequence[str], what: str) -> None:
    """A ``ValueError`` if ``items`` (an alphabet or token list) hold one of ``DISPLAY_MARKS``."""
    marks = [m for m in DISPLAY_MARKS if m in items]
    if marks:  # then that special token's output and the real token would read alike
        m = marks[0]
        raise ValueError(f"{what} {m!r} (U+{ord(m):04X}), which shows {_MARK_SHOWS[m]} in decoded outputs; "
                         "fit a new vocabulary (fit reads it as <unk>); a vocabulary saved with a trained "
                         "model cannot be edited instead (removing an entry renumbers the ones after it)")


def _check_texts(texts) -> list[str]:
    if isinstance(texts, str):
        raise ValueError("expected a list of strings, got one string; wrap it: [text]")
    texts = list(texts)
    bad = [t for t in texts if not isinstance(t, str)]
    if bad:
        raise ValueError(f"expected strings, got {type(bad[0]).__name__} {bad[0]!r}")
    return texts


def _check_text(text) -> str:
    if not isinstance(text, str):
        raise ValueError(f"expected one string, got {type(text).__name__} {text!r}; use encode() for a list")
    return text


def _check_state(state, kind: str, keys: tuple[str, ...]) -> None:
    cls = {"word": "WordTokenizer", "char": "CharTokenizer"}[kind]
    if not isinstance(state, dict) or state.get("type") != kind:
        found = state.get("type") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"not a {cls} state (type={found!r}); expected the dict of {cls}.to_dict()")
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(f"{cls} state lacks {missing}; expected the dict of {cls}.to_dict()")


class WordTokenizer:
    """Lower-cased words and punctuation marks; ``<pad>`` = 0, ``<unk>`` = 1, then words by frequency."""

    PAD, UNK = "<pad>", "<unk>"

    def __init__(self, vocab: Sequence[str], lowercase: bool = True) -> None:
        vocab = list(vocab)
        if vocab[:2] != [self.PAD, self.UNK]:
            raise ValueError(f"vocab must start with {[self.PAD, self.UNK]}, got {vocab[:2]}")
        bad = [w for w in vocab if not isinstance(w, str)]
        if bad:
            raise ValueError(f"vocab holds {bad[0]!r}; expected strings")
        if len(set(vocab)) != len(vocab):
            raise ValueError("vocab has repeated entries")
        self.vocab = vocab
        self.lowercase = check_bool(lowercase, "lowercase")
        self.index = {w: i for i, w in enumerate(vocab)}
        self.pad_id, self.unk_id = 0, 1

    @classmethod
    def fit(
        cls, texts: Iterable[str], max_vocab: Optional[int] = 20000, min_freq: int = 1, lowercase: bool = True
    ) -> "WordTokenizer":
        """``<pad>``, ``<unk>`` and the ``max_vocab - 2`` most frequent words seen at least ``min_freq`` times
        (ties: first seen): ``max_vocab`` entries in all."""
        if max_vocab is not None:
            max_vocab = check_int(
                max_vocab, f"max_vocab={max_vocab!r}",
                "expected an integer >= 2 (it counts <pad> and <unk>) or None", low=2,
            )
        min_freq = check_int(min_freq, f"min_freq={min_freq!r}", "expected an integer >= 1", low=1)
        counts: Counter = Counter()
        for text in _check_texts(texts):
            counts.update(cls._split(text, lowercase))
        words = [w for w, c in counts.most_common() if c >= min_freq and w not in (cls.PAD, cls.UNK)]
        if max_vocab is not None:
            words = words[: max_vocab - 2]
        return cls([cls.PAD, cls.UNK, *words], lowercase=lowercase)

    @staticmethod
    def _split(text: str, lowercase: bool) -> list[str]:
        """The words and other characters of ``text`` in Unicode's composed form (NFC), so that decomposed
        and composed text give the same tokens; a combining mark stays in its word."""
        text = unicodedata.normalize("NFC", text)
        return _word_pattern().findall(text.lower() if lowercase else text)

    def __len__(self) -> int:
        return len(self.vocab)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def tokenize(self, text: str) -> list[str]:
        return self._split(text, self.lowercase)

    def encode_ids(self, text: str) -> list[int]:
        return [self.index.get(w, self.unk_id) for w in self.tokenize(_check_text(text))]

    def encode(
        self, texts: Sequence[str], max_length: Optional[int] = 256
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids (B, L)``, ``mask (B, L)`` True = real; ``L`` = longest text, at most ``max_length``."""
        return pad_batch([self.encode_ids(t) for t in _check_texts(texts)], self.pad_id, max_length)

    def decode(self, ids: Sequence[int]) -> str:
        """The words of one sequence ``(L,)`` joined by spaces, padding skipped."""
        ids = _id_list(ids, "ids")
        _check_decode_ids(ids, len(self.vocab))
        return " ".join(self.vocab[i] for i in ids if i != self.pad_id)

    def to_dict(self) -> dict:
        return {"type": "word", "vocab": self.vocab, "lowercase": self.lowercase}

    @classmethod
    def from_dict(cls, state: dict) -> "WordTokenizer":
        _check_state(state, "word", ("vocab", "lowercase"))
        return cls(state["vocab"], lowercase=state["lowercase"])

    def __repr__(self) -> str:
        return f"WordTokenizer(vocab_size={len(self)}, lowercase={self.lowercase})"


def _shown(i: int, vocab, unk_id: int, pad_id: int, bos_id: int) -> str:
    """Token ``i`` as shown in decoded text: ``<unk>`` as ``UNKNOWN``, a generated pad / bos as its mark."""
    marks = {unk_id: UNKNOWN, pad_id: GENERATED_PAD, bos_id: GENERATED_BOS}
    return marks.get(i, vocab[i])


class CharTokenizer:
    """Characters; ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2, ``<unk>`` = 3, then the alphabet."""

    SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
    MLU_ALPHABET = "0123456789-+*/%=,xy"

    def __init__(self, alphabet: Iterable[str] = MLU_ALPHABET) -> None:
        chars = list(dict.fromkeys(alphabet))
        bad = [c for c in chars if not isinstance(c, str) or len(c) != 1]
        if bad:
            raise ValueError(f"alphabet must be single characters, got {bad[:3]}")
        _refuse_marks(chars, "alphabet holds")
        self.chars = chars
        self.vocab = [*self.SPECIALS, *chars]
        self.index = {c: i + len(self.SPECIALS) for i, c in enumerate(chars)}
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = 0, 1, 2, 3

    @classmethod
    def fit(cls, texts: Iterable[str]) -> "CharTokenizer":
        """The characters of ``texts`` in sorted order; a display mark in a text reads as ``<unk>``."""
        return cls(sorted({c for t in _check_texts(texts) for c in t} - set(DISPLAY_MARKS)))

    def __len__(self) -> int:
        return len(self.vocab)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode_ids(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = [self.index.get(c, self.unk_id) for c in _check_text(text)]
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

    def decode(self, ids, generated: bool = False) -> list[str]:
        """Strings of a batch ``(B, L)`` (a list of ``B``) or one sequence ``(L,)`` (a list of one): stop at
        ``<eos>``, skip pad/bos. A tensor or array says which by its dimensions, so an empty ``(0,)`` is one
        empty string; a plain empty list ``[]`` is a batch of none.

        ``generated=True`` reads a model's output (no ``<bos>`` in front): a ``<pad>`` or ``<bos>`` it
        generated before ``<eos>`` is shown as ``GENERATED_PAD`` / ``GENERATED_BOS`` (U+2205 / U+25B7), so
        that it never scores as correct (skipped, ``-<bos>99`` read as ``-99``; U+FFFD is an ``<unk>``
        gold's)."""
        check_bool(generated, f"generated={generated!r}")
        rows = ids.tolist() if hasattr(ids, "tolist") else ids
        if isinstance(rows, (str, bytes)) or not isinstance(rows, Iterable):
            raise ValueError(f"ids is {ids!r}; expected a batch (B, L) or one sequence (L,) of token ids")
        rows = list(rows)
        single = getattr(ids, "ndim", None) == 1 or bool(rows) and not isinstance(rows[0], Iterable)
        out = []
        for b, row in enumerate([rows] if single else rows):
            row = _id_list(row, "ids" if single else f"ids row {b}")
            _check_decode_ids(row, len(self.vocab))
            chars = []
            for i in row:
                if i == self.eos_id:
                    break
                if i in (self.pad_id, self.bos_id) and not generated:
                    continue
                chars.append(_shown(i, self.vocab, self.unk_id, self.pad_id, self.bos_id))
            out.append("".join(chars))
        return out

    def to_dict(self) -> dict:
        return {"type": "char", "alphabet": "".join(self.chars)}

    @classmethod
    def from_dict(cls, state: dict) -> "CharTokenizer":
        _check_state(state, "char", ("alphabet",))
        if not isinstance(state["alphabet"], str):
            raise ValueError(f"CharTokenizer state: alphabet is {state['alphabet']!r}; expected a string")
        return cls(state["alphabet"])

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={len(self)})"
