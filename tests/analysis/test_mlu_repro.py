"""``repro_mlu``: a few steps of MLU training return a sequence accuracy for softmax and CoDA variants."""

from __future__ import annotations

import pytest

import attnkit as ak
from attnkit.analysis.repro_mlu import MLU_VARIANTS, train_mlu


@pytest.mark.parametrize(
    "mechanism",
    [
        "softmax",
        ak.CoDA(gate="scaled", n_activation="tanh"),
        ak.CoDA(gate="centered"),
        ak.CoDA(center_e=True),
    ],
)
def test_a_few_steps_give_an_accuracy(mechanism):
    acc = train_mlu(
        mechanism, steps=2, seed=0, value_range=10, num_train=100, num_test=20, batch_size=8, d_model=16
    )
    assert 0.0 <= acc <= 1.0


def test_variants_cover_the_gate_centering_and_activation_ablations():
    configs = [c for c in MLU_VARIANTS.values() if isinstance(c, ak.CoDA)]
    assert {c.gate for c in configs} == {"scaled", "sigmoid", "centered"}
    assert any(c.center_e for c in configs) and {c.n_activation for c in configs} >= {"sigmoid", "tanh"}
    assert any(c.e_activation == "sigmoid" for c in configs)


@pytest.mark.parametrize("quick", [True, False])
def test_claims_fail_when_softmax_does_not_learn(tmp_path, monkeypatch, quick):
    from attnkit.analysis import repro_mlu
    from attnkit.analysis.report import ReproduceResult

    calls = []

    def fake_train(mechanism, steps, seed):  # softmax 0.3, CoDA 0.2: neither precondition nor order holds
        calls.append((mechanism, steps, seed))
        return 0.3 if mechanism == "softmax" else 0.2

    monkeypatch.setattr(repro_mlu, "train_mlu", fake_train)
    result = ReproduceResult(name="mlu", out=tmp_path)
    repro_mlu.mlu_ablations(result, quick=quick, seed=0)
    assert [c.held for c in result.claims[:2]] == [False, False]
    assert {steps for _, steps, _ in calls} == {600}  # quick keeps the budget at which softmax learns
    if quick:
        assert len(calls) == 2 and "quick" in result.note and "ablations run only in full mode" in result.note
    else:
        assert len(calls) == 3 * len(MLU_VARIANTS) and result.note == ""


@pytest.mark.parametrize("gap, held", [(0.002, False), (0.2, True)])
def test_better_than_claims_need_a_gap_beyond_the_seeds_noise(tmp_path, monkeypatch, gap, held):
    """CoDA 0.002 above softmax with a seed spread of 0.05 was "held" (mean against mean); the best
    composition likewise must beat the next one beyond the noise."""
    from attnkit.analysis import repro_mlu
    from attnkit.analysis.report import ReproduceResult

    names = {config: name for name, config in repro_mlu.MLU_VARIANTS.items()}

    def fake_train(mechanism, steps, seed):
        base = {"softmax": 0.6, "coda (2 sigmoid, eq. 5)": 0.6 + gap}.get(names[mechanism], 0.6 + gap / 2)
        return base + 0.05 * (seed - 1)  # seeds 0, 1, 2: -0.05, 0, +0.05

    monkeypatch.setattr(repro_mlu, "train_mlu", fake_train)
    result = ReproduceResult(name="mlu", out=tmp_path)
    repro_mlu.mlu_ablations(result, quick=False, seed=0)
    beats, best = result.claims[1], result.claims[2]
    assert beats.held is held and ("beyond" if held else "within") in beats.evidence
    assert best.held is held and "best - next" in best.evidence


def test_the_best_composition_is_judged_among_table_9s_compositions_only(tmp_path, monkeypatch):
    """The centered-N variant (still tanh(E) x sigmoid(N), a Table 8 centering) beat tanh x 2 sigmoid and
    the claim "tanh(E) x sigmoid(N) is the best composition" was not held, though every Table 9
    composition was far behind it."""
    from attnkit.analysis import repro_mlu
    from attnkit.analysis.report import ReproduceResult

    accuracy = {"softmax": 0.61, "coda (2 sigmoid, eq. 5)": 0.51, "coda centered N (eq. 4)": 0.61,
                "coda tanh(E) x tanh gate (Table 9)": 0.05, "coda sigmoid(E) x sigmoid(N) (Table 9)": 0.31}
    names = {config: name for name, config in repro_mlu.MLU_VARIANTS.items()}

    def fake_train(mechanism, steps, seed):
        return accuracy.get(names[mechanism], 0.31) + 0.01 * (seed - 1)

    monkeypatch.setattr(repro_mlu, "train_mlu", fake_train)
    result = ReproduceResult(name="mlu", out=tmp_path)
    repro_mlu.mlu_ablations(result, quick=False, seed=0)
    best = result.claims[2]
    assert best.held and best.ours == "best: coda (2 sigmoid, eq. 5)"
    assert "centered" not in best.evidence and "sigmoid gate" not in best.evidence


def test_quick_note_does_not_say_softmax_learns_at_the_budget(tmp_path, monkeypatch):
    """The quick note said 600 steps was "the smallest budget at which softmax learns" while the same run
    measured softmax at 0.46 (precondition not held); it now states the measured accuracy and that 63% was
    before the train/test overlap was removed."""
    from attnkit.analysis import repro_mlu
    from attnkit.analysis.report import ReproduceResult

    monkeypatch.setattr(repro_mlu, "train_mlu", lambda mechanism, steps, seed: 0.46)
    result = ReproduceResult(name="mlu", out=tmp_path)
    repro_mlu.mlu_ablations(result, quick=True, seed=0)
    assert "softmax learns" not in result.note
    assert "this run 0.460" in result.note and "overlap was removed" in result.note
    assert "below the 50% precondition" in result.note
    doc = " ".join(repro_mlu.__doc__.split())
    assert "first reaches >= 50%" not in doc and "before the overlap between train and test" in doc


def test_paper_column_is_in_the_unit_of_ours(tmp_path, monkeypatch):
    """The "paper (Table 6)" column showed 76.1 / 84.3 (percent) beside our fractions (0.46)."""
    from attnkit.analysis import repro_mlu
    from attnkit.analysis.report import ReproduceResult

    monkeypatch.setattr(repro_mlu, "train_mlu", lambda mechanism, steps, seed: 0.46)
    result = ReproduceResult(name="mlu", out=tmp_path)
    repro_mlu.mlu_ablations(result, quick=True, seed=0)
    paper = {row["variant"]: row["paper (Table 6)"] for row in result.rows}
    assert paper["softmax"] == 0.761 and paper["coda (2 sigmoid, eq. 5)"] == 0.843
    assert result.claims[0].paper.startswith("0.761")
