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
  a no-op there, which is the math; one ``PATTERN_BIAS`` (100) or more below its row's largest entry but
  above ``MASKED_BIAS`` (-1000, -5000: padding meant as a mask) is refused for them
  (``constant_key_bias``). A bias that varies over the queries (ALiBi) is kept.
- ``causal``     query ``i`` sees keys ``j <= i`` (top-left aligned, as SDPA's ``is_causal``).

A pair ``(i, j)`` is valid when every mask allows it.
"""

from __future__ import annotations

import itertools

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
    """
    Lq, Lk = mask.Lq, mask.Lk
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
    if not any(_maybe_causal(patterns, offset) for offset, patterns, _ in checks):
        return False
    for index in itertools.product(*(range(n) for n in soft.shape[:-2])):
        for offset, patterns, own_key in checks:
            if patterns is None:
                continue
            p = patterns[tuple(min(i, n - 1) for i, n in zip(index, patterns.shape[:-2]))]  # (Lq, Lk)
            if not bool(p.triu(offset + 1).any()):
                if (not own_key or bool(p.diagonal(offset).any())) and _leaks(p):  # no key after its query
                    return True
            elif offset == 0 and Lq == Lk and _prefix_lm_leaks(p):
                return True
    return False


def _maybe_causal(patterns: Optional[Tensor], offset: int) -> bool:
    """Whether some ``(Lq, Lk)`` pattern of ``patterns`` may be flagged aligned at ``offset``: its first query
    sees no key after it (else some query sees a key after it), or (square, top-left) no query before the
    last sees the last key (a prefix-LM's causal suffix). Reads one row and one column of each pattern: the
    bidirectional patterns (every example of the scores given to ``normalize``) skip the loop."""
    if patterns is None:
        return False
    Lq, Lk = patterns.shape[-2:]
    free = ~patterns[..., 0, offset + 1:].any(-1)  # (B|1, H|1)
    if offset == 0 and Lq == Lk:
        free |= ~patterns[..., :-1, -1].any(-1)
    return bool(free.any())


def constant_key_bias(mask: MaskInfo) -> Optional[tuple[float, int]]:
    """``(value, key)`` of a float ``attn_mask`` entry that is the same for every query of its key column
    (among the queries that may attend it) and ``PATTERN_BIAS`` (100) or more below its row's largest
    allowed entry in every such row, while above ``MASKED_BIAS`` (it is not a mask): a per-key bias such as
    padding of -1000 or -5000, which a column (over queries) normalization cancels, so that the key keeps its
    weight. ``None`` when there is none (no float mask, a bias that varies over the queries such as ALiBi, a
    small one, or values hidden by ``vmap``). A few elementwise passes over the mask as given."""
    bias = mask.bias  # (B|1, H|1, Lq|1, Lk|1), 0 where masked
    if bias is None or bias.shape[-1] == 1 or values_hidden(bias) or not bias.numel():
        return None
    allowed = bias if mask.pair is None else bias.masked_fill(~mask.pair, float("-inf"))
    finite = torch.isfinite(allowed)  # False where masked
    top = allowed.amax(-1, keepdim=True)  # (B|1, H|1, Lq|1, 1): each row's largest allowed entry
    low = (allowed <= top + PATTERN_BIAS) & finite  # (B|1, H|1, Lq|1, Lk)
    if not bool(low.any()):  # the common case: no entry far below its row's largest
        return None
    largest = allowed.amax(-2, keepdim=True)  # (B|1, H|1, 1, Lk): over the queries that may attend the key
    smallest = allowed.masked_fill(~finite, float("inf")).amin(-2, keepdim=True)  # (B|1, H|1, 1, Lk)
    bad = (largest == smallest) & (low | ~finite).all(-2, keepdim=True) & low.any(-2, keepdim=True)
    if not bool(bad.any()):
        return None
    at = bad.nonzero()[0]  # (4,): example, head, 0, key
    return float(largest[tuple(at)]), int(at[-1])


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


def _leaks(p: Tensor) -> bool:
    """Whether a query of the pattern ``p`` (``(Lq, Lk)``, True = may attend) that sees two keys or more
    shares a key with a later query, unless every query that sees any key sees the same keys."""
    seeing = p[p.any(-1)]  # (n, Lk): the rows of queries that see some key
    if seeing.shape[0] < 2 or bool((seeing == seeing[:1]).all()):
        return False
    Lq = p.shape[0]
    rows = torch.arange(Lq, device=p.device)
    # the last query that sees each key (-1: none), and whether each query shares a key with a later one
    last = _last_true(p, 0)  # (Lk,)
    shares_later = (p & (last[None, :] > rows[:, None])).any(-1)  # (Lq,)
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
            raise ValueError(
                f"attn_mask has shape {shape}; expected a shape broadcastable to (B, H, Lq, Lk) = "
                f"{expected}, "
                f"e.g. ({Lq}, {Lk}) or ({B}, 1, {Lq}, {Lk})"
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
