"""Reproductions of the explaining-away claims.

- ``explain-away``: "Doubly-Normalized Attention", Fig. 1 (``min_j sum_i pi_ij`` during training
  against the ``1/L`` bound) and "Attention that does not Explain Away" (arXiv:2009.14308), Fig. 1 (histogram
  of the log
  weight sums, eps = 1e-3): a one-layer multi-view fusion model (:class:`MultiViewFusion`) trained with
  LNAS, DNAS and HNAS on a synthetic task; HNAS's hybrid weight is plotted over training ("Doubly-Normalized
  Attention" Fig. 3).
- ``lemma1``: "Doubly-Normalized Attention" Lemma 1 (Appendix B): on random inputs across shapes and masks,
the observed minimum
  of ``n_k * sum_i pi_ij`` must be >= 1 for DNAS (and Sinkhorn with >= 1 iteration, by the same proof).
"""

from __future__ import annotations

import numpy as np
import torch

from ..config import Hybrid, Sinkhorn
from ..functional import normalize
from .explain_away import explain_away
from .plots import plot_hybrid_trajectories, plot_lemma1, plot_log_sum_histograms, plot_min_weight_sum
from .report import Claim, ReproduceResult, exceeds, spread, write_csv
from .toy_models import train_multiview

__all__ = ["explain_away_training", "explain_away_budget", "lemma1", "LEMMA1_CASES", "PAPER_LOG_SUM"]

EPS = 1e-3


PAPER_LOG_SUM = -20.0  # AEA Fig. 1 caption: "the logarithm of their weights-sum is less than -20"
# AEA Table 1 (VQA v2 test-dev): no-attn 68.79%, LNAS 69.14%, DNAS 69.70%; as fractions, the unit of our
# accuracy beside them.
PAPER_VQA_TEST_DEV = {"uniform": 0.6879, "softmax": 0.6914, "dnas": 0.6970}
EXPLAIN_AWAY_MECHANISMS = ("uniform", "softmax", "dnas", "hnas")
# The DNAS-vs-LNAS accuracy claim is trained on the harder variant of the task that ``sinkhorn-iters`` uses:
# on the default one (4 classes, 3 label-carrying boxes) LNAS reaches 100% and cannot be beaten.
ACCURACY_TASK = {"num_classes": 8, "informative": 1}
ACCURACY_MECHANISMS = ("softmax", "dnas")


def _paper_vs(a: str, b: str) -> str:
    """AEA Table 1's ``a`` vs ``b`` as fractions, the paper's percentages in brackets: "0.6914 vs 0.6879
    (69.14% vs 68.79%)"."""
    pa, pb = PAPER_VQA_TEST_DEV[a], PAPER_VQA_TEST_DEV[b]
    return f"{pa:.4f} vs {pb:.4f} ({100 * pa:.2f}% vs {100 * pb:.2f}%)"


def explain_away_budget(quick: bool) -> tuple[int, int, int]:
    """``(seeds, steps, eval_every)`` of the explain-away target."""
    return (3, 150, 10) if quick else (5, 400, 20)


