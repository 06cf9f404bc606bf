"""Tiny fixtures for the runner tests: dataset files written on the fly, and a small configuration."""

from __future__ import annotations

import json
import random
from pathlib import Path


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


def tiny_overrides(path: Path, out: Path, **extra) -> dict:
    values = dict(task=str(path), mechanisms="softmax,hnas", seeds=1, steps=12, batch_size=8, eval_every=4,
                  checkpoint_every=4, d_model=16, nhead=2, num_layers=1, dim_feedforward=32, max_len=16,
                  explain_away_samples=16, lr=1e-2, warmup_steps=1, out=str(out), progress="none")
    values.update(extra)
    return values


def write_seq2seq_jsonl(path: Path, n_train: int = 64, n_test: int = 16, seed: int = 0) -> Path:
    """Reverse a short digit string (a .jsonl dataset file: a kind line, then one example per line)."""
    rng = random.Random(seed)
    lines = [json.dumps({"kind": "seq2seq"})]
    for split, n in (("train", n_train), ("test", n_test)):
        for _ in range(n):
            s = "".join(rng.choices("0123456789", k=rng.randrange(2, 6)))
            lines.append(json.dumps({"split": split, "source": s, "target": s[::-1]}))
    path.write_text("\n".join(lines) + "\n")
    return path
