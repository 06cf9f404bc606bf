"""Fixtures of the Hugging Face tests: a tiny BERT saved once per module, a dataset folder for finetune."""

from __future__ import annotations

import pytest

from tests.hf._fixtures import save_tiny_bert, write_tsv_dataset


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A tiny BERT with its tokenizer, saved with ``save_pretrained`` (``tests/hf/_fixtures.py``)."""
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A finetune dataset folder of three topics (``train.tsv``, ``test.tsv``)."""
    return write_tsv_dataset(tmp_path_factory.mktemp("data"))