def explain_away_training(result: ReproduceResult, quick: bool = False, seed: int = 0) -> None:
    """Train the multi-view model with no attention, softmax, dnas and hnas over several seeds.

    Checks AEA's Fig. 1 (most LNAS keys have log weight sums below -20), Fig. 3 (the HNAS
    weight u moves to 1, i.e. towards DNAS) and Table 1 (no-attn < LNAS < DNAS accuracy), each with the
    paper's criterion, plus DNA's Fig. 1 / Lemma 1 bound and the looser eps = 1e-3 threshold (still a
    majority of keys). DNAS vs LNAS accuracy is compared on the harder variant ``ACCURACY_TASK`` (8 classes,
    one label-carrying box), trained apart on the same seeds and steps; every other claim on the default task.
    """
    out = result.out
    n_seeds, steps, every = explain_away_budget(quick)
    seeds = list(range(seed, seed + n_seeds))
    result.budget = (
        f"{n_seeds} seeds x {steps} Adam steps (batch 64), one-layer multi-view model, 40-50 keys; DNAS vs "
        "LNAS accuracy on the harder variant (8 classes, 1 informative box, as sinkhorn-iters), where LNAS "
        "stays below 100%"
    )
    runs = {name: [train_multiview(name, steps=steps, eval_every=every, eps=EPS, seed=s) for s in seeds]
            for name in EXPLAIN_AWAY_MECHANISMS}
    harder = {  # final accuracy only: one evaluation at the last step
        name: [train_multiview(name, steps=steps, eval_every=steps, seed=s, **ACCURACY_TASK).accuracy
               for s in seeds]
        for name in ACCURACY_MECHANISMS
    }
    first = {name: r[0] for name, r in runs.items()}
    max_keys = first["softmax"].max_keys
    bound = 1.0 / max_keys
    curve_rows = []
    for name, per_seed in runs.items():
        for s, run in zip(seeds, per_seed):
            curve_rows += [
                {"mechanism": name, "seed": s, "step": int(t), "min_sum": m, "min_normalized": mn,
                 "fraction_below_eps": f, "hybrid_u": u}
                for t, m, mn, f, u in zip(run.steps, run.min_sums, run.min_normalized, run.fraction_below_eps,
                                          run.hybrid_u)
            ]
    result.add_file(write_csv(out / "training_curves.csv", curve_rows))
    attn = [n for n in EXPLAIN_AWAY_MECHANISMS if n != "uniform"]
    log_rows = [{"mechanism": name, "seed": s, "log_sum": float(v)}
                for name in attn for s, run in zip(seeds, runs[name]) for v in run.log_sums]
    result.add_file(write_csv(out / "final_log_sums.csv", log_rows))
    result.add_file(plot_log_sum_histograms(
        {name: np.concatenate([r.log_sums for r in runs[name]]) for name in attn},
        out / "log_sum_histogram.png",
        eps=EPS, bound=bound,
        title=f"log key weight sums, {steps} steps, {n_seeds} seeds (Fig. 1: most LNAS < -20)",
    ))
    result.add_file(plot_min_weight_sum(
        first["softmax"].steps, {name: first[name].min_sums for name in attn}, out / "min_weight_sum.png",
        bound=bound, title=f"min_j sum_i pi_ij on held-out data during training (seed {seed})",
    ))
    result.add_file(plot_hybrid_trajectories(
        first["hnas"].steps, np.stack([r.hybrid_u for r in runs["hnas"]], axis=1)[:, None, :],
        out / "hybrid_weight.png",
        title=f"HNAS hybrid weight u during training, {n_seeds} seeds (paper Fig. 3: u -> 1.0)",
        line_labels=[f"seed {s}" for s in seeds],
    ))

    def per_seed(name: str, fn) -> list[float]:
        return [float(fn(r)) for r in runs[name]]

    below20 = {n: per_seed(n, lambda r: np.mean(r.log_sums < PAPER_LOG_SUM)) for n in attn}
    below_eps = {n: per_seed(n, lambda r: r.fraction_below_eps[-1]) for n in attn}
    accuracy = {n: per_seed(n, lambda r: r.accuracy) for n in EXPLAIN_AWAY_MECHANISMS}
    final_u = per_seed("hnas", lambda r: r.hybrid_u[-1])
    for name in EXPLAIN_AWAY_MECHANISMS:
        rs = runs[name]
        row = {"mechanism": name, "seeds": n_seeds, "accuracy": spread(accuracy[name]),
               "accuracy (8 classes, 1 box)": spread(harder[name]) if name in harder else "-",
               "paper VQA test-dev": PAPER_VQA_TEST_DEV.get(name, float("nan"))}
        if name == "uniform":
            row.update({"share log sum < -20": "-", "share < eps": "-", "min log sum": float("nan"),
                        "min n_k*sum": float("nan"), "final u": float("nan")})
        else:
            row.update({
                "share log sum < -20": spread(below20[name]), "share < eps": spread(below_eps[name]),
                "min log sum": float(min(r.log_sums.min() for r in rs)),
                "min n_k*sum": float(min(r.min_normalized.min() for r in rs)),
                "final u": spread(final_u) if name == "hnas" else float("nan"),
            })
        result.rows.append(row)

    soft_b20, dnas_min = np.asarray(below20["softmax"]), min(r.min_normalized.min() for r in runs["dnas"])
    soft_eps, dnas_eps = np.asarray(below_eps["softmax"]), np.asarray(below_eps["dnas"])
    mean_acc = {n: float(np.mean(v)) for n, v in accuracy.items()}
    mean_harder = {n: float(np.mean(v)) for n, v in harder.items()}
    # "better" needs a gap beyond two standard errors over the seeds
    lnas_better = exceeds(accuracy["softmax"], accuracy["uniform"])
    dnas_better = exceeds(harder["dnas"], harder["softmax"])
    u = np.asarray(final_u)
    result.claims += [
        Claim("AEA Fig. 1 (caption)",
              "Majority of the neurons in LNAS are eps-explained away, as the logarithm of their "
              "weights-sum is less than -20", bool(np.all(soft_b20 > 0.5)),
              f"share of LNAS keys with log sum < -20 per seed: {np.round(soft_b20, 3).tolist()}; "
              "lowest log sum "
              f"{min(r.log_sums.min() for r in runs['softmax']):.1f}",
              paper="> 50% of keys below -20", ours=spread(soft_b20)),
        Claim("AEA sec. 4 (eps = 1e-3)",
              "a majority of LNAS keys is eps-explained-away (sum < 1e-3), none under DNAS",
              bool(np.all(soft_eps > 0.5) and np.all(dnas_eps == 0)),
              f"share below eps per seed: LNAS {np.round(soft_eps, 3).tolist()}, DNAS "
              f"{np.round(dnas_eps, 3).tolist()}; the threshold is looser than the paper's -20 "
              "(log 1e-3 = -6.9), the paper's 'majority' (> 50% in every seed) is kept",
              paper="majority below -20",
              ours=f"LNAS {spread(soft_eps)} below 1e-3 (needs > 0.5), DNAS {spread(dnas_eps)} (needs 0)",
              criterion="weaker"),
        Claim("DNA Fig. 1 / Lemma 1", "DNAS keeps every key's weight sum >= 1/n_k throughout training",
              bool(dnas_min >= 1 - 1e-6),
              f"min over {n_seeds} seeds x {len(first['dnas'].steps)} evaluations of n_k * sum = "
              f"{dnas_min:.4f}",
              paper=">= 1/n_k (proof)", ours=f"min n_k * sum {dnas_min:.4f}"),
        Claim("AEA Fig. 3 / sec. 6.1",
              "the hybrid weight rapidly converges to 1.0: the model heavily favors DNAS over LNAS",
              bool(np.all(u > 0.9)), f"final u per seed {np.round(u, 3).tolist()} from u0 = 0.5 "
              f"(direction: {'towards DNAS' if u.mean() > 0.5 else 'towards LNAS (softmax)'})",
              paper="u -> 1.0", ours=spread(u)),
        Claim("AEA Fig. 3 (direction only)", "u moves from u0 = 0.5 towards DNAS (u > 0.5)",
              bool(np.all(u > 0.5)), f"final u per seed {np.round(u, 3).tolist()}",
              paper="u -> 1.0", ours=spread(u), criterion="weaker"),
        Claim("AEA Table 1", "attention (LNAS) improves over the no-attn baseline",
              lnas_better[0],
              f"mean accuracy LNAS {mean_acc['softmax']:.4f} vs no-attn {mean_acc['uniform']:.4f}, "
              f"{lnas_better[1]} (synthetic task, not VQA)", paper=_paper_vs("softmax", "uniform"),
              ours=f"{spread(accuracy['softmax'])} vs {spread(accuracy['uniform'])}",
              criterion="different"),
        Claim("AEA Table 1", "DNAS achieves better accuracy than LNAS",
              dnas_better[0],
              f"mean accuracy DNAS {mean_harder['dnas']:.4f} vs LNAS {mean_harder['softmax']:.4f}, "
              f"{dnas_better[1]} (synthetic task, harder variant: 8 classes, 1 informative box; on the "
              f"default task LNAS is at {mean_acc['softmax']:.4f}, DNAS {mean_acc['dnas']:.4f})",
              paper=_paper_vs("dnas", "softmax"),
              ours=f"{spread(harder['dnas'])} vs {spread(harder['softmax'])} (8 classes, 1 informative box)",
              criterion="different"),
    ]


