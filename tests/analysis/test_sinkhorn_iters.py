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
