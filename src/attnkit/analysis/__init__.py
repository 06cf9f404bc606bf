"""Diagnostics of the papers' claims: explaining away, Lemma 1, mode collapse, CoDA matrices."""

from .explain_away import ExplainAway, explain_away

__all__ = ["ExplainAway", "explain_away"]
