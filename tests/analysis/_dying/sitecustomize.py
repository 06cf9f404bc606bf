"""Loaded by the worker processes of some tests (PYTHONPATH): registers a target that kills its own process,
one that is stopped (Ctrl-C) after a while when STOP_SLOW=1, and targets that hold."""

import os
import signal

from attnkit.analysis import reproduce as _reproduce


def _dies(result, quick, seed):
    os.kill(os.getpid(), signal.SIGKILL)


def _fine(result, quick, seed):
    from attnkit.analysis.report import Claim

    result.claims.append(Claim("constructed", "a claim that holds", True, "always"))


def _slow_stops(result, quick, seed):
    import time

    if os.environ.get("STOP_SLOW") == "1":
        time.sleep(2)  # the other worker's target finishes meanwhile
        raise KeyboardInterrupt
    _fine(result, quick, seed)


_reproduce.TARGETS["dies"] = _dies
_reproduce.TARGETS["slow-stops"] = _slow_stops
_reproduce.TARGETS["fine-a"] = _fine
_reproduce.TARGETS["fine-b"] = _fine