def _lemma1_cases() -> list[tuple[str, tuple[int, int, int, int], str]]:
    shapes = [(2, 2, 8, 8), (3, 4, 5, 17), (2, 1, 33, 4), (1, 2, 64, 64), (4, 2, 1, 9)]
    masks = ["none", "key padding", "query padding", "both padding", "random attn_mask"]
    return [(f"{B}x{H}x{Lq}x{Lk} {m}", (B, H, Lq, Lk), m) for (B, H, Lq, Lk) in shapes for m in masks]


LEMMA1_CASES = _lemma1_cases()
_LEMMA1_MECHANISMS = {
    "softmax": "softmax",
    "dnas": "dnas",
    "hnas": Hybrid(u0=0.5),
    "sinkhorn": Sinkhorn(iters=3),
}


def _random_masks(shape, kind: str, g: torch.Generator):
    B, H, Lq, Lk = shape
    key_mask = query_mask = attn_mask = None

    def lengths(L):  # at least one real token per row, one fully padded row when B > 2
        n = torch.randint(1, L + 1, (B,), generator=g)
        if B > 2:
            n[-1] = 0
        return torch.arange(L)[None, :] < n[:, None]

    if kind in ("key padding", "both padding"):
        key_mask = lengths(Lk)
    if kind in ("query padding", "both padding"):
        query_mask = lengths(Lq)
    if kind == "random attn_mask":
        attn_mask = torch.rand(B, H, Lq, Lk, generator=g) < 0.6
    return key_mask, query_mask, attn_mask


