"""Tiny randomly initialised transformers models for the attnkit.hf tests (offline, seconds to build)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

H = 4  # attention heads of every tiny model
VOCAB = 120


def _configs():
    from transformers import (
        AlbertConfig,
        BartConfig,
        BertConfig,
        DistilBertConfig,
        Gemma2Config,
        Gemma3TextConfig,
        GptOssConfig,
        LlamaConfig,
        RobertaConfig,
        T5Config,
    )

    common = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=H, intermediate_size=64
    )
    gemma = dict(num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    return {
        "bert": lambda: BertConfig(**common),
        "roberta": lambda: RobertaConfig(**common, pad_token_id=1),
        "albert": lambda: AlbertConfig(**common, embedding_size=16),
        "distilbert": lambda: DistilBertConfig(
            vocab_size=VOCAB, dim=32, n_layers=2, n_heads=H, hidden_dim=64
        ),
        "llama": lambda: LlamaConfig(**common, num_key_value_heads=2, max_position_embeddings=64),
        "bart": lambda: BartConfig(
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=H,
            decoder_attention_heads=H,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=64,
        ),
        # attention beyond q, k, v and a mask: T5's relative position bias (taken), GPT-OSS's sinks and
        # Gemma 2's logit soft-capping (refused); Gemma 3 has no soft-capping
        "t5": lambda: T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=H, decoder_start_token_id=0
        ),
        "gpt_oss": lambda: GptOssConfig(
            **common, num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
            max_position_embeddings=64,
        ),
        "gemma2": lambda: Gemma2Config(**common, **gemma),
        "gemma3": lambda: Gemma3TextConfig(**common, **gemma),
    }


ENCODERS = ("bert", "roberta", "albert", "distilbert")
FAMILIES = ENCODERS + ("llama",)


def tiny_config(family: str):
    """A fresh config object of the tiny ``family`` model."""
    return _configs()[family]()


def tiny_model(family: str, seed: int = 0, attn_implementation: str = "eager"):
    """A fresh tiny base model of ``family`` in eval mode (its own config object)."""
    from transformers import AutoModel

    torch.manual_seed(seed)
    config = tiny_config(family)
    return AutoModel.from_config(config, attn_implementation=attn_implementation).eval()


def twin(model):
    """A second model with the same weights and its own config (configs are shared objects in
    transformers)."""
    import copy

    return copy.deepcopy(model)


def padded_batch(lengths=(7, 4, 5), seed: int = 1):
    """``input_ids (B, L)`` with ids >= 3 and a right-padded ``attention_mask (B, L)`` (1 = real)."""
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), L), generator=g)
    mask = torch.zeros(len(lengths), L, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
        ids[b, n:] = 0
    return ids, mask


def hidden(model, ids, mask=None):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).last_hidden_state
