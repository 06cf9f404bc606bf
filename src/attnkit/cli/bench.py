"""``attnkit bench``: time and memory of every mechanism and backend against fused SDPA softmax."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

__all__ = ["register", "parse_list"]


def parse_list(text: Optional[str], name: str, cast=str) -> Optional[list]:
    if text is None:
        return None
    items = [t.strip() for t in text.split(",") if t.strip()]
    try:
        return [cast(t) for t in items]
    except ValueError:
        raise ValueError(f"--{name} {text!r}: expected a comma-separated list, e.g. 256,1024") from None


def register(app: typer.Typer) -> None:
    @app.command()
    def bench(
        quick: bool = typer.Option(False, "--quick", help="Only L in {256, 1024}: a smoke run."),
        lengths: Optional[str] = typer.Option(None, help="Comma-separated sequence lengths (default 256,1024,4096,8192)."),
        mechanisms: Optional[str] = typer.Option(None, help="Comma-separated mechanisms (default: all)."),
        backends: Optional[str] = typer.Option(
            None, help="Comma-separated backends: reference,efficient (and flex on cuda; default on cuda)."
        ),
        repeats: int = typer.Option(3, help="Timed repeats per configuration (the median is reported)."),
        sinkhorn_iters: int = typer.Option(3, help="Iterations k of the Sinkhorn mechanism."),
        memory: bool = typer.Option(True, "--memory/--no-memory", help="Measure peak memory in subprocesses."),
        max_reference_length: int = typer.Option(2048, help="Skip the materialized backend above this L."),
        device: str = typer.Option("cpu", help="cpu or cuda (bfloat16 on cuda)."),
        out: Path = typer.Option(Path("bench-results/kernels.json"), help="Where to write the JSON results."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out file."),
    ) -> None:
        """Benchmark the attention backends; print a table (ratios to SDPA softmax) and write JSON."""
        from attnkit.kernels.bench import (
            DEFAULT_LENGTHS,
            DEFAULT_MECHANISMS,
            QUICK_LENGTHS,
            BenchConfig,
            format_table,
            run_bench,
            write_json,
        )

        if out.exists() and not overwrite:
            raise FileExistsError(f"{out} exists; pass --overwrite to replace it or choose another --out")
        if quick and lengths is not None:
            raise ValueError("--quick and --lengths contradict each other; pass one of them")
        cfg = BenchConfig(
            lengths=parse_list(lengths, "lengths", int) or (QUICK_LENGTHS if quick else DEFAULT_LENGTHS),
            mechanisms=parse_list(mechanisms, "mechanisms") or DEFAULT_MECHANISMS,
            backends=parse_list(backends, "backends")
            or (("reference", "efficient", "flex") if device == "cuda" else ("reference", "efficient")),
            repeats=repeats,
            sinkhorn_iters=sinkhorn_iters,
            memory=memory,
            max_reference_length=max_reference_length,
            device=device,
        )
        result = run_bench(cfg, log=lambda msg: typer.echo(msg, err=True))
        write_json(result, out)
        typer.echo(format_table(result))
        typer.echo(f"wrote {out}")
