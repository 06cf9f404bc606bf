"""The local dataset cache: where it lives, and SHA-256 manifests of what was written there.

The cache root is ``cache_dir`` when given, else ``$ATTNKIT_CACHE``, else ``~/.cache/attnkit``.
Each dataset lives in ``<root>/datasets/<name>/`` beside a ``manifest.json`` that records the SHA-256
of every file; loading verifies it, so a truncated or edited file is reported, never parsed.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Optional, Union

from .._files import json_loads, remove_stale
from .containers import DatasetChecksumError, DatasetUnavailableError

__all__ = [
    "cache_root",
    "dataset_cache_dir",
    "sha256_file",
    "sha256_bytes",
    "write_bytes_atomic",
    "make_cache_folder",
    "check_cache_folder",
    "write_manifest",
    "read_manifest",
    "verify_manifest",
    "MANIFEST",
]

MANIFEST = "manifest.json"
_SHA256 = re.compile(r"[0-9a-f]{64}")
PathLike = Union[str, os.PathLike]


def cache_root(cache_dir: Optional[PathLike] = None) -> Path:
    """``cache_dir``, else ``$ATTNKIT_CACHE``, else ``~/.cache/attnkit`` (not created). A blank variable is
    unset (``" "`` made a folder named by a space in the working directory)."""
    if cache_dir is not None:
        if isinstance(cache_dir, str) and not cache_dir.strip():  # Path("") is the working directory
            raise ValueError("--cache-dir is empty; pass a folder, or drop it for $ATTNKIT_CACHE or "
                             "~/.cache/attnkit")
        return Path(cache_dir).expanduser()
    env = os.environ.get("ATTNKIT_CACHE", "").strip()
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "attnkit"


def dataset_cache_dir(name: Optional[str] = None, cache_dir: Optional[PathLike] = None) -> Path:
    """The folder of dataset ``name`` in the cache (``<root>/datasets/<name>``), or of all datasets."""
    base = cache_root(cache_dir) / "datasets"
    return base if name is None else base / name


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: PathLike, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


def _through_a_file(folder: Path) -> DatasetUnavailableError:
    return DatasetUnavailableError(
        f"cannot create the folder {folder}: a part of that path is a file, not a folder; "
        "point cache_dir (or $ATTNKIT_CACHE) at a folder, or move the file away"
    )


def check_cache_folder(folder: Path) -> None:
    """Refuse, as :func:`make_cache_folder` would, a ``folder`` whose nearest existing part is not a folder
    (a cache root that is a file), creating nothing: for readers of the cache, which otherwise found every
    dataset "not cached"."""
    for part in (folder, *folder.parents):
        if os.path.exists(part):
            if not os.path.isdir(part):
                raise _through_a_file(folder)
            return


def _through_a_dangling_link(folder: Path) -> Optional[DatasetUnavailableError]:
    """The error for a ``folder`` that is, or lies in, a symbolic link to nothing (mkdir calls that "a
    file"), or None."""
    for part in (folder, *folder.parents):
        if part.is_symlink() and not part.exists():
            return DatasetUnavailableError(
                f"cannot create the folder {folder}: {part} is a symbolic link to {os.readlink(part)}, which "
                "does not exist; create that folder, or point cache_dir (or $ATTNKIT_CACHE) elsewhere"
            )
    return None


def check_cache_writable(folder: Path) -> None:
    """Refuse, creating nothing, a ``folder`` that could not be made or written: its nearest existing part
    is a file, or a folder this process may not write (a read-only HOME without ``$ATTNKIT_CACHE``), so
    that a fetch says so before its "downloading" line, not after it."""
    check_cache_folder(folder)
    for part in (folder, *folder.parents):
        if os.path.exists(part):
            if not os.access(part, os.W_OK | os.X_OK):
                raise _unwritable(folder, PermissionError(errno.EACCES, os.strerror(errno.EACCES)))
            return


def make_cache_folder(folder: Path) -> None:
    """Create ``folder`` (and its parents) in the cache; a path through a file or a symbolic link to nothing,
    a read-only or full disk and missing permissions are one ``DatasetUnavailableError`` naming the folder
    and the fix."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # the cache root, or a folder in it, is a file
        raise (_through_a_dangling_link(folder) or _through_a_file(folder)) from None
    except OSError as exc:
        raise _unwritable(folder, exc) from None


def _unwritable(path: Path, exc: OSError) -> DatasetUnavailableError:
    return DatasetUnavailableError(
        f"cannot write to the cache at {path} ({exc.strerror or type(exc).__name__}); point cache_dir (or "
        "$ATTNKIT_CACHE) at a writable folder"
    )


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename (no half-written file on a crash).
    A folder at ``path`` is refused by name (the rename failed "Is a directory", reported as a cache that
    cannot be written, and ``fetch --force`` did not help)."""
    make_cache_folder(path.parent)
    if path.is_dir() and not path.is_symlink():  # a link to a folder is replaced, as a link to a file is
        raise DatasetUnavailableError(
            f"{path} is a folder where attnkit keeps a file; remove it and run the fetch again"
        )
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:  # read-only file system, no permission
        raise _unwritable(path.parent, exc) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; cached data is ordinary readable files
        os.replace(tmp, path)
        # what a writer of this file killed between mkstemp and the rename left (none takes an hour)
        remove_stale(path.parent, f".{glob.escape(path.name)}.*.tmp", older_than_s=3600)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(exc, OSError):  # a full disk, say
            raise _unwritable(path.parent, exc) from None
        raise


def write_manifest(folder: Path, source: str, files: list[str], **extra) -> dict:
    """Hash ``files`` (names inside ``folder``) and write ``manifest.json``; return the manifest. Their sizes
    are recorded too, so that a file of another size is refused before it is hashed (3 GiB took 45 s)."""
    manifest = {"source": source, "files": {f: sha256_file(folder / f) for f in sorted(files)},
                "sizes": {f: (folder / f).stat().st_size for f in sorted(files)}, **extra}
    write_bytes_atomic(folder / MANIFEST, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
    return manifest


def read_manifest(folder: Path) -> Optional[dict]:
    """The manifest of ``folder``, or ``None`` when there is none (the dataset was never fetched)."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json_loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # ValueError: not UTF-8 or not JSON
        return {"files": {}, "corrupt": True}
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return {"files": {}, "corrupt": True}
    for file_name, digest in manifest["files"].items():  # plain names in the folder, hex SHA-256 digests
        if Path(file_name).name != file_name or file_name in ("", ".", "..") or not (
            isinstance(digest, str) and _SHA256.fullmatch(digest)
        ):
            return {"files": {}, "corrupt": True}
    sizes = manifest.get("sizes", {})  # absent from manifests written before sizes were recorded
    if not isinstance(sizes, dict) or not all(type(size) is int and size >= 0 for size in sizes.values()):
        return {"files": {}, "corrupt": True}
    return manifest


def verify_manifest(name: str, folder: Path, required: tuple[str, ...] = ()) -> dict:
    """Check every file of the manifest of ``folder``; raise a clear error naming the fix.

    Raises ``DatasetUnavailableError`` when the dataset was never fetched and ``DatasetChecksumError``
    when a file is missing or its SHA-256 differs from the manifest, or when the manifest does not list
    one of the ``required`` files (the files the loader reads: none is read unchecked).
    """
    manifest = read_manifest(folder)
    fix = f"run `attnkit data fetch {name} --force` (or fetch({name!r}, force=True))"
    if manifest is None:
        raise DatasetUnavailableError(
            f"dataset {name!r} is not in the cache ({folder}); run `attnkit data fetch {name}` "
            f"(attnkit.data.fetch({name!r}) in Python; a hub dataset where the hub is not reachable: with "
            "--source DIR, a local copy)"
        )
    if manifest.get("corrupt") or not manifest["files"]:
        raise DatasetChecksumError(f"dataset {name!r}: the manifest {folder / MANIFEST} is unreadable; {fix}")
    unlisted = [f for f in required if f not in manifest["files"]]
    if unlisted:
        raise DatasetChecksumError(
            f"dataset {name!r}: the manifest {folder / MANIFEST} does not list {unlisted}; {fix}"
        )
    for file_name in manifest["files"]:  # every file there and of its recorded size before any is hashed
        path = folder / file_name
        if not path.is_file():
            raise DatasetChecksumError(f"dataset {name!r}: cached file {path} is missing; {fix}")
        size, recorded = path.stat().st_size, manifest.get("sizes", {}).get(file_name)
        if recorded is not None and size != recorded:  # refused without reading it
            raise DatasetChecksumError(
                f"dataset {name!r}: cached file {path} has {size} bytes, the manifest says {recorded} "
                f"(corrupt or edited); {fix}"
            )
    for file_name, expected in manifest["files"].items():
        path = folder / file_name
        actual = sha256_file(path)
        if actual != expected:
            raise DatasetChecksumError(
                f"dataset {name!r}: cached file {path} has SHA-256 {actual[:16]}..., the manifest says "
                f"{expected[:16]}... (corrupt or edited); {fix}"
            )
    return manifest
