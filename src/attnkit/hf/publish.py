"""Publishing a saved model into an output folder without writing through links or deleting anything.

``attnkit convert`` and ``attnkit finetune`` save into a staging folder inside ``out`` and then move each
new file into place with ``os.replace`` (a symbolic link of that name is replaced, never written through),
``config.json`` last. Model or tokenizer files in ``out`` that the new output does not write are refused,
never removed; a failed save leaves ``out`` as it was. The staging folder holds a marker file
(:data:`MARKER`: host and pid) written first, by which a killed run's folder is recognised and removed.
A run holds ``out`` (:func:`claim_out`: an exclusive lock) from its checks to its last move: a second run
into the same folder is refused rather than replacing, or mixing its files with, the first one's output.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

__all__ = [
    "MARKER", "MAX_SHARD_SIZE", "MODEL_FILES", "PROCESSOR_FILES", "WRITE_TEST", "check_certainly_stale",
    "check_out_link", "check_overwritable", "check_shards", "check_stale", "claim_out", "is_attnkit_output",
    "is_empty", "model_files", "publish", "remove_dead_staging",
]

MARKER = ".attnkit-staging"  # in a staging folder: {"host": ..., "pid": ...} of the run writing into it
_MARKER_BYTES = 4096  # a marker attnkit writes is far shorter (a host name has at most 255 bytes)
_IN_USE = ("attnkit convert or finetune process writing into it: wait for it to finish (or stop it), or "
           "choose another --out")
WRITE_TEST = ".write-test-"  # finetune's test that --out can be written: a file that lives for an instant
# the largest weights file save_pretrained writes (transformers' default), passed to it by both commands:
# whether the new save is sharded, and into how many files at least, is known before it (check_shards)
MAX_SHARD_SIZE = "50GB"
_PREFIX = ".attnkit-"  # staging folders are named .attnkit-<command>-<pid>-<random>

# files of a model folder that transformers or the tokenizer read together with its weights; an output
# writes some of them (save_pretrained of the model and of its tokenizer). One in --out that the new
# output does not write would be read with the new weights (an earlier model's tokenizer): it is refused
MODEL_FILES = ("config.json", "generation_config.json", "chat_template.jinja", "chat_template.json",
               "adapter_config.json", "tf_model.h5", "flax_model.msgpack")
# the weights' names transformers reads (one file, or the shards an index lists): a user's backup such as
# model-backup.safetensors is neither read with the new weights nor refused
_MODEL_PATTERNS = ("model.safetensors", "model-*-of-*.safetensors", "*.safetensors.index.json",
                   "pytorch_model.bin", "pytorch_model-*-of-*.bin", "pytorch_model.bin.index.json",
                   "adapter_model.*")
# an image or feature processor's files (AutoImageProcessor, AutoProcessor), copied as the tokenizer is
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def check_out_link(out: Path) -> None:
    """Refuse an ``out`` that is a symbolic link to a missing folder (creating it was ``[Errno 17] File
    exists``)."""
    if out.is_symlink() and not out.exists():
        raise FileNotFoundError(
            f"--out {out} is a symbolic link to a missing folder ({os.readlink(out)}); create that folder, "
            "remove the link or choose another --out"
        )


@contextmanager
def claim_out(out: Path, lock: bool = True) -> Iterator[bool]:
    """Hold ``out`` for one run of ``convert`` or ``finetune``: create it and its missing parent folders
    (yields whether this run created ``out``) and, with ``lock``, hold an exclusive lock on it
    (:func:`attnkit._files.lock_folder`) until the run ends, so that a second run into the same folder is a
    ``ValueError`` ("... is in use by another attnkit convert or finetune process ...") instead of replacing
    this run's output. On leaving, the folders this run created are removed while they are empty, ``out``
    first (never a file in them), before the lock is released; without ``lock`` (another process of a
    multi-process run holds it) they are kept, for that process to publish. A creation that fails half-way
    removes the folders it created."""
    from .._files import lock_folder

    check_out_link(out)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out} is a file; pass a directory")
    try:  # the tokenizers library writes through UTF-8 paths only: a byte that is not failed after the run
        os.fspath(out).encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fspath(out).encode("utf-8", "backslashreplace").decode()
        raise ValueError(f"--out {shown} is not valid UTF-8, which the tokenizer's files cannot be saved "
                         "under; choose a UTF-8 name") from None
    try:
        made = _make_folders(out)
    except OSError as exc:
        raise PermissionError(
            f"--out {out} cannot be written ({exc.strerror or type(exc).__name__}); choose another --out"
        ) from None
    # refused: the folder is the other run's (which may have locked it right after this run created it)
    fd = lock_folder(out, _IN_USE) if lock else None
    try:
        yield out in made
    finally:
        if lock:
            _remove_if_empty(made)
        if fd is not None:
            os.close(fd)


def _make_folders(out: Path) -> list[Path]:
    """Create ``out`` and its missing parents one at a time, outermost first, and return the folders this
    call created in that order (one another process creates meanwhile is not among them). A failure removes
    those already created and raises."""
    missing = []
    folder = out
    while not folder.exists() and not folder.is_symlink():  # a root or the working directory exists
        missing.append(folder)
        folder = folder.parent
    made: list[Path] = []
    try:
        for folder in reversed(missing):
            try:
                folder.mkdir()
            except FileExistsError:
                if not folder.is_dir():
                    raise
                continue  # another process's
            made.append(folder)
    except BaseException:
        _remove_if_empty(made)
        raise
    return made


def _remove_if_empty(made: list[Path]) -> None:
    """Remove the folders ``made`` (outermost first) that are empty, innermost first: nothing written is ever
    removed, nor a folder that holds something."""
    for folder in reversed(made):
        try:
            folder.rmdir()  # only when empty
        except OSError:
            return  # the folders around it hold it


def is_empty(out: Path) -> bool:
    """Whether ``out`` holds nothing but finetune's write tests (:data:`WRITE_TEST`)."""
    return not _others(out, None)


