"""Saved runs: checkpoints (model, optimizer and scheduler states, the trainer's numbers, every process's RNG
states) and finished results, written by ``train_run`` and read back, checked field by field, on ``--resume``.

A checkpoint holds ``state.pt`` (tensors and numbers only, read back with ``weights_only=True``),
``trainer.json`` (the step, the metrics history, the timing sums and the data's fingerprint; written last, so
its presence marks a complete checkpoint) and ``rng-rank<i>.safetensors``. Nothing is unpickled, so a run
directory from elsewhere cannot run code; a file that does not hold what ``train_run`` writes is a one-line
``ValueError``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from .._files import json_loads, rmtree_named, state_mismatch
from .config import CompareConfig

__all__ = [
    "RESULT_FILE", "TRAINER_FILE", "data_fingerprint", "finished_result", "latest_checkpoint",
    "load_checkpoint_everywhere", "run_expectations", "save_checkpoint",
]

RESULT_FILE = "result.json"
TRAINER_FILE = "trainer.json"  # written last: its presence marks a complete checkpoint


def _rng_state() -> tuple[dict[str, Tensor], dict]:
    """Every RNG state of this process as tensors plus JSON-able numbers (saved with no pickle)."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors = {
        "python": torch.tensor(mt, dtype=torch.int64),  # (625,)
        "numpy": torch.from_numpy(np.asarray(keys, dtype=np.int64)),  # (624,)
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        for i, t in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = t
    meta = {"python": [version, gauss], "numpy": [kind, int(pos), int(has_gauss), float(cached)]}
    return tensors, meta


