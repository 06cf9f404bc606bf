"""``reproduce(name)``: rerun one figure or claim of the papers, writing PNG plots, CSV data and a summary.

Targets (``TARGETS``):

- ``mode-collapse-curves``: "Doubly-Normalized Attention" Fig. 2, eqs. (11)-(14), closed forms and simulation.
- ``mode-collapse-2d``: "Attention that does not Explain Away" (arXiv:2009.14308) Appendix E, cluster counts
  after 4 steps (500/50 and 225/225).
- ``explain-away``: Fig. 1 of both versions, a trained multi-view model under LNAS, DNAS, HNAS.
- ``lemma1``: "Doubly-Normalized Attention" Lemma 1 on random inputs across shapes and masks.
- ``coda-matrices``: CoDA Fig. 2, histograms of the gate, ``tanh(E)`` and ``M`` of a trained model.
- ``lecture-visual``: visual, hard and memory attention (Show-Attend-Tell, RAM, DRAW, MemN2N) on digits
  canvases and generated bAbI-style tasks (several minutes; ``quick`` about two).
- ``lecture-seq``: RNN encoder-decoders (vanilla, content, location, mixed attention) and CTC on
  grapheme-to-phoneme and number words: error rates, accuracy vs input length, alignments.
- ``alignment``: alignment attention (Tables 1, 2, 4 at CPU scale); the full budget takes far longer than the
  others.
- ``sinkhorn-iters``: AEA sec. 3, more Sinkhorn iterations cost time and do not help.
- ``coda-cross``: CoDA Tables 2-3, bidirectional CoDA cross-attention on a sentence-pair task.
- ``hnas-pretraining``: AEA Fig. 4 / Table 2, HNAS u over MLM pretraining, fine-tuned versions.
- ``hnas-headlines``: AEA Fig. 5 / Table 3, headline generation with an LNAS/DNAS/HNAS encoder.
- ``mlu``: CoDA Table 6 and the Table 8/9 ablations on a reduced MLU that a CPU model learns.

``attnkit.analysis.fidelity.reproduce_all`` runs every target into one HTML page. A new target is one
entry in ``TARGETS`` and one in ``TARGET_HELP``: a function ``(result, quick, seed)`` that appends rows,
files and :class:`Claim` objects (paper value, ours with the spread over seeds, the criterion).

Each runs on CPU on one thread (the models are tiny); ``quick=True`` is a smoke test at budgets far below
the full ones (all thirteen targets together take about eight minutes of CPU), and a target whose quick
budget is too small for its claims to mean much says so in ``result.note``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from .repro_alignment import alignment
from .repro_coda import coda_matrices
from .repro_coda_cross import coda_cross
from .repro_explain_away import explain_away_training, lemma1
from .repro_lecture_visual import lecture_visual
from .repro_lecture_seq import lecture_seq
from .repro_mode_collapse import mode_collapse_2d, mode_collapse_curves
from .repro_headlines import headline_generation
from .repro_mlu import mlu_ablations
from .repro_pretraining import hnas_pretraining
from .repro_sinkhorn import sinkhorn_iterations
from ..validators import check_bool, check_seed
from .report import (
    STAGING_PREFIX,
    ReproduceResult,
    _lock,
    is_output_name,
    is_unfinished,
    mark_finished,
    prepare_output_dir,
    record_written,
    release,
)
from .._files import check_output_parents

__all__ = ["TARGETS", "TARGET_HELP", "reproduce", "default_output_dir", "check_output_parents"]

TargetFn = Callable[[ReproduceResult, bool, int], None]

# the targets seed NumPy (< 2**32) with their seed plus offsets of up to 1000 (test splits, later seeds)
REPRODUCE_SEED_MAX = 2**31 - 1

TARGETS: dict[str, TargetFn] = {
    "mode-collapse-curves": mode_collapse_curves,
    "mode-collapse-2d": mode_collapse_2d,
    "explain-away": explain_away_training,
    "lemma1": lemma1,
    "coda-matrices": coda_matrices,
    "lecture-visual": lecture_visual,
    "lecture-seq": lecture_seq,
    "alignment": alignment,
    "sinkhorn-iters": sinkhorn_iterations,
    "coda-cross": coda_cross,
    "hnas-pretraining": hnas_pretraining,
    "hnas-headlines": headline_generation,
    "mlu": mlu_ablations,
}
TARGET_HELP: dict[str, str] = {
    "mode-collapse-curves": "'Doubly-Normalized Attention' Fig. 2: center distance after one step vs r, "
    "LNAS vs DNAS, closed form + simulation",
    "mode-collapse-2d": "AEA App. E: 2-D clusters (500/50, 225/225), 4 steps, clusters left per mechanism",
    "explain-away": "Fig. 1: trained multi-view model, log weight sums and min weight sum vs the 1/n_k bound",
    "lemma1": "'Doubly-Normalized Attention' Lemma 1: min of n_k * sum_i pi_ij over random inputs, "
    "shapes and masks",
    "coda-matrices": "CoDA Fig. 2: histograms of sigmoid(N), tanh(E) and M of a trained CoDA model",
    "lecture-visual": "lecture: Show-Attend-Tell soft vs hard, RAM vs CNN, DRAW, memory networks 1 vs 3 hops",
    "lecture-seq": "lecture seq2seq: vanilla / content / GMM / mixed attention and CTC on g2p "
    "and number words",
    "alignment": "alignment attention: MiniLM on R8, 20NG domain shift, GAT on a kNN document graph "
    "(minutes-hours)",
    "sinkhorn-iters": "AEA sec. 3: Sinkhorn k = 0..5 on the multi-view task, accuracy and time per k",
    "coda-cross": "CoDA Tables 2-3: CoDA cross-attention vs decomposable attention vs none "
    "on Reuters topic pairs",
    "hnas-pretraining": "AEA Fig. 4 / Table 2: MLM pretraining, HNAS u per layer, "
    "LNAS/DNAS/HNAS fine-tuned",
    "hnas-headlines": "AEA Fig. 5 / Table 3: Reuters headline generation, LNAS/DNAS/HNAS encoder, ROUGE, u",
    "mlu": "CoDA Table 6 + Tables 8/9: MLU with operands in [-16, 16), softmax vs CoDA and its ablations",
}


def default_output_dir(name: str) -> Path:
    """``runs/reproduce/<name>`` relative to the working directory."""
    return Path("runs") / "reproduce" / name


def reproduce(
    name: str,
    out: Optional[Union[str, Path]] = None,
    *,
    overwrite: bool = False,
    quick: bool = False,
    seed: int = 0,
) -> ReproduceResult:
    """Run target ``name`` into ``out`` (default ``runs/reproduce/<name>``) and return its result.

    An existing non-empty ``out`` is refused unless ``overwrite`` (a folder whose last run did not finish is
    taken without it, but not the finished results an earlier run left there). The run writes into a staging
    folder inside ``out`` and, once it has finished, its files replace those of the same names
    (``summary.json`` last), and the files that an earlier reproduction's ``summary.json`` there listed as its
    outputs and this run did not write are removed (whichever target wrote them); every other file stays. An
    interrupted run leaves the earlier results as they were (the next run into ``out`` removes its staging
    folder). The result holds the printed table (``rows``), the paper claims checked (``claims``) and the
    files written (PNG, CSV, ``summary.json``).
    """
    if name not in TARGETS:
        raise ValueError(f"unknown reproduction target {name!r}; expected one of {tuple(TARGETS)}")
    check_seed(seed, high=REPRODUCE_SEED_MAX)
    check_bool(quick, f"quick={quick!r}")
    out = default_output_dir(name) if out is None else Path(out)
    check_output_parents(out)
    # a folder whose earlier run did not finish: that run was an --overwrite of the results still there
    if out.is_dir() and not overwrite:
        _lock(out)  # first: a run still going has an unfinished mark too ("in use", not "did not finish")
        if is_unfinished(out) and _earlier_outputs(out):
            # the mark lets the next run remove the unfinished run's own files, not finished results
            release(out)
            raise FileExistsError(
                f"{str(out)!r} holds the finished results of {_earlier_target(out)!r} beside a run that did "
                "not finish; pass --overwrite to replace them or choose another --out"
            )
    out_dir = prepare_output_dir(out, overwrite=overwrite)
    try:
        earlier = _earlier_outputs(out_dir) if overwrite else []
        # every file of the run is written here first, a partial one too (a target interrupted inside a
        # savefig has not listed its file yet): an interrupted run's files are this folder, which the next
        # run into out removes, and an earlier run's results stay whole until this one has finished
        stage = Path(tempfile.mkdtemp(dir=out_dir, prefix=STAGING_PREFIX))
        record_written(stage)
        result = ReproduceResult(name=name, out=stage, seed=seed, quick=quick)
        start, cpu_start = time.perf_counter(), time.process_time()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the models are tiny: one thread avoids the cost of idle synchronisation
        try:
            TARGETS[name](result, quick, seed)
        finally:
            torch.set_num_threads(threads)
        result.seconds = time.perf_counter() - start
        result.cpu_seconds = time.process_time() - cpu_start
        result.write_summary()
        _move_into(result, stage, out_dir)
        written = {path.name for path in result.files}
        for path in earlier:  # the earlier run's results that this one did not replace
            if path.name not in written and path.is_file() and not path.is_symlink():
                path.unlink()
        mark_finished(out_dir)
    finally:
        release(out_dir)  # a failed or interrupted call in a live session must not keep the folder locked
    return result


def _move_into(result: ReproduceResult, stage: Path, out_dir: Path) -> None:
    """Move the files of a run staged in ``stage`` into ``out_dir`` (each replacing the file of its name,
    ``summary.json`` last, so that the folder reads as the earlier run until the new one is whole), point
    ``result`` at them, and remove ``stage``."""
    names = list(dict.fromkeys(p.name for p in result.files))
    for name in sorted(names, key=lambda n: n == "summary.json"):
        _move(stage / name, out_dir / name)
    result.out = out_dir
    result.files = [out_dir / name for name in names]
    shutil.rmtree(stage, ignore_errors=True)  # empty, unless the target left scratch files there


def _move(src: Path, dst: Path) -> None:
    """``src`` to ``dst``: a file replaces the file (or link) of its name; a folder's files go into a folder
    of its name there, one by one (what else that folder holds stays)."""
    if src.is_dir() and not src.is_symlink() and dst.is_dir() and not dst.is_symlink():
        for child in src.iterdir():
            _move(child, dst / child.name)
        src.rmdir()
    else:
        os.replace(src, dst)


def _earlier_summary(out: Path) -> Optional[dict]:
    """The ``summary.json`` in ``out`` when it is the summary of a reproduction (a target's name and the
    fields ``write_summary`` writes), else ``None`` (a ``summary.json`` of another program)."""
    summary = out / "summary.json"
    if not summary.is_file() or summary.is_symlink():
        return None
    try:
        data = json.loads(summary.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # not a summary of ours: leave it and everything else
        return None
    ours = isinstance(data, dict) and _SUMMARY_FIELDS <= data.keys() and isinstance(data["name"], str) \
        and data["name"] in TARGETS
    return data if ours else None


def _earlier_target(out: Path) -> Optional[str]:
    data = _earlier_summary(out)
    return None if data is None else data["name"]


def _earlier_outputs(out: Path) -> list[Path]:
    """The files that the ``summary.json`` in ``out`` lists as its run's outputs, and that summary, when it is
    the summary of a reproduction (a ``summary.json`` of another program lists nothing of ours): only plain
    files directly in ``out`` (no links, folders or paths elsewhere)."""
    data = _earlier_summary(out)
    files = None if data is None else data.get("files")
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return []
    paths = []
    for file_name in [*files, "summary.json"]:
        if not is_output_name(file_name):
            continue  # a listed path outside the folder, or a file of a kind no target writes: not ours
        paths.append(out / file_name)
    return paths


_SUMMARY_FIELDS = {"name", "attnkit", "seed", "quick", "rows", "claims", "files"}
