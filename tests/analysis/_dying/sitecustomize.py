"""Loaded by the worker processes of one test (PYTHONPATH): registers a target that kills its own process."""

import os
import signal

from attnkit.analysis import reproduce as _reproduce


def _dies(result, quick, seed):
    os.kill(os.getpid(), signal.SIGKILL)


def _fine(result, quick, seed):
    from attnkit.analysis.report import Claim

    result.claims.append(Claim("constructed", "a claim that holds", True, "always"))


_reproduce.TARGETS["dies"] = _dies
_reproduce.TARGETS["fine-a"] = _fine
_reproduce.TARGETS["fine-b"] = _fine
