"""Transduction tasks of ``attnkit compare`` and ``attnkit reproduce lecture-seq``: the recurrent models of
the
lecture "Attention and Transformers" on grapheme-to-phoneme, number words and synthetic copy/reverse/sort.

For these tasks the compared "mechanisms" are models (``MODELS``):

- ``vanilla``: ``RNNSeq2Seq(attention="none")``, the fixed-size bottleneck (RNNencdec);
- ``additive``, ``bilinear``, ``dot``, ``scaled_dot``: content attention (RNNsearch, Luong, Vaswani scores);
- ``gmm``: Graves' Gaussian-mixture location attention; ``mixed``: Chorowski's content + location attention;
- ``ctc``: ``CTCModel``, the monotonic baseline.

Metrics: ``sequence_error_rate`` (share of test outputs not exactly right) and ``token_error_rate``
(Levenshtein distance / reference length: the phoneme error rate on ``g2p``, the word error rate on
``numbers``).
Decoding is greedy (best path for CTC).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .sequence_batches import SourceTargetBatches

__all__ = [
    "TRANSDUCTION_TASKS",
    "MODELS",
    "DEFAULT_MODELS",
    "TransductionTask",
    "EncodedTransduction",
    "check_model_names",
    "load_transduction",
]

# task -> (how targets split into tokens, CTC frames per source token)
TRANSDUCTION_TASKS: dict[str, tuple[str, int]] = {
    "g2p": ("words", 3),
    "numbers": ("words", 3),
    "copy": ("chars", 2),
    "reverse": ("chars", 2),
    "sort": ("chars", 2),
}
MODELS = ("vanilla", "additive", "bilinear", "dot", "scaled_dot", "gmm", "mixed", "ctc")
DEFAULT_MODELS = ("vanilla", "additive", "dot", "gmm", "mixed", "ctc")
_ATTENTION = {
    "vanilla": "none",
    "additive": "additive",
    "bilinear": "bilinear",
    "dot": "dot",
    "scaled_dot": "scaled_dot",
    "gmm": "gmm",
    "mixed": "mixed",
}
_DATA_SEED = 0  # the data do not depend on the run seed


def check_model_names(names) -> tuple[str, ...]:
    """Validate model names for a transduction task (``MODELS``); returns them as a tuple."""
    names = tuple(names)
    for name in names:
        if name not in MODELS:
            hint = " ('vanilla' is this family's model without attention)" if name == "none" else ""
            raise ValueError(
                f"unknown model {name!r} for a transduction task; expected names from {MODELS}{hint}"
            )
    if len(set(names)) != len(names):
        raise ValueError(f"models {list(names)} name a model twice; list each once")
    return names


GENERATED_TRAIN = 20000  # max_train=None ("all") of a generated task, which has no "all": the quick preset's


def load_transduction(name: str, num_train: int | None, num_test: int | None):
    """The ``Seq2SeqData`` of a transduction task with the given sizes (``None``: all of g2p's words; for
    the generated tasks, which have no "all", ``GENERATED_TRAIN`` training examples, as many as the quick
    preset's cap (the paper preset trained on 4000 of copy, reverse and sort, fewer than quick), and the
    generator's default number of test examples)."""
    if num_train is None and name in ("copy", "reverse", "sort", "numbers"):
        num_train = GENERATED_TRAIN
    sizes = {k: v for k, v in (("num_train", num_train), ("num_test", num_test)) if v is not None}
    if name == "g2p":
        from ..data.g2p import load_g2p

        return load_g2p(**sizes, seed=_DATA_SEED)
    if name == "numbers":
        from ..data.numbers import generate_numbers

        return generate_numbers(**sizes, seed=_DATA_SEED)
    if name in ("copy", "reverse", "sort"):
        from ..data.synthetic import generate_synthetic

        return generate_synthetic(name, **sizes, test_max_len=12, seed=_DATA_SEED)
    raise ValueError(f"unknown transduction task {name!r}; expected one of {tuple(TRANSDUCTION_TASKS)}")


@dataclass
class EncodedTransduction:
    """Ids and masks of both splits (targets as ``<bos> y <eos>``), the vocabularies and the test strings."""

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
    src_vocab: Any
    tgt_vocab: Any


class TransductionTask(SourceTargetBatches):
    """A transduction task (``g2p``, ``numbers``, ``copy``, ``reverse``, ``sort``) for the runner's loop."""

    kind = "transduction"
    metric_names = ("sequence_error_rate", "token_error_rate")

    def __init__(self, name: str) -> None:
        if name not in TRANSDUCTION_TASKS:
            raise ValueError(
                f"unknown transduction task {name!r}; expected one of {tuple(TRANSDUCTION_TASKS)}"
            )
        self.name = name
        self.target_split, self.upsample = TRANSDUCTION_TASKS[name]

    def prepare(self, config) -> EncodedTransduction:
        from ..data.transduction import TokenVocab

        raw = load_transduction(self.name, config.max_train, config.max_eval)
        src_vocab = TokenVocab.fit(raw.train_src + raw.test_src, "chars")
        tgt_vocab = TokenVocab.fit(raw.train_tgt, self.target_split)
        enc = {}
        for split in ("train", "test"):
            enc[f"{split}_src"], enc[f"{split}_src_mask"] = src_vocab.encode(getattr(raw, f"{split}_src"))
            enc[f"{split}_tgt"], enc[f"{split}_tgt_mask"] = tgt_vocab.encode(
                getattr(raw, f"{split}_tgt"), add_bos=True, add_eos=True
            )
        return EncodedTransduction(
            **enc,
            test_src_texts=list(raw.test_src),
            test_tgt_texts=list(raw.test_tgt),
            src_vocab=src_vocab,
            tgt_vocab=tgt_vocab,
        )

    def build_model(self, config, model: str, data: EncodedTransduction) -> torch.nn.Module:
        from ..models import CTCModel, RNNSeq2Seq

        check_model_names([model])
        hidden = config.d_model
        if model == "ctc":
            return CTCModel(
                data.src_vocab.vocab_size,
                data.tgt_vocab.vocab_size,
                embed_dim=hidden // 2,
                hidden_dim=hidden,
                num_layers=2,
                upsample=self.upsample,
                pad_id=data.src_vocab.pad_id,
                blank_id=data.tgt_vocab.pad_id,  # the padding id never occurs in a target
            )
        return RNNSeq2Seq(
            data.src_vocab.vocab_size,
            data.tgt_vocab.vocab_size,
            embed_dim=hidden // 2,
            hidden_dim=hidden,
            attention=_ATTENTION[model],
            pad_id=data.tgt_vocab.pad_id,
            bos_id=data.tgt_vocab.bos_id,
            eos_id=data.tgt_vocab.eos_id,
        )

    @staticmethod
    def _unwrap(model):
        return getattr(model, "module", model)

    def loss_sum(self, model, data: EncodedTransduction, idx: Tensor, config, device) -> Tensor:
        from ..models import CTCModel

        src, src_mask, tgt, tgt_mask = self._batch("train", data, idx, device)
        if isinstance(self._unwrap(model), CTCModel):
            eos, blank = data.tgt_vocab.eos_id, data.tgt_vocab.pad_id
            labels = tgt[:, 1:].masked_fill(tgt[:, 1:] == eos, blank)  # drop <eos>: (b, Lt - 1)
            lengths = tgt_mask[:, 1:].sum(dim=1) - 1  # (b,)
            # the forward through the wrapped model: DistributedDataParallel syncs the gradients of what runs
            # through its forward only (the unwrapped model's loss() trained each process on its own)
            log_probs, frames = model(src, src_mask)
            return self._unwrap(model).loss_from_log_probs(log_probs, frames, labels, lengths) * src.shape[0]
        logits, _ = model(src, src_mask, tgt[:, :-1], tgt_mask[:, :-1])  # (b, Lt - 1, V)
        gold = tgt[:, 1:].masked_fill(~tgt_mask[:, 1:], -100)  # (b, Lt - 1)
        return F.cross_entropy(
            logits.float().flatten(0, 1), gold.flatten(), ignore_index=-100, reduction="sum"
        )

    @staticmethod
    def decode_limits(src_mask: Tensor) -> Tensor:
        """Each example's generation cap ``(b,)``: four target tokens per source token plus slack (targets
        are at most ~2x longer). Per example, so that an output that never ends is cut where it would be
        alone, whatever the batch it shares (the batch's cap made its length, and the token error rate,
        depend on the batch size and the number of processes)."""
        return 4 * src_mask.sum(dim=1) + 8

    def predict_tokens(
        self, model, data: EncodedTransduction, idx: Tensor, device
    ) -> tuple[list[list[str]], Any]:
        """Greedy outputs as token lists and the alignments ``(b, T, Ls)`` (None for vanilla and CTC)."""
        from ..models import CTCModel

        src, src_mask, _, _ = self._batch("test", data, idx, device)
        net = self._unwrap(model)
        vocab = data.tgt_vocab
        if isinstance(net, CTCModel):
            # CTC never learns <eos> (its loss reads it as blank): one it emits is an error, not the end
            decoded = net.decode(src, src_mask)
            return [vocab.decode_ids(ids, generated=True, eos_ends=False) for ids in decoded], None
        limits = self.decode_limits(src_mask).tolist()
        tokens, align = net.greedy_decode(src, src_mask, max_len=max(limits, default=8))
        rows = zip(tokens.tolist(), limits)
        return [vocab.decode_ids(row[:limit], generated=True) for row, limit in rows], align

    def predict(self, model, data: EncodedTransduction, idx: Tensor, config, device) -> list[str]:
        tokens, _ = self.predict_tokens(model, data, idx, device)
        return [data.tgt_vocab.join(t) for t in tokens]

    def forward_for_diagnostics(self, model, data: EncodedTransduction, idx: Tensor, config, device) -> None:
        """Nothing: a decoder step has a single query, so the explain-away diagnostic does not apply."""

    def references(self, data: EncodedTransduction) -> list[list[str]]:
        return [data.tgt_vocab.tokenize(t) for t in data.test_tgt_texts]

    def metrics(self, data: EncodedTransduction, preds: list[str]) -> dict:
        from ..data.transduction import sequence_error_rate, token_error_rate

        refs = self.references(data)
        hyps = self._hypotheses(data, preds)
        return {
            "sequence_error_rate": sequence_error_rate(refs, hyps),
            "token_error_rate": token_error_rate(refs, hyps),
        }

    def correct(self, data: EncodedTransduction, preds: list[str]) -> list[bool]:
        """Per test example: the whole output sequence equals the target."""
        refs = self.references(data)
        return [h == r for h, r in zip(self._hypotheses(data, preds), refs)]

    @staticmethod
    def _hypotheses(data: EncodedTransduction, preds: list[str]) -> list[list]:
        """The predictions as token lists, an ``<unk>`` output or a generated pad / bos / eos (each shown as
        one of ``DISPLAY_MARKS``) as a token equal to no reference token (a reference keeps a character
        outside the vocabulary raw, so a test target's "∅" matched a generated ``<pad>``)."""
        from ..data.tokenizers import DISPLAY_MARKS

        never = object()
        return [[never if t in DISPLAY_MARKS else t for t in data.tgt_vocab.tokenize(p)] for p in preds]

    def details(self, data: EncodedTransduction, preds: list[str]) -> dict:
        return {}

    def example(self, data: EncodedTransduction, i: int) -> dict:
        return {"source": data.test_src_texts[i], "target": data.test_tgt_texts[i]}

    def show_prediction(self, data: EncodedTransduction, pred: str) -> str:
        return pred

    def samples(self, data: EncodedTransduction, preds: list[str], limit: int = 8) -> list[dict]:
        return [
            {"source": s, "target": t, "predicted": p}
            for s, t, p in zip(data.test_src_texts[:limit], data.test_tgt_texts[:limit], preds)
        ]
