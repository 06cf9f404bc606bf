"""``attnkit info``: version, mechanisms, backends, the torch build and the route of typical calls."""

from __future__ import annotations

import os
import platform

import typer

__all__ = ["register", "info_dict", "dispatch_examples"]

# Typical calls whose route ``attnkit info`` shows: (label, B, H, L, D, padded).
EXAMPLES = (("L=128, key padding", 4, 8, 128, 64, True), ("L=2048, no mask", 1, 8, 2048, 64, False))


def dispatch_examples() -> dict:
    """``{example: {mechanism: "route: reason"}}``: what ``backend="auto"`` picks
    (``ak.explain_dispatch``)."""
    import torch

    import attnkit as ak

    out = {}
    for label, B, H, L, D, padded in EXAMPLES:
        q = torch.zeros(B, H, L, D)
        mask = (
            (torch.arange(L)[None, :] < torch.arange(L // 2, L, L // (2 * B))[:B, None]) if padded else None
        )
        out[label] = {m: str(ak.explain_dispatch(q, q, q, m, key_mask=mask)) for m in ak.MECHANISMS}
    return out


def info_dict() -> dict:
    import torch

    import attnkit as ak

    return {
        "attnkit": ak.__version__,
        "mechanisms": list(ak.MECHANISMS),
        "backends": list(ak.BACKENDS),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "threads": torch.get_num_threads(),
        "cpu_kernels": _cpu_kernels(),
        "sinkhorn_score_cache": _score_cache(),
        "python": platform.python_version(),
        "dispatch (backend='auto')": dispatch_examples(),
    }


def _cpu_kernels() -> str:
    """Which CPU kernels the efficient backend runs for DNAS/HNAS/Sinkhorn (builds the C++ ones if needed)."""
    from attnkit.kernels import cpu_ext

    if cpu_ext.load(warn=False):  # a first build says so on stderr itself, once it holds the build lock
        return f"C++ ({cpu_ext.build_dir()})"
    return f"PyTorch fallback ({cpu_ext.load_error()})"


def _score_cache() -> str:
    """The C++ kernels' budget of Sinkhorn scores kept between rounds, and where it comes from."""
    from attnkit.kernels.cpp_potentials import SCORE_CACHE_ENV, score_cache_bytes

    mib = score_cache_bytes() / 2**20  # a bad value is the command's one-line error
    given = os.environ.get(SCORE_CACHE_ENV, "").strip()
    source = SCORE_CACHE_ENV if given else f"default; {SCORE_CACHE_ENV}"
    return f"{mib:g} MiB ({source})"


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

        routes = data.pop("dispatch (backend='auto')")
        table = Table(title="attnkit", show_header=False)
        table.add_column("key", no_wrap=True, min_width=max(map(len, data)))
        table.add_column("value", overflow="fold")  # a path folds, not "ext/torch-…"
        for key, value in data.items():
            table.add_row(key, ", ".join(map(str, value)) if isinstance(value, list) else str(value))
        console = make_console()
        console.print(table)
        for example, by_mechanism in routes.items():
            grid = Table(title=f"backend='auto' routes, {example} (ak.explain_dispatch)")
            grid.add_column("mechanism")
            grid.add_column("route: reason", overflow="fold")
            for mechanism, plan in by_mechanism.items():
                grid.add_row(mechanism, plan)
            console.print(grid)
