"""``attnkit compare``: train the same model with several mechanisms under the same seeds and budget.

``run_compare(config)`` loops over mechanisms x seeds (``train.train_run``), skips finished runs when
resuming, aggregates mean +- std over seeds and writes ``results.json``, ``results.csv``, the plots and
``report.html`` into the run directory ``config.out``:

    out/
      config.json            the configuration (a resumed run must match it)
      runs/<mechanism>-seed<k>/result.json, model.pt, checkpoints/
      results.json  results.csv  learning_curves.png  hybrid_weights.png  report.html
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from .._files import json_loads, lock_folder, write_text_file
from .config import CompareConfig, _is_file_task, canonical_task
from .summary import RunClock, _duration, cpp_kernels, summarize, tracker_config
from .checkpoints import RESULT_FILE, finished_result, run_expectations
from .train import batch_indices, check_batch_split, train_run

__all__ = ["CompareResult", "run_compare", "aggregate", "prepare_run_dir", "CONFIG_FILE"]

CONFIG_FILE = "config.json"
_MARKER = "attnkit compare"


@dataclass
class CompareResult:
    """The aggregated table (one record per mechanism), every run's record, and where they were written."""

    config: CompareConfig
    task: object
    records: list[dict]
    runs: list[dict]
    out: Path
    files: dict
    extras: dict = field(default_factory=dict)


def _mean_std(values: list) -> tuple[Optional[float], Optional[float]]:
    values = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def _median_step(run: dict) -> float:
    """A run's median optimizer-step time in seconds (its mean where the steps were not recorded)."""
    spread = run.get("step_times_s")
    return spread["median"] if spread else run["step_time_s"]


def aggregate(runs: list[dict], mechanisms: tuple[str, ...], baseline: str = "softmax") -> list[dict]:
    """One record per mechanism: mean and std over seeds of each metric, step time relative to ``baseline``.

    ``step_time_rel`` divides the median optimizer-step time (evaluation excluded; a run's median step, then
    the median over seeds, so that neither one slow step such as a garbage-collector pause nor one slow run
    moves it, the same number as the summary's ``timing``; the mean step where a run did not record its
    steps) by the baseline's; when the baseline was not run, the first
    mechanism is the baseline (``step_time_baseline`` says which). ``step_time_s`` is the mean step.
    ``explain_away_min_normalized`` is the smallest ``n_k * min_j sum_i pi_ij`` over layers and seeds
    (Lemma 1: >= 1 for DNAS); ``hybrid_u`` is the final ``u`` per layer and head, averaged over seeds.
    """
    if baseline not in mechanisms:
        baseline = mechanisms[0]
    by_mech = {m: [r for r in runs if r["mechanism"] == m] for m in mechanisms}
    base_time = statistics.median(_median_step(r) for r in by_mech[baseline])
    records = []
    for mech in mechanisms:
        group = by_mech[mech]
        record: dict = {"mechanism": mech, "seeds": [r["seed"] for r in group], "n_seeds": len(group)}
        metric_names = [k for k, v in group[0]["metrics"].items() if isinstance(v, (int, float))]
        for name in metric_names:
            record[f"{name}_mean"], record[f"{name}_std"] = _mean_std([r["metrics"][name] for r in group])
        record["step_time_s"], _ = _mean_std([r["step_time_s"] for r in group])
        seed_times = [_median_step(r) for r in group]
        record["step_time_median_s"] = statistics.median(seed_times)
        record["step_time_rel"] = record["step_time_median_s"] / base_time if base_time else None
        record["step_time_rel_min"] = min(seed_times) / base_time if base_time else None
        record["step_time_rel_max"] = max(seed_times) / base_time if base_time else None
        record["step_time_baseline"] = baseline
        mins = [
            r["explain_away"]["min_normalized"]
            for r in group
            if r["explain_away"]["min_normalized"] is not None
        ]
        raw = [r["explain_away"]["min"] for r in group if r["explain_away"]["min"] is not None]
        record["explain_away_min_normalized"] = min(mins) if mins else None
        record["explain_away_min_raw"] = min(raw) if raw else None
        us = [r["hybrid_u"] for r in group if r["hybrid_u"] is not None]
        if us:
            layers, heads = len(us[0]), len(us[0][0])
            record["hybrid_u"] = [
                [statistics.fmean(u[l][h] for u in us) for h in range(heads)] for l in range(layers)
            ]
            record["hybrid_u_mean"] = statistics.fmean(x for row in record["hybrid_u"] for x in row)
        else:
            record["hybrid_u"], record["hybrid_u_mean"] = None, None
        records.append(record)
    return records


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _is_run_dir(out: Path) -> bool:
    try:
        return json_loads((out / CONFIG_FILE).read_text()).get("created_by") == _MARKER
    except (OSError, ValueError, AttributeError):
        return False


