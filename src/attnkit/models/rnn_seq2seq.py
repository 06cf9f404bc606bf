r"""A recurrent encoder-decoder with a choice of attention: the models of the lecture "Attention and
Transformers".

- ``attention="none"``: the vanilla encoder-decoder of Cho et al., "Learning Phrase Representations using RNN
  Encoder-Decoder for Statistical Machine Translation" (arXiv:1406.1078), eqs. (3)-(4): the encoder's final
  states are squeezed into one fixed-size vector ``v``, fed to the decoder at every step (the bottleneck):
  ``p(y_t | v, y_{<t})``.
- ``"additive"``, ``"bilinear"``, ``"dot"``, ``"scaled_dot"``: content attention (RNNsearch, Bahdanau et al.,
  "Neural Machine Translation by Jointly Learning to Align and Translate", arXiv:1409.0473, eqs. (4)-(6)):
  ``c_i = sum_j alpha_ij h_j``, ``alpha_i = normalize(a(s_{i-1}, h_j))`` (``ak.nn.AdditiveAttention`` etc.).
- ``"gmm"``: Graves' Gaussian-mixture window (arXiv:1308.0850, eqs. 46-51; ``ak.nn.GMMLocationAttention``).
- ``"mixed"``: content + location (Chorowski et al., arXiv:1506.07503, eqs. 8-9; ``ak.nn.MixedAttention``).

Decoder step (the same for all attentions), with ``q = s_{i-1}`` the previous decoder state:

.. math::
    c_i = \mathrm{attend}(s_{i-1}, H), \qquad s_i = \mathrm{RNNCell}([E y_{i-1}; c_i], s_{i-1}), \qquad
    p(y_i \mid y_{<i}, x) = \mathrm{softmax}(W_o \tanh(W_h [s_i; c_i; E y_{i-1}]))

The encoder is a (bidirectional) GRU or LSTM over packed sequences, so padding never enters it (a source
puts its real tokens first and its padding after them; a ``src_mask`` with padding between real tokens is
refused); with ``bidirectional=True`` each direction has ``hidden_dim / 2`` units and ``H`` has
``hidden_dim`` features, the size of the decoder state (dot attention needs equal sizes).
``s_0 = tanh(W_0 v)`` with ``v`` the concatenated final encoder states.

Training: teacher forcing (``forward``). Inference: ``greedy_decode`` (batched) and ``beam_search`` (per
example, no length normalization, so width 1 is exactly greedy). Both return the alignment matrix
``(B, Lt, Ls)`` (``phi`` for ``gmm``, which is not normalized; ``None`` for ``"none"``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from ..registry import normalizes_over_queries, resolve_mechanism
from ..nn.additive import AdditiveAttention
from ..nn.bilinear import BilinearAttention
from ..nn.dot import DotAttention
from ..nn.location import PARAMETERIZATIONS, GMMLocationAttention
from ..nn.mixed import MixedAttention
from .building_blocks import check_id, check_ids_and_mask, check_positive_int, check_prefix_mask

__all__ = ["RNNSeq2Seq", "ATTENTIONS", "CELLS"]

ATTENTIONS = ("none", "additive", "bilinear", "dot", "scaled_dot", "gmm", "mixed")
CELLS = ("gru", "lstm")
_MAX_LEN = 1 << 20


class RNNSeq2Seq(nn.Module):
    """``RNNSeq2Seq(src_vocab_size, tgt_vocab_size, embed_dim=64, hidden_dim=128, cell="gru",
    bidirectional=True, attention="additive", mechanism="softmax", num_components=3,
    parameterization="softplus", pad_id=0, bos_id=1, eos_id=2)``.

    Shapes: ``src_ids (B, Ls)``, ``src_mask (B, Ls)`` bool True = real (default ``src_ids != pad_id``),
    ``tgt_in_ids (B, Lt)`` = ``<bos> y_1 .. y_{T-1}``, ``tgt_mask (B, Lt)`` bool True = real (default
    ``tgt_in_ids != pad_id``; right padding only, see :meth:`forward`) -> ``logits (B, Lt, V)``,
    ``weights (B, Lt, Ls)`` or None.
    ``mechanism`` weighs the content scores of ``attention`` in ``additive``, ``bilinear``, ``dot``,
    ``scaled_dot`` and ``mixed``: a row-normalized one (softmax-like; a decoder step sees one query, and the
    query-normalized dnas, hnas and sinkhorn would be uniform there: refused) or, with ``dot`` /
    ``scaled_dot``, CoDA, whose quasi-attention weights lie in [-1, 1] and need not sum to 1 (the alignments
    it returns are those weights). ``gmm`` and ``none`` take no mechanism: another than softmax is refused,
    not ignored.
    """

    def __init__(
        self,
        src_vocab_size: int,
        tgt_vocab_size: int,
        embed_dim: int = 64,
        hidden_dim: int = 128,
        cell: str = "gru",
        bidirectional: bool = True,
        attention: str = "additive",
        mechanism="softmax",
        num_components: int = 3,
        parameterization: str = "softplus",
        pad_id: int = 0,
        bos_id: int = 1,
        eos_id: int = 2,
    ) -> None:
        super().__init__()
        # checked sizes, as Python ints (a NumPy integer is accepted)
        src_vocab_size, tgt_vocab_size, embed_dim, hidden_dim, num_components = (
            check_positive_int(name, value)
            for name, value in (
                ("src_vocab_size", src_vocab_size),
                ("tgt_vocab_size", tgt_vocab_size),
                ("embed_dim", embed_dim),
                ("hidden_dim", hidden_dim),
                ("num_components", num_components),
            )
        )
        if cell not in CELLS:
            raise ValueError(f"cell={cell!r}: expected one of {CELLS}")
        if attention not in ATTENTIONS:
            raise ValueError(f"attention={attention!r}: expected one of {ATTENTIONS}")
        if not isinstance(bidirectional, bool):
            raise ValueError(f"bidirectional={bidirectional!r}: expected True or False")
        if bidirectional and hidden_dim % 2:
            raise ValueError(
                f"hidden_dim={hidden_dim} must be even with bidirectional=True (hidden_dim/2 per direction)"
            )
        if parameterization not in PARAMETERIZATIONS:
            raise ValueError(f"parameterization={parameterization!r}: expected one of {PARAMETERIZATIONS}")
        config = resolve_mechanism(mechanism)
        if normalizes_over_queries(config):
            raise ValueError(
                f"mechanism={config.name!r} normalizes over queries, but a decoder step has one query (its "
                f"weights "
                "would be uniform); use a row-normalized mechanism such as 'softmax'"
            )
        if attention in ("gmm", "none") and config.name != "softmax":
            raise ValueError(
                f"attention={attention!r} has no content scores for mechanism={config.name!r} to weigh; drop "
                "mechanism, or pick a content attention ('additive', 'dot', ...)"
            )
        for name, value in (("pad_id", pad_id), ("bos_id", bos_id), ("eos_id", eos_id)):
            check_id(name, value, tgt_vocab_size, "tgt_vocab_size")
        check_id("pad_id", pad_id, src_vocab_size, "src_vocab_size")
        if len({int(pad_id), int(bos_id), int(eos_id)}) < 3:  # <bos> as padding_idx: a frozen zero embedding
            raise ValueError(f"pad_id={pad_id}, bos_id={bos_id}, eos_id={eos_id}: the special tokens need "
                             "three different ids")
        self.src_vocab_size, self.tgt_vocab_size = src_vocab_size, tgt_vocab_size
        self.hidden_dim, self.cell_type, self.attention_type = hidden_dim, cell, attention
        self.pad_id, self.bos_id, self.eos_id = int(pad_id), int(bos_id), int(eos_id)  # NumPy ints too
        self.mechanism = config

        rnn = nn.GRU if cell == "gru" else nn.LSTM
        self.src_embed = nn.Embedding(src_vocab_size, embed_dim, padding_idx=pad_id)
        self.tgt_embed = nn.Embedding(tgt_vocab_size, embed_dim, padding_idx=pad_id)
        self.encoder = rnn(
            embed_dim,
            hidden_dim // 2 if bidirectional else hidden_dim,
            batch_first=True,
            bidirectional=bidirectional,
        )
        self.init_state = nn.Linear(hidden_dim, hidden_dim)
        self.decoder = (nn.GRUCell if cell == "gru" else nn.LSTMCell)(embed_dim + hidden_dim, hidden_dim)
        if attention == "additive":
            self.attention = AdditiveAttention(hidden_dim, hidden_dim, mechanism=config)
        elif attention == "bilinear":
            self.attention = BilinearAttention(hidden_dim, hidden_dim, mechanism=config)
        elif attention in ("dot", "scaled_dot"):
            self.attention = DotAttention(hidden_dim, scaled=attention == "scaled_dot", mechanism=config)
        elif attention == "gmm":
            self.attention = GMMLocationAttention(hidden_dim, num_components, parameterization)
        elif attention == "mixed":
            self.attention = MixedAttention(hidden_dim, hidden_dim, mechanism=config)
        else:
            self.attention = None
        self.pre_output = nn.Linear(2 * hidden_dim + embed_dim, hidden_dim)
        self.output = nn.Linear(hidden_dim, tgt_vocab_size)

    def reset_parameters(self) -> None:
        """Every layer as at construction: PyTorch's default initializations (the embeddings' padding rows
        zero) and the attention's own."""
        for module in (self.src_embed, self.tgt_embed, self.encoder, self.init_state, self.decoder,
                       self.attention, self.pre_output, self.output):
            if module is not None:
                module.reset_parameters()

    # ------------------------------------------------------------------ encoder

    def encode(self, src_ids: Tensor, src_mask: Optional[Tensor] = None) -> dict:
        """``{"memory": H (B, Ls, hidden), "mask": (B, Ls), "summary": v (B, hidden)}``."""
        src_mask = check_ids_and_mask(
            src_ids, src_mask, self.src_vocab_size, _MAX_LEN, self.pad_id, "src_ids", "src_mask"
        )
        lengths = check_prefix_mask(src_mask, "src_mask")  # (B,)
        B, Ls = src_ids.shape
        if B == 0:  # nothing to pack
            memory = self.src_embed.weight.new_zeros(0, Ls, self.hidden_dim)
            return {"memory": memory, "mask": src_mask, "summary": memory.new_zeros(0, self.hidden_dim)}
        packed = pack_padded_sequence(
            self.src_embed(src_ids), lengths.cpu(), batch_first=True, enforce_sorted=False
        )
        out, final = self.encoder(packed)
        memory, _ = pad_packed_sequence(out, batch_first=True, total_length=Ls)  # (B, Ls, hidden)
        h_n = final[0] if self.cell_type == "lstm" else final  # (directions, B, hidden / directions)
        summary = h_n.transpose(0, 1).reshape(B, -1)  # (B, hidden)
        return {"memory": memory, "mask": src_mask, "summary": summary}

    def initial_state(self, enc: dict) -> dict:
        h = torch.tanh(self.init_state(enc["summary"]))  # (B, hidden)
        state = {"h": h}
        if self.cell_type == "lstm":
            state["c"] = torch.zeros_like(h)
        if self.attention_type == "gmm":
            state["kappa"] = self.attention.initial_kappa(h.shape[0], device=h.device, dtype=h.dtype)
        if self.attention_type == "mixed":
            state["prev"] = MixedAttention.initial_weights(enc["mask"]).to(h.dtype)  # (B, Ls)
        return state

    # ------------------------------------------------------------------ one decoder step

    def step(self, enc: dict, state: dict, y_prev: Tensor) -> tuple[Tensor, dict, Optional[Tensor]]:
        """``y_prev (B,)`` -> ``logits (B, V)``, the new state, the alignment ``(B, Ls)`` (None without
        attention)."""
        memory, mask, query = enc["memory"], enc["mask"], state["h"]
        new: dict = {}
        weights = None
        if self.attention_type == "none":
            context = enc["summary"]  # (B, hidden): the fixed-size bottleneck
        elif self.attention_type == "gmm":
            context, weights, new["kappa"] = self.attention(query, memory, state["kappa"], key_mask=mask)
        elif self.attention_type == "mixed":
            context, weights = self.attention(query, memory, state["prev"], key_mask=mask)
            new["prev"] = weights
        else:
            context, weights = self.attention(query, memory, key_mask=mask)  # (B, hidden), (B, Ls)
        emb = self.tgt_embed(y_prev)  # (B, E)
        rnn_in = torch.cat([emb, context], dim=-1)  # (B, E + hidden)
        if self.cell_type == "lstm":
            new["h"], new["c"] = self.decoder(rnn_in, (state["h"], state["c"]))
        else:
            new["h"] = self.decoder(rnn_in, state["h"])
        hidden = torch.tanh(self.pre_output(torch.cat([new["h"], context, emb], dim=-1)))  # (B, hidden)
        return self.output(hidden), new, weights

    # ------------------------------------------------------------------ training and decoding

    def forward(
        self,
        src_ids: Tensor,
        src_mask: Optional[Tensor] = None,
        tgt_in_ids: Optional[Tensor] = None,
        tgt_mask: Optional[Tensor] = None,
    ) -> tuple[Tensor, Optional[Tensor]]:
        """Teacher forcing: ``logits (B, Lt, V)`` and the alignment ``(B, Lt, Ls)`` (None for ``"none"``).

        ``tgt_mask (B, Lt)`` bool, True = real (default ``tgt_in_ids != pad_id``), must mark a prefix of each
        row: the real target tokens first, the padding after them (right padding, as the source's). The
        decoder reads the target left to right, so the logits of a real position never depend on the
        padding after it: a valid mask changes nothing in the computation and is only checked. The logits
        at padded positions are computed from the padding and mean nothing (mask them out of the loss). A
        mask with padding before a real token (left padding, or a hole; with the default mask a ``pad_id``
        inside a row counts as padding, while a mask given marks it real: it is read as a token, with the
        pad row's zero embedding) or a row with no real token (a target starts with ``<bos>``) is refused, as
        for the source.
        """
        if tgt_in_ids is None:
            raise ValueError(
                "tgt_in_ids is required (teacher forcing); use greedy_decode or beam_search to generate"
            )
        tgt_mask = check_ids_and_mask(
            tgt_in_ids, tgt_mask, self.tgt_vocab_size, _MAX_LEN, self.pad_id, "tgt_in_ids", "tgt_mask"
        )
        check_prefix_mask(tgt_mask, "tgt_mask")  # right padding only (what the decoder reads correctly)
        enc = self.encode(src_ids, src_mask)
        if tgt_in_ids.shape[0] != src_ids.shape[0]:
            raise ValueError(f"tgt_in_ids has batch {tgt_in_ids.shape[0]} but src_ids has {src_ids.shape[0]}")
        state = self.initial_state(enc)
        logits, weights = [], []
        for t in range(tgt_in_ids.shape[1]):
            step_logits, state, w = self.step(enc, state, tgt_in_ids[:, t])
            logits.append(step_logits)
            weights.append(w)
        out = torch.stack(logits, dim=1)  # (B, Lt, V)
        return out, (None if weights[0] is None else torch.stack(weights, dim=1))  # (B, Lt, Ls)

    @torch.no_grad()
    def greedy_decode(
        self, src_ids: Tensor, src_mask: Optional[Tensor] = None, max_len: int = 64
    ) -> tuple[Tensor, Optional[Tensor]]:
        """Arg-max tokens ``(B, T)`` (``<eos>`` included, ``pad_id`` after it; no ``<bos>``) and alignments
        ``(B, T, Ls)``; stops when every row has produced ``<eos>`` or after ``max_len`` tokens."""
        max_len = check_positive_int("max_len", max_len)
        enc = self.encode(src_ids, src_mask)
        state = self.initial_state(enc)
        B = src_ids.shape[0]
        y = torch.full((B,), self.bos_id, dtype=torch.long, device=src_ids.device)
        done = torch.zeros(B, dtype=torch.bool, device=src_ids.device)
        tokens, weights = [], []
        if B == 0:  # an empty batch decodes nothing: (0, 0) tokens, (0, 0, Ls) alignments
            align = None if self.attention is None else enc["memory"].new_zeros(0, 0, enc["memory"].shape[1])
            return src_ids.new_zeros(0, 0, dtype=torch.long), align
        for _ in range(max_len):
            logits, state, w = self.step(enc, state, y)
            y = logits.argmax(dim=-1).masked_fill(done, self.pad_id)  # (B,)
            tokens.append(y)
            weights.append(w)
            done = done | (y == self.eos_id)
            if bool(done.all()):
                break
        align = None if weights[0] is None else torch.stack(weights, dim=1)  # (B, T, Ls)
        return torch.stack(tokens, dim=1), align

    @torch.no_grad()
    def beam_search(
        self, src_ids: Tensor, src_mask: Optional[Tensor] = None, beam_width: int = 4, max_len: int = 64
    ) -> tuple[list[list[int]], list[Optional[Tensor]]]:
        """Per example: the most probable hypothesis found with ``beam_width`` beams (sum of
        log-probabilities in the model's dtype, float32 for a half or bfloat16 model; no length
        normalization), as a token list ending with ``<eos>`` (unless ``max_len`` cut it), and its
        alignment ``(T, Ls_b)`` (None for ``"none"``). Width 1 gives exactly ``greedy_decode``."""
        beam_width = check_positive_int("beam_width", beam_width)
        max_len = check_positive_int("max_len", max_len)
        src_mask = check_ids_and_mask(
            src_ids, src_mask, self.src_vocab_size, _MAX_LEN, self.pad_id, "src_ids", "src_mask"
        )
        check_prefix_mask(src_mask, "src_mask")
        results, aligns = [], []
        for b in range(src_ids.shape[0]):
            tokens, align = self._beam_one(src_ids[b : b + 1], src_mask[b : b + 1], beam_width, max_len)
            results.append(tokens)
            aligns.append(align)
        return results, aligns

    def _beam_one(
        self, src: Tensor, mask: Tensor, width: int, max_len: int
    ) -> tuple[list[int], Optional[Tensor]]:
        length = int(mask.sum())
        enc = self.encode(src[:, :length], mask[:, :length])
        state = self.initial_state(enc)
        alive = [([], 0.0, [])]  # (tokens, log-probability, alignment rows)
        finished: list[tuple[list[int], float, list]] = []
        y = torch.tensor([self.bos_id], device=src.device)
        for _ in range(max_len):
            k = len(alive)
            enc_k = {key: value.expand(k, *value.shape[1:]) for key, value in enc.items()}
            logits, new_state, w = self.step(enc_k, state, y)
            dtype = torch.promote_types(logits.dtype, torch.float32)  # half -> float32, float64 stays
            logp = F.log_softmax(logits.to(dtype), dim=-1)  # (k, V)
            scores = torch.tensor([s for _, s, _ in alive], dtype=dtype, device=logp.device)  # (k,)
            total = scores[:, None] + logp  # (k, V)
            # a stable sort: among equal scores the lowest index first, as greedy's argmax takes it (topk
            # took the later of two tied bfloat16 logits, and width 1 was not greedy_decode)
            values, indices = total.flatten().sort(descending=True, stable=True)
            keep = min(width, total.numel())
            keep_rows, next_alive = [], []
            for score, flat in zip(values[:keep].tolist(), indices[:keep].tolist()):
                row, token = divmod(flat, logp.shape[1])
                tokens, _, rows = alive[row]
                rows = rows + ([] if w is None else [w[row]])
                if token == self.eos_id:
                    finished.append((tokens + [token], score, rows))
                else:
                    next_alive.append((tokens + [token], score, rows))
                    keep_rows.append(row)
            best_done = max((s for _, s, _ in finished), default=-float("inf"))
            if not next_alive or best_done >= next_alive[0][1]:  # scores only fall: nothing alive can win
                break
            index = torch.tensor(keep_rows, device=src.device)
            state = {key: value.index_select(0, index) for key, value in new_state.items()}
            alive = next_alive
            y = torch.tensor([t[-1] for t, _, _ in alive], device=src.device)
        pool = finished if finished else next_alive
        tokens, _, rows = max(pool, key=lambda item: item[1])
        return tokens, (torch.stack(rows) if rows else None)

    def extra_repr(self) -> str:
        return (
            f"cell={self.cell_type}, attention={self.attention_type}, hidden_dim={self.hidden_dim}, "
            f"mechanism={self.mechanism.name}"
        )
