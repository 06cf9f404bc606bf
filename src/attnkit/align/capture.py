r"""Find the self-attention layers of a model and capture their per-head queries and keys during the forward
pass.

Hooks only read: the forward computes exactly what it computes without them (outputs are bit-identical).
Three families of layers ("sites"):

- **attnkit / torch multi-head attention** (``attnkit.nn.MultiheadAttention``,
  ``torch.nn.MultiheadAttention``, hence attnkit's and torch's Transformer layers, any mechanism): a forward
  pre-hook reads ``query``, ``key`` and ``key_padding_mask`` of self-attention calls (``query is key``) and
  projects them with the module's own ``W_Q, b_Q, W_K, b_K`` (the projection is computed a second time,
  outside the module).
  Cross-attention calls and modules named ``multihead_attn`` (decoder cross-attention) are not captured.
- **Hugging Face encoders** (BERT, RoBERTa, ALBERT, DistilBERT, MiniLM, ... converted by ``attnkit.hf`` or
  not): forward hooks on the query and key ``nn.Linear`` of each self-attention module (``query``/``key``,
  ``q_lin``/``k_lin`` or ``q_proj``/``k_proj``); the padding comes from the ``attention_mask`` passed to the
  model. ALBERT shares one attention module across its layers: each call is captured.
- **PyTorch Geometric ``GATConv``**: GAT's logit is
  :math:`e_{ij} = a_{dst}^\top W x_i + a_{src}^\top W x_j` for an edge from source ``j`` to destination
  ``i``; per head we take the query of node ``i`` as :math:`q_i = a_{dst} \odot W x_i` and the key of node
  ``j`` as :math:`k_j = a_{src} \odot W x_j`
  (``(C,)`` vectors whose coordinate sums are the two halves of the logit, so aligning them aligns the
  destination and source roles of the nodes; the projected features ``W x`` alone are shared by both
  roles). The whole graph is one sample: ``q (1, H, N_dst, C)``, ``k (1, H, N_src, C)``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..masks import MASKED_BIAS

__all__ = ["Captured", "ForwardState", "Site", "find_sites"]

_HF_PAIRS = (("query", "key"), ("q_lin", "k_lin"), ("q_proj", "k_proj"))


@dataclass
class Captured:
    """Queries and keys of one attention call: ``q (B, H, Lq, d)``, ``k (B, H, Lk, d)``, masks True = real."""

    q: Tensor
    k: Tensor
    q_mask: Tensor
    k_mask: Tensor


Record = Callable[[Captured], None]


class Site:
    """One self-attention layer of a model: its name, heads and head dim, and how to hook it."""

    kind = "site"

    def __init__(self, name: str, module: nn.Module, num_heads: int, head_dim: int) -> None:
        self.name, self.module, self.num_heads, self.head_dim = name, module, num_heads, head_dim

    def attach(self, record: Record, context: ForwardState) -> list:  # returns hook handles
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, heads={self.num_heads}, head_dim={self.head_dim})"


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
            if query is not key:
                return None
            record(self._project(query, bound.arguments.get("key_padding_mask")))
            return None

        return [self.module.register_forward_pre_hook(hook, with_kwargs=True)]

    def _project(self, x: Tensor, key_padding_mask: Optional[Tensor]) -> Captured:
        m = self.module
        if x.is_nested:  # torch's TransformerEncoder in eval mode packs a padded batch (B, L_b, E)
            lengths = torch.tensor([t.shape[0] for t in x.unbind()], device=x.device)  # (B,)
            x = torch.nested.to_padded_tensor(x, 0.0)  # (B, L, E)
            key_padding_mask = torch.arange(x.shape[1], device=x.device)[None, :] >= lengths[:, None]
        elif x.dim() == 2:  # unbatched (L, E)
            x = x.unsqueeze(0)
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.reshape(1, -1)
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
        if key_padding_mask is None:
            valid = torch.ones(B, L, dtype=torch.bool, device=x.device)
        elif key_padding_mask.dtype == torch.bool:
            valid = ~key_padding_mask  # torch: True = ignore
        else:
            valid = key_padding_mask > MASKED_BIAS  # additive float mask: -inf (or <= -1e4) = ignore
        return Captured(q, k, valid, valid)


# -- Hugging Face encoders -----------------------------------------------------------------------------------


class HFSite(Site):
    kind = "hf"

    def __init__(self, name: str, module: nn.Module, num_heads: int, head_dim: int, q_lin, k_lin) -> None:
        super().__init__(name, module, num_heads, head_dim)
        self.q_lin, self.k_lin = q_lin, k_lin

    def attach(self, record: Record, context: ForwardState) -> list:
        pending: dict[str, Tensor] = {}

        def split(out: Tensor) -> Tensor:
            B, L, _ = out.shape
            return out.view(B, L, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, L, d)

        def make(role: str):
            own = self.q_lin if role == "q" else self.k_lin

            def hook(module, args, out):
                if module is not own:  # a copy of the model (copy.deepcopy keeps the hooks)
                    return
                pending[role] = out
                if "q" in pending and "k" in pending:
                    q, k = split(pending.pop("q")), split(pending.pop("k"))
                    B, _, Lq, _ = q.shape
                    Lk = k.shape[2]
                    mask = context.attention_mask
                    record(Captured(q, k, _hf_valid(mask, B, Lq, q.device), _hf_valid(mask, B, Lk, q.device)))

            return hook

        return [self.q_lin.register_forward_hook(make("q")), self.k_lin.register_forward_hook(make("k"))]


def _hf_valid(mask: Optional[Tensor], B: int, L: int, device) -> Tensor:
    if mask is None:
        return torch.ones(B, L, dtype=torch.bool, device=device)
    if mask.dim() != 2 or tuple(mask.shape) != (B, L):
        raise ValueError(
            f"attention_mask has shape {tuple(mask.shape)}, expected (B, L) = ({B}, {L}) for the alignment "
            "regularizer; pass a 2-D padding mask (1 = real token)"
        )
    return mask.to(device) > 0


def _hf_heads(module: nn.Module, config) -> int:
    for attr in ("num_attention_heads", "num_heads", "n_heads"):
        value = getattr(module, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    for attr in ("num_attention_heads", "n_heads"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(
        f"cannot tell the number of heads of {type(module).__name__}; it has no num_attention_heads"
    )


def _hf_sites(model) -> list[Site]:
    from ..hf import attention_modules

    sites = []
    for name, module in attention_modules(model):
        children = dict(module.named_children())
        pair = next(
            ((children[a], children[b]) for a, b in _HF_PAIRS if a in children and b in children), None
        )
        if pair is None or not all(isinstance(p, nn.Linear) for p in pair):
            raise ValueError(
                f"{type(module).__name__} at {name!r} has no query/key nn.Linear "
                f"({', '.join('/'.join(p) for p in _HF_PAIRS)}); the alignment regularizer cannot capture it"
            )
        H = _hf_heads(module, model.config)
        q_lin, k_lin = pair
        if q_lin.out_features != k_lin.out_features or q_lin.out_features % H:
            raise ValueError(
                f"{name!r}: query width {q_lin.out_features} and key width {k_lin.out_features} "
                "must be equal and "

                f"divisible by the {H} heads (grouped-query attention is not supported)"
            )
        sites.append(HFSite(name, module, H, q_lin.out_features // H, q_lin, k_lin))
    return sites


# -- PyTorch Geometric GATConv ----------------------------------------------------------------------------


class GATSite(Site):
    kind = "gat"

    def attach(self, record: Record, context: ForwardState) -> list:
        conv = self.module
        outputs: list[tuple[str, Tensor]] = []
        H, C = self.num_heads, self.head_dim

        def collect(role: str):
            def hook(module, args, out):
                if module in (conv.lin, getattr(conv, "lin_src", None), getattr(conv, "lin_dst", None)):
                    outputs.append((role, out))

            return hook

        def start(module, args):
            if module is conv:
                outputs.clear()

        def finish(module, args, out):
            if module is not conv or not outputs:
                return
            if conv.lin is not None:
                x_src = outputs[0][1]
                x_dst = outputs[1][1] if len(outputs) > 1 else x_src
            else:
                roles = dict(outputs)
                x_src, x_dst = roles["src"], roles.get("dst", roles["src"])
            outputs.clear()
            q = (x_dst.view(-1, H, C) * conv.att_dst).transpose(0, 1).unsqueeze(0)  # (1, H, N_dst, C)
            k = (x_src.view(-1, H, C) * conv.att_src).transpose(0, 1).unsqueeze(0)  # (1, H, N_src, C)
            ones = lambda n: torch.ones(1, n, dtype=torch.bool, device=q.device)  # noqa: E731
            record(Captured(q, k, ones(q.shape[2]), ones(k.shape[2])))

        handles = [conv.register_forward_pre_hook(start), conv.register_forward_hook(finish)]
        if conv.lin is not None:
            handles.append(conv.lin.register_forward_hook(collect("lin")))
        else:
            handles.append(conv.lin_src.register_forward_hook(collect("src")))
            handles.append(conv.lin_dst.register_forward_hook(collect("dst")))
        return handles


def _gat_class():
    try:
        from torch_geometric.nn import GATConv
    except ImportError:
        return None
    return GATConv


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
        return _hf_sites(model), True
    from ..nn import MultiheadAttention

    gat = _gat_class()
    sites: list[Site] = []
    for name, module in model.named_modules():
        if isinstance(module, (MultiheadAttention, nn.MultiheadAttention)):
            if name.rsplit(".", 1)[-1] == "multihead_attn":  # decoder cross-attention
                continue
            sites.append(MultiheadSite(name, module, module.num_heads, module.head_dim))
        elif gat is not None and isinstance(module, gat):
            sites.append(GATSite(name, module, module.heads, module.out_channels))
    return sites, False


class ForwardState:
    """Whether the model the regularizer is attached to is running its forward pass, and how.

    Captures count only inside that forward: a submodule called on its own would pile its calls onto the last
    forward's (and, for Hugging Face models, miss the ``attention_mask`` given to the model), and gradient
    checkpointing recomputes the layers during ``backward()``, which would capture every layer a second time.
    ``grad_enabled`` is the autograd mode at the start of the forward: a layer that runs with gradients off
    inside a forward that started with them on (reentrant gradient checkpointing) gives queries and keys that
    no loss can train.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.grad_enabled = False
        self.attention_mask: Optional[Tensor] = None

    @property
    def active(self) -> bool:
        return self.depth > 0


