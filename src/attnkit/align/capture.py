r"""Find the self-attention layers of a model and capture their per-head queries and keys during the forward
pass.

Hooks only read: the forward computes exactly what it computes without them (outputs are bit-identical).
Three families of layers ("sites"):

- **attnkit / torch multi-head attention** (``attnkit.nn.MultiheadAttention``,
  ``torch.nn.MultiheadAttention``, hence attnkit's and torch's Transformer layers, any mechanism): a forward
  pre-hook reads ``query``, ``key``, ``key_padding_mask`` and attnkit's ``query_padding_mask`` (the queries'
  own padding; the key padding serves them without it) of self-attention calls (``query`` and ``key``
  one tensor or views of the same elements) and projects them with the module's own ``W_Q, b_Q, W_K, b_K``
  (the projection is computed a second time, outside the module).
  Cross-attention calls and modules named ``multihead_attn`` (decoder cross-attention) are not captured.
- **Hugging Face models** (``attnkit.align.hf_sites``): the query and key projections of each self-attention
  module, with the padding of the model's ``attention_mask``.
- **PyTorch Geometric ``GATConv`` and ``TransformerConv``** (``attnkit.align.graph_sites``): per-node queries
  and keys, one sample per graph of the model's ``batch`` vector.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..masks import MASKED_BIAS
from ..nn.module_utils import same_tensor
from ._sites import Captured, ForwardState, Record, Site, _PositionsMismatch
from .graph_sites import GATSite, GraphTransformerSite, gat_class, graph_batch, graph_transformer_class
from .hf_sites import cross_attention_hooks, find_hf_sites, mask_owner_hooks, other_part, packed_segments

__all__ = ["Captured", "ForwardState", "Site", "find_sites", "mask_owner_hooks", "cross_attention_hooks"]


# -- attnkit / torch multi-head attention ------------------------------------------------------------------


class MultiheadSite(Site):
    kind = "multihead"

    def attach(self, record: Record, context: ForwardState) -> list:
        signature = inspect.signature(self.module.forward)

        def hook(module, args, kwargs):
            if module is not self.module:  # a copy of the model (copy.deepcopy keeps the hooks)
                return None
            bound = signature.bind(*args, **kwargs)
            query, key = bound.arguments["query"], bound.arguments["key"]
            if not same_tensor(query, key):
                return None
            arguments = bound.arguments
            # attnkit's module takes the queries' own padding (query_padding_mask); torch's has none
            masks = (arguments.get("key_padding_mask"), arguments.get("query_padding_mask"))
            record(self._project(query, *masks))
            return None

        return [self.module.register_forward_pre_hook(hook, with_kwargs=True)]

    def _project(
        self, x: Tensor, key_padding_mask: Optional[Tensor], query_padding_mask: Optional[Tensor] = None
    ) -> Captured:
        m = self.module
        if x.is_nested:  # torch's TransformerEncoder in eval mode packs a padded batch (B, L_b, E)
            lengths = torch.tensor([t.shape[0] for t in x.unbind()], device=x.device)  # (B,)
            x = torch.nested.to_padded_tensor(x, 0.0)  # (B, L, E)
            key_padding_mask = torch.arange(x.shape[1], device=x.device)[None, :] >= lengths[:, None]
        elif x.dim() == 2:  # unbatched (L, E)
            x = x.unsqueeze(0)
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.reshape(1, -1)
            query_padding_mask = None if query_padding_mask is None else query_padding_mask.reshape(1, -1)
        elif not m.batch_first:  # (L, B, E) -> (B, L, E)
            x = x.transpose(0, 1)
        B, L, _ = x.shape
        H, D = self.num_heads, self.head_dim
        if getattr(m, "in_proj_weight", None) is not None:
            w_q, w_k, _ = m.in_proj_weight.chunk(3)
        else:
            w_q, w_k = m.q_proj_weight, m.k_proj_weight
        b_q = b_k = None
        if getattr(m, "in_proj_bias", None) is not None:
            b_q, b_k, _ = m.in_proj_bias.chunk(3)
        q = F.linear(x, w_q, b_q).view(B, L, H, D).transpose(1, 2)  # (B, H, L, D)
        k = F.linear(x, w_k, b_k).view(B, L, H, D).transpose(1, 2)  # (B, H, L, D)
        valid_k = _real(key_padding_mask, B, L, x.device)  # (B, L)
        # the keys' padding serves the queries of a self-attention call unless the queries have their own
        valid_q = valid_k if query_padding_mask is None else _real(query_padding_mask, B, L, x.device)
        return Captured(q, k, valid_q, valid_k)


def _real(padding_mask: Optional[Tensor], B: int, L: int, device) -> Tensor:
    """``(B, L)`` True = real position, from a torch padding mask: boolean True = ignore, or additive float
    (-inf, or at most ``MASKED_BIAS``, = ignore); all real without one."""
    if padding_mask is None:
        return torch.ones(B, L, dtype=torch.bool, device=device)
    if padding_mask.dtype == torch.bool:
        return ~padding_mask.to(device)
    return padding_mask.to(device) > MASKED_BIAS


# -- discovery ----------------------------------------------------------------------------------------------


def _is_hf(model) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def find_sites(model: nn.Module) -> tuple[list[Site], bool]:
    """The self-attention layers of ``model`` in module order, and whether it is a Hugging Face model."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"expected a torch.nn.Module, got {type(model).__name__}")
    if _is_hf(model):
        return find_hf_sites(model), True
    from ..nn import MultiheadAttention

    gat, graph_transformer = gat_class(), graph_transformer_class()
    sites: list[Site] = []
    for name, module in model.named_modules():
        if isinstance(module, (MultiheadAttention, nn.MultiheadAttention)):
            if name.rsplit(".", 1)[-1] == "multihead_attn":  # decoder cross-attention
                continue
            sites.append(MultiheadSite(name, module, module.num_heads, module.head_dim))
        elif gat is not None and isinstance(module, gat):
            sites.append(GATSite(name, module, module.heads, module.out_channels))
        elif graph_transformer is not None and isinstance(module, graph_transformer):
            sites.append(GraphTransformerSite(name, module, module.heads, module.out_channels))
    return sites, False


