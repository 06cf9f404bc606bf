"""The public surface of ak.nn: lazy export from the top-level package and ``__all__``."""

from __future__ import annotations

import subprocess
import sys


import attnkit.nn as aknn


def test_all_names_exist():
    assert set(aknn.__all__) >= {
        "MultiheadAttention", "TransformerEncoderLayer", "TransformerDecoderLayer", "TransformerEncoder",
        "TransformerDecoder", "Transformer", "SinusoidalPositionalEncoding", "LearnedPositionalEncoding",
        "MultiViewAttention", "hybrid_weights",
    }
    for name in aknn.__all__:
        assert getattr(aknn, name) is not None


def test_ak_nn_is_reachable_from_a_fresh_interpreter():
    code = "import attnkit as ak; print(ak.nn.MultiheadAttention.__name__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-500:]
    assert result.stdout.strip() == "MultiheadAttention"