def start_hook(model, is_hf: bool, state: ForwardState, reset: Callable[[], None]):
    """A pre-hook on the model: a new capture (and the HF ``attention_mask``) at each forward. Register it
    before the sites' hooks."""
    signature = inspect.signature(model.forward) if is_hf else None

    def start(module, args, kwargs):
        if module is not model:  # a copy of the model (copy.deepcopy keeps the hooks) is not captured
            return None
        state.depth += 1
        if state.depth > 1:  # the model's forward calling itself: one capture
            return None
        reset()
        state.grad_enabled = torch.is_grad_enabled()
        if signature is not None:
            try:
                bound = signature.bind_partial(*args, **kwargs)
                state.attention_mask = bound.arguments.get("attention_mask")
            except TypeError:
                state.attention_mask = kwargs.get("attention_mask")
        return None

    return model.register_forward_pre_hook(start, with_kwargs=True)


def end_hook(model, state: ForwardState):
    """A hook at the end of the model's forward (also when it raises). Register it after the sites' hooks:
    when the model is itself a site (one GATConv), its capture comes from a forward hook."""

    def end(module, args, kwargs, output):
        if module is not model:
            return None
        state.depth = max(state.depth - 1, 0)
        if not state.active:
            state.attention_mask = None
        return None

    return model.register_forward_hook(end, with_kwargs=True, always_call=True)
