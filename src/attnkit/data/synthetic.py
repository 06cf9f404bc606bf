"""Synthetic transduction controls: copy, reverse and sort a string of symbols.

``copy`` has a diagonal (monotonic) alignment, ``reverse`` an anti-diagonal one, ``sort`` a content-defined
one
(each output symbol is found by its value, not its position). Lengths of the test set may exceed the training
lengths (``test_max_len``). Source and target are strings of single characters from ``alphabet``.
"""

from __future__ import annotations

import random

from ..validators import check_seed
from .containers import Seq2SeqData
from .sampling import draw_avoiding

__all__ = ["generate_synthetic", "SYNTHETIC_TASKS"]

SYNTHETIC_TASKS = ("copy", "reverse", "sort")


def generate_synthetic(
    task: str,
    num_train: int = 4000,
    num_test: int = 500,
    *,
    min_len: int = 1,
    max_len: int = 8,
    test_max_len: int | None = None,
    alphabet: str = "abcdefghij",
    seed: int = 0,
) -> Seq2SeqData:
    """Seeded random strings with lengths in ``[min_len, max_len]`` (test: up to ``test_max_len``, default
    max_len); no training source is a test source, so the shortest lengths, whose few strings the test set
    holds nearly all of, are rare or absent in training (with 10 symbols: no string of one symbol)."""
    if task not in SYNTHETIC_TASKS:
        raise ValueError(f"task={task!r}: expected one of {SYNTHETIC_TASKS}")
    test_max_len = max_len if test_max_len is None else test_max_len
    for name, value in (
        ("num_train", num_train),
        ("num_test", num_test),
        ("min_len", min_len),
        ("max_len", max_len),
        ("test_max_len", test_max_len),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected a positive integer")
    if not min_len <= max_len <= test_max_len:
        raise ValueError(
            f"lengths must satisfy min_len <= max_len <= test_max_len, got {min_len}, {max_len}, "
            f"{test_max_len}"
        )
    seed = check_seed(seed)  # None would seed from the OS: a different data set each call
    if len(set(alphabet)) < 2:
        raise ValueError(f"alphabet={alphabet!r}: expected at least two distinct characters")
    transform = {"copy": lambda s: s, "reverse": lambda s: s[::-1], "sort": lambda s: "".join(sorted(s))}[
        task
    ]

    def draw(rng: random.Random, low: int, high: int) -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(low, high)))

    # The test set first, then training strings that avoid every test string (drawn independently, a
    # third of the test strings were training strings too: every string of one or two symbols is in both).
    # Each split has its own random stream: the training set does not move with num_test (only the few
    # strings a larger test set takes leave it).
    test_rng, train_rng = random.Random(seed), random.Random(f"train-{seed}")
    test = [draw(test_rng, min_len, test_max_len) for _ in range(num_test)]
    train = draw_avoiding(
        num_train, lambda _: draw(train_rng, min_len, max_len), set(test),
        f"the test set holds nearly every string of {min_len} to {max_len} symbols of {alphabet!r}; "
        "lower num_test or raise max_len, or use a larger alphabet",
    )
    return Seq2SeqData(
        name=task,
        train_src=train,
        train_tgt=[transform(s) for s in train],
        test_src=test,
        test_tgt=[transform(s) for s in test],
    )
