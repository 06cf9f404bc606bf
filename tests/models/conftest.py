"""Run the small-model tests on one thread: tiny matrices gain nothing from more, and under
``pytest -n 2`` on two cores extra threads only contend with the other worker."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
