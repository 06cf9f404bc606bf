"""Input checks and embeddings shared by the small models."""

from __future__ import annotations

import numbers

import math
from typing import Optional, Sequence, Union

import torch
from torch import Tensor, nn

from ..config import MechanismLike
from ..nn.module_utils import check_like_parameters
from ..registry import config_label

__all__ = [
    "PerLayer",
    "per_layer",
    "label",
    "check_positive_int",
    "describe",
    "check_id",
    "check_token_ids",
    "check_ids_and_mask",
    "check_prefix_mask",
    "check_loss_batch",
    "TokenEmbedding",
]

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


def check_positive_int(name: str, value) -> int:
    """``value`` as a Python ``int`` if it is a positive integer (a NumPy integer too, as ``nn.Embedding``
    and :func:`check_id` take; not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name}={value!r}; expected a positive integer")
    return int(value)


def describe(value) -> str:
    """``"(2, 3) torch.int64"`` for a tensor, the type name otherwise (for error messages)."""
    return f"{tuple(value.shape)} {value.dtype}" if isinstance(value, Tensor) else type(value).__name__


def check_id(name: str, value, vocab_size: int, vocab_name: str = "vocab_size") -> None:
    """A special token id (``pad_id``, ``bos_id`` ...): an integer in ``[0, vocab_size)``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < vocab_size:
        raise ValueError(f"{name}={value!r}; expected an id in [0, {vocab_name}) = [0, {vocab_size})")


def check_token_ids(
    ids, dim: int, vocab_size: int, name: str, shape: str, of: str = "the vocabulary has"
) -> None:
    """``ids`` is a LongTensor of ``dim`` dimensions (``shape`` names them) with ids in ``[0, vocab_size)``.

    ``of`` precedes the count in the message (``"the vocabulary has"``, ``"num_classes is"``). The range
    check is one fused ``aminmax`` and one host sync (an id out of range would otherwise be an opaque
    ``IndexError``, or a device-side assert on CUDA).
    """
    if not isinstance(ids, Tensor) or ids.dim() != dim or ids.dtype != torch.long:
        raise ValueError(f"{name} is {describe(ids)}; expected a LongTensor {shape} of ids")
    if ids.numel():
        low, high = torch.stack(torch.aminmax(ids)).tolist()
        if low < 0 or high >= vocab_size:
            raise ValueError(
                f"{name} holds ids in [{low}, {high}] but {of} {vocab_size} (ids 0 .. {vocab_size - 1})"
            )


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
    if L == 0:
        raise ValueError(f"{ids_name} has shape {tuple(ids.shape)}: length 0; give at least one token")
    if L > max_len:
        raise ValueError(
            f"{ids_name} has length {L} > max_len={max_len}; truncate the input or build the model "
            f"with max_len >= {L}"
        )
    check_token_ids(ids, 2, vocab_size, ids_name, "(B, L)")
    if mask is None:
        return ids != pad_id
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != (B, L):
        got = f"{tuple(mask.shape)} {mask.dtype}" if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(
            f"{mask_name} is {got}; expected a BoolTensor (B, L) = ({B}, {L}) with True = real token"
        )
    return mask


def check_prefix_mask(mask: Tensor, name: str) -> Tensor:
    """Lengths ``(B,)`` of a mask ``(B, L)`` whose real tokens come first (what packed RNNs read).

    One host sync checks both that every row has a real token and that no row has padding before a real
    token (a ``pad_id`` inside a sentence counts as padding); either would otherwise be read wrongly.
    """
    B, L = mask.shape
    lengths = mask.sum(dim=1)  # (B,)
    prefix = torch.arange(L, device=mask.device) < lengths[:, None]  # (B, L)
    if B:
        empty, holes = torch.stack([(lengths < 1).any(), (mask != prefix).any()]).tolist()
        if empty:
            raise ValueError(f"{name} has a row with no real token; every sequence needs at least one token")
        if holes:
            row = int((mask != prefix).any(1).nonzero()[0])
            raise ValueError(
                f"{name} row {row} has padding before a real token; put the real tokens first and the "
                "padding after them (a pad_id inside a sequence counts as padding)"
            )
    return lengths


def check_loss_batch(batch: int, name: str) -> None:
    """A loss is a mean over the batch: an empty batch has none (it would be NaN)."""
    if batch == 0:
        raise ValueError(f"{name} is an empty batch (B=0); the loss is a mean over examples: skip the batch")


class TokenEmbedding(nn.Module):
    """``sqrt(d_model) * E[ids]`` (Vaswani et al. 2017, section 3.4), with the pad row kept at zero."""

    def __init__(self, vocab_size: int, d_model: int, pad_id: int) -> None:
        super().__init__()
        check_id("pad_id", pad_id, vocab_size)  # a NumPy integer too
        self.embedding = nn.Embedding(vocab_size, d_model, padding_idx=int(pad_id))
        self.scale = math.sqrt(d_model)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.embedding.weight, std=self.embedding.embedding_dim**-0.5)
        with torch.no_grad():
            self.embedding.weight[self.embedding.padding_idx].zero_()

    def forward(self, ids: Tensor) -> Tensor:
        return self.embedding(ids) * self.scale  # (B, L, d_model)


def check_input_dtype(images: Tensor, weight: Tensor, model: str) -> None:
    """``images`` floating, on the device and (outside autocast) of the dtype of the model's ``weight``."""
    if not images.is_floating_point():
        raise ValueError(f"images have dtype {images.dtype}; expected a floating tensor (cast with .float())")
    check_like_parameters(images, weight, "images", model, plural=True, cast="the images", holder="model")


def check_finite_pixels(images: Tensor) -> None:
    """``images`` free of NaN and infinite pixels (one host sync): a NaN would give NaN logits or a NaN loss
    silently, or an error far from its cause (in an attention window or a recurrent state)."""
    if not bool(torch.isfinite(images).all()):
        raise ValueError("images hold NaN or infinite pixels; replace them (e.g. torch.nan_to_num) first")
