r"""Connectionist Temporal Classification (CTC) baseline: Graves et al., "Connectionist Temporal
Classification:
Labelling Unsegmented Sequence Data with Recurrent Neural Networks" (ICML 2006), eqs. (2)-(3); lecture "Going
back in time: CTC":

.. math::
    p(l \mid x) = \sum_{\pi \in \mathcal{B}^{-1}(l)} \prod_t y^t_{\pi_t}

where ``B`` removes repeated labels and then blanks. The lecture reads CTC as hard monotonic attention whose
marginal over alignments is computed exactly by dynamic programming (``torch.nn.CTCLoss``).

The model: a bidirectional GRU/LSTM encoder over the source tokens; each encoder state emits ``upsample``
frames
(a linear map to ``upsample * V`` logits), so targets longer than the source (``"305"`` -> ``three hundred and
five``) stay representable: a target of ``n`` labels with ``r`` adjacent repeats needs ``n + r <= upsample *
Ls``
frames. The blank is ``blank_id`` (default 0, the padding id, which never occurs in a target).

Decoding: ``ctc_greedy_decode`` (best path: arg-max per frame, collapse repeats, drop blanks) and
``ctc_prefix_beam_search`` (Hannun et al., "First-Pass Large Vocabulary Continuous Speech Recognition using
Bi-Directional Recurrent DNNs", arXiv:1408.2873, Algorithm 1, without a language model).
"""

from __future__ import annotations

import itertools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from .building_blocks import (
    check_id,
    check_ids_and_mask,
    check_loss_batch,
    check_positive_int,
    check_prefix_mask,
    describe,
)

__all__ = ["CTCModel", "ctc_greedy_decode", "ctc_prefix_beam_search", "ctc_frames_needed"]

_MAX_LEN = 1 << 20

# The largest value ctc_prefix_beam_search takes as a log-probability. log_softmax is <= 0 exactly
# (x - max - log sum exp(x - max), the sum >= 1), and so is the log of a correctly rounded softmax; 1e-4
# leaves room for log-probabilities that went through other rounding (a float32 sum, an average of models),
# and still refuses probabilities of up to 10^4 labels (a frame's largest probability is >= 1/V > 1e-4).
_LOG_PROB_TOL = 1e-4


def ctc_frames_needed(target: list[int]) -> int:
    """The fewest frames that can emit ``target``: its length plus one blank between equal neighbours."""
    return len(target) + sum(1 for a, b in itertools.pairwise(target) if a == b)


def ctc_greedy_decode(
    log_probs: Tensor, lengths: Optional[Tensor] = None, blank_id: int = 0
) -> list[list[int]]:
    """Best-path decoding. ``log_probs (B, T, V)`` (or probabilities: the arg-max is the same; unlike
    :func:`ctc_prefix_beam_search`, which needs log-probabilities), ``lengths (B,)`` valid frames -> labels.
    ``blank_id`` is an id in ``[0, V)``."""
    if not isinstance(log_probs, Tensor) or log_probs.dim() != 3:
        raise ValueError(
            f"log_probs must be a (B, T, V) tensor, got {getattr(log_probs, 'shape', type(log_probs))}"
        )
    _check_log_probs(log_probs)
    check_id("blank_id", blank_id, log_probs.shape[2], "V")
    B, T, _ = log_probs.shape
    if lengths is None:
        lengths = torch.full((B,), T)
    if not isinstance(lengths, Tensor) or tuple(lengths.shape) != (B,) or not _is_integer(lengths):
        raise ValueError(
            f"lengths is {describe(lengths)}; expected an integer tensor (B,) = ({B},) of frame counts"
        )
    counts = lengths.tolist()
    if any(not 0 <= n <= T for n in counts):
        raise ValueError(f"lengths holds {counts}; each is a frame count in [0, T={T}]")
    valid = torch.arange(T, device=log_probs.device) < lengths.to(log_probs.device)[:, None]  # (B, T)
    _check_frames_possible(log_probs, valid)
    best = log_probs.argmax(dim=-1).tolist()  # (B, T)
    out = []
    for row, n in zip(best, counts):
        labels, prev = [], None
        for token in row[:n]:
            if token != prev and token != blank_id:
                labels.append(token)
            prev = token
        out.append(labels)
    return out


