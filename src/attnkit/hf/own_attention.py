r"""attnkit's code for Hugging Face attention modules that compute attention themselves (they do not
dispatch through transformers' ``AttentionInterface``): the model's own projections and position terms, the
scores normalized by the module's mechanism through :func:`attnkit.hf.attention_forward` (masks, hybrid
weight, backend and ``output_attentions`` as for every converted model). Softmax gives the original model's
outputs.

- **DeBERTa-v2/v3** ("DeBERTa: Decoding-enhanced BERT with Disentangled Attention", arXiv:2006.03654,
  eqs. 2-4): content-to-content plus the disentangled relative-position terms,

  .. math::
      s_{ij} = \frac{q_i^\top k_j + q_i^\top k^r_{\delta(i,j)} + k_j^\top q^r_{\delta(j,i)}}{\sqrt{3 d}}

  (c2p and p2c; the divisor counts the terms the config enables). The position terms come from the module's
  own ``disentangled_attention_bias`` and enter as an additive score bias, as T5's relative bias does.
- **DeBERTa** (v1): the same terms from one fused ``in_proj`` plus ``q_bias`` and ``v_bias``, its position
  terms computed from the scaled queries (``disentangled_att_bias``); talking-head attention (heads mixed
  before and after the softmax) is refused.
- **MPNet** ("MPNet: Masked and Permuted Pre-training for Language Understanding", arXiv:2004.09297), as
  sentence-transformers' all-mpnet models use it: :math:`s_{ij} = q_i^\top k_j / \sqrt{d} + b_{h, i - j}`, a
  relative position bucket bias that its encoder computes once for all layers.
- **RoFormer** ("RoFormer: Enhanced Transformer with Rotary Position Embedding", arXiv:2104.09864),
  **MegatronBERT** and **RemBERT**: BERT's attention, :math:`s_{ij} = q_i^\top k_j / \sqrt{d}`, RoFormer's
  with its rotary embedding applied to q and k (and v with ``rotary_value``) by the module's own method; their
  self-attention as encoders (a decoder's, ``is_decoder=True``, is refused).
- **GPT-Neo**: its ``_attn`` (scores :math:`q_i^\top k_j` without scaling, a causal mask, a sliding window of
  ``window_size`` keys in its local layers) is replaced, the rest of its forward (the cache of ``generate``
  included) is the model's; as a decoder it takes softmax and CoDA.

CoDA, whose masks are multiplicative, refuses a position bias (a DeBERTa config with
``relative_attention=False`` has none).
"""

from __future__ import annotations

import inspect
import math
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from ..masks import MASKED_BIAS
from .attention_interface import attention_forward


def deberta_attention(
    self: nn.Module,
    hidden_states: Tensor,
    attention_mask: Tensor,
    output_attentions: bool = False,
    query_states: Optional[Tensor] = None,
    relative_pos: Optional[Tensor] = None,
    rel_embeddings: Optional[Tensor] = None,
) -> tuple[Tensor, Optional[Tensor]]:
    """``DisentangledSelfAttention.forward`` of DeBERTa and DeBERTa-v2 with attnkit's normalization (same
    arguments and return value). ``attention_mask (B, 1, L, L)``: True (or 1) = may attend, as the model
    builds it."""
    q, k, v, scaling, bias = (_deberta_v1 if hasattr(self, "in_proj") else _deberta_v2)(
        self, hidden_states, query_states, relative_pos, rel_embeddings
    )  # (B, H, L, d) x 3, the scale of q . k, (B, H, Lq, Lk) or None
    out, weights = attention_forward(
        self, q, k, v, attention_mask.bool(),
        scaling=scaling,
        dropout=self.dropout.p if self.training else 0.0,
        position_bias=bias,
        output_attentions=output_attentions,
    )  # (B, Lq, H, d), (B, H, Lq, Lk) or None
    context = out.reshape(out.shape[0], out.shape[1], -1)  # (B, Lq, H d)
    return context, (weights if output_attentions else None)


