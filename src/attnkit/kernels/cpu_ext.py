"""Build and load the C++ CPU kernels (``csrc/*.cpp``: potentials, L1 distances) on first use.

The extension is compiled once per machine with ``torch.utils.cpp_extension`` (a C++ compiler and
``ninja`` are needed; ``scripts/setup.sh`` builds it) into ``$ATTNKIT_CACHE/ext`` (default
``~/.cache/attnkit/ext``), in a folder named after the torch version and the CPU capability; a changed
source is rebuilt. Where it cannot be built, the efficient backend keeps working on its pure-PyTorch
kernels (same results, slower) and says so once. ``ATTNKIT_NO_CPP=1`` turns the extension off.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from pathlib import Path
from typing import Optional

import torch

__all__ = ["available", "load", "build_dir", "disabled", "load_error"]

_SOURCES = [Path(__file__).parent / "csrc" / name for name in ("potentials_cpu.cpp", "l1_distance_cpu.cpp")]
_lock = threading.Lock()
_state: dict = {"loaded": False, "ok": False, "error": None}


def disabled() -> bool:
    """True when ``ATTNKIT_NO_CPP`` is set to a true value."""
    return os.environ.get("ATTNKIT_NO_CPP", "").strip().lower() not in ("", "0", "false", "no")


def _capability() -> str:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # pragma: no cover - very old builds
        return "DEFAULT"


def _flags() -> list[str]:
    flags = ["-O3", "-fopenmp", "-DNDEBUG"]
    if _capability() in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    return flags


def _ninja_on_path() -> None:
    """``cpp_extension`` runs ``ninja`` from PATH: add the interpreter's bin folder and the ``ninja`` wheel's."""
    dirs = [str(Path(sys.executable).parent)]
    try:
        import ninja

        dirs.append(str(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        pass
    path = os.environ.get("PATH", "").split(os.pathsep)
    missing = [d for d in dirs if d not in path]
    if missing:
        os.environ["PATH"] = os.pathsep.join(path + missing)


def build_dir() -> Path:
    """Where the extension is built: ``$ATTNKIT_CACHE/ext/torch-<version>-<capability>``."""
    root = os.environ.get("ATTNKIT_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "attnkit"
    version = torch.__version__.replace("+", "-")
    return base / "ext" / f"torch-{version}-{_capability().lower()}"


def load(verbose: bool = False, *, warn: bool = True) -> bool:
    """Build (if needed) and load the extension; True when ``torch.ops.attnkit_cpu`` is usable."""
    if _state["loaded"]:
        return _state["ok"]
    with _lock:
        if _state["loaded"]:
            return _state["ok"]
        if disabled():
            _state.update(loaded=True, ok=False, error="disabled by ATTNKIT_NO_CPP")
            return False
        try:
            from torch.utils import cpp_extension

            _ninja_on_path()
            path = build_dir()
            path.mkdir(parents=True, exist_ok=True)
            cpp_extension.load(
                name="attnkit_cpu",
                sources=[str(p) for p in _SOURCES],
                extra_cflags=_flags(),
                extra_ldflags=["-fopenmp"],
                build_directory=str(path),
                is_python_module=False,
                verbose=verbose,
            )
            torch.ops.attnkit_cpu.potentials_forward  # noqa: B018  (raises if the library did not register)
            torch.ops.attnkit_cpu.l1_distance  # noqa: B018
            _state.update(loaded=True, ok=True, error=None)
        except Exception as exc:  # a missing compiler, ninja or BLAS symbol: fall back, say why once
            _state.update(loaded=True, ok=False, error=f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1:]}")
            if warn:
                warnings.warn(
                    "attnkit: the C++ CPU kernels could not be built "
                    f"({_state['error']}); the efficient backend uses its pure-PyTorch kernels (same results, "
                    "slower). Install a C++ compiler (g++) and ninja, then run `attnkit info` to build them.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return _state["ok"]


def available() -> bool:
    """True when the extension is loaded or can be built now (builds it on the first call)."""
    return load()


def load_error() -> Optional[str]:
    """Why the extension is not in use (``None`` when it is, or before the first ``load``)."""
    return _state["error"]
