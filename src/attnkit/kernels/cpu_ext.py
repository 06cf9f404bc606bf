"""Build and load the C++ CPU kernels (``csrc/*.cpp``: potentials, L1 distances, CoDA) on first use.

The extension is compiled once per machine with ``torch.utils.cpp_extension`` (a C++ compiler and
``ninja`` are needed; ``scripts/setup.sh`` builds it) into ``$ATTNKIT_CACHE/ext`` (default
``~/.cache/attnkit/ext``), in a folder named after the torch version, the CPU capability and a hash of
the sources and flags, so a changed source is rebuilt into a new folder. Where it cannot be built, the
efficient backend keeps working on its pure-PyTorch kernels (same results, slower) and says so once.
``ATTNKIT_NO_CPP=1`` turns the extension off.

A killed process never blocks later ones:

- loading a finished build takes no lock: the ``.so`` is opened with ``torch.ops.load_library``;
- a build runs in a private temporary folder that is renamed into place when complete (``os.replace``
  is atomic), so a half-written build is never loaded; the folder records the library's size and SHA-256
  (``attnkit_cpu.sha256``), and a library that does not match (truncated or replaced on disk: opening a
  truncated one kills the process with SIGBUS) is rebuilt instead of loaded;
- concurrent builders serialize on an OS file lock (``fcntl.flock``) that the kernel releases when its
  holder dies; a wait longer than ``ATTNKIT_EXT_LOCK_TIMEOUT`` seconds (default 900) gives up with a
  message naming the lock file.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Iterator, Optional

import torch

from .._files import NO_LOCKS, _umask, without_lock

__all__ = ["available", "load", "build_dir", "disabled", "load_error", "build_lock"]

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("potentials_cpu.cpp", "l1_distance_cpu.cpp", "coda_cpu.cpp")]
_LDFLAGS = ["-fopenmp"]
_LIBRARY = "attnkit_cpu.so"
_DIGEST = "attnkit_cpu.sha256"  # "<size> <sha256>" of the library, written by the build that made it
_FALSE, _TRUE = ("", "0", "false", "no", "off"), ("1", "true", "yes", "on")
_CACHE_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST)
_CAUSE = re.compile(r"not found|error|No such file|No space left|Permission denied", re.IGNORECASE)
_lock = threading.Lock()
_state: dict = {"loaded": False, "ok": False, "error": None}


def disabled() -> bool:
    """True when ``ATTNKIT_NO_CPP`` is set to a true value (1, true, yes, on); false values (unset, empty, 0,
    false, no, off) keep the kernels; anything else is a ``ValueError``."""
    raw = os.environ.get("ATTNKIT_NO_CPP", "")
    value = raw.strip().lower()
    if value not in _FALSE + _TRUE:
        raise ValueError(
            f"ATTNKIT_NO_CPP={raw!r}; expected 1/true/yes/on to turn the C++ kernels off, or 0/false/no/off "
            "(or unset) to keep them"
        )
    return value in _TRUE


def _capability() -> str:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # pragma: no cover - very old builds
        return "DEFAULT"


def _flags() -> list[str]:
    flags = ["-O3", "-fopenmp", "-DNDEBUG"]
    if _capability() == "AVX512":  # 16-wide vectors for the elementwise steps (exp, maxima, sums)
        flags += ["-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c",
                  "-mprefer-vector-width=512", "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"]
    elif _capability() == "AVX2":
        flags += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    return flags


def _ninja_on_path() -> None:
    """``cpp_extension`` runs ``ninja`` from PATH: add the interpreter's bin folder and the ``ninja``
    wheel's."""
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


def _build_key(sources: Optional[list[Path]] = None) -> str:
    """A hash of everything the binary depends on: the C++ files, the flags, torch and Python versions."""
    digest = hashlib.sha256()
    csrc = sorted(_CSRC.glob("*")) if sources is None else sorted(sources)
    for path in csrc:
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    meta = [torch.__version__, _capability(), sys.version.split()[0], *_flags(), "|", *_LDFLAGS]
    digest.update("\0".join(meta).encode())
    return digest.hexdigest()[:16]


