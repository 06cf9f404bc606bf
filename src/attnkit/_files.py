"""File modes of what attnkit writes for the user.

``safetensors.save_file`` creates its file with mode 0600 (owner only), unlike ``open()``, which honours the
umask (0644 under the usual 022): a model or attention export written for a team would be unreadable to the
others. :func:`match_umask` gives such files the mode ``open()`` would have. :func:`write_text_file` writes a
result file whole or not at all, and never over a file that appeared meanwhile unless asked to.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Optional, Union

__all__ = ["match_umask", "write_text_file", "write_file_with", "check_link", "check_output_parents",
           "check_out_writable", "check_deletable", "rmtree_named"]

_LOCK = threading.Lock()


def _umask() -> int:
    with _LOCK:  # os.umask can only be read by setting it
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def match_umask(*paths: Union[str, os.PathLike]) -> None:
    """Give each regular file in ``paths`` (files, or folders: their files) mode ``0666 & ~umask``."""
    mode = 0o666 & ~_umask()
    for path in paths:
        path = Path(path)
        files = [p for p in path.iterdir() if p.is_file()] if path.is_dir() else [path]
        for file in files:
            if file.is_file() and not file.is_symlink() and (file.stat().st_mode & 0o777) != mode:
                os.chmod(file, mode)


def write_text_file(path: Union[str, os.PathLike], text: str, *, overwrite: bool) -> None:
    """Write ``text`` to ``path`` through a temporary file in its folder: readers never see half a file,
    and a process killed meanwhile leaves the old file (if any) as it was. Without ``overwrite`` the file is
    linked into place only if ``path`` does not exist at that moment (a file that appeared while a long run
    was going is kept): ``FileExistsError`` then."""
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    write_file_with(path, write, overwrite=overwrite)


def write_file_with(path: Union[str, os.PathLike], write, *, overwrite: bool) -> None:
    """:func:`write_text_file` for any writer: ``write(tmp)`` writes the whole file at the temporary path
    ``tmp`` (in ``path``'s folder), which then takes ``path``'s place as ``write_text_file`` says, with the
    mode ``open()`` would give it. A ``path`` that is, or lies in, a symbolic link to nothing is refused
    (:func:`check_link`)."""
    check_link(path)
    path = Path(os.path.realpath(path))  # a symbolic link is written through, not replaced
    if path.exists() and not path.is_file():  # a folder, a device, a pipe: never renamed over
        kind = "a folder" if path.is_dir() else "not a regular file (a device, a pipe or a socket)"
        raise ValueError(f"{path} is {kind}; pass the path of a file to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        try:
            write(tmp)
        except OSError as exc:
            if exc.filename is None and exc.errno is not None:  # write()/close() name no file: name this one
                raise OSError(exc.errno, exc.strerror or os.strerror(exc.errno), str(path)) from None
            raise
        match_umask(tmp)
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # atomic, and fails when path exists
            except FileExistsError:
                raise FileExistsError(
                    f"{path} exists (it appeared while this was running); pass --overwrite to replace it or "
                    "choose another --out"
                ) from None
            except OSError:  # a file system without hard links: the check and the rename are two steps
                if path.exists():
                    raise FileExistsError(f"{path} exists; pass --overwrite to replace it") from None
                os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    # what a writer of this file killed between its temporary file and the rename left (none takes an hour)
    remove_stale(path.parent, f".{glob.escape(path.name)}.*.tmp", older_than_s=3600)


def write_results(path: Union[str, os.PathLike], text: str, *, overwrite: bool) -> Path:
    """Write measurements ``text`` to ``path`` (:func:`write_text_file`); when ``path`` appeared while they
    were measured (and ``overwrite`` is off), that file is kept and they go beside it, to ``NAME-1.SUFFIX``
    (the first free number): the ``FileExistsError`` then names both. Returns the path written."""
    path = Path(path)
    try:
        write_text_file(path, text, overwrite=overwrite)
        return path
    except FileExistsError:
        spare = next(p for i in range(1, 10_000)
                     if not os.path.lexists(p := path.with_name(f"{path.stem}-{i}{path.suffix}")))
        write_text_file(spare, text, overwrite=False)
        raise FileExistsError(f"{path} appeared while this was running and is kept; the results are in "
                              f"{spare}") from None


def check_link(path: Union[str, os.PathLike], name: str = "") -> None:
    """Refuse a ``path`` that is, or lies in, a symbolic link to nothing: writing through it would create
    the link's target, and the folders above it, wherever the link points. One line, a
    ``FileNotFoundError`` that starts with ``name`` (the option, e.g. ``"--out"``) where given."""
    path = Path(path)
    label = f"{name} {path}" if name else str(path)
    fix = f"choose another {name}" if name else "write elsewhere"
    for link in (path, *path.parents):
        if link.is_symlink() and not link.exists():
            where = f"is a symbolic link to {os.readlink(link)}" if link == path else (
                f"lies in {link}, a symbolic link to {os.readlink(link)}")
            raise FileNotFoundError(f"{label} {where}, which does not exist; remove the link or {fix}")


def check_output_parents(out: Union[str, Path]) -> None:
    """Raise ``NotADirectoryError`` naming the file when a folder above ``out`` is a file (``out`` could not
    be made), and ``FileNotFoundError`` when ``out`` is or lies in a symbolic link to nothing (writing would
    create its target); ``out`` itself being a file is refused where the folder is prepared."""
    check_link(out, "--out")
    for parent in Path(out).parents:  # the nearest first: the first that exists decides
        if parent.exists():
            if not parent.is_dir():
                raise NotADirectoryError(
                    f"output path {str(out)!r} cannot be made: {str(parent)!r} is a file, not a directory; "
                    "pass another --out (or move that file)"
                )
            return


def make_out_dir(out: Union[str, Path]) -> None:
    """``out.mkdir(parents=True, exist_ok=True)``, a refusal naming ``--out`` when the system refuses it (a
    working directory that cannot be written: the default ``--out`` printed only "[Errno 2] No such file or
    directory: 'runs'")."""
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
    except (FileNotFoundError, PermissionError) as exc:
        why = exc.strerror or type(exc).__name__
        raise PermissionError(f"--out {str(out)!r} cannot be made ({why}); choose another --out") from None


def check_out_writable(out: Union[str, Path], name: str = "--out") -> None:
    """Refuse, before any work, an ``out`` that cannot be written: a ``PermissionError`` "--out OUT cannot be
    written (why); choose another --out". An existing folder is probed with a temporary file (removed at
    once); one still to be made is judged by the nearest folder above it that exists (``os.access``)."""
    out = Path(out)
    try:
        if out.is_dir():
            with tempfile.NamedTemporaryFile(dir=out, prefix=".attnkit-write-test-"):
                pass
            return
        parent = next((p for p in out.parents if p.is_dir()), Path("."))
        if not os.access(parent, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(parent))
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise PermissionError(f"{name} {out} cannot be written ({why}); choose another {name}") from None


def check_deletable(paths, what: str) -> None:
    """Refuse, before anything is deleted, to delete ``paths`` (files, and folders with all they hold) when
    one of them cannot be: a ``PermissionError`` naming the first folder that cannot be written (a folder
    owned by another user, mode 0555), which would have stopped the deletion half-way. ``what`` says who
    deletes (e.g. "--overwrite")."""
    need = os.R_OK | os.W_OK | os.X_OK
    for path in map(Path, paths):
        folders = [path.parent]
        if path.is_dir() and not path.is_symlink():
            folders += [Path(root) for root, _dirs, _files in os.walk(path)]  # links are not followed
        for folder in folders:
            if not os.access(folder, need):
                raise PermissionError(
                    f"{what}: cannot delete what {str(folder)!r} holds ({os.strerror(errno.EACCES)}); "
                    "nothing was deleted: make it writable or choose another --out"
                )


def rmtree_named(path: Union[str, os.PathLike]) -> None:
    """``shutil.rmtree(path)`` whose refusal names the full path of what could not be deleted and the fix
    (``shutil.rmtree`` names only the entry, relative to its folder: "Permission denied: 'model.pt'")."""
    import shutil

    def refused(_function, where, exc_info) -> None:  # ``where``: the full path (the error has the name)
        exc = exc_info[1]
        if not isinstance(exc, OSError):
            raise exc
        raise PermissionError(f"cannot delete {str(where)!r} ({exc.strerror or type(exc).__name__}); make it "
                              "writable or choose another --out") from None

    shutil.rmtree(path, onerror=refused)


def save_figure(fig, path: Union[str, os.PathLike], **kwargs) -> None:
    """``fig.savefig`` whole or not at all (through a temporary file; the format from ``path``'s suffix)."""
    fmt = Path(path).suffix.lstrip(".") or "png"
    write_file_with(path, lambda tmp: fig.savefig(tmp, format=fmt, **kwargs), overwrite=True)


_CSV_LIMIT = threading.Lock()


@contextlib.contextmanager
def wide_csv_fields():
    """Python's ``csv`` refuses a field over 131072 characters (``field larger than field limit``): a long
    document is a valid example. The limit is the process's; it is raised while the block runs and then
    restored."""
    import csv

    with _CSV_LIMIT:
        old = csv.field_size_limit(2**31 - 1)  # a C long everywhere
        try:
            yield
        finally:
            csv.field_size_limit(old)


def json_loads(text: Union[str, bytes], **kwargs):
    """``json.loads`` for files attnkit did not write: nesting deeper than Python's recursion limit is a
    ``json.JSONDecodeError`` (a ``ValueError``, which the callers turn into one line naming the file), not a
    ``RecursionError`` traceback."""
    try:
        return json.loads(text, **kwargs)
    except RecursionError:
        doc = text if isinstance(text, str) else text.decode("utf-8", "replace")
        raise json.JSONDecodeError("nested deeper than can be read", doc, 0) from None


#: what ``flock`` raises on a file system without file locks: NFS without its lock daemon or with a lock
#: emulation that wants a file open for writing (EBADF on a folder), FUSE and SMB mounts
NO_LOCKS = frozenset(e for e in (errno.ENOLCK, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", None),
                                 errno.EINVAL, errno.ENOSYS, errno.EBADF) if e is not None)


_SAID_WITHOUT_LOCK: set[str] = set()


def without_lock(path: Union[str, os.PathLike], exc: OSError, what: str) -> None:
    """Say on stderr, in one line (once per path and process), that ``path`` could not be locked because its
    file system has no locks, and what goes on without the lock (``what``)."""
    import sys

    if str(path) in _SAID_WITHOUT_LOCK:
        return
    _SAID_WITHOUT_LOCK.add(str(path))
    reason = errno.errorcode.get(exc.errno, str(exc.errno))
    print(f"attnkit: cannot lock {str(path)!r} (its file system has no file locks: {reason}); {what}",
          file=sys.stderr, flush=True)


def lock_folder(folder: Union[str, os.PathLike], in_use: str) -> Optional[int]:
    """An exclusive ``fcntl.flock`` on ``folder`` (released when the descriptor is closed or this process
    ends, even killed); a second process gets a ``ValueError``: "folder ... is in use by another ``in_use``".
    Returns the descriptor to close, or ``None`` where the platform has no ``flock`` or the folder's file
    system has no locks (said in one line: the run goes on, unguarded against a second one)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        return None
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if not isinstance(exc, BlockingIOError):
            os.close(fd)
            if exc.errno not in NO_LOCKS:
                raise
            # a traceback before (a 54-line one on NFS-like mounts): the run needs no lock to be right
            without_lock(folder, exc, "going on without it: a second run into it at the same time is not "
                         "refused")
            return None
        os.close(fd)
        holder = _lock_holder(folder)
        if holder is not None and holder[0] not in in_use.split(":")[0].split():
            # another command holds it (a reproduce into a folder a compare runs in): ``in_use`` names ours
            raise ValueError(f"{str(folder)!r} is in use by another attnkit process (attnkit {holder[0]}, "
                             f"pid {holder[1]}): wait for it to finish (or stop it), or choose another --out"
                             ) from None
        raise ValueError(f"{str(folder)!r} is in use by another {in_use}") from None
    return fd


def _lock_holder(folder: Union[str, os.PathLike]) -> Optional[tuple[str, int]]:
    """``(command, pid)`` of the attnkit command (``compare``, ``reproduce``, ...) whose process holds the
    ``flock`` on ``folder``, read from ``/proc/locks`` and the holder's command line (Linux); ``None`` where
    it cannot be told (another platform, a process that is not the ``attnkit`` script, one that just
    ended)."""
    try:
        st = os.stat(folder)
        key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            # "1: FLOCK  ADVISORY  WRITE 14362 fe:00:2376650 0 EOF" (a waiter's line has "->" after "1:")
            pids = [int(p[4]) for p in (line.split() for line in f)
                    if len(p) >= 6 and p[1] == "FLOCK" and p[5] == key and p[4].isdigit()]
        for pid in pids:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode("utf-8", "replace") for a in f.read().split(b"\0")]
            command = _attnkit_command(argv)
            if command is not None:
                return command, pid
    except (OSError, ValueError, IndexError):
        return None
    return None


# the commands that lock their output folder (lock_folder's callers)
_LOCKING_COMMANDS = ("compare", "reproduce", "convert", "finetune")


def _attnkit_command(argv: list[str]) -> Optional[str]:
    """The subcommand of an ``attnkit`` command line (``attnkit compare ...``, ``python .../attnkit compare``,
    ``python -m attnkit[.cli] compare``), or ``None`` for another program (a script of the user's whose
    arguments name a folder ``.../attnkit`` is not one)."""
    words = list(argv)
    if words and os.path.basename(words[0]).startswith("python"):  # the interpreter running the script
        words = words[1:]
        if len(words) >= 2 and words[0] == "-m" and words[1] in ("attnkit", "attnkit.cli"):
            words = ["attnkit", *words[2:]]
    if len(words) >= 2 and os.path.basename(words[0]) == "attnkit" and words[1] in _LOCKING_COMMANDS:
        return words[1]
    return None


def remove_stale(folder: Union[str, os.PathLike], pattern: str, older_than_s: float) -> None:
    """Remove the entries of ``folder`` matching ``pattern`` (files or folders: the scratch of a writer that
    was killed) not modified for ``older_than_s`` seconds, a time no live writer of them takes; entries that
    vanish or cannot be removed meanwhile are left to the next call."""
    import shutil
    import time

    now = time.time()
    for entry in Path(folder).glob(pattern):
        try:
            if now - entry.lstat().st_mtime < older_than_s:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except OSError:
            continue


def state_mismatch(exc: BaseException) -> str:
    """What ``load_state_dict``'s ``RuntimeError`` says, on one line: the missing, unexpected and resized
    names (its first line, "Error(s) in loading state_dict for X:", says nothing)."""

    def names(text: str) -> str:
        keys = [k.strip().strip('"') for k in text.rstrip(". ").split(",") if k.strip()]
        return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")

    parts, resized = [], []
    for line in str(exc).splitlines()[1:]:
        line = line.strip()
        if line.startswith("Missing key(s) in state_dict:"):
            parts.append("missing " + names(line.partition(":")[2]))
        elif line.startswith("Unexpected key(s) in state_dict:"):
            parts.append("unexpected " + names(line.partition(":")[2]))
        elif line.startswith("size mismatch for "):
            resized.append(line[len("size mismatch for "):].partition(":")[0])
    if resized:
        parts.append("other shapes: " + names(", ".join(resized)))
    if not parts:
        lines = str(exc).strip().splitlines()
        return lines[0] if lines else type(exc).__name__
    text = "; ".join(parts)
    if ".highway.linear." in text:  # the layout before the highway had a separate gate and transform
        text += ("; written by an earlier attnkit, whose alignment highway layer had one matrix for its gate "
                 "and transform: it cannot be resumed")
    return text
