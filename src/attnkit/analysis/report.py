"""What a reproduction produces: a table, the claims it checked, and the files it wrote.

Shared by the targets of :mod:`attnkit.analysis.reproduce`; each writes PNG plots and CSV data into one
output directory, which is never overwritten unless asked.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

from .._files import json_loads, lock_folder, make_out_dir

__all__ = [
    "Claim",
    "CRITERIA",
    "ReproduceResult",
    "prepare_output_dir",
    "is_unfinished",
    "unfinished_without_record",
    "record_replaced",
    "replaced_in_mark",
    "mark_finished",
    "write_csv",
    "format_value",
    "from_jsonable",
    "spread",
    "verdict",
    "exceeds",
    "table_columns",
]

CRITERIA: tuple[str, ...] = ("paper", "weaker", "different")


@dataclass(frozen=True)
class Claim:
    """A paper's claim, whether the reproduction supports it, and the numbers behind the verdict.

    ``source`` quotes where the paper states it (figure, table, section), ``statement`` the claim in the
    paper's words; ``paper`` is the paper's value or criterion and ``ours`` our measurement (with its
    spread over seeds). ``criterion`` says how the check relates to the paper's: ``"paper"`` (the paper's
    own criterion), ``"weaker"`` (a looser criterion, always reported next to the paper's) or
    ``"different"`` (another measurement of the same statement, e.g. at a scale the paper did not use).
    """

    source: str
    statement: str
    held: bool
    evidence: str
    paper: str = ""
    ours: str = ""
    criterion: str = "paper"

    def __post_init__(self) -> None:
        if self.criterion not in CRITERIA:
            raise ValueError(f"Claim criterion={self.criterion!r}; expected one of {CRITERIA}")
        object.__setattr__(self, "held", bool(self.held))

    @property
    def verdict(self) -> str:
        return verdict(self.held)


def verdict(held: bool) -> str:
    """``"held"`` or ``"not held"``: the words every report uses for a claim's outcome."""
    return "held" if held else "not held"


def spread(values: Sequence[float], digits: int = 3) -> str:
    """``"mean +- std (n=K)"`` of per-seed values (sample std); ``"value (1 seed)"`` for one seed, which has
    no spread to report."""
    v = [float(x) for x in values]
    if not v:
        raise ValueError("spread() needs at least one value")
    if len(v) == 1:
        return f"{v[0]:.{digits}g} (1 seed)"
    mean = sum(v) / len(v)
    std = math.sqrt(sum((x - mean) ** 2 for x in v) / (len(v) - 1))
    return f"{mean:.{digits}g} +- {std:.2g} (n={len(v)})"


def exceeds(a: Sequence[float], b: Sequence[float]) -> tuple[bool, str]:
    """Whether the mean of the per-seed values ``a`` exceeds that of ``b`` by more than two standard errors
    of the difference (a gap within the seeds' noise supports no "better than"), and the words for it.

    With one seed on either side, or no spread on both, there is no noise to judge by, so no gap counts
    (seed noise alone could give it), and the words say so."""
    a, b = [float(x) for x in a], [float(x) for x in b]
    if not a or not b:
        raise ValueError("exceeds() needs at least one value on each side")
    gap = sum(a) / len(a) - sum(b) / len(b)
    if len(a) < 2 or len(b) < 2:
        return False, f"gap {gap:+.4f} (1 seed: no spread to judge the gap by, so no 'better')"

    def se2(v: list[float]) -> float:
        m = sum(v) / len(v)
        return sum((x - m) ** 2 for x in v) / (len(v) - 1) / len(v)

    noise = 2 * math.sqrt(se2(a) + se2(b))
    if noise == 0:  # every seed gave the same value on both sides: no estimate of the noise, not a zero one
        return False, f"gap {gap:+.4f} (no spread over the seeds on either side to judge it by)"
    return gap > noise, f"gap {gap:+.4f}, {'beyond' if gap > noise else 'within'} 2 s.e. = {noise:.4f}"


@dataclass
class ReproduceResult:
    """``rows``: the printed table (one dict per row, same keys); ``claims``; ``files`` written, in order;
    ``seconds``: the wall time of the run; ``cpu_seconds``: the CPU time of its process (all threads), which
    a loaded machine does not inflate; ``note``: what a reader must know about the budget (e.g. that a quick
    run is below the smallest budget at which the claim means something)."""

    name: str
    out: Path
    rows: list[dict] = field(default_factory=list)
    claims: list[Claim] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    seconds: float = 0.0
    budget: str = ""
    cpu_seconds: float = 0.0
    note: str = ""
    seed: Optional[int] = None
    quick: Optional[bool] = None

    @property
    def all_held(self) -> bool:
        """True when every claim held (and there is at least one claim)."""
        return bool(self.claims) and all(c.held for c in self.claims)

    @property
    def failed(self) -> list[Claim]:
        return [c for c in self.claims if not c.held]

    def add_file(self, path: Union[str, Path]) -> Path:
        path = Path(path)
        self.files.append(path)
        record_written(path)  # so that the next run in an unfinished folder removes it, and nothing else
        return path

    def write_summary(self) -> Path:
        """Write ``summary.json`` (rows, claims, files) next to the other outputs."""
        from .. import __version__

        data = {
            "name": self.name,
            "seed": self.seed,  # the numbers depend on both: a summary says how it was made
            "quick": self.quick,
            "attnkit": __version__,
            "seconds": round(self.seconds, 2),
            "cpu_seconds": round(self.cpu_seconds, 2),
            "budget": self.budget,
            "note": self.note,
            "rows": [{k: _jsonable(v) for k, v in row.items()} for row in self.rows],
            "claims": [{**c.__dict__, "verdict": c.verdict} for c in self.claims],
            "files": [p.name for p in self.files],
        }
        path = self.out / "summary.json"
        path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        return self.add_file(path)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf", "-inf": JSON has no such numbers
    if hasattr(value, "item"):
        return _jsonable(value.item())
    return value


_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def from_jsonable(value: Any) -> Any:
    """The inverse of what ``summary.json`` stores for a table cell: ``"nan"``, ``"inf"`` and ``"-inf"`` are
    floats again (so a page rebuilt from the summary shows them as the run's own page did)."""
    return _NON_FINITE.get(value, value) if isinstance(value, str) else value


# Written into an output directory when a run starts and removed when it finishes: a run that was killed
# (Ctrl-C, out of memory) leaves it behind, and the next run may replace that directory's files without
# --overwrite, since they are ours and incomplete.
UNFINISHED_MARKER = ".attnkit-unfinished"
STAGING_PREFIX = ".attnkit-reproduce-"  # the folder inside --out that a run writes into until it finishes
# what a reproduction writes: a file that a mark or a summary.json lists is removed only if its name is one
# of these (those files come from a folder the user may have been given: a list naming thesis.tex or a
# folder of data does not make them ours)
OUTPUT_SUFFIXES = (".csv", ".png", ".txt", ".json")


def is_output_name(name: str) -> bool:
    """Whether ``name`` is a plain file name (no folder, not ``.``/``..``) of the kinds a reproduction writes
    (:data:`OUTPUT_SUFFIXES`)."""
    return Path(name).name == name and name not in ("", ".", "..") and name.endswith(OUTPUT_SUFFIXES)


def prepare_output_dir(out: Union[str, Path], overwrite: bool = False) -> Path:
    """Create ``out`` and mark it unfinished (:func:`mark_finished` removes the mark); refuse an existing
    non-empty directory unless ``overwrite`` (files are then replaced) or it holds a run of ours that did
    not finish. The mark lists what the run wrote (``record_written``); a later run in a folder whose run
    did not finish first removes those entries (the partial files of that run), so that none of them is
    taken for a result of the new one, and leaves everything else (what the user saved there)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(
            f"output path {str(out)!r} exists and is not a directory; pass another "
            "--out"
        )
    if out.is_dir():
        _lock(out)  # before reading its mark: a run still going has an unfinished mark too
    try:
        if is_unfinished(out):
            print(f"{out} holds a run that did not finish; replacing its files", file=sys.stderr, flush=True)
            _remove_unfinished_files(out)
        elif out.is_dir() and any(out.iterdir()) and not overwrite:
            raise FileExistsError(
                f"output directory {str(out)!r} is not empty; pass --overwrite to replace its files or "
                "choose another --out"
            )
        created = not out.is_dir()
        make_out_dir(out)
        if created:
            _lock(out)
        _write_mark(out, [])
    except BaseException:
        release(out)  # refused, or failed: the folder is not this process's to hold
        raise
    return out


def _write_mark(out: Path, written: list[str], replaced: Sequence[str] = (),
                finished: Optional[Mapping[str, str]] = None) -> None:
    note = "attnkit: this run did not finish; the next run replaces its files\n"
    # "finished" always (empty at first): a mark without it is an older version's, which recorded no digests
    record = {"written": written, **({"replaced": list(replaced)} if replaced else {}),
              "finished": dict(finished or {})}
    try:
        (out / UNFINISHED_MARKER).write_text(note + json.dumps(record) + "\n", encoding="utf-8")
    except PermissionError as exc:  # named the hidden mark: "Permission denied: '.../.attnkit-unfinished'"
        raise PermissionError(
            f"--out {out} cannot be written ({exc.strerror or type(exc).__name__}); choose another --out"
        ) from None


def _finished(marker: Path) -> Optional[dict[str, str]]:
    """The target folders a run of all targets finished, each with its ``summary.json``'s SHA-256; ``None``
    for a mark that records none (an older version's, or an unreadable one)."""
    try:
        lines = marker.read_text(encoding="utf-8").splitlines()
        found = json_loads(lines[1]).get("finished") if len(lines) > 1 else None
    except (OSError, ValueError, KeyError, TypeError, IndexError, RecursionError, AttributeError):
        return None
    if not isinstance(found, dict):
        return None
    return {k: v for k, v in found.items() if isinstance(k, str) and isinstance(v, str)}


def _summary_digest(folder: Path) -> Optional[str]:
    import hashlib

    summary = folder / "summary.json"
    if not summary.is_file() or summary.is_symlink():
        return None
    try:
        return hashlib.sha256(summary.read_bytes()).hexdigest()
    except OSError:
        return None


def record_finished(folder: Union[str, Path]) -> None:
    """Note in the mark of ``folder``'s parent (a run of all targets) the digest of the ``summary.json`` the
    target just wrote into ``folder``: the next run removes those results only while they are still these."""
    folder = Path(folder)
    marker = folder.parent / UNFINISHED_MARKER
    digest = _summary_digest(folder)
    if marker.is_file() and digest is not None:
        _write_mark(folder.parent, _written(marker) or [], _mark_list(marker, "replaced") or [],
                    {**(_finished(marker) or {}), folder.name: digest})


def results_saved_since(out: Union[str, Path]) -> list[str]:
    """The target folders of the unfinished run of all targets in ``out`` that now hold finished results
    that run did not write (a target run alone into its folder since, or the earlier results an interrupted
    ``--overwrite`` had not reached yet)."""
    out = Path(out)
    marker = out / UNFINISHED_MARKER
    if not marker.is_file():
        return []
    finished = _finished(marker)
    if finished is None:  # an older version's mark: its folders are taken as its own, as that version did
        return []
    names = dict.fromkeys([*(_written(marker) or []), *(_mark_list(marker, "replaced") or [])])
    return [n for n in names if Path(n).name == n and not n.startswith(STAGING_PREFIX)
            and (digest := _summary_digest(out / n)) is not None and finished.get(n) != digest]


def _mark_list(marker: Path, key: str) -> Optional[list[str]]:
    try:
        lines = marker.read_text(encoding="utf-8").splitlines()
        names = json_loads(lines[1]).get(key, [] if key != "written" else None) if len(lines) > 1 else None
    except (OSError, ValueError, KeyError, TypeError, IndexError, RecursionError, AttributeError):
        return None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return None
    return names


def _written(marker: Path) -> Optional[list[str]]:
    """The names the run that wrote ``marker`` wrote into its folder, or ``None`` (no record: a mark of an
    older version, or an unreadable one)."""
    return _mark_list(marker, "written")


def written_in_mark(out: Union[str, Path]) -> list[str]:
    """What the unfinished run of ``out`` listed as written (its own files and folders; [] without a mark)."""
    marker = Path(out) / UNFINISHED_MARKER
    return (_written(marker) or []) if marker.is_file() else []


def replaced_in_mark(out: Union[str, Path]) -> list[str]:
    """The folders in ``out`` whose files an unfinished run of all targets was replacing (``--overwrite``):
    the next run replaces them too, file by file, keeping what else the user saved there."""
    marker = Path(out) / UNFINISHED_MARKER
    return (_mark_list(marker, "replaced") or []) if marker.is_file() else []


def record_replaced(path: Union[str, Path]) -> None:
    """Add ``path``'s name to the ``replaced`` list of its folder's unfinished mark."""
    path = Path(path)
    marker = path.parent / UNFINISHED_MARKER
    if marker.is_file():
        replaced = _mark_list(marker, "replaced") or []
        if path.name not in replaced:
            _write_mark(path.parent, _written(marker) or [], replaced + [path.name], _finished(marker))


def record_written(path: Union[str, Path]) -> None:
    """Add ``path``'s name to the unfinished mark of its folder (nothing without a mark)."""
    path = Path(path)
    marker = path.parent / UNFINISHED_MARKER
    if not marker.is_file():
        return
    written = _written(marker) or []
    if path.name not in written and path.name != UNFINISHED_MARKER:
        _write_mark(path.parent, written + [path.name], _mark_list(marker, "replaced") or [],
                    _finished(marker))


def _remove_unfinished_files(out: Path) -> None:
    """Remove what the unfinished run of ``out`` wrote, as its mark lists it (nothing, without that record):
    a file saved there since, or before with ``--overwrite``, stays. A listed folder is a staging folder
    (removed whole) or a target's folder of a run of all targets, of which only the run's own files go
    (:func:`_remove_run_folder`), so that a file saved in it since stays too."""
    finished = _finished(out / UNFINISHED_MARKER)
    for name in _written(out / UNFINISHED_MARKER) or []:
        path = out / name
        if Path(name).name != name or name in ("", ".", ".."):  # a hand-edited mark: only plain names
            continue
        if path.is_dir() and not path.is_symlink():
            if name.startswith(STAGING_PREFIX):
                shutil.rmtree(path)
            elif finished is None or _summary_digest(path) in (None, finished.get(name)):  # saved since: stay
                _remove_run_folder(path)
        elif (path.exists() or path.is_symlink()) and is_output_name(name):  # an older version's partial
            path.unlink()


def _remove_run_folder(folder: Path) -> None:
    """Remove the files of the reproduction in ``folder``: an unfinished one's (its mark's list) or a finished
    one's (its ``summary.json``'s list, and the summary), then ``folder`` if nothing else is left."""
    if is_unfinished(folder):
        _remove_unfinished_files(folder)
        (folder / UNFINISHED_MARKER).unlink(missing_ok=True)
    summary = folder / "summary.json"
    if summary.is_file() and not summary.is_symlink():
        try:
            files = json_loads(summary.read_text(encoding="utf-8")).get("files")
        except (OSError, ValueError, AttributeError, RecursionError):
            files = None
        if isinstance(files, list) and all(isinstance(f, str) for f in files):
            for name in [*files, summary.name]:
                path = folder / name
                if is_output_name(name) and path.is_file() and not path.is_symlink():
                    path.unlink()
    try:
        folder.rmdir()
    except OSError:  # what the user saved there stays (and the folder with it)
        pass


def unfinished_without_record(out: Union[str, Path]) -> bool:
    """Whether ``out`` holds an unfinished run whose mark does not say what it wrote (an older version's)."""
    return is_unfinished(out) and _written(Path(out) / UNFINISHED_MARKER) is None


def is_unfinished(out: Union[str, Path]) -> bool:
    """Whether ``out`` holds a run that started and did not finish (see :func:`prepare_output_dir`)."""
    return (Path(out) / UNFINISHED_MARKER).is_file()


def mark_finished(out: Union[str, Path]) -> None:
    """Remove the unfinished mark of ``out``: the run that wrote it finished (and release the folder)."""
    (Path(out) / UNFINISHED_MARKER).unlink(missing_ok=True)
    release(out)


def release(out: Union[str, Path]) -> None:
    """Release this process's lock on ``out`` (a run that finished, failed or was interrupted; its mark
    stays until :func:`mark_finished`)."""
    fd = _LOCKS.pop(str(Path(out).resolve()), None)
    if fd is not None:
        os.close(fd)


_LOCKS: dict[str, int] = {}  # the output folders this process runs in: their flock descriptors


def _lock(out: Path) -> None:
    """An exclusive lock on the folder ``out`` for as long as this process runs in it (the system releases
    it when the process ends, even killed): a second ``attnkit reproduce`` into the same folder is refused
    instead of mixing its files with the first's."""
    key = str(out.resolve())
    if key in _LOCKS:
        return
    fd = lock_folder(out, "attnkit reproduce process: wait for it to finish (or stop it), or choose another "
                          "--out")
    if fd is not None:
        _LOCKS[key] = fd


def table_columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The keys of all ``rows``, in the order they first appear (rows of a table may add their own: the
    mode-collapse sweep's rows hold a value per mechanism, and a table of the first row's keys left them
    blank)."""
    return list(dict.fromkeys(key for row in rows for key in row))


def write_csv(path: Union[str, Path], rows: Sequence[Mapping[str, Any]], columns: Iterable[str] = ()) -> Path:
    """Write ``rows`` (dicts) as CSV with a header; ``columns`` fixes the order (default: every row's keys,
    ``table_columns``)."""
    path = Path(path)
    columns = list(columns) or table_columns(rows)
    with path.open("w", newline="", encoding="utf-8") as f:  # rows may hold "±", whatever the locale
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _jsonable(row.get(k, "")) for k in columns})
    return path


def format_value(value: Any) -> str:
    """Short text for a table cell: floats with 4 significant digits, ``"-"`` for NaN (a cell that does not
    apply, as the terminal table shows it), the rest as ``str``. CSV files keep ``"nan"`` (``write_csv``)."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.3e}"
        return f"{value:.4g}"
    return str(value)