def _deberta_v2(self, hidden_states, query_states, relative_pos, rel_embeddings):
    H = self.num_attention_heads
    if query_states is None:
        query_states = hidden_states
    q = self.transpose_for_scores(self.query_proj(query_states), H)  # (B H, Lq, d)
    k = self.transpose_for_scores(self.key_proj(hidden_states), H)  # (B H, Lk, d)
    v = self.transpose_for_scores(self.value_proj(hidden_states), H)  # (B H, Lk, d)
    factor = 1 + ("c2p" in self.pos_att_type) + ("p2c" in self.pos_att_type)
    # the model's own divisor, sqrt(d * factor) taken in float32 as it takes it
    scale = float(inspect.getmodule(type(self)).scaled_size_sqrt(q, factor))
    bias = None
    if self.relative_attention:
        rel_embeddings = self.pos_dropout(rel_embeddings)
        bias = self.disentangled_attention_bias(q, k, relative_pos, rel_embeddings, factor)  # (B H, Lq, Lk)
    heads = lambda t: t.view(-1, H, *t.shape[1:])  # noqa: E731  (B H, L, .) -> (B, H, L, .)
    return heads(q), heads(k), heads(v), 1.0 / scale, None if bias is None else heads(bias)


def _deberta_v1(self, hidden_states, query_states, relative_pos, rel_embeddings):
    if query_states is not None:
        raise ValueError(
            "DeBERTa's query_states= path (its enhanced mask decoder) is not converted by attnkit; call the "
            "attention with hidden_states only"
        )
    q, k, v = self.transpose_for_scores(self.in_proj(hidden_states)).chunk(3, dim=-1)  # (B, H, L, d) each
    q = q + self.transpose_for_scores(self.q_bias[None, None, :])
    v = v + self.transpose_for_scores(self.v_bias[None, None, :])
    factor = 1 + len(self.pos_att_type)
    scale = inspect.getmodule(type(self)).scaled_size_sqrt(q, factor)  # its divisor, float32
    bias = None
    if self.relative_attention and rel_embeddings is not None and relative_pos is not None:
        rel_embeddings = self.pos_dropout(rel_embeddings)
        scaled = q / scale.to(dtype=q.dtype)  # the model computes its position terms from the scaled queries
        bias = self.disentangled_att_bias(scaled, k, relative_pos, rel_embeddings, factor)  # (B, H, Lq, Lk)
    # q itself, unscaled: CoDA's L1 term is between the projections (as for every converted model)
    return q, k, v, 1.0 / float(scale), bias


def mpnet_attention(
    self: nn.Module,
    hidden_states: Tensor,
    attention_mask: Optional[Tensor] = None,
    position_bias: Optional[Tensor] = None,
    output_attentions: bool = False,
    **kwargs,
) -> tuple:
    """``MPNetSelfAttention.forward`` with attnkit's normalization (same arguments and return value).
    ``attention_mask``: the model's (additive or boolean) mask, ``position_bias (B, H, L, L)``."""
    B, L = hidden_states.shape[:2]
    d = self.attention_head_size
    q = self.q(hidden_states).view(B, L, -1, d).transpose(1, 2)  # (B, H, L, d)
    k = self.k(hidden_states).view(B, L, -1, d).transpose(1, 2)  # (B, H, L, d)
    v = self.v(hidden_states).view(B, L, -1, d).transpose(1, 2)  # (B, H, L, d)
    out, weights = attention_forward(
        self, q, k, v, attention_mask,
        scaling=1.0 / math.sqrt(d),
        dropout=self.dropout.p if self.training else 0.0,
        position_bias=position_bias,
        output_attentions=output_attentions,
    )  # (B, L, H, d), (B, H, L, L) or None
    o = self.o(out.reshape(B, L, -1))  # (B, L, E)
    return (o, weights) if output_attentions else (o,)


def bert_style_attention(
    self: nn.Module,
    hidden_states: Tensor,
    attention_mask: Optional[Tensor] = None,
    sinusoidal_pos: Optional[Tensor] = None,
    encoder_hidden_states: Optional[Tensor] = None,
    cache=None,
    output_attentions: bool = False,
    **kwargs,
) -> tuple[Tensor, Optional[Tensor]]:
    """The encoder self-attention of RoFormer, MegatronBERT and RemBERT with attnkit's normalization (their
    ``SelfAttention.forward``'s keyword arguments and return value)."""
    if encoder_hidden_states is not None or cache is not None:
        raise ValueError(
            f"{type(self).__name__} was converted as encoder self-attention; it cannot take "
            "encoder_hidden_states or a key/value cache"
        )
    B, L = hidden_states.shape[:2]
    d = self.attention_head_size
    q = self.query(hidden_states).view(B, L, -1, d).transpose(1, 2)  # (B, H, L, d)
    k = self.key(hidden_states).view(B, L, -1, d).transpose(1, 2)  # (B, H, L, d)
    v = self.value(hidden_states).view(B, L, -1, d).transpose(1, 2)  # (B, H, L, d)
    if sinusoidal_pos is not None:  # RoFormer
        if getattr(self, "rotary_value", False):
            q, k, v = self.apply_rotary_position_embeddings(sinusoidal_pos, q, k, v)
        else:
            q, k = self.apply_rotary_position_embeddings(sinusoidal_pos, q, k)
    out, weights = attention_forward(
        self, q, k, v, attention_mask,
        scaling=1.0 / math.sqrt(d),
        dropout=self.dropout.p if self.training else 0.0,
        output_attentions=output_attentions,
    )  # (B, L, H, d), (B, H, L, L) or None
    return out.reshape(B, L, -1), (weights if output_attentions else None)  # (B, L, H d)


