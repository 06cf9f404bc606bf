"""``attnkit show``: one self-contained HTML page of attention heatmaps per layer, head and mechanism, plus
the weights in bertviz's layout. A thin layer over ``attnkit.analysis.attention_view``."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import typer

from ._lists import parse_list

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    @app.command()
    def show(
        source: str = typer.Argument(
            ..., help="A run directory of attnkit compare, or a (converted) model directory."
        ),
        text: str = typer.Option(
            ..., "--text",
            help='The text to look at; for a sentence-pair run (mrpc, snli) or a model attnkit finetune '
            'trained on pairs, the pair as "a | b".',
        ),
        out_text: str = typer.Option(  # a str: typer would read "" as Path("."), the working directory
            "attention-view", "--out", help="Output directory (HTML + bertviz files).", metavar="<path>"
        ),
        mechanisms: Optional[str] = typer.Option(
            None,
            help="Comma-separated mechanisms (run: those of the run; stock model: softmax,dnas,hnas, a "
            "decoder: softmax,coda; a converted model shows its own).",
        ),
        seed: Optional[int] = typer.Option(
            None, help="Which seed's models of a run directory (default: the first)."
        ),
        heads: Optional[str] = typer.Option(
            None, help="Comma-separated heads to draw (default: the first 4)."
        ),
        layers: Optional[str] = typer.Option(None, help="Comma-separated layers to draw (default: all)."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace the files of an existing --out."),
    ) -> None:
        """Draw attention over a text per layer, head and mechanism (HTML), and export it for bertviz."""
        from attnkit._files import check_out_writable, check_output_parents
        from attnkit.hf.publish import remove_dead_staging
        from attnkit.analysis.attention_view import (
            BERTVIZ_FILES,
            canonical_mechanisms,
            is_run_directory,
            render_view_html,
            selected_layers,
            view_from_hf,
            view_from_run,
        )

        if not out_text.strip():
            raise ValueError("--out is empty; pass a directory such as attention-view")
        if not source.strip():  # Path("") is the working directory
            raise ValueError("SOURCE is empty; pass a run directory of attnkit compare or a model directory")
        out = Path(out_text)
        head_list = parse_list(heads, "heads", int, example="0,1")
        layer_list = parse_list(layers, "layers", int, example="0,5")
        # before any work: --out can be made and holds none of the three files (unless --overwrite)
        check_output_parents(out)  # a dangling link, or a file where a folder above --out should be
        page = out / "attention.html"
        if out.exists() and not out.is_dir():
            raise NotADirectoryError(f"--out {out} is a file; pass a directory")
        check_out_writable(out)  # a read-only --out failed after the models ran, naming a hidden folder
        remove_dead_staging(out)  # what a killed show (SIGKILL) left: a whole attention export
        for path in (page, *(out / name for name in BERTVIZ_FILES)):
            if path.exists() and not overwrite:
                raise FileExistsError(
                    f"{path} exists; pass --overwrite to replace it or choose another --out"
                )
        src = Path(source)
        is_run = is_run_directory(src)  # by compare's own config.json, not by a runs/ folder (HF Trainer's)
        # registered names ("HNAS", "hybrid" -> "hnas"); a run's "dnas+ct" keeps its alignment method, and
        # its no-attention baseline "none" is refused by view_from_run with the runs to pick from
        names = canonical_mechanisms(parse_list(mechanisms, "mechanisms", example="softmax,dnas"), run=is_run)
        if not text.strip():
            raise ValueError("--text is empty; pass a sentence to look at")
        if not src.is_dir():
            raise FileNotFoundError(
                f"{source} is not a directory; pass a run directory of attnkit compare or a "
                "model directory written by save_pretrained"
            )
        if is_run:
            view = view_from_run(src, text, seed=seed, mechanisms=names)
        else:
            if seed is not None:  # it was ignored
                raise ValueError(
                    f"--seed picks the models of one seed of a compare run directory; {source} is a model "
                    "directory (one model): drop --seed"
                )
            view = view_from_hf(src, text, mechanisms=names)
        document = render_view_html(view, heads=head_list, layers=layer_list)
        _write_together(out, view, document, overwrite=overwrite)
        drawn, total = len(selected_layers(view, layer_list)), view.num_layers
        of_layers = f"{drawn} of {total} layer(s)" if drawn < total else f"{drawn} layer(s)"
        typer.echo(f"{len(view.mechanisms)} mechanism(s) x {of_layers} over {len(view.tokens)} tokens")
        if view.truncation_note:
            typer.echo(f"       note: {view.truncation_note}")
        typer.echo(f"       page: {page}")
        typer.echo(
            f"    bertviz: {out / BERTVIZ_FILES[0]} (load with attnkit.analysis.attention_view.load_bertviz)"
        )


def _write_together(out: Path, view, document: str, *, overwrite: bool) -> None:
    """``attention.html`` (``document``) and the bertviz files of ``view`` into ``out``: they are written in a
    hidden folder in ``out``, then moved into place, so that a failed render or write leaves ``out`` as it
    was. Without ``overwrite``, an interruption (Ctrl-C, an error) during the moves removes the files it had
    moved in, so nothing is left that would refuse the same command, and a file that appeared meanwhile is
    kept (``FileExistsError``); with it, the files moved in before the interruption stay beside the earlier
    run's others (the same command replaces them all). Folders it made for ``out`` are removed on failure
    while they are empty."""
    from attnkit._files import make_out_dir, write_file_with, write_text_file
    from attnkit.analysis.attention_view import BERTVIZ_FILES, write_bertviz
    from attnkit.hf.publish import MARKER, _marker_text

    made = [p for p in (out, *out.parents) if not p.exists()]  # deepest first: this command makes them
    make_out_dir(out)
    failed = True
    try:
        staging = Path(tempfile.mkdtemp(dir=out, prefix=".attnkit-show.", suffix=".tmp"))
        placed: list[Path] = []
        try:
            # first: this host and pid, by which the next show removes the folder of one that was killed
            (staging / MARKER).write_text(_marker_text(), encoding="utf-8")
            write_text_file(staging / "attention.html", document, overwrite=True)
            write_bertviz(view, staging, overwrite=True)
            for name in ("attention.html", *BERTVIZ_FILES):
                # the staged file becomes write_file_with's temporary file: never over a file that appeared
                move = functools.partial(os.replace, staging / name)
                write_file_with(out / name, move, overwrite=overwrite)
                placed.append(out / name)
        except BaseException:
            if not overwrite:  # the files this command made; with --overwrite the next run replaces them
                for path in placed:
                    path.unlink(missing_ok=True)
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        failed = False
    finally:
        if failed:  # the folders it made, if nothing else is in them (a full disk left an empty --out)
            for folder in made:
                try:
                    folder.rmdir()
                except OSError:
                    break