def _others(out: Path, staging) -> list[str]:
    """The names in ``out`` other than the ``staging`` folder and finetune's write tests."""
    return sorted(p.name for p in out.iterdir() if p != staging and not p.name.startswith(WRITE_TEST))


def _marker_text() -> str:
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid()}) + "\n"


def _is_dead_staging(folder: Path) -> bool:
    """Whether ``folder`` is the staging folder of a run of this host whose process is gone: its marker
    names this host and a pid that is not alive. A folder without the marker (a user's) is never one, nor one
    whose marker cannot be read as one: longer than attnkit writes (read no further), not UTF-8 JSON."""
    from .._files import json_loads

    marker = folder / MARKER
    if not folder.is_dir() or folder.is_symlink() or marker.is_symlink() or not marker.is_file():
        return False
    try:
        with open(marker, "rb") as f:
            raw = f.read(_MARKER_BYTES + 1)
        if len(raw) > _MARKER_BYTES:
            return False
        record = json_loads(raw.decode("utf-8"))  # nested deeper than Python recurses: a ValueError
    except (OSError, ValueError):
        return False
    if not isinstance(record, dict) or record.get("host") != socket.gethostname():
        return False  # another host's run (a shared file system): its pid means nothing here
    pid = record.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False  # a live process of another user (or no such pid): not ours to judge
    return False