def _check_config_file(out: Path) -> None:
    """A ``config.json`` that is there but cannot be read (cut short, overwritten) makes the directory neither
    resumable nor provably ours: say so, instead of advising --resume and --overwrite in turn."""
    path = out / CONFIG_FILE
    if not path.is_file():
        return
    try:
        payload = json_loads(path.read_text())
        ours = isinstance(payload, dict) and payload.get("created_by") == _MARKER
        if ours and not isinstance(payload.get("config"), dict):  # a KeyError traceback on --resume
            found = json.dumps(payload["config"])[:40] if "config" in payload else "missing"
            raise ValueError(f"its 'config' is {found}, not a JSON object of settings")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"{str(path)!r} is damaged ({type(exc).__name__}: {exc}), so the run in {str(out)!r} can be "
            "neither resumed nor recognized as ours; move or delete that directory yourself, or choose "
            "another --out"
        ) from None
    except OSError as exc:
        raise PermissionError(f"cannot read {str(path)!r} ({exc.strerror or type(exc).__name__})") from None


def _check_writable(out: Path) -> None:
    from .._files import check_link

    check_link(out, "--out")  # a dangling link: named as such (mkdir said only "File exists")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise PermissionError(
            f"cannot write to the run directory {str(out)!r} ({exc.strerror or type(exc).__name__}); "
            "choose another --out"
        ) from None
    _check_run_folders(out)


def _check_run_folders(out: Path) -> None:
    """The folders a resumed run writes into and deletes from (runs/, each run's folder, its checkpoints/
    and step folders) can be written: a read-only one failed only after training, naming a bare file
    ("Permission denied: 'rng-rank0.safetensors'")."""
    runs = out / "runs"
    folders = [runs, *runs.glob("*"), *runs.glob("*/checkpoints"), *runs.glob("*/checkpoints/*")]
    for folder in folders:
        if folder.is_dir() and not os.access(folder, os.R_OK | os.W_OK | os.X_OK):
            raise PermissionError(
                f"cannot write to {str(folder)!r}, a folder of the run directory {str(out)!r} "
                f"({os.strerror(errno.EACCES)}); make it writable or choose another --out"
            )


def _lock_run_dir(out: Path, overwrite: bool = False) -> Optional[int]:
    """An exclusive lock on the run directory ``out``: two processes continuing one run would delete each
    other's checkpoints; the second gets a ``ValueError`` (``overwrite``: worded for replacing the run)."""
    doing = "replacing" if overwrite else "continuing"
    return lock_folder(out, f"attnkit compare process: wait for it to finish (or stop it) before {doing} "
                            "this run, or choose another --out")


def saved_config(out: str | Path) -> Optional[dict]:
    """The configuration saved in run directory ``out`` (for ``--resume``), or ``None``."""
    path = Path(out) / CONFIG_FILE
    if not _is_run_dir(Path(out)):
        return None
    _check_config_file(Path(out))  # the marker with no "config" object: damaged, not a traceback
    return json_loads(path.read_text())["config"]


# what a run writes into its directory (the report's images by name, the trackers' folders): --overwrite
# deletes these and keeps whatever else the user put there (notes, the --config file)
_OWN_OUTPUTS = ("config.json", "results.json", "results.csv", "report.html", "learning_curves.png",
                "confusion_matrices.png", "hybrid_weights.png", "runs", ".write-test")


