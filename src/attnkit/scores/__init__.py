"""Score functions ``s (B, H, Lq, Lk)`` from queries and keys; each can feed any normalization
(``ak.normalize(scores, mechanism=...)``)."""

from .additive import AdditiveScore, additive
from .bilinear import BilinearScore, bilinear
from .dot import dot, scaled_dot
from .l1 import neg_l1_distance

SCORE_FUNCTIONS = ("dot", "scaled_dot", "bilinear", "additive")

__all__ = [
    "SCORE_FUNCTIONS",
    "AdditiveScore",
    "BilinearScore",
    "additive",
    "bilinear",
    "dot",
    "scaled_dot",
    "neg_l1_distance",
]
