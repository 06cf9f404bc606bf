r"""Transformer encoder and decoder layers with a mechanism per attention.

Vaswani et al. (2017) ("Attention Is All You Need", arXiv:1706.03762) ("the Transformer":
multi-head self-attention, masked decoder self-attention, cross-attention, residual + LayerNorm);
the mechanisms of docs/design.md section 2. Post-LN (``norm_first=False``) and pre-LN sublayers:

.. math::
    x \leftarrow \text{LN}(x + \text{Drop}(\text{Attn}(x))) \quad\text{or}\quad
    x \leftarrow x + \text{Drop}(\text{Attn}(\text{LN}(x)))

    \text{FF}(x) = W_2\, \text{Drop}(\sigma(W_1 x + b_1)) + b_2

Parameter names are those of ``torch.nn.TransformerEncoderLayer`` / ``TransformerDecoderLayer``
(``self_attn``, ``multihead_attn``, ``linear1``, ``norm1``...), so their ``state_dict`` loads; HNAS
attention adds only its ``theta``.

Decoders are causal. dnas, hnas and sinkhorn normalize over queries, so in decoder self-attention
the column normalizer ``c_j`` would mix in later positions, and in cross-attention it would sum over
all decoder positions (future targets under teacher forcing): both leak, and both are refused.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import CoDA, MechanismLike
from ..functional import observed_query_padding, observing
from ..masks import MASKED_BIAS
from ..registry import normalizes_over_queries, resolve_mechanism
from ..validators import check_number
from .module_utils import flag, mechanism_label, positive_int, reset_submodules
from .multihead import MultiheadAttention

__all__ = ["TransformerEncoderLayer", "TransformerDecoderLayer", "Activation"]

Activation = Union[str, Callable[[Tensor], Tensor]]
_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}

def _rebuilt(layer: nn.Module, **changes) -> nn.Module:
    """``type(layer)`` built afresh from ``layer``'s arguments with ``changes``, moved to ``layer``'s device
    and dtype. An activation module (``nn.PReLU()``) is copied, as torch's stacks deep-copy their layers:
    built from the one object, every layer shared its parameters, and a torch state_dict's per-layer
    weights collapsed into one."""
    args = dict(layer._init_args)
    if isinstance(layer.activation, nn.Module):
        args["activation"] = copy.deepcopy(layer.activation)
    param = next((p for p in layer.parameters() if p.is_floating_point()), None)
    if param is not None:  # after .double() / .to(device) / to_empty(): built where the layer is now (not
        args["device"] = param.device  # on the meta device it was built on: nothing to copy from there)
    new = type(layer)(**{**args, **changes})
    if param is not None:  # the arguments record the dtype it was built with
        new.to(device=param.device, dtype=param.dtype)
    return new


def _activation(activation: Activation) -> Callable[[Tensor], Tensor]:
    if isinstance(activation, str):
        if activation not in _ACTIVATIONS:
            raise ValueError(
                f"activation={activation!r}; expected one of {tuple(_ACTIVATIONS)} or a "
                "callable"
            )
        return _ACTIVATIONS[activation]
    if not callable(activation):
        raise ValueError(f"activation={activation!r}; expected one of {tuple(_ACTIVATIONS)} or a callable")
    return activation


def _check_decoder_mechanism(mechanism: MechanismLike, role: str) -> None:
    config = resolve_mechanism(mechanism)
    if isinstance(config, CoDA) and config.uses_global_means:
        arg = "self_mechanism" if role == "self" else "cross_mechanism"
        raise ValueError(
            f"{arg}={mechanism_label(config)!r} is not allowed in a decoder: CoDA(gate={config.gate!r}, "
            f"center_e={config.center_e!r}) subtracts means over every (query, key) pair (eqs. 4 and 6), and "
            "the queries are the decoder positions, so each position would depend on later target positions "
            "under teacher forcing (a future-token leak). Use CoDA(gate='scaled') or gate='sigmoid' with "
            "center_e=False in the decoder."
        )
    if not normalizes_over_queries(config):
        return
    if role == "self":
        why = (
            "decoder self-attention is causal, and this mechanism normalizes each key's column over the "
            "queries, so position i would depend on positions after i (a future-token leak)"
        )
        arg = "self_mechanism"
    else:
        why = (
            "in cross-attention the queries are the decoder positions: normalizing each memory key's column "
            "over all decoder queries mixes in the future target positions under teacher forcing, so "
            "training would not match step-by-step decoding"
        )
        arg = "cross_mechanism"
    raise ValueError(
        f"{arg}={mechanism_label(config)!r} is not allowed in a decoder: {why}. Use 'softmax' or 'coda' "
        "in the decoder and keep dnas/hnas/sinkhorn for the encoder."
    )


def _check_layer_norm_eps(eps: float) -> float:
    """LayerNorm divides by ``sqrt(var + eps)``: ``eps <= 0`` or non-finite gives NaN or constant outputs."""
    expected = "expected a finite number > 0 (torch's default is 1e-5)"
    return check_number(eps, f"layer_norm_eps={eps!r}", expected, low=0.0, low_open=True, sep="; ")


class _Sublayers(nn.Module):
    """The feed-forward block shared by both layer kinds."""

    def _init_ff(self, d_model, dim_feedforward, dropout, activation, bias, factory) -> None:
        d_model = positive_int(d_model, "d_model")
        dim_feedforward = positive_int(dim_feedforward, "dim_feedforward")
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=bias, **factory)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias, **factory)
        self.activation = _activation(activation)

    def reset_parameters(self) -> None:
        """Every sublayer's own initialization (attention, feed-forward, LayerNorm), as at construction."""
        reset_submodules(self)

    def _ff_block(self, x: Tensor, dropout: nn.Dropout) -> Tensor:
        return dropout(self.linear2(self.dropout(self.activation(self.linear1(x)))))


