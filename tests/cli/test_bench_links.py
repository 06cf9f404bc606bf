"""``attnkit bench --out`` and symbolic links to nothing: refused in one line, never written through (which
created the link's target folder wherever the link pointed)."""

from __future__ import annotations

import json
import os

import pytest

from attnkit.cli import main
from tests.cli._fixtures import save_during_bench

ARGS = ["bench", "--lengths", "16", "--mechanisms", "dnas", "--backends", "efficient", "--repeats", "1",
        "--no-memory"]


@pytest.mark.parametrize("out, needle", [
    ("dangling.json", "--out dangling.json is a symbolic link to nowhere/missing.json, which does not exist"),
    ("sub/kernels.json", "--out sub/kernels.json lies in sub, a symbolic link to nowhere/deeper"),
])
def test_an_out_through_a_link_to_nothing_is_refused_before_the_run_and_makes_no_folder(
        out, needle, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.symlink("nowhere/missing.json", "dangling.json")
    os.symlink("nowhere/deeper", "sub")
    with pytest.raises(SystemExit) as exc:
        main([*ARGS, "--out", out])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err
    assert "L=" not in err  # nothing was timed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling.json", "sub"]  # no nowhere/


def test_a_link_left_pointing_to_nothing_during_the_run_is_not_written_through(tmp_path, capsys, monkeypatch):
    """The check before the run passed (the link's target existed); the write refuses it and the
    measurements go to stderr."""
    from attnkit import benchmark

    target = tmp_path / "target.json"
    target.write_text("{}")
    out = tmp_path / "kernels.json"
    out.symlink_to(target)
    real = benchmark.run_bench

    def run_then_the_link_is_moved(cfg, log=None):
        result = real(cfg, log)
        out.unlink()
        out.symlink_to(tmp_path / "nowhere" / "missing.json")
        return result

    monkeypatch.setattr(benchmark, "run_bench", run_then_the_link_is_moved)
    with pytest.raises(SystemExit) as exc:
        main([*ARGS, "--out", str(out), "--overwrite"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "is a symbolic link to" in err and "which does not exist" in err
    assert '"rows"' in err  # the measurements, kept from the terminal
    assert not (tmp_path / "nowhere").exists()


def test_the_spare_name_of_a_file_that_appeared_is_never_a_link_to_nothing(tmp_path, capsys, monkeypatch):
    out = tmp_path / "kernels.json"
    (tmp_path / "kernels-1.json").symlink_to(tmp_path / "nowhere" / "missing.json")
    save_during_bench(monkeypatch, out)
    with pytest.raises(SystemExit) as exc:
        main([*ARGS, "--out", str(out)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "the results are in" in err and "kernels-2.json" in err, err
    assert json.loads((tmp_path / "kernels-2.json").read_text())["meta"]["lengths"] == [16]
    assert out.read_text() == '{"user": "precious"}'
    assert not (tmp_path / "nowhere").exists()
