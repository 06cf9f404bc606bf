"""Small trained models for the explain-away and CoDA reproductions, built on ``ak.attention``.

- :class:`MultiViewFusion`: the one-layer, single-head multi-view attention of the VQA model
  ("Attention that does not Explain Away" (arXiv:2009.14308), section 6.1 and Appendix B; "Doubly-Normalized
  Attention" section 7.1): queries
  from a primary view ``q = W_q P``, keys from a secondary view ``k = W_k S``, the secondary features
  themselves as values. It is trained on a synthetic task in which only a few secondary "boxes" carry
  the label, so a softmax model learns to explain the others away ("Doubly-Normalized Attention" Fig. 1,
  "Attention that does not Explain Away" Fig. 1).
- :class:`CoDAClassifier`: one CoDA self-attention layer over token embeddings (CoDA eqs. 1-5), trained
  on a signed-sum task, from which ``tanh(E)``, the gate ``sigmoid(N)`` and ``M`` are read (CoDA Fig. 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import Tensor, nn

from ..config import CoDA, Hybrid, MechanismLike
from ..functional import attention, normalize
from ..mechanisms import coda_affinity, coda_gate, sigmoid_weight
from ..registry import initial_theta, resolve_options
from ..mechanisms.masked import masked_mean
from ..scores import neg_l1_distance, scaled_dot
from .collect import collect_explain_away

__all__ = [
    "NO_ATTENTION",
    "MultiViewFusion",
    "make_multiview_task",
    "ExplainAwayTraining",
    "train_multiview",
    "CoDAClassifier",
    "make_signed_sum_task",
    "CoDATraining",
    "train_coda",
]


NO_ATTENTION = "uniform"


class MultiViewFusion(nn.Module):
    """One attention layer fusing a primary view ``P (B, Lq, F)`` with a secondary view ``S (B, Lk, F)``.

    ``out = LayerNorm(P + attention(W_q P, W_k S, S))``, mean-pooled over the primary boxes and
    classified. For ``"hnas"`` the hybrid weight is ``u = sigmoid(theta)``, one per head (here one head).
    ``mechanism="uniform"`` is the no-attention baseline of AEA's Table 1: every real
    secondary box gets the same weight (mean pooling over the view), the projections are unused.
    """

    def __init__(self, features: int, head_dim: int, num_classes: int, mechanism: MechanismLike = "softmax"):
        super().__init__()
        self.config = None if mechanism == NO_ATTENTION else resolve_options(mechanism, learnable_u=True)
        self.q_proj = nn.Linear(features, head_dim)
        self.k_proj = nn.Linear(features, head_dim)
        self.norm = nn.LayerNorm(features)
        self.classifier = nn.Linear(features, num_classes)
        self.theta = nn.Parameter(torch.zeros(1)) if isinstance(self.config, Hybrid) else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for layer in (self.q_proj, self.k_proj, self.classifier):
            layer.reset_parameters()
        self.norm.reset_parameters()
        if self.theta is not None:
            nn.init.constant_(self.theta, initial_theta(self.config))

    def hybrid_weight(self) -> Optional[Tensor]:
        return None if self.theta is None else sigmoid_weight(self.theta)

    @property
    def mechanism_name(self) -> str:
        return NO_ATTENTION if self.config is None else self.config.name

    def forward(self, primary: Tensor, secondary: Tensor, key_mask: Optional[Tensor] = None) -> Tensor:
        if self.config is None:  # no attention: the mean of the real secondary boxes
            # (B, Lk)
            keep = torch.ones(secondary.shape[:2], dtype=torch.bool) if key_mask is None else key_mask
            pooled = (secondary * keep[..., None]).sum(1) / keep.sum(1, keepdim=True).clamp_min(1)  # (B, F)
            h = self.norm(primary + pooled[:, None])  # (B, Lq, F)
            return self.classifier(h.mean(dim=1))  # (B, C)
        q = self.q_proj(primary)[:, None]  # (B, 1, Lq, D)
        k = self.k_proj(secondary)[:, None]  # (B, 1, Lk, D)
        v = secondary[:, None]  # (B, 1, Lk, F)
        fused = attention(
            q, k, v, self.config, key_mask=key_mask, hybrid_weight=self.hybrid_weight(), backend="reference"
        )
        h = self.norm(primary + fused[:, 0])  # (B, Lq, F)
        return self.classifier(h.mean(dim=1))  # (B, C)


def make_multiview_task(
    n: int,
    num_boxes: int = 50,
    num_primary: int = 20,
    features: int = 16,
    num_classes: int = 4,
    informative: int = 3,
    min_boxes: Optional[int] = None,
    seed: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Synthetic multi-view data: ``(primary (n, Lq, F), secondary (n, Lk, F), key_mask (n, Lk), labels
    (n,))``.

    In each secondary view, ``informative`` boxes at random positions carry the class prototype and a
    marker feature; the other boxes are noise. Views have between ``min_boxes`` and ``num_boxes`` real
    boxes (the rest is padding, ``key_mask`` False). The primary view is noise.
    """
    if min_boxes is None:
        min_boxes = num_boxes
    if not 1 <= informative <= min_boxes <= num_boxes:
        raise ValueError(
            f"need 1 <= informative ({informative}) <= min_boxes ({min_boxes}) <= num_boxes "
            f"({num_boxes})"
        )
    g = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(num_classes, features, generator=torch.Generator().manual_seed(1234))
    prototypes[:, 0] = 0.0
    labels = torch.randint(num_classes, (n,), generator=g)
    primary = torch.randn(n, num_primary, features, generator=g)
    secondary = torch.randn(n, num_boxes, features, generator=g)
    lengths = torch.randint(min_boxes, num_boxes + 1, (n,), generator=g)
    key_mask = torch.arange(num_boxes)[None, :] < lengths[:, None]  # (n, Lk)
    for b in range(n):
        slots = torch.randperm(int(lengths[b]), generator=g)[:informative]
        secondary[b, slots] = prototypes[labels[b]] + 0.3 * torch.randn(informative, features, generator=g)
        secondary[b, slots, 0] = 3.0  # the marker a query can learn to look for
    secondary = secondary.masked_fill(~key_mask[..., None], 0.0)
    return primary, secondary, key_mask, labels


