"""MLU arithmetic generator (CoDA paper sec. 3.6): determinism, correct targets, variations, splits."""

from __future__ import annotations

import re

import pytest

from attnkit.data import MLUConfig, generate_mlu, load_dataset, sequence_accuracy

_PATTERN = re.compile(r"^(\w+)=(-?\d+),(\w+)=(-?\d+),(\w+)(\+|-|\*|//|%)(\w+)$")


def _evaluate_plainly(src: str) -> int:
    v1, a, v2, b, left, op, right = _PATTERN.match(src).groups()
    env = {v1: int(a), v2: int(b)}
    x, y = env[left], env[right]
    return {"+": x + y, "-": x - y, "*": x * y, "//": x // y, "%": x % y}[op]


def test_same_seed_gives_same_data_and_other_seed_differs():
    config = MLUConfig(num_train=300, num_test=50, seed=3)
    a, b = generate_mlu(config), generate_mlu(config)
    c = generate_mlu(MLUConfig(num_train=300, num_test=50, seed=4))
    assert (a.train_src, a.train_tgt, a.test_src) == (b.train_src, b.train_tgt, b.test_src)
    assert a.train_src != c.train_src


def test_targets_are_the_value_of_the_expression():
    data = generate_mlu(
        MLUConfig(num_train=500, num_test=100, operators=("+", "-", "*", "//", "%"), permute_operands=True)
    )
    for src, tgt in zip(data.train_src + data.test_src, data.train_tgt + data.test_tgt):
        assert int(tgt) == _evaluate_plainly(src), src


def test_paper_example_format():
    data = generate_mlu(MLUConfig(num_train=200, num_test=0))
    assert all(_PATTERN.match(s) for s in data.train_src)
    assert all(re.fullmatch(r"-?\d+", t) for t in data.train_tgt)
    assert _evaluate_plainly("x=85,y=-523,x*y") == -44455


def test_samples_are_unique_and_splits_disjoint():
    data = generate_mlu(MLUConfig(num_train=2000, num_test=300, low=-20, high=20))
    assert len(set(data.train_src)) == 2000 and len(set(data.test_src)) == 300
    assert not set(data.train_src) & set(data.test_src)


def test_values_stay_in_range():
    data = generate_mlu(MLUConfig(num_train=400, num_test=0, low=-5, high=7))
    values = [int(v) for s in data.train_src for v in _PATTERN.match(s).group(2, 4)]
    assert min(values) >= -5 and max(values) <= 6 and min(values) == -5 and max(values) == 6


def test_permuted_assignments_use_both_orders():
    orders = {s.split(",")[0][0] for s in generate_mlu(MLUConfig(num_train=200, num_test=0)).train_src}
    assert orders == {"x", "y"}
    fixed = {
        s.split(",")[0][0]
        for s in generate_mlu(MLUConfig(num_train=200, num_test=0, permute_assignments=False)).train_src
    }
    assert fixed == {"x"}


def test_operand_permutation_and_operator_choice():
    plain = generate_mlu(MLUConfig(num_train=300, num_test=0, operators=("-",)))
    assert all(s.endswith(",x-y") for s in plain.train_src)
    swapped = generate_mlu(MLUConfig(num_train=300, num_test=0, operators=("-",), permute_operands=True))
    assert {s[-3:] for s in swapped.train_src} == {"x-y", "y-x"}


def test_division_and_modulo_never_by_zero():
    data = generate_mlu(
        MLUConfig(num_train=90, num_test=0, low=-2, high=3, operators=("//", "%"), permute_operands=True)
    )
    for src in data.train_src:
        v1, a, v2, b, left, op, right = _PATTERN.match(src).groups()
        assert {v1: int(a), v2: int(b)}[right] != 0


def test_custom_variable_names():
    data = generate_mlu(MLUConfig(num_train=50, num_test=0, variables=("a", "b")))
    assert all(s.startswith(("a=", "b=")) and s.endswith(("a+b", "a-b", "a*b")) for s in data.train_src)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"operators": ("^",)}, "operators"),
        ({"variables": ("x", "x")}, "variables"),
        ({"variables": ("x1", "y")}, "variables"),
        ({"low": 5, "high": 5}, "low < high"),
        ({"num_train": 0}, "num_train >= 1"),
        ({"num_train": 100, "low": 0, "high": 3}, "allow only"),
    ],
)
def test_invalid_config_raises_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MLUConfig(**kwargs)


def test_load_dataset_passes_generator_options():
    data = load_dataset("mlu", num_train=100, num_test=10, seed=1)
    assert (len(data.train_src), len(data.test_src)) == (100, 10)
    assert data.train_src == generate_mlu(MLUConfig(num_train=100, num_test=10, seed=1)).train_src
    with pytest.raises(ValueError, match="unknown options.*'n_train'"):
        load_dataset("mlu", n_train=5)