def own_outputs(out: str | Path) -> list[Path]:
    """The files and folders of an earlier run in ``out`` that ``--overwrite`` deletes (config.json last)."""
    from .config import TRACKERS

    names = (*_OWN_OUTPUTS, *TRACKERS)
    found = [Path(out) / name for name in names if os.path.lexists(Path(out) / name)]
    return sorted(found, key=lambda p: p.name == CONFIG_FILE)


def _own_run_files(out: Path, name: str) -> list[Path]:
    """``runs/*/name`` in real folders of ``out`` only: a symbolic link (``runs`` itself, or a run's folder)
    is deleted as a link, never followed (``glob`` followed them, and --overwrite deleted result.json files
    outside ``out``)."""
    runs = out / "runs"
    if runs.is_symlink() or not runs.is_dir():
        return []
    return [d / name for d in runs.iterdir()
            if d.is_dir() and not d.is_symlink() and (d / name).is_file() and not (d / name).is_symlink()]


def _delete_outputs(out: Path) -> None:
    """Delete the earlier run's outputs in ``out`` for ``--overwrite``, or nothing when one of them cannot be
    deleted (a folder of another user's, mode 0555: the deletion stopped half-way, the error named a bare
    file). Each run's result.json, by which --resume keeps a run as finished, goes first: a run stopped
    (Ctrl-C) meanwhile never leaves one without its model.pt; config.json, the mark by which --overwrite and
    --resume know the folder, goes last."""
    from .._files import check_deletable, rmtree_named

    outputs = own_outputs(out)
    check_deletable(outputs, f"--overwrite of {str(out)!r}")
    for finished in _own_run_files(out, RESULT_FILE):
        finished.unlink()
    for child in outputs:
        if child.is_dir() and not child.is_symlink():
            rmtree_named(child)
        else:
            child.unlink()


def doomed_by_overwrite(path: str | Path, out: str | Path) -> bool:
    """Whether ``--overwrite`` of the run directory ``out`` would delete ``path`` (it is one of the earlier
    run's outputs or lies in one of its folders)."""
    return any(lies_in(path, own) for own in own_outputs(out))


def lies_in(path: str | Path, folder: str | Path) -> bool:
    """Whether ``path`` lies in ``folder``, as written (a symbolic link in the folder to a file elsewhere is
    deleted with the folder) or with the links followed."""
    return any(
        Path(p).is_relative_to(f)
        for p in (os.path.abspath(path), os.path.realpath(path))
        for f in (os.path.abspath(folder), os.path.realpath(folder))
    )


def _task_digest(config: CompareConfig) -> Optional[str]:
    """The SHA-256 of the ``--task`` dataset file, or for a catalog dataset in the cache of its manifest's
    file digests (``data fetch --force`` can replace it: SST-2 from another source); ``None`` for a
    generated task or a dataset not fetched yet."""
    from ..data.cache import sha256_bytes, sha256_file

    if _is_file_task(config.task):
        return sha256_file(config.task) if Path(config.task).is_file() else None
    from ..data import DATASETS
    from ..data.cache import dataset_cache_dir, read_manifest

    if config.task not in DATASETS:
        return None
    try:
        manifest = read_manifest(dataset_cache_dir(config.task))
    except (ValueError, OSError):  # a damaged manifest: loading the dataset names it
        return None
    if not manifest or manifest.get("corrupt") or manifest.get("source") == "generated":
        return None
    return sha256_bytes(json.dumps(manifest["files"], sort_keys=True).encode())


