"""Tiny fixtures for the runner tests: a dataset file and a stand-in classifier until attnkit.models lands."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from torch import nn

from attnkit.nn import MultiheadAttention
from attnkit.runner.tasks import ClassificationTask

WORDS = {
    "sport": ["goal", "match", "team", "score", "league", "coach"],
    "money": ["bank", "stock", "price", "market", "profit", "trade"],
    "<b>&tag": ["alpha", "beta", "gamma", "delta", "omega", "sigma"],
}


def write_classification_file(path: Path, n_train: int = 96, n_test: int = 32, seed: int = 0) -> Path:
    """Three separable topics (one label name holds HTML characters, to check escaping)."""
    rng = random.Random(seed)
    names = list(WORDS)
    filler = ["the", "a", "of", "and", "to", "in"]

    def example() -> dict:
        label = rng.randrange(len(names))
        words = rng.choices(WORDS[names[label]], k=3) + rng.choices(filler, k=rng.randrange(2, 6))
        rng.shuffle(words)
        return {"text": " ".join(words), "label": names[label]}

    data = {"kind": "classification", "label_names": names,
            "train": [example() for _ in range(n_train)], "test": [example() for _ in range(n_test)]}
    data["test"][0]["text"] = "<script>alert('x')</script> goal team"
    path.write_text(json.dumps(data))
    return path


class TinyClassifier(nn.Module):
    """Embedding + one attnkit attention layer + masked mean pooling + linear."""

    def __init__(self, vocab_size: int, num_classes: int, d_model: int, nhead: int, mechanism: str, pad_id: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        self.attn = MultiheadAttention(d_model, nhead, mechanism=mechanism, batch_first=True)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, ids, mask):
        x = self.embed(ids)  # (B, L, d)
        y, _ = self.attn(x, x, x, key_padding_mask=~mask, need_weights=False, query_padding_mask=~mask)
        x = self.drop(x + y) * mask[..., None]
        return self.head(x.sum(1) / mask.sum(1, keepdim=True).clamp_min(1))  # (B, C)


class TinyTask(ClassificationTask):
    def build_model(self, config, mechanism, data):
        return TinyClassifier(data.vocab_size, len(data.label_names), config.d_model, config.nhead, mechanism, data.pad_id)


def tiny_overrides(path: Path, out: Path, **extra) -> dict:
    values = dict(task=str(path), mechanisms="softmax,hnas", seeds=1, steps=12, batch_size=8, eval_every=4,
                  checkpoint_every=4, d_model=16, nhead=2, num_layers=1, dim_feedforward=32, max_len=16,
                  explain_away_samples=16, lr=1e-2, warmup_steps=1, out=str(out), progress="none")
    values.update(extra)
    return values
