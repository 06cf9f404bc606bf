"""What ``attnkit finetune`` tells the user while it works: the load report, labelled progress, a time
estimate.

- ``load_classifier`` loads a sequence-classification model without transformers' coloured load report and
  returns plain lines instead: a new classification head is expected (it is what fine-tuning trains), so it
  gets one line that says so; any other missing, unexpected or resized weight is listed.
- ``progress_callbacks`` gives the ``Trainer`` progress bars labelled "train" and "evaluate" and, after the
  first steps, one line with the estimated time of the whole run, evaluation included (evaluating a few
  thousand documents can take as long as a short training run).
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Callable, Iterator, Optional

__all__ = ["load_classifier", "describe_loading", "progress_callbacks", "estimate_line", "HEAD_PREFIXES",
           "quiet_load", "quiet_transformers"]

HEAD_PREFIXES = (  # classification_head: BART, mBART, LED, T5 and their kin
    "classifier.", "score.", "pre_classifier.", "qa_outputs.", "classification_head.",
)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Within: no transformers progress bars ("Loading weights", "Writing model shards") and only its errors;
    the settings before are restored after. The commands' own lines and bars say what happens instead."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hub = _hub_bar_states()  # transformers' switch turns every huggingface_hub bar on or off with its own
    saved = dict(hub) if hub is not None else None
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
        if hub is not None:  # a group of hub bars the user had turned off stays off
            hub.clear()
            hub.update(saved)


def _hub_bar_states() -> Optional[dict]:
    """huggingface_hub's per-group progress bar switches (its ``disable_progress_bars(name)``), if found."""
    import importlib

    try:  # the module: ``huggingface_hub.utils.tqdm`` as an attribute is its tqdm class
        hub_tqdm = importlib.import_module("huggingface_hub.utils.tqdm")
    except ImportError:  # pragma: no cover - huggingface_hub is a transformers dependency
        return None
    states = getattr(hub_tqdm, "progress_bar_states", None)
    return states if isinstance(states, dict) else None


def quiet_load(model_dir: str):
    """``attnkit.hf.load`` without transformers' "Loading weights" progress bar and loading report (an
    encoder loads in about a second; they stood on stderr above any one-line error about the options)."""
    from .convert import load

    with quiet_transformers():
        return load(model_dir)


def _mismatched(info: dict) -> list[str]:
    """The names of the weights that ``ignore_mismatched_sizes`` re-initialized (entries may be tuples)."""
    return sorted(str(m[0] if isinstance(m, (tuple, list)) else m) for m in info.get("mismatched_keys") or [])


def describe_loading(info: dict, other_task: Optional[str] = None) -> list[str]:
    """Plain-text lines for ``from_pretrained(..., output_loading_info=True)``'s info dict; ``other_task``
    names the checkpoint's architecture when its head is of another task than sequence classification."""
    missing = sorted(info.get("missing_keys") or [])
    head = [k for k in missing if k.startswith(HEAD_PREFIXES)]
    other = [k for k in missing if not k.startswith(HEAD_PREFIXES)]
    lines = []
    if head:
        lines.append(
            f"new classification head ({', '.join(head)}): randomly initialized, as expected; "
            "this run trains it"
        )
    if other:
        lines.append(
            f"warning: weights missing from the checkpoint, randomly initialized: {', '.join(other)}"
        )
    unexpected = sorted(info.get("unexpected_keys") or [])
    if unexpected:
        lines.append(f"unused weights of the checkpoint (another head or pooler): {', '.join(unexpected)}")
    mismatched = _mismatched(info)
    head = [k for k in mismatched if k.startswith(HEAD_PREFIXES)]
    other = [k for k in mismatched if not k.startswith(HEAD_PREFIXES)]
    if head:
        reason = f"of another task ({other_task})" if other_task else "for another number of labels"
        lines.append(
            f"the checkpoint's classification head is {reason}; a new one "
            f"({', '.join(head)}) is randomly initialized and trained"
        )
    if other:
        lines.append(
            f"warning: weights with another shape in the checkpoint, re-initialized: {', '.join(other)}"
        )
    return lines


