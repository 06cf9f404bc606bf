"""``reproduce_all``: run every reproduction target and write one self-contained HTML fidelity page.

The page lists, per paper, every claim a target checked: the paper's wording and source, the paper's value
or criterion, ours (with the spread over seeds), whether our criterion is the paper's, and held / not
held; the targets' tables and PNG plots (embedded as data URIs, so the page is one file) follow.
"""

from __future__ import annotations

import base64
import contextlib
import html
import json
import math
import os
import platform
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

from .. import __version__
from .._files import json_loads
from ..validators import check_bool, check_seed
from .report import (
    UNFINISHED_MARKER, ReproduceResult, format_value, from_jsonable, is_unfinished, mark_finished,
    prepare_output_dir, record_finished, record_replaced, record_written, release, replaced_in_mark,
    results_saved_since, unfinished_without_record,
    written_in_mark, table_columns, verdict,
)

__all__ = [
    "reproduce_all",
    "default_jobs",
    "RunInfo",
    "run_summary",
    "load_result",
    "rebuild_fidelity",
    "write_fidelity_html",
    "write_fidelity_markdown",
    "paper_of",
    "PAPERS",
]

PAPERS: dict[str, str] = {
    "doubly-normalized": "Attention that does not Explain Away (arXiv:2009.14308) and its draft, "
    "Doubly-Normalized Attention",
    "coda": "Compositional De-Attention Networks (NeurIPS 2019)",
    "alignment": "Alignment Attention by Matching Key and Query Distributions (arXiv:2110.12567)",
    "lecture": "The attention lecture: content, location, hard, visual and memory attention, CTC",
    "other": "Other papers",
}


def paper_of(target: str) -> str:
    """The paper key of a target (``PAPERS``): CoDA targets start with ``coda``; the doubly-normalized
    papers' targets are the mode-collapse, explain-away, Lemma 1, Sinkhorn and HNAS ones; ``alignment``
    and the ``lecture-*`` targets have their own sections."""
    if target.startswith("coda") or target.startswith("mlu"):
        return "coda"
    if target.startswith(("mode-collapse", "explain-away", "lemma1", "sinkhorn", "hnas")):
        return "doubly-normalized"
    if target == "alignment":
        return "alignment"
    if target.startswith("lecture"):
        return "lecture"
    return "other"


@dataclass(frozen=True)
class RunInfo:
    """How a fidelity page was made: ``quick`` budgets or full, the first seed, worker processes, the wall
    time of the whole run and the CPU time summed over its targets; the targets that a worker process's
    death stopped and that ran again, each in a process of its own (``rerun_alone``)."""

    quick: bool
    seed: int = 0
    jobs: int = 1
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    rerun_alone: tuple[str, ...] = ()