def gpt_neo_attn(
    self: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor] = None
) -> tuple[Tensor, Optional[Tensor]]:
    """``GPTNeoSelfAttention._attn`` with attnkit's normalization: q, k, v ``(B, H, L, d)`` -> ``(out
    (B, H, Lq, d), weights (B, H, Lq, Lk))`` (materialized, as the model's own). Its causal (and, in local
    layers, windowed) pattern comes from the module's ``bias`` buffer, the padding from the model's
    ``attention_mask``."""
    Lq, Lk = query.shape[-2], key.shape[-2]
    allowed = self.bias[:, :, Lk - Lq : Lk, :Lk]  # (1, 1, Lq, Lk) True = may attend
    if attention_mask is not None and attention_mask.dtype != torch.bool:  # the model's additive mask
        attention_mask = attention_mask > MASKED_BIAS
    mask = allowed if attention_mask is None else allowed & attention_mask  # (B|1, 1, Lq, Lk)
    out, weights = attention_forward(
        self, query, key, value, mask,
        scaling=1.0,
        dropout=self.attn_dropout.p if self.training else 0.0,
        is_causal=True,
        output_attentions=True,
    )  # (B, Lq, H, d), (B, H, Lq, Lk)
    return out.transpose(1, 2), weights


# attention classes that compute attention themselves ("source module.class name"): attnkit's forward for them
_OWN_FORWARDS: dict[str, Callable] = {
    "modeling_deberta_v2.DisentangledSelfAttention": deberta_attention,
    "modeling_deberta.DisentangledSelfAttention": deberta_attention,
    "modeling_mpnet.MPNetSelfAttention": mpnet_attention,
    "modeling_roformer.RoFormerSelfAttention": bert_style_attention,
    "modeling_megatron_bert.MegatronBertSelfAttention": bert_style_attention,
    "modeling_rembert.RemBertSelfAttention": bert_style_attention,
    "modeling_gpt_neo.GPTNeoSelfAttention": gpt_neo_attn,
}
# the method each replaces (forward unless named here)
_METHODS = {gpt_neo_attn: "_attn"}


def own_forward(module: nn.Module) -> Optional[Callable]:
    """attnkit's forward for an attention module that does not dispatch through ``AttentionInterface``
    (DeBERTa's, DeBERTa-v2's, MPNet's, RoFormer's, MegatronBERT's, RemBERT's, GPT-Neo's ``_attn``), or
    ``None``."""
    cls = type(module)
    return _OWN_FORWARDS.get(f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}")


def own_method(module: nn.Module) -> str:
    """The name of the method attnkit's function replaces in ``module`` (``forward`` but for GPT-Neo)."""
    return _METHODS.get(own_forward(module), "forward")


def own_forward_problem(module: nn.Module) -> Optional[str]:
    """Why attnkit's forward cannot stand in for this module's, or ``None``."""
    if own_forward(module) is bert_style_attention and getattr(module, "is_decoder", False):
        return "it is a decoder's self-attention (is_decoder=True), which attnkit converts only for encoders"
    if own_forward(module) is deberta_attention and getattr(module, "head_logits_proj", None) is not None:
        return (
            "its talking-head attention mixes the heads' scores before the softmax and their weights after "
            "it, which attnkit does not implement"
        )
    return None


def takes_position_bias(module: nn.Module) -> bool:
    """Whether an attention module with attnkit's own forward adds position terms to its scores."""
    forward = own_forward(module)
    if forward is deberta_attention:
        return bool(getattr(module, "relative_attention", False))
    return forward is mpnet_attention


__all__ = [
    "bert_style_attention", "deberta_attention", "gpt_neo_attn", "mpnet_attention", "own_forward",
    "own_forward_problem", "own_method", "takes_position_bias",
]
