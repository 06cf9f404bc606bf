"""Models: the comparison runner's Transformer classifier and encoder-decoder (MLU), and the lecture's
recurrent encoder-decoder, CTC, Show-Attend-Tell, RAM, DRAW and memory networks.

The Transformer models take an attention mechanism per block (``"softmax"``, ``"dnas"``, ``"hnas"``,
``"sinkhorn"``, ``"coda"`` or a config object); decoders take ``"softmax"`` or ``"coda"`` (query-normalized
mechanisms would leak future positions there).
"""

from .classifier import POOLINGS, TransformerClassifier
from .ctc import CTCModel
from .draw import DRAW
from .draw_classifier import DRAWClassifier
from .memn2n import MemN2N
from .ram import RecurrentAttentionModel
from .rnn_seq2seq import RNNSeq2Seq
from .seq2seq import Seq2SeqTransformer
from .show_attend_tell import ShowAttendTell

__all__ = [
    "TransformerClassifier",
    "Seq2SeqTransformer",
    "POOLINGS",
    "RNNSeq2Seq",
    "CTCModel",
    "ShowAttendTell",
    "RecurrentAttentionModel",
    "MemN2N",
    "DRAW",
    "DRAWClassifier",
]
