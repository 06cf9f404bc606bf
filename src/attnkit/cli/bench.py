"""``attnkit bench``: time and memory of every mechanism and backend against fused SDPA softmax."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from .._files import check_output_parents
from ._lists import parse_list

__all__ = ["register"]


def _check_writable(out: Path) -> list[Path]:
    """Fail before a long benchmark, not after it, when ``out`` cannot be written (``PermissionError``) or is,
    or lies in, a symbolic link to nothing (``FileNotFoundError``; no folder is made for it). Returns the
    folders it created for ``out``, innermost first (removed again when the run ends without writing)."""
    check_output_parents(out)  # a file where a folder above --out should be: named (mkdir said "File exists")
    created = [p for p in (out.parent, *out.parent.parents) if not os.path.lexists(p)]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = out.parent / f".{out.name}.write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        _remove_empty(created)
        raise PermissionError(f"--out {out} cannot be written ({exc.strerror or type(exc).__name__}); "
                              "choose another --out") from None
    return created


def _remove_empty(folders: list[Path]) -> None:
    """Remove ``folders`` (innermost first) while they are empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # not empty (the results, or another's files), or gone
            return


def register(app: typer.Typer) -> None:
    @app.command()
    def bench(
        quick: bool = typer.Option(
            False,
            "--quick",
            help="A smoke run under a minute: L in {256, 1024}, 2 rounds, no memory subprocesses.",
        ),
        lengths: Optional[str] = typer.Option(
            None, help="Comma-separated sequence lengths (default 256,1024,4096,8192)."
        ),
        mechanisms: Optional[str] = typer.Option(None, help="Comma-separated mechanisms (default: all)."),
        backends: Optional[str] = typer.Option(
            None,
            help="Comma-separated backends: reference, efficient and the peers naive, xtransformers (the "
            "[bench] extra) and flex (cuda). Default: all of them that are installed for --device.",
        ),
        repeats: Optional[int] = typer.Option(
            None,
            help="Timed rounds per configuration (default 3, 2 with --quick): median, min and max reported.",
        ),
        sinkhorn_iters: Optional[int] = typer.Option(
            None, help="Iterations k of the Sinkhorn mechanism (default 3)."
        ),
        memory: Optional[bool] = typer.Option(
            None,
            "--memory/--no-memory",
            help="Measure peak memory in subprocesses (default: on, off with --quick).",
        ),
        max_reference_length: int = typer.Option(2048, help="Skip the materialized backend above this L."),
        device: str = typer.Option("cpu", help="cpu or cuda (bfloat16 on cuda)."),
        batch: int = typer.Option(1, help="Batch size B of q, k, v (B, H, L, D)."),
        heads: int = typer.Option(8, help="Heads H."),
        head_dim: int = typer.Option(64, help="Head size D."),
        threads: Optional[int] = typer.Option(
            None, help="CPU threads for the run (default: torch's setting, e.g. from OMP_NUM_THREADS)."
        ),
        dropout: float = typer.Option(
            0.0, help="Attention dropout p of every call, SDPA's included (on the CPU SDPA then takes its "
            "math path).",
        ),
        padding: float = typer.Option(
            0.0, help="Pad the batch: valid lengths fall evenly from L to (1 - padding) L over the batch "
            "(key and query masks); with --batch 1 the one sequence is (1 - padding) L long.",
        ),
        out: str = typer.Option(  # str: typer drops a trailing "/" (and reads "" as ".")
            "bench-results/kernels.json", help="Where to write the JSON results."
        ),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out file."),
    ) -> None:
        """Benchmark the attention backends; print a table (ratios to SDPA softmax) and write JSON."""
        from attnkit.benchmark import (
            DEFAULT_LENGTHS,
            DEFAULT_MECHANISMS,
            QUICK_LENGTHS,
            BenchConfig,
            default_backends,
            format_table,
            run_bench,
            write_json,
        )

        if quick and lengths is not None:
            raise ValueError("--quick and --lengths contradict each other; pass one of them")
        chosen = parse_list(mechanisms, "mechanisms") or DEFAULT_MECHANISMS
        cfg = BenchConfig(  # every argument is checked here, before any file is looked at
            lengths=parse_list(lengths, "lengths", int) or (QUICK_LENGTHS if quick else DEFAULT_LENGTHS),
            mechanisms=chosen,
            backends=parse_list(backends, "backends") or default_backends(device),
            repeats=repeats if repeats is not None else (2 if quick else 3),
            sinkhorn_iters=3 if sinkhorn_iters is None else sinkhorn_iters,
            memory=memory if memory is not None else not quick,
            max_reference_length=max_reference_length,
            device=device,
            batch=batch,
            heads=heads,
            head_dim=head_dim,
            threads=threads,
            dropout=dropout,
            padding=padding,
        )
        if sinkhorn_iters is not None and "sinkhorn" not in cfg.mechanisms:
            raise ValueError(f"--sinkhorn-iters {sinkhorn_iters} is for the sinkhorn mechanism, which "
                             f"--mechanisms {','.join(cfg.mechanisms)} leaves out; add sinkhorn or drop "
                             "--sinkhorn-iters")
        if not out.strip() or out.endswith(("/", os.sep)):
            raise ValueError(f"--out {out!r} names a folder; pass a file path such as "
                             f"{os.path.join(out or '.', 'kernels.json')}")
        out = Path(out)
        real = Path(os.path.realpath(out))
        if real.exists() and not real.is_dir() and not real.is_file():  # before the run, not after it
            raise ValueError(f"--out {out} is not a regular file (a device, a pipe or a socket); pass the "
                             "path of a file to write")
        if out.is_dir():
            raise ValueError(f"--out {out} is a directory; pass a file path such as {out / 'kernels.json'}")
        if out.exists() and not overwrite:
            raise FileExistsError(f"{out} exists; pass --overwrite to replace it or choose another --out")
        created = _check_writable(out)
        try:
            result = run_bench(cfg, log=lambda msg: typer.echo(msg, err=True))
        except BaseException:
            _remove_empty(created)  # a failed or stopped run leaves no empty folder behind
            raise
        typer.echo(format_table(result))  # before writing: a write that fails loses no measurement
        try:
            write_json(result, out, overwrite=overwrite)
        except FileExistsError:  # saved there while this ran: kept, and the results go beside it
            spare = next(p for i in range(1, 10_000)
                         if not os.path.lexists(p := out.with_name(f"{out.stem}-{i}{out.suffix}")))
            write_json(result, spare, overwrite=False)
            raise FileExistsError(
                f"{out} appeared while this was running and is kept; the results are in {spare}"
            ) from None
        except OSError:
            import json

            typer.echo(json.dumps(result), err=True)  # the measurements, to be kept from the terminal
            _remove_empty(created)
            raise
        typer.echo(f"wrote {out}")
