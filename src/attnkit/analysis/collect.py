"""Collect explaining-away statistics from every attention call of a forward pass.

"Attention that does not Explain Away" (arXiv:2009.14308), section 4 (Fig. 1); "Doubly-Normalized Attention",
section 5.1 (Fig. 1, ``min_j sum_i pi_ij`` against the ``1/L`` bound of Lemma 1). Built on
``attnkit.functional.observe_weights``, so it sees every ``ak.attention`` call: attnkit modules,
models written on the functional API and Hugging Face models converted by attnkit.

    with collect_explain_away(model) as log:
        model(x)
    log[0].layer, log[0].stats.min          # one record per attention call, in call order
    log[-1], log[2:4], list(log)            # indexing, slices and iteration work like a list
    for row in log.summary():               # one row per layer, reduced over forward passes
        print(row)

How to read ``log.summary()``: one dict per layer with ``layer`` (order of the attention call within a
forward pass), ``mechanism``, ``calls`` (forward passes seen), ``min_sum`` (the smallest total weight
``sum_i pi_ij`` any valid key received; a key is "explained away" when this is near 0), ``min_normalized``
(the same times the number of valid keys ``n_k``: Lemma 1 guarantees >= 1 for DNAS, i.e. every key gets at
least its fair share ``1/n_k`` of the column mass; softmax can go far below 1), and ``fraction_below_eps``
(the mean share of valid keys whose sum is below ``eps``). CoDA's weights are not normalized, so its sums are
not shares of a unit mass.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
from torch import Tensor

from ..config import MechanismConfig
from ..functional import observe_weights
from ..masks import MaskInfo
from .explain_away import ExplainAway, explain_away

__all__ = ["ExplainAwayRecord", "ExplainAwayLog", "collect_explain_away"]


@dataclass(frozen=True)
class ExplainAwayRecord:
    """The statistics of one attention call.

    ``call``: order among all calls in the block; ``forward_pass``: index of the model forward pass
    (0 when no model was given); ``layer``: order of the call within its forward pass (the layer index
    for a stack of attention layers); ``mechanism``: the mechanism's name; ``stats``: :class:`ExplainAway`.
    """

    call: int
    forward_pass: int
    layer: int
    mechanism: str
    stats: ExplainAway


@dataclass
class ExplainAwayLog:
    """The records collected by :func:`collect_explain_away`, in call order."""

    eps: float
    records: list[ExplainAwayRecord] = field(default_factory=list)
    _pass: int = 0
    _layer: int = 0

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index):
        """``log[i]``: the ``i``-th record (negative indices count from the end); ``log[a:b]``: a list of
        them."""
        return self.records[index]

    def __iter__(self) -> Iterator[ExplainAwayRecord]:
        return iter(self.records)

    def layers(self) -> list[int]:
        """The layer indices seen, sorted."""
        return sorted({r.layer for r in self.records})

    def by_layer(self, layer: int) -> list[ExplainAway]:
        """Statistics of every call recorded at ``layer`` (one per forward pass)."""
        if layer not in self.layers():
            raise ValueError(
                f"no attention call was recorded at layer {layer}; recorded layers: "
                f"{self.layers()}"
            )
        return [r.stats for r in self.records if r.layer == layer]

    def min(self) -> float:
        """Smallest key weight sum over every recorded call (NaN when no call had a valid key)."""
        if not self.records:
            raise ValueError("no attention call was recorded; run the model inside the `with` block")
        return _nanmin(r.stats.min for r in self.records)

    def min_normalized(self) -> float:
        """Smallest ``n_k * sum_i pi_ij`` over every recorded call (Lemma 1: >= 1 for DNAS)."""
        if not self.records:
            raise ValueError("no attention call was recorded; run the model inside the `with` block")
        return _nanmin(r.stats.min_normalized for r in self.records)

    def summary(self) -> list[dict]:
        """One row per layer, reduced over the forward passes recorded.

        Keys: ``layer``; ``mechanism``; ``calls`` (how many calls were recorded at this layer);
        ``min_sum``: the smallest column sum ``sum_i pi_ij`` over valid keys and calls (near 0: some key is
        explained away); ``min_normalized``: the smallest ``n_k * sum_i pi_ij`` (Lemma 1: >= 1 for DNAS;
        1 means the key gets exactly the uniform share ``1/n_k``); ``fraction_below_eps``: the mean share of
        valid keys whose sum is below ``eps``. Calls without a valid key (an empty batch, all padding) count
        in ``calls`` only; a layer that never had one reports NaN minima (as :class:`ExplainAway` does).
        """
        rows = []
        for layer in self.layers():
            recs = [r for r in self.records if r.layer == layer]
            seen = [r.stats for r in recs if r.stats.valid_keys.any()]
            rows.append(
                {
                    "layer": layer,
                    "mechanism": recs[0].mechanism,
                    "calls": len(recs),
                    "min_sum": _nanmin(s.min for s in seen),
                    "min_normalized": _nanmin(s.min_normalized for s in seen),
                    "fraction_below_eps": (
                        sum(s.fraction_below_eps for s in seen) / len(seen) if seen else 0.0
                    ),
                }
            )
        return rows

    def _observe(self, weights: Tensor, mask: MaskInfo, config: MechanismConfig) -> None:
        stats = explain_away(
            weights,
            key_mask=mask.key_mask,
            query_mask=mask.query_mask,
            eps=self.eps,
            valid=mask.valid,
        )
        record = ExplainAwayRecord(
            call=len(self.records),
            forward_pass=self._pass,
            layer=self._layer,
            mechanism=config.name,
            stats=stats,
        )
        self.records.append(record)
        self._layer += 1

    def _start_pass(self) -> None:
        if self._layer > 0:
            self._pass += 1
        self._layer = 0


def _nanmin(values) -> float:
    """The smallest of ``values`` leaving NaN out (``min()`` would depend on the order); NaN if all are."""
    finite = [v for v in values if not math.isnan(v)]
    return min(finite) if finite else float("nan")


@contextlib.contextmanager
def collect_explain_away(
    model: Optional[torch.nn.Module] = None, eps: float = 1e-3
) -> Iterator[ExplainAwayLog]:
    """Record :func:`~attnkit.analysis.explain_away` statistics of every ``ak.attention`` call in the block.

    With ``model``, each call of ``model`` starts a new forward pass and ``layer`` counts the attention
    calls within it; without, every call in the block belongs to pass 0 and ``layer`` is the call order.
    Keys and queries are told apart from padding with the call's ``MaskInfo`` (key/query masks and the
    combined validity of all masks). Calls inside the block use the reference backend.
    """
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not (0 < eps < math.inf):
        raise ValueError(f"eps={eps!r}; expected a finite number > 0")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module (or None), got {type(model).__name__}")
    log = ExplainAwayLog(eps=float(eps))
    handle = None
    if model is not None:
        handle = model.register_forward_pre_hook(lambda module, args: log._start_pass())
    try:
        with observe_weights(log._observe):
            yield log
    finally:
        if handle is not None:
            handle.remove()
