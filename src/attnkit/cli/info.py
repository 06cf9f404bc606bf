"""``attnkit info``: version, mechanisms, backends and the torch build."""

from __future__ import annotations

import platform

import typer

__all__ = ["register", "info_dict"]


def info_dict() -> dict:
    import torch

    import attnkit as ak
    from attnkit import functional

    kernels = functional._efficient_module()
    return {
        "attnkit": ak.__version__,
        "mechanisms": list(ak.MECHANISMS),
        "backends": [b for b in ak.BACKENDS if b != "efficient" or kernels is not None],
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "threads": torch.get_num_threads(),
        "cpu_kernels": _cpu_kernels(),
        "python": platform.python_version(),
    }


def _cpu_kernels() -> str:
    """Which CPU kernels the efficient backend runs for DNAS/HNAS/Sinkhorn (builds the C++ ones if needed)."""
    from attnkit.kernels import cpu_ext

    if cpu_ext.load(warn=False):
        return f"C++ ({cpu_ext.build_dir()})"
    return f"PyTorch fallback ({cpu_ext.load_error()})"


def register(app: typer.Typer) -> None:
    @app.command()
    def info(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
        """Show the attnkit version, its mechanisms and backends, and the torch build."""
        data = info_dict()
        if as_json:
            import json

            typer.echo(json.dumps(data, indent=2))
            return
        from attnkit.cli._screen import console as make_console
        from rich.table import Table

        table = Table(title="attnkit", show_header=False)
        for key, value in data.items():
            table.add_row(key, ", ".join(map(str, value)) if isinstance(value, list) else str(value))
        make_console().print(table)
