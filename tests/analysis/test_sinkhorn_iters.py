"""``sinkhorn-iters``: the sweep runs on a tiny budget and its claims are computed, not asserted."""

from __future__ import annotations

from attnkit.analysis.repro_sinkhorn import SINKHORN_ITERS, normalization_times


def test_normalization_times_cover_every_k_and_are_positive():
    times = normalization_times(rounds=2, shape=(2, 1, 4, 6))
    assert set(times) == set(SINKHORN_ITERS) and all(t > 0 for t in times.values())


def test_target_quick_reports_every_k(tmp_path, monkeypatch):
    from attnkit.analysis import repro_sinkhorn
    from attnkit.analysis.reproduce import reproduce

    real = repro_sinkhorn.train_multiview
    monkeypatch.setattr(repro_sinkhorn, "train_multiview", lambda *a, **k: real(*a, **{**k, "steps": 3}))
    result = reproduce("sinkhorn-iters", tmp_path / "sk", quick=True)
    assert [row["k"] for row in result.rows] == list(SINKHORN_ITERS)
    assert len(result.claims) == 2 and all(c.criterion == "paper" for c in result.claims)
    assert (tmp_path / "sk" / "sinkhorn_iters.png").stat().st_size > 0


def test_a_collapse_beyond_noise_is_reported_beside_the_held_claim(tmp_path, monkeypatch):
    """k >= 2 at half DNAS's accuracy passed as "do not improve" with nothing said about the fall."""
    from types import SimpleNamespace

    from attnkit.analysis import repro_sinkhorn
    from attnkit.analysis.reproduce import reproduce

    def fake(mechanism, *, seed, **_):
        base = 0.85 if mechanism.iters <= 1 else 0.43
        return SimpleNamespace(accuracy=base + 0.01 * seed, loss=1.0)

    monkeypatch.setattr(repro_sinkhorn, "train_multiview", fake)
    claim = reproduce("sinkhorn-iters", tmp_path / "sk", quick=True).claims[0]
    assert claim.held and "worse beyond noise at k = [2, 3, 4, 5]" in claim.evidence
    assert "(worse beyond noise at k = 2, 3, 4, 5)" in claim.ours