def default_jobs(n_targets: int) -> int:
    """Worker processes for :func:`reproduce_all` when none is given: the cores this process may use minus
    the one-minute load average (other work on the machine), at least 1 and at most ``n_targets``."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    free = int(cores - os.getloadavg()[0] + 0.5) if hasattr(os, "getloadavg") else cores
    return max(1, min(cores, free, max(n_targets, 1)))


# CPU seconds of each target's quick mode on one thread (measured in `attnkit reproduce all --quick`, see
# docs/fidelity.md); used only to start the longest targets first when several worker processes share the
# run. Unknown targets count as long.
QUICK_CPU_SECONDS: dict[str, float] = {
    "alignment": 173.0,
    "hnas-pretraining": 71.0,
    "hnas-headlines": 62.0,
    "lecture-seq": 49.0,
    "mlu": 43.0,
    "lecture-visual": 20.0,
    "mode-collapse-2d": 16.0,
    "coda-cross": 15.0,
    "explain-away": 10.0,
    "sinkhorn-iters": 10.0,
    "coda-matrices": 1.5,
    "mode-collapse-curves": 0.7,
    "lemma1": 0.6,
}


def _run_target(name: str, out: Path, overwrite: bool, quick: bool, seed: int) -> ReproduceResult:
    """One target; an error becomes one failed claim ("the target ran"), so it never hides the others."""
    from .reproduce import reproduce

    try:
        return reproduce(name, out, overwrite=overwrite, quick=quick, seed=seed)
    except Exception as exc:  # any error (a KeyboardInterrupt still stops the run)
        where = ""
        if not isinstance(exc, (ImportError, RuntimeError, ValueError, OSError)):  # a defect: say where
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            where = f" (at {Path(frame.filename).name}:{frame.lineno})"
        return _failed(name, out, f"{type(exc).__name__}: {exc}{where}")


TARGET_RAN = "the target ran"  # the one claim of a target that raised


def _failed(name: str, out: Path, evidence: str) -> ReproduceResult:
    """The result of a target that raised: one failed claim, "the target ran"."""
    from .report import Claim

    failed = ReproduceResult(name=name, out=out)
    # the error in "ours" too: the Markdown table has no evidence column
    failed.claims.append(Claim(name, TARGET_RAN, False, evidence, ours=evidence))
    return failed


def did_not_run(results: Sequence[ReproduceResult]) -> list[str]:
    """The names of the targets that raised (their one claim "the target ran" not held)."""
    return [r.name for r in results
            if len(r.claims) == 1 and r.claims[0].statement == TARGET_RAN and not r.claims[0].held]


def _worker_start(parent: int) -> None:
    """In each worker of :func:`reproduce_all`: Ctrl-C is the main process's to handle (it stops the
    workers), and a worker whose main process died (killed) exits instead of running on into its folders."""
    import signal
    import threading

    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="attnkit-parent-watch", daemon=True).start()


@contextlib.contextmanager
def _workers(jobs: int) -> Iterator:
    """A pool of ``jobs`` worker processes that ends with the block; an exception or Ctrl-C in the block
    cancels the targets not started and terminates the workers (the pool's own exit would wait for every
    queued target to run)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn, not fork: a forked child of a process that already ran OpenMP threads can hang
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_worker_start, initargs=(os.getpid(),))
    try:
        yield pool
    except BaseException:
        _terminate(pool)
        raise
    pool.shutdown()


def _record_done(futures: dict, root: Path) -> None:
    """Record the targets among ``futures`` (future -> name) that finished with a result, on a stop."""
    for f, n in futures.items():
        if f.done() and not f.cancelled() and f.exception() is None:
            record_finished(root / n)


