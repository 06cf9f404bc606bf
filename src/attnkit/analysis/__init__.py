"""Diagnostics of the papers' claims: explaining away, Lemma 1, mode collapse, CoDA matrices.

- :func:`explain_away`, :func:`log_sum_histogram`: per-key weight sums of any weights ``(B, H, Lq, Lk)``.
- :func:`collect_explain_away`: the same statistics from every ``ak.attention`` call of a forward pass.
- :func:`center_distance_lnas`, :func:`center_distance_dnas`, :func:`simulate_self_attention`,
  :func:`count_clusters`: mode collapse ("Doubly-Normalized Attention" eqs. 11-14, "Attention that does not
  Explain Away" (arXiv:2009.14308) Appendix E).
- ``attnkit.analysis.reproduce.reproduce(name)``: the ``attnkit reproduce NAME`` targets; plotting helpers
  in ``attnkit.analysis.plots`` (matplotlib, the ``plot`` extra).
"""

from .collect import ExplainAwayLog, ExplainAwayRecord, collect_explain_away
from .explain_away import ExplainAway, explain_away, log_sum_histogram
from .mode_collapse import (
    ClusterCounts,
    center_distance_dnas,
    center_distance_lnas,
    count_clusters,
    simulate_self_attention,
    two_clusters,
)

__all__ = [
    "ExplainAway",
    "explain_away",
    "log_sum_histogram",
    "ExplainAwayRecord",
    "ExplainAwayLog",
    "collect_explain_away",
    "ClusterCounts",
    "center_distance_lnas",
    "center_distance_dnas",
    "simulate_self_attention",
    "two_clusters",
    "count_clusters",
]