def _is_integer(t: Tensor) -> bool:
    """An integer tensor: not floating, complex or bool (``True`` would count as one)."""
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _check_log_probs(log_probs: Tensor) -> None:
    """Scores to decode: floating, at least one label (the blank), no NaN (a NaN frame has no best label:
    decoding returned nothing)."""
    if not log_probs.dtype.is_floating_point:
        raise ValueError(f"log_probs has dtype {log_probs.dtype}; expected floating log-probabilities")
    if log_probs.shape[-1] == 0:
        raise ValueError(
            f"log_probs has shape {tuple(log_probs.shape)}: V = 0 labels; expected V >= 1 (the blank and the "
            "labels)"
        )
    if bool(torch.isnan(log_probs).any()):
        raise ValueError("log_probs contains NaN; check the model's outputs")


def _check_frames_possible(log_probs: Tensor, valid: Optional[Tensor] = None) -> None:
    """Every (valid) frame gives some label, the blank included, a probability above 0: a frame of -inf
    alone has no labelling (the arg-max read it as label 0, the beam search returned an arbitrary prefix)."""
    dead = log_probs.amax(dim=-1) == -math.inf  # (..., T)
    if valid is not None:
        dead = dead & valid
    if bool(dead.any()):
        where = [tuple(i) if len(i) > 1 else i[0] for i in dead.nonzero().tolist()[:3]]
        raise ValueError(
            f"log_probs is -inf for every label at frame(s) {', '.join(map(str, where))}: no labelling has a "
            "probability above 0; check the model's outputs (or lengths, for frames that are padding)"
        )


def _logaddexp(a: float, b: float) -> float:
    if a == -math.inf:
        return b
    if b == -math.inf:
        return a
    m = max(a, b)
    return m + math.log1p(math.exp(-abs(a - b)))


def ctc_prefix_beam_search(log_probs: Tensor, beam_width: int = 8, blank_id: int = 0) -> list[int]:
    """The most probable labelling found by prefix beam search over ``log_probs (T, V)`` of one sequence.

    Each prefix keeps two log-probabilities, ending in a blank (``p_b``) or in its last label (``p_nb``); a
    repeat
    of the last label extends the prefix only after a blank. Unlike best-path decoding, this sums over the
    alignments of a labelling. ``log_probs`` are log-probabilities (``<= 0``): probabilities are refused
    (a value above ``1e-4`` raises a ``ValueError``), since ranked as log-probabilities they decode wrongly.
    """
    beam_width = check_positive_int("beam_width", beam_width)
    if not isinstance(log_probs, Tensor) or log_probs.dim() != 2:
        raise ValueError(
            f"log_probs must be a (T, V) tensor, got {getattr(log_probs, 'shape', type(log_probs))}"
        )
    log_probs = log_probs.detach()  # a model's live output: a search, no gradient (torch warned per float())
    _check_log_probs(log_probs)
    check_id("blank_id", blank_id, log_probs.shape[1], "V")
    high = float(log_probs.max()) if log_probs.numel() else 0.0
    if high > _LOG_PROB_TOL:  # probabilities (a frame's largest is >= 1/V) ranked as log-probabilities
        raise ValueError(
            f"log_probs holds {high:g} > 0, which is no log-probability; pass log-probabilities "
            "(probs.log() or log_softmax(logits, -1)), not probabilities"
        )
    _check_frames_possible(log_probs)
    lp = log_probs.double().tolist()
    beams: dict[tuple, tuple[float, float]] = {(): (0.0, -math.inf)}  # prefix -> (p_b, p_nb)
    for frame in lp:
        nxt: dict[tuple, list[float]] = {}

        def add(prefix: tuple, pb: float, pnb: float, nxt: dict = nxt) -> None:
            old = nxt.setdefault(prefix, [-math.inf, -math.inf])
            old[0], old[1] = _logaddexp(old[0], pb), _logaddexp(old[1], pnb)

        for prefix, (pb, pnb) in beams.items():
            total = _logaddexp(pb, pnb)
            add(prefix, total + frame[blank_id], -math.inf)  # a blank keeps the prefix
            last = prefix[-1] if prefix else None
            for c, lc in enumerate(frame):
                if c == blank_id or lc == -math.inf:
                    continue
                if c == last:
                    add(prefix, -math.inf, pnb + lc)  # repeat without blank: collapses into the prefix
                    add(prefix + (c,), -math.inf, pb + lc)  # repeat after a blank: a new label
                else:
                    add(prefix + (c,), -math.inf, total + lc)
        ranked = sorted(nxt.items(), key=lambda item: _logaddexp(*item[1]), reverse=True)[:beam_width]
        beams = {prefix: (p[0], p[1]) for prefix, p in ranked}
    best = max(beams.items(), key=lambda item: _logaddexp(*item[1]))
    return list(best[0])


