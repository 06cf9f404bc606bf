"""Checkpoints of a compare run: a new one replaces the one before it, and the data fingerprint that a resume
checks covers the class names as well as the tensors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from attnkit.runner import build_config, get_task, run_compare
from attnkit.runner.checkpoints import data_fingerprint
from tests.runner._fixtures import Killed, kill_at, tiny_overrides, write_classification_file


def test_a_new_checkpoint_replaces_the_superseded_one(tmp_path):
    """Superseded checkpoints (each a full model and optimizer state) were kept: a run stopped at step 5 with
    checkpoint_every=2 left ['step-0000002', 'step-0000004'] instead of ['step-0000004']."""
    data = write_classification_file(tmp_path / "topics.json", n_train=32, n_test=8)
    config = build_config(tiny_overrides(data, tmp_path / "out", mechanisms="softmax", seeds=1, steps=6,
                                         checkpoint_every=2, eval_every=3))
    with pytest.raises(Killed):
        run_compare(config, on_step=kill_at(5))
    checkpoints = tmp_path / "out" / "runs" / "softmax-seed0" / "checkpoints"
    folders = sorted(p.name for p in checkpoints.glob("step-*"))
    assert folders == ["step-0000004"]


def _renamed_labels(doc):
    """The same dataset with every class name prefixed by "x" (same order, so the same label ids)."""
    def label(example):
        return {**example, "label": "x" + example["label"]}

    return {**doc, "label_names": ["x" + n for n in doc["label_names"]],
            "train": [label(e) for e in doc["train"]], "test": [label(e) for e in doc["test"]]}


def test_data_fingerprint_covers_the_class_names(tmp_path):
    """Lists of strings were left out of the fingerprint: two datasets that differ only in their class names
    (identical tensors) had the same fingerprint, so a resume accepted a checkpoint trained on the other."""
    a = write_classification_file(tmp_path / "a.json", n_train=16, n_test=8)
    b = tmp_path / "b.json"
    b.write_text(json.dumps(_renamed_labels(json.loads(a.read_text()))))
    prepared = []
    for path in (a, b):
        config = build_config(tiny_overrides(path, tmp_path / ("out-" + path.stem)))
        prepared.append(get_task(str(path)).prepare(config))
    tensors = [[x for x in (getattr(d, f.name) for f in dataclasses.fields(d)) if isinstance(x, torch.Tensor)]
               for d in prepared]
    assert tensors[0] and all(torch.equal(x, y) for x, y in zip(*tensors))  # only the names differ
    assert data_fingerprint(prepared[0]) != data_fingerprint(prepared[1])