def build_dir() -> Path:
    """Where the extension lives: ``$ATTNKIT_CACHE/ext/torch-<version>-<capability>-<hash>``.

    The hash covers the C++ sources, the compiler flags and the torch and Python versions.
    """
    root = os.environ.get("ATTNKIT_CACHE", "").strip()  # blank: unset, as for the datasets
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "attnkit"
    version = torch.__version__.replace("+", "-")
    return base / "ext" / f"torch-{version}-{_capability().lower()}-{_build_key()}"


def _lock_timeout() -> float:
    raw = os.environ.get("ATTNKIT_EXT_LOCK_TIMEOUT", "").strip() or "900"  # blank: unset, as the others
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0:  # nan waited forever and negative values not at all; inf waits without a limit
        raise ValueError(
            f"ATTNKIT_EXT_LOCK_TIMEOUT={raw!r}; expected a number of seconds >= 0 (default 900; inf: no "
            "limit)"
        )
    return value


@contextlib.contextmanager
def build_lock(path: Path, timeout: Optional[float] = None) -> Iterator[None]:
    """Hold an exclusive ``fcntl.flock`` on ``path`` (released by the kernel if this process dies).

    Waits at most ``timeout`` seconds (``ATTNKIT_EXT_LOCK_TIMEOUT``, default 900), then raises a
    ``TimeoutError`` that names the lock file.
    """
    import fcntl

    timeout = _lock_timeout() if timeout is None else timeout
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout
        waiting = False
        locked = True
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if not isinstance(exc, BlockingIOError):
                    if exc.errno not in NO_LOCKS:
                        raise
                    # a cache on a file system without locks (an NFS home): the build is still whole, made
                    # in a private folder renamed into place; only concurrent builders are not serialized
                    without_lock(path, exc, "building without it")
                    locked = False
                    break
                if not waiting:  # the other build may take minutes: say why this process is silent
                    print(f"attnkit: waiting for another process building the C++ CPU kernels (lock {path})",
                          file=sys.stderr, flush=True)
                    waiting = True
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"waited {timeout:g} s for another process building the C++ kernels (lock {path}); "
                        f"if no attnkit process is running, delete {path} and retry"
                    ) from None
                time.sleep(0.1)
        try:
            yield
        finally:
            if locked:
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _digest(library: Path) -> str:
    """``"<size> <sha256>"`` of the library file."""
    data = library.read_bytes()
    return f"{len(data)} {hashlib.sha256(data).hexdigest()}"


def _intact(final: Path) -> bool:
    """The build in ``final`` is complete and its library is the one it recorded (size and SHA-256)."""
    library, record = final / _LIBRARY, final / _DIGEST
    try:
        return library.is_file() and record.is_file() and record.read_text().strip() == _digest(library)
    except (OSError, ValueError):  # ValueError: a record that is not text (damaged like the library)
        return False


def _elf_whole(library: Path) -> bool:
    """Whether ``library`` is an ELF file as long as its header says (its section header table, at the end
    of the file, is there): loading a cut one maps pages past its end and the process dies of SIGBUS."""
    try:
        with open(library, "rb") as fh:
            head = fh.read(64)
        size = library.stat().st_size
    except OSError:
        return False
    if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] not in (1, 2) or head[5] not in (1, 2):
        return False
    order = "little" if head[5] == 1 else "big"

    def field(start: int, end: int) -> int:
        return int.from_bytes(head[start:end], order)

    if head[4] == 2:  # 64-bit: e_shoff at 0x28 (8 bytes), e_shentsize at 0x3A, e_shnum at 0x3C
        shoff, shentsize, shnum = field(0x28, 0x30), field(0x3A, 0x3C), field(0x3C, 0x3E)
    else:  # 32-bit: e_shoff at 0x20 (4 bytes), e_shentsize at 0x2E, e_shnum at 0x30
        shoff, shentsize, shnum = field(0x20, 0x24), field(0x2E, 0x30), field(0x30, 0x32)
    return 0 < shoff and shoff + shentsize * shnum <= size