def _set_rng_state(tensors: dict[str, Tensor], meta: dict) -> None:
    version, gauss = meta["python"]
    random.setstate((int(version), tuple(int(x) for x in tensors["python"].tolist()), gauss))
    kind, pos, has_gauss, cached = meta["numpy"]
    keys = tensors["numpy"].numpy().astype(np.uint32)  # (624,)
    np.random.set_state((str(kind), keys, int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[f"cuda.{i}"] for i in range(sum(1 for k in tensors if k.startswith("cuda.")))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def _save_rng(path: Path) -> None:
    from safetensors.torch import save_file

    tensors, meta = _rng_state()
    save_file(tensors, str(path), metadata={"attnkit_rng": json.dumps(meta)})


class _CheckpointError(ValueError):
    """A checkpoint file's problem, already on one line."""


def _checkpoint_error(file: Path, problem: str) -> ValueError:
    return _CheckpointError(
        f"checkpoint file {str(file)!r} {problem}; delete {str(file.parent)!r} to restart that run from its "
        "last good state, or start over with --overwrite"
    )


def _read_checkpoint_file(file: Path, reader: Callable[[Path], Any]) -> Any:
    """``reader(file)``, with any failure turned into one ``ValueError`` naming the file."""
    import pickle

    if not file.is_file():
        raise _checkpoint_error(file, "is missing (written by an older attnkit, or deleted)")
    try:
        return reader(file)
    except _CheckpointError:
        raise
    except pickle.UnpicklingError as exc:
        if "GLOBAL" in str(exc):  # weights_only refused a class or function the file names
            raise _checkpoint_error(
                file, "holds pickled objects other than tensors (refused: loading them could run code)"
            ) from None
        raise _checkpoint_error(file, "is not a valid checkpoint (not a PyTorch tensor file: damaged or "
                                "replaced)") from None
    except Exception as exc:  # truncated, garbage, wrong format: one line, no traceback
        lines = str(exc).strip().splitlines()
        first = lines[0] if lines else ""
        raise _checkpoint_error(file, f"cannot be read ({type(exc).__name__}: {first})") from None


_RESULT_KEYS = {"mechanism": str, "seed": int, "steps": int, "metrics": dict, "history": list,
                "step_time_s": (int, float)}


def _read_result(path: Path, mechanism: str, seed: int, metric_names: Sequence[str] = (),
                 expect: Optional[dict] = None) -> dict:
    """A finished run's ``result.json``; damaged (truncated, edited, another run's, a metric of
    ``metric_names`` missing or not a finite number) is one ``ValueError``, and so is the result of another
    configuration than ``expect`` (``run_expectations``; each key optional: a 150-step result was averaged
    with 40-step ones, the report saying 40 steps each) or trained on other data than it describes."""
    record, why = _parse_result(path, metric_names)
    if why is None and (record["mechanism"], record["seed"]) != (mechanism, seed):
        why = f"is the result of {record['mechanism']} seed {record['seed']}, not {mechanism} seed {seed}"
    if why is None and expect:
        why = _foreign_result(record, expect)
    if why is not None:
        raise ValueError(
            f"run result {str(path)!r} {why}; delete {str(path.parent)!r} to train that run again with "
            "--resume"
        )
    return record


def _foreign_result(record: dict, expect: dict) -> Optional[str]:
    """What makes ``record`` the result of another configuration than ``expect``, or ``None``."""
    for key, what in (("steps", "optimizer steps"), ("eval_examples", "evaluation examples"),
                      ("train_examples", "training examples")):
        if expect.get(key) is not None and key in record and record[key] != expect[key]:
            return f"is of a run with {record[key]} {what}, not this configuration's {expect[key]}"
    labels = expect.get("labels")
    if labels is not None:
        names = [c["name"] for c in record.get("classes") or []]
        if "classes" in record and names != list(labels):
            return f"has classes {names}, not this dataset's {list(labels)}"
        if any(not isinstance(p, int) or not 0 <= p < len(labels) for p in record.get("predictions") or []):
            return f"has predictions that are not class indices below {len(labels)}"
    supports = expect.get("supports")
    recorded = [c["support"] for c in record.get("classes") or []]
    if supports is not None and "classes" in record and recorded != supports:  # label_names read otherwise
        return f"was trained on other data (test examples per class {recorded}, this dataset's {supports})"
    return _other_data(record.get("data_sha256"), expect.get("data_sha256"))


def _other_data(saved, now: Optional[str]) -> Optional[str]:
    """Why a run that recorded the data fingerprint ``saved`` was trained on other data than ``now``'s, or
    ``None`` (also when either is ``None``: a run saved before fingerprints were recorded)."""
    if saved is None or now is None or saved == now:
        return None
    return f"was trained on other data (data SHA-256 {str(saved)[:12]}... then, {now[:12]}... now)"


def _number(value, finite: bool = True) -> bool:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return ok and (not finite or math.isfinite(value))


def _parse_result(path: Path, metric_names: Sequence[str] = ()) -> tuple[Any, Optional[str]]:
    """``(record, None)``, or ``(None, what is wrong)``: every field the report reads, checked (a NaN metric,
    a deleted one or a null ``explain_away`` ended the report in a traceback)."""
    try:
        record = json_loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        return None, f"cannot be read ({type(exc).__name__}: {first})"
    if not isinstance(record, dict):
        return None, f"holds a JSON {type(record).__name__}, not a run result"
    for key, kind in _RESULT_KEYS.items():
        if not isinstance(record.get(key), kind) or isinstance(record.get(key), bool):
            return None, f"has no valid {key!r}"
    if not math.isfinite(record["step_time_s"]):
        return None, "has no valid 'step_time_s'"
    metrics = record["metrics"]
    for name in metric_names:
        if name not in metrics:
            return None, f"has no metric {name!r}"
        if not _number(metrics[name]):
            return None, f"has a metric {name!r} that is not a finite number ({metrics[name]!r})"
    for name, value in metrics.items():
        if isinstance(value, (int, float)) and not _number(value):
            return None, f"has a metric {name!r} that is not a finite number ({value!r})"
    explain = record.get("explain_away")
    if not isinstance(explain, dict) or any(
        explain.get(key) is not None and not _number(explain.get(key)) for key in ("min", "min_normalized")
    ) or not {"min", "min_normalized"} <= set(explain):
        return None, "has no valid 'explain_away'"
    u = record.get("hybrid_u")
    if u is not None and _matrix(u) is None:
        return None, "has no valid 'hybrid_u'"
    where = _non_finite(record)
    if where is not None:  # results.json is written strictly (a bare NaN is not JSON)
        return None, f"holds a number that is not finite at {where}"
    if not _count(record.get("eval_examples")):  # the report reads it: "on N evaluation examples"
        return None, "has no valid 'eval_examples'"
    if "world_size" in record and not (_count(record["world_size"]) and record["world_size"] > 0):
        return None, "has no valid 'world_size'"
    why = _check_history(record["history"], record["steps"], metric_names) or _check_run_fields(record)
    return (None, why) if why else (record, None)


def _non_finite(value, where: str = "") -> Optional[str]:
    """Where the first NaN or infinity is in parsed JSON or a loaded ``state.pt`` (a float or a floating-point
    tensor in nested dicts, lists and tuples): ``"history/0/train_loss"``, ``"model/embed.weight"``; ``None``
    when there is none."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (where or "the top")
    if isinstance(value, Tensor):
        finite = not value.is_floating_point() or bool(torch.isfinite(value).all())
        return None if finite else (where or "a tensor")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(
        value, (list, tuple)) else ()
    for key, item in items:
        found = _non_finite(item, f"{where}/{key}" if where else str(key))
        if found is not None:
            return found
    return None


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _matrix(value) -> Optional[tuple[int, int]]:
    """``(rows, columns)`` of a non-empty rectangular list of lists of finite numbers, else ``None``."""
    if not (isinstance(value, list) and value and all(isinstance(row, list) and row for row in value)):
        return None
    if len({len(row) for row in value}) != 1 or not all(_number(x) for row in value for x in row):
        return None
    return len(value), len(value[0])


def _check_history(history: list, steps: int, metric_names: Sequence[str] = ()) -> Optional[str]:
    """What is wrong with a metrics history (the report plots it: a text accuracy ended it in a traceback),
    or ``None``: one dict per evaluation, steps rising within ``1..steps``, finite numbers, ``hybrid_u``
    of one shape."""
    last, shapes = 0, set()
    for i, h in enumerate(history):
        if not isinstance(h, dict) or not isinstance(h.get("step"), int) or isinstance(h["step"], bool):
            return f"has no valid 'history' (entry {i} has no step)"
        if not last < h["step"] <= steps:
            return f"has no valid 'history' (entry {i} is at step {h['step']!r}, after {last}, of {steps})"
        last = h["step"]
        for key in ("train_loss", *metric_names):
            if not _number(h.get(key)):
                return f"has no valid 'history' (entry {i}: {key} {h.get(key)!r} is not a finite number)"
        for key, value in h.items():
            if key not in ("step", "hybrid_u") and value is not None and not _number(value):
                return f"has no valid 'history' (entry {i}: {key} {value!r} is not a finite number)"
        if h.get("hybrid_u") is not None:
            shapes.add(_matrix(h["hybrid_u"]))
    if None in shapes or len(shapes) > 1:
        return "has no valid 'history' (its hybrid_u is not one layers x heads table of numbers)"
    return None


def _check_run_fields(record: dict) -> Optional[str]:
    """What is wrong with the per-step, per-example and per-class fields of a run result that the report
    reads (``None`` when they are absent or valid); lengths agree with ``steps``, ``eval_examples`` and
    ``classes``."""
    losses = record.get("step_losses")
    if losses is not None and not (
        isinstance(losses, list) and len(losses) <= record["steps"] and all(_number(x) for x in losses)
    ):
        return "has no valid 'step_losses' (finite numbers, at most one per step)"
    spread = record.get("step_times_s")
    if spread is not None and not (
        isinstance(spread, dict) and all(_number(spread.get(k)) for k in ("min", "median", "max"))
        and 0 <= spread["min"] <= spread["median"] <= spread["max"]
    ):
        return "has no valid 'step_times_s'"
    load = record.get("load_average_max")
    if load is not None and not _number(load):
        return "has no valid 'load_average_max'"
    if record.get("cpp_kernels") not in (None, True, False):
        return "has no valid 'cpp_kernels'"
    if record.get("data_sha256") is not None and not isinstance(record["data_sha256"], str):
        return "has no valid 'data_sha256'"
    samples = record.get("samples")
    if not isinstance(samples, list) or not all(isinstance(x, dict) for x in samples) or len(
        {tuple(x) for x in samples}
    ) > 1:
        return "has no valid 'samples'"
    preds = record.get("predictions")
    if preds is not None and not (
        isinstance(preds, list) and len(preds) == record["eval_examples"]
        and (all(_count(p) for p in preds) or all(isinstance(p, str) for p in preds))
    ):
        return f"has no valid 'predictions' (one per evaluation example, {record['eval_examples']})"
    classes, confusion = record.get("classes"), record.get("confusion")
    if classes is None and confusion is None:
        return None
    k = len(classes) if isinstance(classes, list) else 0
    if not k or not all(
        isinstance(c, dict) and isinstance(c.get("name"), str) and _count(c.get("support"))
        and all(_number(c.get(key)) and 0 <= c[key] <= 1 for key in ("precision", "recall", "f1"))
        for c in classes
    ):
        return "has no valid 'classes'"
    if not (isinstance(confusion, list) and len(confusion) == k and all(
        isinstance(row, list) and len(row) == k and all(_count(x) for x in row) for row in confusion
    ) and sum(map(sum, confusion)) == record["eval_examples"]):
        return f"has no valid 'confusion' ({k} x {k} counts summing to {record['eval_examples']})"
    if preds is not None and not all(isinstance(p, int) and p < k for p in preds):
        return f"has no valid 'predictions' (class indices below {k})"
    return None


def _load_rng(file: Path) -> tuple[dict[str, Tensor], dict]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        meta = json_loads((f.metadata() or {})["attnkit_rng"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    for key in ("python", "numpy", "torch"):
        if key not in tensors:
            raise KeyError(f"no {key!r} state")
    return tensors, meta


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    """The newest complete checkpoint of ``run_dir`` (one whose ``trainer.json`` was written), or ``None``."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob("step-*") if (p / TRAINER_FILE).is_file())
    return done[-1] if done else None


def save_checkpoint(
    accelerator, run_dir: Path, step: int, model, optimizer, scheduler, trainer: dict, reg=None
) -> None:
    path = Path(run_dir) / "checkpoints" / f"step-{step:07d}"
    if accelerator.is_main_process:
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
    accelerator.wait_for_everyone()
    try:
        _save_rng(path / f"rng-rank{accelerator.process_index}.safetensors")
        if accelerator.is_main_process:
            state = {
                "model": accelerator.unwrap_model(model).state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
            }
            if reg is not None:  # the alignment regularizer's discriminator / critic and its sampling stream
                state["regularizer"] = reg.state_dict()
                state["regularizer_rng"] = reg._generator.get_state()
            torch.save(state, path / "state.pt")  # tensors and numbers only: read back with weights_only=True
    except BaseException:  # a full disk, Ctrl-C: the partial step folder goes (the earlier one stays whole)
        if accelerator.is_main_process:
            shutil.rmtree(path, ignore_errors=True)
        raise
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        tmp = path / (TRAINER_FILE + ".tmp")
        try:
            tmp.write_text(json.dumps(trainer))
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        os.replace(tmp, path / TRAINER_FILE)
        for old in (Path(run_dir) / "checkpoints").glob("step-*"):
            if old != path:
                rmtree_named(old)  # a refusal names the full path (rmtree named 'rng-rank0.safetensors')
    accelerator.wait_for_everyone()


def finished_result(
    run_dir: Path, mechanism: str, seed: int, world: int, metric_names: Sequence[str] = (),
    expect: Optional[dict] = None,
) -> Optional[dict]:
    """The record of ``run_dir``'s finished run, ``None`` when it has none; a ``ValueError`` when it is
    damaged, of another configuration than ``expect`` (``run_expectations``) or ran on another number of
    processes than ``world`` (a comparison would set step times of different process counts side by side)."""
    path = Path(run_dir) / RESULT_FILE
    if not path.is_file():
        return None
    record = _read_result(path, mechanism, seed, metric_names, expect)
    if record.get("world_size", world) != world:
        raise ValueError(
            f"run {str(run_dir)!r} finished with {record['world_size']} process(es) and this run has "
            f"{world}; resume with the same number of processes, or start over with --overwrite"
        )
    return record


def run_expectations(task, data, config: CompareConfig) -> dict:
    """What a finished run of ``config`` on ``task`` records (``finished_result``'s ``expect``): its steps,
    evaluation and training examples, a classification task's class names and test examples per class
    (``supports``), and the data's fingerprint (``data_fingerprint``), which its checkpoints record too.

    A result or checkpoint saved before fingerprints were recorded (an older attnkit) is checked by what it
    does record (sizes, class names, supports) and accepted otherwise. Computed once per comparison."""
    labels = getattr(data, "label_names", None) if task.kind == "classification" else None
    supports = None
    if labels is not None:  # (C,) test examples per class, as per_class counts them
        supports = torch.bincount(data.test_labels, minlength=len(labels)).tolist()
    return {"steps": config.total_steps, "eval_examples": task.num_eval(data),
            "train_examples": task.num_train(data), "labels": None if labels is None else list(labels),
            "supports": supports, "data_sha256": data_fingerprint(data)}


def data_fingerprint(data) -> Optional[str]:
    """The SHA-256 of both splits as the task sees them: every tensor of its encoded ``data`` (token ids,
    masks, labels or targets, in order) and every list of strings (test texts, class names), field by field
    with its name, dtype and shape; ``None`` when ``data`` is not a dataclass. A run trained on other examples
    of the same sizes (integer labels read as other classes, a regenerated split) has another one."""
    if not dataclasses.is_dataclass(data):
        return None
    digest = hashlib.sha256()
    for field in dataclasses.fields(data):
        value = getattr(data, field.name)
        if isinstance(value, Tensor):
            flat = value.detach().cpu().contiguous().reshape(-1)  # (N * L,)
            digest.update(f"{field.name} {value.dtype} {tuple(value.shape)}\n".encode())
            digest.update(flat.view(torch.uint8).numpy().tobytes())
        elif isinstance(value, list) and all(isinstance(x, str) for x in value):
            digest.update(f"{field.name} {json.dumps(value)}\n".encode())
    return digest.hexdigest()


def _load_checkpoint(accelerator, path: Path, model, optimizer, scheduler, reg=None, *,
                     run: Optional[tuple[str, int, int, Optional[str]]] = None) -> dict:
    """Restore a checkpoint; nothing in it is unpickled (``weights_only=True``, safetensors, JSON).

    Any file that is missing, truncated or not ours raises one ``ValueError`` that names it, and so does a
    checkpoint of another run than ``run`` = ``(mechanism, seed, total steps, data fingerprint)`` (a copied
    folder trained seed 1 as seed 0's duplicate; one trained on other data) or whose step disagrees with its
    folder and its records.
    """
    trainer = _read_checkpoint_file(path / TRAINER_FILE, lambda f: json_loads(f.read_text()))
    kinds = {"step": int, "history": list, "time_sum": (int, float), "time_count": int,
             "loss_sum": (int, float), "loss_count": int, "world_size": int}
    optional = {"load_max": (int, float), "step_times": list, "step_losses": list}

    def numbers(value, finite: bool = False) -> bool:
        return all(_number(x, finite) for x in (value if isinstance(value, list) else [value]))

    ours = isinstance(trainer, dict) and all(isinstance(trainer.get(k), t) for k, t in kinds.items())
    if not ours or not all(
        k not in trainer or (isinstance(trainer[k], t) and numbers(trainer[k])) for k, t in optional.items()
    ):
        raise _checkpoint_error(path / TRAINER_FILE, "is not an attnkit trainer state")
    infinite = [k for k in [*kinds, *optional] if k in trainer and k != "history"
                and not numbers(trainer[k], finite=True)]
    if infinite:  # a NaN loss_sum was written into results.json as bare NaN
        raise _checkpoint_error(path / TRAINER_FILE, f"holds a number that is not finite in {infinite[0]!r}")
    if run is not None:
        _check_checkpoint_run(path, trainer, *run)
    why = _check_history(trainer["history"], trainer["step"])
    if why is not None:  # the run trained on and wrote it into result.json: every later --resume failed
        raise _checkpoint_error(path / TRAINER_FILE, why)
    if trainer["world_size"] != accelerator.num_processes:
        raise ValueError(
            f"checkpoint {str(path)!r} was written by {trainer['world_size']} process(es); "
            "resume it with the same "
            f"number (this run has {accelerator.num_processes}) or start over with --overwrite"
        )
    state_file = path / "state.pt"
    state = _read_checkpoint_file(state_file, lambda f: torch.load(f, map_location="cpu", weights_only=True))
    bad = _non_finite(state)
    if bad is not None:  # NaN weights trained on were blamed on lr ("the training loss became nan")
        raise _checkpoint_error(state_file, f"holds non-finite values (NaN or infinity) in {bad}")

    def restore(_file: Path) -> None:
        try:
            accelerator.unwrap_model(model).load_state_dict(state["model"])
            if reg is not None and "regularizer" in state:  # checkpoints from before it was saved: fresh
                reg.load_state_dict(state["regularizer"])
        except RuntimeError as exc:  # another model: name what differs (the first line says nothing)
            raise _checkpoint_error(file=state_file, problem=f"does not fit this run's model "
                                    f"({state_mismatch(exc)})") from None
        saved = _split_hybrid_group(state["optimizer"], optimizer, accelerator.unwrap_model(model))
        optimizer.load_state_dict(saved)
        schedule = state["scheduler"]
        if saved is not state["optimizer"] and isinstance(schedule, dict):  # its per-group lists too
            schedule = {k: (v[:1] + v[:1] + v[1:] if k in ("base_lrs", "_last_lr", "lr_lambdas")
                            and isinstance(v, list) and len(v) == len(optimizer.param_groups) - 1 else v)
                        for k, v in schedule.items()}
        scheduler.load_state_dict(schedule)
        if reg is not None and "regularizer" in state:
            reg._generator.set_state(state["regularizer_rng"])

    _read_checkpoint_file(state_file, restore)
    rng_file = path / f"rng-rank{accelerator.process_index}.safetensors"
    rng = _read_checkpoint_file(rng_file, _load_rng)
    _read_checkpoint_file(rng_file, lambda f: _set_rng_state(*rng))
    return trainer


def hybrid_weight(name: str) -> bool:
    """Whether the parameter ``name`` is an HNAS hybrid weight (``theta`` of attnkit's modules,
    ``attnkit_theta`` of a converted model): it takes no weight decay, which would pull every ``u`` towards
    1/2 (``theta = 0``) whatever the task wants."""
    return name.rsplit(".", 1)[-1] in ("theta", "attnkit_theta")


def _split_hybrid_group(saved: dict, optimizer, model) -> dict:
    """``saved`` (an optimizer state_dict) in ``optimizer``'s layout of parameter groups: checkpoints written
    before the hybrid weights had a group of their own kept them in the first group with the other model
    parameters (decayed); they move to the second, undecayed group with their Adam moments, so that such a run
    resumes (without decay from there on)."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    now = optimizer.state_dict()["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(now) - 1 or len(now) < 2 or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        return saved
    hybrid = [hybrid_weight(n) for n, _ in model.named_parameters()]
    if not any(hybrid) or len(groups[0]["params"]) != len(hybrid) or now[1].get("weight_decay") != 0.0:
        return saved
    old = groups[0]["params"]  # saved ids in model.parameters() order
    kept = [i for i, h in zip(old, hybrid) if not h]
    moved = [i for i, h in zip(old, hybrid) if h]
    first = {**groups[0], "params": kept}
    second = {**groups[0], "params": moved, "weight_decay": 0.0}
    # the optimizer numbers its parameters in group order: renumber so that ids follow the new layout
    order = kept + moved + [i for g in groups[1:] for i in g["params"]]
    renumber = {old_id: new_id for new_id, old_id in enumerate(order)}
    regroup = [first, second, *groups[1:]]
    return {
        "state": {renumber[i]: v for i, v in saved.get("state", {}).items() if i in renumber},
        "param_groups": [{**g, "params": [renumber[i] for i in g["params"]]} for g in regroup],
    }


def _check_checkpoint_run(path: Path, trainer: dict, mechanism: str, seed: int, total: int,
                          data_sha256: Optional[str] = None) -> None:
    """The checkpoint at ``path`` is one of this run (``mechanism``, ``seed``) part-way through its ``total``
    steps on the data of fingerprint ``data_sha256`` (not checked when either is missing), its step the one
    its folder is named after and its records as long as that step."""
    file = path / TRAINER_FILE
    owner = (trainer.get("mechanism", mechanism), trainer.get("seed", seed))
    why = None
    if owner != (mechanism, seed):
        why = f"is of {owner[0]} seed {owner[1]}, not {mechanism} seed {seed}"
    why = why or _other_data(trainer.get("data_sha256"), data_sha256)
    if why is not None:
        raise ValueError(
            f"checkpoint {str(path)!r} {why}; delete {str(path.parent.parent)!r} to train that run again "
            "with --resume"
        )
    step = trainer["step"]
    history = [h.get("step") if isinstance(h, dict) else None for h in trainer["history"]]
    consistent = (
        0 < step <= total and path.name == f"step-{step:07d}" and trainer["time_count"] == step
        and len(trainer.get("step_losses", [0] * step)) == step
        and all(isinstance(h, int) and 0 < h <= step for h in history) and history == sorted(set(history))
    )
    if not consistent:
        raise _checkpoint_error(file, f"records step {step} of a {total}-step run, which disagrees with its "
                                      "folder name or its own records")


def load_checkpoint_everywhere(accelerator, path: Path, model, optimizer, scheduler, reg,
                                run: Optional[tuple[str, int, int, Optional[str]]] = None) -> dict:
    """``_load_checkpoint`` in every process, which all stop with one line when any of them could not read
    its part (a damaged ``rng-rank1`` stopped process 1 alone, and process 0 died later in a collective with a
    gloo traceback)."""
    error: Optional[ValueError] = None
    trainer: dict = {}
    try:
        trainer = _load_checkpoint(accelerator, path, model, optimizer, scheduler, reg, run=run)
    except ValueError as exc:
        error = exc
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        errors = gather_object([None if error is None else str(error)])  # one entry per process
        failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
        if failed and error is None:
            rank, message = failed[0]
            error = ValueError(f"process {rank} could not resume: {message}")
    if error is not None:
        raise error
    return trainer
