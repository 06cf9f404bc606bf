"""Mathematical Language Understanding (MLU): character-level arithmetic with two variables.

The task of Wangperawong (2018), "Attending to Mathematical Language with Transformers"
(arXiv:1812.02825), used in the CoDA paper ("Compositional De-Attention Networks", section 3.6, Table 6):
the input assigns integer values to two variables and asks for an expression of them, the output is
its value, both as character strings, e.g. ``x=85,y=-523,x*y`` -> ``-44455``.

The original data draw ``x, y`` from ``[-1000, 1000)`` and the operator from ``{+, -, *}``, and, "to
ensure that the model embraces symbolic variables", put the two assignments in a random order
(``y=129,x=531,x-y``). The variations here:

- ``permute_assignments`` (default on): the order of the two assignments is random;
- ``permute_operands`` (default off): the order of the operands is random too (``y-x``);
- ``operators``: any subset of ``+ - * // %`` (``//`` and ``%`` with Python's floor semantics, never by 0);
- ``variables``: the two variable names.

Samples are unique (by input string) and split into train and test sets that share no problem. One
problem is one computation: the operator and the values of its left and right operands (read from the
assignments by variable name), the two values unordered for the commutative ``+`` and ``*``. So
``y=2,x=1,x+y``, ``x=1,y=2,y+x`` and ``x=2,y=1,x+y`` are one problem (``1 + 2``), while ``x=1,y=2,x-y``
(``1 - 2``) and ``x=2,y=1,x-y`` (``2 - 1``) are two; exact match never scores a memorized computation. A
seed fixes everything. The metric is sequence accuracy: an output counts only when it matches exactly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable, Sequence

from ..validators import check_bool, check_int
from .containers import Seq2SeqData

__all__ = ["MLUConfig", "OPERATORS", "generate_mlu", "evaluate_expression", "sequence_accuracy"]

OPERATORS: dict[str, object] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "//": lambda a, b: a // b,
    "%": lambda a, b: a % b,
}
_COMMUTATIVE = ("+", "*")
_FORBIDDEN_IN_NAMES = set("0123456789=,+-*/% ")


@dataclass(frozen=True)
class MLUConfig:
    """Settings of the MLU generator (defaults: the original task, 100k samples split 9:1)."""

    num_train: int = 90_000
    num_test: int = 10_000
    low: int = -1000
    high: int = 1000  # exclusive
    operators: tuple[str, ...] = ("+", "-", "*")
    variables: tuple[str, str] = ("x", "y")
    permute_assignments: bool = True
    permute_operands: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        for field_name in ("num_train", "num_test", "low", "high", "seed"):
            value = getattr(self, field_name)
            what = f"MLUConfig({field_name}={value!r})"
            object.__setattr__(self, field_name, check_int(value, what, "expected an integer"))
        for field_name in ("permute_assignments", "permute_operands"):
            check_bool(getattr(self, field_name), f"MLUConfig({field_name}={getattr(self, field_name)!r})")
        if self.num_train < 1 or self.num_test < 0:
            raise ValueError(
                f"MLUConfig(num_train={self.num_train}, num_test={self.num_test}): "
                "need num_train >= 1, num_test >= 0"
            )
        if self.high <= self.low:
            raise ValueError(
                f"MLUConfig(low={self.low}, high={self.high}): need low < high (high is exclusive)"
            )
        ops = tuple(self.operators) if isinstance(self.operators, Iterable) else ()
        known = all(isinstance(op, str) and op in OPERATORS for op in ops)
        if not ops or not known or len(set(ops)) != len(ops):
            raise ValueError(
                f"MLUConfig(operators={self.operators!r}): "
                f"expected distinct operators from {tuple(OPERATORS)}"
            )
        object.__setattr__(self, "operators", ops)
        names = tuple(self.variables) if isinstance(self.variables, Iterable) else ()
        if (
            len(names) != 2
            or names[0] == names[1]
            or any(not isinstance(v, str) or not v or set(v) & _FORBIDDEN_IN_NAMES for v in names)
        ):
            raise ValueError(
                f"MLUConfig(variables={self.variables!r}): expected two distinct non-empty names "
                "without digits, "
                "spaces or the characters = , + - * / %"
            )
        object.__setattr__(self, "variables", names)
        if self.num_train + self.num_test > self.space_size // 2:
            raise ValueError(
                f"MLUConfig: {self.num_train + self.num_test} unique samples requested but the settings "
                "allow only "
                f"{self.space_size}; ask for at most half of that, or widen [low, high) / add operators"
            )
        # a test problem keeps its other inputs (``_problem``) out of train: room for them too
        needed = self.num_train + self.inputs_per_problem * self.num_test
        if needed > self.num_valid_inputs:
            raise ValueError(
                f"MLUConfig: {self.num_train + self.num_test} unique samples requested (room for {needed} "
                "with each test problem's other inputs kept out of train) but the settings "
                f"allow only {self.num_valid_inputs} without a division by 0; "
                "widen [low, high) or add operators"
            )

    @property
    def space_size(self) -> int:
        """Number of distinct input strings the settings can produce (an upper bound with ``//``/``%``)."""
        n = self.high - self.low
        return (
            n
            * n
            * len(self.operators)
            * (2 if self.permute_assignments else 1)
            * (2 if self.permute_operands else 1)
        )

    @property
    def inputs_per_problem(self) -> int:
        """Most input strings that pose one problem (``_problem``): the assignment orders, the operand
        orders, and for ``+`` or ``*`` the two ways to give the two values to the two variables."""
        commutative = any(op in _COMMUTATIVE for op in self.operators)
        return (
            (2 if commutative else 1)
            * (2 if self.permute_assignments else 1)
            * (2 if self.permute_operands else 1)
        )

    @property
    def num_valid_inputs(self) -> int:
        """Number of distinct input strings without a division by 0 (exact; ``space_size`` counts those)."""
        n = self.high - self.low
        zero = 1 if self.low <= 0 < self.high else 0  # a right operand 0 is left out for // and %
        pairs = sum(n * (n - zero) if op in ("//", "%") else n * n for op in self.operators)
        return pairs * (2 if self.permute_assignments else 1) * (2 if self.permute_operands else 1)


def evaluate_expression(a: int, op: str, b: int) -> int:
    if op not in OPERATORS:
        raise ValueError(f"operator {op!r}: expected one of {tuple(OPERATORS)}")
    if op in ("//", "%") and b == 0:
        raise ValueError(f"{a} {op} 0 is undefined")
    return OPERATORS[op](a, b)


def _sample(rng: random.Random, config: MLUConfig) -> tuple[str, str] | None:
    x = rng.randrange(config.low, config.high)
    y = rng.randrange(config.low, config.high)
    op = config.operators[rng.randrange(len(config.operators))]
    vx, vy = config.variables
    assignments = [f"{vx}={x}", f"{vy}={y}"]
    if config.permute_assignments and rng.random() < 0.5:
        assignments.reverse()
    (left, a), (right, b) = (vx, x), (vy, y)
    if config.permute_operands and rng.random() < 0.5:
        (left, a), (right, b) = (right, b), (left, a)
    if op in ("//", "%") and b == 0:
        return None
    return f"{assignments[0]},{assignments[1]},{left}{op}{right}", str(evaluate_expression(a, op, b))


def _problem(src: str, config: MLUConfig) -> tuple[str, int, int]:
    """The computation an input poses, ``(operator, left value, right value)``, the two values sorted for
    a commutative operator: ``y=2,x=1,x+y``, ``x=1,y=2,y+x`` and ``x=2,y=1,x+y`` are all ``("+", 1, 2)``,
    ``x=2,y=1,x-y`` is ``("-", 2, 1)`` and ``x=1,y=2,x-y`` is ``("-", 1, 2)``."""
    first, second, expression = src.split(",")
    values = {name: int(value) for name, value in (first.split("="), second.split("="))}
    vx, vy = config.variables
    for op in config.operators:
        for left, right in ((vx, vy), (vy, vx)):
            if expression == f"{left}{op}{right}":
                a, b = values[left], values[right]
                return (op, *sorted((a, b))) if op in _COMMUTATIVE else (op, a, b)
    raise ValueError(f"MLU input {src!r} is not an expression of {config.variables} with {config.operators}")


def generate_mlu(config: MLUConfig | None = None, name: str = "mlu") -> Seq2SeqData:
    """Unique MLU samples, split into train/test sets without a common problem (``_problem``: no training
    input computes a test input's operator on the same operand values, in the same order or, for ``+`` and
    ``*``, in either order); the same config gives the same data."""
    config = config if config is not None else MLUConfig()
    rng = random.Random(config.seed)
    total = config.num_train + config.num_test
    seen: dict[str, str] = {}
    while len(seen) < total:
        sample = _sample(rng, config)
        if sample is not None and sample[0] not in seen:
            seen[sample[0]] = sample[1]
    pairs = list(seen.items())  # insertion order: deterministic for a seed
    rng.shuffle(pairs)
    train, test = pairs[: config.num_train], pairs[config.num_train :]
    held_out = {_problem(s, config) for s, _ in test}
    for i in range(len(train)):  # a test problem in train is replaced by a new one, in its place
        while _problem(train[i][0], config) in held_out:
            sample = _sample(rng, config)
            if sample is not None and sample[0] not in seen:
                seen[sample[0]] = sample[1]
                train[i] = sample
    return Seq2SeqData(
        name=name,
        train_src=[s for s, _ in train],
        train_tgt=[t for _, t in train],
        test_src=[s for s, _ in test],
        test_tgt=[t for _, t in test],
    )


def sequence_accuracy(predictions: Sequence[str], targets: Sequence[str]) -> float:
    """Share of predictions that equal their target exactly (the MLU metric)."""
    if len(predictions) != len(targets):
        raise ValueError(
            f"{len(predictions)} predictions for {len(targets)} targets; expected one per target"
        )
    if not targets:
        raise ValueError("sequence_accuracy of an empty set is undefined; pass at least one target")
    for name, values in (("predictions", predictions), ("targets", targets)):
        odd = [v for v in values if not isinstance(v, str)][:1]
        if isinstance(values, str) or odd:
            got = "one string" if isinstance(values, str) else f"{type(odd[0]).__name__} {odd[0]!r}"
            raise ValueError(f"{name} must be a list of strings (decoded sequences), got {got}")
    return sum(p == t for p, t in zip(predictions, targets)) / len(targets)
