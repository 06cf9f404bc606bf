"""Shared fixtures: the ``backend`` fixture runs every attention test on each backend.

``"efficient"`` needs the ``attnkit.kernels`` package; without it those tests are skipped.
"""

from __future__ import annotations

import pytest

BACKENDS_UNDER_TEST = ("reference", "efficient")


@pytest.fixture(scope="session", params=BACKENDS_UNDER_TEST)
def backend(request) -> str:
    """Each attention backend by name; ``"efficient"`` is skipped until ``attnkit.kernels`` exists."""
    if request.param == "efficient":
        pytest.importorskip("attnkit.kernels")
    return request.param
