"""Alignment attention with transformers' ``Trainer`` (and so with ``accelerate launch``).

    from attnkit.align import AlignmentRegularizer
    from attnkit.align.trainer import AlignmentTrainer

    reg = AlignmentRegularizer(model, method="ct", weight=0.01)
    trainer = AlignmentTrainer(model=model, args=args, train_dataset=train, regularizer=reg)
    trainer.train()

``AlignmentTrainer`` adds ``reg.loss()`` to the task loss of every training step, puts the regularizer's
parameters (discriminator / critic / navigator) in the optimizer it builds as their own group without weight
decay (an optimizer given in ``optimizers=`` with its scheduler must already hold them, as it is used as it
is; one given without a scheduler gets the group before the Trainer builds the scheduler),
broadcasts them from process 0 when training starts and averages their gradients over the processes before
each optimizer step (DDP does both for the model only), clips their gradient norm to ``max_grad_norm`` (their
own norm; the Trainer clips the model's), and zeroes them after each step (the Trainer zeroes the model's
only). ``model_init=`` (and so ``hyperparameter_search``) is refused: the regularizer is attached to one
model. Each checkpoint holds the regularizer too (``alignment_regularizer.safetensors``: its
parameters and the generator of its token subsampling), and
``train(resume_from_checkpoint=...)`` restores it, so that a resumed run continues the uninterrupted one. Any
``Trainer`` subclass can be extended the same way with ``alignment_trainer_class(base)``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from functools import lru_cache
from typing import Optional

__all__ = ["alignment_trainer_class"]

REGULARIZER_FILE = "alignment_regularizer.safetensors"
_GENERATOR_KEY = "_generator_state"  # AlignmentTrainer (the Trainer subclass) is built on first access


_COUNT = "num_items_in_batch"


def _normalizes_by_items(model) -> bool:
    """Whether ``model``'s ``forward`` hands ``num_items_in_batch`` to its loss: transformers' causal LMs do
    so through ``self.loss_function(..., **kwargs)``; others compute a plain per-batch mean, with their own
    ``CrossEntropyLoss`` (BERT's classifiers and masked LM) or ``self.loss_function`` called without the
    keyword arguments (the decoders' ``GenericForSequenceClassification``). Read from the ``forward``'s
    source: a call of ``loss_function`` given ``**kwargs``, or the Trainer's count (the parameter
    ``num_items_in_batch``, or ``kwargs["num_items_in_batch"]`` / ``kwargs.get(...)`` / ``kwargs.pop(...)``,
    and names assigned from them) divided by or passed to a call, as a model of one's own does. A count
    only compared, deleted or popped and dropped, converted (``int(n)``), logged or formatted does not
    normalize, nor does a count the forward sets itself before it reads it (the latest assignment before
    the read, in its block or one around it, or in a with/try body before it: transformers' ``if labels is
    not None: n = ...; loss = ... / n``; a fallback under an ``if n is None:`` keeps the Trainer's count).
    A ``forward`` whose source cannot be read is taken to normalize (the Trainer's own reading); a forward
    that hands everything to another model (``self.lm(**kwargs)``) is read as not normalizing:
    ``trainer.loss_is_scaled_for_ga`` overrides the reading."""
    import ast
    import inspect
    import textwrap

    from transformers.trainer_utils import unwrap_peft_model

    inner = model
    for _ in range(8):  # torch.compile's OptimizedModule, DDP / DataParallel, PEFT, in any order
        unwrapped = unwrap_peft_model(getattr(inner, "_orig_mod", getattr(inner, "module", inner)))
        if unwrapped is inner:
            break
        inner = unwrapped
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(inner).forward)))
    except (OSError, TypeError, SyntaxError):
        return True
    function = tree.body[0] if tree.body else None
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return True  # forward = something else (an assignment, a decorator's product): not readable
    params = function.args
    names = {a.arg for a in (*params.posonlyargs, *params.args, *params.kwonlyargs)}

    def looks_up(node) -> bool:  # kwargs["num_items_in_batch"], kwargs.get / .pop("num_items_in_batch", ...)
        if isinstance(node, ast.Subscript):
            return isinstance(node.slice, ast.Constant) and node.slice.value == _COUNT
        return (isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("get", "pop")
                and bool(node.args) and isinstance(node.args[0], ast.Constant)
                and node.args[0].value == _COUNT)

    def key(node) -> Optional[str]:  # a name, or an attribute such as self.n, as an alias is written
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            return f"{node.value.id}.{node.attr}"
        return None

    parents = {child: node for node in ast.walk(function) for child in ast.iter_child_nodes(node)}

    def carries(node, aliases) -> bool:  # an expression that holds the Trainer's count (not a test, a text)
        if isinstance(node, (ast.Compare, ast.JoinedStr)):
            return False
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and _text(node.left):  # "%d" % n
            return False
        if isinstance(node, ast.Call) and _only_reads(node):  # isinstance(n, ...), print(n), log.info(n)
            return False
        if isinstance(node, ast.IfExp):  # its test is a test: 'sum' if n else 'mean'
            return carries(node.body, aliases) or carries(node.orelse, aliases)
        if looks_up(node):
            return True
        if isinstance(getattr(node, "ctx", None), ast.Load) and key(node) in aliases:
            return not overwritten(node, aliases)
        return any(carries(child, aliases) for child in ast.iter_child_nodes(node))

    def last_word(block, name: str, aliases) -> Optional[bool]:
        return next((found for s in reversed(block) if (found := sets(s, name, aliases)) is not None), None)

    def sets(statement, name: str, aliases) -> Optional[bool]:  # True: a count of the forward's own
        if isinstance(statement, (ast.With, ast.AsyncWith)):  # a body that runs: its last word
            return last_word(statement.body, name, aliases)
        if isinstance(statement, ast.Try):  # body, else, finally (an except may not run)
            return last_word([*statement.body, *statement.orelse, *statement.finalbody], name, aliases)
        if isinstance(statement, ast.If):  # own only where both branches set their own
            both = (last_word(statement.body, name, aliases), last_word(statement.orelse, name, aliases))
            return True if both == (True, True) else None
        if isinstance(statement, ast.AugAssign):  # n *= k keeps n's value: decided by what came before
            return False if key(statement.target) == name and carries(statement.value, aliases) else None
        values = [value for targets, value in assigned([statement]) if name in targets]
        return None if not values else not any(carries(value, aliases) for value in values)

    def overwritten(use, aliases) -> bool:
        """Whether the load ``use`` reads a count the forward set itself: an earlier statement of a block
        around it (or of a with/try body before it) assigns that name from something that is not the count
        (``if labels is not None: n = (labels != -100).sum(); loss = ... / n``; but not a fallback under an
        if, which the load after that if may or may not read)."""
        name, node = key(use), use
        while node in parents:
            parent = parents[node]
            for field in ("body", "orelse", "finalbody"):
                block = getattr(parent, field, None)
                if isinstance(block, list) and node in block:  # the latest assignment before it decides
                    found = next((found for s in reversed(block[:block.index(node)])
                                  if (found := sets(s, name, aliases)) is not None), None)
                    if found is not None:
                        return found
            node = parent
        return False

    def assigned(nodes) -> list[tuple[list[str], ast.AST]]:  # (target names, value) of the assignments
        found = []
        for node in nodes:
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    value = node.value
                    pairs = (zip(target.elts, value.elts) if isinstance(target, ast.Tuple)
                             and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts)
                             else [(target, value)])  # a, n = x, count: n alone takes the count
                    for t, value in pairs:
                        names = [key(n) for n in ([t] if key(t) else getattr(t, "elts", [])) if key(n)]
                        found.append((names, value))  # unpacked or not (not d["k"] = ...)
            elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                found.append(([key(node.target)] if key(node.target) else [], node.value))
            elif isinstance(node, ast.AugAssign) and key(node.target):  # denom *= count
                found.append(([key(node.target)], node.value))
            elif isinstance(node, (ast.For, ast.AsyncFor)) and key(node.target):  # for n in [count]
                found.append(([key(node.target)], node.iter))
        return found

    assignments = assigned(ast.walk(function))
    aliases = {_COUNT} if _COUNT in names else set()  # the parameter (where not overwritten before a read)
    grown = True
    while grown:  # names assigned from the count, from names assigned from it, ...
        grown = False
        for targets, value in assignments:
            if set(targets) - aliases and carries(value, aliases):
                aliases |= set(targets)
                grown = True
    for node in ast.walk(function):
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Div, ast.FloorDiv)):
            if carries(node.right, aliases):
                return True
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):  # n ** -1
            if carries(node.left, aliases):
                return True
        elif isinstance(node, ast.AugAssign) and isinstance(node.op, (ast.Div, ast.FloorDiv)):
            if carries(node.value, aliases):
                return True
        elif isinstance(node, ast.Call) and not looks_up(node) and not _only_reads(node) \
                and not _converts(node):  # int(n) alone computes no loss (loss / int(n) does, above)
            if any(carries(a, aliases) for a in node.args):
                return True
            for k in node.keywords:  # num_items_in_batch=..., any name, or **{"num_items_in_batch": n}
                if carries(k.value, aliases):
                    return True
            name = getattr(node.func, "attr", getattr(node.func, "id", None))
            if name == "loss_function" and any(k.arg is None for k in node.keywords):  # **kwargs
                return True
    return False


def _text(node) -> bool:
    """A string constant (the left side of ``"..." % n``, the receiver of ``"...".format(n)``)."""
    import ast

    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _converts(call) -> bool:
    """``int(n)``, ``float(n)``, ``bool(n)``, ...: a call that hands back the value converted, which carries
    the count into what uses it but computes no loss itself."""
    return getattr(call.func, "id", None) in ("int", "float", "bool", "abs", "round")


def _only_reads(call) -> bool:
    """A call that reads a value without computing a loss with it: isinstance, print, type, a text
    (``str(n)``, ``"...".format(n)``), a message to a logger or to warnings (``logger.info``,
    ``logging.warning``, ``warnings.warn``: not ``torch.log`` or a tensor's ``n.type(dtype)``)."""
    import ast

    func = call.func
    if isinstance(func, ast.Name):
        return func.id in ("isinstance", "print", "type", "repr", "str", "id", "hasattr")
    if not isinstance(func, ast.Attribute):
        return False
    if func.attr == "format" and _text(func.value):
        return True
    receiver = ast.unparse(func.value).lower()
    return ("log" in receiver or "warn" in receiver) and receiver not in ("torch", "math", "np", "numpy") \
        and func.attr in ("warn", "debug", "info", "warning", "warning_once", "info_once", "error", "log",
                          "exception", "critical")


@lru_cache(maxsize=None)
def alignment_trainer_class(base=None):
    """A subclass of ``base`` (default ``transformers.Trainer``) taking ``regularizer=`` in its
    constructor."""
    from transformers import Trainer, TrainerCallback

    base = Trainer if base is None else base

    class _SyncRegularizer(TrainerCallback):
        def __init__(self, regularizer) -> None:
            self.regularizer = regularizer

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.regularizer.sync_gradients()
            # the Trainer clips the model's gradients (just before this call); the regularizer's parameters
            # are in the same optimizer and take the same max_grad_norm, as their own group
            own = [p for p in self.regularizer.parameters() if p.grad is not None]
            if own and args.max_grad_norm is not None and args.max_grad_norm > 0:
                import torch

                torch.nn.utils.clip_grad_norm_(own, args.max_grad_norm)

        # the Trainer zeroes the model's gradients only (model.zero_grad()): without these the
        # discriminator / critic stepped on the sum of every step's gradients so far
        def on_train_begin(self, args, state, control, **kwargs):
            # DDP broadcasts the model only: every process starts from rank 0's regularizer (after a resume
            # too, whose checkpoint was loaded before this call)
            self.regularizer.broadcast_parameters(src=0)
            self.regularizer.zero_grad(set_to_none=True)

        def on_step_end(self, args, state, control, **kwargs):
            self.regularizer.zero_grad(set_to_none=True)

    class AlignmentTrainer(base):
        """``Trainer`` whose training loss is ``task loss + regularizer.loss()``."""

        def __init__(self, *args, regularizer, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            if getattr(self, "model_init", None) is not None:
                # train() would build a new model, and the regularizer's hooks stay on the one it was given
                raise ValueError(
                    "AlignmentTrainer takes model=, not model_init= (nor hyperparameter_search): the "
                    "regularizer is attached to one model; build the model, attach "
                    "AlignmentRegularizer(model, ...) to it and pass both"
                )
            self.regularizer = regularizer.to(self.args.device)
            own = [p for p in regularizer.parameters() if p.requires_grad]
            if self.optimizer is not None and own:  # the user's optimizers=(optimizer, scheduler or None)
                known = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
                missing = [p for p in own if id(p) not in known]
                if missing and self.lr_scheduler is None:  # the Trainer builds the scheduler after this group
                    self.optimizer.add_param_group({"params": missing, "weight_decay": 0.0})
                elif missing:
                    # adding a group to it now would leave the user's scheduler one group short
                    raise ValueError(
                        f"the optimizer given in optimizers= lacks {len(missing)} of the regularizer's "
                        "parameter tensors (its discriminator / critic / navigator); build it over "
                        "[*model.parameters(), *regularizer.parameters()] before its scheduler, or leave "
                        "optimizers= out for the Trainer's own"
                    )
            self.add_callback(_SyncRegularizer(regularizer))

        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True, **kwargs)
            if model.training and self.regularizer.config.weight > 0:
                reg = self.regularizer.loss()  # the mean over this micro-batch
                if self._loss_scaled_for_accumulation(kwargs.get("num_items_in_batch")):
                    # the Trainer will not divide this loss by the accumulation steps (the task loss was
                    # normalized over the whole accumulated batch): the regularizer's share is divided here,
                    # or its weight would grow with gradient_accumulation_steps
                    reg = reg / getattr(self, "current_gradient_accumulation_steps",
                                        self.args.gradient_accumulation_steps)
                reg = reg * self._process_factor(kwargs.get("num_items_in_batch"))
                loss = loss + reg
            return (loss, outputs) if return_outputs else loss

        def _loss_scaled_for_accumulation(self, num_items_in_batch) -> bool:
            """Whether the task loss of a micro-batch is already a share of the accumulated batch's mean, so
            that the regularizer's is divided by the accumulation steps too. ``Trainer.training_step`` leaves
            the loss undivided when the model's ``forward`` takes ``**kwargs`` and is handed
            ``num_items_in_batch``, but a model that takes them without normalizing by it (BERT's and most
            encoders' sequence classifiers compute a per-micro-batch mean) then sums the micro-batches' task
            losses: the regularizer, divided, lost weight by the accumulation steps (x0.5 at 2)."""
            fixed = getattr(self, "loss_is_scaled_for_ga", None)
            if fixed is not None:
                return bool(fixed)
            if getattr(self, "compute_loss_func", None) is not None:
                return True
            return bool(getattr(self, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None
                        and self._task_normalizes_by_items())

        def _process_factor(self, num_items_in_batch) -> int:
            """The factor by which ``Trainer.compute_loss`` multiplied the task loss (the number of processes,
            under ``average_tokens_across_devices``) where the task loss is a per-process mean that ignores
            ``num_items_in_batch``: the regularizer takes it too, or its weight against the task would be
            divided by the number of processes. 1 where the task loss is normalized over every process's
            items (the factor undoes that division) or the Trainer did not multiply."""
            args = self.args
            if not (getattr(args, "average_tokens_across_devices", False) and num_items_in_batch is not None
                    and getattr(self, "model_accepts_loss_kwargs", False)
                    and getattr(self, "compute_loss_func", None) is None):
                return 1
            if self._task_normalizes_by_items():
                return 1
            tp = self.get_tp_size() if hasattr(self, "get_tp_size") else 1
            return args.n_gpu if args.n_gpu > 1 else max(1, self.accelerator.num_processes // tp)

        def _task_normalizes_by_items(self) -> bool:
            fixed = getattr(self, "loss_is_scaled_for_ga", None)  # the Trainer's own switch, the user's word
            if fixed is not None:
                return bool(fixed)
            # the Trainer's label smoother (label_smoothing_factor > 0) divides by num_items_in_batch itself
            return getattr(self, "label_smoother", None) is not None or _normalizes_by_items(self.model)

        def _save_checkpoint(self, model, trial, *args, **kwargs):
            states = None
            if self.accelerator.num_processes > 1:  # every process saves (a collective: all take part)
                from accelerate.utils import gather_object

                # each process's subsampling stream: with max_tokens each draws over its own padded length,
                # so the streams part, and rank 0's alone resumed the others on another one
                states = gather_object([self.regularizer._generator.get_state()])
            if self.args.should_save:  # written first: the folder is complete when the Trainer's files are
                from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

                folder = os.path.join(
                    self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
                )
                save_regularizer(self.regularizer, folder, rank_generators=states)
            return super()._save_checkpoint(model, trial, *args, **kwargs)

        def _load_from_checkpoint(self, resume_from_checkpoint, *args, **kwargs):
            # the regularizer first: a checkpoint refused for its settings leaves the model as it was
            load_regularizer(self.regularizer, resume_from_checkpoint, rank=self.accelerator.process_index,
                             world=self.accelerator.num_processes)
            return super()._load_from_checkpoint(resume_from_checkpoint, *args, **kwargs)

        def create_optimizer(self, *args, **kwargs):
            optimizer = super().create_optimizer(*args, **kwargs)
            own = [p for p in self.regularizer.parameters() if p.requires_grad]
            known = {id(p) for group in optimizer.param_groups for p in group["params"]}
            own = [p for p in own if id(p) not in known]
            if own:
                optimizer.add_param_group({"params": own, "weight_decay": 0.0})
            return optimizer

    AlignmentTrainer.__qualname__ = AlignmentTrainer.__name__ = f"Alignment{base.__name__}"
    return AlignmentTrainer


def save_regularizer(regularizer, folder, rank_generators=None) -> None:
    """Write ``regularizer``'s parameters and subsampling generator to ``folder/REGULARIZER_FILE``;
    ``rank_generators``: every process's generator state, in rank order (a run on several processes)."""
    from safetensors.torch import save_file

    from .._files import match_umask

    os.makedirs(folder, exist_ok=True)
    tensors = {f"state.{k}": v.detach().cpu().contiguous() for k, v in regularizer.state_dict().items()}
    tensors[_GENERATOR_KEY] = regularizer._generator.get_state()
    for rank, state in enumerate(rank_generators or ()):
        tensors[f"{_GENERATOR_KEY}.rank{rank}"] = state.detach().cpu().contiguous()
    path = os.path.join(folder, REGULARIZER_FILE)
    save_file(tensors, path + ".tmp", metadata={_SETTINGS_KEY: json.dumps(_settings(regularizer))})
    os.replace(path + ".tmp", path)
    match_umask(path)


_SETTINGS_KEY = "attnkit.align.settings"


def _settings(regularizer) -> dict:
    """The regularizer's settings that shape its loss (``AlignConfig`` without the seed: the subsampling
    generator's state is saved itself), as JSON values."""
    settings = {k: v for k, v in asdict(regularizer.config).items() if k != "seed"}
    return json.loads(json.dumps(settings))  # tuples as lists, as they come back from the file


def load_regularizer(regularizer, folder, rank: int = 0, world: int = 1) -> None:
    """Restore what :func:`save_regularizer` wrote (on process ``rank`` of ``world``: its own generator state
    where the checkpoint holds one per process of a run on as many); a ``ValueError`` naming the file when
    it is missing, damaged, holds non-finite parameters or does not fit ``regularizer``."""
    import torch
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    path = os.path.join(folder, REGULARIZER_FILE)
    if os.path.isdir(path):
        raise ValueError(f"{path} is a folder, not the regularizer's file; the checkpoint is damaged: "
                         "delete it")
    if not os.path.isfile(path):
        raise ValueError(
            f"checkpoint {folder} has no {REGULARIZER_FILE}: it was saved without the alignment regularizer, "
            "so resuming from it would restart the discriminator / critic; train again from the start or "
            "resume from a checkpoint that AlignmentTrainer saved"
        )
    try:
        tensors = load_file(path)
        with safe_open(path, framework="pt") as f:
            saved = json.loads((f.metadata() or {}).get(_SETTINGS_KEY, "null"))
    except (SafetensorError, OSError, ValueError, RecursionError) as exc:
        raise ValueError(f"{path} cannot be read ({exc}); it is damaged: delete the checkpoint") from None
    if saved is not None and not (isinstance(saved, dict) and "method" in saved):
        raise ValueError(f"{path} has damaged settings ({_SETTINGS_KEY} = {str(saved)[:80]!r}); delete the "
                         "checkpoint")
    if saved is not None:  # a file of an older attnkit has none: its parameters are checked below
        now = _settings(regularizer)
        changed = [f"{k}={saved.get(k)!r} (now {now[k]!r})" for k in now if saved.get(k, now[k]) != now[k]]
        if changed:
            raise ValueError(
                f"{path} was saved by a regularizer with {', '.join(changed)}; a resumed run equals the "
                "uninterrupted one only with the same settings: resume with them, or train again from the "
                "start"
            )
    state = {k[len("state."):]: v for k, v in tensors.items() if k.startswith("state.")}
    bad = next((k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())),
               None)
    if bad is not None:  # a diverged run's: resuming would train on, every loss NaN
        raise ValueError(f"{path} holds non-finite values (NaN or inf) in {bad}: the run had diverged before "
                         "this checkpoint; resume from an earlier checkpoint or train again with a lower "
                         "learning rate or alignment weight")
    per_rank = sorted(k for k in tensors if k.startswith(_GENERATOR_KEY + ".rank"))
    key = _GENERATOR_KEY  # rank 0's: a run of one process, or of another number than this one
    if world > 1 and len(per_rank) == world:
        key = f"{_GENERATOR_KEY}.rank{rank}"
    for name in (n for n in (_GENERATOR_KEY, *per_rank) if n in tensors):  # a missing one: "does not fit"
        generator = tensors[name]
        if generator.dtype != torch.uint8 or generator.dim() != 1:
            raise ValueError(f"{path} has a damaged {name} ({generator.dtype}, shape "
                             f"{tuple(generator.shape)}; a 1-D uint8 tensor was expected); delete the "
                             "checkpoint")
    try:
        regularizer.load_state_dict(state)
        regularizer._generator.set_state(tensors[key])
    except (RuntimeError, KeyError) as exc:
        from .._files import state_mismatch

        raise ValueError(
            f"{path} does not fit this regularizer ({state_mismatch(exc)}); resume with the alignment "
            "method and settings the checkpoint was trained with, or train again from the start"
        ) from None


def __getattr__(name: str):
    if name == "AlignmentTrainer":
        return alignment_trainer_class()
    raise AttributeError(name)
