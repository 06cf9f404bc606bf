"""Loaded by the processes of two tests (PYTHONPATH): registers targets that say when they start, then
sleep far longer than the tests wait."""

import time

from attnkit.analysis import reproduce as _reproduce


def _sleeps(result, quick, seed):
    (result.out / "started").write_text(str(time.time()))
    time.sleep(120)


for _name in ("sleeps-a", "sleeps-b", "sleeps-c", "sleeps-d"):
    _reproduce.TARGETS[_name] = _sleeps