@dataclass
class ExplainAwayTraining:
    """What :func:`train_multiview` measured: ``steps (T,)``, ``min_sums (T,)`` (``min_j sum_i pi_ij``
    on the evaluation batch), ``min_normalized (T,)``, ``fraction_below_eps (T,)``, ``hybrid_u (T,)``
    (NaN unless hnas), the final ``log_sums`` of every valid key, ``accuracy`` and ``max_keys``."""

    mechanism: str
    steps: np.ndarray
    min_sums: np.ndarray
    min_normalized: np.ndarray
    fraction_below_eps: np.ndarray
    hybrid_u: np.ndarray
    log_sums: np.ndarray
    accuracy: float
    max_keys: int
    loss: float = float("nan")


def train_multiview(
    mechanism: MechanismLike = "softmax",
    steps: int = 300,
    eval_every: int = 10,
    batch_size: int = 64,
    lr: float = 1e-2,
    eps: float = 1e-3,
    num_boxes: int = 50,
    min_boxes: int = 40,
    seed: int = 0,
    num_classes: int = 4,
    informative: int = 3,
) -> ExplainAwayTraining:
    """Train :class:`MultiViewFusion` with Adam and record explain-away statistics every ``eval_every`` steps.

    ``num_classes`` and ``informative`` (label-carrying boxes per view) set the difficulty of the task.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r}; expected an integer >= 1")
    if isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 1:
        raise ValueError(f"eval_every={eval_every!r}; expected an integer >= 1")
    torch.manual_seed(seed)
    features, classes = 16, num_classes
    task = dict(num_boxes=num_boxes, min_boxes=min_boxes, features=features, num_classes=classes,
                informative=informative)
    train = make_multiview_task(2048, seed=seed, **task)
    evals = make_multiview_task(256, seed=seed + 1, **task)
    model = MultiViewFusion(features, head_dim=16, num_classes=classes, mechanism=mechanism)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    record_steps, minima, normalized, fractions, us = [], [], [], [], []

    def evaluate(step: int) -> list:
        model.eval()
        with torch.no_grad(), collect_explain_away(model, eps=eps) as log:
            logits = model(evals[0], evals[1], evals[2])
        if model.config is None:  # no attention weights to measure
            record_steps.append(step)
            for series in (minima, normalized, fractions, us):
                series.append(float("nan"))
            model.train()
            return [logits, None]
        stats = log.records[0].stats
        record_steps.append(step)
        minima.append(stats.min)
        normalized.append(stats.min_normalized)
        fractions.append(stats.fraction_below_eps)
        u = model.hybrid_weight()
        us.append(float(u.item()) if u is not None else float("nan"))
        model.train()
        return [logits, stats]

    for step in range(steps):
        if step % eval_every == 0:
            evaluate(step)
        idx = torch.randint(train[0].shape[0], (batch_size,), generator=g)
        logits = model(train[0][idx], train[1][idx], train[2][idx])
        loss = nn.functional.cross_entropy(logits, train[3][idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    logits, stats = evaluate(steps)
    accuracy = (logits.argmax(-1) == evals[3]).double().mean().item()
    eval_loss = nn.functional.cross_entropy(logits, evals[3]).item()
    return ExplainAwayTraining(
        mechanism=model.mechanism_name,
        steps=np.asarray(record_steps),
        min_sums=np.asarray(minima),
        min_normalized=np.asarray(normalized),
        fraction_below_eps=np.asarray(fractions),
        hybrid_u=np.asarray(us),
        log_sums=np.zeros(0) if stats is None else stats.log_sums[stats.valid_keys].double().numpy(),
        accuracy=accuracy,
        max_keys=num_boxes,
        loss=eval_loss,
    )


class CoDAClassifier(nn.Module):
    """Token embeddings, one CoDA self-attention layer (``H`` heads), residual, mean pool, linear."""

    def __init__(self, vocab: int, d_model: int, num_heads: int, num_classes: int, config: CoDA):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} must be divisible by num_heads={num_heads}")
        self.config, self.H = config, num_heads
        self.embed = nn.Embedding(vocab, d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.classifier = nn.Linear(d_model, num_classes)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for layer in (self.embed, self.qkv, self.out, self.classifier):
            layer.reset_parameters()

    def project(self, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        x = self.embed(tokens)  # (B, L, d)
        B, L, d = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.H, d // self.H).permute(2, 0, 3, 1, 4)  # 3 x (B, H, L, D)
        return x, q, k, v

    def forward(self, tokens: Tensor, mask: Tensor) -> Tensor:
        x, q, k, v = self.project(tokens)
        B, L, d = x.shape
        o = attention(
            q, k, v, self.config, key_mask=mask, query_mask=mask, backend="reference"
        )  # (B, H, L, D)
        h = x + self.out(o.transpose(1, 2).reshape(B, L, d))  # (B, L, d)
        pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)  # (B, d)
        return self.classifier(pooled)

    @torch.no_grad()
    def matrices(self, tokens: Tensor, mask: Tensor) -> dict[str, np.ndarray]:
        """``tanh(E)``, the gate (``sigmoid(N)`` after the config's centering/scaling) and ``M`` on valid
        pairs."""
        _, q, k, _ = self.project(tokens)
        e = scaled_dot(q, k, 1 / math.sqrt(q.shape[-1]))  # (B, H, L, L)
        n = neg_l1_distance(q, k)  # (B, H, L, L)
        valid = (mask[:, None, :, None] & mask[:, None, None, :]).expand_as(e)  # (B, H, L, L)
        m = normalize(e, self.config, key_mask=mask, query_mask=mask, gate_scores=n)
        e, n = self.config.alpha * e, self.config.beta * n
        if self.config.center_e:
            e = e - masked_mean(e, valid)
        if self.config.gate == "centered":
            n = n - masked_mean(n, valid)
        gate = coda_gate(n, self.config)
        f_e = coda_affinity(e, self.config)
        gate_name = {"sigmoid": "sigmoid(N)", "scaled": "2 sigmoid(N)", "centered": "sigmoid(N - mean N)"}
        return {
            gate_name[self.config.gate]: gate[valid].numpy(),
            "tanh(E)": f_e[valid].numpy(),
            "M": m[valid].numpy(),
        }


def make_signed_sum_task(
    n: int, length: int = 16, min_length: int = 8, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """Tokens 1..14 carry values -7..-1, 1..7 (0 is padding); label 1 when the sum of the values is > 0.

    Returns ``(tokens (n, L), mask (n, L), labels (n,))``.
    """
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 15, (n, length), generator=g)
    lengths = torch.randint(min_length, length + 1, (n,), generator=g)
    mask = torch.arange(length)[None, :] < lengths[:, None]  # (n, L)
    tokens = tokens.masked_fill(~mask, 0)
    values = torch.where(tokens <= 7, tokens - 8, tokens - 7).masked_fill(~mask, 0)
    labels = (values.sum(1) > 0).long()
    return tokens, mask, labels


@dataclass
class CoDATraining:
    """What :func:`train_coda` measured: the matrices on the evaluation set, before and after training,
    the final ``accuracy`` and the ``config``."""

    before: dict
    after: dict
    accuracy: float
    config: CoDA


def train_coda(
    config: Optional[CoDA] = None, steps: int = 400, batch_size: int = 64, lr: float = 3e-3, seed: int = 0
) -> CoDATraining:
    """Train :class:`CoDAClassifier` (d_model 32, 2 heads) on the signed-sum task with Adam."""
    config = CoDA(gate="centered") if config is None else config
    if not isinstance(config, CoDA):
        raise ValueError(f"config must be an ak.CoDA(...) config, got {type(config).__name__}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps={steps!r}; expected an integer >= 0")
    torch.manual_seed(seed)
    train = make_signed_sum_task(4096, seed=seed)
    evals = make_signed_sum_task(256, seed=seed + 1)
    model = CoDAClassifier(vocab=15, d_model=32, num_heads=2, num_classes=2, config=config)
    before = model.matrices(evals[0], evals[1])
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(train[0].shape[0], (batch_size,), generator=g)
        loss = nn.functional.cross_entropy(model(train[0][idx], train[1][idx]), train[2][idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model(evals[0], evals[1]).argmax(-1) == evals[2]).double().mean().item()
    return CoDATraining(
        before=before, after=model.matrices(evals[0], evals[1]), accuracy=accuracy, config=config
    )
