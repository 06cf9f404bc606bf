"""Progress bars of training runs draw on stderr, so that stdout holds only the results."""

from __future__ import annotations

import pytest

from attnkit.runner.progress import RichProgress, TqdmProgress, make_progress


@pytest.mark.parametrize("bar", [RichProgress, TqdmProgress])
def test_bars_draw_on_stderr_not_stdout(bar, capsys):
    """The rich bar took rich's default console, stdout: `attnkit compare > out.txt` at a terminal showed no
    bar and the file began with the bar's last frame."""
    progress = bar()
    progress.start_run("softmax seed 0", 3, 0)
    progress.update(3, 0.5, 100.0)
    progress.end_run({"accuracy": 0.9})
    progress.close()
    out, err = capsys.readouterr()
    assert out == "" and "softmax seed 0" in err


def test_no_bar_off_the_main_process_or_when_asked():
    assert make_progress("rich", is_main_process=False) is None and make_progress("none") is None
