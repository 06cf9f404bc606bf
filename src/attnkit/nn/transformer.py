r"""Transformer encoder/decoder stacks and a full encoder-decoder with a mechanism per layer.

Vaswani et al. (2017) ("Attention Is All You Need", arXiv:1706.03762) (stacked layers,
sinusoidal or learned positional embeddings, final LayerNorm). The headline-generation setup of
"Attention that does not Explain Away" (arXiv:2009.14308) (section 6.3, Appendix D) uses an HNAS encoder with
a
softmax decoder, hence the defaults of ``Transformer``. Parameter names are those of
``torch.nn.TransformerEncoder`` / ``TransformerDecoder`` / ``Transformer`` (``layers.0``, ``norm``,
``encoder``, ``decoder``).
"""

from __future__ import annotations

import copy
from typing import Optional, Sequence, Union

import torch
from torch import Tensor, nn

from ..config import MechanismLike
from ..validators import values_hidden
from .module_utils import positive_int, reset_submodules
from .layers import Activation, TransformerDecoderLayer, TransformerEncoderLayer
from .multihead import _flag
from .positional import POSITIONAL, LearnedPositionalEncoding, SinusoidalPositionalEncoding

__all__ = ["TransformerEncoder", "TransformerDecoder", "Transformer"]

PerLayer = Union[MechanismLike, Sequence[MechanismLike]]

