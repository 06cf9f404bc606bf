"""Validation of attention inputs and the combination of masks into one validity pattern.

Convention (docs/design.md section 4): boolean masks with **True = real / may attend**.

- ``key_mask``   ``(B, Lk)``   False marks padded keys.
- ``query_mask`` ``(B, Lq)``   False marks padded queries (they get a zero output and never enter
  column normalizations).
- ``attn_mask``  broadcastable to ``(B, H, Lq, Lk)``; boolean (True = may attend) or floating
  (an additive score bias, ``-inf`` = may not attend), as in ``F.scaled_dot_product_attention``.
  A float entry at or below ``MASKED_BIAS`` (-1e4: BERT's ``-10000.0``, Hugging Face's ``finfo.min``,
  the common ``-1e9``) counts as ``-inf``: softmax gives such a pair an exact 0 weight in every dtype
  anyway when the query has an allowed key, and the column-normalizing mechanisms (dnas, hnas, sinkhorn)
  would otherwise cancel a constant per-key bias and give padded keys weight. A query whose every key is
  so masked therefore has no allowed key and gets a zero output, where PyTorch's softmax of equal finite
  scores spreads its weight uniformly (and gives NaN for ``-inf``). Those mechanisms cancel any bias that is
  the same for every query of a key column (a ``(B, 1, 1, Lk)`` bias is one): a small one (``|b| < 100``) is
  a no-op there, which is the math; a key that a fill ``PATTERN_BIAS`` (100) or more below its rows' largest
  entries but above ``MASKED_BIAS`` hides (-1000, -5000: padding meant as a mask, with or without ALiBi on
  top) is refused for them (``constant_key_bias``). A graded bias alone (ALiBi) is kept.
- ``causal``     query ``i`` sees keys ``j <= i`` (top-left aligned, as SDPA's ``is_causal``).

A pair ``(i, j)`` is valid when every mask allows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from .registry import causal_problem, resolve_mechanism
from .validators import unbatched_values, values_hidden

__all__ = [
    "MASKED_BIAS", "MaskInfo", "check_dense", "check_qkv", "build_mask", "causal_leak_error",
    "causal_pattern", "constant_key_bias",
]

MASKED_BIAS = -1e4
"""A float mask entry ``<= MASKED_BIAS`` means "may not attend", as ``-inf`` does."""

PATTERN_BIAS = -100.0
"""For the causal-pattern check, a float mask entry ``PATTERN_BIAS`` or more below its row's largest also
hides its pair (``exp(-100)`` is 4e-44: a causal mask of -1000 leaks future tokens through a
query-normalized mechanism as -inf would)."""



@dataclass
class MaskInfo:
    """The masks of one attention call, built once by ``build_mask`` at the public boundary.

    Every backend reads this one object: the reference path the combined ``valid`` pattern, the
    efficient kernels the factored form, block by block (``block_valid`` / ``bias_block`` / ``select``),
    so that the only ``O(Lq * Lk)`` memory is what the user passed. Factored fields, each broadcastable
    to ``(B, H, Lq, Lk)``:

    ``key``: ``(B, 1, 1, Lk)`` bool; ``query``: ``(B, 1, Lq, 1)`` bool; ``pair``: ``(B|1, H|1, Lq|1, Lk|1)``
    bool from ``attn_mask`` (a boolean mask, or the entries of a float mask above ``MASKED_BIAS``);
    ``bias``: the additive float bias of a float ``attn_mask`` (0 where invalid); ``causal``: flag.
    ``key_mask`` / ``query_mask`` / ``attn_mask``: the validated user masks as given.
    """

    key_mask: Optional[Tensor]
    query_mask: Optional[Tensor]
    attn_mask: Optional[Tensor]
    causal: bool
    key: Optional[Tensor]
    query: Optional[Tensor]
    pair: Optional[Tensor]
    bias: Optional[Tensor]
    Lq: int
    Lk: int
    device: Optional[torch.device] = None
    _valid: Optional[Tensor] = field(default=None, repr=False)
    _valid_built: bool = field(default=False, repr=False)

    @property
    def valid(self) -> Optional[Tensor]:
        """The combined validity ``(B|1, H|1, Lq, Lk)`` (True = the pair may attend), ``None`` when all pairs
        are
        valid. Built on first use: only the reference path and the diagnostics need it."""
        if not self._valid_built:
            self._valid = self.block_valid(0, self.Lq, 0, self.Lk)
            self._valid_built = True
        return self._valid

    @property
    def padding_only(self) -> bool:
        """Only key/query padding (no ``attn_mask``, not causal): the form the C++ and ATen kernels take."""
        return self.attn_mask is None and not self.causal

    @property
    def any(self) -> bool:
        """True when some pair may be invalid."""
        return self.key is not None or self.query is not None or self.pair is not None or self.causal

    def block_valid(self, i0: int, i1: int, j0: int, j1: int) -> Optional[Tensor]:
        """Validity of the block ``[i0, i1) x [j0, j1)``, broadcastable to ``(B, H, i1 - i0, j1 - j0)``."""
        out: Optional[Tensor] = None

        def _and(m: Tensor) -> None:
            nonlocal out
            out = m if out is None else out & m

        if self.key is not None:
            _and(self.key[..., j0:j1])  # (B, 1, 1, cols)
        if self.query is not None:
            _and(self.query[..., i0:i1, :])  # (B, 1, rows, 1)
        if self.causal:
            rows = torch.arange(i0, i1, device=self.device)[:, None]  # (rows, 1)
            cols = torch.arange(j0, j1, device=self.device)[None, :]  # (1, cols)
            _and((cols <= rows)[None, None])  # (1, 1, rows, cols)
        if self.pair is not None:
            _and(_block(self.pair, i0, i1, j0, j1))
        return out

    def bias_block(self, i0: int, i1: int, j0: int, j1: int) -> Optional[Tensor]:
        """The additive bias of the block ``[i0, i1) x [j0, j1)``, or ``None``."""
        return None if self.bias is None else _block(self.bias, i0, i1, j0, j1)

    def select(self, b0: int, b1: int, h0: int, h1: int) -> "MaskInfo":
        """The masks of batch elements ``[b0, b1)`` and heads ``[h0, h1)``."""

        def _sub(t: Optional[Tensor]) -> Optional[Tensor]:
            if t is None:
                return None
            if t.shape[0] != 1:
                t = t[b0:b1]
            if t.shape[1] != 1:
                t = t[:, h0:h1]
            return t

        return MaskInfo(
            key_mask=None if self.key_mask is None else self.key_mask[b0:b1],
            query_mask=None if self.query_mask is None else self.query_mask[b0:b1],
            attn_mask=self.attn_mask,  # as given (its sliced form is ``pair`` / ``bias``)
            causal=self.causal,
            key=_sub(self.key), query=_sub(self.query), pair=_sub(self.pair), bias=_sub(self.bias),
            Lq=self.Lq, Lk=self.Lk, device=self.device,
        )


def _block(t: Tensor, i0: int, i1: int, j0: int, j1: int) -> Tensor:
    """Rows ``[i0, i1)`` and columns ``[j0, j1)`` of a tensor broadcastable to ``(B, H, Lq, Lk)``."""
    if t.shape[-2] != 1:
        t = t[..., i0:i1, :]
    if t.shape[-1] != 1:
        t = t[..., j0:j1]
    return t


def check_dense(t: Tensor, name: str) -> None:
    """Nested (ragged) and sparse tensors have no (B, H, L, D) layout for the kernels: a ``ValueError`` with
    the conversion to use."""
    if t.is_nested:
        raise ValueError(
            f"{name} is a nested tensor; pad it (torch.nested.to_padded_tensor({name}, 0.0)) and mark the "
            "padding with a mask (key_mask / query_mask, or key_padding_mask for the modules)"
        )
    if t.layout != torch.strided:
        raise ValueError(f"{name} has layout {t.layout}; pass a dense tensor ({name}.to_dense())")


def check_qkv(q: Tensor, k: Tensor, v: Tensor, *, same_head_dim: bool = True) -> None:
    """Raise a ``ValueError`` unless ``q (B,H,Lq,D)``, ``k (B,H,Lk,D)``, ``v (B,H,Lk,Dv)`` agree."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        check_dense(t, name)
        if t.dim() != 4:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} ({t.dim()}-D); expected 4-D (B, H, L, D). "
                "Add a head dimension with .unsqueeze(1) or reshape (B, L, H*D) to (B, H, L, D)."
            )
        if not t.dtype.is_floating_point:
            raise ValueError(
                f"{name} has dtype {t.dtype}; expected a floating dtype (float32, float64, "
                "bfloat16, float16)"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them "
            "with .to(dtype)"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}; move them "
            "with .to(device)"
        )
    (Bq, Hq, _, Dq), (Bk, Hk, Lk, Dk), (Bv, Hv, Lv, _) = q.shape, k.shape, v.shape
    if not (Bq == Bk == Bv):
        hint = ""
        if Bk == Bv == 1:  # one key/value set shared by every query sequence
            hint = f"; to share them over q's batch, pass k.expand({Bq}, -1, -1, -1) and the same for v"
        elif Bk == Bv:
            hint = "; pass one key/value sequence per query sequence (or k and v with B=1, expanded)"
        raise ValueError(f"batch sizes differ: q has B={Bq}, k has B={Bk}, v has B={Bv}{hint}")
    if not (Hq == Hk == Hv):
        hint = ""
        if Hk == Hv and Hk > 0 and Hq % Hk == 0:  # grouped-query attention: Hq / Hk queries per k/v head
            hint = (
                f"; for grouped-query attention repeat each key/value head over its {Hq // Hk} query heads: "
                f"k.repeat_interleave({Hq // Hk}, dim=1), and the same for v"
            )
        raise ValueError(f"head counts differ: q has H={Hq}, k has H={Hk}, v has H={Hv}{hint}")
    if same_head_dim and Dq != Dk:
        raise ValueError(f"q and k head dims differ: q has D={Dq}, k has D={Dk}; scores need equal D")
    if Lk != Lv:
        raise ValueError(f"k and v lengths differ: k has Lk={Lk}, v has {Lv}; each key needs one value")
    if Hq == 0:
        raise ValueError(f"q, k, v have H=0 heads (q has shape {tuple(q.shape)}); expected H >= 1")
    if Dq == 0 or Dk == 0:
        raise ValueError(
            f"q and k have head dim D=0 (q has shape {tuple(q.shape)}); scores q . k need D >= 1"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[2] == 0:
            raise ValueError(f"{name} has an empty sequence (shape {tuple(t.shape)}); expected L >= 1")


def _check_1d_mask(name: str, mask: Tensor, B: int, L: int, length_name: str, device: torch.device) -> Tensor:
    if not isinstance(mask, Tensor):
        raise ValueError(
            f"{name} must be a boolean torch.Tensor of shape (B, {length_name}), got "
            f"{type(mask).__name__}"
        )
    if mask.dtype != torch.bool:
        raise ValueError(
            f"{name} has dtype {mask.dtype}; expected torch.bool with True = real token "
            f"(convert with {name}.bool() if 1 marks real tokens)"
        )
    if tuple(mask.shape) != (B, L):
        raise ValueError(f"{name} has shape {tuple(mask.shape)}, expected (B, {length_name}) = ({B}, {L})")
    if mask.device != device:
        raise ValueError(
            f"{name} is on {mask.device} but the inputs are on {device}; move it with "
            ".to(device)"
        )
    return mask


def causal_leak_error(mechanism: str) -> ValueError:
    """The error for a query-normalized ``mechanism`` under a causal mask
    (``attnkit.registry.causal_problem``)."""
    return ValueError(causal_problem(resolve_mechanism(mechanism)))


def causal_pattern(mask: MaskInfo) -> bool:
    """Whether ``attn_mask`` is an autoregressive pattern through which a query-normalized mechanism leaks:
    in some example and head, no query sees a key after it, and some query that sees two keys or more
    shares a key with a later query (whose content then enters that key's column normalization).

    A float mask's entries ``PATTERN_BIAS`` (100) or more below their row's largest count as hidden (a causal
    fill of -1000 or -5000). The causal mask, strictly causal ones (``tril(-1)``), causal masks combined with
    padding and sliding windows are; so is each of them aligned bottom-right (``Lq < Lk``, the last ``Lq``
    positions as queries). Masks through which nothing can leak are not: every query sees one key (the
    diagonal, or only key 0), or every query that sees any key sees the same keys (padding of keys and
    queries, e.g. cross-attention to padded keys). A prefix-LM pattern (a bidirectional prefix, a causal
    suffix) is one too. Under such a pattern a query-normalized mechanism leaks future tokens as it would
    with ``causal=True``.

    Each example is judged on its real block (``_causal_leaks``), with ``key_mask`` / ``query_mask`` hiding
    their padding as if merged into ``attn_mask``: the verdict does not depend on how the padding is spelled
    (Hugging Face merges it into a 4-D mask), and a short example does not look causal for being truncated.
    """
    Lq, Lk = mask.Lq, mask.Lk
    if Lq == 0 or Lk == 0:  # no pair: nothing can leak (and an amax over no keys raised an IndexError)
        return False
    hard = _full_pattern(mask.pair, Lq, Lk)
    soft = hard
    bias = mask.bias
    if bias is not None and not values_hidden(bias) and tuple(bias.shape[-2:]) == (Lq, Lk):
        # a float mask hides pairs too: an entry PATTERN_BIAS or more below its row's largest allowed one
        # weighs under exp(-100) = 4e-44 next to it (a causal fill of -1000, with or without a graded bias)
        allowed = bias if mask.pair is None else bias.masked_fill(~mask.pair, float("-inf"))
        top = allowed.amax(-1, keepdim=True)  # (..., Lq, 1)
        seen = (allowed > top + PATTERN_BIAS) & torch.isfinite(top)
        soft = seen if hard is None else hard & seen
    if soft is None or Lq < 2:
        return False
    bottom_right = max(Lk - Lq, 0)
    # one (Lq, Lk) pattern at a time: an expanded mask is never copied whole, and a bidirectional example
    # (the common case) costs one pass for the keys after their queries. Bottom-right (Lq < Lk) reads the
    # float mask's near-zero weights as hidden only where some query sees the key at its own position (a
    # causal fill of -1000 does): a distance bias (ALiBi) aligned top-left gives the keys far after a query
    # such weights without meaning "may not attend", and hides the key at its bottom-right position too
    checks = [(0, soft, False)]
    if bottom_right:
        checks += [(bottom_right, hard, False), *(((bottom_right, soft, True),) if soft is not hard else ())]
    key, query = _padding(mask, soft)
    # the examples (and heads) worth a look: those with padding, whose first row says nothing, and those
    # whose first row sees no key after it
    maybe = _padded_examples(hard, key, query)  # (B|1, H|1)
    for offset, patterns, _ in checks:
        if patterns is not None:
            maybe = maybe | _maybe_causal(patterns, offset)
    maybe = maybe | _maybe_ordered(soft)
    shape = _batch_shape(soft, key, query)
    for index in maybe.expand(shape).nonzero().tolist():
        for offset, patterns, own_key in checks:
            if patterns is None:
                continue
            p = patterns[_at(index, patterns)]  # (Lq, Lk)
            real = None if hard is None else hard[_at(index, hard)]  # (Lq, Lk): what the padding leaves
            for m in (key, query):  # padding hidden, as if merged into attn_mask
                if m is not None:
                    p = _and(p, m[_at(index, m)])
                    real = m[_at(index, m)].expand(Lq, Lk) if real is None else _and(real, m[_at(index, m)])
            if _causal_leaks(p, real, offset, own_key) or _ordered_leaks(p, offset):
                return True
            if offset == 0 and Lq == Lk and _prefix_lm_leaks(p) and bool(_any(p.triu(1))):
                return True
    return False


def _padding(mask: MaskInfo, patterns: Tensor) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """The call's key padding ``(B, 1, 1, Lk)`` and query padding ``(B, 1, Lq, 1)`` (True = real), each
    ``None`` when absent, or when ``vmap`` hides its values or the patterns' layout (they are then judged
    without it)."""
    if patterns.dim() != 4:  # read from under vmap: its mapped dimension is among the leading ones
        return None, None
    key = None if mask.key is None or values_hidden(mask.key) else mask.key
    query = None if mask.query is None or values_hidden(mask.query) else mask.query
    return key, query


def _padded_examples(hard: Optional[Tensor], key: Optional[Tensor], query: Optional[Tensor]) -> Tensor:
    """Which examples and heads ``(B|1, H|1)`` have padding (in the boolean pattern ``hard``, a key no query
    sees or a query that sees no key; a False entry of ``key`` / ``query``), for which the first row of
    ``_maybe_causal`` says nothing."""
    out = torch.zeros((), dtype=torch.bool)
    if hard is not None:
        out = ~_any(hard, -2).all(-1) | ~_any(hard, -1).all(-1)  # (B|1, H|1)
    for m in (key, query):
        if m is not None:
            out = out | ~m.flatten(2).all(-1)  # (B, 1)
    return out


def _batch_shape(*patterns: Optional[Tensor]) -> tuple[int, ...]:
    """The broadcast leading (example, head) dimensions of the patterns given."""
    return tuple(torch.broadcast_shapes(*(t.shape[:-2] for t in patterns if t is not None)))


def _at(index: tuple[int, ...], t: Tensor) -> tuple[int, ...]:
    """``index`` into the leading dimensions of ``t``, which may broadcast (size 1)."""
    return tuple(min(i, n - 1) for i, n in zip(index, t.shape[:-2]))


def _causal_leaks(p: Tensor, real: Optional[Tensor], offset: int, own_key: bool) -> bool:
    """Whether the pattern ``p`` (``(Lq, Lk)``) of one example is causal and leaks; ``real`` (``(Lq, Lk)``
    or ``None``) is its boolean pattern with the padding, which tells the padding apart (the near-zero
    weights of a float mask are no padding).

    It is judged on its real block only, so that the verdict does not depend on how padding is spelled
    (``key_mask`` / ``query_mask`` or merged into ``attn_mask``): keys that no query sees and queries that
    see no key are padding; so are, in a square pattern in which some query sees its own key, the queries
    at positions that no query sees (Hugging Face's 4-D masks let them see the real keys; the modules infer
    the same query padding in self-attention). The pattern is causal when no query sees a key after it,
    aligned at ``offset`` as given (and hiding some real key from some real query: padded keys after every
    query do not make a pattern causal), or aligned top-left / bottom-right on the real block alone (as the
    example would be judged truncated). ``own_key``: only where some query sees the key at its own
    position."""
    Lq, Lk = p.shape
    if real is None:
        rows = torch.ones(Lq, dtype=torch.bool, device=p.device)
        cols = torch.ones(Lk, dtype=torch.bool, device=p.device)
    else:
        rows, cols = _any(real, -1), _any(real, -2)  # (Lq,), (Lk,): the real queries and keys
        if Lq == Lk and bool(real.diagonal().any()):
            rows = rows & cols  # the rows at positions no query sees are padding
        p = _and(p, rows[:, None])
    n_rows, n_cols = int(rows.sum()), int(cols.sum())
    if n_rows < 2:
        return False
    # the first real query, which sees no key after it in a causal pattern: a bidirectional one stops here
    first = int(rows.to(torch.uint8).argmax())
    seen = p[first].nonzero()
    if not seen.numel():
        return False
    last = int(seen[-1])
    rank = int(cols[: last + 1].sum()) - 1  # its index among the real keys
    aligned = 0 if offset == 0 else max(n_cols - n_rows, 0)  # on the real block
    as_given = last <= first + offset and int(cols.nonzero()[-1]) > first + offset
    if not (as_given or rank <= aligned) or not _leaks(p):
        return False
    if (as_given and not bool(_any(p.triu(offset + 1)))
            and (not own_key or bool(p.diagonal(offset).any()))):
        return True
    if n_rows == Lq and n_cols == Lk:
        return False  # no padding: judged above
    block = p[rows][:, cols]  # (Lq', Lk'): the real block
    return not bool(_any(block.triu(aligned + 1))) and (not own_key or bool(block.diagonal(aligned).any()))


def _maybe_causal(patterns: Tensor, offset: int) -> Tensor:
    """Which ``(Lq, Lk)`` patterns of ``patterns`` ``(B|1, H|1)`` may be flagged aligned at ``offset``: its
    first query sees no key after it (else some query sees a key after it), or (square, top-left) no query
    before the last sees the last key (a prefix-LM's causal suffix). Reads one row and one column of each
    pattern: the bidirectional patterns (every example of the scores given to ``normalize``) skip the
    loop."""
    Lq, Lk = patterns.shape[-2:]
    free = ~patterns[..., 0, offset + 1:].any(-1)  # (B|1, H|1)
    if offset == 0 and Lq == Lk:
        free |= ~patterns[..., :-1, -1].any(-1)
    return free


def constant_key_bias(mask: MaskInfo) -> Optional[tuple[float, float, int]]:
    """``(smallest, largest, key)`` of the entries of a key that a float ``attn_mask`` hides with a finite
    fill from every query that counts: ``PATTERN_BIAS`` (100) or more below its row's largest allowed entry,
    and 100 or more below the key before or after it, or across a gap of 100 or more in the row's sorted
    values, while above ``MASKED_BIAS`` (it is not a mask). Padding
    of -1000 or -5000 at a key is one, the same for every query or with a graded bias (ALiBi) on top: a
    column (over queries) normalization cancels what is the same for every query of the key and normalizes
    what varies, so that the key keeps a share of the weight. A row counts unless its query is hidden
    itself: no allowed entry, or every entry 100 or more below the largest of its example and head (the
    padded queries' rows of an outer-product padding mask, all -1000). Keys that ``key_mask`` hides are left
    out. ``None`` when there is none (no float mask, a small bias, a graded one whose far keys fall in small
    steps such as ALiBi alone, a row where the key is near its largest, values hidden by ``vmap``). A few
    elementwise passes over the mask as given, and where they find nothing, a sort of one row per example and
    head (of every row, one example and head at a time, where that leaves a key that may be such)."""
    bias = mask.bias  # (B|1, H|1, Lq|1, Lk|1), 0 where masked
    if bias is None or bias.shape[-1] == 1 or values_hidden(bias) or not bias.numel():
        return None
    allowed = bias if mask.pair is None else bias.masked_fill(~mask.pair, float("-inf"))
    finite = torch.isfinite(allowed)  # False where masked
    top = allowed.amax(-1, keepdim=True)  # (B|1, H|1, Lq|1, 1): each row's largest allowed entry
    low = (allowed <= top + PATTERN_BIAS) & finite  # (B|1, H|1, Lq|1, Lk)
    if not bool(low.any()):  # the common case: no entry far below its row's largest
        return None
    counts = top > top.amax(-2, keepdim=True) + PATTERN_BIAS  # (B|1, H|1, Lq|1, 1): not a hidden query
    if not bool(_hidden_keys(low, finite, counts, mask.key).any()):
        return None
    # a fill sets a key 100 or more below a neighbouring key in every row (the keys at the edge of the
    # padding), also under a steep graded bias whose values span past the fill, where a graded bias alone
    # falls in small steps, or peaks at the key in some row
    bad = _hidden_keys(low & _below_a_neighbour(allowed), finite, counts, mask.key)
    if bool(bad.any()):
        return _first_key(bad, allowed, low & counts)
    # the same across a gap in the row's sorted values, where an allowed key lies between (or a masked one
    # separates the fill from the real keys): the first row that counts in each example and head clears
    # such keys, before every row is sorted
    first = counts.to(torch.uint8).argmax(-2, keepdim=True).expand(*allowed.shape[:-2], 1, allowed.shape[-1])
    row = allowed.gather(-2, first)  # (B|1, H|1, 1, Lk)
    cleared = torch.isfinite(row) & ~_below_a_gap(row)  # (B|1, H|1, 1, Lk)
    if not bool(_hidden_keys(low & ~cleared, finite, counts, mask.key).any()):
        return None
    low = low & _below_a_gap(allowed)
    bad = _hidden_keys(low, finite, counts, mask.key)  # (B|1, H|1, 1, Lk)
    if not bool(bad.any()):
        return None
    return _first_key(bad, allowed, low & counts)


def _first_key(bad: Tensor, allowed: Tensor, hidden: Tensor) -> tuple[float, float, int]:
    """``(smallest, largest, key)`` of the first key that ``bad`` ``(B|1, H|1, 1, Lk)`` flags: its entries of
    ``allowed`` in the rows where ``hidden`` ``(B|1, H|1, Lq|1, Lk)`` hides it."""
    at = bad.nonzero()[0].tolist()  # example, head, 0, key
    b, h = (min(i, n - 1) for i, n in zip(at[:2], allowed.shape[:2]))
    values = allowed[b, h, :, at[-1]][hidden[b, h, :, at[-1]]]
    return float(values.min()), float(values.max()), at[-1]


def _below_a_neighbour(allowed: Tensor) -> Tensor:
    """Which entries of ``allowed`` ``(B|1, H|1, Lq|1, Lk)`` lie 100 (``-PATTERN_BIAS``) or more below the
    allowed entry of the key before or after them in the row."""
    step = allowed[..., 1:] - allowed[..., :-1]  # (B|1, H|1, Lq|1, Lk - 1); NaN or -inf beside a masked key
    out = torch.zeros(allowed.shape, dtype=torch.bool, device=allowed.device)
    out[..., 1:] = step <= PATTERN_BIAS  # below the key before
    out[..., :-1] |= step >= -PATTERN_BIAS  # below the key after
    return out


def _hidden_keys(low: Tensor, finite: Tensor, counts: Tensor, key: Optional[Tensor]) -> Tensor:
    """``(B|1, H|1, 1, Lk)``: the keys ``low`` (or masked) in every row that ``counts`` and low in one at
    least, among those that ``key`` ``(B, 1, 1, Lk)`` keeps."""
    bad = (low | ~finite | ~counts).all(-2, keepdim=True) & (low & counts).any(-2, keepdim=True)
    return bad if key is None else bad & key


def _below_a_gap(allowed: Tensor) -> Tensor:
    """Which entries of ``allowed`` ``(B|1, H|1, Lq|1, Lk)`` lie below a gap of 100 (``-PATTERN_BIAS``) or
    more between their row's sorted values, one example and head at a time: a fill sets a key that far apart
    from the row's largest, where a graded bias (ALiBi's distances) falls in small steps."""
    flat = allowed.flatten(0, 1)  # (B|1 * H|1, Lq|1, Lk)
    out = torch.zeros(flat.shape, dtype=torch.bool, device=flat.device)
    for i, rows in enumerate(flat):
        values = rows.sort(-1, descending=True).values  # (Lq|1, Lk), -inf last
        # (Lq|1, Lk - 1): a step of 100 or more between finite values
        gap = (values[:, :-1] - values[:, 1:] >= -PATTERN_BIAS) & torch.isfinite(values[:, 1:])
        first = gap.to(torch.uint8).argmax(-1, keepdim=True)  # (Lq|1, 1): the gap nearest the row's largest
        below = values.gather(-1, first + 1)  # (Lq|1, 1): the largest value below it
        out[i] = rows <= below.masked_fill(~gap.any(-1, keepdim=True), float("-inf"))
    return out.view(allowed.shape)


def _any(p: Tensor, dim: Optional[int] = None) -> Tensor:
    """``p.any(dim)`` of a boolean ``p``, read as bytes: torch's boolean ``any`` is 30x slower on the CPU."""
    u = p.view(torch.uint8)
    return (u.amax() if dim is None else u.amax(dim)).bool()


def _and(p: Tensor, m: Tensor) -> Tensor:
    """``p & m`` of boolean tensors, multiplied as bytes: torch's ``&`` broadcasting a column is 15x slower on
    the CPU."""
    return (p.view(torch.uint8) * m.view(torch.uint8)).view(torch.bool)


def _last_true(p: Tensor, dim: int) -> Tensor:
    """Index of the last True of ``p`` along ``dim`` (-1 where there is none)."""
    n = p.shape[dim]
    return torch.where(p.any(dim), n - 1 - p.flip(dim).view(torch.uint8).argmax(dim), -1)


def _full_pattern(pair: Optional[Tensor], Lq: int, Lk: int) -> Optional[Tensor]:
    """``pair`` if it holds an ``(Lq, Lk)`` pattern per example and head (under vmap: read from the plain
    tensor under it), else ``None``."""
    if pair is None or pair.shape[-2] != Lq or pair.shape[-1] != Lk:
        return None
    if values_hidden(pair):
        return unbatched_values(pair, trailing=2)  # None where a mapped dimension is among (Lq, Lk)
    return pair


def _prefix_lm_leaks(p: Tensor) -> bool:
    """Whether the square pattern ``p`` is a prefix-LM one (T5, UniLM, GLM): positions ``< P`` see only
    each other, positions ``>= P`` see no key after themselves, for some ``P``; and a later real position
    (one that sees itself) shares a key with a query that sees two keys or more and cannot see it, so that
    a query-normalized mechanism leaks it. A position is real when it sees itself: padded positions of
    Hugging Face's masks (rows that see the real keys, not their own) are not later positions. A padded
    position whose row sees every key, itself included, is the same pattern as one generated position after
    a prefix, and is refused with it (a leak is worse than a refusal: pass the padding as key_mask and
    query_mask)."""
    L = p.shape[0]
    # fast exits, O(L): a query before the last sees the last position (no causal
    # suffix), or no real position sees the one before it without being seen by it (as a causal suffix does)
    if bool(p[:-1, -1].any()):
        return False
    real = p.diagonal()  # (L,)
    if not bool((~p.diagonal(1) & p.diagonal(-1) & real[:-1] & real[1:]).any()):
        return False
    rows = torch.arange(L, device=p.device)
    last_key = _last_true(p, -1)  # (L,)
    sees_after = (last_key > rows).nonzero()
    start = int(sees_after.max()) + 1 if sees_after.numel() else 0  # the suffix is causal from here on
    seen_before = last_key.cummax(0).values  # (L,): the last key any query <= i sees
    splits = ((seen_before[:-1] < rows[1:]) & (rows[1:] >= start)).nonzero()
    if not splits.numel():
        return False
    P = int(splits[0]) + 1  # the first split: queries < P see no key >= P
    if not bool(real[P:].any()):  # only padding after it
        return False
    later = p & (real & (rows >= P))[:, None]  # (L, L): the rows of real positions after the split
    last_later = _last_true(later, 0)  # (Lk,): the last such position that sees each key
    shares = (p & (last_later[None, :] > rows[:, None])).any(-1)  # (L,)
    return bool(((p.sum(-1) >= 2) & shares).any())


def _maybe_ordered(patterns: Optional[Tensor]) -> Tensor:
    """Which square ``(Lq, Lk)`` patterns of ``patterns`` ``(B|1, H|1)`` ``_ordered_leaks`` may flag, from
    their corners alone (no pass over the patterns): an order hides the last key from the first query or the
    first key from the last one, not both where each sees itself (neither key set holds the other: a
    window)."""
    if patterns is None or patterns.shape[-1] != patterns.shape[-2]:
        return torch.zeros((), dtype=torch.bool)
    first_last, last_first = patterns[..., 0, -1], patterns[..., -1, 0]  # (B|1, H|1)
    ends = patterns[..., 0, 0] & patterns[..., -1, -1]
    return ~(first_last & last_first) & ~(~first_last & ~last_first & ends)


def _ordered_leaks(p: Tensor, offset: int) -> bool:
    """Whether the pattern ``p`` (``(Lq, Lk)``, padding merged; query ``i`` at key position ``i + offset``)
    orders its queries so that a query-normalized mechanism leaks: the key sets of the queries that see
    some key form a chain (each one within the next) and are not all the same, as in causal orders of any
    kind: block-causal (chunked, streaming), right-to-left, permuted (XLNet) or prefix-LM; which are orders:
    no query sees the position of a query that sees more keys (seeing is transitive); and a query that
    sees two keys or more cannot see the position of a query whose key set holds its own and more (whose
    content enters the shared keys' column normalization). Patterns that are no such order (windows, a pair
    hidden in a bidirectional mask, patterns of one's own) are not judged here, nor orders of two key sets
    (a bidirectional block and one that sees it and itself: also the pattern of global or register tokens
    that read everything and are read by none), nor rectangular patterns (``Lq != Lk``)."""
    Lq, Lk = p.shape
    if Lq != Lk or offset != 0:
        return False
    real = _any(p, -1) & _any(p, -2)  # (L,): positions that see a key and are seen
    if int(real.sum()) < 3:
        return False
    first, last = int(real.to(torch.uint8).argmax()), Lq - 1 - int(real.flip(0).to(torch.uint8).argmax())
    if bool(p[first, last]) == bool(p[last, first]) or not bool(p[first, first] and p[last, last]):
        return False  # the ends see each other both ways or neither (bidirectional, a window): no order
    counts = p.sum(-1, dtype=torch.int32)  # (Lq,)
    real = counts > 0
    held = counts[real]
    if held.numel() < 3 or int(held.unique().numel()) < 3:
        return False
    rows = p[real][held.argsort()]  # (n, Lk): the key sets, growing
    if bool((rows[:-1] & ~rows[1:]).any()):
        return False  # some set is not within the next one: no chain
    sees = p[:, offset:offset + Lq]  # (Lq, Lq): query i sees the position of query i'
    more = (counts[None, :] > counts[:, None]) & real[None, :]  # (Lq, Lq): i' sees i's keys and more
    if bool((sees & more).any()):
        return False  # not an order: a query sees a position that sees more than it (one hidden pair)
    return bool((more & ~sees & (counts >= 2)[:, None]).any())


def _leaks(p: Tensor) -> bool:
    """Whether a query of the pattern ``p`` (``(Lq, Lk)``, True = may attend) that sees two keys or more
    shares a key with a later query, unless every query that sees any key sees the same keys."""
    seeing = p[_any(p, -1)]  # (n, Lk): the rows of queries that see some key
    if seeing.shape[0] < 2 or bool((seeing == seeing[:1]).all()):
        return False
    Lq = p.shape[0]
    rows = torch.arange(Lq, device=p.device)
    # the last query that sees each key (-1: none), and whether each query shares a key with a later one
    last = _last_true(p, 0)  # (Lk,)
    shares_later = _any(p & (last[None, :] > rows[:, None]), -1)  # (Lq,)
    return bool(((p.sum(-1) >= 2) & shares_later).any())


def build_mask(
    B: int,
    H: int,
    Lq: int,
    Lk: int,
    *,
    key_mask: Optional[Tensor] = None,
    query_mask: Optional[Tensor] = None,
    attn_mask: Optional[Tensor] = None,
    causal: bool = False,
    device: torch.device,
    allow_bias: bool = True,
) -> MaskInfo:
    """Validate the masks and return the one ``MaskInfo`` of the call (its ``valid`` has shape
    ``(B or 1, H or 1, Lq, Lk)``)."""
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    if key_mask is not None:
        key_mask = _check_1d_mask("key_mask", key_mask, B, Lk, "Lk", device)
    if query_mask is not None:
        query_mask = _check_1d_mask("query_mask", query_mask, B, Lq, "Lq", device)

    pair: Optional[Tensor] = None
    bias: Optional[Tensor] = None
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            raise ValueError(f"attn_mask must be a torch.Tensor, got {type(attn_mask).__name__}")
        if attn_mask.device != device:
            raise ValueError(
                f"attn_mask is on {attn_mask.device} but the inputs are on {device}; move it with .to(device)"
            )
        expected = (B, H, Lq, Lk)
        shape = tuple(attn_mask.shape)
        if not 2 <= len(shape) <= 4 or any(s not in (1, e) for s, e in zip(shape[::-1], expected[::-1])):
            per_key = ("; for a per-key mask pass key_mask (B, Lk) or attn_mask.view(1, Lk)"
                       if len(shape) < 2 else "")
            raise ValueError(
                f"attn_mask has shape {shape}; expected 2 to 4 dimensions broadcastable to (B, H, Lq, Lk) = "
                f"{expected}, e.g. ({Lq}, {Lk}) or ({B}, 1, {Lq}, {Lk}){per_key}"
            )
        m = attn_mask.reshape((1,) * (4 - len(shape)) + shape)  # (B|1, H|1, Lq|1, Lk|1)
        if m.dtype == torch.bool:
            pair = m
        elif m.dtype.is_floating_point:
            if not allow_bias:
                raise ValueError(
                    f"attn_mask has dtype {m.dtype}: an additive float mask is meaningless for CoDA "
                    "(its masks are multiplicative); pass a boolean mask with True = may attend"
                )
            hidden = values_hidden(m)  # under vmap: checked on the plain values, every entry maybe masked
            plain = unbatched_values(m) if hidden else m
            if torch.isnan(plain).any() or (plain == float("inf")).any():
                raise ValueError(
                    "attn_mask contains NaN or +inf; use finite biases and -inf for pairs that may not attend"
                )
            allowed = m > MASKED_BIAS  # -inf, finfo.min, -1e9, -10000.0: may not attend
            pair = None if not hidden and bool(allowed.all()) else allowed
            bias = m.masked_fill(~allowed, 0.0)
        else:
            raise ValueError(
                f"attn_mask has dtype {m.dtype}; expected torch.bool (True = may attend) or a float "
                "additive bias"
            )
    return MaskInfo(
        key_mask=key_mask,
        query_mask=query_mask,
        attn_mask=attn_mask,
        causal=causal,
        key=None if key_mask is None else key_mask[:, None, None, :],  # (B, 1, 1, Lk)
        query=None if query_mask is None else query_mask[:, None, :, None],  # (B, 1, Lq, 1)
        pair=pair,
        bias=bias,
        Lq=Lq,
        Lk=Lk,
        device=device,
    )
