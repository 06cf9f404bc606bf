"""Convert a loaded transformers model to an attnkit mechanism, in place (docs/design.md sections 2 and 7).

HNAS (hybrid) attention mixes ``pi^H = u * pi^D + (1 - u) * pi^L`` with one ``u = sigmoid(theta)`` per layer
and
head ("Doubly-Normalized Attention" sec. 6, "Attention that does not Explain Away" (arXiv:2009.14308) sec. 5);
``theta (H,)`` becomes a parameter of each converted attention module,
so optimizers and ``save_pretrained`` see it. The conversion is recorded in ``model.config.attnkit``, and the
config names the ``"attnkit"`` attention implementation, so ``attnkit.hf.load(path)`` (or ``from_pretrained``
after ``attnkit.hf.register()``) rebuilds the same model.

Which modules convert: the self-attention modules that dispatch through transformers' ``AttentionInterface``
(BERT, RoBERTa, ALBERT, DistilBERT, Llama-style decoders, T5, ...), and those of DeBERTa, DeBERTa-v2, MPNet,
RoFormer, MegatronBERT, RemBERT and GPT-Neo, which compute attention themselves and get attnkit's code instead
(``hf/own_attention.py``; the model keeps its attention implementation). Cross-attention is never converted;
in encoder-decoder models only the encoder self-attention is. dnas/hnas/sinkhorn normalize over queries and so
leak future tokens under a causal mask: converting causal self-attention to them raises a ``ValueError``.
After the conversion every attention module of the model runs through attnkit (the unconverted ones as
softmax), so ``convert`` first checks that each one computes softmax attention: T5's relative position bias is
taken (an additive score bias; CoDA refuses it), while features attnkit does not implement (attention sinks,
logit soft-capping, or an attention function whose output differs from softmax on random inputs) raise a
``ValueError``.
"""

from __future__ import annotations

import copy
import functools
import inspect
import operator
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from typing import Optional, Union

import torch
from torch import Tensor, nn

from ..config import CoDA, Hybrid, MechanismConfig, MechanismLike
from ..mechanisms import whole_theta
from ..registry import causal_problem, config_label, initial_theta, resolve_mechanism, resolve_options
from .attention_interface import (
    _BACKEND_ATTR,
    _MECHANISM_ATTR,
    _SELF_ATTR,
    _THETA_ATTR,
    IMPLEMENTATION,
    UNSUPPORTED_FEATURES,
    _coda_prescale_problem,
    _query_prescale,
    coda_prescale,
    attention_forward,
    attention_mask,
    forward_source,
    prescales_query,
)
from .own_attention import own_forward, own_forward_problem, own_method, takes_position_bias

__all__ = [
    "convert",
    "load",
    "hybrid_weights",
    "attention_modules",
    "converted_modules",
    "conversion",
    "set_backend",
    "restore_conversion",
    "register",
    "is_registered",
]

CONFIG_KEY = "attnkit"
_CROSS_NAMES = ("crossattention", "cross_attention", "cross_attn", "encoder_attn")
# Encoders whose attention modules dispatch through AttentionInterface but carry no ``is_causal`` (the mark
# attnkit reads to tell causal self-attention): each builds its own bidirectional padding mask.
_ENCODERS_WITHOUT_IS_CAUSAL = ("modeling_layoutlm", "modeling_markuplm", "modeling_splinter")


def _dispatches_attention(module: nn.Module) -> bool:
    """Whether the module's ``forward`` calls an ``AttentionInterface`` function (read from its source
    once)."""
    return "ALL_ATTENTION_FUNCTIONS" in forward_source(type(module))


def _is_cross_attention(name: str, module: nn.Module) -> bool:
    last = name.rsplit(".", 1)[-1].lower()
    return "cross" in type(module).__name__.lower() or last in _CROSS_NAMES or bool(
        getattr(module, "is_cross_attention", False)
    )