def _per_layer(value: Optional[PerLayer], num_layers: int, name: str) -> Optional[list]:
    """One mechanism for every layer, or a list with one per layer."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        if len(value) != num_layers:
            raise ValueError(
                f"{name} has {len(value)} entries for num_layers={num_layers}; give one per "
                "layer or a single value"
            )
        return list(value)
    return [value] * num_layers


def _check_num_layers(num_layers: int, name: str = "num_layers") -> int:
    return positive_int(num_layers, name)


def _length(x: Tensor, dim: int) -> Optional[int]:
    """``x.shape[dim]``; ``None`` for a nested tensor (its sequences have their own lengths)."""
    return None if x.is_nested else x.shape[dim]


def _detect_causal(mask: Optional[Tensor], is_causal: Optional[bool], L: Optional[int]) -> bool:
    """``is_causal`` if given; otherwise whether ``mask`` is exactly the causal mask (as torch detects it),
    so that a causal mask handed to a query-normalized mechanism raises instead of leaking."""
    if is_causal is not None:
        return _flag(is_causal, "is_causal")
    if mask is None or L is None or mask.dim() != 2 or tuple(mask.shape) != (L, L) or values_hidden(mask):
        return False
    upper = torch.ones(L, L, dtype=torch.bool, device=mask.device).triu(1)
    if mask.dtype == torch.bool:
        return bool(torch.equal(mask, upper))
    return bool(torch.equal(mask == float("-inf"), upper) and (mask.masked_fill(upper, 0) == 0).all())

class TransformerEncoder(nn.Module):
    """A stack of ``num_layers`` encoder layers and an optional final ``norm``.

    Without ``mechanism`` the layers are deep copies of ``encoder_layer`` (as in torch). With
    ``mechanism`` (one value or a list of ``num_layers``, keyword-only), layer ``i`` is a freshly
    initialised copy of ``encoder_layer``'s hyperparameters using mechanism ``i``.

    ``enable_nested_tensor`` and ``mask_check`` are accepted for torch compatibility and change nothing:
    the stack never converts padded batches to nested tensors (``use_nested_tensor`` is always False).
    Real positions get torch's outputs; padded positions keep their computed values, where torch's
    nested-tensor fast path (eval, no grad) returns zeros.
    """

    def __init__(
        self,
        encoder_layer: TransformerEncoderLayer,
        num_layers: int,
        norm: Optional[nn.Module] = None,
        enable_nested_tensor: bool = True,
        mask_check: bool = True,
        *,
        mechanism: Optional[PerLayer] = None,
    ) -> None:
        super().__init__()
        self.enable_nested_tensor = enable_nested_tensor
        self.use_nested_tensor = False
        self.mask_check = mask_check
        num_layers = _check_num_layers(num_layers)
        mechanisms = _per_layer(mechanism, num_layers, "mechanism")
        if mechanisms is not None and not isinstance(encoder_layer, TransformerEncoderLayer):
            raise ValueError(
                "mechanism needs an attnkit TransformerEncoderLayer, got "
                f"{type(encoder_layer).__name__}"
            )
        if mechanisms is None:
            layers = [copy.deepcopy(encoder_layer) for _ in range(num_layers)]
        else:
            layers = [encoder_layer.with_mechanism(m) for m in mechanisms]
        self.layers = nn.ModuleList(layers)
        self.num_layers = num_layers
        self.norm = norm

    def reset_parameters(self) -> None:
        """Every layer's own initialization (and the final norm's), as at construction."""
        reset_submodules(self)

    def forward(
        self,
        src: Tensor,
        mask: Optional[Tensor] = None,
        src_key_padding_mask: Optional[Tensor] = None,
        is_causal: Optional[bool] = None,
    ) -> Tensor:
        """``is_causal=None`` detects a causal ``mask`` (so query-normalized layers refuse it)."""
        seq_dim = 1 if (src.dim() == 3 and getattr(self.layers[0].self_attn, "batch_first", False)) else 0
        causal = _detect_causal(mask, is_causal, _length(src, seq_dim))
        out = src
        for layer in self.layers:
            out = layer(out, src_mask=mask, src_key_padding_mask=src_key_padding_mask, is_causal=causal)
        return self.norm(out) if self.norm is not None else out


class TransformerDecoder(nn.Module):
    """A stack of ``num_layers`` decoder layers and an optional final ``norm``.

    ``self_mechanism`` / ``cross_mechanism`` (keyword-only; one value or a list of ``num_layers``) rebuild
    the layers as in ``TransformerEncoder``; without them the layers are deep copies of ``decoder_layer``.
    """

    def __init__(
        self,
        decoder_layer: TransformerDecoderLayer,
        num_layers: int,
        norm: Optional[nn.Module] = None,
        *,
        self_mechanism: Optional[PerLayer] = None,
        cross_mechanism: Optional[PerLayer] = None,
    ) -> None:
        super().__init__()
        num_layers = _check_num_layers(num_layers)
        selfs = _per_layer(self_mechanism, num_layers, "self_mechanism")
        crosses = _per_layer(cross_mechanism, num_layers, "cross_mechanism")
        if selfs is None and crosses is None:
            layers = [copy.deepcopy(decoder_layer) for _ in range(num_layers)]
        else:
            if not isinstance(decoder_layer, TransformerDecoderLayer):
                raise ValueError(
                    f"self_mechanism/cross_mechanism need an attnkit TransformerDecoderLayer, got "
                    f"{type(decoder_layer).__name__}"
                )
            args = decoder_layer._init_args
            selfs = selfs or [args["self_mechanism"]] * num_layers
            crosses = crosses or [args["cross_mechanism"]] * num_layers
            layers = [decoder_layer.with_mechanism(s, c) for s, c in zip(selfs, crosses)]
        self.layers = nn.ModuleList(layers)
        self.num_layers = num_layers
        self.norm = norm

    def reset_parameters(self) -> None:
        """Every layer's own initialization (and the final norm's), as at construction."""
        reset_submodules(self)

    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        tgt_mask: Optional[Tensor] = None,
        memory_mask: Optional[Tensor] = None,
        tgt_key_padding_mask: Optional[Tensor] = None,
        memory_key_padding_mask: Optional[Tensor] = None,
        tgt_is_causal: Optional[bool] = None,
        memory_is_causal: bool = False,
    ) -> Tensor:
        seq_dim = 1 if (tgt.dim() == 3 and getattr(self.layers[0].self_attn, "batch_first", False)) else 0
        causal = _detect_causal(tgt_mask, tgt_is_causal, _length(tgt, seq_dim))
        out = tgt
        for layer in self.layers:
            out = layer(
                out,
                memory,
                tgt_mask=tgt_mask,
                memory_mask=memory_mask,
                tgt_key_padding_mask=tgt_key_padding_mask,
                memory_key_padding_mask=memory_key_padding_mask,
                tgt_is_causal=causal,
                memory_is_causal=memory_is_causal,
            )
        return self.norm(out) if self.norm is not None else out


class Transformer(nn.Module):
    """Encoder-decoder Transformer on embedded inputs, with positional encodings and a mechanism per part.

    ``encoder_mechanism`` (one value or one per encoder layer; default ``"hnas"``, the setup of the
    headline-generation experiments), ``decoder_mechanism`` and ``cross_mechanism`` (softmax or coda).
    ``positional``: ``"sinusoidal"``, ``"learned"`` or ``None`` (then inputs must carry positions).
    The decoder self-attention is causal by default (``tgt_is_causal=True``), and ``forward`` uses
    ``src_key_padding_mask`` as ``memory_key_padding_mask`` when the latter is not given (padded source
    tokens are never attended to). Unlike ``torch.nn.Transformer`` it adds positions to ``src``/``tgt``,
    takes no ``custom_encoder`` / ``custom_decoder`` (pass the arguments after ``activation`` by keyword),
    and its decoder is causal by default (``tgt_is_causal=None`` detects a causal ``tgt_mask`` as torch
    does). With ``positional=None``, ``encoder_mechanism="softmax"``, ``tgt_is_causal=None`` and a
    ``memory_key_padding_mask`` wherever there is a ``src_key_padding_mask`` it computes what
    ``torch.nn.Transformer`` computes.

    Shapes: src ``(Ls, B, d_model)``, tgt ``(Lt, B, d_model)`` -> ``(Lt, B, d_model)`` (torch's default
    ``batch_first=False``); ``(B, L, d_model)`` everywhere with ``batch_first=True``.
    """

    def __init__(
        self,
        d_model: int = 512,
        nhead: int = 8,
        num_encoder_layers: int = 6,
        num_decoder_layers: int = 6,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: Activation = "relu",
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        encoder_mechanism: PerLayer = "hnas",
        decoder_mechanism: PerLayer = "softmax",
        cross_mechanism: PerLayer = "softmax",
        positional: Optional[str] = "sinusoidal",
        max_len: int = 1024,
        device=None,
        dtype=None,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        if positional is not None and positional not in POSITIONAL:
            raise ValueError(f"positional={positional!r}; expected one of {POSITIONAL} or None")
        num_encoder_layers = _check_num_layers(num_encoder_layers, "num_encoder_layers")
        num_decoder_layers = _check_num_layers(num_decoder_layers, "num_decoder_layers")
        factory = {"device": device, "dtype": dtype}
        common = dict(
            d_model=d_model,
            nhead=nhead,
            dim_feedforward=dim_feedforward,
            dropout=dropout,
            activation=activation,
            layer_norm_eps=layer_norm_eps,
            batch_first=batch_first,
            norm_first=norm_first,
            bias=bias,
            backend=backend,
            **factory,
        )
        enc = _per_layer(encoder_mechanism, num_encoder_layers, "encoder_mechanism")
        dec = _per_layer(decoder_mechanism, num_decoder_layers, "decoder_mechanism")
        cross = _per_layer(cross_mechanism, num_decoder_layers, "cross_mechanism")
        self.encoder = TransformerEncoder(
            TransformerEncoderLayer(mechanism=enc[0], **common), num_encoder_layers,
            norm=nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory), mechanism=enc,
        )
        self.decoder = TransformerDecoder(
            TransformerDecoderLayer(self_mechanism=dec[0], cross_mechanism=cross[0], **common),
            num_decoder_layers,
            norm=nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory),
            self_mechanism=dec,
            cross_mechanism=cross,
        )
        if positional is None:
            self.src_position = self.tgt_position = None
        else:
            make = SinusoidalPositionalEncoding if positional == "sinusoidal" else LearnedPositionalEncoding
            extra = {"device": device} if positional == "sinusoidal" else factory
            self.src_position = make(
                d_model, max_len=max_len, dropout=dropout, batch_first=batch_first, **extra
            )
            self.tgt_position = make(
                d_model, max_len=max_len, dropout=dropout, batch_first=batch_first, **extra
            )
        self.d_model = d_model
        self.nhead = nhead
        self.batch_first = batch_first
        self.positional = positional
        # torch's scheme (xavier on every matrix), not a seeded nn.Transformer's numbers: torch deep-copies
        # one layer per stack, attnkit builds each layer for its own mechanism
        self._init_matrices()

    def _reset_parameters(self) -> None:
        """torch's name for ``reset_parameters`` (code written for ``torch.nn.Transformer`` calls it)."""
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Every layer's own initialization (``nn.Linear``, ``nn.LayerNorm``, attention: zero projection
        biases, ``theta = logit(u0)``; learned positions ``N(0, 0.02^2)``), then torch's ``nn.Transformer``
        initialisation: Xavier-uniform for every matrix of the encoder and decoder. A model built on the
        meta device and materialized by ``to_empty()`` holds no leftover memory after it."""
        reset_submodules(self)
        self._init_matrices()

    def _init_matrices(self) -> None:
        for p in list(self.encoder.parameters()) + list(self.decoder.parameters()):
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, nhead={self.nhead}, positional={self.positional}"

    @staticmethod
    def generate_square_subsequent_mask(sz: int, device=None, dtype=None) -> Tensor:
        """The float causal mask ``(sz, sz)``: ``-inf`` above the diagonal, 0 elsewhere (as torch)."""
        return nn.Transformer.generate_square_subsequent_mask(sz, device=device, dtype=dtype)

    def encode(
        self,
        src: Tensor,
        src_mask: Optional[Tensor] = None,
        src_key_padding_mask: Optional[Tensor] = None,
        src_is_causal: Optional[bool] = None,
        src_positions: Optional[Tensor] = None,
    ) -> Tensor:
        """The memory ``(B, Ls, d_model)`` (``(Ls, B, d_model)`` unless ``batch_first``); ``src_positions``
        ``(B, Ls)`` (batch-first models): each token's position (default ``0 .. Ls - 1``;
        ``(mask.cumsum(1) - 1).clamp(min=0)`` keeps left or inner padding from moving the real tokens)."""
        if self.src_position is not None:
            src = self.src_position(src, positions=src_positions)
        elif src_positions is not None:
            raise ValueError("src_positions given but the model has positional=None; add the positions to "
                             "src")
        return self.encoder(
            src, mask=src_mask, src_key_padding_mask=src_key_padding_mask, is_causal=src_is_causal
        )

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        tgt_mask: Optional[Tensor] = None,
        memory_mask: Optional[Tensor] = None,
        tgt_key_padding_mask: Optional[Tensor] = None,
        memory_key_padding_mask: Optional[Tensor] = None,
        tgt_is_causal: Optional[bool] = True,
        memory_is_causal: bool = False,
        tgt_positions: Optional[Tensor] = None,
    ) -> Tensor:
        """Decoder states ``(B, Lt, d_model)`` (``(Lt, B, d_model)`` unless ``batch_first``);
        ``tgt_positions`` ``(B, Lt)`` (batch-first models): each target token's position (default
        ``0 .. Lt - 1``; ``(mask.cumsum(1) - 1).clamp(min=0)`` keeps left or inner padding from moving the
        real tokens)."""
        if self.tgt_position is not None:
            tgt = self.tgt_position(tgt, positions=tgt_positions)
        elif tgt_positions is not None:
            raise ValueError("tgt_positions given but the model has positional=None; add the positions to "
                             "tgt")
        return self.decoder(
            tgt,
            memory,
            tgt_mask=tgt_mask,
            memory_mask=memory_mask,
            tgt_key_padding_mask=tgt_key_padding_mask,
            memory_key_padding_mask=memory_key_padding_mask,
            tgt_is_causal=tgt_is_causal,
            memory_is_causal=memory_is_causal,
        )

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        src_mask: Optional[Tensor] = None,
        tgt_mask: Optional[Tensor] = None,
        memory_mask: Optional[Tensor] = None,
        src_key_padding_mask: Optional[Tensor] = None,
        tgt_key_padding_mask: Optional[Tensor] = None,
        memory_key_padding_mask: Optional[Tensor] = None,
        src_is_causal: Optional[bool] = None,
        tgt_is_causal: Optional[bool] = True,
        memory_is_causal: bool = False,
    ) -> Tensor:
        """torch's ``Transformer.forward`` arguments; ``tgt_is_causal`` defaults to True (see the class)."""
        memory = self.encode(
            src, src_mask=src_mask, src_key_padding_mask=src_key_padding_mask, src_is_causal=src_is_causal
        )
        if memory_key_padding_mask is None:
            memory_key_padding_mask = src_key_padding_mask
        return self.decode(
            tgt,
            memory,
            tgt_mask=tgt_mask,
            memory_mask=memory_mask,
            tgt_key_padding_mask=tgt_key_padding_mask,
            memory_key_padding_mask=memory_key_padding_mask,
            tgt_is_causal=tgt_is_causal,
            memory_is_causal=memory_is_causal,
        )
