"""Attention modules: a drop-in ``MultiheadAttention``, Transformer layers, multi-view fusion, and the
lecture's content, location, hard and DRAW attention.

The modules hold parameters; the math goes through ``attnkit.functional``.
"""

from .additive import AdditiveAttention
from .bilinear import BilinearAttention
from .dot import DotAttention
from .draw import DRAWRead
from .hard import HardAttention
from .hybrid import hybrid_weights
from .layers import TransformerDecoderLayer, TransformerEncoderLayer
from .location import GMMLocationAttention
from .mixed import MixedAttention
from .multihead import MultiheadAttention
from .multiview import MultiViewAttention
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
    "HardAttention",
    "DRAWRead",
]