def load_classifier(model_dir: str, log: Optional[Callable[[str], None]] = None, **kwargs):
    """``AutoModelForSequenceClassification.from_pretrained`` with the load report as plain lines on
    ``log``. A checkpoint whose ``num_labels`` differs from the one asked for (a sequence or token
    classifier fine-tuned on other labels), whose label names (``id2label``) differ from those asked for,
    or whose architecture is not a sequence classifier (a multiple-choice head), gets a new classification
    head; any other tensor whose shape
    differs from config.json is refused as damaged files."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    from .checks import auto_config, check_model_dir, damaged_keys, from_pretrained, weights_file

    log = log or (lambda line: print(line, file=sys.stderr))
    check_model_dir(model_dir, "--model")
    saved = auto_config(model_dir)
    architectures = getattr(saved, "architectures", None) or []
    other_head = next((a for a in architectures if not a.endswith("ForSequenceClassification")), None)
    if "num_labels" in kwargs and (saved.num_labels != kwargs["num_labels"] or other_head):
        # a classifier (sequence, token, ...) fine-tuned on other labels, or a head of another task whose
        # shape a sequence classifier's cannot match (multiple choice: classifier (1, H) whatever num_labels
        # says): its head is replaced, and only its head (the other resized tensors are refused below)
        kwargs = {**kwargs, "ignore_mismatched_sizes": True}
    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        model, info = from_pretrained(
            AutoModelForSequenceClassification, model_dir, "--model", output_loading_info=True, **kwargs
        )
        heads = _head_prefixes(model)
        damaged = [k for k in damaged_keys(model, info, heads=False) if not k.startswith(heads)]
        if damaged:  # trained from a random tensor with a warning before
            raise ValueError(
                f"the weights in {model_dir} do not match {model_dir}/config.json ({', '.join(damaged[:3])}"
                f"{' ...' if len(damaged) > 3 else ''}: missing or left over, as with a tensor deleted or a "
                "layer count edited); restore the matching pair of files from the original model"
            )
        resized = _mismatched(info)
        if any(not key.startswith(heads) for key in resized):
            raise ValueError(
                f"{weights_file(model_dir)} holds tensors whose shapes differ from the sizes in "
                f"{model_dir}/config.json ({', '.join(resized)}); restore the matching pair of files"
            )
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    for line in describe_loading(info, other_task=other_head if saved.num_labels == kwargs.get("num_labels")
                                 else None):
        log(line)
    kept = not any(k.startswith(heads) for k in [*resized, *(info.get("missing_keys") or [])])
    other_loss = _other_problem_type(saved, kwargs) if kept else None
    before, asked = _other_label_names(saved, kwargs, other_head)
    if before is not None and sorted(before) == sorted(asked) and len(set(asked)) == len(asked):
        import torch

        # the same labels in another order: the output rows are put in the new order (the trained head kept)
        last = [m for n, m in model.named_modules() if f"{n}.".startswith(heads)
                and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.shape[0] == len(asked)]
        if last:
            order = torch.tensor([before.index(label) for label in asked])
            with torch.no_grad():
                for p in (last[-1].weight, getattr(last[-1], "bias", None)):
                    if p is not None:
                        p.copy_(p[order.to(p.device)])
            log(f"the checkpoint's classification head is for the same labels in another order "
                f"({', '.join(before)}); its rows are reordered for {', '.join(asked)}")
            if other_loss:
                log(other_loss)
            return model
    if before is not None:  # as many labels, other names: the head's rows meant other classes
        for name, module in model.named_modules():
            own = list(module.parameters(recurse=False))
            if f"{name}.".startswith(heads) and own:
                for p in own:  # loaded weights are flagged initialized, and transformers' init skips them
                    if getattr(p, "_is_hf_initialized", False):
                        p._is_hf_initialized = False
                model._init_weights(module)
        log(f"the checkpoint's classification head is for other labels ({', '.join(before)}); a new one is "
            f"randomly initialized and trained for {', '.join(asked)}")
    elif other_loss:
        log(other_loss)
    return model


def _other_problem_type(saved, kwargs: dict) -> Optional[str]:
    """The line for a kept head trained with another loss than the one asked for (a multi-label head's
    independent sigmoids, now one softmax); None when the losses agree or nothing was asked."""
    before, asked = getattr(saved, "problem_type", None), kwargs.get("problem_type")
    if before is None or asked is None or before == asked:
        return None
    names = {"multi_label_classification": "multi-label classification (one sigmoid per label)",
             "single_label_classification": "single-label classification (softmax cross-entropy)",
             "regression": "regression (mean squared error)"}
    return (f"the checkpoint's classification head was trained for {names.get(before, before)}; it is kept "
            f"and trained on for {names.get(asked, asked)}")


def _head_prefixes(model) -> tuple[str, ...]:
    """The prefixes of the head's weights in ``model``: ``HEAD_PREFIXES`` and every top-level module but
    the base model (``base_model_prefix``: XLNet's ``sequence_summary.`` and ``logits_proj.``)."""
    base = getattr(model, "base_model_prefix", "")
    if not base or not hasattr(model, base):
        return HEAD_PREFIXES
    return HEAD_PREFIXES + tuple(f"{name}." for name, _ in model.named_children() if name != base)


def _other_label_names(saved, kwargs: dict, other_head) -> tuple[Optional[list[str]], list[str]]:
    """The label names of a sequence classifier ``saved`` when a head of as many labels is asked for with
    other names (``id2label``), and the names asked for; ``(None, [])`` when the head fits, or when the
    checkpoint's names are transformers' defaults (``LABEL_0``, ...: nothing says what they meant)."""
    asked = kwargs.get("id2label")
    n = kwargs.get("num_labels")
    if asked is None or other_head or n is None or saved.num_labels != n:
        return None, []
    saved_names = [str((saved.id2label or {}).get(i, f"LABEL_{i}")) for i in range(n)]
    if not all(i in asked or str(i) in asked for i in range(n)):
        raise ValueError(f"id2label={asked!r}: expected the keys 0 to {n - 1} (one per label, int or str)")
    asked_names = [str(asked[i] if i in asked else asked[str(i)]) for i in range(n)]  # int or str keys
    if saved_names == [f"LABEL_{i}" for i in range(n)] or saved_names == asked_names:
        return None, []
    return saved_names, asked_names


def estimate_line(steps_done: int, seconds: float, total_steps: int, batch_size: int, n_eval: int) -> str:
    """One line: time per step so far and the estimated total, training plus evaluation.

    Evaluation is a forward pass only, about a third of a training step's work per example.
    """
    per_step = seconds / max(1, steps_done)
    train_total = per_step * total_steps
    eval_total = per_step / max(1, batch_size) / 3 * n_eval
    return (
        f"after {steps_done} steps: {per_step:.2f} s/step; "
        f"estimated total ~{_minutes(train_total + eval_total)} "
        f"(training {total_steps} steps ~{_minutes(train_total)}, evaluating {n_eval} documents "
        f"~{_minutes(eval_total)}; --max-eval-samples N evaluates fewer)"
    )


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def progress_callbacks(n_eval: int, batch_size: int, log: Optional[Callable[[str], None]] = None,
                       after_steps: int = 3) -> list:
    """``[LabelledProgress, Estimate]`` callbacks for a ``Trainer`` (replace its ``ProgressCallback``)."""
    from transformers.trainer_callback import ProgressCallback, TrainerCallback

    log = log or (lambda line: print(line, file=sys.stderr))

    class LabelledProgress(ProgressCallback):
        """transformers' progress bars, labelled "train" and "evaluate"."""

        def on_train_begin(self, args, state, control, **kwargs):
            super().on_train_begin(args, state, control, **kwargs)
            if self.training_bar is not None:
                self.training_bar.set_description("train")

        def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
            new = self.prediction_bar is None
            super().on_prediction_step(args, state, control, eval_dataloader=eval_dataloader, **kwargs)
            if new and self.prediction_bar is not None:
                self.prediction_bar.set_description("evaluate")

    class Estimate(TrainerCallback):
        """After ``after_steps`` optimizer steps, one line with the estimated total time."""

        def __init__(self) -> None:
            self.start = 0.0
            self.line: Optional[str] = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if self.line is None and state.global_step >= min(after_steps, state.max_steps):
                self.line = estimate_line(
                    state.global_step, time.perf_counter() - self.start, state.max_steps, batch_size, n_eval
                )
                if state.is_world_process_zero:
                    log(self.line)

    return [LabelledProgress(), Estimate()]
