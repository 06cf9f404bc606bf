"""Tasks of ``attnkit compare``: a dataset, a model builder, a loss and metrics.

- ``reuters8`` (and the other text-classification datasets of ``attnkit.data``): a ``TransformerClassifier``
  over a word vocabulary; metrics accuracy and macro-F1.
- ``mlu`` (CoDA paper sec. 3.6, Table 6): a character-level ``Seq2SeqTransformer``; metric sequence accuracy
  (exact match of the greedy decoding). softmax and coda are used in encoder, decoder and cross attention
  (the CoDA Transformer); the query-normalized ones (dnas, hnas, sinkhorn) normalize over target positions
  in the decoder's self- and cross-attention, which would leak future tokens, so they replace the encoder's
  attention only and the decoder stays softmax (as in the papers).
- a dataset file of your own, ``--task my_data.json``::

      {"kind": "classification", "train": [{"text": "...", "label": "sports"}, ...], "test": [...]}
      {"kind": "seq2seq", "train": [{"source": "x=1,y=2,x+y", "target": "3"}, ...], "test": [...]}

  (optionally ``"label_names"``, at least 2 distinct names; labels are names or indices into it: a string
  label is a name, integer labels are indices unless some of them cannot be (``[1, 2, 3, 4, 5]`` with a
  label 5: they are names), and an integer label that would be one class as a name and another as an index
  (``[1, 0]``, or ``["1", "0"]`` with labels 0/1) is refused; without it the classes are the distinct
  labels, integers in numeric order, and a label that no training example has is refused, as a typo or a
  class the model cannot learn). A classification example may hold ``text_pair``, a second sentence (every
  example or none) and an ``id`` or ``idx``; any other key is refused. ``.jsonl`` files hold one
  ``{"split": "train"|"test", ...}`` object per line and a first line ``{"kind": ...}``. A seq2seq
  ``source`` and ``target`` are strings of at most ``max_len`` and ``max_target_len`` characters; a longer
  one is refused (it would be cut, and scored against the cut text), with the ``--set`` that fits it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import CompareConfig
from .dataset_file import file_task_kind, is_dataset_file_name
from .dataset_file import read_dataset_file as _read_file
from .sequence_batches import SourceTargetBatches, trim_padding

__all__ = [
    "ClassificationTask",
    "Seq2SeqTask",
    "EncodedClassification",
    "EncodedSeq2Seq",
    "get_task",
    "load_file_dataset",
    "file_task_kind",
    "macro_f1",
]

_DATA_SEED = 1234  # the training/evaluation subsets do not depend on the run seed


def macro_f1(labels: list[int], preds: list[int]) -> float:
    """Unweighted mean of per-class F1 over the classes present in ``labels`` or ``preds``."""
    classes = sorted(set(labels) | set(preds))
    scores = []
    for c in classes:
        tp = sum(1 for y, p in zip(labels, preds) if y == c and p == c)
        fp = sum(1 for y, p in zip(labels, preds) if y != c and p == c)
        fn = sum(1 for y, p in zip(labels, preds) if y == c and p != c)
        scores.append(0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn))
    return sum(scores) / len(scores) if scores else 0.0


def _encode_pairs(tokenizer, raw, split: str, rows: Tensor, max_len: int) -> tuple[Tensor, Tensor]:
    """``ids (B, L)``, ``mask (B, L)`` of the sentence pairs ``rows`` of ``split`` as ``a | b`` in at most
    ``max_len`` tokens, each sentence cut at its end, the longer one first (transformers' ``truncation=
    "longest_first"``), so that a long first sentence does not push the second one out."""
    from ..data import pad_batch

    firsts, seconds = getattr(raw, f"{split}_texts"), getattr(raw, f"{split}_text_pairs")
    sep = tokenizer.encode_ids("|")
    encoded = []
    for i in rows.tolist():
        a, b = tokenizer.encode_ids(firsts[i]), tokenizer.encode_ids(seconds[i])
        keep_a, keep_b = len(a), len(b)
        while keep_a + keep_b > max_len - len(sep) and keep_a + keep_b > 0:
            if keep_a > keep_b:
                keep_a -= 1
            else:
                keep_b -= 1
        encoded.append(a[:keep_a] + sep + b[:keep_b])
    return pad_batch(encoded, tokenizer.pad_id, max_len)


def _subset(n: int, cap: Optional[int]) -> Tensor:
    """A fixed random subset of ``range(n)`` of size ``cap`` (all of it, in order, without a cap)."""
    if cap is None or cap >= n:
        return torch.arange(n)
    generator = torch.Generator().manual_seed(_DATA_SEED)
    return torch.randperm(n, generator=generator)[:cap].sort().values


# --------------------------------------------------------------------------- dataset files


def load_file_dataset(path: str, *, max_len: Optional[int] = None, max_target_len: Optional[int] = None):
    """A ``TextClassificationData`` or ``Seq2SeqData`` from a dataset file (format in the module
    docstring). For a seq2seq file, ``max_len`` / ``max_target_len`` (None = no limit) are the longest source
    and target it may hold (``_refuse_long_sequences``)."""
    from ..data import Seq2SeqData, TextClassificationData

    kind = file_task_kind(path)
    raw = _read_file(path)
    name = Path(path).stem
    fields = ("text", "label") if kind == "classification" else ("source", "target")
    jsonl = str(path).lower().endswith(".jsonl")
    lines = raw.get("lines") if jsonl else None  # a .jsonl file: its line numbers
    known = {"kind", "train", "test", "label_names", *(("lines",) if jsonl else ())}
    extra = sorted(k for k in raw if k not in known)
    # before the splits' check: a file of train and "validation" (or a misspelt "tset") was told only that
    # 'test' must be a non-empty list, not which key it holds instead
    if extra:  # a misspelt label_names, or a split that would be left out without a word
        raise ValueError(
            f"dataset file {path!r}: unknown key(s) {', '.join(map(repr, extra))}; a dataset file holds "
            "kind, train, test and optionally label_names (a validation split: merge it into train or test)"
        )
    for split in ("train", "test"):
        if not isinstance(raw.get(split), list) or not raw[split]:
            raise ValueError(f"dataset file {path!r}: {split!r} must be a non-empty list of examples")
    optional = ("text_pair",) if kind == "classification" else ()
    allowed = {*fields, *optional, "split", "id", "idx"}  # an example's identifier (GLUE's idx) is read past
    for split in ("train", "test"):
        for i, row in enumerate(raw[split]):
            where = f"line {lines[split][i]}" if lines else f"{split}[{i}]"
            if not isinstance(row, dict) or any(f not in row for f in fields):
                raise ValueError(
                    f"dataset file {path!r}, {where}: {row!r}; expected an object with keys {fields}"
                )
            if row.get("split", split) != split:  # a .json example in the other split's list
                raise ValueError(
                    f"dataset file {path!r}, {where}: \"split\": {json.dumps(row['split'])[:40]} in the "
                    f"{split} list; move the example to its split's list, or drop its split key"
                )
            unknown = sorted(k for k in row if k not in allowed)
            if unknown:  # e.g. a second sentence under another name, which would be dropped
                raise ValueError(
                    f"dataset file {path!r}, {where}: unknown key(s) {', '.join(map(repr, unknown))}; an "
                    f"example holds {' and '.join(fields)}"
                    + (" (and text_pair, the second sentence of a pair)" if optional else "")
                    + " and may hold an id or idx; drop the others"
                )
    if kind == "seq2seq":
        rows = []  # (line, where, source, target); line 0 in a .json file
        for split in ("train", "test"):
            for i, row in enumerate(raw[split]):
                where = f"line {lines[split][i]}" if lines else f"{split}[{i}]"
                for field in fields:
                    if not isinstance(row[field], str):
                        value = json.dumps(row[field])  # as the file writes it: null, 12, ["x", "y"]
                        raise ValueError(
                            f"dataset file {path!r}, {where}: the {field} of a {split} example is "
                            f"{value[:80]}, not text; write it as a JSON string in double quotes, e.g. "
                            f'"{field}": "12"'
                        )
                rows.append((lines[split][i] if lines else 0, where, row["source"], row["target"]))
        rows.sort(key=lambda r: r[0])  # a .jsonl file interleaves the splits: its first line first
        _refuse_long_sequences(f"dataset file {path!r}", [r[1:] for r in rows], max_len, max_target_len)
        return Seq2SeqData(
            name=name,
            train_src=[r["source"] for r in raw["train"]],
            train_tgt=[r["target"] for r in raw["train"]],
            test_src=[r["source"] for r in raw["test"]],
            test_tgt=[r["target"] for r in raw["test"]],
        )
    paired = {split: ["text_pair" in row for row in raw[split]] for split in ("train", "test")}
    is_pair = any(paired["train"] + paired["test"])
    for split in ("train", "test"):
        for i, row in enumerate(raw[split]):
            y = row["label"]
            where = f"line {lines[split][i]}" if lines else f"{split}[{i}]"
            for field in ("text", "text_pair") if is_pair else ("text",):
                if field not in row:
                    raise ValueError(
                        f"dataset file {path!r}, {where}: no text_pair, which other examples have; give "
                        "every example of a sentence-pair file its second sentence"
                    )
                if not isinstance(row[field], str):  # null, 12.5, ["a", "b"] were turned into text
                    value = json.dumps(row[field])
                    raise ValueError(
                        f"dataset file {path!r}, {where}: the {field} of a {split} example is {value[:80]}, "
                        f'not text; write it as a JSON string in double quotes, e.g. "{field}": "12"'
                    )
            if isinstance(y, bool) or not isinstance(y, (str, int)):
                raise ValueError(
                    f"dataset file {path!r}, {where}: label {y!r}; expected a class name (a string) or an "
                    "integer"
                )
    given = raw.get("label_names") is not None
    names = _class_names(path, raw)
    if not given:
        _refuse_test_only_labels(path, raw, lines)
    index = {n: i for i, n in enumerate(names)}
    by_index = given and _integer_labels_are_indices(path, raw, names, lines)

    def label(split: str, i: int, row: dict) -> int:
        y = row["label"]
        if by_index and isinstance(y, int) and 0 <= y < len(names):  # an index into the given label_names
            return y
        if str(y) not in index:
            where = f"line {lines[split][i]}" if lines else f"{split}[{i}]"
            raise ValueError(f"dataset file {path!r}, {where}: label {y!r} is not in label_names {names}")
        return index[str(y)]

    return TextClassificationData(
        name=name,
        train_texts=[r["text"] for r in raw["train"]],
        train_labels=[label("train", i, r) for i, r in enumerate(raw["train"])],
        test_texts=[r["text"] for r in raw["test"]],
        test_labels=[label("test", i, r) for i, r in enumerate(raw["test"])],
        label_names=names,
        train_text_pairs=[r["text_pair"] for r in raw["train"]] if is_pair else None,
        test_text_pairs=[r["text_pair"] for r in raw["test"]] if is_pair else None,
    )


def _integer_labels_are_indices(path: str, raw: dict, names: list[str], lines: Optional[dict]) -> bool:
    """Whether the integer labels of a file with ``label_names`` are indices into them (else names).

    A string label is always a name. An integer label ``y`` is read one way for the whole file: as an
    index when no integer label is also a name (the usual ``["neg", "pos"]`` with labels 0/1), or when every
    one that is names the class it indexes (``[0, 1]``); as a name when some integer label cannot be an
    index (``[1, 2, 3, 4, 5]`` with a label 5: star ratings). Otherwise an integer label would name one class
    as a name and another as an index (``[1, 0]``, or ``["1", "0"]`` with labels 0/1): a ``ValueError``
    that names it and asks for the labels as names."""
    position = {n: i for i, n in enumerate(names)}
    found = [
        (split, i, row["label"])
        for split in ("train", "test")
        for i, row in enumerate(raw[split])
        if isinstance(row["label"], int)
    ]
    differ = next(((s, i, y) for s, i, y in found if position.get(str(y), y) != y), None)
    if differ is None:
        return True  # no integer label is a name, or each one that is names the class it indexes
    if any(not 0 <= y < len(names) for _, _, y in found):
        return False  # some integer label is no index: the file's integer labels are names
    split, i, y = differ
    where = f"line {lines[split][i]}" if lines else f"{split}[{i}]"
    raise ValueError(
        f"dataset file {path!r}, {where}: label {y} is the name {names[position[str(y)]]!r} and the index "
        f"of {names[y]!r} in label_names {names}; write the labels as names in double quotes, e.g. "
        f'"label": "{names[position[str(y)]]}"'
    )


def _refuse_long_sequences(
    what: str, rows: list[tuple[str, str, str]], max_len: Optional[int], max_target_len: Optional[int]
) -> None:
    """A ``ValueError`` when a ``(where, source, target)`` row has a source longer than ``max_len`` or a
    target longer than ``max_target_len`` characters (None = no limit): the encoder and decoder would cut it,
    training would lose the target's ``<eos>`` and exact match would score against the cut target. The
    error names the first such row, its length, and the ``--set`` that fits the longest one."""
    problems = []
    sides = (
        (1, "source", "max_len", max_len, "the encoder would see it cut"),
        (2, "target", "max_target_len", max_target_len, "it would be cut and scored against the cut text"),
    )
    for k, side, key, limit, why in sides:
        over = [] if limit is None else [(r[0], len(r[k])) for r in rows if len(r[k]) > limit]
        if over:
            (where, n), longest = over[0], max(m for _, m in over)
            problems.append(
                f"{where}: the {side} has {n} characters, more than {key}={limit} ({why}); the longest "
                f"{side} has {longest}: pass --set {key}={longest}"
            )
    if problems:
        raise ValueError(f"{what}, " + "; and ".join(problems))


def _refuse_test_only_labels(path: str, raw: dict, lines: Optional[dict]) -> None:
    """A ``ValueError`` when a file without ``label_names`` has a test label that no training example has:
    it would silently become a class the model never saw (a typo such as "sprot" for "sport", or a class
    whose examples all went to the test split). With ``label_names`` the file declares its classes."""
    seen = {str(r["label"]) for r in raw["train"]}
    only: dict[str, int] = {}  # label -> index of its first test example
    for i, row in enumerate(raw["test"]):
        if str(row["label"]) not in seen:
            only.setdefault(str(row["label"]), i)
    if only:
        first = min(only.values())
        where = f"line {lines['test'][first]}" if lines else f"test[{first}]"
        raise ValueError(
            f"dataset file {path!r}: label(s) {', '.join(map(repr, only))} occur only in the test split "
            f"(first at {where}); no training example has them: correct the label, or add training examples "
            'of it (or list every class in "label_names")'
        )


def _is_class_name(n: Any) -> bool:
    return isinstance(n, (str, int)) and not isinstance(n, bool)


def _class_names(path: str, raw: dict) -> list[str]:
    """The class names of a classification file: its ``label_names`` (distinct names, at least 2), or
    without them the distinct labels (integers in numeric order, else names sorted)."""
    names = raw.get("label_names")
    if names is None:
        values = {r["label"] for r in raw["train"] + raw["test"]}
        numeric = all(isinstance(y, int) for y in values)
        names = list(dict.fromkeys(str(y) for y in sorted(values, key=(lambda y: y) if numeric else str)))
        if len(names) < 2:
            raise ValueError(
                f"dataset file {path!r}: every label is {names[0]!r}; a classification task needs examples "
                "of at least 2 classes"
            )
        return names
    if not isinstance(names, list) or not all(_is_class_name(n) for n in names):
        raise ValueError(
            f"dataset file {path!r}: label_names={names!r}; expected a list of class names such as "
            '["negative", "positive"]'
        )
    names = [str(n) for n in names]
    twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if twice is not None:
        raise ValueError(
            f"dataset file {path!r}: label_names {names} holds {twice!r} twice; give each class one name"
        )
    if len(names) < 2:
        raise ValueError(
            f"dataset file {path!r}: label_names {names} names {len(names)} class(es); a classification task "
            "needs at least 2"
        )
    return names


# --------------------------------------------------------------------------- classification


@dataclass
class EncodedClassification:
    """Token ids ``(N, L)``, masks ``(N, L)`` (True = real) and labels ``(N,)`` of both splits."""

    train_ids: Tensor
    train_mask: Tensor
    train_labels: Tensor
    test_ids: Tensor
    test_mask: Tensor
    test_labels: Tensor
    test_texts: list[str]
    label_names: list[str]
    vocab_size: int
    pad_id: int
    tokenizer: Any = None  # the WordTokenizer fitted on the training texts (to encode new text)


class ClassificationTask:
    """Text classification with a ``TransformerClassifier``; metrics accuracy and macro-F1."""

    kind = "classification"
    metric_names = ("accuracy", "macro_f1")

    def __init__(self, name: str, source: Optional[str] = None) -> None:
        self.name, self.source = name, source

    def load(self, config: CompareConfig):
        if self.source is not None:
            return load_file_dataset(self.source)
        from ..data import load_or_fetch

        return load_or_fetch(self.name)

    def prepare(self, config: CompareConfig) -> EncodedClassification:
        from ..data import WordTokenizer

        raw = self.load(config)
        train_texts = raw.joined_texts("train") if raw.is_pair else list(raw.train_texts)
        test_texts = raw.joined_texts("test") if raw.is_pair else list(raw.test_texts)
        tr, te = _subset(len(train_texts), config.max_train), _subset(len(test_texts), config.max_eval)
        train_texts = [train_texts[i] for i in tr.tolist()]
        test_texts = [test_texts[i] for i in te.tolist()]
        tokenizer = WordTokenizer.fit(train_texts, max_vocab=config.vocab_size)
        if raw.is_pair:  # both sentences kept, cut longest first, as "a | b"
            train_ids, train_mask = _encode_pairs(tokenizer, raw, "train", tr, config.max_len)
            test_ids, test_mask = _encode_pairs(tokenizer, raw, "test", te, config.max_len)
        else:
            train_ids, train_mask = tokenizer.encode(train_texts, max_length=config.max_len)
            test_ids, test_mask = tokenizer.encode(test_texts, max_length=config.max_len)
        return EncodedClassification(
            train_ids=train_ids, train_mask=train_mask,
            train_labels=torch.tensor(raw.train_labels, dtype=torch.long)[tr],
            test_ids=test_ids, test_mask=test_mask,
            test_labels=torch.tensor(raw.test_labels, dtype=torch.long)[te],
            test_texts=test_texts, label_names=list(raw.label_names),
            vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id, tokenizer=tokenizer,
        )

    def build_model(
        self, config: CompareConfig, mechanism: str, data: EncodedClassification
    ) -> torch.nn.Module:
        from ..models import TransformerClassifier
        from .baseline import NO_ATTENTION, MeanPoolClassifier

        if mechanism == NO_ATTENTION:
            return MeanPoolClassifier(data.vocab_size, len(data.label_names), config.d_model,
                                      config.dim_feedforward, config.dropout, pad_id=data.pad_id)

        return TransformerClassifier(
            vocab_size=data.vocab_size, num_classes=len(data.label_names), d_model=config.d_model,
            nhead=config.nhead, num_layers=config.num_layers, dim_feedforward=config.dim_feedforward,
            dropout=config.dropout, mechanism=mechanism, max_len=config.max_len, pad_id=data.pad_id,
        )

    def num_train(self, data: EncodedClassification) -> int:
        return len(data.train_labels)

    def num_eval(self, data: EncodedClassification) -> int:
        return len(data.test_labels)

    def count(self, data: EncodedClassification, idx: Tensor) -> int:
        return len(idx)

    def _batch(self, ids: Tensor, mask: Tensor, idx: Tensor, device) -> tuple[Tensor, Tensor]:
        ids, mask = trim_padding(ids[idx], mask[idx])  # (b, L)
        return ids.to(device), mask.to(device)

    def loss_sum(self, model, data: EncodedClassification, idx: Tensor, config, device) -> Tensor:
        ids, mask = self._batch(data.train_ids, data.train_mask, idx, device)
        logits = model(ids, mask)  # (b, num_classes)
        return F.cross_entropy(logits.float(), data.train_labels[idx].to(device), reduction="sum")

    def predict(self, model, data: EncodedClassification, idx: Tensor, config, device) -> list[int]:
        ids, mask = self._batch(data.test_ids, data.test_mask, idx, device)
        return model(ids, mask).argmax(dim=-1).tolist()

    def forward_for_diagnostics(
        self, model, data: EncodedClassification, idx: Tensor, config, device
    ) -> None:
        ids, mask = self._batch(data.test_ids, data.test_mask, idx, device)
        model(ids, mask)

    def metrics(self, data: EncodedClassification, preds: list[int]) -> dict:
        labels = data.test_labels.tolist()
        accuracy = sum(int(p == y) for p, y in zip(preds, labels)) / max(1, len(labels))
        return {"accuracy": accuracy, "macro_f1": macro_f1(labels, preds)}

    def correct(self, data: EncodedClassification, preds: list[int]) -> list[bool]:
        return [p == y for p, y in zip(preds, data.test_labels.tolist())]

    def details(self, data: EncodedClassification, preds: list[int]) -> dict:
        """Per-class precision/recall/F1 and the confusion matrix (``runner.stats.per_class``)."""
        from .stats import per_class

        return per_class(data.test_labels.tolist(), preds, data.label_names)

    def example(self, data: EncodedClassification, i: int) -> dict:
        text = data.test_texts[i]
        return {
            "text": text[:240] + ("…" if len(text) > 240 else ""),
            "label": data.label_names[data.test_labels[i]],
        }

    def show_prediction(self, data: EncodedClassification, pred: int) -> str:
        return data.label_names[pred]

    def samples(self, data: EncodedClassification, preds: list[int], limit: int = 8) -> list[dict]:
        names = data.label_names
        return [
            {"text": text[:240] + ("…" if len(text) > 240 else ""), "label": names[y], "predicted": names[p]}
            for text, y, p in zip(data.test_texts[:limit], data.test_labels.tolist(), preds)
        ]


# --------------------------------------------------------------------------- sequence to sequence


@dataclass
class EncodedSeq2Seq:
    """Source ids ``(N, Ls)`` and target ids ``(N, Lt)`` (``<bos> target <eos>``) with masks, both splits."""

    train_src: Tensor
    train_src_mask: Tensor
    train_tgt: Tensor
    train_tgt_mask: Tensor
    test_src: Tensor
    test_src_mask: Tensor
    test_tgt: Tensor
    test_tgt_mask: Tensor
    test_src_texts: list[str]
    test_tgt_texts: list[str]
    tokenizer: Any


class Seq2SeqTask(SourceTargetBatches):
    """Character-level transduction with a ``Seq2SeqTransformer``; metrics sequence accuracy (exact match) and
    token accuracy (characters right at their position, ``runner.stats.token_accuracy``), which still moves
    when a small budget gets no whole sequence right."""

    kind = "seq2seq"
    metric_names = ("sequence_accuracy", "token_accuracy")

    def __init__(self, name: str, source: Optional[str] = None) -> None:
        self.name, self.source = name, source

    def load(self, config: CompareConfig):
        """The task's ``Seq2SeqData``; a source or target longer than ``config.max_len`` /
        ``config.max_target_len`` is a ``ValueError`` (``_refuse_long_sequences``)."""
        if self.source is not None:
            return load_file_dataset(
                self.source, max_len=config.max_len, max_target_len=config.max_target_len
            )
        from ..data import load_dataset

        options = {}
        if self.name == "mlu":  # generated: make only what is used
            options = {"seed": 0}
            if config.max_train is not None:
                options["num_train"] = config.max_train
            if config.max_eval is not None:
                options["num_test"] = config.max_eval
        raw = load_dataset(self.name, **options)
        rows = [(f"{split}[{i}]", s, t) for split in ("train", "test")
                for i, (s, t) in enumerate(zip(getattr(raw, f"{split}_src"), getattr(raw, f"{split}_tgt")))]
        _refuse_long_sequences(f"task {self.name!r}", rows, config.max_len, config.max_target_len)
        return raw

    def prepare(self, config: CompareConfig) -> EncodedSeq2Seq:
        from ..data import CharTokenizer

        raw = self.load(config)
        tr, te = _subset(len(raw.train_src), config.max_train), _subset(len(raw.test_src), config.max_eval)
        pick = lambda items, idx: [items[i] for i in idx.tolist()]  # noqa: E731
        train_src, train_tgt = pick(raw.train_src, tr), pick(raw.train_tgt, tr)
        test_src, test_tgt = pick(raw.test_src, te), pick(raw.test_tgt, te)
        tokenizer = CharTokenizer.fit(train_src + train_tgt + test_src + test_tgt)
        enc = {}
        for split, src, tgt in (("train", train_src, train_tgt), ("test", test_src, test_tgt)):
            # load() refused longer texts, so nothing is cut: <bos> target <eos> is at most max_target_len + 2
            enc[f"{split}_src"], enc[f"{split}_src_mask"] = tokenizer.encode(src, max_length=config.max_len)
            enc[f"{split}_tgt"], enc[f"{split}_tgt_mask"] = tokenizer.encode(
                tgt, max_length=config.max_target_len + 2, add_bos=True, add_eos=True
            )
        return EncodedSeq2Seq(**enc, test_src_texts=test_src, test_tgt_texts=test_tgt, tokenizer=tokenizer)

    @staticmethod
    def mechanisms_for(mechanism: str) -> dict:
        """Encoder, decoder self- and cross-attention mechanisms for one compared ``mechanism``."""
        from ..registry import resolve_mechanism

        decoder = "softmax" if resolve_mechanism(mechanism).query_normalized else mechanism
        return {"encoder_mechanism": mechanism, "decoder_mechanism": decoder, "cross_mechanism": decoder}

    def build_model(self, config: CompareConfig, mechanism: str, data: EncodedSeq2Seq) -> torch.nn.Module:
        from .baseline import NO_ATTENTION

        if mechanism == NO_ATTENTION:
            raise ValueError("mechanism 'none' (the no-attention baseline) is for classification tasks; "
                             "drop it from --mechanisms for a sequence-to-sequence task")
        from ..models import Seq2SeqTransformer

        return Seq2SeqTransformer(
            src_vocab_size=data.tokenizer.vocab_size, tgt_vocab_size=data.tokenizer.vocab_size,
            d_model=config.d_model, nhead=config.nhead,
            num_encoder_layers=config.num_layers, num_decoder_layers=config.num_layers,
            dim_feedforward=config.dim_feedforward, dropout=config.dropout,
            max_len=max(config.max_len, config.max_target_len + 2), pad_id=data.tokenizer.pad_id,
            **self.mechanisms_for(mechanism),
        )

    def loss_sum(self, model, data: EncodedSeq2Seq, idx: Tensor, config, device) -> Tensor:
        src, src_mask, tgt, tgt_mask = self._batch("train", data, idx, device)
        logits = model(src, src_mask, tgt[:, :-1], tgt_mask[:, :-1])  # (b, Lt - 1, V)
        gold = tgt[:, 1:].masked_fill(~tgt_mask[:, 1:], -100)  # (b, Lt - 1)
        return F.cross_entropy(
            logits.float().flatten(0, 1), gold.flatten(), ignore_index=-100, reduction="sum"
        )

    def predict(self, model, data: EncodedSeq2Seq, idx: Tensor, config, device) -> list[str]:
        src, src_mask, _, _ = self._batch("test", data, idx, device)
        tok = data.tokenizer
        out = model.greedy_decode(  # room for the longest target and its <eos>
            src, src_mask, max_len=config.max_target_len + 1, bos_id=tok.bos_id, eos_id=tok.eos_id
        )
        return tok.decode(out, generated=True)  # a generated <bos>/<pad> is wrong, not skipped

    def forward_for_diagnostics(self, model, data: EncodedSeq2Seq, idx: Tensor, config, device) -> None:
        src, src_mask, tgt, tgt_mask = self._batch("test", data, idx, device)
        model(src, src_mask, tgt[:, :-1], tgt_mask[:, :-1])

    def metrics(self, data: EncodedSeq2Seq, preds: list[str]) -> dict:
        from .stats import token_accuracy

        gold = self._targets(data)
        return {
            "sequence_accuracy": sum(int(p == t) for p, t in zip(preds, gold)) / max(1, len(gold)),
            "token_accuracy": token_accuracy(preds, gold),
        }

    def correct(self, data: EncodedSeq2Seq, preds: list[str]) -> list[bool]:
        return [p == t for p, t in zip(preds, self._targets(data))]

    def details(self, data: EncodedSeq2Seq, preds: list[str]) -> dict:
        return {}

    def example(self, data: EncodedSeq2Seq, i: int) -> dict:
        return {"source": data.test_src_texts[i], "target": self._targets(data)[i]}

    def show_prediction(self, data: EncodedSeq2Seq, pred: str) -> str:
        return pred

    @staticmethod
    def _targets(data: EncodedSeq2Seq) -> list[str]:
        """The test targets, decoded from their ids (``<bos>``/``<eos>`` dropped); whole, since ``load``
        refuses a target longer than max_target_len."""
        return data.tokenizer.decode(data.test_tgt)

    def samples(self, data: EncodedSeq2Seq, preds: list[str], limit: int = 8) -> list[dict]:
        return [
            {"source": s, "target": t, "predicted": p}
            for s, t, p in zip(data.test_src_texts[:limit], self._targets(data)[:limit], preds)
        ]



def expected_tasks() -> str:
    """What a task may be, for error messages: every catalog dataset, the recurrent tasks, a dataset file."""
    from ..data import DATASETS
    from .transduction import TRANSDUCTION_TASKS

    return (f"expected one of {', '.join(DATASETS)}, one of the recurrent tasks "
            f"{', '.join(TRANSDUCTION_TASKS)}, or a dataset file ending in .json/.jsonl")


def get_task(name: str):
    """The task for a built-in dataset name or a dataset file (``.json``/``.jsonl``)."""
    if is_dataset_file_name(name):
        kind = file_task_kind(name)
        cls = ClassificationTask if kind == "classification" else Seq2SeqTask
        return cls(Path(name).stem, source=str(name))
    from ..data import DATASETS
    from .transduction import TRANSDUCTION_TASKS, TransductionTask

    key = str(name).lower()
    if key in TRANSDUCTION_TASKS:
        return TransductionTask(key)
    if key not in DATASETS:
        raise ValueError(f"unknown task {name!r}; {expected_tasks()}")
    return Seq2SeqTask(key) if DATASETS[key].kind == "seq2seq" else ClassificationTask(key)
