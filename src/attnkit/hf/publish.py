"""Publishing a saved model into an output folder without writing through links or deleting anything.

``attnkit convert`` and ``attnkit finetune`` save into a staging folder inside ``out`` and then move each
new file into place with ``os.replace`` (a symbolic link of that name is replaced, never written through),
``config.json`` last. Model or tokenizer files in ``out`` that the new output does not write are refused,
never removed; a failed save leaves ``out`` as it was. The staging folder holds a marker file
(:data:`MARKER`: host and pid) written first, by which a killed run's folder is recognised and removed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Callable

__all__ = [
    "MARKER", "MODEL_FILES", "PROCESSOR_FILES", "check_certainly_stale", "check_out_link",
    "check_overwritable", "check_stale", "is_attnkit_output", "model_files", "publish", "remove_dead_staging",
]

MARKER = ".attnkit-staging"  # in a staging folder: {"host": ..., "pid": ...} of the run writing into it
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


def _marker_text() -> str:
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid()}) + "\n"


def _is_dead_staging(folder: Path) -> bool:
    """Whether ``folder`` is the staging folder of a run of this host whose process is gone: its marker
    names this host and a pid that is not alive. A folder without the marker (a user's) is never one."""
    marker = folder / MARKER
    if not folder.is_dir() or folder.is_symlink() or marker.is_symlink() or not marker.is_file():
        return False
    try:
        record = json.loads(marker.read_text(encoding="utf-8"))
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

    config, metrics = read("config.json"), read("metrics.json")
    return (isinstance(config, dict) and isinstance(config.get(CONFIG_KEY), dict)) or (
        isinstance(metrics, dict) and {"mechanism", "train_steps"} <= metrics.keys()
    )


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

    if not isinstance(exc, (OSError, SafetensorError)):
        raise exc
    text = " ".join(str(exc).split())
    code = exc.errno if isinstance(exc, OSError) else None
    found = re.search(r"os error (\d+)", text)  # safetensors: "I/O error: File too large (os error 27)"
    if code is None and found is None:  # not a refused write (safetensors' own check): a defect
        raise exc
    code = code if code is not None else int(found[1])
    reason = (exc.strerror if isinstance(exc, OSError) else None) or os.strerror(code)
    return OSError(code, f"{reason} while saving the {what} (--out left as it was)", str(out))


def publish(out: Path, write: Callable[[Path], None], what: str, command: str) -> list[str]:
    """Save an output with ``write(staging)`` into a staging folder inside ``out`` (created when missing),
    then move each file it wrote into ``out``, ``config.json`` last, and return their names.

    The staging folder (``.attnkit-<command>-<pid>-*``) holds the :data:`MARKER` first. A model, tokenizer
    or processor file in ``out`` that ``write`` did not write is refused before any file of ``out`` changes
    (:func:`check_stale`). Each move replaces the file or symbolic link of that name (never its target).
    A failed save (disk full) is one ``OSError`` and leaves ``out`` as it was; a failed or interrupted run
    removes an ``out`` it created (all in it is its own) and always its staging folder."""
    from .._files import match_umask

    check_out_link(out)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        # inside --out: on its file system (os.replace moves, never copies), whatever its parent allows
        staging = Path(tempfile.mkdtemp(dir=out, prefix=f"{_PREFIX}{command}-{os.getpid()}-"))
    except BaseException:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    try:
        (staging / MARKER).write_text(_marker_text(), encoding="utf-8")
        try:
            write(staging)
        except Exception as exc:
            raise _refused_write(exc, what, out) from exc
        match_umask(staging)  # model.safetensors is written 0600 by safetensors
        new = sorted(p.name for p in staging.iterdir() if p.name != MARKER)
        check_stale(out, new, what)  # before any file of --out changes
        # config.json last: stopped between two moves (Ctrl-C), --out holds some new files beside the earlier
        # config.json, and reads as the earlier output until the end (--overwrite then runs again)
        for name in sorted(new, key=lambda name: name == "config.json"):
            os.replace(staging / name, out / name)  # a symbolic link is replaced, not written through
    except BaseException:
        if created:  # a failed or interrupted run leaves no --out it created (all in it is ours)
            shutil.rmtree(out, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return new
