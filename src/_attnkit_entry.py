"""The ``attnkit`` command's entry point.

Importing ``attnkit.cli`` imports torch (and transformers) first, which takes seconds; a Ctrl-C meanwhile
ended the command with Python's ``KeyboardInterrupt`` traceback and exit code 1, where a command stopped
by Ctrl-C prints ``interrupted`` and exits with 130 (``attnkit.cli.main`` handles it from there on). This
module imports nothing heavy, so that it can catch that interrupt.
"""

import sys


def main() -> None:
    try:
        from attnkit.cli import main as run
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    run()