def check_task_unchanged(config: CompareConfig, out: Path, what: str, fix: str = "") -> None:
    """A ``ValueError`` when the ``--task`` file differs from the one the run in ``out`` started with (its
    SHA-256 in config.json; runs saved before it was recorded are not checked): ``what`` says who refuses,
    ``fix`` what else to do besides restoring the file."""
    saved = json_loads((Path(out) / CONFIG_FILE).read_text()).get("task_sha256")
    digest = _task_digest(config)
    if digest is None and not _is_file_task(config.task):
        return  # a catalog dataset not in this cache (another ATTNKIT_CACHE): loading it fetches or names it
    if saved is not None and digest != saved:  # the runs of one report, and its models, on one dataset
        dataset = (f"the dataset file {config.task!r}" if _is_file_task(config.task)
                   else f"the dataset {config.task!r} in the cache (fetched again?)")
        raise ValueError(
            f"{what}: {dataset} changed since the run in {str(out)!r} started "
            f"(SHA-256 {saved[:12]}... then, {str(digest)[:12]}... now); restore it"
            + (f", {fix}" if fix else "")
        )


def _moved_task_file(config: CompareConfig, out: Path, saved_task) -> bool:
    """Whether the run in ``out`` was started on a dataset file with the contents of ``config.task`` under
    another path (its SHA-256 in config.json)."""
    if not (isinstance(saved_task, str) and _is_file_task(saved_task) and _is_file_task(config.task)):
        return False
    recorded = json_loads((out / CONFIG_FILE).read_text()).get("task_sha256")
    return recorded is not None and recorded == _task_digest(config)


def prepare_run_dir(config: CompareConfig, is_main_process: bool = True) -> Path:
    """Check the run directory against ``resume`` / ``overwrite`` and, on the main process, create it.

    A non-empty directory is an error unless ``resume`` (it must hold a run with the same configuration)
    or ``overwrite`` (it must be an earlier ``attnkit compare`` run directory, whose outputs are then
    deleted: config.json, results, report, plots, runs/, tracker logs; other files in it stay).
    """
    out = Path(config.out)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {str(out)!r} is a file, not a directory; choose another --out")
    non_empty = out.is_dir() and any(out.iterdir())
    if non_empty:
        _check_config_file(out)
    moved = False
    if config.resume:
        if not _is_run_dir(out):
            raise FileNotFoundError(
                f"--resume: {str(out)!r} holds no attnkit compare run to continue; drop --resume to start one"
            )
        saved = json_loads((out / CONFIG_FILE).read_text())["config"]
        if isinstance(saved.get("task"), str):  # saved as given before: "Reuters8" is reuters8
            saved["task"] = canonical_task(saved["task"])
        if isinstance(saved.get("task"), str) and _is_file_task(saved["task"]):  # saved relative before
            saved["task"] = os.path.abspath(saved["task"])
        current = config.result_dict()
        changed = {k: (saved.get(k), v) for k, v in current.items() if saved.get(k) != v}
        moved = "task" in changed and _moved_task_file(config, out, saved["task"])
        if moved:  # the same file under another path (the project was moved): recorded where it is now
            del changed["task"]
        if changed:
            detail = ", ".join(f"{k}: saved {a!r}, given {b!r}" for k, (a, b) in sorted(changed.items()))
            raise ValueError(
                f"--resume: the run in {str(out)!r} was started with other settings ({detail}); "
                "pass the same settings, or --overwrite to start over"
            )
        check_task_unchanged(config, out, "--resume", "or pass --overwrite to start over")
    elif non_empty and not config.overwrite:
        raise FileExistsError(
            f"run directory {str(out)!r} exists and is not empty; pass --resume to continue it, "
            "--overwrite to replace it, or choose another --out"
        )
    elif non_empty and config.overwrite and not _is_run_dir(out):
        raise FileExistsError(
            f"--overwrite: {str(out)!r} is not an attnkit compare run directory (no {CONFIG_FILE} of ours); "
            "refusing to delete it, choose another --out"
        )
    if config.overwrite and non_empty and _is_file_task(config.task):
        if doomed_by_overwrite(config.task, out):
            raise ValueError(
                f"--overwrite would delete {config.task!r}, the --task file, which lies among the outputs of "
                f"the run directory {str(out)!r}; move it out of the folder first"
            )
    if is_main_process:
        if non_empty and config.overwrite:  # the contents: --out may be a symbolic link to the folder
            # config.json, the mark by which --overwrite and --resume know the folder, goes last: a run
            # stopped (Ctrl-C) while runs/ is deleted leaves a folder that --overwrite still replaces;
            # the user's other files in it stay
            _delete_outputs(out)
        _check_writable(out)
        if config.resume and moved:
            payload = json_loads((out / CONFIG_FILE).read_text())
            payload["config"]["task"] = config.task
            write_text_file(out / CONFIG_FILE, json.dumps(payload, indent=1), overwrite=True)
        if not config.resume:
            payload = {"created_by": _MARKER, "config": config.result_dict(),
                       "task_sha256": _task_digest(config)}
            (out / CONFIG_FILE).write_text(json.dumps(payload, indent=1))
    return out


