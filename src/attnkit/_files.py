"""File modes of what attnkit writes for the user.

``safetensors.save_file`` creates its file with mode 0600 (owner only), unlike ``open()``, which honours the
umask (0644 under the usual 022): a model or attention export written for a team would be unreadable to the
others. :func:`match_umask` gives such files the mode ``open()`` would have.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Union

__all__ = ["match_umask"]

_LOCK = threading.Lock()


def _umask() -> int:
    with _LOCK:  # os.umask can only be read by setting it
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def match_umask(*paths: Union[str, os.PathLike]) -> None:
    """Give each regular file in ``paths`` (files, or folders: their files) mode ``0666 & ~umask``."""
    mode = 0o666 & ~_umask()
    for path in paths:
        path = Path(path)
        files = [p for p in path.iterdir() if p.is_file()] if path.is_dir() else [path]
        for file in files:
            if file.is_file() and not file.is_symlink() and (file.stat().st_mode & 0o777) != mode:
                os.chmod(file, mode)
