r"""Positional encodings added to token embeddings.

Vaswani et al. (2017), section 3.5, ("Attention Is All You Need", arXiv:1706.03762)
("positional encodings"): the fixed sinusoids

.. math::
    PE_{(pos, 2i)} = \sin(pos / 10000^{2i/d}), \qquad PE_{(pos, 2i+1)} = \cos(pos / 10000^{2i/d})

or a learned table ``P in R^{max_len x d}``. Both return ``dropout(x + PE[start : start + L])``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from .module_utils import readable

__all__ = ["SinusoidalPositionalEncoding", "LearnedPositionalEncoding", "POSITIONAL"]

POSITIONAL: tuple[str, ...] = ("sinusoidal", "learned")


def _check_args(d_model: int, max_len: int, dropout: float) -> None:
    for name, value in (("d_model", d_model), ("max_len", max_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r}; expected a positive integer")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout={dropout!r}; expected a probability in [0, 1)")


def _sinusoids(positions: Tensor, d_model: int) -> Tensor:
    """``PE`` ``(*positions.shape, d_model)`` in float64 at integer ``positions`` (the equation above)."""
    device = positions.device
    position = positions.to(torch.float64)[..., None]  # (..., 1)
    div = torch.exp(
        torch.arange(0, d_model, 2, dtype=torch.float64, device=device) * (-math.log(10000.0) / d_model)
    )  # (ceil(d/2),)
    angle = position * div  # (..., ceil(d/2))
    # sin and cos interleaved (columns 0::2 and 1::2), built without writes into a new tensor, which
    # torch.func.vmap cannot batch; an odd d_model drops the last cos
    pe = torch.stack([torch.sin(angle), torch.cos(angle)], dim=-1)  # (..., ceil(d/2), 2)
    return pe.flatten(-2)[..., :d_model]  # (..., d_model)


class _PositionalEncoding(nn.Module):
    """Shared forward: validate ``x``, add ``table[start : start + L]`` along the sequence dimension."""

    def __init__(self, d_model: int, max_len: int, dropout: float, batch_first: bool) -> None:
        super().__init__()
        _check_args(d_model, max_len, dropout)
        self.d_model = d_model
        self.max_len = max_len
        self.batch_first = batch_first
        self.dropout = nn.Dropout(dropout)

    def table(self) -> Tensor:  # pragma: no cover - overridden
        """The ``(max_len, d_model)`` table."""
        raise NotImplementedError

    def rows(self, positions: Tensor, dtype: torch.dtype) -> Tensor:
        """The table's rows at integer ``positions`` (any shape), in ``dtype``."""
        return self.table()[positions].to(dtype)

    def forward(self, x: Tensor, start: int = 0, positions: Tensor | None = None) -> Tensor:
        """``x`` ``(B, L, d_model)`` (``(L, B, d_model)`` if not ``batch_first``, or unbatched ``(L,
        d_model)``);
        positions ``start .. start + L - 1`` (``start`` > 0 for incremental decoding), or ``positions``
        ``(B, L)`` given per token for batch-first ``x`` (e.g.
        ``(attention_mask.cumsum(1) - 1).clamp(min=0)``, so that left or inner padding does not move the real
        tokens' positions)."""
        if isinstance(x, Tensor) and x.is_nested:
            return self._nested(x, start, positions)
        if not isinstance(x, Tensor) or x.dim() not in (2, 3) or x.shape[-1] != self.d_model:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x has shape {got}, expected (B, L, {self.d_model}) or (L, {self.d_model})")
        if not x.is_floating_point():  # token ids passed by mistake: .to(x.dtype) truncated the encodings
            raise ValueError(
                f"x has dtype {x.dtype}; expected the floating embeddings (B, L, {self.d_model}) that the "
                "positions are added to (embed token ids first)"
            )
        if positions is not None:
            if start != 0:
                raise ValueError(f"start={start!r} and positions given; pass one of them")
            return self.dropout(x + self._gather(x, positions))
        seq_dim = 1 if (x.dim() == 3 and self.batch_first) else 0
        L = x.shape[seq_dim]
        self._check_span(start, L)
        pe = self.rows(torch.arange(start, start + L, device=x.device), x.dtype)  # (L, d_model)
        if x.dim() == 3:
            pe = pe.unsqueeze(0) if self.batch_first else pe.unsqueeze(1)  # (1, L, d) or (L, 1, d)
        return self.dropout(x + pe)

    def _check_span(self, start, L: int) -> None:
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"start={start!r}; expected an integer >= 0")
        if start + L > self.max_len:
            raise ValueError(
                f"positions up to {start + L - 1} requested but max_len={self.max_len}; "
                f"build the module with max_len >= {start + L}"
            )

    def _nested(self, x: Tensor, start: int, positions: Optional[Tensor]) -> Tensor:
        """A nested batch (sequences ``(L_b, d_model)``, as ``torch.nested`` builds them): each sequence takes
        positions ``start .. start + L_b - 1``."""
        if not self.batch_first:
            raise ValueError("x is a nested tensor, which is batch-first; build the module with "
                             "batch_first=True")
        if positions is not None:
            raise ValueError("positions are for a padded batch (B, L, d_model); a nested x numbers each "
                             "sequence from start: leave positions out")
        if x.dim() != 3 or not x.is_floating_point() or x.size(-1) != self.d_model:
            raise ValueError(f"x is a nested tensor of {x.dim()} dimensions and dtype {x.dtype}; expected "
                             f"floating sequences (L_b, {self.d_model})")
        if x.layout == torch.jagged and x.lengths() is None:  # keep x's offsets: x + pe(x) must still add
            values, offsets = x.values(), x.offsets()  # (N, d_model), (B + 1,)
            lengths = offsets.diff()  # (B,)
            self._check_span(start, int(lengths.max()) if lengths.numel() else 0)
            first = offsets[:-1].repeat_interleave(lengths)  # (N,): each token's sequence start
            position = torch.arange(values.shape[0], device=values.device) - first
            out = values + self.rows(start + position, x.dtype)  # (N, d_model)
            return self.dropout(torch.nested.nested_tensor_from_jagged(out, offsets=offsets))
        parts = x.unbind()
        self._check_span(start, max((p.shape[0] for p in parts), default=0))
        out = [p + self.rows(torch.arange(start, start + p.shape[0], device=p.device), x.dtype)
               for p in parts]  # (L_b, d_model) each
        return self.dropout(torch.nested.as_nested_tensor(out, layout=x.layout))

    def _gather(self, x: Tensor, positions: Tensor) -> Tensor:
        """The table's rows ``(B, L, d_model)`` at ``positions`` ``(B, L)``."""
        if x.dim() == 2:
            raise ValueError(f"positions are per token of a batch (B, L, d_model) but x is unbatched "
                             f"{tuple(x.shape)}: add the batch dimension (x[None], positions[None]), or "
                             "leave positions out")
        if not self.batch_first:
            raise ValueError("positions (B, L) are for batch-first x (B, L, d_model); build the module with "
                             "batch_first=True, or leave positions out")
        integer = isinstance(positions, Tensor) and not positions.is_floating_point() \
            and not positions.is_complex() and positions.dtype != torch.bool
        if not integer or positions.shape != x.shape[:2]:
            got = positions
            if isinstance(positions, Tensor):
                got = f"{tuple(positions.shape)} {positions.dtype}"
            raise ValueError(f"positions {got}; expected integer positions of shape {tuple(x.shape[:2])} "
                             "(e.g. (attention_mask.long().cumsum(1) - 1).clamp(min=0))")
        plain = readable(positions)  # inside torch.func.vmap: every example's positions
        if plain.numel() and (plain.min() < 0 or plain.max() >= self.max_len):
            low, high = plain.min().item(), plain.max().item()
            fix = ("positions are >= 0: clamp them, e.g. (attention_mask.cumsum(1) - 1).clamp(min=0) for "
                   "left padding" if low < 0 else "build the module with a larger max_len")
            raise ValueError(f"positions span {low}..{high}, outside [0, max_len={self.max_len}); {fix}")
        # any integer dtype: indexing takes int64 (int8/int16 raised, uint8 was read as a boolean mask)
        return self.rows(positions.long(), x.dtype)  # (B, L, d_model)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, max_len={self.max_len}"


