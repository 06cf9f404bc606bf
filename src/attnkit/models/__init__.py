"""Small models for the comparison runner: a Transformer text classifier and an encoder-decoder (MLU).

Both take an attention mechanism per block (``"softmax"``, ``"dnas"``, ``"hnas"``, ``"sinkhorn"``,
``"coda"`` or a config object); decoders take ``"softmax"`` or ``"coda"`` (query-normalized mechanisms
would leak future positions there).
"""

from .classifier import POOLINGS, TransformerClassifier
from .ctc import CTCModel
from .rnn_seq2seq import RNNSeq2Seq
from .seq2seq import Seq2SeqTransformer

__all__ = ["TransformerClassifier", "Seq2SeqTransformer", "POOLINGS", "RNNSeq2Seq", "CTCModel"]
