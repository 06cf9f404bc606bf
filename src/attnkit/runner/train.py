"""One training run (task x mechanism x seed) with Hugging Face Accelerate.

The same code runs in one CPU process (``attnkit compare``) and in many processes or GPUs
(``accelerate launch -m attnkit.cli compare ...``): every process sees the same deterministic batch order
(a permutation of the training set per epoch, seeded by the run seed and the epoch) and takes its share
of each global batch; the loss is normalized by the size of the *global* batch, so the averaged gradient
is the same as one process would compute on the whole batch. The random draws of training (dropout,
attention dropout) differ: every process starts from the run seed for the model's initialisation (the same
on all of them), then draws from a stream of its own (``rank_seed``), so with dropout N processes give
different, equally valid, results than one (without dropout the same, up to float rounding); one process
keeps the run seed's stream.

Checkpoints (every ``checkpoint_every`` steps, ``attnkit.runner.checkpoints``) hold the model, optimizer,
scheduler and RNG states and the trainer's numbers, no pickle. The batch order is a function of (seed, step),
so a run continued from a checkpoint ends with the same metrics as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .checkpoints import (
    RESULT_FILE, data_fingerprint, finished_result, hybrid_weight, latest_checkpoint,
    load_checkpoint_everywhere, run_expectations, save_checkpoint,
)
from .config import CompareConfig

__all__ = [
    "RunResult", "train_run", "batch_indices", "check_batch_split", "finished_result", "hybrid_u",
    "latest_checkpoint", "run_expectations", "data_fingerprint", "RESULT_FILE",
]


@dataclass
class RunResult:
    """What one run reports: final metrics, timings, diagnostics and the metrics history."""

    record: dict
    trained: float = 0.0  # the share of the run's steps trained by this call (less than 1 when resumed)

    @property
    def metrics(self) -> dict:
        return self.record["metrics"]


def rank_seed(seed: int, rank: int) -> int:
    """The seed of process ``rank``'s random stream in a run of several processes: distinct per rank, and
    not the next run's seed as ``seed + rank`` would be (rank 1 of seed 0 drawing seed 1's stream)."""
    return (seed * 1_000_003 + 7919 * (rank + 1)) % 2**32


def batch_indices(step: int, n_train: int, batch_size: int, seed: int) -> Tensor:
    """The training-set indices of global batch ``step`` (0-based): epoch permutations, last partial batch
    dropped."""
    per_epoch = n_train // batch_size
    if per_epoch < 1:
        raise ValueError(
            f"batch_size={batch_size} is larger than the training set ({n_train} examples); lower batch_size"
        )
    epoch, position = divmod(step, per_epoch)
    generator = torch.Generator().manual_seed(1_000_003 * seed + epoch)
    order = torch.randperm(n_train, generator=generator)  # (n_train,)
    return order[position * batch_size:(position + 1) * batch_size]


def hybrid_u(model: torch.nn.Module) -> Optional[list[list[float]]]:
    """The hybrid weights ``u`` of the HNAS attention modules (``ak.nn.hybrid_weights``): ``[layer][head]``.

    ``None`` when the model has no hybrid attention.
    """
    from ..nn import MultiheadAttention, MultiViewAttention, hybrid_weights

    if not any(
        isinstance(m, (MultiheadAttention, MultiViewAttention)) and m.theta is not None
        for m in model.modules()
    ):
        return None
    return hybrid_weights(model).double().cpu().tolist()  # (layers, heads)


def check_batch_split(batch_size: int, world: int) -> None:
    """``batch_size`` splits evenly over ``world`` processes, or a ``ValueError`` saying what to use."""
    if batch_size % world:
        raise ValueError(
            f"batch_size={batch_size} does not split evenly over {world} processes; use a multiple of {world}"
        )


def _spread(times: list) -> Optional[dict]:
    """``{"min", "median", "max"}`` seconds per optimizer step within one run (the median of an even count
    is the mean of the two middle steps)."""
    if not times:
        return None
    return {"min": min(times), "median": statistics.median(times), "max": max(times)}


def _schedule(warmup: int, total: int) -> Callable[[int], float]:
    def factor(step: int) -> float:  # linear warmup, then linear decay to 0 at ``total``
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total - step) / max(1, total - warmup))

    return factor


def _evaluate(accelerator, task, data, model, config: CompareConfig) -> tuple[dict, list]:
    """Metrics on the evaluation set; each process predicts its share, the predictions are gathered."""
    from accelerate.utils import gather_object

    net = accelerator.unwrap_model(model)
    net.eval()
    n = task.num_eval(data)
    local = list(range(accelerator.process_index, n, accelerator.num_processes))
    preds: list = []
    with torch.no_grad():
        for start in range(0, len(local), config.batch_size):
            idx = torch.tensor(local[start:start + config.batch_size], dtype=torch.long)
            preds.extend(zip(idx.tolist(), task.predict(net, data, idx, config, accelerator.device)))
    if accelerator.num_processes > 1:
        preds = gather_object(preds)
    preds = [p for _, p in sorted(preds, key=lambda item: item[0])]
    net.train()
    return task.metrics(data, preds), preds


def _explain_away(accelerator, task, data, model, config: CompareConfig) -> dict:
    """Smallest key weight sums over the non-causal self-attention calls on a sample of the evaluation set
    (a seq2seq model's cross-attention, softmax whatever the mechanism, is left out).

    ``min_normalized`` is ``n_k * min_j sum_i pi_ij`` (Lemma 1: >= 1 for DNAS); ``min`` is the raw smallest
    sum.
    """
    from ..analysis import explain_away
    from ..functional import observe_weights

    stats = {"min": math.inf, "min_normalized": math.inf, "fraction_below_eps": 0.0, "calls": 0}
    cross: list[bool] = []  # per MultiheadAttention call in progress: whether it is cross-attention

    def observer(weights, mask_info, mechanism_config) -> None:
        if mask_info.causal:  # a causal decoder's last key is seen by one query: not explaining away
            return
        if cross and cross[-1]:  # a decoder's cross-attention (softmax whatever the mechanism): not the
            return  # mechanism's self-attention, whose keys Lemma 1 is about
        result = explain_away(weights, key_mask=mask_info.key_mask, query_mask=mask_info.query_mask)
        if not math.isnan(result.min):
            stats["min"] = min(stats["min"], result.min)
            stats["min_normalized"] = min(stats["min_normalized"], result.min_normalized)
        stats["fraction_below_eps"] = max(stats["fraction_below_eps"], result.fraction_below_eps)
        stats["calls"] += 1

    net = accelerator.unwrap_model(model)
    net.eval()
    n = min(config.explain_away_samples, task.num_eval(data))
    from ..nn import MultiheadAttention

    def enter(module, args, kwargs):
        query = args[0] if args else kwargs.get("query")
        key = args[1] if len(args) > 1 else kwargs.get("key")
        cross.append(query is not key)

    def leave(module, args, output):
        cross.pop()

    handles = [
        h for m in net.modules() if isinstance(m, MultiheadAttention)
        for h in (m.register_forward_pre_hook(enter, with_kwargs=True), m.register_forward_hook(leave))
    ]
    try:
        with torch.no_grad(), observe_weights(observer):
            for start in range(0, n, config.batch_size):
                idx = torch.arange(start, min(n, start + config.batch_size))
                task.forward_for_diagnostics(net, data, idx, config, accelerator.device)
    finally:
        for handle in handles:
            handle.remove()
    net.train()
    if stats["calls"] == 0:
        return {"min": None, "min_normalized": None, "fraction_below_eps": None, "calls": 0}
    if math.isinf(stats["min"]):  # no call had a valid key: no sum to report (JSON has no Infinity)
        stats["min"] = stats["min_normalized"] = None
    return stats


# the reasons the model's input checks give for values out of range: ``functional``'s score-range check
# ("the scores ... would overflow to inf"), the score functions' and recurrent attentions' ("scores contain
# NaN or +inf", "query contains NaN or inf"). After optimizer steps, on inputs that are token ids, they are
# the weights grown by too large a learning rate, which the user fixes with lr, not by scaling q and k.
_OUT_OF_RANGE = re.compile(r"\bNaN\b|non-finite|overflow")


@contextlib.contextmanager
def _divergence_named(mechanism: str, seed: int, step: int, lr: float, trained: bool = True):
    """Re-raise a ``ValueError`` of the model's forward at (1-based) ``step`` that names values out of range
    (``_OUT_OF_RANGE``) as the run's divergence: the mechanism, seed, step and lr, and what to change (the
    kernel's reason kept). ``trained``: the weights have had optimizer steps (a fresh model's overflow is no
    matter of lr: raised as it is)."""
    try:
        yield
    except ValueError as exc:
        if not trained or _OUT_OF_RANGE.search(str(exc)) is None:
            raise
        raise ValueError(
            f"{mechanism} seed {seed}: training diverged at step {step} with lr={lr:g} ({exc}); "
            "lower lr or raise warmup_steps"
        ) from exc


def _check_outputs_after_last_step(accelerator, task, data, model, config: CompareConfig, local_idx: Tensor,
                                   mechanism: str, seed: int, step: int) -> None:
    """A ``ValueError`` when the model's outputs are not finite after the last optimizer step ``step``.

    The loop reads each step's loss before that step's update, so a last update that diverged (weights of
    1e30, finite themselves) went unseen: the evaluation took the arg-max of NaN logits, class 0, and
    reported its share as the accuracy. The last batch's loss is computed again, in evaluation mode and
    without drawing random numbers: one forward per run, not per step.
    """
    net = accelerator.unwrap_model(model)
    devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    net.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            loss_sum = task.loss_sum(net, data, local_idx, config, accelerator.device).float()
    finally:
        net.train()
    value = _summed(accelerator, loss_sum)  # every process one verdict (one raising alone left the others)
    if not math.isfinite(value):
        raise ValueError(
            f"{mechanism} seed {seed}: the model's outputs became {value} after step {step}, the last (its "
            "loss on that step's batch, computed again after the update); lower lr or raise warmup_steps"
        )


def _summed(accelerator, value: Tensor) -> float:
    """``value`` summed over the processes of the launch (itself on one), as a Python float."""
    if accelerator.num_processes > 1:
        value = accelerator.reduce(value, reduction="sum")
    return float(value)


def _remove_scratch(run_dir: Path) -> None:
    """A finished run's checkpoints, and the temporary model files of a process killed while it saved one
    (the run directory is this locked run's alone: none is being written)."""
    from .._files import remove_stale

    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    remove_stale(run_dir, ".model.pt.*.tmp", older_than_s=0)


def train_run(
    task,
    data,
    config: CompareConfig,
    mechanism: str,
    seed: int,
    run_dir: Path,
    accelerator,
    progress=None,
    on_step: Optional[Callable[[int], None]] = None,
    expect: Optional[dict] = None,
) -> RunResult:
    """Train and evaluate ``mechanism`` with ``seed`` on ``task``; continue from ``run_dir``'s checkpoint if
    any.

    Writes ``run_dir/result.json`` when done and returns its record. ``on_step(step)`` is called after each
    optimizer step (and its checkpoint); ``progress`` is a ``runner.progress`` bar or ``None``; ``expect`` is
    ``run_expectations(task, data, config)``, computed here when not given (once per comparison: it hashes
    the data).
    """
    from accelerate.utils import set_seed

    run_dir = Path(run_dir)
    result_path = run_dir / RESULT_FILE
    world, rank = accelerator.num_processes, accelerator.process_index
    expect = run_expectations(task, data, config) if expect is None else expect
    record = finished_result(run_dir, mechanism, seed, world, task.metric_names, expect)
    if record is not None:
        if accelerator.is_main_process:  # a process killed between its result and this cleanup left them
            _remove_scratch(run_dir)
        return RunResult(record)
    check_batch_split(config.batch_size, world)
    total = config.total_steps
    n_train = task.num_train(data)
    batch_indices(0, n_train, config.batch_size, seed)  # validates batch_size against the training set

    set_seed(seed)
    base_mechanism, _, align = mechanism.partition("+")  # "dnas+ct": dnas with alignment attention (ct)
    model = task.build_model(config, base_mechanism, data)
    n_params = sum(p.numel() for p in model.parameters())
    model.to(accelerator.device)
    if accelerator.device.type == "cpu":
        # Build (or load) the C++ kernels before the clock starts: a first build inside the first step made
        # DNAS' step time read 2.16x softmax's instead of 0.66x (one 27 s step) with a fresh cache.
        from ..kernels import cpu_ext

        cpu_ext.load()
    reg = None
    if align:
        from ..align import AlignmentRegularizer

        reg = AlignmentRegularizer(model, method=align, weight=getattr(config, "align_weight", 0.01))
    named = list(model.named_parameters())
    optimizer = torch.optim.AdamW([p for n, p in named if not hybrid_weight(n)], lr=config.lr,
                                  weight_decay=config.weight_decay)
    if any(hybrid_weight(n) for n, _ in named):  # HNAS's theta: no decay towards u = 1/2
        optimizer.add_param_group({"params": [p for n, p in named if hybrid_weight(n)], "weight_decay": 0.0})
    if reg is not None and any(True for _ in reg.parameters()):
        optimizer.add_param_group({"params": list(reg.parameters()), "weight_decay": 0.0})
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(config.warmup_steps, total))
    accelerator.free_memory()
    model, optimizer = accelerator.prepare(model, optimizer)

    trainer: dict[str, Any] = {
        "step": 0, "history": [], "time_sum": 0.0, "time_count": 0, "loss_sum": 0.0, "loss_count": 0,
        "world_size": world, "mechanism": mechanism, "seed": seed, "data_sha256": expect["data_sha256"],
    }
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is not None:  # restores every process's RNG states
        trainer = load_checkpoint_everywhere(accelerator, checkpoint, model, optimizer, scheduler, reg,
                                              run=(mechanism, seed, total, expect["data_sha256"]))
        trainer["data_sha256"] = expect["data_sha256"]  # the same, or none (saved before it was recorded)
    elif world > 1:  # each process its own dropout masks (all drew the same ones for their shares)
        set_seed(rank_seed(seed, rank))
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)

    first_step = trainer["step"]
    if progress is not None:
        progress.start_run(f"{mechanism} seed {seed}", total, first_step)
    model.train()
    while trainer["step"] < total:
        step = trainer["step"]
        start = time.perf_counter()
        global_idx = batch_indices(step, n_train, config.batch_size, seed)  # (batch_size,)
        local_idx = global_idx[rank::world]
        with _divergence_named(mechanism, seed, step + 1, config.lr, trained=step > 0):
            loss_sum = task.loss_sum(model, data, local_idx, config, accelerator.device)
        denominator = task.count(data, global_idx)
        loss = loss_sum * (world / denominator)  # DDP averages over processes: the mean over the global batch
        if reg is not None:
            loss = loss + reg.loss()
        accelerator.backward(loss)
        if reg is not None:
            reg.sync_gradients()  # DDP averages the model's gradients, not the regularizer's
        if config.grad_clip:
            accelerator.clip_grad_norm_(model.parameters(), config.grad_clip)
            if reg is not None:  # its own norm, as the alignment Trainer's max_grad_norm (docs/alignment.md)
                own = [p for p in reg.parameters() if p.grad is not None]
                if own:
                    torch.nn.utils.clip_grad_norm_(own, config.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = _summed(accelerator, loss.detach() / world)
        if not math.isfinite(loss_value):
            raise ValueError(
                f"{mechanism} seed {seed}: the training loss became {loss_value} at step {step + 1}; "
                "lower lr or raise warmup_steps"
            )
        step_seconds = time.perf_counter() - start
        trainer["time_sum"] += step_seconds
        trainer["time_count"] += 1
        trainer.setdefault("step_times", []).append(step_seconds)
        trainer.setdefault("step_losses", []).append(loss_value)
        trainer["load_max"] = max(trainer.get("load_max", 0.0), os.getloadavg()[0])
        accelerator.log({f"{mechanism}-seed{seed}/train_loss": loss_value,
                         f"{mechanism}-seed{seed}/step_seconds": step_seconds}, step=step + 1)
        trainer["loss_sum"] += loss_value
        trainer["loss_count"] += 1
        trainer["step"] = step = step + 1
        if progress is not None:
            progress.update(
                step, loss_value, len(global_idx) / max(1e-9, trainer["time_sum"] / trainer["time_count"])
            )

        if step == total:  # the loss above was read before this last update: the outputs after it
            with _divergence_named(mechanism, seed, step, config.lr):
                _check_outputs_after_last_step(accelerator, task, data, model, config, local_idx, mechanism,
                                               seed, step)
        if step % config.eval_every == 0 or step == total:
            with _divergence_named(mechanism, seed, step, config.lr):
                metrics, _ = _evaluate(accelerator, task, data, model, config)
            trainer["history"].append({
                "step": step,
                "train_loss": trainer["loss_sum"] / max(1, trainer["loss_count"]),
                "lr": scheduler.get_last_lr()[0],
                **metrics,
                "hybrid_u": hybrid_u(accelerator.unwrap_model(model)),
            })
            trainer["loss_sum"], trainer["loss_count"] = 0.0, 0
            accelerator.log({f"{mechanism}-seed{seed}/eval_{k}": v for k, v in metrics.items()
                             if isinstance(v, (int, float))}, step=step)
        if step % config.checkpoint_every == 0 and step < total:
            save_checkpoint(accelerator, run_dir, step, model, optimizer, scheduler, trainer, reg)
        if on_step is not None:
            on_step(step)

    if reg is not None:
        reg.remove()
    metrics, preds = _evaluate(accelerator, task, data, model, config)
    explain = _explain_away(accelerator, task, data, model, config)
    net = accelerator.unwrap_model(model)
    record = {
        "mechanism": mechanism,
        "seed": seed,
        "steps": total,
        "metrics": metrics,
        "step_time_s": trainer["time_sum"] / max(1, trainer["time_count"]),
        "explain_away": explain,
        "hybrid_u": hybrid_u(net),
        "history": trainer["history"],
        "num_params": n_params,
        "train_examples": n_train,
        "eval_examples": task.num_eval(data),
        "data_sha256": expect["data_sha256"],
        "world_size": world,
        "samples": task.samples(data, preds, limit=8),
        "predictions": preds,
        "step_times_s": _spread(trainer.get("step_times", [])),
        "step_losses": trainer.get("step_losses", []),
        "load_average_max": trainer.get("load_max"),
        **task.details(data, preds),
    }
    if accelerator.is_main_process:
        from .._files import write_file_with

        # whole or not at all (a full disk left a truncated model.pt beside the checkpoints)
        write_file_with(run_dir / "model.pt", lambda tmp: torch.save(net.state_dict(), tmp), overwrite=True)
        tmp = run_dir / (RESULT_FILE + ".tmp")
        tmp.write_text(json.dumps(record, indent=1, allow_nan=False))  # strict JSON: no bare NaN
        os.replace(tmp, result_path)
        _remove_scratch(run_dir)
    accelerator.wait_for_everyone()
    if progress is not None:
        progress.end_run(metrics)
    accelerator.free_memory()
    return RunResult(record, trained=(total - first_step) / total if total else 1.0)