def _build(final: Path, verbose: bool) -> None:
    """Compile into a private temporary folder (``cpp_extension`` loads it), then rename it to ``final``."""
    from torch.utils import cpp_extension

    _ninja_on_path()
    for stale in final.parent.glob(final.name + ".tmp-*"):  # left by a builder that died; we hold the lock
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=final.parent))
    try:
        cpp_extension.load(
            name="attnkit_cpu",
            sources=[str(p) for p in _SOURCES],
            extra_cflags=_flags(),
            extra_ldflags=list(_LDFLAGS),  # cpp_extension appends to the list it gets
            build_directory=str(tmp),
            is_python_module=False,
            verbose=verbose,
        )
        built = sorted(tmp.glob("attnkit_cpu*.so"))
        if not built:
            raise RuntimeError(f"the build in {tmp} produced no attnkit_cpu*.so")
        if built[-1].name != _LIBRARY:
            os.replace(built[-1], tmp / _LIBRARY)
        (tmp / _DIGEST).write_text(_digest(tmp / _LIBRARY))
        # mkdtemp's folder is 0700: as the umask makes folders, so that others can read a shared cache
        os.chmod(tmp, 0o777 & ~_umask())
        if final.exists():  # an incomplete folder without the library; we hold the lock
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _announce_build(final: Path) -> None:
    """One line on stderr before the first build, which takes one to a few minutes and is otherwise silent."""
    print(
        f"attnkit: building the C++ CPU kernels into {final} (a minute or more; a finished build is kept for "
        "later runs; ATTNKIT_NO_CPP=1 skips them)",
        file=sys.stderr,
        flush=True,
    )


def load(verbose: bool = False, *, warn: bool = True) -> bool:
    """Build (if needed) and load the extension; True when ``torch.ops.attnkit_cpu`` is usable."""
    if _state["loaded"]:
        return _state["ok"]
    with _lock:
        if _state["loaded"]:
            return _state["ok"]
        if disabled():  # a ValueError for a value it does not know, as for the lock timeout below
            _state.update(loaded=True, ok=False, error="disabled by ATTNKIT_NO_CPP")
            return False
        _lock_timeout()
        try:
            final = build_dir()
            library = final / _LIBRARY
            built_here = False
            if not _intact(final):  # missing, half-built, damaged, or from before the record: (re)build
                try:
                    final.parent.mkdir(parents=True, exist_ok=True)
                    with build_lock(final.parent / (final.name + ".lock")):
                        if not _intact(final):  # nobody finished it while we waited
                            _announce_build(final)
                            _build(final, verbose)
                            built_here = True
                except Exception:
                    # A library built before the record was kept is not known to be damaged: where it cannot
                    # be rebuilt (no compiler, a read-only cache) it is loaded as it was before, if whole.
                    if not (library.is_file() and not (final / _DIGEST).exists() and _elf_whole(library)):
                        raise
            if not built_here:
                torch.ops.load_library(str(library))
            torch.ops.attnkit_cpu.potentials_forward  # noqa: B018  (raises if the library did not register)
            torch.ops.attnkit_cpu.potentials_inference  # noqa: B018
            torch.ops.attnkit_cpu.l1_distance  # noqa: B018
            torch.ops.attnkit_cpu.coda_forward  # noqa: B018
            _state.update(loaded=True, ok=True, error=None)
        except Exception as exc:  # no compiler, ninja or BLAS symbol, a lock wait: fall back, say why once
            lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
            # the line that names the cause ("c++: not found", "error: ..."), not ninja's "build stopped"
            cause = next((line for line in lines if _CAUSE.search(line)), lines[-1] if lines else "")
            _state.update(loaded=True, ok=False, error=f"{type(exc).__name__}: {cause}")
            text = str(exc)
            if isinstance(exc, OSError) and exc.errno in _CACHE_ERRNOS:  # the cache folder
                fix = f"make ATTNKIT_CACHE a writable folder (the build goes to {build_dir().parent})"
            elif (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) or "No space left" in text:
                fix = f"free disk space where the build goes ({build_dir().parent}), then run `attnkit info`"
            elif isinstance(exc, TimeoutError):
                fix = ("let the other attnkit process finish its build (or remove a stale lock file it "
                       "names), then run `attnkit info`")
            else:
                fix = "install a C++ compiler (g++) and ninja, then run `attnkit info` to build them"
            if warn:
                warnings.warn(
                    f"attnkit: the C++ CPU kernels are not in use ({_state['error']}); the efficient backend "
                    f"uses its pure-PyTorch kernels (same results, slower). To use them, {fix}.",
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
