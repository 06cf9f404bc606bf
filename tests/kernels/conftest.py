"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest
import torch

from attnkit.kernels import cpp_potentials


@pytest.fixture
def query_chunks_of_256(monkeypatch):
    """The C++ kernels' strips built in query chunks of 256 rows (1024 by default), so that inputs of a few
    hundred queries span several chunks and the merges of per-chunk column statistics are exercised."""
    monkeypatch.setattr(cpp_potentials, "QUERY_CHUNK_ROWS", 256)


@pytest.fixture
def num_threads():
    """Set torch's thread count for one test: ``num_threads(n)``; restored afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)
