r"""A small Transformer encoder text classifier with an attention mechanism per layer.

Vaswani et al. (2017) encoder ("Attention Is All You Need", arXiv:1706.03762: multi-head self-attention,
sinusoidal positions, residual + LayerNorm) over word embeddings, pooled into one vector and mapped
to class logits; each layer may use any mechanism of docs/design.md sections 2-3 (softmax, DNAS, HNAS,
Sinkhorn, CoDA), as in the text-classification comparisons of the doubly-normalized and CoDA papers.

.. math::
    h^{(0)} = \sqrt{d}\, E[x] + PE, \qquad h^{(\ell)} = \text{EncoderLayer}_{m_\ell}(h^{(\ell-1)}), \qquad
    \text{logits} = W\, \text{pool}(h^{(n)}) + b

``pool``: ``"mean"`` (over real tokens), ``"max"`` (over real tokens) or ``"cls"`` (a learned vector
prepended to every sequence). Padding never changes the pooled vector of the real tokens, on either side
or between them: the real tokens are numbered 0, 1, ... as they would be without it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..registry import resolve_mechanism
from ..validators import check_bool
from ..nn import SinusoidalPositionalEncoding, TransformerEncoder, TransformerEncoderLayer
from ..nn.module_utils import reset_submodules
from .building_blocks import (
    PerLayer,
    TokenEmbedding,
    check_ids_and_mask,
    check_positive_int,
    label,
    per_layer,
)

__all__ = ["TransformerClassifier", "POOLINGS"]

POOLINGS = ("mean", "max", "cls")


class TransformerClassifier(nn.Module):
    """Token ids -> class logits through a small Transformer encoder.

    ``mechanism``: one mechanism for every layer or a list with one per layer (names or config objects,
    e.g. ``["softmax", ak.Sinkhorn(iters=5)]``). ``norm_first`` picks pre-LN layers (with a final
    LayerNorm; the default, stable without warm-up) or post-LN layers as in the original Transformer.

    Shapes: ``input_ids (B, L)`` LongTensor, ``attention_mask (B, L)`` bool True = real token (default
    ``input_ids != pad_id``) -> logits ``(B, num_classes)``. A sequence with no real token pools to zeros
    (``"mean"``/``"max"``) and its logits are the bias.
    """

    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        d_model: int = 128,
        nhead: int = 4,
        num_layers: int = 2,
        dim_feedforward: int = 256,
        dropout: float = 0.1,
        mechanism: PerLayer = "softmax",
        max_len: int = 512,
        pad_id: int = 0,
        pooling: str = "mean",
        norm_first: bool = True,
    ) -> None:
        super().__init__()
        # checked sizes, as Python ints (a NumPy integer is accepted)
        vocab_size, num_classes, d_model, num_layers, max_len = (
            check_positive_int(name, value)
            for name, value in (
                ("vocab_size", vocab_size),
                ("num_classes", num_classes),
                ("d_model", d_model),
                ("num_layers", num_layers),
                ("max_len", max_len),
            )
        )
        check_bool(norm_first, f"norm_first={norm_first!r}")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling={pooling!r}; expected one of {POOLINGS}")
        mechanisms = [resolve_mechanism(m) for m in per_layer(mechanism, num_layers, "mechanism")]
        self.vocab_size, self.num_classes, self.d_model = vocab_size, num_classes, d_model
        self.max_len, self.pad_id, self.pooling = max_len, pad_id, pooling
        self.mechanisms = mechanisms
        self.embed = TokenEmbedding(vocab_size, d_model, pad_id)
        self.pad_id = int(pad_id)  # checked by the embedding; a NumPy integer is kept as an int
        self.position = SinusoidalPositionalEncoding(d_model, max_len=max_len + 1, dropout=dropout)
        layer = TransformerEncoderLayer(
            d_model,
            nhead,
            dim_feedforward=dim_feedforward,
            dropout=dropout,
            batch_first=True,
            norm_first=norm_first,
            mechanism=mechanisms[0],
        )
        self.encoder = TransformerEncoder(
            layer, num_layers, norm=nn.LayerNorm(d_model) if norm_first else None, mechanism=mechanisms
        )
        self.cls = nn.Parameter(torch.zeros(1, 1, d_model)) if pooling == "cls" else None
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(d_model, num_classes)
        self._init_weights()  # the submodules were just built with their own initializations

    def reset_parameters(self) -> None:
        """Every layer's own initialization (``nn.LayerNorm``, attention: zero projection biases, ``theta =
        logit(u0)``), then embeddings ``N(0, 1/d)``, encoder matrices Xavier-uniform (as ``nn.Transformer``)
        and the head Xavier with a zero bias. After ``to_empty()`` no leftover memory stays."""
        reset_submodules(self)
        self._init_weights()

    def _init_weights(self) -> None:
        self.embed.reset_parameters()
        for p in self.encoder.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
        if self.cls is not None:
            nn.init.normal_(self.cls, std=0.02)
        nn.init.xavier_uniform_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def extra_repr(self) -> str:
        names = ", ".join(label(m) for m in self.mechanisms)
        return (
            f"vocab_size={self.vocab_size}, num_classes={self.num_classes}, mechanism=[{names}], "
            f"pooling={self.pooling}"
        )

    def encode(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Encoder states ``(B, L', d_model)`` and their mask ``(B, L')`` (``L' = L + 1`` with ``"cls"``)."""
        mask = check_ids_and_mask(
            input_ids,
            attention_mask,
            self.vocab_size,
            self.max_len,
            self.pad_id,
            "input_ids",
            "attention_mask",
        )
        x = self.embed(input_ids)  # (B, L, d_model)
        if self.cls is not None:
            B = x.shape[0]
            x = torch.cat([self.cls.expand(B, 1, -1).to(x.dtype), x], dim=1)  # (B, 1 + L, d_model)
            mask = torch.cat([mask.new_ones(B, 1), mask], dim=1)  # (B, 1 + L)
        # real tokens take positions 0, 1, ... as without padding, wherever the padding is (left padding too)
        positions = (mask.long().cumsum(1) - 1).clamp(min=0)  # (B, L')
        x = self.position(x, positions=positions)
        h = self.encoder(x, src_key_padding_mask=~mask)  # torch convention: True = ignore
        return h, mask

    def pool(self, h: Tensor, mask: Tensor) -> Tensor:
        """``(B, L, d_model)``, ``(B, L)`` -> ``(B, d_model)`` over the real tokens only."""
        if self.pooling == "cls":
            return h[:, 0]
        real = mask.unsqueeze(-1)  # (B, L, 1)
        if self.pooling == "mean":
            count = real.sum(1).clamp(min=1).to(h.dtype)  # (B, 1)
            return (h * real).sum(1) / count
        pooled = h.masked_fill(~real, float("-inf")).amax(1)  # (B, d_model)
        return torch.where(real.any(1), pooled, torch.zeros_like(pooled))

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        h, mask = self.encode(input_ids, attention_mask)
        return self.head(self.dropout(self.pool(h, mask)))  # (B, num_classes)
