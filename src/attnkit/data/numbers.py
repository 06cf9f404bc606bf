"""Numbers to English words, with test inputs longer than any training input (``num2words`` from PyPI; install
with ``pip install 'attnkit[seq]'``).

A source is a list of ``k`` numbers in ``[0, max_value]`` written with digits (``"12 305"``); its target is
their
words (``"twelve three hundred and five"``; hyphens and commas become spaces). Training draws ``k`` in
``[1, train_max_count]``; the test set draws ``k`` evenly in ``[1, test_max_count]``, so most test inputs are
longer
than every training input. The alignment is monotonic with local reorderings (``"15"`` -> ``fifteen``,
``"305"`` -> ``three hundred and five``): the lecture's bottleneck and long-input claims can be checked by
input length. No test source occurs in the training set.
"""

from __future__ import annotations

import random

from ..validators import check_seed
from .containers import DatasetUnavailableError, Seq2SeqData
from .sampling import draw_avoiding

__all__ = ["generate_numbers", "number_words", "NUM2WORDS_REQUIREMENT"]

NUM2WORDS_REQUIREMENT = "num2words>=0.5"


def number_words(value: int) -> str:
    """English words of ``value`` with hyphens and commas replaced by spaces."""
    try:
        from num2words import num2words
    except ImportError:
        raise DatasetUnavailableError(
            "numbers needs the 'num2words' package; install it with: pip install 'attnkit[seq]' "
            "(or pip install num2words)"
        ) from None
    return " ".join(num2words(value, lang="en").replace("-", " ").replace(",", " ").split())


def generate_numbers(
    num_train: int = 20000,
    num_test: int = 1000,
    *,
    train_max_count: int = 3,
    test_max_count: int = 8,
    max_value: int = 999,
    seed: int = 0,
) -> Seq2SeqData:
    """Seeded train/test pairs (sources ``"n1 n2 ..."``, targets their words); see the module docstring."""
    for name, value in (
        ("num_train", num_train),
        ("num_test", num_test),
        ("train_max_count", train_max_count),
        ("test_max_count", test_max_count),
        ("max_value", max_value),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected a positive integer")
    if test_max_count < train_max_count:
        raise ValueError(
            f"test_max_count={test_max_count} < train_max_count={train_max_count}; the test must reach at "
            f"least "
            "the training lengths"
        )
    rng = random.Random(check_seed(seed))  # None would seed from the OS: a different data set each call
    words = {}

    def pair(count: int) -> tuple[str, str]:
        values = [rng.randint(0, max_value) for _ in range(count)]
        for v in values:
            if v not in words:
                words[v] = number_words(v)
        return " ".join(map(str, values)), " ".join(words[v] for v in values)

    # the test set first (distinct sources), then training inputs that avoid every test source
    held_out: set = set()
    test = draw_avoiding(
        num_test, lambda k: pair(1 + k % test_max_count), held_out,  # counts 1..test_max_count in turn
        f"could not draw {num_test} distinct test inputs with numbers up to {max_value}; lower num_test or "
        "raise max_value",
        key=lambda item: item[0], hold=True,
    )
    train = draw_avoiding(
        num_train, lambda _: pair(rng.randint(1, train_max_count)), held_out,
        f"the test set holds nearly every input of up to {train_max_count} numbers; lower num_test or raise "
        "max_value",
        key=lambda item: item[0],
    )
    return Seq2SeqData(
        name="numbers",
        train_src=[s for s, _ in train],
        train_tgt=[t for _, t in train],
        test_src=[s for s, _ in test],
        test_tgt=[t for _, t in test],
    )
