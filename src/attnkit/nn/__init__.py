"""Attention modules: a drop-in ``MultiheadAttention``, Transformer layers, multi-view fusion.

The modules hold parameters; the math goes through ``attnkit.functional.attention``.
"""

from .additive import AdditiveAttention
from .bilinear import BilinearAttention
from .dot import DotAttention
from .additive import AdditiveAttention
from .bilinear import BilinearAttention
from .dot import DotAttention
from .hybrid import hybrid_weights
from .location import GMMLocationAttention
from .mixed import MixedAttention
from .location import GMMLocationAttention
from .mixed import MixedAttention
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
    "AdditiveAttention",
    "BilinearAttention",
    "DotAttention",
    "GMMLocationAttention",
    "MixedAttention",
]