def staging_left(out: Path) -> str:
    """When every entry of ``out`` is a marked staging folder that :func:`remove_dead_staging` left (a live
    run's, another host's, or one whose pid was taken again): the words that name them, for the error of an
    ``out`` that reads as empty in ``ls``; else ``""``."""
    from .._files import json_loads

    try:
        entries = sorted(out.iterdir())
    except OSError:
        return ""
    if not entries or not all(e.name.startswith(_PREFIX) and (e / MARKER).is_file() for e in entries):
        return ""
    described = []
    for entry in entries[:3]:
        try:
            record = json_loads((entry / MARKER).read_text(encoding="utf-8")[:_MARKER_BYTES])
            who = f"pid {record['pid']} on host {record['host']}"
        except (OSError, ValueError, TypeError, KeyError):
            who = "a run"
        described.append(f"{entry.name} (the unfinished save of {who})")
    return (f": it holds only the hidden {', '.join(described)}; if that run is gone (killed on another "
            "host, or in a container since restarted), delete the folder")


def remove_dead_staging(out: Path) -> None:
    """Remove the staging folders in ``out`` of runs that were killed (SIGKILL leaves them), so that they
    neither make ``out`` non-empty nor stay in it. Only a folder holding the :data:`MARKER` of a run of this
    host whose process is gone is removed; a live one, another host's and a user's folder are left alone."""
    if not out.is_dir() or out.is_symlink():
        return
    for child in out.glob(_PREFIX + "*"):
        if _is_dead_staging(child):
            shutil.rmtree(child, ignore_errors=True)


def model_files(out: Path) -> list[Path]:
    """The files in ``out``, regular files and symbolic links alike (a Hugging Face cache snapshot links its
    files), named as the files of a saved model, tokenizer or processor."""
    from .checks import TOKENIZER_FILES

    names = set(MODEL_FILES) | set(TOKENIZER_FILES) | set(PROCESSOR_FILES)
    return [p for p in out.iterdir() if (p.is_symlink() or p.is_file())
            and (p.name in names or any(p.match(pattern) for pattern in _MODEL_PATTERNS))]


