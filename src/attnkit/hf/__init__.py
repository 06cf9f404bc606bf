"""Hugging Face transformers integration (extra ``[hf]``).

    import attnkit.hf
    model = AutoModel.from_pretrained(path)
    attnkit.hf.convert(model, mechanism="hnas", u0=0.5)   # in place; adds theta (H,) per layer
    model.save_pretrained(out)                           # safetensors; the config records the conversion
    model = attnkit.hf.load(out)                         # the same model back
    attnkit.hf.hybrid_weights(model)                     # (layers, H) u values

``register()`` adds attnkit to transformers' ``AttentionInterface`` and ``AttentionMaskInterface`` under the
name ``"attnkit"``; ``convert`` and ``load`` call it.
"""

from .attention_interface import IMPLEMENTATION, attention_forward, attention_mask
from .convert import (
    attention_modules,
    conversion,
    convert,
    converted_modules,
    hybrid_weights,
    is_registered,
    load,
    register,
    set_backend,
)

__all__ = [
    "IMPLEMENTATION",
    "register",
    "is_registered",
    "convert",
    "load",
    "hybrid_weights",
    "attention_modules",
    "converted_modules",
    "conversion",
    "set_backend",
    "attention_forward",
    "attention_mask",
]