class SinusoidalPositionalEncoding(_PositionalEncoding):
    """Fixed sine/cosine positions (no parameters; the table is a non-persistent buffer).

    The table ``pe`` ``(max_len, d_model)`` is a function of ``max_len`` and ``d_model`` alone, so it is not
    saved: it is rebuilt by :meth:`reset_parameters` and whenever the module's tensors are replaced off the
    meta device (``to_empty``, ``.to(device)``, ``.half()``), so that a module built under
    ``torch.device("meta")`` and materialized with ``to_empty`` has the table a normal construction has.
    A table still on the meta device (``load_state_dict(..., assign=True)`` has none to assign) gives inputs
    on another device the rows the table would hold, computed at their positions."""

    def __init__(
        self, d_model: int, max_len: int = 1024, dropout: float = 0.0, batch_first: bool = True, device=None
    ) -> None:
        super().__init__(d_model, max_len, dropout, batch_first)
        # float32, as the module's other floating tensors (a float64 buffer could not move to MPS); float64
        # inputs get a table computed in float64 (the float32 one rounded them by 3e-8)
        self.register_buffer("pe", torch.empty(max_len, d_model, device=device, dtype=torch.float32),
                             persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Recompute the table ``pe`` in place, in its dtype and on its device (nothing to compute on the
        meta device)."""
        if self.pe.is_meta:
            return
        # MPS has no float64: the table is computed on the CPU there
        device = self.pe.device if self.pe.device.type != "mps" else torch.device("cpu")
        table = _sinusoids(torch.arange(self.max_len, device=device), self.d_model)  # (max_len, d_model)
        with torch.no_grad():
            self.pe.copy_(table)

    def _apply(self, fn, recurse: bool = True):
        before = self.pe
        if before.is_meta:
            try:
                fn(before[:0])  # (0, d_model)
            except NotImplementedError:  # .to(device), which cannot copy a table never materialized out of
                # meta (after load_state_dict(assign=True), which has no table to assign): move an empty one
                self.pe = torch.empty_like(before, device="cpu")
        module = super()._apply(fn, recurse)
        if self.pe is not before:  # a new tensor (moved, cast, or the uninitialised memory of to_empty)
            self.reset_parameters()
        return module

    def table(self) -> Tensor:
        return self.pe

    def rows(self, positions: Tensor, dtype: torch.dtype) -> Tensor:
        if dtype == torch.float64:  # computed at the positions asked for: O(rows), nothing kept
            return _sinusoids(positions, self.d_model)
        if self.pe.is_meta and not positions.is_meta:  # the table was never materialized (assign=True)
            return _sinusoids(positions, self.d_model).to(self.pe.dtype).to(dtype)
        return self.pe[positions].to(dtype)


class LearnedPositionalEncoding(_PositionalEncoding):
    """A learned ``(max_len, d_model)`` table, initialised ``N(0, 0.02^2)`` (BERT/GPT-2 style)."""

    def __init__(
        self,
        d_model: int,
        max_len: int = 1024,
        dropout: float = 0.0,
        batch_first: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(d_model, max_len, dropout, batch_first)
        self.weight = nn.Parameter(torch.empty(max_len, d_model, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)

    def table(self) -> Tensor:
        return self.weight
