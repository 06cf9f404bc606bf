"""Small models for the comparison runner: a Transformer text classifier and an encoder-decoder (MLU).

Both take an attention mechanism per block (``"softmax"``, ``"dnas"``, ``"hnas"``, ``"sinkhorn"``,
``"coda"`` or a config object); decoders take ``"softmax"`` or ``"coda"`` (query-normalized mechanisms
would leak future positions there).
"""

from .classifier import POOLINGS, TransformerClassifier
from .draw import DRAW
from .draw_classifier import DRAWClassifier
from .memn2n import MemN2N
from .ram import RecurrentAttentionModel
from .seq2seq import Seq2SeqTransformer
from .show_attend_tell import ShowAttendTell
from .draw import DRAW
from .draw_classifier import DRAWClassifier
from .memn2n import MemN2N
from .ram import RecurrentAttentionModel
from .show_attend_tell import ShowAttendTell

__all__ = ["TransformerClassifier", "Seq2SeqTransformer", "POOLINGS"]
__all__ += ["DRAW", "DRAWClassifier", "MemN2N", "RecurrentAttentionModel", "ShowAttendTell"]
__all__ += ["ShowAttendTell", "RecurrentAttentionModel", "MemN2N", "DRAW", "DRAWClassifier"]
