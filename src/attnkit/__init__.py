"""attnkit: softmax, doubly-normalized, hybrid, Sinkhorn and CoDA attention for PyTorch.

    import attnkit as ak
    out = ak.attention(q, k, v, mechanism="dnas", key_mask=mask)
"""

import importlib as _importlib

from . import scores
from .config import DNAS, CoDA, Hybrid, Sinkhorn, Softmax
from .functional import BACKENDS, attention, explain_dispatch, normalize
from .registry import MECHANISMS, resolve_mechanism

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "MECHANISMS",
    "BACKENDS",
    "Softmax",
    "DNAS",
    "Hybrid",
    "Sinkhorn",
    "CoDA",
    "resolve_mechanism",
    "attention",
    "normalize",
    "explain_dispatch",
    "scores",
    "nn",
    "explain_away",
]


def __getattr__(name):  # lazy: ``ak.nn`` and ``ak.explain_away`` import torch.nn modules on first use
    if name == "nn":
        return _importlib.import_module(f"{__name__}.nn")
    if name == "explain_away":
        return _importlib.import_module(f"{__name__}.analysis").explain_away
    raise AttributeError(f"module 'attnkit' has no attribute {name!r}")
