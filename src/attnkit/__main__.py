"""``python -m attnkit``: the ``attnkit`` command (``python -m attnkit.cli`` is the same)."""

from attnkit.cli import main

if __name__ == "__main__":
    main()
