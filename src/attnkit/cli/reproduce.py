"""``attnkit reproduce NAME``: rerun a figure or claim of the papers (a thin layer over
``attnkit.analysis.reproduce``). Writes PNG plots, CSV data and ``summary.json``; prints a table and
whether each paper claim held. ``NAME=all`` runs every target and writes one HTML fidelity page;
``--strict`` exits with code 1 when a claim is not held."""

from __future__ import annotations

import math
import sys
from typing import Optional

import typer

__all__ = ["register"]


def _print_result(result) -> None:
    from attnkit.cli._screen import add_fitted_columns
    from attnkit.cli._screen import console as make_console
    from rich.table import Table

    from attnkit.analysis.report import format_value, table_columns

    console = make_console()
    if result.rows:
        table = Table(title=f"attnkit reproduce {result.name}")
        columns = table_columns(result.rows)
        rows = []
        for row in result.rows:
            cells = []
            for column in columns:
                value = row.get(column, "")
                cells.append("-" if isinstance(value, float) and math.isnan(value) else format_value(value))
            rows.append(cells)
        add_fitted_columns(table, columns, rows, left=columns[:1])
        for cells in rows:
            table.add_row(*cells)
        console.print(table, crop=False)
    claims = Table(title="paper claims")
    rows = [[str(i), claim.verdict, f"{claim.statement} ({claim.source})", claim.paper or "-",
             claim.ours or "-", claim.criterion] for i, claim in enumerate(result.claims, 1)]
    add_fitted_columns(claims, ["#", "verdict", "claim (source)", "paper", "ours", "criterion"], rows,
                       left=())
    for cells in rows:
        claims.add_row(*cells)
    console.print(claims, crop=False)
    for i, claim in enumerate(result.claims, 1):
        console.print(f"{i}. {claim.verdict}: {claim.evidence}", highlight=False)
    if result.budget:
        console.print(f"budget: {result.budget}")
    console.print(f"{len(result.files)} files written to {result.out} in {result.seconds:.1f} s")


def register(app: typer.Typer) -> None:
    from attnkit.analysis.reproduce import TARGET_HELP

    targets = "\n\n".join(f"{name}: {text}" for name, text in TARGET_HELP.items())

    @app.command(
        help=f"Reproduce a figure or claim of the papers (PNG + CSV + table).\n\nTargets:\n\n{targets}"
    )
    def reproduce(
        name: str = typer.Argument(
            ..., help=f"One of: {', '.join(TARGET_HELP)}, or all (HTML fidelity page)."
        ),
        out: Optional[str] = typer.Option(  # str: typer would turn "" into Path(".")
            None, "--out", help="Output directory (default runs/reproduce/NAME)."
        ),
        overwrite: bool = typer.Option(
            False, "--overwrite",
            help="Replace files in a non-empty output directory; once the run finishes, the files an earlier "
            "reproduction there listed in its summary.json and this run did not write are removed.",
        ),
        quick: bool = typer.Option(False, "--quick", help="Smaller sizes and shorter training (smoke test)."),
        seed: int = typer.Option(0, "--seed", help="Random seed (the first of a target's seeds)."),
        strict: bool = typer.Option(False, "--strict", help="Exit with code 1 when any claim is not held."),
        jobs: int = typer.Option(
            0, "--jobs", help="With 'all': targets run at once in worker processes (0: one per free core)."
        ),
    ) -> None:
        from attnkit.analysis.fidelity import did_not_run, reproduce_all
        from attnkit.analysis.reproduce import check_output_parents, reproduce as run

        if out is not None and not out.strip():
            raise ValueError("--out is empty; pass a directory such as runs/reproduce/NAME")
        if name != "all" and jobs != 0:
            raise ValueError(
                f"--jobs {jobs} is only used with 'all' (a target runs in this process); drop it"
            )
        if out is not None:
            check_output_parents(out)  # a file where a folder above --out should be: name it
        try:
            if name == "all":
                results, page = reproduce_all(out, overwrite=overwrite, quick=quick, seed=seed, jobs=jobs)
            else:
                results, page = [run(name, out, overwrite=overwrite, quick=quick, seed=seed)], None
        except ImportError as exc:  # matplotlib missing: a user-fixable environment problem
            raise ValueError(str(exc)) from exc
        for result in results:
            _print_result(result)
        failed = [(r.name, c) for r in results for c in r.failed]
        total = sum(len(r.claims) for r in results)
        if page is not None:
            print(f"fidelity page: {page}")
        print(f"{total - len(failed)} of {total} claims held")
        crashed = did_not_run(results) if name == "all" else []
        if crashed:  # an error, not a verdict: exit 2 with or without --strict (a quick run never holds all)
            print(f"error: {len(crashed)} target(s) did not run ({', '.join(crashed)}); their errors are on "
                  "the page, under 'the target ran'", file=sys.stderr)
            raise typer.Exit(2)
        if strict and failed:
            raise typer.Exit(1)
