r"""Hugging Face attention modules as capture sites (``attnkit.align.capture.find_sites`` finds them).

Hugging Face models (BERT, RoBERTa, ALBERT, DistilBERT, MiniLM, DeBERTa-v2, ModernBERT, T5's and BART's
encoders, Llama, Qwen, Mistral, Phi-3, GPT-2, GPT-NeoX, ... converted by ``attnkit.hf`` or not): forward
hooks on the query and key projections of each self-attention module, separate linear layers (``nn.Linear``
or a wrapper that has ``out_features``, such as PEFT's LoRA layers) named ``query``/``key``,
``q_lin``/``k_lin``, ``q_proj``/``k_proj``, ``query_proj``/``key_proj``, ``q``/``k`` or ``Wq``/``Wk``, or a
fused one whose layout is known (``c_attn`` of GPT-2, GPT-BigCode, OpenAI GPT and ImageGPT,
``query_key_value`` of GPT-NeoX(-Japanese), Persimmon, BLOOM and Falcon, ``qkv_proj`` of Phi-3 and
Phi-4-multimodal, ``Wqkv`` of ModernBERT and MPT, DeBERTa's ``in_proj``). These are the
projections themselves: rotary embeddings, q/k norms and a scaling of q, where a model applies them
afterwards, are not in the capture (MPT's clamp of the fused output to ``clip_qkv`` and DeBERTa's
``q_bias`` are). With grouped-query
attention each query head is paired with its group's key head. The modules are
those that call an attention function (``attnkit.hf.attention_modules``) and those with such projections
that compute attention themselves (MegatronBERT, RoFormer, MPNet, ...; not FSMT, Longformer and LED, which
work on time-first states); for an encoder-decoder model the encoder's alone. A call whose query and key
projections read different inputs (cross-attention) is skipped, and so is a step of cached decoding
(``generate``), whose earlier keys are in the cache. The padding comes from the ``attention_mask`` passed to
the model (XLM's ``lengths=`` without one; a multiple-choice ``(N, C, L)`` one as its ``(N C, L)`` rows); a
layer whose positions are not the mask's, or that lies outside the part of the model the mask is handed to
(CLIP's ``vision_model``, whatever its length), is left out with a warning (a ``ValueError`` when
``layers=`` names it). A layer that runs after a cross-attention that came before any self-attention (a
Perceiver's latents, whatever their number) runs on that cross-attention's query positions, which the mask
does not describe and which have no padding: all real (left out, as above, when the model hands the layer
a mask of its own). A packed batch (no ``attention_mask``, ``position_ids`` restarting within a row, as
transformers' ``find_packed_sequence_indices`` reads them) is split into its sequences, one sample each, in
a causal attention (the module's ``is_causal``), the only one whose mask transformers packs
(``create_causal_mask``); an encoder's row (BERT's bidirectional mask) is one sample, as the model runs it.
A query or key projection replaced after attaching (``peft.get_peft_model``) raises a ``ValueError`` at the
next forward. ALBERT shares one attention module across its layers: each call is captured.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
from torch import Tensor, nn

from ..masks import MASKED_BIAS
from ._sites import Captured, ForwardState, Record, Site, _PositionsMismatch

__all__ = [
    "HFSite", "cross_attention_hooks", "find_hf_sites", "mask_owner_hooks", "other_part", "packed_segments",
]


# Separate query and key projections: attribute names of two linear children of an attention module.
_HF_PAIRS = (
    ("query", "key"), ("q_lin", "k_lin"), ("q_proj", "k_proj"), ("query_proj", "key_proj"), ("q", "k"),
    ("Wq", "Wk"),
)
# Fused projections, by attention class (its name, or "source.name" for a generic one): the child layer whose
# output (B, L, W) holds q, k and v. Its layout, as the class's own forward splits it, is "sequential",
# [q (H d) | k (Hkv d) | v (Hkv d)], or "grouped", per key head [q (H / Hkv heads) | k | v] (with Hkv = H,
# per head [q_h | k_h | v_h]).
_HF_FUSED = {
    "GPT2Attention": "c_attn",  # c_attn(x).split(E)
    "GPTBigCodeAttention": "c_attn",  # multi-query: split((E, d, d)); else view(H, 3 d).split(d)
    "GPTNeoXAttention": "query_key_value",  # view(H, 3 d).chunk(3)
    "PersimmonAttention": "query_key_value",  # view(H, 3, d)
    "BloomAttention": "query_key_value",  # view(H, 3, d)
    "FalconAttention": "query_key_value",  # view(Hkv, H / Hkv + 2, d); multi-query view(H + 2, d)
    "Phi3Attention": "qkv_proj",  # [q | k | v] with num_key_value_heads
    "ModernBertAttention": "Wqkv",  # view(3, H, d).unbind
    "MptAttention": "Wqkv",  # chunk(3), clamped to clip_qkv
    "modeling_openai.Attention": "c_attn",  # split(E) (OpenAI GPT)
    "ImageGPTAttention": "c_attn",  # split(E)
    "GPTNeoXJapaneseAttention": "query_key_value",  # view(H, 3 d)
    "Phi4MultimodalAttention": "qkv_proj",  # as Phi-3
    "modeling_deberta.DisentangledSelfAttention": "in_proj",  # view(H, 3 d).chunk(3), q + q_bias (DeBERTa v1)
}
_HF_GROUPED = (
    "GPTNeoXAttention", "PersimmonAttention", "BloomAttention", "GPTNeoXJapaneseAttention",
    "DisentangledSelfAttention",
)


def _fused_layout(module: nn.Module) -> str:
    name = type(module).__name__
    if name == "GPTBigCodeAttention":
        return "sequential" if getattr(module, "multi_query", True) else "grouped"
    if name == "FalconAttention":  # the original multi-query layout puts the one key head after all queries
        old_multi_query = getattr(module, "multi_query", False) and not getattr(
            module, "new_decoder_architecture", False
        )
        return "sequential" if old_multi_query else "grouped"
    return "grouped" if name in _HF_GROUPED else "sequential"


# Modules that compute attention themselves on time-first (L, B, E) states: their projections cannot be read
# as (B, L, .), so the scan for attention that does not call an attention function skips them.
_TIME_FIRST_SOURCES = ("modeling_fsmt", "modeling_longformer", "modeling_led")
_HEAD_DIM_ATTRS = ("head_dim", "attention_head_size", "head_size", "key_value_proj_dim")


def _width(layer) -> Optional[int]:
    """Output width of a linear layer: ``nn.Linear``, transformers' ``Conv1D`` (GPT-2), or a layer that wraps
    one and says its ``out_features`` (PEFT's LoRA layers, quantized linears); else None."""
    if type(layer).__name__ == "Conv1D" and isinstance(getattr(layer, "nf", None), int):
        return layer.nf
    width = getattr(layer, "out_features", None)
    if isinstance(layer, nn.Module) and isinstance(width, int) and not isinstance(width, bool) and width > 0:
        return width
    return None


@dataclass(frozen=True)
class _Projections:
    """Where an attention module's queries and keys come from: ``q_layer`` and ``k_layer`` (one layer for
    fused projections) and the layout of their outputs (``pair``, ``sequential`` or ``grouped``)."""

    q_layer: nn.Module
    k_layer: nn.Module
    layout: str


def _projections(module: nn.Module) -> Optional[_Projections]:
    children = dict(module.named_children())
    for a, b in _HF_PAIRS:
        if a in children and b in children and all(_width(children[n]) is not None for n in (a, b)):
            return _Projections(children[a], children[b], "pair")
    cls = type(module)
    source = cls.__module__.rsplit(".", 1)[-1]
    child = _HF_FUSED.get(cls.__name__) or _HF_FUSED.get(f"{source}.{cls.__name__}")
    fused = children.get(child or "")
    if fused is None or _width(fused) is None:
        return None
    return _Projections(fused, fused, _fused_layout(module))


class HFSite(Site):
    """A Hugging Face attention module, captured from the outputs of its query and key projections (before
    rotary embeddings, q/k norms or a scaling of q, where the model has them). With grouped-query attention
    (``Hkv < H`` key heads) each query head is paired with the keys of its group, as the attention does."""

    kind = "hf"

    def __init__(
        self, name: str, module: nn.Module, num_heads: int, head_dim: int, kv_heads: int, proj: _Projections
    ) -> None:
        super().__init__(name, module, num_heads, head_dim)
        self.kv_heads, self.proj = kv_heads, proj
        # ids of the modules from the model down to this one (not the model itself): set by mask_owner_hooks
        self.ancestors: frozenset[int] = frozenset()
        # whether the model splits a packed row (position_ids restarting, no mask) into its sequences here:
        # transformers does it for causal attention only (create_causal_mask); set by _hf_site
        self.splits_packed = False

    def __repr__(self) -> str:
        kv = f", kv_heads={self.kv_heads}" if self.kv_heads != self.num_heads else ""
        return f"HFSite({self.name!r}, heads={self.num_heads}{kv}, head_dim={self.head_dim})"

    def attach(self, record: Record, context: ForwardState) -> list:
        H, Hkv, d = self.num_heads, self.kv_heads, self.head_dim
        proj = self.proj

        def emit(q: Tensor, k: Tensor) -> None:  # q (B, Lq, H, d), k (B, Lk, Hkv, d)
            B, Lq = q.shape[:2]
            Lk = k.shape[1]
            if context.cached:
                return  # a step of cached decoding (generate): the earlier keys are in the cache, not here
            mask = context.attention_mask
            q = q.transpose(1, 2)  # (B, H, Lq, d)
            k = k.transpose(1, 2)  # (B, Hkv, Lk, d)
            if Hkv != H:
                # (B, H, Lk, d): query head h reads key head h // (H / Hkv)
                k = k.repeat_interleave(H // Hkv, dim=1)
            segments = context.segments if self.splits_packed else None
            if context.resampled is not None:
                # after a cross-attention (a Perceiver's latents): on its query positions, which the model's
                # attention_mask does not describe and which have no padding: all real, unless the model
                # hands this layer a mask of its own
                if own_mask[0]:
                    why = (
                        f"the attention at {self.name!r} runs after the cross-attention at "
                        f"{context.resampled!r}, on its query positions, and the model passes it an "
                        "attention mask of its own, which the alignment regularizer does not read; pass "
                        "layers= without it"
                    )
                    self.leave_out(context, why, _PositionsMismatch)
                    return
                mask = segments = None
            try:
                valid_q, valid_k = (_hf_valid(mask, B, n, q.device, self.name) for n in (Lq, Lk))
            except _PositionsMismatch as exc:
                self.leave_out(context, str(exc), _PositionsMismatch)
                return
            captured = Captured(q, k, valid_q, valid_k)
            if segments is not None:  # a packed batch in a causal attention: one sample per sequence
                if Lq != Lk or segments.shape[-1] != Lq or segments.shape[0] not in (1, B):
                    why = (
                        f"the attention at {self.name!r} runs over (B, Lq, Lk) = ({B}, {Lq}, {Lk}) positions "
                        f"but the packed batch's position_ids are {tuple(segments.shape)}, so the alignment "
                        "regularizer cannot tell its sequences apart; pass layers= with the layers whose "
                        "positions are the position_ids'"
                    )
                    self.leave_out(context, why, _PositionsMismatch)
                    return
                captured = _split_packed(captured, segments.to(q.device).expand(B, Lq))
            if mask is not None and self.ancestors and not self.ancestors & context.mask_receivers.keys():
                # the mask was not handed down to this layer: when another part of the model takes it (a
                # text tower beside this vision tower), this layer's positions are not the mask's even where
                # their numbers match
                if context.mask_receivers:
                    self.leave_out(context, other_part(self.name, context), _PositionsMismatch)
                    return
                context.tentative.append((self, captured))  # decided at the end of the forward
            record(captured)

        try:
            signature: Optional[inspect.Signature] = inspect.signature(self.module.forward)
        except (TypeError, ValueError):  # a forward without a signature (builtin or scripted)
            signature = None
        own_mask = [False]  # whether this call was handed an attention_mask tensor

        def check(module, args, kwargs):
            # a projection replaced after attaching (peft.get_peft_model wraps query/key in LoRA layers) would
            # leave the hooks on the stale inner layer: its outputs are no longer the attention's queries
            if module is not self.module or not context.active:
                return None
            try:
                arguments = kwargs if signature is None else signature.bind_partial(*args, **kwargs).arguments
            except TypeError:
                arguments = kwargs
            own_mask[0] = isinstance(arguments.get("attention_mask"), Tensor)
            children = tuple(module.children())
            for role, layer in (("query", proj.q_layer), ("key", proj.k_layer)):
                if not any(child is layer for child in children):
                    raise ValueError(
                        f"the {role} projection {type(layer).__name__} of {self.name!r} is no longer a child "
                        f"of its {type(module).__name__}: it was replaced after the regularizer was attached "
                        "(as peft.get_peft_model does); attach the regularizer after wrapping the model"
                    )
            return None

        guard = self.module.register_forward_pre_hook(check, with_kwargs=True)

        if proj.layout != "pair":
            clip = getattr(self.module, "clip_qkv", None)  # MPT clamps the fused output before splitting it
            if not isinstance(clip, (int, float)) or isinstance(clip, bool) or not clip:
                clip = None
            site = self.module

            def fused(module, args, out):
                out = _tensor_output(out)
                if module is not proj.q_layer or out is None:  # a copy of the model (deepcopy keeps hooks)
                    return
                B, L, _ = out.shape
                if clip is not None:
                    out = out.clamp(min=-clip, max=clip)
                if proj.layout == "grouped":
                    qkv = out.view(B, L, Hkv, H // Hkv + 2, d)
                    q, k = qkv[..., :-2, :].reshape(B, L, H, d), qkv[..., -2, :]
                else:
                    q = out[..., : H * d].view(B, L, H, d)
                    k = out[..., H * d : (H + Hkv) * d].view(B, L, Hkv, d)
                q_bias = getattr(site, "q_bias", None)  # DeBERTa adds it to the queries after the split
                if isinstance(q_bias, Tensor) and q_bias.shape == (H * d,):
                    q = q + q_bias.view(H, d)
                emit(q, k)

            return [guard, proj.q_layer.register_forward_hook(fused)]

        pending: dict[str, tuple[Optional[Tensor], Tensor]] = {}

        def make(role: str):
            own = proj.q_layer if role == "q" else proj.k_layer

            def hook(module, args, out):
                out = _tensor_output(out)
                if module is not own or out is None:  # a copy of the model (copy.deepcopy keeps the hooks)
                    return
                pending[role] = (args[0] if args else None, out)
                if "q" in pending and "k" in pending:
                    (x_q, q), (x_k, k) = pending.pop("q"), pending.pop("k")
                    if x_q is not x_k:  # keys from another sequence (cross-attention): not this site's pairs
                        return
                    emit(q.view(*q.shape[:2], H, d), k.view(*k.shape[:2], Hkv, d))

            return hook

        q_hook, k_hook = make("q"), make("k")
        return [guard, proj.q_layer.register_forward_hook(q_hook), proj.k_layer.register_forward_hook(k_hook)]


def _tensor_output(out) -> Optional[Tensor]:
    """A projection's output tensor: I-BERT's quantized linears return ``(output, scaling_factor)``."""
    if isinstance(out, tuple) and out and isinstance(out[0], Tensor):
        out = out[0]
    return out if isinstance(out, Tensor) else None


def _hf_valid(mask: Optional[Tensor], B: int, L: int, device, site: str = "") -> Tensor:
    if mask is None:
        return torch.ones(B, L, dtype=torch.bool, device=device)
    additive = False
    if mask.dim() == 4 and mask.shape[1:3] == (1, 1):  # (B, 1, 1, L) extended mask -> (B, L)
        # transformers hands a 4-D mask to the attention as it is: a bool one keeps its True positions, any
        # other dtype is added to the scores (a float 0/1 one pads nothing: +1 and +0 are scores, not padding)
        additive = mask.dtype != torch.bool
        mask = mask[:, 0, 0]
    elif mask.dim() in (2, 3) and mask.dtype != torch.bool and bool((mask < 0).any()):
        # transformers reads a 2-D mask as 1 = real, 0 = padding (recent models: any nonzero is real; older
        # ones pad a negative entry too): an additive mask there is no padding the model applies as meant
        raise ValueError(
            f"attention_mask of shape {tuple(mask.shape)} has negative entries; a (B, L) attention_mask is 1 "
            "for real tokens and 0 for padding (transformers makes the additive form itself): pass the 0/1 "
            "mask, or an additive (B, 1, 1, L) one"
        )
    elif mask.dim() == 3 and mask.shape[:-1].numel() == B:
        # (N, C, L) 0/1 mask of a multiple-choice model, whose layers run N samples' C choices as N C rows
        mask = mask.reshape(B, mask.shape[-1])  # (B, L)
    if mask.dim() != 2:
        raise ValueError(
            f"attention_mask has shape {tuple(mask.shape)}; the alignment regularizer reads the padding from "
            f"a (B, L) mask (1 = real token), a (B, 1, 1, L) one (bool, or additive), or a 0/1 (N, C, L) one "
            f"whose N C = {B} rows (multiple choice): pass that to the model"
        )
    if mask.shape[0] == 1 and mask.shape[1] == L:  # one mask for every row, as transformers broadcasts it
        mask = mask.expand(B, L)
    if tuple(mask.shape) != (B, L):
        raise _PositionsMismatch(
            f"the attention at {site!r} runs over (B, L) = ({B}, {L}) positions but the model's "
            f"attention_mask is {tuple(mask.shape)}, so the alignment regularizer cannot tell its padding "
            "(a vision tower of a multimodal model, or a model that pads its input inside); pass layers= "
            "with the self-attention layers whose positions are the mask's"
        )
    return mask.to(device) > (MASKED_BIAS if additive else 0)


def packed_segments(position_ids) -> Optional[Tensor]:
    """The sequence index of each position of a packed (padding-free) batch, several sequences in a row told
    apart by ``position_ids`` that do not go up by 1 (transformers' ``find_packed_sequence_indices``, as
    ``DataCollatorWithFlattening`` makes them): ``(B, L)`` (or ``(1, L)``), 0, 0, 1, 1, 1, 2, ... in each row.
    None when no row restarts (or for another layout, such as 3-D multimodal rotary positions)."""
    if not isinstance(position_ids, Tensor) or position_ids.is_floating_point() or position_ids.dim() > 2:
        return None
    position_ids = position_ids.reshape(-1, position_ids.shape[-1])  # (B or 1, L)
    if position_ids.shape[-1] == 0:
        return None
    first = position_ids[:, :1] - 1  # the first position starts the first sequence
    segments = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)  # (B or 1, L)
    return segments if bool((segments[:, -1] > 0).any()) else None


def _split_packed(c: Captured, segments: Tensor) -> Captured:
    """``c`` of a packed batch, ``q (B, H, L, d)``, as one sample per sequence: ``q (S, H, max L_s, d)`` with
    ``S`` the number of sequences, padded (masks True = real); ``segments (B, L)`` numbers each row's
    sequences 0, 1, ... in order."""
    B, H, L, d = c.q.shape
    count = segments[:, -1] + 1  # (B,) sequences per row
    seq = (segments + (torch.cumsum(count, 0) - count)[:, None]).reshape(-1)  # (B L,) global index, sorted
    sizes = torch.bincount(seq)  # (S,) positions per sequence
    slot = torch.arange(B * L, device=seq.device) - (torch.cumsum(sizes, 0) - sizes)[seq]  # (B L,)
    S, Ls = len(sizes), int(sizes.max())

    def pack(x: Tensor) -> Tensor:  # (B, H, L, d) -> (S, H, Ls, d)
        rows = x.transpose(1, 2).reshape(B * L, H, d)  # (B L, H, d)
        return x.new_zeros(S, Ls, H, d).index_put((seq, slot), rows).transpose(1, 2)

    def real(m: Tensor) -> Tensor:  # (B, L) -> (S, Ls)
        return m.new_zeros(S, Ls).index_put((seq, slot), m.reshape(-1))

    return Captured(pack(c.q), pack(c.k), real(c.q_mask), real(c.k_mask))


def other_part(site: str, context: ForwardState) -> str:
    owner = min(context.mask_receivers.values(), key=len)
    return (
        f"the attention at {site!r} is outside {owner!r}, the part of the model that received the "
        "attention_mask (a vision tower of a multimodal model), so the alignment regularizer cannot tell its "
        "padding; pass layers= with the self-attention layers whose positions are the mask's"
    )


def mask_owner_hooks(model: nn.Module, sites: list[Site], state: ForwardState) -> list:
    """Pre-hooks on the modules between a Hugging Face ``model`` and its attention sites that note which
    of them receive the model's ``attention_mask`` itself (CLIP's ``text_model``, not its ``vision_model``): a
    site outside every receiver is left out once the mask has gone elsewhere. Returns the hook handles."""
    paths: dict[int, str] = {}
    for name, module in model.named_modules():
        paths.setdefault(id(module), name)
    watched: dict[int, tuple[str, nn.Module]] = {}
    for site in sites:
        if not isinstance(site, HFSite) or id(site.module) not in paths:
            continue
        parts = paths[id(site.module)].split(".")
        chain = [".".join(parts[: i + 1]) for i in range(len(parts))]  # "a", "a.b", ..., the site itself
        modules = [model.get_submodule(n) for n in chain]
        site.ancestors = frozenset(id(m) for m in modules)
        watched.update({id(m): (n, m) for n, m in zip(chain, modules)})

    def receiver(name: str, own: nn.Module):
        def hook(module, args, kwargs):
            mask = state.attention_mask
            if module is not own or mask is None or not state.active:
                return None
            if any(v is mask for v in args) or any(v is mask for v in kwargs.values()):
                state.mask_receivers.setdefault(id(module), name)
            return None

        return hook

    return [m.register_forward_pre_hook(receiver(n, m), with_kwargs=True) for n, m in watched.values()]


def _hf_site(name: str, module: nn.Module, proj: _Projections, config) -> HFSite:
    from ..hf.convert import _num_heads

    H = _num_heads(module, config)
    where = f"{type(module).__name__} at {name!r}"
    dims = {getattr(module, a) for a in _HEAD_DIM_ATTRS if isinstance(getattr(module, a, None), int)}
    width, k_width = _width(proj.q_layer), _width(proj.k_layer)
    if proj.layout == "pair":
        d = width // H if width % H == 0 else 0
        keys = k_width  # the key projection's width, Hkv d
    else:  # one fused layer of width W = (H + 2 Hkv) d: the head dim comes from the module
        if not dims and width % (3 * H) == 0:  # no head dim attribute (OpenAI GPT): as many keys as queries
            dims = {width // (3 * H)}
        d = next(iter(dims)) if len(dims) == 1 else 0
        rest = width - H * d  # the keys and values
        keys = rest // 2 if rest > 0 and rest % 2 == 0 else 0
    if d < 1 or dims - {d}:
        raise ValueError(
            f"{where}: cannot tell its head dim (projection width {width}, {H} heads, head dim attributes "
            f"{sorted(dims) or 'none'}); the alignment regularizer cannot split its queries into heads"
        )
    Hkv = keys // d if keys > 0 and keys % d == 0 else 0
    if Hkv < 1 or H % Hkv:
        raise ValueError(
            f"{where}: its keys (width {keys}) are not a whole number of heads of dim {d} that divides its "
            f"{H} query heads; the alignment regularizer cannot pair its queries and keys"
        )
    site = HFSite(name, module, H, d, Hkv, proj)
    # transformers reads packed position_ids in create_causal_mask alone (find_packed_sequence_indices), which
    # a model with config.is_causal False replaces with create_bidirectional_mask: an encoder's attention
    # (is_causal False: BERT, RoBERTa, ...) runs over the whole packed row
    causal = getattr(module, "is_causal", False) is True
    site.splits_packed = causal and getattr(config, "is_causal", True) is not False
    return site


def _is_cross(name: str, module: nn.Module) -> bool:
    """Whether the attention module at ``name`` is a cross-attention: by its class or attribute, or a name
    on its path (Perceiver's ``encoder.cross_attention.attention.self``)."""
    from ..hf.convert import _CROSS_NAMES, _is_cross_attention

    return _is_cross_attention(name, module) or any(p.lower() in _CROSS_NAMES for p in name.split("."))


def cross_attention_hooks(model: nn.Module, sites: list[Site], state: ForwardState) -> list:
    """Forward hooks on the query and key projections of the cross-attention modules inside a Hugging Face
    ``model`` (its encoder's, for an encoder-decoder one) that note, in ``state.resampled``, one that runs
    before any self-attention layer (of ``sites``, chosen or not) in a forward: a Perceiver's, which maps the
    inputs (the mask's positions) onto its latents, on whose positions (no padding) every layer after it
    runs. (A decoder's cross-attention runs after its first self-attention, on the mask's positions.) Returns
    the hook handles."""
    from ..hf.convert import encoder_prefix

    def attended(module, args, kwargs):
        if state.active:
            state.attended = True

    prefix = encoder_prefix(model)
    handles = [site.module.register_forward_pre_hook(attended, with_kwargs=True) for site in sites]
    for name, module in model.base_model.named_modules():
        proj = _projections(module)
        pair = proj is not None and proj.layout == "pair"
        if not (name.startswith(prefix) and pair and _is_cross(name, module)):
            continue
        inputs: dict[str, Tensor] = {}

        def hook(layer, args, out, role: str, own: nn.Module, inputs=inputs, name=name):
            if layer is not own or not state.active or not args:  # a copy of the model (deepcopy keeps hooks)
                return
            inputs[role] = args[0]
            if "q" in inputs and "k" in inputs:
                x_q, x_k = inputs.pop("q"), inputs.pop("k")
                if x_q is not x_k and state.resampled is None and not state.attended:  # two sequences
                    state.resampled = name

        for role, layer in (("q", proj.q_layer), ("k", proj.k_layer)):
            handles.append(layer.register_forward_hook(partial(hook, role=role, own=layer)))
    return handles


def find_hf_sites(model) -> list[Site]:
    """The self-attention modules of a Hugging Face model in module order: those that call an attention
    function (every one must have projections the regularizer reads), and those that compute attention
    themselves from separate or known fused query and key projections (BERT-like encoders such as
    MegatronBERT, RoFormer or MPNet). For encoder-decoder models, the encoder's alone."""
    from ..hf.convert import attention_modules, encoder_prefix

    dispatching = {id(m) for _, m in attention_modules(model)}
    prefix = encoder_prefix(model)
    sites: list[Site] = []
    taken: list[str] = []
    for name, module in model.base_model.named_modules():
        if not name.startswith(prefix) or any(name.startswith(t + ".") for t in taken):
            continue
        proj = _projections(module)
        if id(module) in dispatching:
            if proj is None:
                pairs = ", ".join("/".join(p) for p in _HF_PAIRS)
                raise ValueError(
                    f"{type(module).__name__} at {name!r} has no query/key nn.Linear ({pairs}) and no fused "
                    "projection the alignment regularizer knows; it cannot capture its queries and keys"
                )
        elif (
            proj is None
            or _is_cross(name, module)
            or type(module).__module__.rsplit(".", 1)[-1] in _TIME_FIRST_SOURCES
        ):
            continue
        sites.append(_hf_site(name, module, proj, model.config))
        taken.append(name)
    return sites