def run_compare(
    config: CompareConfig,
    *,
    accelerator=None,
    task=None,
    on_step: Optional[Callable[[str, int, int], None]] = None,
) -> CompareResult:
    """Run every mechanism x seed of ``config`` and write the results; see the module docstring.

    ``task`` replaces the task named by ``config.task`` (a ``runner.tasks`` task object);
    ``on_step(mechanism, seed, step)`` is called after every optimizer step.
    """
    import torch
    from accelerate import Accelerator

    if config.plots:  # before any training: the plots and the report come after every run
        from ..analysis.plots import _pyplot

        _pyplot()
    if accelerator is None:
        # On a machine without a GPU, processes started by ``accelerate launch --multi_gpu`` or ``torchrun``
        # train together on the CPU (gloo); Accelerate only forms that group when told to use the CPU.
        tracking = {}
        # Accelerate's trackers, e.g. TensorBoard event files in OUT/tensorboard
        if config.log_with is not None:
            tracking = {"log_with": config.log_with, "project_dir": str(Path(config.out) / config.log_with)}
        accelerator = Accelerator(cpu=not torch.cuda.is_available(), **tracking)
    threads_before = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    try:
        return _run_compare(config, accelerator, task, on_step)
    finally:
        torch.set_num_threads(threads_before)


def check_accelerator_settings(accelerator) -> None:
    """Refuse the settings an ``accelerate launch`` (or its environment) can hand ``compare`` that its runs
    would follow without recording them: mixed precision (bf16 autocast; a run resumed under it would mix
    float32 and bf16 steps) and gradient accumulation (Accelerate divides each step's loss by its steps while
    ``compare`` steps the optimizer every batch)."""
    precision = str(getattr(accelerator, "mixed_precision", "no"))
    if precision != "no":
        raise ValueError(
            f"accelerate's mixed precision is {precision!r} (accelerate launch --mixed_precision, its config "
            "file or ACCELERATE_MIXED_PRECISION); compare trains in float32 and its results do not record "
            "another precision: launch without it"
        )
    steps = getattr(accelerator, "gradient_accumulation_steps", 1)
    if steps != 1:
        raise ValueError(
            f"accelerate's gradient_accumulation_steps is {steps} (ACCELERATE_GRADIENT_ACCUMULATION_STEPS or "
            "its config); compare steps the optimizer every batch and would only divide the loss by it: "
            "unset it and raise batch_size instead"
        )


