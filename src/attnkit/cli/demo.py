"""``attnkit demo``: every mechanism side by side on one padded batch."""

from __future__ import annotations

import typer

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    @app.command()
    def demo(
        seed: int = typer.Option(0, help="Seed of the random batch."),
        eps: float = typer.Option(1e-3, help="A key is explained away when its weight sum is below eps."),
    ) -> None:
        """Show each mechanism's weights and explaining-away numbers on one padded batch."""
        from attnkit.cli._screen import add_fitted_columns
        from attnkit.cli._screen import console as make_console
        from rich.table import Table

        from attnkit.demo import side_by_side

        item, head = 1, 0  # the shorter sequence (5 real tokens), first head; from 0 as in show --heads
        summaries = side_by_side(seed=seed, eps=eps, show=(item, head))
        console = make_console()
        table = Table(
            title="Mechanisms on one padded batch (lengths 8 and 5, 2 heads; key 0 matches every query)"
        )
        rows = [[s.mechanism, f"{s.row_sums_min:.3f}..{s.row_sums_max:.3f}", f"{s.min_key_sum:.2e}",
                 f"{s.min_normalized:.3f}", f"{100 * s.fraction_below_eps:.1f}%"] for s in summaries]
        add_fitted_columns(table, ["mechanism", "row sums", "min key sum", "min n_k*sum", f"keys < {eps:g}"],
                           rows)
        for cells in rows:
            table.add_row(*cells)
        console.print(table, crop=False)
        console.print("min n_k*sum: the smallest over keys of n_k times the key's weight sum, n_k its "
                      "sequence's key count. Lemma 1: DNAS gives min n_k*sum >= 1 (no key explained away); "
                      "softmax need not.\n")
        for s in summaries:
            w = s.weights
            grid = Table(
                title=f"{s.mechanism}: weights of batch item {item} (5 real tokens), head {head} "
                "(counted from 0)",
                show_header=True,
            )
            rows = [[f"q{i}", *(f"{x:+.2f}" for x in w[i].tolist()), f"{w[i].sum().item():+.2f}"]
                    for i in range(w.shape[0])]
            rows.append(["sum", *(f"{x:+.2f}" for x in w.sum(0).tolist()), ""])
            add_fitted_columns(grid, ["query", *(f"k{j}" for j in range(w.shape[1])), "sum"], rows,
                               left=("query",))
            for cells in rows:
                grid.add_row(*cells)
            console.print(grid, crop=False)
