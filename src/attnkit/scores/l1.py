"""Negative L1 distance scores, the ``N`` matrix of CoDA (eq. 10): ``-||q_i - k_j||_1 / sqrt(D)``."""

from ..mechanisms.coda import neg_l1_distance

__all__ = ["neg_l1_distance"]