class TransformerEncoderLayer(_Sublayers):
    """``torch.nn.TransformerEncoderLayer`` with a self-attention ``mechanism`` (any of ``ak.MECHANISMS``).

    Shapes: src ``(L, B, d_model)`` as in torch (``(B, L, d_model)`` with ``batch_first=True``);
    ``src_key_padding_mask`` ``(B, L)`` True = padding (also keeps padded queries out of dnas/hnas/sinkhorn
    column sums).

    The positional arguments and defaults are torch's (through ``device, dtype``); ``mechanism`` and
    ``backend`` are keyword-only additions.
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: Activation = "relu",
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        mechanism: MechanismLike = "softmax",
        backend: str = "auto",
    ) -> None:
        super().__init__()
        layer_norm_eps = _check_layer_norm_eps(layer_norm_eps)
        d_model = positive_int(d_model, "d_model")
        batch_first, norm_first, bias = (
            flag(batch_first, "batch_first"), flag(norm_first, "norm_first"), flag(bias, "bias")
        )
        self._init_args = dict(
            d_model=d_model,
            nhead=nhead,
            dim_feedforward=dim_feedforward,
            dropout=dropout,
            activation=activation,
            layer_norm_eps=layer_norm_eps,
            batch_first=batch_first,
            norm_first=norm_first,
            bias=bias,
            mechanism=mechanism,
            device=device,
            dtype=dtype,
            backend=backend,
        )
        factory = {"device": device, "dtype": dtype}
        self.self_attn = MultiheadAttention(
            d_model, nhead, mechanism=mechanism, dropout=dropout, bias=bias, batch_first=batch_first,
            backend=backend, **factory,
        )
        self._init_ff(d_model, dim_feedforward, dropout, activation, bias, factory)
        self.norm_first = norm_first
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)

    def with_mechanism(self, mechanism: MechanismLike) -> "TransformerEncoderLayer":
        """A freshly initialised layer with the same hyperparameters and another mechanism (on this layer's
        device and dtype, with its own copy of an activation module)."""
        return _rebuilt(self, mechanism=mechanism)

    def extra_repr(self) -> str:
        return f"norm_first={self.norm_first}"

    def forward(
        self,
        src: Tensor,
        src_mask: Optional[Tensor] = None,
        src_key_padding_mask: Optional[Tensor] = None,
        is_causal: bool = False,
    ) -> Tensor:
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            x = x + self._ff_block(self.norm2(x), self.dropout2)
        else:
            x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal))
            x = self.norm2(x + self._ff_block(x, self.dropout2))
        return x

    def _sa_block(self, x: Tensor, attn_mask, key_padding_mask, is_causal: bool) -> Tensor:
        out = self.self_attn(
            x,
            x,
            x,
            attn_mask=attn_mask,
            key_padding_mask=key_padding_mask,
            need_weights=False,
            is_causal=is_causal,
        )[0]
        return self.dropout1(out)


class TransformerDecoderLayer(_Sublayers):
    """``torch.nn.TransformerDecoderLayer`` with ``self_mechanism`` / ``cross_mechanism``.

    Both must be ``"softmax"`` or ``"coda"`` (a ``ValueError`` explains the leak otherwise). As in torch,
    causality comes from ``tgt_mask`` or ``tgt_is_causal=True``. The positional arguments and defaults are
    torch's (through ``device, dtype``); ``self_mechanism``, ``cross_mechanism`` and ``backend`` are
    keyword-only additions.
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: Activation = "relu",
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        self_mechanism: MechanismLike = "softmax",
        cross_mechanism: MechanismLike = "softmax",
        backend: str = "auto",
    ) -> None:
        super().__init__()
        layer_norm_eps = _check_layer_norm_eps(layer_norm_eps)
        d_model = positive_int(d_model, "d_model")
        batch_first, norm_first, bias = (
            flag(batch_first, "batch_first"), flag(norm_first, "norm_first"), flag(bias, "bias")
        )
        _check_decoder_mechanism(self_mechanism, "self")
        _check_decoder_mechanism(cross_mechanism, "cross")
        self._init_args = dict(
            d_model=d_model,
            nhead=nhead,
            dim_feedforward=dim_feedforward,
            dropout=dropout,
            activation=activation,
            layer_norm_eps=layer_norm_eps,
            batch_first=batch_first,
            norm_first=norm_first,
            bias=bias,
            self_mechanism=self_mechanism,
            cross_mechanism=cross_mechanism,
            device=device,
            dtype=dtype,
            backend=backend,
        )
        factory = {"device": device, "dtype": dtype}
        attn = dict(dropout=dropout, bias=bias, batch_first=batch_first, backend=backend, **factory)
        self.self_attn = MultiheadAttention(d_model, nhead, mechanism=self_mechanism, **attn)
        self.multihead_attn = MultiheadAttention(d_model, nhead, mechanism=cross_mechanism, **attn)
        self._init_ff(d_model, dim_feedforward, dropout, activation, bias, factory)
        self.norm_first = norm_first
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory)
        self.norm3 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.dropout3 = nn.Dropout(dropout)

    def with_mechanism(
        self, self_mechanism: MechanismLike, cross_mechanism: MechanismLike
    ) -> "TransformerDecoderLayer":
        """A freshly initialised layer with the same hyperparameters and other mechanisms (on this layer's
        device and dtype, with its own copy of an activation module)."""
        return _rebuilt(self, self_mechanism=self_mechanism, cross_mechanism=cross_mechanism)

    def extra_repr(self) -> str:
        return f"norm_first={self.norm_first}"

    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        tgt_mask: Optional[Tensor] = None,
        memory_mask: Optional[Tensor] = None,
        tgt_key_padding_mask: Optional[Tensor] = None,
        memory_key_padding_mask: Optional[Tensor] = None,
        tgt_is_causal: bool = False,
        memory_is_causal: bool = False,
    ) -> Tensor:
        x = tgt
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), tgt_mask, tgt_key_padding_mask, tgt_is_causal)
            x = x + self._mha_block(
                self.norm2(x), memory, memory_mask, memory_key_padding_mask, memory_is_causal,
                tgt_key_padding_mask,
            )
            x = x + self._ff_block(self.norm3(x), self.dropout3)
        else:
            x = self.norm1(x + self._sa_block(x, tgt_mask, tgt_key_padding_mask, tgt_is_causal))
            x = self.norm2(
                x + self._mha_block(x, memory, memory_mask, memory_key_padding_mask, memory_is_causal,
                                    tgt_key_padding_mask)
            )
            x = self.norm3(x + self._ff_block(x, self.dropout3))
        return x

    def _sa_block(self, x: Tensor, attn_mask, key_padding_mask, is_causal: bool) -> Tensor:
        out = self.self_attn(
            x,
            x,
            x,
            attn_mask=attn_mask,
            key_padding_mask=key_padding_mask,
            need_weights=False,
            is_causal=is_causal,
        )[0]
        return self.dropout1(out)

    def _mha_block(self, x: Tensor, mem: Tensor, attn_mask, key_padding_mask, is_causal: bool,
                   tgt_key_padding_mask: Optional[Tensor] = None) -> Tensor:
        hint = contextlib.nullcontext()
        if tgt_key_padding_mask is not None and observing():
            # the observers of the cross-attention leave the padded target rows out (they entered its
            # column sums); the outputs keep them, as torch's
            padded = (tgt_key_padding_mask if tgt_key_padding_mask.dtype == torch.bool
                      else tgt_key_padding_mask.detach() <= MASKED_BIAS)
            hint = observed_query_padding(~padded.reshape(-1, padded.shape[-1]))  # (B, Lt), True = real
        with hint:
            out = self.multihead_attn(
                x, mem, mem, attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=False,
                is_causal=is_causal,
            )[0]
        return self.dropout2(out)
