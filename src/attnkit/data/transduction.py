"""Token vocabularies and metrics for the transduction tasks (grapheme-to-phoneme, number words,
copy/reverse/sort).

Sources are split into characters; targets into whitespace-separated tokens (g2p's phonemes, numbers' words)
or, for copy/reverse/sort, into characters (``attnkit.runner.transduction.TRANSDUCTION_TASKS`` says which), so
one ``Seq2SeqData`` of strings serves every task. Metrics: sequence error rate (share
of
outputs that are not exactly right) and token error rate (Levenshtein distance over the reference length, the
phoneme error rate of G2P).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from torch import Tensor

from ..validators import check_bool
from .tokenizers import (
    DISPLAY_MARKS, GENERATED_EOS, _check_decode_ids, _check_text, _check_texts, _refuse_marks, _shown,
    pad_batch,
)

__all__ = ["TokenVocab", "edit_distance", "token_error_rate", "sequence_error_rate", "SPLITS"]

SPLITS = ("chars", "words")


class TokenVocab:
    """``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2, ``<unk>`` = 3, then the tokens; ``split`` is ``chars`` or
    ``words`` (whitespace)."""

    SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")

    def __init__(self, tokens: Iterable[str], split: str) -> None:
        if split not in SPLITS:
            raise ValueError(f"split={split!r}: expected one of {SPLITS}")
        self.split = split
        self.tokens = list(dict.fromkeys(tokens))
        _refuse_marks(self.tokens, "tokens hold")
        self.vocab = [*self.SPECIALS, *self.tokens]
        self.index = {t: i + len(self.SPECIALS) for i, t in enumerate(self.tokens)}
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = 0, 1, 2, 3

    @classmethod
    def fit(cls, texts: Iterable[str], split: str) -> TokenVocab:
        tokens = set()
        for text in _check_texts(texts):
            tokens.update(cls.tokenize_with(text, split))
        # a display mark in a text (U+FFFD: undecodable bytes) reads as <unk>
        return cls(sorted(tokens - set(DISPLAY_MARKS)), split)

    @staticmethod
    def tokenize_with(text: str, split: str) -> list[str]:
        return list(text) if split == "chars" else text.split()

    def tokenize(self, text: str) -> list[str]:
        return self.tokenize_with(_check_text(text), self.split)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode_ids(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = [self.index.get(t, self.unk_id) for t in self.tokenize(text)]
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def encode(
        self, texts: Sequence[str], add_bos: bool = False, add_eos: bool = False
    ) -> tuple[Tensor, Tensor]:
        """``ids (N, L)`` and ``mask (N, L)`` (True = real)."""
        return pad_batch([self.encode_ids(t, add_bos, add_eos) for t in _check_texts(texts)], self.pad_id)

    def decode_ids(self, ids: Iterable[int], generated: bool = False, eos_ends: bool = True) -> list[str]:
        """Tokens up to the first ``<eos>``; pad and bos skipped, ``<unk>`` shown as ``UNKNOWN`` (U+FFFD); an
        id outside the vocabulary is a ``ValueError``. ``generated=True`` reads a model's output: a pad or bos
        it generated before ``<eos>`` is shown as ``GENERATED_PAD`` / ``GENERATED_BOS``, never skipped (it
        would score as correct). ``eos_ends=False`` with ``generated=True`` (a CTC model, which never learns
        to end with ``<eos>``) shows an ``<eos>`` as ``GENERATED_EOS`` and reads on; a reference
        (``generated=False``) always ends at its ``<eos>`` and never shows a mark for a special token."""
        check_bool(generated, f"generated={generated!r}")
        check_bool(eos_ends, f"eos_ends={eos_ends!r}")
        ids = list(ids)
        _check_decode_ids(ids, len(self.vocab))
        out = []
        for i in ids:
            if i == self.eos_id and (eos_ends or not generated):
                break
            if i in (self.pad_id, self.bos_id) and not generated:
                continue
            out.append(GENERATED_EOS if i == self.eos_id else
                       _shown(i, self.vocab, self.unk_id, self.pad_id, self.bos_id))
        return out

    def join(self, tokens: Sequence[str]) -> str:
        return "".join(tokens) if self.split == "chars" else " ".join(tokens)


def edit_distance(a: Sequence, b: Sequence) -> int:
    """Levenshtein distance (insertions, deletions, substitutions of one token each cost 1)."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, y in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y))
        prev = cur
    return prev[-1]


def token_error_rate(refs: Sequence[Sequence], hyps: Sequence[Sequence]) -> float:
    """Total edit distance over total reference length (the phoneme / word error rate)."""
    if len(refs) != len(hyps):
        raise ValueError(
            f"{len(refs)} references but {len(hyps)} hypotheses; pass one hypothesis per reference"
        )
    total = sum(len(r) for r in refs)
    return sum(edit_distance(r, h) for r, h in zip(refs, hyps)) / max(1, total)


def sequence_error_rate(refs: Sequence[Sequence], hyps: Sequence[Sequence]) -> float:
    """Share of hypotheses that differ from their reference."""
    if len(refs) != len(hyps):
        raise ValueError(
            f"{len(refs)} references but {len(hyps)} hypotheses; pass one hypothesis per reference"
        )
    return sum(list(r) != list(h) for r, h in zip(refs, hyps)) / max(1, len(refs))
