"""Input checks and embeddings shared by the small models."""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
from torch import Tensor, nn

from ..config import MechanismLike
from ..registry import config_label

__all__ = ["PerLayer", "per_layer", "label", "check_positive_int", "check_ids_and_mask", "TokenEmbedding"]

PerLayer = Union[MechanismLike, Sequence[MechanismLike]]


def per_layer(value: PerLayer, num_layers: int, name: str) -> list:
    """One mechanism for every layer, or a list/tuple with exactly one per layer."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_layers:
            raise ValueError(
                f"{name} has {len(value)} entries for {num_layers} layers; "
                "give one per layer or a single value"
            )
        return list(value)
    return [value] * num_layers


label = config_label  # "hnas" for a default config, the full repr (``Sinkhorn(iters=5)``) otherwise


def check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r}; expected a positive integer")


def check_ids_and_mask(
    ids: Tensor,
    mask: Optional[Tensor],
    vocab_size: int,
    max_len: int,
    pad_id: int,
    ids_name: str,
    mask_name: str,
) -> Tensor:
    """Validate ``ids (B, L)`` and ``mask (B, L)`` (True = real); return the mask (``ids != pad_id``)."""
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.dtype != torch.long:
        got = f"{tuple(ids.shape)} {ids.dtype}" if isinstance(ids, Tensor) else type(ids).__name__
        raise ValueError(f"{ids_name} is {got}; expected a LongTensor (B, L) of token ids")
    B, L = ids.shape
    if L > max_len:
        raise ValueError(
            f"{ids_name} has length {L} > max_len={max_len}; truncate the input or build the model "
            f"with max_len >= {L}"
        )
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(
            f"{ids_name} holds ids in [{int(ids.min())}, {int(ids.max())}] but the vocabulary has "
            f"{vocab_size} entries"
        )
    if mask is None:
        return ids != pad_id
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != (B, L):
        got = f"{tuple(mask.shape)} {mask.dtype}" if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(
            f"{mask_name} is {got}; expected a BoolTensor (B, L) = ({B}, {L}) with True = real token"
        )
    return mask


class TokenEmbedding(nn.Module):
    """``sqrt(d_model) * E[ids]`` (Vaswani et al. 2017, section 3.4), with the pad row kept at zero."""

    def __init__(self, vocab_size: int, d_model: int, pad_id: int) -> None:
        super().__init__()
        if isinstance(pad_id, bool) or not isinstance(pad_id, int) or not 0 <= pad_id < vocab_size:
            raise ValueError(f"pad_id={pad_id!r}; expected an id in [0, {vocab_size})")
        self.embedding = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        self.scale = math.sqrt(d_model)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.embedding.weight, std=self.embedding.embedding_dim**-0.5)
        with torch.no_grad():
            self.embedding.weight[self.embedding.padding_idx].zero_()

    def forward(self, ids: Tensor) -> Tensor:
        return self.embedding(ids) * self.scale  # (B, L, d_model)
