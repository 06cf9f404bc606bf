r"""Show, Attend and Tell: a CNN feature grid, an LSTM decoder, soft or stochastic hard attention per word.

"Show, Attend and Tell: Neural Image Caption Generation with Visual Attention" (Xu et al., ICML 2015,
arXiv:1502.03044), section 3 (eqs. 1-7) and 4 (eqs. 8-14).

The encoder (two conv + max-pool stages over the image and two channels of pixel coordinates, so that
features know where they are) gives from its last feature map ``L = H_f * W_f`` annotation vectors
``a_i`` of size ``D``. Per word t:

.. math::
    e_{ti} = f_{att}(a_i, h_{t-1}), \quad \alpha_t = \text{softmax}(e_t) \quad (4\text{-}5), \qquad
    \hat z_t = \beta_t\, \phi(\{a_i\}, \{\alpha_{ti}\}), \\
    \beta_t = \sigma(f_\beta(h_{t-1})) \quad (\text{sec. } 4.2.1) \\
    (i, f, o, g)_t = (\sigma, \sigma, \sigma, \tanh)\, T(E y_{t-1}, h_{t-1}, \hat z_t) \quad (1\text{-}3), \\
    h_0, c_0 = f_{init}(\tfrac{1}{L}\textstyle\sum_i a_i) \\
    p(y_t | a, y_{<t}) \propto \exp(L_o(E y_{t-1} + L_h h_t + L_z \hat z_t)) \quad (7)

``phi`` is :func:`attnkit.nn.hard.hard_attention`: the expectation ``sum_i alpha_ti a_i`` (soft, eq. 13), a
sampled location trained with REINFORCE, a moving-average baseline and an entropy bonus (hard, eq. 12; with
probability ``expectation_prob`` an image uses alpha instead of a sample, sec. 4.1), or a straight-through
Gumbel-softmax sample. Training adds the doubly stochastic penalty ``lambda sum_i (1 - sum_t alpha_ti)^2``
(eq. 14) over the words of each caption. In ``eval()`` a hard model attends to the argmax location.
:meth:`greedy` and :meth:`beam_search` return the weights each word was read with (for a hard model the
one-hot location, for the pictures); :meth:`forward` returns the soft alpha, which eq. 14 penalizes.

Shapes: ``images (B, C, H, W)``, ``tokens (B, T)`` word ids ending in ``<eos>`` then ``<pad>`` (id 0) ->
``logits (B, T, V)``, ``alphas (B, T, L)``; :meth:`feature_grid` gives ``(H_f, W_f)`` to reshape alphas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.hard import HardAttention, MovingAverageBaseline, hard_attention, reinforce_loss
from ..validators import check_number
from .building_blocks import (
    check_finite_pixels, check_input_dtype, check_loss_batch, check_positive_int, check_token_ids, describe,
)

__all__ = ["ATTENTIONS", "CaptionLoss", "ShowAttendTell"]

ATTENTIONS = ("soft", "reinforce", "gumbel", "none")

PAD, BOS, EOS = 0, 1, 2


@dataclass
class CaptionLoss:
    """``total`` (to minimize) and its parts (detached floats): ``nll`` per caption, ``penalty`` (eq. 14),
    ``reinforce`` surrogate, ``reward`` mean and ``baseline``."""

    total: Tensor
    nll: float
    penalty: float
    reinforce: float
    reward: float
    baseline: float


class ShowAttendTell(nn.Module):
    """Captioner with ``attention`` in ``ATTENTIONS``: ``"soft"``, ``"reinforce"`` (stochastic hard),
    ``"gumbel"`` (straight-through hard) or ``"none"`` (the mean annotation at every step, i.e. uniform
    alpha: a "Show and Tell"-like baseline without attention)."""

    def __init__(
        self,
        vocab_size: int,
        attention: str = "soft",
        in_channels: int = 1,
        feature_dim: int = 64,
        embed_dim: int = 32,
        hidden_dim: int = 128,
        attention_dim: int = 64,
        penalty_weight: float = 1.0,
        reward_weight: float = 1.0,
        entropy_weight: float = 0.01,
        expectation_prob: float = 0.5,
        baseline_decay: float = 0.9,
        tau: float = 1.0,
    ) -> None:
        super().__init__()
        if attention not in ATTENTIONS:
            raise ValueError(f"attention={attention!r}; expected one of {ATTENTIONS}")
        # checked sizes, as Python ints (a NumPy integer is accepted)
        vocab_size, in_channels, feature_dim, embed_dim, hidden_dim, attention_dim = (
            check_positive_int(name, value)
            for name, value in (
                ("vocab_size", vocab_size),
                ("in_channels", in_channels),
                ("feature_dim", feature_dim),
                ("embed_dim", embed_dim),
                ("hidden_dim", hidden_dim),
                ("attention_dim", attention_dim),
            )
        )
        if vocab_size <= EOS:
            raise ValueError(
                f"vocab_size={vocab_size}; expected at least {EOS + 1} "
                f"(ids {PAD}, {BOS}, {EOS} are <pad>, <bos>, <eos>)"
            )
        for name, value in (
            ("penalty_weight", penalty_weight),
            ("reward_weight", reward_weight),
            ("entropy_weight", entropy_weight),
        ):
            check_number(value, f"{name}={value!r}", "expected a number >= 0", low=0.0)
        check_number(
            expectation_prob, f"expectation_prob={expectation_prob!r}", "expected a probability in [0, 1]",
            low=0.0, high=1.0, sep="; ",
        )
        self.attention_mode, self.vocab_size, self.in_channels = attention, vocab_size, in_channels
        self.penalty_weight, self.reward_weight = penalty_weight, reward_weight
        self.entropy_weight, self.expectation_prob = entropy_weight, expectation_prob
        self.encoder = nn.Sequential(  # +2 input channels: the (y, x) coordinates of each pixel in [-1, 1]
            nn.Conv2d(in_channels + 2, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, feature_dim, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.init_h = nn.Linear(feature_dim, hidden_dim)
        self.init_c = nn.Linear(feature_dim, hidden_dim)
        mode = "soft" if attention == "none" else attention
        self.attend = HardAttention(hidden_dim, feature_dim, attention_dim, mode=mode, tau=tau)
        self.gate = nn.Linear(hidden_dim, 1)
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.lstm = nn.LSTMCell(embed_dim + feature_dim, hidden_dim)
        self.out_h = nn.Linear(hidden_dim, embed_dim)
        self.out_z = nn.Linear(feature_dim, embed_dim)
        self.out = nn.Linear(embed_dim, vocab_size)
        self.baseline = MovingAverageBaseline(baseline_decay)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d, nn.Embedding, nn.LSTMCell, MovingAverageBaseline)) \
                    and module is not self:  # the REINFORCE baseline forgets its batches, as BatchNorm's
                module.reset_parameters()
        self.attend.reset_parameters()

    # -- pieces ------------------------------------------------------------------------------------------
    def annotations(self, images: Tensor) -> Tensor:
        """``images (B, C, H, W)`` of finite pixels -> ``a (B, L, D)``."""
        if not isinstance(images, Tensor) or images.dim() != 4 or not images.is_floating_point():
            raise ValueError(f"images are {describe(images)}; expected a floating tensor (B, C, H, W)")
        check_input_dtype(images, self.init_h.weight, "ShowAttendTell")
        B, C, H, W = images.shape
        if C != self.in_channels or H < 4 or W < 4:
            raise ValueError(
                f"images have shape {tuple(images.shape)}; "
                f"expected (B, C={self.in_channels}, H >= 4, W >= 4) (two 2x2 poolings)"
            )
        check_finite_pixels(images)  # a NaN would give a NaN loss or a caption of noise
        ys = torch.linspace(-1, 1, H, device=images.device, dtype=images.dtype)
        xs = torch.linspace(-1, 1, W, device=images.device, dtype=images.dtype)
        coords = torch.stack(torch.meshgrid(ys, xs, indexing="ij")).expand(B, -1, -1, -1)  # (B, 2, H, W)
        feats = self.encoder(torch.cat([images, coords], dim=1))  # (B, D, Hf, Wf)
        return feats.flatten(2).transpose(1, 2)  # (B, L, D)

    def feature_grid(self, height: int, width: int) -> tuple[int, int]:
        return height // 4, width // 4

    def _init_state(self, a: Tensor) -> tuple[Tensor, Tensor]:
        mean = a.mean(1)  # (B, D)
        return torch.tanh(self.init_h(mean)), torch.tanh(self.init_c(mean))

    def _step(self, a: Tensor, prev: Tensor, state, mode: str | None = None, use_mean: Tensor | None = None):
        """One word: ``-> logits (B, V)``, the new state, ``alpha (B, L)`` (the soft weights, which eq. 14
        penalizes), ``read (B, L)`` (the weights the context was read with: alpha, or the one-hot location
        of hard attention), ``log_prob (B,)`` and ``entropy (B,)``."""
        h, c = state
        if self.attention_mode == "none":  # no attention: the mean annotation at every step
            att = hard_attention(a.new_zeros(a.shape[:2]), a, mode="soft")
        else:
            att = self.attend(h, a, mode=mode)
        selection, log_prob = att.selection, att.log_prob
        if use_mean is not None:  # sec. 4.1: with probability 0.5 an image uses the expected location
            selection = torch.where(use_mean[:, None], att.weights, selection)
            log_prob = log_prob.masked_fill(use_mean, 0.0)
        z = torch.sigmoid(self.gate(h)) * torch.einsum("bl,bld->bd", selection, a)  # (B, D)
        e = self.embed(prev)  # (B, E)
        h, c = self.lstm(torch.cat([e, z], dim=-1), (h, c))
        logits = self.out(e + self.out_h(h) + self.out_z(z))  # (B, V)
        return logits, (h, c), att.weights, selection, log_prob, att.entropy

    # -- training ------------------------------------------------------------------------------------------
    def forward(self, images: Tensor, tokens: Tensor):
        """Teacher forcing: ``-> logits (B, T, V), alphas (B, T, L), log_probs (B, T), entropies (B, T)``;
        ``alphas`` are the soft weights (what eq. 14 penalizes), also for hard attention."""
        check_token_ids(tokens, 2, self.vocab_size, "tokens", "(B, T)")
        B, T = tokens.shape
        if T == 0 or not isinstance(images, Tensor) or images.shape[:1] != (B,):
            raise ValueError(
                f"tokens {tuple(tokens.shape)} and images {describe(images)}; expected tokens (B, T >= 1) "
                "and images (B, C, H, W) with the same B"
            )
        gaps = (tokens[:, :-1] == PAD) & (tokens[:, 1:] != PAD)  # (B, T - 1): <pad> before a later word
        if bool(gaps.any()):
            row = int(gaps.any(1).nonzero()[0])
            raise ValueError(
                f"tokens row {row} has <pad> (id {PAD}) before a later word; a caption is its word ids, "
                "<eos>, then <pad> only (pad at the end, never inside)"
            )
        empty = tokens[:, 0] == PAD  # (B,): all <pad>, since no <pad> precedes a word
        if bool(empty.any()):
            row = int(empty.nonzero()[0])
            raise ValueError(
                f"tokens row {row} is all <pad> (id {PAD}): an empty caption, which has no likelihood to "
                "train and added a constant doubly stochastic penalty; drop it, or give it at least <eos>"
            )
        a = self.annotations(images)
        state = self._init_state(a)
        prev = torch.full((B,), BOS, dtype=torch.long, device=tokens.device)
        use_mean = None
        if self.training and self.attention_mode == "reinforce" and self.expectation_prob > 0:
            use_mean = torch.rand(B, device=tokens.device) < self.expectation_prob
        outs = []
        for t in range(T):
            logits, state, alpha, _, log_prob, entropy = self._step(a, prev, state, use_mean=use_mean)
            outs.append((logits, alpha, log_prob, entropy))
            prev = tokens[:, t]
        logits, alphas, log_probs, entropies = (torch.stack(x, dim=1) for x in zip(*outs))
        return logits, alphas, log_probs, entropies

    def loss(self, images: Tensor, tokens: Tensor) -> CaptionLoss:
        logits, alphas, log_probs, entropies = self(images, tokens)
        check_loss_batch(tokens.shape[0], "images")
        valid = tokens != PAD  # (B, T)
        token_nll = F.cross_entropy(logits.transpose(1, 2), tokens, reduction="none") * valid  # (B, T)
        nll = token_nll.sum(1)  # (B,) = -log p(y | s, a)
        coverage = (alphas * valid[..., None]).sum(1)  # (B, L) = sum_t alpha_ti
        penalty = ((1 - coverage) ** 2).sum(1)  # (B,)  eq. 14
        total = nll.mean() + self.penalty_weight * penalty.mean()
        reinforce = torch.zeros(())
        reward_mean = baseline = 0.0
        if self.attention_mode == "reinforce" and self.training:
            reward = -nll.detach()  # log p(y | s, a)
            b = self.baseline.update(reward)
            reinforce = reinforce_loss(
                (log_probs * valid).sum(1),
                reward,
                b,
                (entropies * valid).sum(1),
                reward_weight=self.reward_weight,
                entropy_weight=self.entropy_weight,
            )
            total = total + reinforce
            reward_mean, baseline = float(reward.mean()), float(b.mean())  # (N,) on the first batch
        return CaptionLoss(
            total,
            float(nll.detach().mean()),
            float(penalty.detach().mean()),
            float(reinforce.detach()),
            reward_mean,
            baseline,
        )

    # -- decoding ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def greedy(self, images: Tensor, max_len: int) -> tuple[Tensor, Tensor]:
        """``-> tokens (B, max_len)`` (padded after ``<eos>``), ``alphas (B, max_len, L)``: the weights each
        word was read with, i.e. alpha for ``"soft"`` and ``"none"``, and for the hard modes (which attend to
        the argmax location here) the one-hot location, not the soft alpha it was chosen from."""
        max_len = check_positive_int("max_len", max_len)
        a = self.annotations(images)  # checks images first
        B = images.shape[0]
        state = self._init_state(a)
        prev = torch.full((B,), BOS, dtype=torch.long, device=images.device)
        done = torch.zeros(B, dtype=torch.bool, device=images.device)
        tokens, alphas = [], []
        for _ in range(max_len):
            logits, state, _, read, _, _ = self._step(a, prev, state, mode=self._eval_mode())
            prev = logits.argmax(-1)
            tokens.append(prev.masked_fill(done, PAD))
            alphas.append(read)
            done = done | (prev == EOS)
        return torch.stack(tokens, 1), torch.stack(alphas, 1)

    @torch.no_grad()
    def beam_search(self, image: Tensor, beam: int = 3, max_len: int = 10) -> tuple[list[int], Tensor]:
        """One image ``(C, H, W)`` -> best word ids (through ``<eos>``) and its alphas ``(T, L)``: the weights
        each word was read with, as :meth:`greedy` returns them."""
        beam = check_positive_int("beam", beam)
        max_len = check_positive_int("max_len", max_len)
        if not isinstance(image, Tensor) or image.dim() != 3:
            raise ValueError(f"image is {describe(image)}; expected one image (C, H, W)")
        a = self.annotations(image[None])  # (1, L, D)
        state = self._init_state(a)
        beams = [(0.0, [], [], state)]  # (log prob, ids, alphas, state)
        finished = []
        for _ in range(max_len):
            live = [b for b in beams if not (b[1] and b[1][-1] == EOS)]
            if not live:
                break
            prev = torch.tensor([b[1][-1] if b[1] else BOS for b in live], device=image.device)
            h = torch.cat([b[3][0] for b in live])
            c = torch.cat([b[3][1] for b in live])
            logits, (h, c), _, read, _, _ = self._step(
                a.expand(len(live), -1, -1), prev, (h, c), mode=self._eval_mode()
            )
            logp = torch.log_softmax(logits, -1)  # (k, V)
            candidates = []
            for i, (score, ids, al, _) in enumerate(live):
                top = logp[i].topk(min(beam, self.vocab_size))
                for lp, w in zip(top.values.tolist(), top.indices.tolist()):
                    candidates.append((score + lp, ids + [w], al + [read[i]], (h[i : i + 1], c[i : i + 1])))
            candidates.sort(key=lambda x: -x[0])
            beams = []
            for cand in candidates[:beam]:
                (finished if cand[1][-1] == EOS else beams).append(cand)
            if not beams:
                break
        best = max(finished or beams, key=lambda x: x[0])
        return best[1], torch.stack(best[2])

    def _eval_mode(self) -> str:
        return "soft" if self.attention_mode in ("soft", "none") else "argmax"

    def extra_repr(self) -> str:
        return f"attention={self.attention_mode}, penalty_weight={self.penalty_weight:g}"