def test_sequence_accuracy_counts_exact_matches_only():
    assert sequence_accuracy(["12", "-3", "40"], ["12", "-3", "4"]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="2 predictions for 3 targets"):
        sequence_accuracy(["1", "2"], ["1", "2", "3"])


@pytest.mark.parametrize(
    "predictions, targets, message",
    [
        ([1], ["1"], "predictions .* got int 1"),
        (["1"], [None], "targets .* got NoneType"),
        ("12", "12", "one string"),
    ],
)
def test_sequence_accuracy_refuses_what_is_not_decoded_text(predictions, targets, message):
    with pytest.raises(ValueError, match=message):  # 1 != "1" would count as a silent miss
        sequence_accuracy(predictions, targets)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"seed": True}, "seed=True"),
        ({"seed": 1.0}, "seed=1.0"),
        ({"permute_assignments": "no"}, "permute_assignments='no'"),
        ({"operators": None}, "operators=None"),
        ({"operators": [["+"]]}, "operators"),
        ({"variables": None}, "variables=None"),
    ],
)
def test_config_rejects_values_of_the_wrong_type(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MLUConfig(**kwargs)


def test_numpy_integers_are_accepted_as_sizes_and_seed():
    import numpy as np

    config = MLUConfig(num_train=np.int64(20), num_test=np.int32(5), seed=np.int64(3))
    assert config == MLUConfig(num_train=20, num_test=5, seed=3) and type(config.seed) is int
    expected = generate_mlu(MLUConfig(num_train=20, num_test=5, seed=3)).train_src
    assert generate_mlu(config).train_src == expected


@pytest.mark.parametrize("op", ["//", "%"])
def test_space_size_leaves_out_division_by_zero(op):
    # [0, 1) has only the divisor 0: no sample exists, so asking for one is an error, not an endless loop
    with pytest.raises(ValueError, match="allow only 0 without a division by 0"):
        MLUConfig(num_train=1, num_test=0, low=0, high=1, operators=(op,))
    config = MLUConfig(num_train=3, num_test=0, low=-1, high=2, operators=(op,), permute_assignments=False)
    assert config.num_valid_inputs == 3 * 2  # x in {-1, 0, 1}, y in {-1, 1}
    inputs = generate_mlu(config).train_src
    assert len(set(inputs)) == 3 and not any(s.endswith(f"y=0,x{op}y") for s in inputs)


def test_a_config_without_room_for_train_beside_the_test_problems_is_refused():
    # 12 inputs without a division by 0: 8 test problems would keep up to 16 of them out of train
    with pytest.raises(ValueError, match=r"9 unique samples requested \(room for 17 .*allow only 12 without"):
        MLUConfig(num_train=1, num_test=8, low=-1, high=2, operators=("//",))


def _computation(src: str) -> tuple:
    """The operator and its left and right operand values, unordered for + and * (a + b is b + a)."""
    v1, a, v2, b, left, op, right = _PATTERN.match(src).groups()
    env = {v1: int(a), v2: int(b)}
    values = (env[left], env[right])
    return (op, *sorted(values)) if op in "+*" else (op, *values)


@pytest.mark.parametrize("config", [
    MLUConfig(num_train=2400, num_test=400, low=-16, high=16, seed=1000),  # analysis/repro_mlu.py's data
    MLUConfig(num_train=2400, num_test=400, low=-16, high=16, seed=1001),
    MLUConfig(num_train=2400, num_test=400, low=-16, high=16, seed=1000, permute_operands=True),
    MLUConfig(num_train=500, num_test=200, low=-20, high=20, operators=("//", "%"), seed=2),
    MLUConfig(num_train=3000, num_test=300),  # the default range and operators
])
def test_no_test_computation_is_in_train_with_its_assignments_or_operands_swapped(config):
    """140 of the 400 test inputs were a training input with its two assignments swapped, and 37-44% were a
    training item's computation with the two values of + or * swapped (5 + (-2) in test, (-2) + 5 in train,
    the same answer)."""
    data = generate_mlu(config)
    assert (len(data.train_src), len(data.test_src)) == (config.num_train, config.num_test)
    assert len(set(data.train_src + data.test_src)) == config.num_train + config.num_test
    train = {_computation(s) for s in data.train_src}
    assert not [s for s in data.test_src if _computation(s) in train]


def test_inputs_of_one_computation_are_one_problem():
    from attnkit.data.mlu import _problem

    config = MLUConfig(permute_operands=True)
    assert {_problem(s, config) for s in ("y=2,x=1,x+y", "x=1,y=2,y+x", "x=2,y=1,x+y")} == {("+", 1, 2)}
    assert _problem("x=1,y=2,x-y", config) != _problem("x=2,y=1,x-y", config)
    assert _problem("x=2,y=1,x-y", config) == _problem("y=2,x=1,y-x", config) == ("-", 2, 1)
    assert config.inputs_per_problem == 8
    assert MLUConfig(operators=("-",)).inputs_per_problem == 2
