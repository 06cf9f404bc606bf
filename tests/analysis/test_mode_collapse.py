"""Mode collapse: closed forms of "Doubly-Normalized Attention" eqs. (11)-(14) against the simulator, and the
2-D cluster counts."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import attnkit as ak
from attnkit.analysis import (
    center_distance_dnas,
    center_distance_lnas,
    count_clusters,
    simulate_self_attention,
    two_clusters,
)
from attnkit.analysis.repro_mode_collapse import CLUSTER_GAP, MODE_COLLAPSE_2D_STD


def _simulated_distance(n0: int, n1: int, a: float, mechanism: str, scores: str = "gaussian") -> float:
    x = two_clusters(n0, n1, [a], [-a])  # exactly separated clusters
    after = simulate_self_attention(x, mechanism, steps=1, scores=scores)[1, :, 0]
    return float(after[:n0].mean() - after[n0:].mean())


@pytest.mark.parametrize("scores", ["gaussian", "dot"])
@pytest.mark.parametrize("n0,n1,a", [(10, 5, 0.6), (3, 3, 0.8), (2, 20, 1.0), (30, 1, 0.4), (7, 7, 1.3)])
def test_closed_forms_match_simulation(n0, n1, a, scores):
    assert abs(_simulated_distance(n0, n1, a, "softmax", scores) - center_distance_lnas(n0 / n1, a)) < 1e-6
    assert abs(_simulated_distance(n0, n1, a, "dnas", scores) - center_distance_dnas(n0 / n1, a)) < 1e-6


def test_closed_forms_from_cluster_sums_by_hand():
    # Appendix C before simplification: t = 1, s = exp(-2 a^2), written with N0, N1 directly
    n0, n1, a = 6.0, 2.0, 0.7
    s, t = math.exp(-2 * a * a), 1.0
    lnas = 2 * n0 * n1 * (t * t - s * s) * a / ((n1 * t + n0 * s) * (n0 * t + n1 * s))
    c0 = (n0 * t * (n0 * s + n1 * t) - n1 * s * (n0 * t + n1 * s)) / (
        n0 * t * (n0 * s + n1 * t) + n1 * s * (n0 * t + n1 * s)
    )
    c1 = (n0 * s * (n0 * s + n1 * t) - n1 * t * (n0 * t + n1 * s)) / (
        n0 * s * (n0 * s + n1 * t) + n1 * t * (n0 * t + n1 * s)
    )
    assert center_distance_lnas(n0 / n1, a) == pytest.approx(lnas, rel=1e-12)
    assert center_distance_dnas(n0 / n1, a) == pytest.approx((c0 - c1) * a, rel=1e-12)


def test_both_schemes_agree_at_r_equal_one():
    for a in (0.2, 0.7, 1.5):
        s = math.exp(-2 * a * a)
        expected = 2 * a * (1 - s) / (1 + s)
        assert center_distance_lnas(1.0, a) == pytest.approx(expected, rel=1e-12)
        assert center_distance_dnas(1.0, a) == pytest.approx(expected, rel=1e-12)
        assert abs(_simulated_distance(4, 4, a, "softmax") - _simulated_distance(4, 4, a, "dnas")) < 1e-12


def test_dnas_upper_bounds_lnas_for_unbalanced_clusters():
    r = np.concatenate([np.logspace(-3, -0.01, 50), np.logspace(0.01, 3, 50)])
    for a in (0.3, 0.8, 1.2, 2.0):
        assert np.all(center_distance_dnas(r, a) > center_distance_lnas(r, a))
        assert np.all(center_distance_dnas(r, a) < 2 * a)  # both still shrink the distance


def test_closed_forms_broadcast_and_reject_bad_values():
    out = center_distance_lnas(np.array([0.5, 1.0, 2.0]), 1.0)
    assert out.shape == (3,)
    assert out[0] == pytest.approx(out[2])  # symmetric in r <-> 1/r
    with pytest.raises(ValueError, match="r="):
        center_distance_dnas(0.0, 1.0)
    with pytest.raises(ValueError, match="a="):
        center_distance_lnas(1.0, -1.0)


def test_simulator_keeps_points_and_sinkhorn_between_schemes():
    x = two_clusters(12, 3, [0.9], [-0.9])
    traj = simulate_self_attention(x, ak.Sinkhorn(iters=3), steps=3)
    assert traj.shape == (4, 15, 1) and torch.equal(traj[0], x)
    sink = float(traj[1, :12, 0].mean() - traj[1, 12:, 0].mean())
    assert center_distance_lnas(4.0, 0.9) < sink < center_distance_dnas(4.0, 0.9) + 1e-12


def test_simulator_rejects_bad_input():
    with pytest.raises(ValueError, match="coda"):
        simulate_self_attention(torch.zeros(3, 2), "coda")
    with pytest.raises(ValueError, match="steps"):
        simulate_self_attention(torch.zeros(3, 2), "dnas", steps=-1)
    with pytest.raises(ValueError, match="scores"):
        simulate_self_attention(torch.zeros(3, 2), "dnas", scores="cosine")
    with pytest.raises(ValueError, match="shape"):
        simulate_self_attention(torch.zeros(2, 3, 4), "dnas")


def test_count_clusters_gap_rule_on_hand_built_points():
    chain = torch.tensor([[0.0, 0], [0.4, 0], [0.8, 0], [1.2, 0]])  # steps of 0.4 < gap 0.5: one cluster
    far = torch.tensor([[5.0, 5.0], [5.1, 5.0]])
    straggler = torch.tensor([[-9.0, -9.0]])
    points = torch.cat([chain, far, straggler])
    counts = count_clusters(points, gap=0.5, min_fraction=0.2)  # min size ceil(0.2 * 7) = 2
    assert counts.count == 2 and counts.sizes == (4, 2, 1) and counts.min_size == 2
    assert count_clusters(points, gap=0.3, min_fraction=0.0).count == 6  # the chain breaks into 4 points
    # "shorter than gap": points exactly gap apart are not linked (binary fractions, no rounding)
    assert count_clusters(torch.tensor([[0.0], [0.5], [1.0]]), gap=0.5, min_fraction=0.0).count == 3
    assert count_clusters(torch.tensor([[0.0], [0.5], [1.0]]), gap=0.5625, min_fraction=0.0).count == 1
    with pytest.raises(ValueError, match="gap"):
        count_clusters(points, gap=0)


def _final_counts(n0: int, n1: int, mechanism) -> int:
    x = two_clusters(n0, n1, [1.8, 0.7], [-1.0, -1.0], std=MODE_COLLAPSE_2D_STD, seed=0)
    final = simulate_self_attention(x, mechanism, steps=4)[-1]
    return count_clusters(final, gap=CLUSTER_GAP).count


def test_unbalanced_2d_lnas_collapses_dnas_keeps_two_clusters():
    assert _final_counts(500, 50, "softmax") == 1
    assert _final_counts(500, 50, "dnas") == 2


def test_balanced_2d_both_keep_two_clusters():
    assert _final_counts(225, 225, "softmax") == 2
    assert _final_counts(225, 225, "dnas") == 2


def test_sweep_covers_every_case_mechanism_std_and_scale():
    from attnkit.analysis.repro_mode_collapse import mode_collapse_sweep

    rows = mode_collapse_sweep([0], stds=(0.3,), scales=(0.5, 2.0), steps=1)
    assert len(rows) == 2 * 2 * 4  # cases x scales x mechanisms
    assert {r["scale"] for r in rows} == {0.5, 2.0} and all(r["initial_clusters"] >= 1 for r in rows)


def test_std_range_reports_runs_and_none():
    from attnkit.analysis.repro_mode_collapse import _std_range

    assert _std_range(np.array([1.0, 1.0, 0.5, 1.0]), (0.1, 0.2, 0.3, 0.4)) == "0.1-0.2, 0.4"
    assert _std_range(np.zeros(3), (0.1, 0.2, 0.3)) == "none"


def test_simulate_rejects_a_non_positive_scale():
    from attnkit.analysis.mode_collapse import simulate_self_attention

    with pytest.raises(ValueError, match="scale"):
        simulate_self_attention(torch.zeros(3, 2), "softmax", scale=0.0)


def _fake_sweep(mc, start, final):
    """A stand-in for ``mode_collapse_sweep``: rows of every std, case and mechanism with the cluster counts
    ``start(std, case)`` before and ``final(std, case, name)`` after the steps."""
    def sweep(seeds):
        return [{"case": case, "std": std, "scale": 1.0, "seed": s, "mechanism": name,
                 "initial_clusters": start(std, case), "final_clusters": final(std, case, name)}
                for std in mc.SWEEP_STDS for case in mc._CASES_2D for name in mc._MECHANISMS_2D
                for s in seeds]
    return sweep


def test_the_sensitivity_sweep_is_reported_as_a_note_not_judged_as_a_paper_claim(tmp_path, monkeypatch):
    """The sweep counted as a claim ("the pattern holds across the spreads") that the paper never makes, and
    at the widest spreads the balanced data starts as one cluster, where the pattern cannot hold."""
    from attnkit.analysis import repro_mode_collapse as mc
    from attnkit.analysis.report import ReproduceResult

    monkeypatch.setattr(mc, "SWEEP_STDS", (0.2, 1.0))
    monkeypatch.setattr(mc, "SWEEP_SCALES", (1.0,))

    def start(std, case):
        return 2 if std < 0.5 else 1

    def final(std, case, name):
        return 1 if (case == "unbalanced" and name == "softmax") or start(std, case) == 1 else 2

    monkeypatch.setattr(mc, "mode_collapse_sweep", _fake_sweep(mc, start, final))
    result = ReproduceResult(name="mode-collapse-2d", out=tmp_path)
    mc._sweep_into(result, [0, 1])
    assert result.claims == []
    assert "not a paper claim" in result.note
    assert "holds in every seed at std 0.2 of (0.2, 1.0)" in result.note
    assert "starts as two clusters at std 0.2 only" in result.note


def test_the_sweep_counts_a_pattern_only_where_the_data_started_as_two_clusters(tmp_path, monkeypatch):
    """The note said the balanced pattern ("both keep two clusters") held at spreads where the data started
    as one cluster that attention then split: kept means two at the start and at the end."""
    from attnkit.analysis import repro_mode_collapse as mc
    from attnkit.analysis.report import ReproduceResult

    monkeypatch.setattr(mc, "SWEEP_STDS", (0.2, 0.6))
    monkeypatch.setattr(mc, "SWEEP_SCALES", (1.0,))

    fake_sweep = _fake_sweep(  # at 0.6 the balanced data starts as one cluster and ends as two
        mc, lambda std, case: 1 if (std > 0.5 and case == "balanced") else 2,
        lambda std, case, name: 1 if (case == "unbalanced" and name == "softmax") else 2)
    monkeypatch.setattr(mc, "mode_collapse_sweep", fake_sweep)
    result = ReproduceResult(name="mode-collapse-2d", out=tmp_path)
    mc._sweep_into(result, [0, 1])
    assert "holds in every seed at std 0.2 of (0.2, 0.6)" in result.note
    assert mc._two_cluster_share(fake_sweep([0]), "balanced", "dnas", 1.0, (0.2, 0.6)).tolist() == [1.0, 0.0]


def _closed_forms_mp(r: float, a: float) -> tuple[float, float]:
    """Eqs. (11)/(13) and (12)/(14) at 60 digits: the reference for the float64 closed forms."""
    mpmath = pytest.importorskip("mpmath")
    with mpmath.workdps(60):
        r, a = mpmath.mpf(r), mpmath.mpf(a)
        s = mpmath.exp(-2 * a**2)
        q = (r + s) / (r * s + 1)
        lnas = 2 * r * (1 - s**2) * a / ((1 + r * s) * (r + s))
        dnas = 2 * q * r * (1 - s**2) * a / ((q + r * s) * (r + s * q))
        return float(lnas), float(dnas)


@pytest.mark.parametrize("r, a", [(2.0, 1e-6), (0.5, 1e-9), (3.0, 1e-3), (1e300, 1.0), (1e-300, 1.0),
                                  (1e150, 1e-3), (7.0, 1.5), (1.0, 30.0)])
def test_closed_forms_match_the_reference_to_float64_precision(r, a):
    """1 - s**2 with s = exp(-2 a^2) cancelled at small a (every digit lost at a = 1e-9), and r = 1e300
    overflowed with a RuntimeWarning."""
    lnas_ref, dnas_ref = _closed_forms_mp(r, a)
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # (underflow: exp(-2 a^2) at a = 30)
        lnas, dnas = center_distance_lnas(r, a), center_distance_dnas(r, a)
    assert lnas == pytest.approx(lnas_ref, rel=1e-12, abs=0)
    assert dnas == pytest.approx(dnas_ref, rel=1e-12, abs=0)


@pytest.mark.parametrize("kwargs, match", [
    ({"std": math.inf}, "std=inf"), ({"std": True}, "std=True"), ({"std": math.nan}, "std=nan"),
    ({"seed": -1}, "seed=-1"), ({"seed": 1.5}, "seed=1.5"), ({"seed": True}, "seed=True"),
    ({"center0": [math.nan]}, "center0=.nan"), ({"center1": [math.inf]}, "center1=.inf"),
    ({"center0": [], "center1": []}, "center0=..; expected at least one coordinate"),
])
def test_two_clusters_rejects_values_that_give_non_finite_points(kwargs, match):
    args = {"center0": [1.0], "center1": [-1.0], **kwargs}
    with pytest.raises(ValueError, match=match):
        two_clusters(2, 2, **args)


def test_two_clusters_takes_a_numpy_integer_seed():
    # the seed passed the check and then failed in manual_seed with "an integer is required"
    a = two_clusters(3, 3, [1.0], [-1.0], seed=np.int64(3))
    torch.testing.assert_close(a, two_clusters(3, 3, [1.0], [-1.0], seed=3), rtol=0, atol=0)


@pytest.mark.parametrize("kwargs, match", [
    ({"gap": True}, "gap=True"), ({"gap": math.inf}, "gap=inf"), ({"gap": math.nan}, "gap=nan"),
    ({"min_fraction": True}, "min_fraction=True"), ({"min_fraction": math.nan}, "min_fraction=nan"),
])
def test_count_clusters_rejects_booleans_and_non_finite_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        count_clusters(two_clusters(3, 3, [1.0], [-1.0]), **kwargs)


@pytest.mark.parametrize("n0, n1, fraction", [(93, 7, 0.07), (97, 3, 0.03), (86, 14, 0.14), (71, 29, 0.29)])
def test_a_cluster_holding_exactly_min_fraction_of_the_points_counts(n0, n1, fraction):
    """ceil(0.07 * 100) is 8 in floats (0.07 * 100 = 7.000000000000001): the 7-point cluster was dropped."""
    counts = count_clusters(two_clusters(n0, n1, [0.0], [5.0]), min_fraction=fraction)
    assert counts.min_size == n1 and counts.count == 2


@pytest.mark.parametrize("lnas_unbalanced, held", [((1, 1), True), ((1, 2), False), ((2, 2), False)])
def test_the_2d_claims_need_every_seed(lnas_unbalanced, held, tmp_path, monkeypatch):
    """"LNAS collapses to one cluster" is judged on every seed's final count: one seed of two was enough when
    the rule read any() for all(), and no test caught it."""
    from attnkit.analysis import repro_mode_collapse
    from attnkit.analysis.report import ReproduceResult

    def run(n0, n1, steps, seed, std=MODE_COLLAPSE_2D_STD, scale=1.0):
        final = {name: 2 for name in repro_mode_collapse._MECHANISMS_2D}
        if n0 != n1 and std == MODE_COLLAPSE_2D_STD and scale == 1.0:  # the unbalanced case of the claims
            final["softmax"] = lnas_unbalanced[seed]
        counts = {name: [2] * steps + [c] for name, c in final.items()}
        points = np.zeros((steps + 1, n0 + n1, 2))
        return np.r_[np.zeros(n0, dtype=int), np.ones(n1, dtype=int)], dict.fromkeys(final, points), counts

    monkeypatch.setattr(repro_mode_collapse, "_run_2d", run)
    monkeypatch.setattr(repro_mode_collapse, "plot_mode_collapse_2d", lambda *a, **k: tmp_path / "x.png")
    result = ReproduceResult(name="mode-collapse-2d", out=tmp_path)
    repro_mode_collapse.mode_collapse_2d(result, quick=True)
    claim = next(c for c in result.claims if "LNAS collapses to one cluster" in c.statement)
    assert claim.held is held
    assert f"1 cluster in {sum(c == 1 for c in lnas_unbalanced)}/2 seeds" in claim.evidence


def test_the_simulation_options_each_change_the_trajectory_as_stated():
    """Dot scores on points of unequal norms (the tests' clusters at +-a gave dot = gaussian + a^2, which
    every normalization cancels), the score scale, hnas's hybrid weight and the second cluster's seed were
    each droppable without a failing test."""
    from attnkit.analysis.mode_collapse import two_clusters

    x = two_clusters(6, 4, [1.0, 0.5], [-0.8, 0.2], std=0.3, seed=1)
    for mech in ("softmax", "dnas"):
        dot = simulate_self_attention(x, mech, steps=2, scores="dot")
        y = x
        for _ in range(2):  # x <- normalize(x x^T) x, by hand
            y = ak.normalize((y @ y.T)[None, None], mech)[0, 0] @ y
        torch.testing.assert_close(dot[-1], y, atol=1e-12, rtol=0)
        # scale c on gaussian scores = scale 1 on the points times sqrt(c), scaled back
        torch.testing.assert_close(simulate_self_attention(x, mech, steps=3, scale=4.0),
                                   simulate_self_attention(2 * x, mech, steps=3) / 2, atol=1e-12, rtol=0)
    for u, same_as in ((0.0, "softmax"), (1.0, "dnas")):
        torch.testing.assert_close(simulate_self_attention(x, "hnas", steps=2, hybrid_weight=u),
                                   simulate_self_attention(x, same_as, steps=2), atol=1e-12, rtol=0)
    again = two_clusters(6, 4, [1.0, 0.5], [-0.8, 0.2], std=0.3, seed=1)
    other = two_clusters(6, 4, [1.0, 0.5], [-0.8, 0.2], std=0.3, seed=2)
    assert torch.equal(again, x) and not torch.equal(other[6:], x[6:]) and not torch.equal(other[:6], x[:6])
