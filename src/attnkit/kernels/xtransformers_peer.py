"""x-transformers' doubly-normalized attention: a peer of ``attnkit bench`` (the ``[bench]`` extra).

x-transformers (``pip install x-transformers``) has one option that computes DNAS ("Attention that does
not Explain Away", arXiv:2009.14308, section 3.1): ``x_transformers.attend.Attend(inverted_attention=True)``
takes the softmax over the queries (``dim=-2``) of the materialized scores, then divides each row by its
sum (``F.normalize(p=1)``), after "Inverted-Attention Transformers can Learn Object Representations:
Insights from Slot Attention" (Wu et al., UniReps 2023). Its layers offer it for cross-attention only
(``cross_attn_inverted_attention=True``; self-attention layers drop the option), so the peer calls
``Attend`` directly. Its softmax runs in float32. It has no option for HNAS or Sinkhorn-k. No masks here:
the benchmark's inputs are unpadded.
"""

from __future__ import annotations

import importlib.util
from typing import Callable

__all__ = ["xtransformers_available", "xtransformers_call", "XTRANSFORMERS_MECHANISMS"]

XTRANSFORMERS_MECHANISMS = ("dnas",)


def xtransformers_available() -> bool:
    """True when x-transformers is installed (``pip install 'attnkit[bench]'``)."""
    return importlib.util.find_spec("x_transformers") is not None


def xtransformers_call(mechanism: str) -> Callable:
    """``f(q, k, v) -> out`` for ``attnkit bench``: x-transformers' ``Attend`` with its DNAS option."""
    if mechanism not in XTRANSFORMERS_MECHANISMS:
        raise ValueError(
            f"x-transformers has no option for mechanism {mechanism!r}; it has one for "
            f"{XTRANSFORMERS_MECHANISMS} (inverted_attention=True)"
        )
    if not xtransformers_available():
        raise ValueError("x-transformers is not installed; pip install 'attnkit[bench]' (or x-transformers)")
    from x_transformers.attend import Attend

    attend = Attend(inverted_attention=True)
    return lambda q, k, v: attend(q, k, v)[0]  # (B, H, Lq, Dv); [1] holds its intermediates