def _eager_difference(module: nn.Module) -> Optional[tuple[float, float]]:
    """``(difference, tolerance)``: how far the model's own ``eager_attention_forward`` is from attnkit's
    softmax on random q, k, v (the max absolute difference of the outputs) and what rounding allows, or
    ``None`` when the function cannot be called alone.

    Attention functions that read more than q, k, v and the mask (GPT-OSS's sinks, a parameter of the module)
    would otherwise be replaced by plain softmax without a word. The inputs are float32; where the function
    needs the module's own dtype (its parameters enter), they are in that dtype and the tolerance is a few
    of its rounding steps."""
    eager = getattr(inspect.getmodule(type(module)), "eager_attention_forward", None)
    if not callable(eager):
        return None
    like = next(module.parameters(), None)
    device = like.device if like is not None else None
    if device is not None and device.type == "meta":
        return None  # nothing to compute with until the weights are loaded
    own = like.dtype if like is not None and like.dtype.is_floating_point else torch.float32
    try:
        H = _num_heads(module, getattr(module, "config", None))
    except (AttributeError, TypeError, ValueError):
        return None
    groups = getattr(module, "num_key_value_groups", 1)
    groups = groups if isinstance(groups, int) and groups >= 1 and H % groups == 0 else 1
    scaling = getattr(module, "scaling", None)
    scaling = float(scaling) if isinstance(scaling, (int, float)) else 8**-0.5
    for dtype in dict.fromkeys((torch.float32, own)):
        g = torch.Generator(device="cpu").manual_seed(0)
        q = torch.randn(1, H, 5, 8, generator=g).to(device=device, dtype=dtype)  # (1, H, L, D)
        k, v = (torch.randn(1, H // groups, 5, 8, generator=g).to(device=device, dtype=dtype) for _ in "kv")
        try:
            with torch.no_grad():
                theirs = eager(module, q, k, v, None, scaling=scaling, dropout=0.0)[0].float()  # (1, L, H, D)
                ours = attention_forward(module, q, k, v, None, scaling=scaling, is_causal=False)[0].float()
            size = max(1.0, float(theirs.abs().max()))
            difference = float((theirs - ours).abs().max())
        except Exception:  # noqa: BLE001 - a model-specific function that needs more: try the next dtype
            continue
        return difference, 1e-4 if dtype == torch.float32 else 8 * torch.finfo(dtype).eps * size
    return None


def _unsupported_feature(module: nn.Module, config) -> Optional[tuple[str, str]]:
    """``(keyword, feature)`` of ``UNSUPPORTED_FEATURES`` that the module's ``forward`` passes to its
    attention function (soft-capping only when the config sets it), or ``None``."""
    source = forward_source(type(module))
    own = getattr(module, "config", config)
    for keyword, feature in UNSUPPORTED_FEATURES.items():
        if not re.search(rf"\b{keyword}\s*=", source):
            continue
        if keyword == "softcap" and getattr(own, "attn_logit_softcapping", 0) is None:
            continue
        return keyword, feature
    return None


def _takes_position_bias(module: nn.Module) -> bool:
    """Whether the model's attention function takes an additive ``position_bias`` (T5's relative
    positions)."""
    if own_forward(module) is not None:
        return takes_position_bias(module)
    eager = getattr(inspect.getmodule(type(module)), "eager_attention_forward", None)
    try:
        return callable(eager) and "position_bias" in inspect.signature(eager).parameters
    except (TypeError, ValueError):
        return False


def _mask_reading_attention(model) -> Optional[str]:
    """The name of an attention module that computes attention itself (not through ``AttentionInterface``)
    from the model's ``attention_mask``, or ``None``. After the conversion the model's masks are attnkit's (a
    key padding mask, boolean masks), which such a module would add to its scores as if they were its own."""
    dispatching = {id(m) for _, m in model.base_model.named_modules() if _dispatches_attention(m)}
    for name, module in model.base_model.named_modules():
        if "attention" not in type(module).__name__.lower() or id(module) in dispatching:
            continue
        if any(id(m) in dispatching for m in module.modules()):
            continue  # a wrapper of a dispatching module
        if not any(isinstance(m, nn.Linear) for m in module.children()):
            continue
        try:
            takes_mask = "attention_mask" in inspect.signature(module.forward).parameters
        except (TypeError, ValueError):
            takes_mask = False
        if takes_mask:
            return f"{type(module).__name__} ({name})"
    return None


def _check_plain_softmax(model) -> None:
    """Every attention module class of ``model`` (converted or not: all of them run through attnkit after the
    conversion) must compute softmax attention as attnkit's softmax does."""
    seen: set[type] = set()
    for name, module in model.base_model.named_modules():
        if type(module) in seen or not _dispatches_attention(module):
            continue
        seen.add(type(module))
        where = f"{type(module).__name__} ({name})"
        feature = _unsupported_feature(module, model.config)
        if feature is not None:
            raise ValueError(
                f"{where} passes {feature[0]}= to its attention function: {feature[1]}, which attnkit does "
                "not implement, so attnkit cannot replace its attention; use the model as it is"
            )
        probe = _eager_difference(module)
        if probe is not None and not probe[0] <= probe[1]:
            diff = probe[0]
            raise ValueError(
                f"{where} does not compute plain softmax attention: its own attention function differs "
                f"from attnkit's softmax by {diff:.3g} on the same q, k, v (e.g. attention sinks or a "
                "learned score term), so attnkit cannot replace it; use the model as it is"
            )


def _check_model(model) -> None:
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        hint = ""
        if callable(getattr(model, "get_base_model", None)):  # PEFT's PeftModel
            hint = ("; for a model with adapters pass model.get_base_model() (converting before adding them "
                    "leaves HNAS's attnkit_theta frozen by PEFT)")
        raise ValueError(
            "expected a transformers PreTrainedModel (e.g. AutoModel.from_pretrained(...)), got "
            f"{type(model).__name__}{hint}"
        )


def attention_modules(model) -> list[tuple[str, nn.Module]]:
    """The convertible self-attention modules of ``model``, in layer order, named relative to
    ``model.base_model``.

    For encoder-decoder models only the encoder's self-attention modules are listed.
    """
    _check_model(model)
    prefix = encoder_prefix(model)
    found = []
    for name, module in model.base_model.named_modules():
        if not name.startswith(prefix) or _is_cross_attention(name, module):
            continue
        marked = hasattr(module, "is_causal") or type(module).__module__.rsplit(".", 1)[-1] in (
            _ENCODERS_WITHOUT_IS_CAUSAL
        )
        dispatching = marked and _dispatches_attention(module)
        if dispatching or own_forward(module) is not None:
            found.append((name, module))
    return found


_CAUSAL_CALL = re.compile(r"\bis_causal\s*=\s*True\b")


@functools.lru_cache(maxsize=None)
def _forward_passes_causal(cls: type) -> bool:
    """Whether ``cls.forward`` calls a submodule with ``is_causal=True`` (CLIP's text transformer calls its
    encoder so: its attention modules say ``is_causal = False`` and are causal per call)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return bool(_CAUSAL_CALL.search(source))


def _causal(model, name: str, module: nn.Module) -> bool:
    """Whether the self-attention module ``name`` (of ``model.base_model``) runs causal: its own
    ``is_causal``, its ``is_decoder`` (a decoder's self-attention; BigBirdPegasus's keeps ``is_causal=False``
    and is causal through its mask), or a module above it that passes ``is_causal=True`` down."""
    if getattr(module, "is_causal", False) or getattr(module, "is_decoder", False) is True:
        return True
    parts = name.split(".")
    base = model.base_model
    above = [base] + [base.get_submodule(".".join(parts[:i])) for i in range(1, len(parts))]
    return any(_forward_passes_causal(type(m)) for m in above)


def encoder_prefix(model) -> str:
    """``""``, or for an encoder-decoder model the name of its encoder relative to ``model.base_model``
    followed by a dot."""
    if not getattr(model.config, "is_encoder_decoder", False):
        return ""
    encoder = model.get_encoder()
    names = [n for n, m in model.base_model.named_modules() if m is encoder]
    if not names:
        raise ValueError(
            f"{type(model).__name__} is encoder-decoder but its encoder was not found in the model"
        )
    return names[0] + "." if names[0] else ""


def _num_heads(module: nn.Module, config) -> int:
    for attr in ("num_attention_heads", "num_heads", "n_heads"):
        value = getattr(module, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    own = getattr(module, "config", config)
    value = getattr(own, "num_attention_heads", None)
    if not isinstance(value, int) or value < 1:
        raise ValueError(
            f"cannot find the number of heads of {type(module).__name__} (no num_attention_heads, num_heads "
            "or n_heads on it or its config), so attnkit cannot convert it"
        )
    return value


def _apply(module: nn.Module, config: MechanismConfig, H: int) -> None:
    """Attach the mechanism (and for hnas the ``theta (H,)`` parameter initialised to ``logit(u0)``); a module
    that computes attention itself (DeBERTa-v2's) gets attnkit's forward."""
    setattr(module, _MECHANISM_ATTR, config)
    setattr(module, _SELF_ATTR, True)
    forward = own_forward(module)
    if forward is not None:  # a partial, not a bound method: it pickles and deep-copies
        setattr(module, own_method(module), functools.partial(forward, module))
    if isinstance(config, CoDA):
        coda_prescale(module)  # read once here, not under torch.compile
    if isinstance(config, Hybrid):
        like = next(module.parameters(), None)
        theta = torch.full(
            (H,), initial_theta(config),
            dtype=torch.float32,
            device=like.device if like is not None else None,
        )
        module.register_parameter(_THETA_ATTR, nn.Parameter(theta))
        # to_empty() leaves theta as whatever memory held (the meta-device build of FSDP2 and large models:
        # build on meta, convert, to_empty, load the stock weights, which hold no theta); as ak.nn's modules,
        # the module then sets theta to logit(u0). A partial, not a bound method: it pickles and deep-copies.
        module._apply = functools.partial(_apply_setting_theta, module)


def _apply_setting_theta(module: nn.Module, fn, recurse: bool = True):
    """``nn.Module._apply`` of a converted hnas module: after ``to_empty()`` theta is ``logit(u0)``."""
    from ..nn.module_utils import _from_to_empty

    result = type(module)._apply(module, fn, recurse)
    theta = getattr(module, _THETA_ATTR, None)
    config = getattr(module, _MECHANISM_ATTR, None)
    if theta is not None and isinstance(config, Hybrid) and _from_to_empty(fn) and not theta.is_meta:
        with torch.no_grad():
            theta.fill_(initial_theta(config))
    return result


def _choose_layers(layers, n: int, model_name: str) -> list[int]:
    """The sorted, distinct indices in ``[0, n)`` that ``layers`` names (Python-style negative indices)."""
    if layers is None:
        return list(range(n))
    expected = (
        f"expected None (all layers) or a non-empty list of distinct integer indices in [{-n}, {n - 1}] "
        f"({model_name} has {n} convertible attention layer(s); -1 is the last)"
    )
    if isinstance(layers, (str, bytes, Mapping)) or not isinstance(layers, Iterable):
        hint = ""
        if isinstance(layers, int) and not isinstance(layers, bool):
            hint = f"; for that one layer pass layers=[{layers}]"
        raise ValueError(f"layers={layers!r}: {expected}{hint}")
    values = list(layers)
    shown = values if iter(layers) is layers else layers  # an iterator is spent: show what it held
    if not values:
        raise ValueError(f"layers={shown!r}: {expected}")
    chosen: dict[int, object] = {}
    for value in values:
        try:
            if isinstance(value, bool) or getattr(value, "dtype", None) is torch.bool:
                raise TypeError
            i = operator.index(value)
        except TypeError:
            raise ValueError(f"layers={shown!r}: {value!r} is not an integer; {expected}") from None
        if not -n <= i < n:
            raise ValueError(f"layers={shown!r}: index {i} is out of range; {expected}")
        if i % n in chosen:
            first = chosen[i % n]
            raise ValueError(
                f"layers={shown!r}: layer {i % n} is named twice ({first!r} and {value!r}); {expected}"
            )
        chosen[i % n] = value
    return sorted(chosen)


def _enclosing_model(model):
    """The transformers model that holds ``model`` as a submodule (``clf.bert``, ``t5.get_encoder()``, an
    encoder-decoder's ``encoder``), or ``None``: found through the garbage collector's referrers (a module
    knows its children, not its parent)."""
    import gc

    from transformers import PreTrainedModel

    gc.collect()  # a parent dropped but not yet freed (a reference cycle) holds nothing any more
    for children in gc.get_referrers(model):  # a parent's _modules
        if not isinstance(children, dict):
            continue
        for attributes in gc.get_referrers(children):  # that parent's __dict__, then the parent
            if not (isinstance(attributes, dict) and attributes.get("_modules") is children):
                continue
            for owner in gc.get_referrers(attributes):
                if owner is not model and isinstance(owner, PreTrainedModel) and vars(owner) is attributes:
                    return owner
    return None


def _own_config(model) -> None:
    """Give ``model`` (and every submodule that holds its config or a sub-config) copies of its config.

    transformers models built from one config object share it (``AutoModel.from_config(cfg)`` twice, a model
    and one built from ``model.config``); a conversion written into a shared config would switch the other
    model to the attnkit implementation and claim a conversion it does not have.
    """
    from transformers import PretrainedConfig, PreTrainedModel

    memo: dict[int, object] = {}
    new = copy.deepcopy(model.config, memo)  # memo: id(original) -> copy, for the config and its sub-configs
    orphans: dict[int, object] = {}  # the copies of configs reachable from nowhere (one copy per object)
    # A model built from parts (EncoderDecoderModel(encoder=..., decoder=...), VisionEncoderDecoderModel)
    # points each part's .config at a sub-config of its own, while the part's layers keep the config object
    # the part was built with: reachable from nowhere, so a conversion never reached them (their attention
    # kept running sdpa on attnkit's masks). Such a layer takes its part's sub-config when the two say the
    # same; a config a part made on purpose (T5's encoder and decoder stacks, with is_decoder set) is kept.
    parts = {
        name: module.config for name, module in model.named_modules() if isinstance(module, PreTrainedModel)
    }
    for name, module in model.named_modules():
        owner = next(
            (parts[p] for p in _ancestors(name) if p in parts and p != name), None
        )  # the config of the nearest enclosing model
        for attr, value in list(vars(module).items()):
            if not isinstance(value, PretrainedConfig):
                continue
            if id(value) in memo:
                setattr(module, attr, memo[id(value)])
            elif (
                not isinstance(module, PreTrainedModel)
                and owner is not None
                and id(owner) in memo
                and type(value) is type(owner)
                and value.to_dict() == owner.to_dict()
            ):
                setattr(module, attr, memo[id(owner)])
            else:  # any other config a part holds (the user's decoder config, one that differs) is copied:
                # the conversion writes into the configs of the modules it converts, never into the user's
                setattr(module, attr, copy.deepcopy(value, orphans))
    model.config = new


def _ancestors(name: str) -> list[str]:
    """Module names enclosing ``name``, nearest first, ending with the root ``""``."""
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _set_implementation(model) -> None:
    # ``attn_implementation`` in config.json is read back by the config constructor, so a saved model
    # asks for the attnkit implementation: a plain ``from_pretrained`` without ``register()`` fails loudly
    # instead of building the stock model. A model whose attention modules compute attention themselves
    # (DeBERTa-v2, GPT-Neo) records it too, but keeps running "eager" (its masks; its layers that were not
    # converted): attnkit's forward replaces theirs. Rebuilt from a saved config, it is set back to "eager".
    model.config.attn_implementation = IMPLEMENTATION
    if model._can_set_attn_implementation():
        model.set_attn_implementation(IMPLEMENTATION)
    elif model.config._attn_implementation == IMPLEMENTATION:
        model.config._attn_implementation = "eager"


def convert(
    model,
    mechanism: MechanismLike = "hnas",
    u0: Optional[float] = None,
    layers: Optional[Iterable[int]] = None,
    *,
    sinkhorn_iters: Optional[int] = None,
):
    r"""Convert ``model``'s self-attention to ``mechanism`` in place and return the model.

    .. math::
        \pi^H = u \, \pi^D + (1 - u) \, \pi^L, \qquad u = \sigma(\theta) \in (0, 1)^H \text{ per layer}

    Args:
        model: a loaded transformers model whose attention goes through ``AttentionInterface``, or a
            DeBERTa (v1, v2, v3), MPNet, RoFormer, MegatronBERT, RemBERT or GPT-Neo model.
        mechanism: a name in ``ak.MECHANISMS`` or a config object (``ak.Sinkhorn(iters=5)``,
        ``ak.CoDA(...)``).
        u0: initial hybrid weight for ``"hnas"`` (default 0.5); ``theta`` starts at ``logit(u0)``.
        layers: a list of distinct integer indices into ``attention_modules(model)`` to convert (default
            ``None``: all); the others keep softmax. Negative indices count from the end as in Python
            (``-1`` is the last convertible layer, ``[-2, -1]`` the last two); order does not matter.
            A bare int, a string, bools, floats, an empty list, an index out of ``[-n, n - 1]`` or a layer
            named twice (``[1, -1]`` with ``n = 2``) raise a ``ValueError``.
        sinkhorn_iters: iterations for ``"sinkhorn"`` (default 3).

    Adds one parameter ``attnkit_theta (H,)`` per converted layer for hnas and records the choice in
    ``model.config.attnkit``. Save with ``model.save_pretrained`` (safetensors).

    The model gets its own copy of its config before anything is written to it, so the config object it was
    built from, and every other model built from that object, keep their settings (their attention
    implementation included). Nothing changes when a ``ValueError`` is raised.

    Raises a ``ValueError`` for a model that does not dispatch attention through ``AttentionInterface``, a
    model converted already, a part of another transformers model (``clf.bert``: convert ``clf``, whose
    save_pretrained then records it), bad ``layers``, or dnas/hnas/sinkhorn on causal self-attention.
    """
    _check_model(model)
    register()
    config = resolve_options(mechanism, u0=u0, sinkhorn_iters=sinkhorn_iters, learnable_u=True)
    owner = _enclosing_model(model)
    if owner is not None:
        raise ValueError(
            f"{type(model).__name__} sits inside {type(owner).__name__}, whose config would not record the "
            f"conversion: its save_pretrained would load as softmax; convert the {type(owner).__name__} "
            "itself (layers= picks the layers; an encoder-decoder converts its encoder)"
        )
    if getattr(model.config, CONFIG_KEY, None):
        done = getattr(model.config, CONFIG_KEY)
        raise ValueError(
            f"{type(model).__name__} is already converted to {done.get('mechanism')!r}; load the original "
            "model to convert it to another mechanism"
        )
    modules = attention_modules(model)
    own_route = bool(modules) and all(own_forward(m) is not None for _, m in modules)
    if not own_route and not model._can_set_attn_implementation():
        raise ValueError(
            f"{type(model).__name__} does not dispatch attention through transformers' AttentionInterface, "
            "so attnkit cannot replace its attention; supported: BERT, RoBERTa, ALBERT, DistilBERT, "
            "DeBERTa, DeBERTa-v2/v3, MPNet, RoFormer, MegatronBERT, RemBERT, GPT-Neo, Llama-style models, T5"
        )
    if not modules:
        raise ValueError(f"{type(model).__name__} has no self-attention module that attnkit can convert")
    for name, module in modules if own_route else ():
        problem = own_forward_problem(module)
        if problem is not None:
            raise ValueError(
                f"{type(module).__name__} ({name}): {problem}, so attnkit cannot replace its attention; use "
                "the model as it is"
            )
    _check_plain_softmax(model)
    own = None if own_route else _mask_reading_attention(model)
    if own is not None:
        raise ValueError(
            f"{own} computes attention itself from the model's attention_mask, which attnkit's conversion "
            "replaces (boolean masks instead of additive ones), so its attention would change; this model "
            "mixes attention implementations and cannot be converted"
        )
    if isinstance(config, CoDA):
        biased = [name for name, module in modules if _takes_position_bias(module)]
        # BEiT and Swin add a learned relative position bias to their scores through attention_mask
        biased += [name for name, _ in model.named_parameters() if "relative_position_bias" in name]
        if biased:
            raise ValueError(
                f"{type(model).__name__} adds a position bias to its attention scores ({biased[0]}), which "
                "CoDA cannot take (its masks are multiplicative); convert it to softmax, dnas, hnas or "
                "sinkhorn"
            )
        prescaled = [(name, m) for name, m in modules
                     if prescales_query(m) and _query_prescale(m, 1.0) is None]
        if prescaled:
            raise ValueError(f"{prescaled[0][0]}: {_coda_prescale_problem(prescaled[0][1])}")
    chosen = _choose_layers(layers, len(modules), type(model).__name__)
    problem = causal_problem(config)
    if problem is not None:
        causal = [modules[i][0] for i in chosen if _causal(model, *modules[i])]
        if causal:
            # a model with bidirectional layers too (CLIP's vision tower beside its causal text tower) can
            # convert those alone
            bidirectional = [i for i in range(len(modules)) if not _causal(model, *modules[i])]
            alone = ""
            if bidirectional:
                alone = (
                    f" To convert only its {len(bidirectional)} bidirectional layer(s), pass "
                    f"layers={bidirectional} (--layers {','.join(map(str, bidirectional))})."
                )
            raise ValueError(
                f"cannot convert causal self-attention ({causal[0]}, {len(causal)} module(s)) to "
                f"{config_label(config)!r}: {problem}{alone}"
            )
    _own_config(model)
    for i in chosen:
        name, module = modules[i]
        _apply(module, config, _num_heads(module, model.config))
    setattr(model.config, CONFIG_KEY, {
        "mechanism": config.name,
        "options": asdict(config),
        "modules": [modules[i][0] for i in chosen],
    })
    _set_implementation(model)
    implementation = model.config._attn_implementation
    for i in chosen:  # a converted module whose config model.config does not reach (a part built on its own
        module = modules[i][1]  # config) asks for the implementation of the model, as the others do
        own_config = getattr(module, "config", None)
        if _dispatches_attention(module) and getattr(own_config, "_attn_implementation", None) is not None:
            own_config._attn_implementation = implementation
    return model


def unwrapped(model):
    """The model inside the wrappers training puts around it, in any order: ``torch.compile``'s
    ``OptimizedModule``, ``DistributedDataParallel`` / ``DataParallel`` (what ``accelerate`` prepares) and a
    PEFT model (``get_base_model()``); ``model`` itself when it is none of them."""
    for _ in range(8):
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            inner = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            inner = model._orig_mod
        elif type(model).__module__.partition(".")[0] == "peft" and hasattr(model, "get_base_model"):
            inner = model.get_base_model()
        else:
            return model
        if inner is model:
            return model
        model = inner
    return model


def conversion(model) -> Optional[MechanismConfig]:
    """The mechanism config recorded in ``model.config`` (``None`` for a model that was not converted); a
    wrapped model (``torch.compile``, DDP, DataParallel, PEFT) is read through its wrappers."""
    record = getattr(getattr(unwrapped(model), "config", None), CONFIG_KEY, None)
    if not record:
        return None
    return resolve_mechanism(record["mechanism"], **record.get("options", {}))


class _ImplementationConflict(ValueError):
    """A load that asks for another attention implementation than a saved conversion's (its own message)."""


def restore_conversion(model) -> bool:
    """Re-apply the conversion recorded in ``model.config`` to a freshly built model; ``True`` if applied.

    Runs when a model is built after ``register()``, before its weights are loaded. A sub-model, whose
    modules are named from its own root (the encoder or decoder of an encoder-decoder), is left to its
    parent; a model that holds some recorded modules but not all (built with fewer layers) is a
    ``ValueError``.
    """
    config = conversion(model)
    if config is None:
        parts = [(n, m) for n, m in model.named_modules() if n and conversion(m) is not None]
        if parts:  # EncoderDecoderModel.from_encoder_decoder_pretrained(<a converted folder>, ...)
            name, part = parts[0]
            raise ValueError(
                f"{type(model).__name__} is built from a converted part ({name}: "
                f"{config_label(conversion(part))}), which its own config does not record: save_pretrained "
                "would write a folder that does not "
                f"load; build it from the unconverted model and convert the {type(model).__name__} itself"
            )
        return False
    names = getattr(model.config, CONFIG_KEY)["modules"]
    by_name = dict(model.base_model.named_modules())
    missing = [n for n in names if n not in by_name]
    beyond = [n for n in missing if _beyond_layers(n, by_name)]  # layer 2 of a model built with 1
    if not beyond and (len(missing) == len(names)
                       or any(hasattr(by_name[n], _MECHANISM_ATTR) for n in names if n in by_name)):
        return False  # a sub-model (its modules are named from its own root), or applied already
    if missing:  # built with other settings than it was saved with (num_hidden_layers=1): some layers would
        # run softmax under a record that names the mechanism for them all
        raise ValueError(
            f"config.json: the attnkit conversion record names {missing[0]!r}"
            f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}, which this "
            f"{type(model).__name__} does not have, converted to {config_label(config)}: it was built with "
            "other settings than it was saved with (num_hidden_layers=...?), or the record was edited; load "
            "it with the saved settings, or convert the unconverted model built as you need it"
        )
    requested = getattr(model.config, "_attn_implementation", None)
    if requested not in (None, IMPLEMENTATION) and model._can_set_attn_implementation():
        # from_pretrained(..., attn_implementation="sdpa"): it was overridden without a word, and the model
        # ran the mechanism while the caller believed it ran softmax through sdpa
        label = config_label(config)
        raise _ImplementationConflict(
            f"attn_implementation={requested!r} for a model saved converted to {label}: it would run softmax "
            f"attention while the model records {label}; leave attn_implementation out to run {label}, or "
            "load the unconverted model to use another implementation"
        )
    for n in names:
        _apply(by_name[n], config, _num_heads(by_name[n], model.config))
    _set_implementation(model)
    return True


def _beyond_layers(name: str, by_name: dict) -> bool:
    """Whether the module ``name`` (``encoder.layer.2.attention.self``) is missing because its layer index
    lies beyond the model's list of layers (``encoder.layer`` holds 1), not because the names start elsewhere
    (a sub-model's modules are named from its own root)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            layers = by_name.get(".".join(parts[:i]))
            return isinstance(layers, (nn.ModuleList, nn.Sequential)) and int(part) >= len(layers)
    return False


def converted_modules(model) -> list[nn.Module]:
    """The converted attention modules of ``model`` (read through its wrappers: ``torch.compile``, DDP,
    DataParallel, PEFT), in the recorded layer order."""
    model = unwrapped(model)
    record = getattr(getattr(model, "config", None), CONFIG_KEY, None)
    if not record:
        raise ValueError(f"{type(model).__name__} was not converted with attnkit.hf.convert; nothing to read")
    by_name = dict(model.base_model.named_modules())
    missing = [n for n in record["modules"] if n not in by_name]
    if missing:  # BartForCausalLM from a converted BART folder: the decoder alone, which was not converted
        raise ValueError(
            f"{type(model).__name__} does not hold the converted modules its config records ({missing[0]!r}"
            f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}): it is a part of the converted "
            "model that was not converted, and runs softmax; load the whole model to read them"
        )
    return [by_name[n] for n in record["modules"]]


def set_backend(model, backend: str) -> None:
    """The backend of every converted attention call of ``model``: ``"auto"`` (the default), ``"efficient"``
    or ``"reference"`` (materialized weights; needed for second derivatives, ``create_graph=True``).

    A setting of this process, not saved with the model.
    """
    from ..functional import BACKENDS

    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")
    for module in converted_modules(model):
        setattr(module, _BACKEND_ATTR, backend)


def hybrid_weights(model) -> Tensor:
    """The hybrid weights ``u = sigmoid(theta)`` of an hnas-converted model, shape ``(layers, H)``, detached.

    ``layers`` counts converted attention modules (ALBERT shares one module across its layers). Under
    FSDP2 (``fully_shard``) every process must call it: it gathers the heads each one holds.
    """
    config = conversion(model)
    if not isinstance(config, Hybrid):
        name = "none" if config is None else repr(config.name)
        raise ValueError(
            "hybrid_weights needs a model converted with mechanism='hnas', got mechanism "
            f"{name}"
        )
    thetas = [whole_theta(getattr(m, _THETA_ATTR)) for m in converted_modules(model)]  # FSDP2: all heads
    return torch.sigmoid(torch.stack(thetas).float())  # (layers, H)


def load(path: Union[str, os.PathLike], model_class=None, **kwargs):
    """Load a model saved after ``convert`` (or a stock one) with its attnkit conversion restored.

    ``model_class`` defaults to the saved architecture (``config.architectures[0]``), else ``AutoModel``;
    extra ``kwargs`` go to ``from_pretrained`` (e.g. ``num_labels``). Weights load from safetensors only.

    Raises a one-line ``FileNotFoundError`` (``path`` missing or a file, no ``config.json`` or no weights) or
    ``ValueError`` (a corrupt ``config.json`` or ``model.safetensors``, weights that disagree with
    config.json (a tensor of a module missing beside its loaded ones, a layer more or fewer than the weights
    hold: they would start random or be dropped; a head missing whole starts afresh, as in transformers;
    with ``model_class`` given, transformers' report alone says so, as new layers may be meant), or an
    attnkit conversion record
    that is missing, corrupt, or does not match the weights or the model) naming the file and the fix
    (``hf.checks``).
    """
    import transformers

    from .checks import auto_config, check_model_dir, damaged_keys, from_pretrained

    path = os.fspath(path)
    check_model_dir(path)
    register()
    saved_class = model_class is None
    if saved_class:
        config = auto_config(path)
        arch = (getattr(config, "architectures", None) or [None])[0]
        model_class = getattr(transformers, arch, None) if isinstance(arch, str) else None
        model_class = model_class or transformers.AutoModel
    report = bool(kwargs.pop("output_loading_info", False))
    if not saved_class:
        # another class (e.g. a classifier on a base model): new layers may be meant, and transformers
        # reports them
        return from_pretrained(model_class, path, caller_options=True, output_loading_info=report, **kwargs)
    model, info = from_pretrained(model_class, path, caller_options=True, output_loading_info=True, **kwargs)
    resized = {str(m[0] if isinstance(m, (tuple, list)) else m) for m in info.get("mismatched_keys") or ()}
    damaged = [k for k in damaged_keys(model, info) if k not in resized]  # ignore_mismatched_sizes: asked for
    if damaged:  # a module or layer half in the weights: it would start random, silently
        shown = ", ".join(damaged[:3]) + (f" and {len(damaged) - 3} more" if len(damaged) > 3 else "")
        raise ValueError(
            f"the weights in {path} do not match the {model_class.__name__} of "
            f"{os.path.join(path, 'config.json')} ({shown}: missing or left over, as with a tensor deleted "
            "or a layer count edited); restore the matching pair of files from the original model, or pass "
            f"model_class=transformers.{model_class.__name__} to start the missing tensors afresh"
        )
    return (model, info) if report else model


_REGISTERED = False


def is_registered() -> bool:
    """Whether ``register()`` has run in this process."""
    return _REGISTERED


def _register_own_classes() -> None:
    """Models that pick their attention class by implementation name when built (GPT-Neo) get the eager
    class under attnkit's name, so that a saved conversion (config: ``attn_implementation="attnkit"``)
    builds; ``restore_conversion`` then replaces its attention computation."""
    from transformers.models.gpt_neo import modeling_gpt_neo

    classes = modeling_gpt_neo.GPT_NEO_ATTENTION_CLASSES
    classes.setdefault(IMPLEMENTATION, modeling_gpt_neo.GPTNeoSelfAttention)


def register() -> None:
    """Register attnkit with transformers (idempotent).

    After it, ``attn_implementation="attnkit"`` is valid in ``from_pretrained`` / ``set_attn_implementation``,
    and a model saved after ``attnkit.hf.convert`` is restored by a plain ``from_pretrained``: its config
    names
    the ``"attnkit"`` implementation and carries the conversion, which is re-applied when the model is built,
    before its weights (the hnas ``theta`` included) are loaded.
    """
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, attention_mask)
    _register_own_classes()

    original_post_init = PreTrainedModel.post_init

    def post_init(self) -> None:
        original_post_init(self)
        restore_conversion(self)

    post_init.__wrapped__ = original_post_init  # type: ignore[attr-defined]
    PreTrainedModel.post_init = post_init

    original_set = PreTrainedModel.set_attn_implementation

    @functools.wraps(original_set)
    def set_attn_implementation(self, attn_implementation, *args, **kwargs):
        _check_implementation_change(self, attn_implementation)
        return original_set(self, attn_implementation, *args, **kwargs)

    PreTrainedModel.set_attn_implementation = set_attn_implementation
    _REGISTERED = True


def _check_implementation_change(model, requested) -> None:
    """A converted model keeps the attnkit implementation: another one would run softmax attention while
    ``conversion(model)`` and ``config.attnkit`` still name the mechanism."""
    record = conversion(model)
    if record is None:
        return
    names = requested.values() if isinstance(requested, dict) else [requested]
    other = [name for name in names if name not in (None, IMPLEMENTATION)]
    if other:
        label = config_label(record)
        raise ValueError(
            f"set_attn_implementation({requested!r}) on a model converted to {label}: it would run softmax "
            f"attention through {other[0]!r} while the model still records {label}; load the unconverted "
            "model again to use another implementation"
        )