def _cache_length(cache) -> int:
    """How many positions a Hugging Face key/value cache holds (0 for none or an empty one)."""
    if cache is None:
        return 0
    length = getattr(cache, "get_seq_length", None)
    if callable(length):
        return int(length())
    return 1 if isinstance(cache, (tuple, list)) and len(cache) > 0 else 0


def _mask_from_lengths(arguments: dict) -> Optional[Tensor]:
    """XLM's and FlauBERT's padding given as ``lengths (B,)`` (real tokens per sample, the first ones) instead
    of an ``attention_mask``: the ``(B, L)`` mask it stands for, 1 = real; None without one."""
    lengths = arguments.get("lengths")
    tokens = arguments.get("input_ids")
    tokens = arguments.get("inputs_embeds") if tokens is None else tokens
    if not isinstance(lengths, Tensor) or not isinstance(tokens, Tensor) or tokens.dim() < 2:
        return None
    if lengths.dim() != 1 or lengths.is_floating_point() or len(lengths) != tokens.shape[0]:
        return None
    positions = torch.arange(tokens.shape[1], device=lengths.device)  # (L,)
    return (positions[None, :] < lengths[:, None]).long()  # (B, L)


def start_hook(model, is_hf: bool, state: ForwardState, reset: Callable[[], None]):
    """A pre-hook on the model: a new capture (and the HF ``attention_mask``) at each forward. Register it
    before the sites' hooks."""
    try:
        signature: Optional[inspect.Signature] = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a forward without a signature (builtin or scripted)
        signature = None

    def start(module, args, kwargs):
        if getattr(module, "_is_replica", False):  # nn.DataParallel on 2+ GPUs: replicas
            raise ValueError(
                "AlignmentRegularizer cannot capture through nn.DataParallel's replicas (several GPUs in one "
                "process); use DistributedDataParallel, one process per GPU (accelerate launch or torchrun)"
            )
        if module is not model:  # a copy of the model (copy.deepcopy keeps the hooks) is not captured
            return None
        state.depth += 1
        if state.depth > 1:  # the model's forward calling itself: one capture
            return None
        reset()
        state.forwards += 1
        state.resampled, state.attended = None, False
        state.skipped.clear()
        state.mask_receivers.clear()
        state.tentative.clear()
        state.grad_enabled = torch.is_grad_enabled()
        state.training_forward = state.grad_enabled  # an evaluation runs under no_grad (a model in eval()
        # mode may be trained, dropout off)
        try:
            arguments = kwargs if signature is None else signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            arguments = kwargs
        if not is_hf:
            state.graph_batch = graph_batch(arguments)
        else:
            state.attention_mask = arguments.get("attention_mask")
            if state.attention_mask is None:
                state.attention_mask = _mask_from_lengths(arguments)
            caches = (arguments.get(name) for name in ("cache", "past_key_values", "past_key_value"))
            state.cached = _cache_length(next((c for c in caches if c is not None), None)) > 0
            packed = state.attention_mask is None and not state.cached  # as transformers decides it
            state.segments = packed_segments(arguments.get("position_ids")) if packed else None
        state.last_cached = state.cached
        return None

    return model.register_forward_pre_hook(start, with_kwargs=True)


def end_hook(model, state: ForwardState, drop: Optional[Callable[[list[Captured]], None]] = None):
    """A hook at the end of the model's forward (also when it raises). Register it after the sites' hooks:
    when the model is itself a site (one GATConv), its capture comes from a forward hook. ``drop`` takes back
    the captures of Hugging Face sites found, at the end, to be outside the part that received the mask."""

    def end(module, args, kwargs, output):
        if module is not model:
            return None
        state.depth = max(state.depth - 1, 0)
        if not state.active:
            state.attention_mask, state.cached, state.graph_batch, state.segments = None, False, None, None
            tentative, state.tentative = state.tentative, []
            if tentative and state.mask_receivers:  # the mask went to another part after these ran
                if drop is not None:
                    drop([c for _, c in tentative])
                for site, _ in tentative:
                    site.leave_out(state, other_part(site.name, state), _PositionsMismatch)
        return None

    return model.register_forward_hook(end, with_kwargs=True, always_call=True)
