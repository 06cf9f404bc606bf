"""Reproductions of the mode-collapse claims.

- ``mode-collapse-curves``: "Doubly-Normalized Attention", Fig. 2 (section 5.2, Appendix C): center
  distance after one step against ``r = N0 / N1`` for several ``a``, LNAS vs DNAS, closed forms
  (eqs. 11-14) and simulated points (exactly separated clusters) on the same axes.
- ``mode-collapse-2d``: "Attention that does not Explain Away" (arXiv:2009.14308), Appendix E (Figs. 6, 8, 9):
500 points
  around (1.8, 0.7) and 50 around (-1, -1), or 225/225, four steps of self-attention with Gaussian-kernel
  scores under LNAS, DNAS, HNAS and Sinkhorn, and the number of clusters left after each step.

The covariance of the 2-D clusters was lost in the extraction of the paper; we use ``0.1 I``
(std ``sqrt(0.1)``) for the figures and count clusters by the gap rule of :func:`count_clusters` (gap
0.5). Because the outcome depends on that choice, the target also sweeps the spread (std 0.1-1.0) and the
key/query scale (the factor on the scores) and reports, per mechanism, the range of spreads at which two
clusters survive four steps (``sensitivity.png``, ``sensitivity.csv``).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ..config import Hybrid, Sinkhorn
from .mode_collapse import (
    center_distance_dnas,
    center_distance_lnas,
    count_clusters,
    simulate_self_attention,
    two_clusters,
)
from .plots import plot_center_distance_curves, plot_mode_collapse_2d
from .report import Claim, ReproduceResult, write_csv

__all__ = [
    "mode_collapse_curves",
    "mode_collapse_2d",
    "mode_collapse_sweep",
    "MODE_COLLAPSE_2D_STD",
    "CLUSTER_GAP",
    "SWEEP_STDS",
    "SWEEP_SCALES",
]

MODE_COLLAPSE_2D_STD = math.sqrt(0.1)
CLUSTER_GAP = 0.5
CURVE_A_VALUES = (0.5, 1.0, 1.5)
SIMULATED_SIZES = (
    (1, 40),
    (2, 40),
    (5, 40),
    (10, 40),
    (20, 40),
    (40, 40),
    (40, 20),
    (40, 10),
    (40, 5),
    (40, 2),
    (40, 1),
)


def mode_collapse_curves(result: ReproduceResult, quick: bool = False, seed: int = 0) -> None:
    """DNA Fig. 2: closed forms against simulation, DNAS >= LNAS, equality at r = 1."""
    out = result.out
    r = np.logspace(-2, 2, 81 if quick else 201)
    result.budget = (f"closed forms on {len(r)} ratios r, simulation at {len(SIMULATED_SIZES)} sizes "
                     "x 3 values of a")
    curves, simulated = {}, {}
    curve_rows, sim_rows = [], []
    for a in CURVE_A_VALUES:
        lnas, dnas = center_distance_lnas(r, a), center_distance_dnas(r, a)
        curves[a] = {"softmax": lnas, "dnas": dnas}
        curve_rows += [{"a": a, "r": ri, "lnas": li, "dnas": di} for ri, li, di in zip(r, lnas, dnas)]
        simulated[a] = {}
        for name, closed_form in (("softmax", center_distance_lnas), ("dnas", center_distance_dnas)):
            rs, ds = [], []
            for n0, n1 in SIMULATED_SIZES:
                x = two_clusters(n0, n1, [a], [-a])  # exactly separated: every point on its center
                after = simulate_self_attention(x, name, steps=1)[1, :, 0]  # (N,)
                distance = float(after[:n0].mean() - after[n0:].mean())
                expected = closed_form(n0 / n1, a)
                rs.append(n0 / n1)
                ds.append(distance)
                sim_rows.append(
                    {"a": a, "n0": n0, "n1": n1, "r": n0 / n1, "mechanism": name, "simulated": distance,
                     "closed_form": expected, "abs_error": abs(distance - expected)}
                )
            simulated[a][name] = (np.asarray(rs), np.asarray(ds))
    result.add_file(write_csv(out / "closed_form.csv", curve_rows))
    result.add_file(write_csv(out / "simulated.csv", sim_rows))
    result.add_file(plot_center_distance_curves(
        r, curves, out / "center_distance.png", simulated=simulated,
        title="Center distance after one step: LNAS (solid) vs DNAS (dashed), "
        "'Doubly-Normalized Attention' Fig. 2",
    ))

    for a in CURVE_A_VALUES:
        for ratio in (0.1, 0.5, 1.0, 2.0, 10.0):
            result.rows.append(
                {"a": a, "r": ratio, "initial": 2 * a, "lnas": center_distance_lnas(ratio, a),
                 "dnas": center_distance_dnas(ratio, a)}
            )
    max_err = max(row["abs_error"] for row in sim_rows)
    gaps = np.concatenate([curves[a]["dnas"] - curves[a]["softmax"] for a in CURVE_A_VALUES])
    off_one = np.concatenate([np.abs(np.log(r)) > 1e-9 for _ in CURVE_A_VALUES])
    at_one = max(abs(center_distance_dnas(1.0, a) - center_distance_lnas(1.0, a)) for a in CURVE_A_VALUES)
    decays = all(np.all(curves[a][m] < 2 * a) for a in CURVE_A_VALUES for m in ("softmax", "dnas"))
    result.claims += [
        Claim("DNA eqs. (11)-(14)",
              "the closed forms match simulated self-attention on exactly separated clusters",
              max_err < 1e-6, f"max |closed form - simulated| = {max_err:.2e} over {len(sim_rows)} points",
              paper="eqs. (11)-(14)", ours=f"max error {max_err:.1e}"),
        Claim("DNA sec. 5.2", "the center distance decays after one step under both schemes",
              decays, f"all distances < 2a for a in {CURVE_A_VALUES}", paper="distance < 2a",
              ours="all < 2a" if decays else "not all < 2a"),
        Claim("DNA sec. 5.2 / App. C", "the DNAS distance upper-bounds LNAS for r != 1",
              bool(np.all(gaps[off_one] > 0)), f"min (DNAS - LNAS) over r != 1: {gaps[off_one].min():.3e}",
              paper="DNAS > LNAS", ours=f"min gap {gaps[off_one].min():.2e}"),
        Claim("DNA App. C", "at r = 1 both schemes give the same distance",
              at_one < 1e-12, f"max |DNAS - LNAS| at r = 1: {at_one:.1e}", paper="equal",
              ours=f"max difference {at_one:.1e}"),
    ]


_MECHANISMS_2D = {"softmax": "softmax", "dnas": "dnas", "hnas": Hybrid(u0=0.5), "sinkhorn": Sinkhorn(iters=3)}
_CASES_2D = {"unbalanced": (500, 50), "balanced": (225, 225)}


SWEEP_STDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.85, 1.0)
SWEEP_SCALES = (0.5, 1.0, 2.0)


def _run_2d(
    n0: int, n1: int, steps: int, seed: int, std: float = MODE_COLLAPSE_2D_STD, scale: float = 1.0
) -> tuple[np.ndarray, dict, dict]:
    x = two_clusters(n0, n1, [1.8, 0.7], [-1.0, -1.0], std=std, seed=seed)
    trajectories, counts = {}, {}
    for name, mech in _MECHANISMS_2D.items():
        traj = simulate_self_attention(x, mech, steps=steps, scale=scale)  # (T+1, N, 2)
        trajectories[name] = traj.numpy()
        counts[name] = [count_clusters(traj[t], gap=CLUSTER_GAP).count for t in range(steps + 1)]
    labels = np.r_[np.zeros(n0, dtype=int), np.ones(n1, dtype=int)]
    return labels, trajectories, counts


def mode_collapse_2d(result: ReproduceResult, quick: bool = False, seed: int = 0) -> None:
    """Appendix E: cluster counts after each of 4 steps, unbalanced (500/50) and balanced (225/225)."""
    out, steps = result.out, 4
    seeds = range(seed, seed + (2 if quick else 5))
    finals: dict[tuple[str, str], list[int]] = {}
    step_rows, point_rows = [], []
    for case, (n0, n1) in _CASES_2D.items():
        for s in seeds:
            labels, trajectories, counts = _run_2d(n0, n1, steps, s)
            for name, c in counts.items():
                finals.setdefault((case, name), []).append(c[-1])
            if s != seed:
                continue
            for name, traj in trajectories.items():
                for t in range(steps + 1):
                    d = np.linalg.norm(traj[t][labels == 0].mean(0) - traj[t][labels == 1].mean(0))
                    step_rows.append({"case": case, "n0": n0, "n1": n1, "mechanism": name, "step": t,
                                      "clusters": counts[name][t], "center_distance": float(d)})
                    point_rows += [
                        {
                            "case": case,
                            "mechanism": name,
                            "step": t,
                            "point": i,
                            "cluster": int(labels[i]),
                            "x1": float(p[0]),
                            "x2": float(p[1]),
                        }
                        for i, p in enumerate(traj[t])
                    ]
            result.add_file(plot_mode_collapse_2d(
                trajectories, labels, out / f"mode_collapse_{case}.png", steps_to_show=(0, 1, 2, 4),
                cluster_counts=counts,
                title=f"{n0} points around (1.8, 0.7), {n1} around (-1, -1): 4 steps of self-attention",
            ))
            for name in trajectories:
                result.rows.append({"case": f"{case} {n0}/{n1}", "mechanism": name,
                                    **{f"step {t}": counts[name][t] for t in range(steps + 1)}})
    result.add_file(write_csv(out / "cluster_counts.csv", step_rows))
    result.add_file(write_csv(out / "points.csv", point_rows))
    seed_rows = [{"case": case, "mechanism": name, "seeds": len(v), "final_counts": " ".join(map(str, v))}
                 for (case, name), v in finals.items()]
    result.add_file(write_csv(out / "final_counts_by_seed.csv", seed_rows))

    def share(case: str, name: str, k: int) -> tuple[bool, str]:
        v = finals[(case, name)]
        return all(c == k for c in v), f"{sum(c == k for c in v)}/{len(v)} seeds"

    rule = (
        f"gap rule: chains of steps < {CLUSTER_GAP}, clusters of >= 2% of the points; "
        f"std {MODE_COLLAPSE_2D_STD:.3f}"
    )
    lnas_u, ev_lu = share("unbalanced", "softmax", 1)
    dnas_u, ev_du = share("unbalanced", "dnas", 2)
    lnas_b, ev_lb = share("balanced", "softmax", 2)
    dnas_b, ev_db = share("balanced", "dnas", 2)
    result.claims += [
        Claim("AEA App. E, Figs. 6/9",
              "unbalanced 500/50: LNAS collapses to one cluster after 4 steps",
              lnas_u, f"1 cluster in {ev_lu}; {rule}", paper="1 cluster", ours=f"1 cluster in {ev_lu}"),
        Claim("AEA App. E, Figs. 6/9", "unbalanced 500/50: DNAS keeps two clusters after 4 steps",
              dnas_u, f"2 clusters in {ev_du}", paper="2 clusters", ours=f"2 clusters in {ev_du}"),
        Claim("AEA App. E, Fig. 8", "balanced 225/225: both LNAS and DNAS keep two clusters",
              lnas_b and dnas_b, f"LNAS 2 clusters in {ev_lb}, DNAS in {ev_db}", paper="2 and 2",
              ours=f"LNAS {ev_lb}, DNAS {ev_db}"),
    ]
    sweep_seeds = list(seeds)[:3]
    result.budget = (f"{len(seeds)} seeds at std {MODE_COLLAPSE_2D_STD:.3f}; sweep {len(SWEEP_STDS)} stds x "
                     f"{len(SWEEP_SCALES)} score scales x {len(sweep_seeds)} seeds")
    _sweep_into(result, sweep_seeds)


def mode_collapse_sweep(
    seeds: Sequence[int],
    stds: Sequence[float] = SWEEP_STDS,
    scales: Sequence[float] = SWEEP_SCALES,
    steps: int = 4,
) -> list[dict]:
    """Final cluster counts for every case, mechanism, std, score scale and seed: one dict per run."""
    rows = []
    for case, (n0, n1) in _CASES_2D.items():
        for scale in scales:
            for std in stds:
                for s in seeds:
                    _, _, counts = _run_2d(n0, n1, steps, s, std=float(std), scale=float(scale))
                    rows += [{"case": case, "scale": float(scale), "std": float(std), "seed": int(s),
                              "mechanism": name, "initial_clusters": c[0], "final_clusters": c[-1]}
                             for name, c in counts.items()]
    return rows


def _two_cluster_share(
    rows: list[dict], case: str, name: str, scale: float, stds: Sequence[float]
) -> np.ndarray:
    # kept: two clusters at the start and after the last step (data that starts as one cluster and is split
    # in two by attention did not keep anything)
    return np.asarray([np.mean([r["initial_clusters"] == 2 and r["final_clusters"] == 2 for r in rows
                                if r["case"] == case and r["mechanism"] == name and r["scale"] == scale
                                and r["std"] == std])
                       for std in stds])


def _std_range(share: np.ndarray, stds: Sequence[float]) -> str:
    """The stds at which every seed kept two clusters, as ``a-b`` runs (``none`` when there is none)."""
    runs, start = [], None
    for i, ok in enumerate(list(share == 1.0) + [False]):
        if ok and start is None:
            start = i
        if not ok and start is not None:
            runs.append(f"{stds[start]:g}" if start == i - 1 else f"{stds[start]:g}-{stds[i - 1]:g}")
            start = None
    return ", ".join(runs) if runs else "none"


def _plot_sweep(rows: list[dict], stds, scales, path, title: str):
    from .plots import _pyplot

    plt = _pyplot()
    names = list(_MECHANISMS_2D)
    fig, axes = plt.subplots(len(_CASES_2D), len(names), figsize=(3.2 * len(names), 2.8 * len(_CASES_2D)),
                             squeeze=False, sharex=True, sharey=True)
    for i, case in enumerate(_CASES_2D):
        for j, name in enumerate(names):
            # (scales, stds)
            grid = np.stack([_two_cluster_share(rows, case, name, sc, stds) for sc in scales])
            ax = axes[i][j]
            im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
            ax.set_xticks(range(len(stds)), [f"{v:g}" for v in stds], rotation=90, fontsize=7)
            ax.set_yticks(range(len(scales)), [f"{v:g}" for v in scales], fontsize=7)
            ax.set_title(f"{case}: {name}", fontsize=9)
            if i == len(_CASES_2D) - 1:
                ax.set_xlabel("point std")
            if j == 0:
                ax.set_ylabel("score scale")
    fig.colorbar(im, ax=axes, shrink=0.8,
                 label="share of seeds starting and ending with 2 clusters (4 steps)")
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _sweep_into(result: ReproduceResult, seeds: Sequence[int]) -> None:
    out = result.out
    rows = mode_collapse_sweep(seeds)
    result.add_file(write_csv(out / "sensitivity.csv", rows))
    result.add_file(_plot_sweep(rows, SWEEP_STDS, SWEEP_SCALES, out / "sensitivity.png",
                                title=f"2 clusters kept after 4 steps, {len(seeds)} seeds per cell"))
    for case in _CASES_2D:
        for scale in SWEEP_SCALES:
            result.rows.append({"case": f"sweep {case}, scale {scale:g}",
                                **{name: _std_range(_two_cluster_share(rows, case, name, scale, SWEEP_STDS),
                                                    SWEEP_STDS) for name in _MECHANISMS_2D}})
    # The paper's pattern (unbalanced: LNAS 1 cluster and DNAS 2; balanced: both 2) per std and scale.
    def all_seeds(case, name, k, std, scale):  # two clusters at the start, k after the last step
        return all(r["initial_clusters"] == 2 and r["final_clusters"] == k for r in rows
                   if r["case"] == case and r["mechanism"] == name and r["scale"] == scale
                   and r["std"] == std)

    def pattern_at(scale: float) -> list[bool]:
        return [all_seeds("unbalanced", "softmax", 1, std, scale)
                and all_seeds("unbalanced", "dnas", 2, std, scale)
                and all_seeds("balanced", "softmax", 2, std, scale)
                and all_seeds("balanced", "dnas", 2, std, scale)
                for std in SWEEP_STDS]

    pattern = pattern_at(1.0)
    where = _std_range(np.asarray(pattern, dtype=float), SWEEP_STDS)
    other_scales = "; ".join(
        f"scale {sc:g}: std {_std_range(np.asarray(pattern_at(sc), dtype=float), SWEEP_STDS)}"
        for sc in SWEEP_SCALES if sc != 1.0)
    dnas_u = _std_range(_two_cluster_share(rows, "unbalanced", "dnas", 1.0, SWEEP_STDS), SWEEP_STDS)
    soft_u = _std_range(_two_cluster_share(rows, "unbalanced", "softmax", 1.0, SWEEP_STDS), SWEEP_STDS)
    starts_two = _std_range(np.asarray([
        all(r["initial_clusters"] == 2 for r in rows if r["case"] == "balanced" and r["scale"] == 1.0
            and r["std"] == std) for std in SWEEP_STDS], dtype=float), SWEEP_STDS)
    # Not a claim: the paper states its pattern for one covariance (not given), so how far it extends over the
    # spreads is what we saw, with nothing of the paper's to hold it against
    sweep = (f"Sensitivity (a sweep, not a paper claim: the paper shows one unstated covariance): the full "
             f"pattern (500/50: LNAS one cluster, DNAS two; 225/225: both two) holds in every seed at std "
             f"{where} of {tuple(SWEEP_STDS)} (score scale 1; {other_scales}); unbalanced two clusters: DNAS "
             f"at std {dnas_u}, LNAS at std {soft_u}; the balanced data starts as two clusters at std "
             f"{starts_two} only.")
    result.note = f"{result.note} {sweep}".strip()