def lemma1(result: ReproduceResult, quick: bool = False, seed: int = 0) -> None:
    """Observed minimum of ``n_k * sum_i pi_ij`` over random float64 inputs, per case and mechanism."""
    trials = 3 if quick else 20
    result.budget = f"{len(LEMMA1_CASES)} cases (shapes x masks) x {trials} random float64 inputs"
    g = torch.Generator().manual_seed(seed)
    rows = []
    for case, shape, kind in LEMMA1_CASES:
        minima = {name: float("inf") for name in _LEMMA1_MECHANISMS}
        for trial in range(trials):
            temperature = (1.0, 5.0, 30.0)[trial % 3]  # large scores make softmax explain keys away
            scores = temperature * torch.randn(*shape, generator=g, dtype=torch.float64)
            key_mask, query_mask, attn_mask = _random_masks(shape, kind, g)
            for name, mech in _LEMMA1_MECHANISMS.items():
                w = normalize(scores, mech, key_mask=key_mask, query_mask=query_mask, attn_mask=attn_mask)
                stats = explain_away(w, key_mask=key_mask, query_mask=query_mask, valid=attn_mask)
                if np.isfinite(stats.min_normalized):
                    minima[name] = min(minima[name], stats.min_normalized)
        for name, value in minima.items():
            rows.append({"case": case, "mechanism": name, "trials": trials, "min_normalized": value})
    result.add_file(write_csv(result.out / "lemma1.csv", rows))
    result.add_file(
        plot_lemma1(
            rows,
            result.out / "lemma1.png",
            title=f"Lemma 1: min_j n_k * sum_i pi_ij over {trials} random inputs per case",
        )
    )
    overall = {
        name: min(r["min_normalized"] for r in rows if r["mechanism"] == name) for name in _LEMMA1_MECHANISMS
    }
    for name, value in overall.items():
        worst = min((r for r in rows if r["mechanism"] == name), key=lambda r: r["min_normalized"])
        result.rows.append(
            {
                "mechanism": name,
                "cases": len(LEMMA1_CASES),
                "trials per case": trials,
                "min n_k*sum": value,
                "worst case": worst["case"],
                "bound": {"dnas": "1 (Lemma 1)", "sinkhorn": "1", "hnas": "u = 0.5", "softmax": "none"}[name],
            }
        )
    result.claims += [
        Claim("DNA Lemma 1 (App. B)", "DNAS: every key with a valid query gets n_k * sum_i pi_ij >= 1",
              overall["dnas"] >= 1 - 1e-9, f"observed min {overall['dnas']:.6f} over "
              f"{len(LEMMA1_CASES) * trials} inputs", paper=">= 1 (proof)", ours=f"{overall['dnas']:.6f}"),
        Claim("Lemma 1 proof applied to Sinkhorn", "Sinkhorn (3 iterations) also keeps n_k * sum >= 1",
              overall["sinkhorn"] >= 1 - 1e-9, f"observed min {overall['sinkhorn']:.6f}",
              paper=">= 1 (proof)",
              ours=f"{overall['sinkhorn']:.6f}"),
        Claim("DNA sec. 5.1", "softmax has no such bound (keys can be explained away)",
              overall["softmax"] < 1, f"observed min {overall['softmax']:.3e}", paper="no bound",
              ours=f"{overall['softmax']:.3e}"),
    ]
