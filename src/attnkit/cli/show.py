"""``attnkit show``: one self-contained HTML page of attention heatmaps per layer, head and mechanism, plus
the weights in bertviz's layout. A thin layer over ``attnkit.analysis.attention_view``."""

from __future__ import annotations

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
        text: str = typer.Option(..., "--text", help="The text to look at."),
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
        from attnkit._files import write_text_file
        from attnkit.analysis.attention_view import (
            BERTVIZ_FILES,
            render_view_html,
            selected_layers,
            view_from_hf,
            view_from_run,
            write_bertviz,
        )

        if not out_text.strip():
            raise ValueError("--out is empty; pass a directory such as attention-view")
        if not source.strip():  # Path("") is the working directory
            raise ValueError("SOURCE is empty; pass a run directory of attnkit compare or a model directory")
        out = Path(out_text)
        head_list = parse_list(heads, "heads", int, example="0,1")
        layer_list = parse_list(layers, "layers", int, example="0,5")
        names = [m.strip() for m in mechanisms.split(",") if m.strip()] if mechanisms else None
        src = Path(source)
        is_run = (src / "config.json").is_file() and (src / "runs").is_dir()
        if names:
            from attnkit import resolve_mechanism

            for name in names:
                # A run directory names its runs "dnas" or "dnas+ct" (with alignment attention); its
                # no-attention baseline "none" is refused by view_from_run with the runs to pick from.
                base = name.partition("+")[0] if is_run else name
                if not (is_run and base == "none"):
                    resolve_mechanism(base)
        if not text.strip():
            raise ValueError("--text is empty; pass a sentence to look at")
        page = out / "attention.html"
        if out.exists() and not out.is_dir():
            raise NotADirectoryError(f"--out {out} is a file; pass a directory")
        for path in (page, *(out / name for name in BERTVIZ_FILES)):  # before any work: all three files
            if path.exists() and not overwrite:
                raise FileExistsError(
                    f"{path} exists; pass --overwrite to replace it or choose another --out"
                )
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
        out.mkdir(parents=True, exist_ok=True)
        write_text_file(page, document, overwrite=overwrite)  # whole or not at all
        files = write_bertviz(view, out, overwrite=overwrite)
        drawn, total = len(selected_layers(view, layer_list)), view.num_layers
        of_layers = f"{drawn} of {total} layer(s)" if drawn < total else f"{drawn} layer(s)"
        typer.echo(f"{len(view.mechanisms)} mechanism(s) x {of_layers} over {len(view.tokens)} tokens")
        if view.truncation_note:
            typer.echo(f"       note: {view.truncation_note}")
        typer.echo(f"       page: {page}")
        typer.echo(
            f"    bertviz: {files['safetensors']} (load with attnkit.analysis.attention_view.load_bertviz)"
        )
