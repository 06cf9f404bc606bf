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
