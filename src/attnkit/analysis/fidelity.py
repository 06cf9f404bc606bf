"""``reproduce_all``: run every reproduction target and write one self-contained HTML fidelity page.

The page lists, per paper, every claim a target checked: the paper's wording and source, the paper's value
or criterion, ours (with the spread over seeds), whether our criterion is the paper's, and held / not
held; the targets' tables and PNG plots (embedded as data URIs, so the page is one file) follow.
"""

from __future__ import annotations

import base64
import html
import json
import platform
import time
from pathlib import Path
from typing import Optional, Sequence, Union

from .report import ReproduceResult, format_value, prepare_output_dir, verdict

__all__ = [
    "reproduce_all",
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


def reproduce_all(
    out: Optional[Union[str, Path]] = None,
    *,
    overwrite: bool = False,
    quick: bool = False,
    seed: int = 0,
    targets: Optional[Sequence[str]] = None,
) -> tuple[list[ReproduceResult], Path]:
    """Run ``targets`` (default: all registered) into ``out/<name>`` and write ``out/fidelity.html``.

    Returns the results and the page's path. A target that raises is recorded as one failed claim
    ("the target ran") with the error, so one broken target never hides the others.
    """
    from .reproduce import TARGETS, reproduce

    names = list(TARGETS) if targets is None else list(targets)
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        raise ValueError(f"unknown reproduction targets {unknown}; expected names from {tuple(TARGETS)}")
    root = prepare_output_dir(Path("runs") / "reproduce" / "all" if out is None else out, overwrite=overwrite)
    results = []
    start = time.perf_counter()
    for name in names:
        try:
            results.append(reproduce(name, root / name, overwrite=overwrite, quick=quick, seed=seed))
        except (ImportError, RuntimeError, ValueError, OSError) as exc:
            from .report import Claim

            failed = ReproduceResult(name=name, out=root / name)
            failed.claims.append(Claim(name, "the target ran", False, f"{type(exc).__name__}: {exc}"))
            results.append(failed)
    page = write_fidelity_html(
        results, root / "fidelity.html", quick=quick, seed=seed, seconds=time.perf_counter() - start
    )
    write_fidelity_markdown(results, root / "fidelity.md", quick=quick, seed=seed)
    summary = [
        {
            "name": r.name,
            "seconds": round(r.seconds, 1),
            "budget": r.budget,
            "claims": [{**c.__dict__, "verdict": c.verdict} for c in r.claims],
        }
        for r in results
    ]
    (root / "fidelity.json").write_text(json.dumps(summary, indent=2) + "\n")
    return results, page


def load_result(folder: Union[str, Path]) -> ReproduceResult:
    """A target's result read back from its ``summary.json`` (rows, claims, files, seconds, budget)."""
    from .report import Claim

    folder = Path(folder)
    path = folder / "summary.json"
    try:
        data = json.loads(path.read_text())
        claims = [Claim(**{k: c[k]
                           for k in ("source", "statement", "held", "evidence", "paper", "ours", "criterion")
                           if k in c}) for c in data["claims"]]
        result = ReproduceResult(name=data["name"], out=folder, rows=list(data["rows"]), claims=claims,
                                 files=[folder / f for f in data["files"]], seconds=float(data["seconds"]),
                                 budget=str(data.get("budget", "")))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot read a reproduction summary from {str(path)!r}: {exc}") from exc
    return result


def rebuild_fidelity(root: Union[str, Path], *, quick: bool, seed: int = 0) -> Path:
    """Rewrite ``fidelity.html`` / ``.md`` of ``root`` from the targets' ``summary.json`` (no rerun)."""
    root = Path(root)
    folders = sorted(p.parent for p in root.glob("*/summary.json"))
    if not folders:
        raise FileNotFoundError(f"no */summary.json under {str(root)!r}; run 'attnkit reproduce all' first")
    results = [load_result(f) for f in folders]
    write_fidelity_markdown(results, root / "fidelity.md", quick=quick, seed=seed)
    return write_fidelity_html(results, root / "fidelity.html", quick=quick, seed=seed,
                               seconds=sum(r.seconds for r in results))


def _md(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def write_fidelity_markdown(
    results: Sequence[ReproduceResult], path: Union[str, Path], *, quick: bool, seed: int
) -> Path:
    """The claims table of the fidelity page as Markdown (for the README and docs): one row per claim."""
    path = Path(path)
    claims = [(r, c) for r in results for c in r.claims]
    lines = [
        f"{'Quick' if quick else 'Full'} budgets, first seed {seed}: {sum(c.held for _, c in claims)} of "
        f"{len(claims)} claims held.",
        "",
        "| target | source | claim | paper | ours | criterion | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for r, c in claims:
        lines.append(
            f"| {r.name} | {_md(c.source)} | {_md(c.statement)} | {_md(c.paper or '-')} | "
            f"{_md(c.ours or '-')} | {c.criterion} | **{verdict(c.held)}** |"
        )
    lines += ["", "| target | budget | seconds |", "|---|---|---|"]
    lines += [f"| {r.name} | {_md(r.budget or '-')} | {r.seconds:.0f} |" for r in results]
    path.write_text("\n".join(lines) + "\n")
    return path


def _png_data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def _esc(value) -> str:
    return html.escape(format_value(value) if not isinstance(value, str) else value)


_STYLE = """
body { font-family: sans-serif; max-width: 1200px; margin: 2em auto; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #bbb; padding: 0.25em 0.5em; vertical-align: top; text-align: left; }
th { background: #eee; }
.held { background: #d8f5d8; } .not-held { background: #f8d0d0; }
img { max-width: 100%; border: 1px solid #ddd; margin: 0.3em 0; }
.meta { color: #555; font-size: 0.9em; }
"""


def write_fidelity_html(
    results: Sequence[ReproduceResult], path: Union[str, Path], *, quick: bool, seed: int, seconds: float
) -> Path:
    """Write the self-contained fidelity page for ``results`` to ``path`` and return it."""
    import torch

    path = Path(path)
    claims = [(r, c) for r in results for c in r.claims]
    n_held = sum(c.held for _, c in claims)
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        "<title>attnkit fidelity report</title>",
        f"<style>{_STYLE}</style></head><body>",
        "<h1>attnkit: the papers' claims, reproduced at CPU scale</h1>",
        f"<p class='meta'>{'quick' if quick else 'full'} budgets, first seed {seed}; {len(results)} targets "
        f"in {seconds:.0f} s; {n_held} of {len(claims)} claims held. "
        f"Python {html.escape(platform.python_version())}, "
        f"torch {html.escape(torch.__version__)}, {html.escape(platform.platform())}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.</p>",
        "<p>Criterion <b>paper</b>: the paper's own test; <b>weaker</b>: a looser reading, shown next to the "
        "paper's; <b>different</b>: the same statement measured on another task or scale than the "
        "paper's.</p>",
    ]
    by_paper: dict[str, list[ReproduceResult]] = {}
    for r in results:
        by_paper.setdefault(paper_of(r.name), []).append(r)
    for key, group in by_paper.items():
        parts.append(f"<h2>{html.escape(PAPERS[key])}</h2>")
        parts.append(
            "<table><tr><th>target</th><th>source</th><th>claim</th><th>paper</th><th>ours</th>"
            "<th>criterion</th><th>verdict</th><th>evidence</th></tr>"
        )
        for r in group:
            for c in r.claims:
                cls = "held" if c.held else "not-held"
                parts.append(
                    f"<tr class='{cls}'><td><a href='#{_esc(r.name)}'>{_esc(r.name)}</a></td>"
                    f"<td>{_esc(c.source)}</td><td>{_esc(c.statement)}</td><td>{_esc(c.paper or '-')}</td>"
                    f"<td>{_esc(c.ours or '-')}</td>"
                    f"<td>{_esc(c.criterion)}</td><td><b>{verdict(c.held)}</b></td><td>{_esc(c.evidence)}</td></tr>"
                )
        parts.append("</table>")
    for r in results:
        parts.append(f"<h2 id='{_esc(r.name)}'>{_esc(r.name)}</h2>")
        parts.append(f"<p class='meta'>budget: {_esc(r.budget or '-')}; {r.seconds:.1f} s</p>")
        if r.rows:
            columns = list(r.rows[0])
            parts.append("<table><tr>" + "".join(f"<th>{_esc(c)}</th>" for c in columns) + "</tr>")
            for row in r.rows:
                parts.append("<tr>" + "".join(f"<td>{_esc(row.get(c, ''))}</td>" for c in columns) + "</tr>")
            parts.append("</table>")
        for f in r.files:
            if f.suffix == ".png" and f.is_file():
                parts.append(
                    f"<figure><img alt='{_esc(f.name)}' src='{_png_data_uri(f)}'>"
                    f"<figcaption>{_esc(f.name)}</figcaption></figure>"
                )
    parts.append("</body></html>")
    path.write_text("\n".join(parts) + "\n")
    return path