def is_attnkit_output(out: Path) -> bool:
    """Whether ``out`` holds what ``convert`` or ``finetune`` wrote: a ``config.json`` that records an attnkit
    conversion, or a fine-tune's ``metrics.json`` (a softmax fine-tune of a stock model records none)."""
    from .._files import json_loads
    from .convert import CONFIG_KEY

    def read(name: str):
        try:
            return json_loads((out / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    config = read("config.json")
    converted = isinstance(config, dict) and isinstance(config.get(CONFIG_KEY), dict)
    return converted or holds_finetune_record(out)


def holds_finetune_record(out: Path) -> bool:
    """Whether ``out/metrics.json`` is a fine-tune's record (its mechanism and steps), not a user's file."""
    from .._files import json_loads

    path = out / "metrics.json"
    try:
        metrics = json_loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError):
        return False
    return isinstance(metrics, dict) and {"mechanism", "train_steps"} <= metrics.keys()


def check_overwritable(out: Path, overwrite: bool) -> None:
    """Refuse an ``--overwrite`` of model files that attnkit did not write (a stock model, or links to one)
    rather than mix the new output's files with them."""
    if not (overwrite and out.is_dir()):
        return
    files = model_files(out)
    if files and not is_attnkit_output(out):
        raise FileExistsError(
            f"--overwrite: --out {out} holds model files ({', '.join(sorted(p.name for p in files))}) that "
            "attnkit did not write (its config.json records no conversion and it has no fine-tune's "
            "metrics.json); refusing to replace them, choose another --out"
        )


def _refuse_stale(out: Path, stale: list[str]) -> None:
    if stale:
        raise FileExistsError(
            f"--out {out} holds model or tokenizer files that the new output does not write "
            f"({', '.join(stale)}), which could be read with its weights; move them out of --out or choose "
            "another --out"
        )


def _may_write(name: str, tokenizer: bool, processor: bool) -> bool:
    """Whether an output's ``save_pretrained`` (model, tokenizer when ``tokenizer``) and processor copy
    (when ``processor``) may write a file of this name: which of them it writes is known after the save."""
    from .checks import TOKENIZER_FILES

    saved = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")
    return (name in saved
            or re.fullmatch(r"model-\d+-of-\d+\.safetensors", name) is not None  # a sharded save
            or (tokenizer and (name in TOKENIZER_FILES or name.startswith("chat_template.")))
            or (processor and name in PROCESSOR_FILES))


def check_certainly_stale(out: Path, tokenizer: bool, processor: bool) -> None:
    """Before the load and save: refuse the files of ``out`` that the new output certainly does not write
    (weights of other names or formats; tokenizer or processor files when it writes none), as
    :func:`check_stale` would after the save."""
    if out.is_dir():
        stale = [p.name for p in model_files(out) if not _may_write(p.name, tokenizer, processor)]
        _refuse_stale(out, sorted(stale))


def check_shards(out: Path, model, max_shard_size=MAX_SHARD_SIZE) -> None:
    """Before the save (and a fine-tune's training): refuse the weights files of ``out`` that saving ``model``
    with ``save_pretrained(max_shard_size=max_shard_size)`` certainly does not write. Whether that save is
    sharded follows from the size of the weights, split as the save splits them
    (``huggingface_hub.split_torch_state_dict_into_shards``): one ``model.safetensors`` makes shards and
    their index stale; shards make ``model.safetensors`` stale (which shards: known after the save)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    if not out.is_dir():
        return
    split = split_torch_state_dict_into_shards(  # the tied weights the save leaves out share a storage
        model.state_dict(), filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
    )
    if split.is_sharded:
        stale = [p.name for p in model_files(out) if p.name == "model.safetensors"]
    else:
        stale = [p.name for p in model_files(out) if p.name == "model.safetensors.index.json"
                 or re.fullmatch(r"model-\d+-of-\d+\.safetensors", p.name)]
    _refuse_stale(out, sorted(stale))


def check_stale(out: Path, new: list[str], what: str) -> None:
    """Refuse an ``out`` holding model, tokenizer or processor files that the new output (the ``what``
    with the file names ``new``) does not write, which transformers would read with the new weights (they
    may be the user's: they are not removed), or a folder where a new file goes."""
    _refuse_stale(out, sorted(p.name for p in model_files(out) if p.name not in new))
    folders = sorted(name for name in new if (out / name).is_dir() and not (out / name).is_symlink())
    if folders:
        raise FileExistsError(
            f"--out {out} holds folders named as files of the {what} ({', '.join(folders)}); move "
            "them out of --out or choose another --out"
        )


def _refused_write(exc: BaseException, what: str, out: Path) -> OSError:
    """A write the system refused (disk full, a file-size limit) as an ``OSError`` naming ``out``; any other
    error is re-raised (a defect)."""
    from safetensors import SafetensorError

    text = " ".join(str(exc).split())
    if not isinstance(exc, (OSError, SafetensorError)) and not (
        type(exc) is Exception and re.search(r"os error \d+", text)  # tokenizers' Rust I/O errors
    ):
        raise exc
    code = exc.errno if isinstance(exc, OSError) else None
    # safetensors: "I/O error: File too large (os error 27)";
    # tokenizers: "No space left on device (os error 28)"
    found = re.search(r"os error (\d+)", text)
    if code is None and found is None:  # not a refused write (safetensors' own check): a defect
        raise exc
    code = code if code is not None else int(found[1])
    reason = (exc.strerror if isinstance(exc, OSError) else None) or os.strerror(code)
    return OSError(code, f"{reason} while saving the {what} (--out left as it was)", str(out))


def publish(out: Path, write: Callable[[Path], None], what: str, command: str,
            found_empty: bool = False) -> list[str]:
    """Save an output with ``write(staging)`` into a staging folder inside ``out`` (created, with its missing
    parents, when missing), then move each file it wrote into ``out``, ``config.json`` last, and return their
    names.

    The staging folder (``.attnkit-<command>-<pid>-*``) holds the :data:`MARKER` first. A model, tokenizer
    or processor file in ``out`` that ``write`` did not write is refused before any file of ``out`` changes
    (:func:`check_stale`); so is anything in an ``out`` that the run found empty (``found_empty``) or
    created, which another program wrote meanwhile. Each move replaces the file or symbolic link of that
    name (never its target): the earlier output's files of those names first step aside into the staging
    folder (``config.json`` first), so that ``out`` never holds new files beside the earlier ``config.json``.
    A failed save (disk full) is one ``OSError`` and leaves ``out`` as it was; a failed or interrupted run
    removes the files it moved there that are still its own, moves the earlier output's back, removes its
    staging folder and then the folders it created while they are empty: never another's file. A SIGKILL
    between the moves leaves ``out`` without ``config.json`` (it fails to load rather than load wrong)."""
    from .._files import match_umask

    check_out_link(out)
    made = _make_folders(out)  # empty inside claim_out, which created them
    found_empty = found_empty or out in made
    try:
        # inside --out: on its file system (os.replace moves, never copies), whatever its parent allows
        staging = Path(tempfile.mkdtemp(dir=out, prefix=f"{_PREFIX}{command}-{os.getpid()}-"))
    except BaseException:
        _remove_if_empty(made)
        raise
    moved: dict[str, tuple[int, int]] = {}  # name -> (device, inode) of each file this run moves into out
    backed: list[str] = []  # the earlier output's files moved aside into the staging folder, in order
    done = False
    try:
        (staging / MARKER).write_text(_marker_text(), encoding="utf-8")
        try:
            write(staging)
        except Exception as exc:
            raise _refused_write(exc, what, out) from exc
        match_umask(staging)  # model.safetensors is written 0600 by safetensors
        new = sorted(p.name for p in staging.iterdir() if p.name != MARKER)
        check_stale(out, new, what)  # before any file of --out changes
        others = _others(out, staging) if found_empty else []
        if others:  # another run or program wrote into the --out this run found empty
            raise FileExistsError(
                f"--out {out} was empty when this run began but now holds {', '.join(others[:5])}"
                f"{f' and {len(others) - 5} more' if len(others) > 5 else ''}, written meanwhile by another "
                "program; nothing was replaced: move them out of --out or choose another --out"
            )
        # --overwrite: the earlier output's files step aside into the staging folder first, config.json
        # first, so that a stop between two moves never leaves new weights under the earlier config.json (it
        # loaded as the earlier mechanism): an interrupt (Ctrl-C, SIGTERM) restores them, a SIGKILL leaves an
        # --out without config.json, which fails to load rather than load wrong
        old = staging / _OLD
        old.mkdir()
        for name in sorted(new, key=lambda name: name != "config.json"):
            if os.path.lexists(out / name):
                os.replace(out / name, old / name)
                backed.append(name)
        # config.json last: stopped between two moves, --out has no config.json until the end
        for name in sorted(new, key=lambda name: name == "config.json"):
            st = os.lstat(staging / name)
            moved[name] = (st.st_dev, st.st_ino)  # before the move: an interrupt may come right after it
            os.replace(staging / name, out / name)  # a symbolic link is replaced, not written through
        done = True
    except BaseException:
        # --out as it was: without the files this run moved in (a later one's are kept), with the earlier
        # output's files back
        _unpublish(out, moved)
        for name in reversed(backed):
            try:
                os.replace(staging / _OLD / name, out / name)
            except OSError:
                continue
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if not done:
            _remove_if_empty(made)
    return new


_OLD = ".attnkit-earlier-output"  # in the staging folder: the files an --overwrite replaces, until done


def _unpublish(out: Path, moved: dict[str, tuple[int, int]]) -> None:
    """Remove the files of ``out`` named in ``moved`` that are still the ones moved there (same inode)."""
    for name, moved_id in moved.items():
        try:
            st = os.lstat(out / name)
            if (st.st_dev, st.st_ino) == moved_id:
                (out / name).unlink()
        except OSError:
            continue
