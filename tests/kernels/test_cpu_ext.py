"""Building and loading the C++ CPU kernels, and the fallback where they cannot be built."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from attnkit.kernels import cpu_ext


def test_extension_builds_where_a_compiler_exists():
    if cpu_ext.disabled():
        pytest.skip("ATTNKIT_NO_CPP is set")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: the efficient backend runs its pure-PyTorch kernels")
    assert cpu_ext.load(), cpu_ext.load_error()
    assert cpu_ext.load_error() is None


def test_build_dir_is_under_the_cache_and_names_torch(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNKIT_CACHE", str(tmp_path))
    path = cpu_ext.build_dir()
    assert path.parent == tmp_path / "ext"
    assert path.name.startswith("torch-2.13.0")


def test_disabled_extension_falls_back_to_the_same_results():
    """With ATTNKIT_NO_CPP=1 the efficient backend gives the reference result through its PyTorch kernels."""
    code = (
        "import torch, attnkit as ak\n"
        "from attnkit.kernels import cpu_ext\n"
        "g = torch.Generator().manual_seed(0)\n"
        "q, k, v = (torch.randn(2, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))\n"
        "km = torch.tensor([[1] * 6, [1] * 4 + [0] * 2], dtype=torch.bool)\n"
        "for m in ('dnas', 'hnas', ak.Sinkhorn(iters=3), 'coda'):\n"
        "    a = ak.attention(q, k, v, m, key_mask=km, backend='efficient')\n"
        "    b = ak.attention(q, k, v, m, key_mask=km, backend='reference')\n"
        "    torch.testing.assert_close(a, b)\n"
        "assert not cpu_ext.load()\n"
        "print(cpu_ext.load_error())\n"
    )
    env = dict(os.environ, ATTNKIT_NO_CPP="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "ATTNKIT_NO_CPP" in proc.stdout
