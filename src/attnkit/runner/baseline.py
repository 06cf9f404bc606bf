"""The no-attention baseline of ``attnkit compare``: mechanism name ``"none"``.

"Attention that does not Explain Away" (arXiv:2009.14308), Table 1, measures each attention scheme
against a "no-attn baseline" that combines the features without attention weights. The text-classification
analogue gives every real token the same weight: uniform attention, which is mean pooling of the token
embeddings, followed by the same feed-forward block and classifier head size as the Transformer models.
Any gain of a mechanism over this row is what attention adds at the same budget.
"""

from __future__ import annotations

from torch import Tensor, nn

from ..models.building_blocks import check_id

__all__ = ["NO_ATTENTION", "MeanPoolClassifier"]

NO_ATTENTION = "none"


class MeanPoolClassifier(nn.Module):
    """``logits = W2 relu(W1 LayerNorm(mean_{real i} E[x_i]))``: uniform weights over the real tokens.

    Shapes: ``input_ids (B, L)``, ``attention_mask (B, L)`` bool True = real token -> ``(B, num_classes)``.
    A row without real tokens pools to zeros.
    """

    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        d_model: int,
        dim_feedforward: int,
        dropout: float,
        pad_id: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (
            ("vocab_size", vocab_size),
            ("num_classes", num_classes),
            ("d_model", d_model),
            ("dim_feedforward", dim_feedforward),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}; expected an integer >= 1")
        check_id("pad_id", pad_id, vocab_size)
        self.pad_id = int(pad_id)  # a NumPy integer too
        self.embed = nn.Embedding(vocab_size, d_model, padding_idx=self.pad_id)
        self.norm = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(
            nn.Linear(d_model, dim_feedforward),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(dim_feedforward, num_classes),
        )

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        mask = (input_ids != self.pad_id) if attention_mask is None else attention_mask.bool()  # (B, L)
        x = self.embed(input_ids) * mask[..., None]  # (B, L, d)
        pooled = x.sum(1) / mask.sum(1, keepdim=True).clamp_min(1)  # (B, d): uniform weights
        return self.ff(self.norm(pooled))  # (B, C)