def _terminate(pool) -> None:
    """Cancel the pool's queued targets and end its worker processes."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()
    for process in processes:
        process.join(5)


def reproduce_all(
    out: Optional[Union[str, Path]] = None,
    *,
    overwrite: bool = False,
    quick: bool = False,
    seed: int = 0,
    targets: Optional[Sequence[str]] = None,
    jobs: int = 1,
) -> tuple[list[ReproduceResult], Path]:
    """Run ``targets`` (default: all registered) into ``out/<name>`` and write ``out/fidelity.html``.

    ``jobs`` > 1 runs that many targets at once in worker processes (each on one thread; the targets are
    independent), longest first; ``jobs=0`` picks :func:`default_jobs`. Returns the results, in the order of
    ``targets``, and the page's path. A target that raises is recorded as one failed claim ("the target
    ran") with the error, so one broken target never hides the others.
    """
    from .reproduce import REPRODUCE_SEED_MAX, TARGETS

    names = list(TARGETS) if targets is None else list(targets)
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        raise ValueError(f"unknown reproduction targets {unknown}; expected names from {tuple(TARGETS)}")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 0:
        raise ValueError(f"jobs={jobs!r}; expected an integer >= 1 (or 0 for one per free core)")
    check_bool(quick, f"quick={quick!r}")
    check_seed(seed, high=REPRODUCE_SEED_MAX)  # before any target runs (each would record it as a failure)
    jobs = default_jobs(len(names)) if jobs == 0 else min(jobs, max(len(names), 1))
    root = Path("runs") / "reproduce" / "all" if out is None else Path(out)
    # A run of all targets that did not finish (Ctrl-C) listed each target's folder in its mark as it made
    # it: preparing the root removes the files of that run in them, finished targets' included, and the
    # folders left empty; a file the user saved in one since stays, and that folder is replaced again, file
    # by file, as is a folder that run was replacing (--overwrite). A folder the user made there since is
    # refused as any non-empty --out is. A mark without these lists (an older version's): every target
    # folder is replaced.
    saved = [] if overwrite else results_saved_since(root)
    if saved:
        raise FileExistsError(
            f"{str(root)!r} holds a run of all targets that did not finish, and finished results in "
            f"{', '.join(saved)} that it did not write (a target run alone since, or earlier results); pass "
            "--overwrite to replace them, or move them out first"
        )
    overwrite = overwrite or unfinished_without_record(root)
    replacing = set(replaced_in_mark(root)) | set(written_in_mark(root))
    root = prepare_output_dir(root, overwrite=overwrite)
    try:
        return _run_all(root, names, overwrite, replacing, quick, seed, jobs)
    finally:
        release(root)  # a failed or interrupted call in a live session must not keep the folder locked


#: the root's page, and the names an earlier run's page takes while a new run is going: a run stopped before
#: it finished leaves that page under these names (its numbers are of target folders the run may have
#: replaced since), and a run that finishes removes them
PAGE_FILES = ("fidelity.html", "fidelity.md", "fidelity.json")
EARLIER_PAGE_FILES = tuple(name.replace("fidelity.", "fidelity.earlier.") for name in PAGE_FILES)


def _run_all(root: Path, names: list[str], overwrite: bool, replacing: set, quick: bool, seed: int,
             jobs: int) -> tuple[list[ReproduceResult], Path]:
    replace = {name: overwrite or name in replacing for name in names}
    for name, earlier in zip(PAGE_FILES, EARLIER_PAGE_FILES):
        if (root / name).is_file():
            os.replace(root / name, root / earlier)
    made = []
    for name in names:  # listed here, in one process: workers writing the root's mark at once lose names
        folder = root / name
        if not folder.exists():  # made here: the next run may remove it whole
            folder.mkdir()
            record_written(folder)
            made.append(folder)
        elif replace[name] and folder.is_dir():  # the user's files in it stay
            record_replaced(folder)
    try:
        return _run_targets(root, names, replace, quick, seed, jobs)
    except BaseException:  # stopped (Ctrl-C, SIGTERM) or failed: the target folders it made and never used
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only while empty
        raise


def _run_targets(root: Path, names: list[str], replace: dict, quick: bool, seed: int,
                 jobs: int) -> tuple[list[ReproduceResult], Path]:
    start = time.perf_counter()
    rerun_alone: tuple[str, ...] = ()
    if jobs == 1:
        results = []
        for name in names:
            results.append(_run_target(name, root / name, replace[name], quick, seed))
            record_finished(root / name)
    else:
        from concurrent.futures import as_completed
        from concurrent.futures.process import BrokenProcessPool

        order = sorted(names, key=lambda n: -QUICK_CPU_SECONDS.get(n, float("inf")))
        by_name, broken = {}, []
        with _workers(jobs) as pool:
            futures = {pool.submit(_run_target, n, root / n, replace[n], quick, seed): n for n in order}
            try:
                for f in as_completed(futures):  # each recorded as it finishes, in this one process
                    n = futures[f]
                    try:
                        by_name[n] = f.result()
                        record_finished(root / n)
                    except BrokenProcessPool:  # a worker died (killed, out of memory): all pending fail
                        broken.append(n)
                    except Exception as exc:
                        by_name[n] = _failed(n, root / n, f"{type(exc).__name__}: {exc}")
            except BaseException:  # Ctrl-C: the targets finished meanwhile are this run's results too
                _record_done(futures, root)
                raise
        broken.sort(key=order.index)
        # each again in a process of its own, so that only a target whose process dies fails, still `jobs`
        # at a time (one at a time, a dying target made the rest of the run serial: 2.6x the time)
        if broken:
            from concurrent.futures import ThreadPoolExecutor

            pools: list = []

            def alone(n: str) -> ReproduceResult:
                with _workers(1) as pool:
                    pools.append(pool)
                    try:
                        return pool.submit(_run_target, n, root / n, replace[n], quick, seed).result()
                    except Exception as exc:
                        return _failed(n, root / n, f"its worker process died ({type(exc).__name__}: {exc})")

            threads = ThreadPoolExecutor(jobs)
            retries = {threads.submit(alone, n): n for n in broken}
            try:
                for f in as_completed(retries):
                    by_name[retries[f]] = f.result()
                    record_finished(root / retries[f])
            except BaseException:  # Ctrl-C: end the workers, whose threads then return at once
                _record_done(retries, root)
                threads.shutdown(wait=False, cancel_futures=True)
                for pool in list(pools):
                    _terminate(pool)
                raise
            threads.shutdown()
        results = [by_name[n] for n in names]
        rerun_alone = tuple(n for n in names if n in broken)  # in the page's order
    run = RunInfo(quick=quick, seed=seed, jobs=jobs, seconds=time.perf_counter() - start,
                  cpu_seconds=sum(r.cpu_seconds for r in results),
                  rerun_alone=rerun_alone)
    page = write_fidelity_html(results, root / "fidelity.html", run=run)
    write_fidelity_markdown(results, root / "fidelity.md", run=run)
    _write_fidelity_json(results, root / "fidelity.json", run=run)
    for earlier in EARLIER_PAGE_FILES:
        (root / earlier).unlink(missing_ok=True)
    mark_finished(root)
    return results, page


def _write_fidelity_json(results: Sequence[ReproduceResult], path: Path, *, run: RunInfo) -> Path:
    """``fidelity.json`` beside the page: per target its seed, budget, times and claims with verdicts."""
    summary = [
        {
            "name": r.name,
            "seed": run.seed,  # what the numbers depend on, as each target's summary.json says too
            "quick": run.quick,
            "attnkit": __version__,
            "seconds": round(r.seconds, 1),
            "cpu_seconds": round(r.cpu_seconds, 1),
            "budget": r.budget,
            "note": r.note,
            # a worker process died while it ran (its own or another target's): it ran again alone
            "rerun_alone": r.name in run.rerun_alone,
            "claims": [{**c.__dict__, "verdict": c.verdict} for c in r.claims],
        }
        for r in results
    ]
    path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return path


def _plain_name(name) -> str:
    """``name`` if it is a plain file name (no folder, not ``.``/``..``): a summary lists only the files its
    run wrote into its own folder, so a path (absolute, ``../x.png``) would embed a file from elsewhere."""
    if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
        raise ValueError(f"files lists {name!r}; expected plain file names inside the target's folder")
    return name


def _check_summary(data) -> None:
    """The fields of a ``summary.json`` that a page states, of the types a run writes: a file is not trusted
    (``"held": "false"`` must not read as held, nor a NaN time be shown)."""
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object")
    if not isinstance(data.get("name"), str):
        raise ValueError(f"name is {data.get('name')!r}; expected a target's name")
    seconds = data.get("seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
            or seconds < 0:
        raise ValueError(f"seconds is {seconds!r}; expected a number of seconds")
    claims = data.get("claims")
    if not isinstance(claims, list) or not all(isinstance(c, dict) for c in claims):
        raise ValueError("claims is not a list of objects")
    for c in claims:
        if not isinstance(c.get("held"), bool):
            raise ValueError(f"a claim's held is {c.get('held')!r}; expected true or false")


def load_result(folder: Union[str, Path]) -> ReproduceResult:
    """A target's result read back from its ``summary.json`` (rows, claims, files, seconds, budget).

    ``files`` must be plain names of files in ``folder`` (as the run wrote them); a path is a ``ValueError``.
    """
    from .report import Claim

    folder = Path(folder)
    path = folder / "summary.json"
    try:
        data = json_loads(path.read_text(encoding="utf-8"))
        _check_summary(data)
        claims = [Claim(**{k: c[k]
                           for k in ("source", "statement", "held", "evidence", "paper", "ours", "criterion")
                           if k in c}) for c in data["claims"]]
        rows = [{k: from_jsonable(v) for k, v in row.items()} for row in data["rows"]]
        result = ReproduceResult(name=data["name"], out=folder, rows=rows, claims=claims,
                                 files=[folder / _plain_name(f) for f in data["files"]],
                                 seconds=float(data["seconds"]),
                                 budget=str(data.get("budget", "")),
                                 cpu_seconds=float(data.get("cpu_seconds", 0.0)),
                                 note=str(data.get("note", "")), seed=data.get("seed"),
                                 quick=data.get("quick"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"cannot read a reproduction summary from {str(path)!r}: {exc}") from exc
    return result


def rebuild_fidelity(
    root: Union[str, Path], *, quick: Optional[bool] = None, seed: Optional[int] = None, jobs: int = 1,
    seconds: Optional[float] = None,
) -> Path:
    """Rewrite ``fidelity.html`` / ``.md`` / ``.json`` of ``root`` from the targets' ``summary.json`` files
    (no rerun).

    The page's budgets (quick or full) and seed are those the summaries record; summaries that mix them are
    a ``ValueError`` naming the targets, and so is a ``quick`` or ``seed`` given here that disagrees with them
    (they are needed only for summaries of older versions, which do not record them).
    ``seconds``: the wall time of the run that made them (default: the sum of the targets' times)."""
    if quick is not None:
        check_bool(quick, f"quick={quick!r}")
    if seed is not None:
        check_seed(seed)
    root = Path(root)
    folders = sorted({p.parent for p in root.glob("*/summary.json")}
                     | {p.parent for p in root.glob(f"*/{UNFINISHED_MARKER}")})
    finished = [f for f in folders if (f / "summary.json").is_file()]
    if is_unfinished(root):  # its targets' summaries mix that run's with an earlier one's
        raise ValueError(f"the run of all targets in {str(root)!r} did not finish"
                         f"{', so its summaries mix runs' if finished else ' (no target finished)'}; run it "
                         f"again ({_rerun_command(root, finished)})")
    if not folders:
        raise FileNotFoundError(f"no */summary.json under {str(root)!r} (no target ran there); run "
                                f"'attnkit reproduce all --out {root}' first")
    if not finished and (quick is None or seed is None):  # every target failed: a page of failures
        raise ValueError(f"no target under {str(root)!r} finished (each folder holds an unfinished mark); "
                         "pass quick= and seed= (those of the run) to rebuild its page of failures")
    from .reproduce import TARGETS

    order = {name: i for i, name in enumerate(TARGETS)}  # the order of a run; unknown folders last
    results = []
    for folder in folders:
        if not (folder / "summary.json").is_file():  # a target whose one run failed or was stopped
            results.append(_failed(folder.name, folder, "it did not finish (its folder holds an unfinished "
                                   "mark and no summary.json); run it again"))
            continue
        result = load_result(folder)
        if is_unfinished(folder):  # the summary is an earlier run's; the latest did not finish
            earlier = result
            result = _failed(result.name, folder, "its latest run did not finish (the folder holds its "
                             "unfinished mark beside an earlier run's summary.json); run it again")
            result.seed, result.quick = earlier.seed, earlier.quick
        results.append(result)
    seen: dict[str, Path] = {}
    for r in results:
        if r.name in seen:
            raise ValueError(f"two summaries of target {r.name!r} under {str(root)!r}: {seen[r.name]} and "
                             f"{r.out}; keep one")
        seen[r.name] = r.out
    results.sort(key=lambda r: (order.get(r.name, len(order)), r.name))
    run_quick = _recorded(results, "quick", quick, root)
    run_seed = _recorded(results, "seed", seed, root)
    if run_quick is None or run_seed is None:
        missing = "quick" if run_quick is None else "seed"
        raise ValueError(f"the summaries under {str(root)!r} do not record {missing}; pass {missing}= "
                         "(the budgets and first seed of the run that made them)")
    wall = sum(r.seconds for r in results) if seconds is None else seconds
    run = RunInfo(quick=bool(run_quick), seed=int(run_seed), jobs=jobs, seconds=wall,
                  cpu_seconds=sum(r.cpu_seconds for r in results))
    write_fidelity_markdown(results, root / "fidelity.md", run=run)
    _write_fidelity_json(results, root / "fidelity.json", run=run)
    return write_fidelity_html(results, root / "fidelity.html", run=run)


def _rerun_command(root: Path, finished: Sequence[Path]) -> str:
    """``'attnkit reproduce all --out ROOT'`` with the ``--quick`` / ``--seed`` the finished targets'
    summaries record (the default budgets are a full run: hours)."""
    flags = ""
    try:
        recorded = [load_result(f) for f in finished]
        quick = {r.quick for r in recorded if r.quick is not None}
        seed = {r.seed for r in recorded if r.seed is not None}
    except (OSError, ValueError):
        quick, seed = set(), set()
    if quick == {True}:
        flags += " --quick"
    if len(seed) == 1 and seed != {0}:
        flags += f" --seed {next(iter(seed))}"
    return f"'attnkit reproduce all{flags} --out {root}'"


def _recorded(results: Sequence[ReproduceResult], key: str, given, root: Path):
    """The one value of ``key`` (``quick`` or ``seed``) the summaries record (``None`` if none does); a mix,
    or a ``given`` value that differs, is a ``ValueError`` naming the targets."""
    by_value: dict = {}
    for r in results:
        value = getattr(r, key)
        if value is None:
            continue
        # a summary.json is not trusted: "false" or 2.7 must not become True or seed 2 on the page
        if key == "quick" and not isinstance(value, bool):
            raise ValueError(f"{r.name}'s summary.json records quick={value!r}; expected true or false "
                             "(rerun the target)")
        if key == "seed":
            check_seed(value, f"{r.name}'s summary.json records seed")
        by_value.setdefault(value, []).append(r.name)
    if len(by_value) > 1:
        listed = "; ".join(f"{key}={v!r}: {', '.join(names)}" for v, names in by_value.items())
        raise ValueError(f"the summaries under {str(root)!r} mix runs ({listed}); rerun them with one {key} "
                         "('attnkit reproduce all') or rebuild each run's folder apart")
    value = next(iter(by_value), None)
    if given is not None and value is not None and given != value:
        raise ValueError(f"{key}={given!r} but the summaries under {str(root)!r} record {key}={value!r} "
                         f"({', '.join(by_value[value])}); leave {key} out")
    return value if value is not None else given


def _md(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def run_summary(results: Sequence[ReproduceResult], run: RunInfo) -> str:
    """One sentence: budgets (quick or full), claims held, targets, wall and CPU time, worker processes."""
    claims = [c for r in results for c in r.claims]
    crashed = did_not_run(results)
    failed = f" ({len(crashed)} did not run: {', '.join(crashed)})" if crashed else ""
    rerun = (
        f" A worker process died; {', '.join(run.rerun_alone)} (the targets it stopped) ran again, each in a "
        "process of its own." if run.rerun_alone else ""
    )
    return (
        f"{'Quick' if run.quick else 'Full'} budgets, first seed {run.seed}: "
        f"{sum(c.held for c in claims)} of {len(claims)} claims held; {len(results)} targets{failed} in "
        f"{run.seconds:.0f} s wall "
        f"({run.cpu_seconds:.0f} s CPU, {run.jobs} worker process{'es' if run.jobs > 1 else ''}, one thread "
        f"each).{rerun}"
    )


QUICK_NOTICE = (
    "This is a quick run (`attnkit reproduce all --quick`): a smoke test at budgets far below the full "
    "mode's (the budget of every target is listed below), meant to show that every experiment runs end to "
    "end. Its verdicts are those of these budgets; a claim about accuracy or training dynamics needs the "
    "full mode (`attnkit reproduce all`, or `attnkit reproduce NAME` for one target)."
)


def write_fidelity_markdown(
    results: Sequence[ReproduceResult], path: Union[str, Path], *, run: RunInfo
) -> Path:
    """The claims table of the fidelity page as Markdown (for the README and docs): one row per claim, then
    each target's budget, note, wall and CPU seconds."""
    path = Path(path)
    claims = [(r, c) for r in results for c in r.claims]
    lines = [run_summary(results, run), ""]
    if run.quick:
        lines += [QUICK_NOTICE, ""]
    lines += [
        "| target | source | claim | paper | ours | criterion | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for r, c in claims:
        lines.append(
            f"| {r.name} | {_md(c.source)} | {_md(c.statement)} | {_md(c.paper or '-')} | "
            f"{_md(c.ours or '-')} | {c.criterion} | **{verdict(c.held)}** |"
        )
    lines += ["", "| target | budget | wall s | CPU s | claims held |", "|---|---|---|---|---|"]
    for r in results:
        budget = _md(r.budget or "-") + (f" **{_md(r.note)}**" if r.note else "")
        lines.append(f"| {r.name} | {budget} | {r.seconds:.0f} | {r.cpu_seconds:.0f} | "
                     f"{sum(c.held for c in r.claims)} of {len(r.claims)} |")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")  # "±": not the locale's encoding
    return path


# Plots are embedded at most this wide, in 128 colours, and a quick page embeds at most
# QUICK_PLOTS_PER_TARGET plots of each target (the others are listed by name): the page stays under 1 MB.
EMBED_MAX_WIDTH = 800
EMBED_COLOURS = 128
QUICK_PLOTS_PER_TARGET = 2


def _png_data_uri(path: Path) -> str:
    """``path`` as a data URI, scaled down to ``EMBED_MAX_WIDTH`` pixels and stored with an
    ``EMBED_COLOURS``-colour palette (line plots and heat maps lose nothing visible)."""
    import io

    from PIL import Image

    with Image.open(path) as image:
        image = image.convert("RGB")
        if image.width > EMBED_MAX_WIDTH:
            height = round(image.height * EMBED_MAX_WIDTH / image.width)
            image = image.resize((EMBED_MAX_WIDTH, height), Image.LANCZOS)
        buffer = io.BytesIO()
        image.quantize(EMBED_COLOURS).save(buffer, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _esc(value) -> str:
    return html.escape(format_value(value) if not isinstance(value, str) else value)


# Narrow windows: the body keeps a margin at the sides, long words wrap, and a table wider than the window
# scrolls inside its own ``.wide`` box instead of running past the right edge.
_STYLE = """
body { font-family: sans-serif; max-width: 1200px; margin: 2em auto; padding: 0 1em; box-sizing: border-box;
       color: #222; overflow-wrap: break-word; }
.wide { overflow-x: auto; max-width: 100%; margin: 0.5em 0 1.5em; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #bbb; padding: 0.25em 0.5em; vertical-align: top; text-align: left; }
td { max-width: 40em; }
figure { margin: 1em 0; }
th { background: #eee; }
.held { background: #d8f5d8; } .not-held { background: #f8d0d0; }
img { max-width: 100%; border: 1px solid #ddd; margin: 0.3em 0; }
.meta { color: #555; font-size: 0.9em; }
.quick { background: #fff3cd; border: 1px solid #e0c060; padding: 0.5em; }
"""


def write_fidelity_html(
    results: Sequence[ReproduceResult], path: Union[str, Path], *, run: RunInfo
) -> Path:
    """Write the self-contained fidelity page for ``results`` to ``path`` and return it."""
    import torch

    path = Path(path)
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        "<title>attnkit fidelity report</title>",
        f"<style>{_STYLE}</style></head><body>",
        "<h1>attnkit: the papers' claims, reproduced at CPU scale</h1>",
        f"<p class='meta'>{html.escape(run_summary(results, run))} "
        f"Python {html.escape(platform.python_version())}, "
        f"torch {html.escape(torch.__version__)}, {html.escape(platform.platform())}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.</p>",
    ]
    if run.quick:
        parts.append(f"<p class='quick'>{html.escape(QUICK_NOTICE).replace('`', '')}</p>")
    parts.append(
        "<p>Criterion <b>paper</b>: the paper's own test; <b>weaker</b>: a looser reading, shown next to the "
        "paper's; <b>different</b>: the same statement measured on another task or scale than the "
        "paper's.</p>"
    )
    by_paper: dict[str, list[ReproduceResult]] = {}
    for r in results:
        by_paper.setdefault(paper_of(r.name), []).append(r)
    for key, group in by_paper.items():
        parts.append(f"<h2>{html.escape(PAPERS[key])}</h2>")
        parts.append(
            "<div class='wide'><table><tr><th>target</th><th>source</th><th>claim</th><th>paper</th>"
            "<th>ours</th><th>criterion</th><th>verdict</th><th>evidence</th></tr>"
        )
        for r in group:
            for c in r.claims:
                cls = "held" if c.held else "not-held"
                parts.append(
                    f"<tr class='{cls}'><td><a href='#{_esc(r.name)}'>{_esc(r.name)}</a></td>"
                    f"<td>{_esc(c.source)}</td><td>{_esc(c.statement)}</td><td>{_esc(c.paper or '-')}</td>"
                    f"<td>{_esc(c.ours or '-')}</td>"
                    f"<td>{_esc(c.criterion)}</td><td><b>{verdict(c.held)}</b></td>"
                    f"<td>{'(as ours)' if c.evidence == c.ours else _esc(c.evidence)}</td></tr>"
                )
        parts.append("</table></div>")
    parts.append("<h2>Budgets and time</h2>")
    parts.append(
        "<div class='wide'><table><tr><th>target</th><th>budget</th><th>wall s</th><th>CPU s</th>"
        "<th>claims held</th></tr>"
    )
    for r in results:
        note = f"<br><b>{_esc(r.note)}</b>" if r.note else ""
        parts.append(
            f"<tr><td><a href='#{_esc(r.name)}'>{_esc(r.name)}</a></td><td>{_esc(r.budget or '-')}{note}</td>"
            f"<td>{r.seconds:.0f}</td><td>{r.cpu_seconds:.0f}</td>"
            f"<td>{sum(c.held for c in r.claims)} of {len(r.claims)}</td></tr>"
        )
    parts.append("</table></div>")
    for r in results:
        parts.append(f"<h2 id='{_esc(r.name)}'>{_esc(r.name)}</h2>")
        parts.append(
            f"<p class='meta'>budget: {_esc(r.budget or '-')}; {r.seconds:.1f} s wall, "
            f"{r.cpu_seconds:.1f} s CPU</p>"
        )
        if r.note:
            parts.append(f"<p class='quick'>{_esc(r.note)}</p>")
        if r.rows:
            columns = table_columns(r.rows)
            head = "".join(f"<th>{_esc(c)}</th>" for c in columns)
            parts.append(f"<div class='wide'><table><tr>{head}</tr>")
            for row in r.rows:
                parts.append("<tr>" + "".join(f"<td>{_esc(row.get(c, ''))}</td>" for c in columns) + "</tr>")
            parts.append("</table></div>")
        plots = [f for f in r.files if f.suffix == ".png" and f.is_file()]
        shown = plots[:QUICK_PLOTS_PER_TARGET] if run.quick else plots
        for f in shown:
            parts.append(
                f"<figure><img alt='{_esc(f.name)}' src='{_png_data_uri(f)}'>"
                f"<figcaption>{_esc(f.name)}</figcaption></figure>"
            )
        if len(shown) < len(plots):
            parts.append(
                f"<p class='meta'>Not embedded in the quick page: "
                f"{_esc(', '.join(f.name for f in plots[len(shown):]))} (in the target's output folder).</p>"
            )
    parts.append("</body></html>")
    path.write_text("\n".join(parts) + "\n", encoding="utf-8")  # as <meta charset> says, whatever the locale
    return path
