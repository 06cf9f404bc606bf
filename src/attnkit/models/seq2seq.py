r"""A small Transformer encoder-decoder for character-level transduction (MLU), mechanism per block.

The "CoDA Transformer" of "Compositional De-Attention Networks" (section 2.4, evaluated on MLU in section
3.6) is a Transformer whose attention is replaced by CoDA; here each of the three attention kinds is
chosen independently: ``encoder_mechanism`` (any mechanism, one or one per layer), ``decoder_mechanism``
(causal self-attention) and ``cross_mechanism`` (``"softmax"`` or ``"coda"``: the query-normalized
mechanisms would mix in future target positions there, and ``ak.nn.TransformerDecoderLayer`` refuses them).

.. math::
    m = \text{Enc}(\sqrt{d} E_s[x] + PE), \qquad
    p(y_t \mid y_{<t}, x) = \text{softmax}(W\, \text{Dec}(\sqrt{d} E_t[y_{<t}] + PE, m)_t)

Training uses teacher forcing (``tgt_in_ids`` = ``<bos> y_1 .. y_{T-1}``); ``greedy_decode`` feeds
back the arg-max token until ``<eos>``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ..registry import resolve_mechanism
from ..validators import check_bool
from ..nn import Transformer
from ..nn.module_utils import reset_submodules
from .building_blocks import (
    PerLayer,
    TokenEmbedding,
    check_id,
    check_ids_and_mask,
    check_positive_int,
    label,
    per_layer,
)

__all__ = ["Seq2SeqTransformer"]


class Seq2SeqTransformer(nn.Module):
    """Source ids -> target logits with a Transformer encoder-decoder.

    Shapes: ``src_ids (B, Ls)``, ``src_mask (B, Ls)`` bool True = real, ``tgt_in_ids (B, Lt)``,
    ``tgt_mask (B, Lt)`` bool True = real -> logits ``(B, Lt, tgt_vocab_size)``. Masks default to
    ``ids != pad_id``. Padded target positions get logits too; leave them out of the loss.
    """

    def __init__(
        self,
        src_vocab_size: int,
        tgt_vocab_size: int,
        d_model: int = 128,
        nhead: int = 4,
        num_encoder_layers: int = 2,
        num_decoder_layers: int = 2,
        dim_feedforward: int = 256,
        dropout: float = 0.1,
        encoder_mechanism: PerLayer = "softmax",
        decoder_mechanism: PerLayer = "softmax",
        cross_mechanism: PerLayer = "softmax",
        max_len: int = 256,
        pad_id: int = 0,
        norm_first: bool = True,
    ) -> None:
        super().__init__()
        # checked sizes, as Python ints (a NumPy integer is accepted)
        src_vocab_size, tgt_vocab_size, d_model, num_encoder_layers, num_decoder_layers, max_len = (
            check_positive_int(name, value)
            for name, value in (
                ("src_vocab_size", src_vocab_size),
                ("tgt_vocab_size", tgt_vocab_size),
                ("d_model", d_model),
                ("num_encoder_layers", num_encoder_layers),
                ("num_decoder_layers", num_decoder_layers),
                ("max_len", max_len),
            )
        )
        check_bool(norm_first, f"norm_first={norm_first!r}")
        enc = [
            resolve_mechanism(m)
            for m in per_layer(encoder_mechanism, num_encoder_layers, "encoder_mechanism")
        ]
        dec = [
            resolve_mechanism(m)
            for m in per_layer(decoder_mechanism, num_decoder_layers, "decoder_mechanism")
        ]
        cross = [
            resolve_mechanism(m) for m in per_layer(cross_mechanism, num_decoder_layers, "cross_mechanism")
        ]
        self.src_vocab_size, self.tgt_vocab_size = src_vocab_size, tgt_vocab_size
        self.d_model, self.max_len, self.pad_id = d_model, max_len, pad_id
        self.mechanisms = {"encoder": enc, "decoder": dec, "cross": cross}
        self.src_embed = TokenEmbedding(src_vocab_size, d_model, pad_id)
        self.tgt_embed = TokenEmbedding(tgt_vocab_size, d_model, pad_id)
        self.pad_id = int(pad_id)  # checked by the embeddings; a NumPy integer is kept as an int
        self.transformer = Transformer(
            d_model=d_model,
            nhead=nhead,
            num_encoder_layers=num_encoder_layers,
            num_decoder_layers=num_decoder_layers,
            dim_feedforward=dim_feedforward,
            dropout=dropout,
            batch_first=True,
            norm_first=norm_first,
            encoder_mechanism=enc,
            decoder_mechanism=dec,
            cross_mechanism=cross,
            positional="sinusoidal",
            max_len=max_len,
        )
        self.generator = nn.Linear(d_model, tgt_vocab_size)
        self._init_weights()  # the submodules were just built with their own initializations

    def reset_parameters(self) -> None:
        """Every layer's own initialization, then embeddings ``N(0, 1/d)``, the Transformer's matrices as
        ``nn.Transformer``'s, the output layer Xavier with a zero bias. After ``to_empty()`` no leftover
        memory stays."""
        reset_submodules(self)
        self._init_weights()

    def _init_weights(self) -> None:
        self.src_embed.reset_parameters()
        self.tgt_embed.reset_parameters()
        self.transformer._init_matrices()
        nn.init.xavier_uniform_(self.generator.weight)
        nn.init.zeros_(self.generator.bias)

    def extra_repr(self) -> str:
        parts = {k: "[" + ", ".join(label(m) for m in v) + "]" for k, v in self.mechanisms.items()}
        return (
            f"src_vocab_size={self.src_vocab_size}, tgt_vocab_size={self.tgt_vocab_size}, "
            f"encoder={parts['encoder']}, decoder={parts['decoder']}, cross={parts['cross']}"
        )

    def encode(self, src_ids: Tensor, src_mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """Memory ``(B, Ls, d_model)`` and the source mask ``(B, Ls)`` (True = real)."""
        src_mask = check_ids_and_mask(
            src_ids, src_mask, self.src_vocab_size, self.max_len, self.pad_id, "src_ids", "src_mask"
        )
        positions = (src_mask.long().cumsum(1) - 1).clamp(min=0)  # left or inner padding moves no real token
        memory = self.transformer.encode(self.src_embed(src_ids), src_key_padding_mask=~src_mask,
                                         src_positions=positions)
        return memory, src_mask

    def decode(
        self, tgt_in_ids: Tensor, memory: Tensor, src_mask: Tensor, tgt_mask: Optional[Tensor] = None
    ) -> Tensor:
        """Logits ``(B, Lt, V)`` of the next token at every target position (causal)."""
        tgt_mask = check_ids_and_mask(
            tgt_in_ids, tgt_mask, self.tgt_vocab_size, self.max_len, self.pad_id, "tgt_in_ids", "tgt_mask"
        )
        if tgt_in_ids.shape[0] != memory.shape[0]:
            raise ValueError(
                f"tgt_in_ids has batch {tgt_in_ids.shape[0]} but the source has {memory.shape[0]}"
            )
        positions = (tgt_mask.long().cumsum(1) - 1).clamp(min=0)  # as the source's: padding moves no token
        h = self.transformer.decode(
            self.tgt_embed(tgt_in_ids),
            memory,
            tgt_key_padding_mask=~tgt_mask,
            memory_key_padding_mask=~src_mask,
            tgt_is_causal=True,
            tgt_positions=positions,
        )  # (B, Lt, d_model)
        return self.generator(h)  # (B, Lt, V)

    def forward(
        self,
        src_ids: Tensor,
        src_mask: Optional[Tensor] = None,
        tgt_in_ids: Optional[Tensor] = None,
        tgt_mask: Optional[Tensor] = None,
    ) -> Tensor:
        if tgt_in_ids is None:  # optional only so that src_mask can be left out, as RNNSeq2Seq's
            given = (" (the second positional argument is src_mask: pass the target as tgt_in_ids=...)"
                     if src_mask is not None and getattr(src_mask, "dtype", None) != torch.bool else "")
            raise ValueError(
                f"tgt_in_ids is required (teacher forcing){given}; use greedy_decode to generate"
            )
        memory, src_mask = self.encode(src_ids, src_mask)
        return self.decode(tgt_in_ids, memory, src_mask, tgt_mask)

    @torch.no_grad()
    def greedy_decode(
        self, src_ids: Tensor, src_mask: Optional[Tensor] = None, max_len: Optional[int] = None,
        bos_id: Optional[int] = None, eos_id: Optional[int] = None,
    ) -> Tensor:
        """Arg-max decoding from ``<bos>``: ``(B, T)`` ids without the ``<bos>``, ``T <= max_len``.
        ``src_mask`` defaults to ``src_ids != pad_id``; ``max_len``, ``bos_id`` and ``eos_id`` are required
        (keywords with defaults only so that ``src_mask`` can be left out).

        ``pad_id``, ``bos_id`` and ``eos_id`` are three different ids. A sequence ends with its ``<eos>``;
        later positions are ``pad_id``. Decoding stops when every sequence has ended or after ``max_len``
        tokens. Runs in whatever mode the model is in (call ``eval()`` first for deterministic output).
        """
        missing = [n for n, v in (("max_len", max_len), ("bos_id", bos_id), ("eos_id", eos_id)) if v is None]
        if missing:
            raise ValueError(f"greedy_decode needs {', '.join(missing)} (keyword arguments: "
                             "greedy_decode(src_ids, max_len=..., bos_id=..., eos_id=...))")
        max_len = check_positive_int("max_len", max_len)
        for name, value in (("bos_id", bos_id), ("eos_id", eos_id)):
            check_id(name, value, self.tgt_vocab_size, "tgt_vocab_size")  # a NumPy integer too
        bos_id, eos_id = int(bos_id), int(eos_id)
        if len({int(self.pad_id), bos_id, eos_id}) < 3:  # <bos> as pad_id: a frozen zero embedding
            raise ValueError(
                f"pad_id={self.pad_id}, bos_id={bos_id}, eos_id={eos_id}: the special tokens need three "
                "different ids"
            )
        if max_len > self.max_len:  # the last step reads <bos> and max_len - 1 tokens
            raise ValueError(
                f"max_len={max_len} needs {max_len} target positions; the model has max_len={self.max_len}"
            )
        memory, src_mask = self.encode(src_ids, src_mask)
        B = src_ids.shape[0]
        ys = torch.full((B, 1), bos_id, dtype=torch.long, device=src_ids.device)  # (B, 1 + t)
        done = torch.zeros(B, dtype=torch.bool, device=src_ids.device)
        for _ in range(max_len if B else 0):  # an empty batch decodes nothing: (0, 0)
            # the mask teacher forcing derives from the same ids (a generated <pad> is padding there: masked,
            # no position), the <bos> column kept whatever bos_id is
            tgt_mask = ys != self.pad_id
            tgt_mask[:, 0] = True
            logits = self.decode(ys, memory, src_mask, tgt_mask)  # (B, 1 + t, V)
            nxt = logits[:, -1].argmax(-1)  # (B,)
            nxt = torch.where(done, torch.full_like(nxt, self.pad_id), nxt)
            ys = torch.cat([ys, nxt[:, None]], dim=1)
            done = done | (nxt == eos_id)
            if bool(done.all()):
                break
        return ys[:, 1:]
