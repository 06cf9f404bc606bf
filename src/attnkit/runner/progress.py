"""Progress bars for training runs: rich or tqdm, showing the loss and the throughput (examples/s).

Only the main process draws; ``make_progress`` returns ``None`` on the others and for ``progress="none"``.
"""

from __future__ import annotations

import sys
from typing import Optional

__all__ = ["make_progress", "RichProgress", "TqdmProgress"]


class TqdmProgress:
    """One tqdm bar per run."""

    def __init__(self) -> None:
        self._bar = None

    def start_run(self, label: str, total: int, done: int) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, initial=done, desc=label, unit="step", dynamic_ncols=True, leave=True)

    def update(self, step: int, loss: float, throughput: float) -> None:
        self._bar.update(step - self._bar.n)
        self._bar.set_postfix(loss=f"{loss:.4f}", ex_per_s=f"{throughput:.0f}", refresh=False)

    def end_run(self, metrics: dict) -> None:
        if self._bar is not None:
            self._bar.set_postfix({k: f"{v:.4f}" for k, v in metrics.items() if isinstance(v, float)})
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        self.end_run({})


class RichProgress:
    """One rich progress task per run, all in one live display on stderr."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:>8}  {task.fields[speed]:>7} ex/s  {task.fields[extra]}"),
            TimeRemainingColumn(),
            console=Console(stderr=True),  # as tqdm's bar and the "run k of N" lines: stdout holds results
        )
        self._progress.start()
        self._task = None

    def start_run(self, label: str, total: int, done: int) -> None:
        self._task = self._progress.add_task(
            label, total=total, completed=done, loss="-", speed="-", extra=""
        )

    def update(self, step: int, loss: float, throughput: float) -> None:
        self._progress.update(self._task, completed=step, loss=f"{loss:.4f}", speed=f"{throughput:.0f}")

    def end_run(self, metrics: dict) -> None:
        text = "  ".join(f"{k} {v:.3f}" for k, v in metrics.items() if isinstance(v, float))
        self._progress.update(self._task, extra=text)

    def close(self) -> None:
        self._progress.stop()


def make_progress(kind: str, is_main_process: bool = True) -> Optional[object]:
    """A progress bar of ``kind`` (``auto``: rich on a terminal, tqdm otherwise; ``none``: no bar)."""
    if not is_main_process or kind == "none":
        return None
    if kind == "auto":
        kind = "rich" if sys.stderr.isatty() else "tqdm"
    return RichProgress() if kind == "rich" else TqdmProgress()
