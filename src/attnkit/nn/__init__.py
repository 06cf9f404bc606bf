"""Attention modules: a drop-in ``MultiheadAttention``, Transformer layers, multi-view fusion.

The modules hold parameters; the math goes through ``attnkit.functional.attention``.
"""

from .draw import DRAWRead
from .hard import HardAttention
from .hybrid import hybrid_weights
from .multihead import MultiheadAttention
from .multiview import MultiViewAttention
from .layers import TransformerDecoderLayer, TransformerEncoderLayer
from .positional import LearnedPositionalEncoding, SinusoidalPositionalEncoding
from .transformer import Transformer, TransformerDecoder, TransformerEncoder

__all__ = [
    "MultiheadAttention",
    "TransformerEncoderLayer",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerDecoder",
    "Transformer",
    "SinusoidalPositionalEncoding",
    "LearnedPositionalEncoding",
    "MultiViewAttention",
    "hybrid_weights",
    "HardAttention",
    "DRAWRead",
]