class CTCModel(nn.Module):
    """``CTCModel(src_vocab_size, tgt_vocab_size, embed_dim=64, hidden_dim=128, cell="gru", num_layers=2,
    upsample=2, pad_id=0, blank_id=0)``.

    ``forward(src_ids, src_mask=None) -> (log_probs (B, T, V), frame_lengths (B,))`` with ``T = upsample *
    Ls``;
    ``loss(src_ids, src_mask, targets, target_lengths)`` is the mean CTC loss (``torch.nn.CTCLoss``, ``sum``
    over each sequence, averaged over the batch) and raises a ``ValueError`` for a target that no alignment
    can
    emit (instead of an infinite loss).
    """

    def __init__(
        self,
        src_vocab_size: int,
        tgt_vocab_size: int,
        embed_dim: int = 64,
        hidden_dim: int = 128,
        cell: str = "gru",
        num_layers: int = 2,
        upsample: int = 2,
        pad_id: int = 0,
        blank_id: int = 0,
    ) -> None:
        super().__init__()
        # checked sizes, as Python ints (a NumPy integer is accepted)
        src_vocab_size, tgt_vocab_size, embed_dim, hidden_dim, num_layers, upsample = (
            check_positive_int(name, value)
            for name, value in (
                ("src_vocab_size", src_vocab_size),
                ("tgt_vocab_size", tgt_vocab_size),
                ("embed_dim", embed_dim),
                ("hidden_dim", hidden_dim),
                ("num_layers", num_layers),
                ("upsample", upsample),
            )
        )
        if cell not in ("gru", "lstm"):
            raise ValueError(f"cell={cell!r}: expected 'gru' or 'lstm'")
        if hidden_dim % 2:
            raise ValueError(f"hidden_dim={hidden_dim} must be even (hidden_dim/2 per direction)")
        check_id("blank_id", blank_id, tgt_vocab_size, "tgt_vocab_size")
        check_id("pad_id", pad_id, src_vocab_size, "src_vocab_size")
        self.src_vocab_size, self.tgt_vocab_size = src_vocab_size, tgt_vocab_size
        self.cell_type, self.upsample = cell, upsample
        self.pad_id, self.blank_id = int(pad_id), int(blank_id)  # checked ids; NumPy integers too
        self.embed = nn.Embedding(src_vocab_size, embed_dim, padding_idx=pad_id)
        rnn = nn.GRU if cell == "gru" else nn.LSTM
        self.encoder = rnn(
            embed_dim, hidden_dim // 2, num_layers=num_layers, batch_first=True, bidirectional=True
        )
        self.output = nn.Linear(hidden_dim, upsample * tgt_vocab_size)
        self.ctc = nn.CTCLoss(blank=blank_id, reduction="sum", zero_infinity=False)

    def reset_parameters(self) -> None:
        """Every layer as at construction (PyTorch's default initializations; the padding row zero)."""
        for module in (self.embed, self.encoder, self.output):
            module.reset_parameters()

    def forward(self, src_ids: Tensor, src_mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        src_mask = check_ids_and_mask(
            src_ids, src_mask, self.src_vocab_size, _MAX_LEN, self.pad_id, "src_ids", "src_mask"
        )
        lengths = check_prefix_mask(src_mask, "src_mask")  # (B,)
        B, Ls = src_ids.shape
        if B:
            packed = pack_padded_sequence(
                self.embed(src_ids), lengths.cpu(), batch_first=True, enforce_sorted=False
            )
            out, _ = self.encoder(packed)
            memory, _ = pad_packed_sequence(out, batch_first=True, total_length=Ls)  # (B, Ls, hidden)
        else:  # nothing to pack
            memory = self.output.weight.new_zeros(0, Ls, self.output.in_features)
        logits = self.output(memory).reshape(B, Ls * self.upsample, self.tgt_vocab_size)  # (B, T, V)
        dtype = torch.promote_types(logits.dtype, torch.float32)  # half -> float32, float64 stays
        return F.log_softmax(logits.to(dtype), dim=-1), lengths * self.upsample

    def loss(
        self, src_ids: Tensor, src_mask: Optional[Tensor], targets: Tensor, target_lengths: Tensor
    ) -> Tensor:
        """Mean over the batch of ``-log p(target | source)``; ``targets (B, S)`` padded, ``target_lengths
        (B,)``."""
        log_probs, frames = self(src_ids, src_mask)
        return self.loss_from_log_probs(log_probs, frames, targets, target_lengths)

    def loss_from_log_probs(
        self, log_probs: Tensor, frames: Tensor, targets: Tensor, target_lengths: Tensor
    ) -> Tensor:
        """:meth:`loss` from the outputs of ``forward`` (``log_probs (B, T, V)``, ``frames (B,)``), for a
        caller that runs the forward through a wrapper (DistributedDataParallel syncs the gradients of what
        runs through its own forward only)."""
        V = self.tgt_vocab_size
        if not isinstance(log_probs, Tensor) or log_probs.dim() != 3 or log_probs.shape[-1] != V:
            raise ValueError(
                f"log_probs is {describe(log_probs)}; expected a (B, T, V) tensor with V = tgt_vocab_size = "
                f"{V}, as forward returns"
            )
        if not log_probs.dtype.is_floating_point:  # NaN passes: a diverged run's loss is NaN, which the
            # training loop reports with its step and the advice to lower lr (a ValueError here lost both)
            raise ValueError(f"log_probs has dtype {log_probs.dtype}; expected floating log-probabilities")
        B, T = log_probs.shape[:2]
        check_loss_batch(B, "src_ids")
        high = float(log_probs.detach().max()) if log_probs.numel() else 0.0
        if high > _LOG_PROB_TOL:  # probabilities or logits: the "loss" came out negative
            raise ValueError(
                f"log_probs holds {high:g} > 0, which is no log-probability; pass forward's outputs "
                "(log_softmax(logits, -1)), not probabilities or logits"
            )
        if not isinstance(frames, Tensor) or tuple(frames.shape) != (B,) or not _is_integer(frames):
            raise ValueError(
                f"frames is {describe(frames)}; expected an integer tensor (B,) = ({B},) of frame counts, as "
                "forward returns"
            )
        if any(not 0 <= t <= T for t in frames.tolist()):
            raise ValueError(f"frames holds {frames.tolist()}; each is a frame count in [0, T={T}]")
        # half precision: F.ctc_loss has no CPU kernel for it; forward returns float32 already
        log_probs = log_probs.to(torch.promote_types(log_probs.dtype, torch.float32))
        if not isinstance(targets, Tensor) or targets.dim() != 2 or targets.dtype != torch.long:
            raise ValueError(f"targets is {describe(targets)}; expected a LongTensor (B, S) of padded labels")
        if not isinstance(target_lengths, Tensor) or not _is_integer(target_lengths):
            raise ValueError(f"target_lengths is {describe(target_lengths)}; expected an integer tensor (B,)")
        S = targets.shape[1]
        if targets.shape[0] != B or tuple(target_lengths.shape) != (B,):
            raise ValueError(
                f"targets {tuple(targets.shape)} and target_lengths {tuple(target_lengths.shape)} do not "
                f"match the batch of {B} sources; expected (B, S) = ({B}, S) and (B,) = ({B},)"
            )
        rows = targets.tolist()
        for b, (n, t) in enumerate(zip(target_lengths.tolist(), frames.tolist())):
            if not 0 <= n <= S:
                raise ValueError(f"target_lengths[{b}]={n}; expected a length in [0, S={S}]")
            labels = rows[b][:n]
            bad = [c for c in labels if c == self.blank_id or not 0 <= c < self.tgt_vocab_size]
            if bad:
                raise ValueError(
                    f"target {b} holds label {bad[0]}; labels are ids in [0, {self.tgt_vocab_size}) other "
                    f"than blank_id={self.blank_id}"
                )
            need = ctc_frames_needed(labels)
            if need > t:
                raise ValueError(
                    f"target {b} needs {need} CTC frames but its source gives {t} ({t // self.upsample} "
                    f"tokens x "
                    f"upsample={self.upsample}); raise upsample"
                )
        loss = self.ctc(log_probs.transpose(0, 1), targets, frames, target_lengths)  # (T, B, V) input
        return loss / B

    @torch.no_grad()
    def decode(
        self, src_ids: Tensor, src_mask: Optional[Tensor] = None, beam_width: int = 1
    ) -> list[list[int]]:
        """Labels per example: best path for ``beam_width=1``, prefix beam search otherwise."""
        beam_width = check_positive_int("beam_width", beam_width)
        log_probs, frames = self(src_ids, src_mask)
        if beam_width == 1:
            return ctc_greedy_decode(log_probs, frames, self.blank_id)
        return [
            ctc_prefix_beam_search(log_probs[b, :n], beam_width, self.blank_id)
            for b, n in enumerate(frames.tolist())
        ]

    def extra_repr(self) -> str:
        return f"cell={self.cell_type}, upsample={self.upsample}, blank_id={self.blank_id}"