def _run_compare(config: CompareConfig, accelerator, task, on_step) -> CompareResult:
    from .tasks import get_task

    task = task or get_task(config.task)
    data = task.prepare(config)  # before touching the run directory: a missing dataset leaves nothing behind
    batch_indices(0, task.num_train(data), config.batch_size, 0)  # batch_size fits the training set
    check_batch_split(config.batch_size, accelerator.num_processes)
    check_accelerator_settings(accelerator)
    out = Path(config.out)
    # a run that fails before any finishes removes only the folders it made: --out, then its new parents
    made = [folder for folder in (out, *out.parents) if not os.path.lexists(folder)]  # deepest first
    # Every process checks the directory before any creates it, then the main process writes.
    error = None
    try:
        prepare_run_dir(config, is_main_process=False)
    except (ValueError, OSError) as exc:
        error = exc
    accelerator.wait_for_everyone()
    if error is not None:
        raise error
    locks: list[int] = []
    try:
        if accelerator.is_main_process:
            try:
                if out.is_dir():  # held while it is checked, resumed or replaced
                    locks.append(_lock_run_dir(out, bool(config.overwrite)))
                prepare_run_dir(config, is_main_process=True)
                replaced = bool(locks) and locks[-1] is not None and _inode(locks[-1]) != _inode(out)
                if not locks or replaced:  # a new (or replaced by --overwrite) directory: lock it too
                    locks.append(_lock_run_dir(out))
            except (ValueError, OSError) as exc:
                error = exc
        if accelerator.num_processes > 1:  # all processes stop when the main one could not take the directory
            from accelerate.utils import broadcast_object_list

            shared = broadcast_object_list([None if error is None else str(error)])
            if shared[0] is not None and error is None:
                error = ValueError(shared[0])
        if error is not None:
            raise error
        try:
            accelerator.wait_for_everyone()
            return _train_all(config, accelerator, task, data, out, on_step, made)
        except BaseException as exc:  # Ctrl-C, SIGTERM (the CLI's SystemExit), a crash, another process of
            # the launch lost (gloo's "Connection closed by peer"): as the README says, the folders made for
            # --out go when nothing is kept in them (stopped before the first checkpoint, or while trackers
            # start, the same command was then refused: "exists and is not empty"); a checkpoint or a
            # finished run stays for --resume
            if accelerator.is_main_process:
                _remove_unkept(out, made, config, keep_config=isinstance(exc, ValueError))
            raise
    finally:
        for fd in locks:
            if fd is not None:
                os.close(fd)


def _inode(target) -> tuple[int, int]:
    st = os.fstat(target) if isinstance(target, int) else os.stat(target)
    return st.st_dev, st.st_ino


def _record_kernels(record: dict, run_dir: Path, is_main: bool) -> None:
    """Add to a run just trained whether it had the C++ CPU kernels (``summary.cpp_kernels``), in its record
    and its result.json: a --resume in another environment then says that its runs mix the two."""
    kernels = cpp_kernels()[0]
    if kernels is None:
        return
    record["cpp_kernels"] = kernels
    if is_main:
        write_text_file(run_dir / RESULT_FILE, json.dumps(record, indent=1, allow_nan=False), overwrite=True)


def _kept(out: Path) -> tuple[bool, bool]:
    """Whether the run directory ``out`` holds a finished run, and a checkpoint."""
    return any((out / "runs").glob(f"*/{RESULT_FILE}")), any((out / "runs").glob("*/checkpoints/*"))


def _remove_unkept(out: Path, made: Sequence[Path], config: CompareConfig, keep_config: bool = False) -> None:
    """After a compare stopped or failed: unless ``out`` keeps a finished run or a checkpoint, remove what
    this call created there, the folders it made (``made``, ``out`` first) or, in an ``--out`` that existed
    (not for ``--resume``), its config.json and empty run folders; never a file of the user's.
    ``keep_config``: a setting's error (``_failed_training``) keeps the config.json of an ``--out`` that
    existed, and names ``--overwrite``."""
    if any(_kept(out)):
        return
    if made:
        _remove_made(out, made)
    elif not config.resume and not keep_config:
        _remove_started(out)


def _remove_made(out: Path, made: Sequence[Path]) -> None:
    """Remove the run directory ``out`` and then the parents this call made for it (``made[1:]``, deepest
    first) while they are empty: never another's file."""
    shutil.rmtree(out, ignore_errors=True)
    for folder in made[1:]:
        try:
            folder.rmdir()
        except OSError:
            break


def _remove_started(out: Path) -> None:
    """Remove from ``out``, a folder this run did not make, what a run stopped before its first checkpoint
    wrote there: its config.json and the empty folders of runs/ (the same command was refused, "exists and is
    not empty"); never another file. config.json, by which --overwrite knows the folder, stays while anything
    else does (a tracker's logs, or a file of the user's: without it the same --overwrite command was refused,
    "not an attnkit compare run directory")."""
    runs = out / "runs"
    if runs.is_dir() and not runs.is_symlink():
        for folder, _dirs, _files in os.walk(runs, topdown=False):  # the deepest first; links not followed
            try:
                os.rmdir(folder)
            except OSError:  # not empty: what the run keeps
                continue
    if _is_run_dir(out) and list(out.iterdir()) == [out / CONFIG_FILE]:
        (out / CONFIG_FILE).unlink(missing_ok=True)


