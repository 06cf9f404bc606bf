"""The normalizations ("mechanisms") as pure functions of scores and a validity mask."""

from .coda import ACTIVATION_FNS, GATE_FNS, coda_affinity, coda_gate, coda_weights
from .dnas import dnas_weights, key_log_normalizer
from .hybrid import check_hybrid_weight, hnas_weights, sigmoid_weight, whole_theta
from .sinkhorn import sinkhorn_column_potential, sinkhorn_weights
from .softmax import softmax_weights

__all__ = [
    "ACTIVATION_FNS",
    "GATE_FNS",
    "coda_weights",
    "coda_affinity",
    "coda_gate",
    "dnas_weights",
    "key_log_normalizer",
    "check_hybrid_weight",
    "hnas_weights",
    "sigmoid_weight",
    "whole_theta",
    "sinkhorn_column_potential",
    "sinkhorn_weights",
    "softmax_weights",
]
