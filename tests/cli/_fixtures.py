"""Helpers shared by the CLI tests."""

from __future__ import annotations


def save_during_bench(monkeypatch, out, text: str = '{"user": "precious"}') -> None:
    """Make ``attnkit bench`` find ``out`` written by someone else once its timing is done (after the --out
    check, before the result is written)."""
    from attnkit import benchmark

    real = benchmark.run_bench

    def run_then_someone_saves(cfg, log=None):
        result = real(cfg, log)
        out.write_text(text)
        return result

    monkeypatch.setattr(benchmark, "run_bench", run_then_someone_saves)


def read_only_folder(monkeypatch, folder) -> None:
    """Make ``folder`` refuse new files as a mode-0555 folder does for a user who is not root (the tests run
    as root, whom permission bits do not stop): the write probe's temporary file there fails."""
    import errno
    import tempfile

    real = tempfile.NamedTemporaryFile

    def refuse(*args, **kwargs):
        if str(kwargs.get("dir")) == str(folder):
            raise PermissionError(errno.EACCES, "Permission denied", str(folder / ".probe"))
        return real(*args, **kwargs)

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", refuse)