def _failed_training(exc: ValueError, config: CompareConfig, out: Path, made: Sequence[Path],
                     is_main: bool = True) -> None:
    """After a run failed on a setting (the loss became NaN, ...): a run directory this call created
    (``made``: the folders it made, ``out`` first, then the parents it made for it) with no finished run
    and no checkpoint in it is removed by ``_run_compare`` (``_remove_unkept``), with those parents while
    they are empty, so that the corrected command is not refused and leaves nothing behind; otherwise the
    error names the way on (``--overwrite``: a resume with other settings is refused). Raises in both
    cases. (A checkpoint is kept: the error may be a defect rather than a setting, and ``--resume`` goes on
    from it once fixed.) Only the main process says what is kept: it decides, and when another process
    failed alone it meets a lost peer, not this error (a rank's "is kept" was false after the main process
    had removed the run directory)."""
    if not is_main:
        raise exc
    finished, saved = _kept(out)
    if made and not finished and not saved:
        raise exc
    if not config.resume:
        raise ValueError(
            f"{exc}; the run directory {str(out)!r} is kept"
            f"{' with its finished runs' if finished else ' with its checkpoints' if saved else ''}: "
            "pass --overwrite with the corrected settings to start it over"
        ) from exc  # a defect's traceback (the CLI shows it) goes back to where it was raised
    raise exc


def _train_all(
    config: CompareConfig, accelerator, task, data, out: Path, on_step, made: Sequence[Path] = ()
) -> CompareResult:
    from .progress import make_progress
    from .report import write_report

    plan = [(mech, seed) for mech in config.variants for seed in config.seed_list]
    expect = run_expectations(task, data, config)
    for mech, seed in plan:  # finished runs first: refused when damaged, of another configuration or
        finished_result(  # of another process count
            out / "runs" / f"{mech}-seed{seed}", mech, seed, accelerator.num_processes, task.metric_names,
            expect,
        )
    if config.log_with is not None:
        accelerator.init_trackers("attnkit-compare", config=tracker_config(config))
    progress = make_progress(config.progress, accelerator.is_main_process)
    say = _say if accelerator.is_main_process else (lambda line: None)
    runs = []
    clock = RunClock(len(plan))
    try:
        for k, (mech, seed) in enumerate(plan, start=1):
            run_dir = out / "runs" / f"{mech}-seed{seed}"
            finished = (run_dir / RESULT_FILE).is_file()
            say(clock.line(k, mech, seed, finished))
            hook = None if on_step is None else (lambda step, m=mech, s=seed: on_step(m, s, step))
            start = time.perf_counter()
            result = train_run(task, data, config, mech, seed, run_dir, accelerator, progress, on_step=hook,
                               expect=expect)
            if not finished:
                clock.add(time.perf_counter() - start, result.trained)
                _record_kernels(result.record, run_dir, accelerator.is_main_process)
            runs.append(result.record)
    except ValueError as exc:  # a setting to correct (the loss became NaN); a crash keeps its checkpoints
        _failed_training(exc, config, out, made, accelerator.is_main_process)
    finally:
        if progress is not None:
            progress.close()
    records = aggregate(runs, config.variants)
    files: dict = {}
    extras: dict = {}
    if accelerator.is_main_process:
        extras = summarize(task, data, config, runs, records, started=clock.started)
        files = write_report(config, task, records, runs, out, extras=extras)
        say(f"done: {len(plan)} runs in {_duration(time.time() - clock.started)}")
    accelerator.wait_for_everyone()  # before end_training, which ends a multi-process run's process group
    if config.log_with is not None:
        accelerator.end_training()
    return CompareResult(
        config=config, task=task, records=records, runs=runs, out=out, files=files, extras=extras
    )
