"""Claims: verdict words, spread over seeds, ``--strict`` and the fidelity page, on constructed cases."""

from __future__ import annotations

import json

import pytest

from attnkit.analysis import reproduce as reproduce_module
from attnkit.analysis.fidelity import reproduce_all
from attnkit.analysis.report import Claim, ReproduceResult, exceeds, spread
from attnkit.cli import main


def _constructed_target(held: bool):
    def target(result: ReproduceResult, quick: bool, seed: int) -> None:
        result.budget = "constructed"
        result.rows.append({"mechanism": "softmax", "share below -20": 0.1})
        result.claims.append(
            Claim(
                "constructed Fig. 1",
                "most keys are explained away",
                held,
                "share 0.1 (constructed)",
                paper="> 0.5",
                ours="0.1",
            )
        )
        result.claims.append(Claim("constructed Fig. 2", "a claim that holds", True, "always"))

    return target


@pytest.fixture
def constructed_targets(monkeypatch):
    monkeypatch.setitem(reproduce_module.TARGETS, "constructed-fail", _constructed_target(False))
    monkeypatch.setitem(reproduce_module.TARGETS, "constructed-pass", _constructed_target(True))


def test_strict_exits_one_when_a_claim_is_not_held(tmp_path, capsys, constructed_targets):
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "constructed-fail", "--out", str(tmp_path / "a"), "--strict"])
    assert exc.value.code == 1
    printed = capsys.readouterr().out
    assert "not held" in printed and "1 of 2 claims held" in printed
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert [c["verdict"] for c in summary["claims"]] == ["not held", "held"]


@pytest.mark.parametrize("strict", [[], ["--strict"]])
def test_all_exits_two_naming_a_target_that_did_not_run(tmp_path, capsys, monkeypatch, strict):
    """A target that raised inside `reproduce all` exited 0 (its claims counted as one "not held"), and with
    --strict 1, as for any claim not held: no exit code told a crash from a verdict."""
    def broken(result, quick, seed):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(reproduce_module, "TARGETS", {"constructed-pass": _constructed_target(True),
                                                      "broken": broken})
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "all", "--out", str(tmp_path / "all"), "--jobs", "1", *strict])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert "2 of 3 claims held" in out
    assert "error: 1 target(s) did not run (broken)" in err.strip().splitlines()[-1]
    page = (tmp_path / "all" / "fidelity.md").read_text()
    assert "2 of 3 claims held; 2 targets (1 did not run: broken)" in page
    assert "RuntimeError: out of memory" in page


def test_without_strict_a_failed_claim_still_exits_zero(tmp_path, capsys, constructed_targets):
    main(["reproduce", "constructed-fail", "--out", str(tmp_path / "a")])
    assert "not held" in capsys.readouterr().out


def test_strict_passes_when_every_claim_holds(tmp_path, capsys, constructed_targets):
    main(["reproduce", "constructed-pass", "--out", str(tmp_path / "a"), "--strict"])
    assert "2 of 2 claims held" in capsys.readouterr().out


def test_fidelity_page_lists_every_claim_with_its_verdict(tmp_path, constructed_targets):
    results, page = reproduce_all(tmp_path / "all", targets=["constructed-fail", "constructed-pass"])
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and text.count("<b>not held</b>") == 1
    assert text.count("<b>held</b>") == 3 and "most keys are explained away" in text and "&gt; 0.5" in text
    assert [r.name for r in results] == ["constructed-fail", "constructed-pass"]
    entry = json.loads((tmp_path / "all" / "fidelity.json").read_text())[0]
    assert entry["claims"][0]["verdict"] == "not held"
    assert (entry["seed"], entry["quick"]) == (0, False) and entry["attnkit"]  # what the numbers depend on
    markdown = (tmp_path / "all" / "fidelity.md").read_text()
    assert "3 of 4 claims held" in markdown and markdown.count("**not held**") == 1


def test_fidelity_rejects_unknown_targets(tmp_path):
    with pytest.raises(ValueError, match="unknown reproduction targets"):
        reproduce_all(tmp_path / "all", targets=["figure-9"])


def test_spread_reports_mean_std_and_count():
    assert spread([1.0, 2.0, 3.0]) == "2 +- 1 (n=3)"
    assert spread([0.5]) == "0.5 (1 seed)"
    with pytest.raises(ValueError):
        spread([])


def test_claim_rejects_unknown_criterion():
    with pytest.raises(ValueError, match="criterion"):
        Claim("s", "t", True, "e", criterion="lenient")


def test_rebuild_reads_the_summaries_back(tmp_path, constructed_targets):
    from attnkit.analysis.fidelity import rebuild_fidelity

    reproduce_all(tmp_path / "all", targets=["constructed-fail", "constructed-pass"])
    (tmp_path / "all" / "fidelity.html").unlink()
    page = rebuild_fidelity(tmp_path / "all")
    assert page.read_text().count("<b>not held</b>") == 1


def test_rebuild_without_results_is_a_clear_error(tmp_path):
    from attnkit.analysis.fidelity import rebuild_fidelity

    with pytest.raises(FileNotFoundError, match="reproduce all"):
        rebuild_fidelity(tmp_path, quick=True)


def test_quick_page_says_quick_and_lists_budgets_and_cpu_time(tmp_path, constructed_targets):
    from attnkit.analysis.fidelity import QUICK_NOTICE

    _, page = reproduce_all(tmp_path / "q", targets=["constructed-fail"], quick=True)
    text = page.read_text()
    assert "a smoke test at budgets far below the full" in text and "Budgets and time" in text
    assert "s CPU" in text and "constructed" in text
    markdown = (tmp_path / "q" / "fidelity.md").read_text()
    assert markdown.startswith("Quick budgets") and QUICK_NOTICE in markdown
    assert "| target | budget | wall s | CPU s | claims held |" in markdown and "| 1 of 2 |" in markdown
    _, full = reproduce_all(tmp_path / "f", targets=["constructed-pass"], quick=False)
    assert "smoke test" not in full.read_text()
    assert (tmp_path / "f" / "fidelity.md").read_text().startswith("Full budgets")


def test_a_target_note_reaches_the_page(tmp_path, monkeypatch):
    def noted(result: ReproduceResult, quick: bool, seed: int) -> None:
        result.note = "below the smallest meaningful budget"
        result.claims.append(Claim("s", "t", False, "e"))

    monkeypatch.setitem(reproduce_module.TARGETS, "noted", noted)
    _, page = reproduce_all(tmp_path / "n", targets=["noted"], quick=True)
    assert "<b>below the smallest meaningful budget</b>" in page.read_text()
    assert json.loads((tmp_path / "n" / "noted" / "summary.json").read_text())["note"].startswith("below")


def test_embedded_plots_are_scaled_down(tmp_path, monkeypatch):
    import base64
    import io
    import re

    from PIL import Image

    from attnkit.analysis.fidelity import EMBED_MAX_WIDTH

    def wide_plot(result: ReproduceResult, quick: bool, seed: int) -> None:
        Image.new("RGB", (2 * EMBED_MAX_WIDTH, 300), (200, 30, 30)).save(result.out / "wide.png")
        result.add_file(result.out / "wide.png")
        result.claims.append(Claim("s", "t", True, "e"))

    monkeypatch.setitem(reproduce_module.TARGETS, "wide", wide_plot)
    _, page = reproduce_all(tmp_path / "w", targets=["wide"])
    data = re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page.read_text()).group(1)
    with Image.open(io.BytesIO(base64.b64decode(data))) as image:
        assert image.size == (EMBED_MAX_WIDTH, 150)


@pytest.mark.slow
def test_worker_processes_return_every_target_in_order(tmp_path):
    names = ["lemma1", "mode-collapse-curves"]  # deterministic: every claim holds
    results, page = reproduce_all(tmp_path / "two", targets=names, quick=True, jobs=2)
    assert [r.name for r in results] == names
    assert all(r.all_held and r.cpu_seconds > 0 for r in results)
    assert (tmp_path / "two" / "lemma1" / "summary.json").is_file()
    assert "2 worker processes" in page.read_text()


def test_jobs_must_be_a_non_negative_integer(tmp_path):
    with pytest.raises(ValueError, match="jobs=-1"):
        reproduce_all(tmp_path / "all", targets=["lemma1"], jobs=-1)


def test_default_jobs_leaves_busy_cores_alone(monkeypatch):
    import os

    from attnkit.analysis import fidelity

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 0.0, 0.0))
    assert fidelity.default_jobs(13) == 2 and fidelity.default_jobs(1) == 1
    monkeypatch.setattr(os, "getloadavg", lambda: (3.5, 0.0, 0.0))
    assert fidelity.default_jobs(13) == 1


def test_quick_page_embeds_at_most_two_plots_per_target(tmp_path, monkeypatch):
    from PIL import Image

    from attnkit.analysis.fidelity import QUICK_PLOTS_PER_TARGET

    def plots(result: ReproduceResult, quick: bool, seed: int) -> None:
        for i in range(QUICK_PLOTS_PER_TARGET + 2):
            Image.new("RGB", (60, 40), (10 * i, 0, 0)).save(result.out / f"plot{i}.png")
            result.add_file(result.out / f"plot{i}.png")
        result.claims.append(Claim("s", "t", True, "e"))

    monkeypatch.setitem(reproduce_module.TARGETS, "plots", plots)
    _, quick = reproduce_all(tmp_path / "q", targets=["plots"], quick=True)
    text = quick.read_text()
    assert text.count("<img") == QUICK_PLOTS_PER_TARGET and "Not embedded in the quick page" in text
    _, full = reproduce_all(tmp_path / "f", targets=["plots"], quick=False)
    assert full.read_text().count("<img") == QUICK_PLOTS_PER_TARGET + 2


def test_a_gap_within_two_standard_errors_is_no_win():
    """coda-cross said "held" for "CoDA outperforms" with a gap of +0.0006 inside 2 s.e. = 0.0505."""
    held, words = exceeds([0.80, 0.85, 0.83], [0.82, 0.84, 0.815])
    assert not held and "within 2 s.e." in words
    held, words = exceeds([0.90, 0.91, 0.92], [0.80, 0.81, 0.79])
    assert held and "beyond 2 s.e." in words and "gap +0.1100" in words
    held, words = exceeds([0.9], [0.8])  # one seed: no spread to tell the gap from seed noise, said so
    assert not held and "1 seed" in words and "gap +0.1000" in words
    assert not exceeds([0.8, 0.8], [0.8, 0.8])[0]
    held, words = exceeds([0.787, 0.787], [0.786, 0.786])  # was "beyond 2 s.e. = 0.0000"
    assert not held and "no spread" in words
    with pytest.raises(ValueError, match="at least one value"):
        exceeds([], [0.1])


def test_rows_that_add_their_own_columns_are_printed_and_written_whole(tmp_path, capsys, monkeypatch):
    """mode-collapse-2d's sweep rows hold one value per mechanism; the table took the first row's keys and
    printed them blank."""
    def target(result: ReproduceResult, quick: bool, seed: int) -> None:
        result.rows.append({"case": "unbalanced", "mechanism": "softmax", "clusters": 1})
        result.rows.append({"case": "sweep, scale 1", "softmax": "0.1", "dnas": "0.1-1"})
        result.claims.append(Claim("constructed", "a claim", True, "always"))

    monkeypatch.setitem(reproduce_module.TARGETS, "constructed-rows", target)
    main(["reproduce", "constructed-rows", "--out", str(tmp_path / "a")])
    printed = capsys.readouterr().out
    assert "0.1-1" in printed and "dnas" in printed
    from attnkit.analysis.report import table_columns, write_csv

    rows = [{"a": 1}, {"b": 2, "a": 3}]
    assert table_columns(rows) == ["a", "b"]
    assert write_csv(tmp_path / "t.csv", rows).read_text().splitlines() == ["a,b", "1,", "3,2"]


def _ascii_locale(monkeypatch):
    """Files opened without an encoding get the locale's: make it ASCII (LC_ALL=C without UTF-8 mode)."""
    import io

    real = io.text_encoding
    monkeypatch.setattr(io, "text_encoding", lambda encoding, stacklevel=2: real(encoding or "ascii"))


def test_fidelity_page_markdown_and_csv_are_utf8_whatever_the_locale(tmp_path, monkeypatch):
    """Under LC_ALL=C, `reproduce all` failed at its very end with UnicodeEncodeError on "±"."""
    from attnkit.analysis.report import write_csv

    def unicode_target(result: ReproduceResult, quick: bool, seed: int) -> None:
        result.rows.append({"mechanism": "softmax", "Σ_i π_ij": "0.5 ± 0.1"})
        result.claims.append(Claim("Fig. 1 (π)", "weights sum to 1 ± 1e-6", True, "max |Σ − 1| = 0",
                                   paper="1 ± 0", ours="1 ± 0"))

    monkeypatch.setitem(reproduce_module.TARGETS, "unicode", unicode_target)
    _ascii_locale(monkeypatch)
    results, page = reproduce_all(tmp_path / "u", targets=["unicode"])
    assert "weights sum to 1 ± 1e-6" in page.read_bytes().decode("utf-8")
    assert "| 1 ± 0 |" in (tmp_path / "u" / "fidelity.md").read_bytes().decode("utf-8")
    assert "Σ_i π_ij" in json.loads((tmp_path / "u" / "unicode" / "summary.json").read_bytes())["rows"][0]
    table = write_csv(tmp_path / "u" / "table.csv", results[0].rows)
    assert "0.5 ± 0.1" in table.read_bytes().decode("utf-8")


def test_not_applicable_cells_are_a_dash_on_the_page_and_nan_in_the_csv(tmp_path, monkeypatch):
    """The fidelity page showed "nan" where the terminal table shows "-"; a rebuilt page did too."""
    import math

    from attnkit.analysis.fidelity import rebuild_fidelity
    from attnkit.analysis.report import format_value, write_csv

    def with_nan(result: ReproduceResult, quick: bool, seed: int) -> None:
        result.rows.append({"mechanism": "softmax", "u": math.nan, "loss": 0.25})
        result.claims.append(Claim("s", "t", True, "e"))
        result.add_file(write_csv(result.out / "table.csv", result.rows))

    monkeypatch.setitem(reproduce_module.TARGETS, "with-nan", with_nan)
    assert format_value(math.nan) == "-" and format_value(0.25) == "0.25" and format_value(math.inf) == "inf"
    _, page = reproduce_all(tmp_path / "n", targets=["with-nan"])
    assert "<td>softmax</td><td>-</td><td>0.25</td>" in page.read_text(encoding="utf-8")
    assert "<td>nan</td>" not in page.read_text(encoding="utf-8")
    page.unlink()
    rebuilt = rebuild_fidelity(tmp_path / "n", quick=False).read_text(encoding="utf-8")
    assert "<td>softmax</td><td>-</td><td>0.25</td>" in rebuilt and "<td>nan</td>" not in rebuilt
    assert (tmp_path / "n" / "with-nan" / "table.csv").read_text().splitlines()[1] == "softmax,nan,0.25"


def test_fidelity_tables_scroll_inside_the_page_on_a_narrow_window(tmp_path, constructed_targets):
    """At 400 px the claims tables ran past the right edge: no scrolling box, no side padding."""
    import re

    from attnkit.analysis.fidelity import _STYLE

    _, page = reproduce_all(tmp_path / "all", targets=["constructed-fail", "constructed-pass"])
    text = page.read_text(encoding="utf-8")
    tables = text.count("<table")
    assert tables == 4 and text.count("<div class='wide'><table") == tables  # claims, budgets, two targets
    assert text.count("</table></div>") == tables
    wide = re.search(r"\.wide \{([^}]*)\}", _STYLE).group(1)
    body = re.search(r"body \{([^}]*)\}", _STYLE).group(1)
    assert "overflow-x: auto" in wide and "padding: 0 1em" in body and "overflow-wrap: break-word" in body


def test_a_target_raising_any_error_is_one_failed_claim_and_the_others_run(tmp_path, monkeypatch,
                                                                            constructed_targets):
    """A KeyError in one target stopped the whole run: no page, and the other targets never ran."""
    def broken(result, quick, seed):
        raise KeyError("some missing column")

    monkeypatch.setitem(reproduce_module.TARGETS, "broken", broken)
    results, page = reproduce_all(tmp_path / "all", targets=["broken", "constructed-pass"])
    (failed,), _ = results[0].claims, results[1]
    assert failed.statement == "the target ran" and not failed.held
    assert "KeyError: 'some missing column' (at test_claims.py:" in failed.evidence
    assert [c.held for c in results[1].claims] == [True, True] and page.is_file()
    # the Markdown table (no evidence column) says why too
    assert "KeyError: 'some missing column'" in (tmp_path / "all" / "fidelity.md").read_text(encoding="utf-8")


def test_a_worker_that_dies_fails_only_its_own_target(tmp_path, monkeypatch):
    """With --jobs 2, one target killing its worker failed every target (BrokenProcessPool on each)."""
    import os
    from pathlib import Path

    helpers = Path(__file__).parent / "_dying"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(helpers), os.environ.get("PYTHONPATH", "")]))
    import importlib.util

    spec = importlib.util.spec_from_file_location("_dying_targets", helpers / "sitecustomize.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))  # here too: the names must be known
    try:
        results, _ = reproduce_all(tmp_path / "all", targets=["dies", "fine-a", "fine-b"], jobs=2)
    finally:
        for name in ("dies", "fine-a", "fine-b"):
            reproduce_module.TARGETS.pop(name, None)
    verdicts = {r.name: [(c.statement, c.held) for c in r.claims] for r in results}
    assert verdicts["fine-a"] == verdicts["fine-b"] == [("a claim that holds", True)]
    assert verdicts["dies"] == [("the target ran", False)]
    assert "worker process died" in results[0].claims[0].evidence
    # the page says which targets ran again alone (the wall time counts those reruns)
    entries = {e["name"]: e for e in json.loads((tmp_path / "all" / "fidelity.json").read_text())}
    assert entries["dies"]["rerun_alone"] is True
    page = (tmp_path / "all" / "fidelity.md").read_text()
    rerun = [n for n, e in entries.items() if e["rerun_alone"]]
    assert f"A worker process died; {', '.join(rerun)} (the targets it stopped) ran again" in page


def test_the_targets_other_workers_finished_before_a_stop_are_the_runs_own(tmp_path, monkeypatch):
    """With --jobs 2, a target that finished while an earlier-submitted one was still running was not recorded
    when Ctrl-C came, and the next run refused its results as "not written by it"."""
    import os
    from pathlib import Path

    helpers = Path(__file__).parent / "_dying"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(helpers), os.environ.get("PYTHONPATH", "")]))
    import importlib.util

    spec = importlib.util.spec_from_file_location("_dying_targets", helpers / "sitecustomize.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    try:
        monkeypatch.setenv("STOP_SLOW", "1")
        with pytest.raises(KeyboardInterrupt):
            reproduce_all(tmp_path / "all", targets=["slow-stops", "fine-a"], jobs=2)
        assert (tmp_path / "all" / "fine-a" / "summary.json").is_file()
        monkeypatch.setenv("STOP_SLOW", "0")
        results, _ = reproduce_all(tmp_path / "all", targets=["slow-stops", "fine-a"], jobs=2)
    finally:
        for name in ("dies", "slow-stops", "fine-a", "fine-b"):
            reproduce_module.TARGETS.pop(name, None)
    assert all(c.held for r in results for c in r.claims)


def _run_all_of_slow_targets(tmp_path, monkeypatch):
    """``reproduce_all`` of four sleeping targets, jobs=2, in a process group of its own (as a terminal
    starts a command), once two targets have started; returns the process and the output folder."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    helpers = Path(__file__).parent / "_slow"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(helpers), os.environ.get("PYTHONPATH", "")]))
    root = tmp_path / "all"
    code = ("from attnkit.analysis.fidelity import reproduce_all\n"
            f"reproduce_all({str(root)!r}, targets=['sleeps-a', 'sleeps-b', 'sleeps-c', 'sleeps-d'], jobs=2)")
    process = subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while len(list(root.rglob("started"))) < 2:
        assert time.monotonic() < deadline and process.poll() is None, "the two first targets never started"
        time.sleep(0.2)
    return process, root


def _group_alive(pgid: int) -> bool:
    import os
    import time

    for _ in range(50):  # the workers notice within a second
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.2)
    return True


def test_ctrl_c_stops_a_run_of_all_targets_with_workers_at_once(tmp_path, monkeypatch):
    """Ctrl-C with --jobs 2 stopped nothing: each worker took the interrupt as its target's error and went on
    to the next queued target, and the main process waited for every one of them (22 s, then no page)."""
    import os
    import signal
    import subprocess

    process, root = _run_all_of_slow_targets(tmp_path, monkeypatch)
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole group
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError("the run went on after Ctrl-C")
    started = sorted(p.parent.parent.name for p in root.rglob("started"))  # in each staging folder
    assert len(started) == 2  # the queued targets never started
    assert not _group_alive(process.pid)


def test_the_workers_of_a_killed_run_of_all_targets_exit(tmp_path, monkeypatch):
    """With the main process killed, the workers ran on, orphaned, into the folders (and started queued
    targets), where the next run would be removing and remaking them."""
    import os
    import signal

    process, root = _run_all_of_slow_targets(tmp_path, monkeypatch)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    try:
        assert not _group_alive(process.pid)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_folder_finished_by_hand_inside_an_interrupted_run_of_all_is_kept(tmp_path, monkeypatch,
                                                                             constructed_targets):
    """A target run alone into a folder of an interrupted run of all targets was listed in that run's mark,
    and the next run of all removed it (the user's finished run) without --overwrite."""
    def interrupted(result, quick, seed):
        raise KeyboardInterrupt

    monkeypatch.setitem(reproduce_module.TARGETS, "interrupted", interrupted)
    root = tmp_path / "all"
    with pytest.raises(KeyboardInterrupt):
        reproduce_all(root, targets=["constructed-pass", "interrupted"])
    assert (root / "constructed-pass" / "summary.json").is_file()
    reproduce_module.reproduce("constructed-fail", root / "mine", seed=3)  # the user's own run, finished
    results, _ = reproduce_all(root, targets=["constructed-pass", "constructed-fail"])
    assert json.loads((root / "mine" / "summary.json").read_text())["name"] == "constructed-fail"
    assert [c.held for c in results[0].claims] == [True, True]  # the interrupted run's folders replaced


def test_a_target_rerun_alone_in_its_folder_of_an_interrupted_run_of_all_asks_for_overwrite(
        tmp_path, monkeypatch, constructed_targets):
    """The user finished the interrupted target by hand in its own folder (seed 5); the next run of all,
    without --overwrite, deleted those results as the interrupted run's and wrote seed 0 in their place."""
    monkeypatch.setitem(reproduce_module.TARGETS, "stops", _writes_then_stops)
    root = tmp_path / "all"
    with pytest.raises(KeyboardInterrupt):
        reproduce_all(root, targets=["constructed-pass", "stops"])
    monkeypatch.setitem(reproduce_module.TARGETS, "stops", _constructed_target(True))
    reproduce_module.reproduce("stops", root / "stops", seed=5)  # the folder holds only the staging folder
    mine = (root / "stops" / "summary.json").read_bytes()
    with pytest.raises(FileExistsError, match=r"results in stops that it did not write .*--overwrite"):
        reproduce_all(root, targets=["constructed-pass", "stops"])
    assert (root / "stops" / "summary.json").read_bytes() == mine
    assert (root / "constructed-pass" / "summary.json").is_file()  # the interrupted run's, not yet removed
    results, _ = reproduce_all(root, targets=["constructed-pass", "stops"], overwrite=True)
    assert json.loads((root / "stops" / "summary.json").read_text())["seed"] == 0


def test_a_mark_of_an_older_version_without_digests_takes_its_folders_as_its_own(tmp_path,
                                                                                  constructed_targets):
    """A mark written before the digests were recorded made every finished folder "saved since"."""
    from attnkit.analysis.report import UNFINISHED_MARKER

    root = tmp_path / "all"
    reproduce_module.reproduce("constructed-pass", root / "constructed-pass", seed=4)
    old_mark = 'attnkit: this run did not finish\n{"written": ["constructed-pass"]}\n'  # no "finished"
    (root / UNFINISHED_MARKER).write_text(old_mark)
    reproduce_all(root, targets=["constructed-pass"])
    assert json.loads((root / "constructed-pass" / "summary.json").read_text())["seed"] == 0


def test_the_targets_an_interrupted_run_of_all_finished_are_replaced_without_overwrite(
        tmp_path, monkeypatch, constructed_targets):
    monkeypatch.setitem(reproduce_module.TARGETS, "stops", _writes_then_stops)
    root = tmp_path / "all"
    with pytest.raises(KeyboardInterrupt):
        reproduce_all(root, targets=["constructed-pass", "stops"], seed=4)
    assert json.loads((root / "constructed-pass" / "summary.json").read_text())["seed"] == 4
    monkeypatch.setitem(reproduce_module.TARGETS, "stops", _constructed_target(True))
    reproduce_all(root, targets=["constructed-pass", "stops"])  # its own finished results: no --overwrite
    assert json.loads((root / "constructed-pass" / "summary.json").read_text())["seed"] == 0


def test_a_summary_records_the_seed_and_budget_its_numbers_depend_on(tmp_path, constructed_targets):
    """summary.json held neither --seed nor --quick: two runs' numbers differed with nothing to say why."""
    from attnkit.analysis.fidelity import load_result

    reproduce_module.reproduce("constructed-pass", tmp_path / "a", seed=5, quick=True)
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["seed"] == 5 and summary["quick"] is True and summary["attnkit"]
    loaded = load_result(tmp_path / "a")
    assert (loaded.seed, loaded.quick) == (5, True)


def test_a_users_file_in_a_target_folder_survives_an_interrupted_overwrite_and_the_next_run(
        tmp_path, monkeypatch, constructed_targets):
    """After an interrupted ``reproduce all --overwrite``, the next run removed the target folders that run
    was replacing, the user's files in them included (--overwrite itself keeps them)."""
    def interrupted(result, quick, seed):
        raise KeyboardInterrupt

    monkeypatch.setitem(reproduce_module.TARGETS, "interrupted", interrupted)
    root = tmp_path / "all"
    reproduce_all(root, targets=["constructed-pass"])
    (root / "constructed-pass" / "my_notes.txt").write_text("mine")
    with pytest.raises(KeyboardInterrupt):
        reproduce_all(root, targets=["constructed-pass", "interrupted"], overwrite=True)
    results, _ = reproduce_all(root, targets=["constructed-pass"])  # replaced again without --overwrite
    assert (root / "constructed-pass" / "my_notes.txt").read_text() == "mine"
    assert all(c.held for c in results[0].claims)


def test_rebuilt_page_says_the_budgets_and_seed_its_summaries_record(tmp_path, constructed_targets):
    """A rebuild labelled the page from its arguments: quick summaries became "Full budgets, first seed 7",
    and fidelity.json kept the old run's claims."""
    from attnkit.analysis.fidelity import rebuild_fidelity

    root = tmp_path / "all"
    reproduce_all(root, targets=["constructed-fail", "constructed-pass"], quick=True, seed=3)
    summary = json.loads((root / "constructed-fail" / "summary.json").read_text())
    summary["claims"][0]["held"] = True  # the page, the Markdown and the JSON must all show it
    (root / "constructed-fail" / "summary.json").write_text(json.dumps(summary))
    (root / "fidelity.json").unlink()
    page = rebuild_fidelity(root)
    assert "Quick budgets, first seed 3" in page.read_text(encoding="utf-8")
    assert (root / "fidelity.md").read_text(encoding="utf-8").startswith("Quick budgets, first seed 3")
    entries = json.loads((root / "fidelity.json").read_text())
    assert [(e["name"], e["quick"], e["seed"]) for e in entries] == [
        ("constructed-fail", True, 3), ("constructed-pass", True, 3)]
    assert all(c["held"] for e in entries for c in e["claims"])
    with pytest.raises(ValueError, match="quick=False but the summaries .* record quick=True"):
        rebuild_fidelity(root, quick=False)
    with pytest.raises(ValueError, match="seed=7 but the summaries .* record seed=3"):
        rebuild_fidelity(root, seed=7)


@pytest.mark.parametrize("key, other", [("quick", False), ("seed", 4)])
def test_rebuild_refuses_summaries_of_different_runs_and_names_the_targets(tmp_path, constructed_targets,
                                                                           key, other):
    from attnkit.analysis.fidelity import rebuild_fidelity

    root = tmp_path / "all"
    reproduce_all(root, targets=["constructed-fail", "constructed-pass"], quick=True, seed=3)
    path = root / "constructed-pass" / "summary.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), key: other}))
    with pytest.raises(ValueError, match=f"mix runs .*{key}=.*constructed-fail.*{key}=.*constructed-pass"):
        rebuild_fidelity(root)


@pytest.mark.parametrize("key, value", [("quick", "false"), ("quick", 1), ("seed", 2.7), ("seed", -1)])
def test_a_summary_recording_a_quick_or_seed_of_another_type_is_refused(tmp_path, constructed_targets, key,
                                                                         value):
    """A summary.json is not trusted: "false" became quick (True) and 2.7 seed 2 on the rebuilt page."""
    from attnkit.analysis.fidelity import rebuild_fidelity

    root = tmp_path / "all"
    reproduce_all(root, targets=["constructed-pass"], quick=True, seed=3)
    path = root / "constructed-pass" / "summary.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), key: value}))
    with pytest.raises(ValueError, match=f"constructed-pass's summary.json records {key}"):
        rebuild_fidelity(root)


@pytest.mark.parametrize("name", ["/etc/private.png", "../outside.png", "sub/plot.png", "..", ""])
def test_a_summary_listing_files_outside_its_folder_is_refused(tmp_path, constructed_targets, name):
    """load_result built ``folder / f`` unchecked: an absolute or ``../`` path embedded any image."""
    from attnkit.analysis.fidelity import load_result, rebuild_fidelity

    root = tmp_path / "all"
    reproduce_all(root, targets=["constructed-pass"])
    path = root / "constructed-pass" / "summary.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "files": ["summary.json", name]}))
    with pytest.raises(ValueError, match=r"constructed-pass.summary\.json.*plain file names") as error:
        rebuild_fidelity(root)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="plain file names"):
        load_result(root / "constructed-pass")


def test_reproduce_all_refuses_a_quick_that_is_not_a_bool(tmp_path):
    with pytest.raises(ValueError, match="quick='no'"):
        reproduce_all(tmp_path / "all", quick="no", targets=["lemma1"])
    assert not (tmp_path / "all").exists()


def _writes_then_stops(result, quick, seed):
    """A target that writes one result file and is interrupted (Ctrl-C) before it finishes."""
    (result.out / "curve.csv").write_text("x,y\n1,2\n")
    result.add_file(result.out / "curve.csv")
    (result.out / "half.png").write_text("half a savefig")  # not listed yet: savefig was under way
    raise KeyboardInterrupt


def test_an_interrupted_overwrite_leaves_the_earlier_results_whole(tmp_path, monkeypatch,
                                                                   constructed_targets):
    """The new run wrote into the folder directly: after Ctrl-C some files were the new run's, the rest and
    the summary.json the earlier run's (a folder that read as the earlier result, with the new numbers)."""
    from attnkit.analysis.fidelity import load_result

    out = tmp_path / "run"
    reproduce_module.reproduce("constructed-pass", out, seed=3)
    (out / "curve.csv").write_text("the earlier run's curve")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setitem(reproduce_module.TARGETS, "stops", _writes_then_stops)
    with pytest.raises(KeyboardInterrupt):
        reproduce_module.reproduce("stops", out, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir() if not p.name.startswith(".attnkit-")} == before
    assert load_result(out).seed == 3
    with pytest.raises(FileExistsError, match="finished results of 'constructed-pass'"):
        reproduce_module.reproduce("constructed-fail", out)  # the earlier results are finished ones
    assert load_result(out).seed == 3
    reproduce_module.reproduce("constructed-fail", out, overwrite=True)  # the unfinished run's files go too
    assert not any(p.name.startswith(".attnkit-") for p in out.iterdir())
    assert json.loads((out / "summary.json").read_text())["name"] == "constructed-fail"
    assert not (out / "half.png").exists()


def test_a_failed_run_releases_its_folder_for_the_same_session(tmp_path, monkeypatch):
    """Only a finished run released its lock: after a target raised, a second call (a notebook's next cell,
    or the command line meanwhile) was refused as "in use by another attnkit reproduce process"."""
    def fails(result, quick, seed):
        raise RuntimeError("a target's own error")

    monkeypatch.setitem(reproduce_module.TARGETS, "fails", fails)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError):
        reproduce_module.reproduce("fails", out)
    from attnkit.analysis.report import _LOCKS

    assert str(out.resolve()) not in _LOCKS
    from attnkit.analysis.fidelity import reproduce_all as run_all

    with pytest.raises(KeyboardInterrupt):
        monkeypatch.setitem(reproduce_module.TARGETS, "stops", _writes_then_stops)
        run_all(tmp_path / "all", targets=["stops"])
    assert str((tmp_path / "all").resolve()) not in _LOCKS


def test_a_file_saved_in_a_target_folder_of_an_interrupted_run_of_all_stays(tmp_path, monkeypatch,
                                                                             constructed_targets):
    """The next run removed the interrupted run's target folders whole, a file the user saved in one since
    included (without --overwrite)."""
    monkeypatch.setitem(reproduce_module.TARGETS, "stops", _writes_then_stops)
    root = tmp_path / "all"
    with pytest.raises(KeyboardInterrupt):
        reproduce_all(root, targets=["constructed-pass", "stops"])
    (root / "constructed-pass" / "my_analysis.txt").write_text("mine")
    (root / "stops" / "notes.txt").write_text("mine too")
    monkeypatch.setitem(reproduce_module.TARGETS, "stops", _constructed_target(True))
    results, _ = reproduce_all(root, targets=["constructed-pass", "stops"])
    assert all(c.held for r in results for c in r.claims)
    assert (root / "constructed-pass" / "my_analysis.txt").read_text() == "mine"
    assert (root / "stops" / "notes.txt").read_text() == "mine too"
    assert not (root / "stops" / "curve.csv").exists()  # the interrupted run's: never moved in


def test_a_rebuilt_page_shows_an_unfinished_target_as_failed_and_trusts_no_field(tmp_path, monkeypatch,
                                                                                  constructed_targets):
    """A target whose latest run did not finish came back "held" from its earlier summary, and a summary's
    "held": "false" read as held."""
    from attnkit.analysis.fidelity import rebuild_fidelity
    from attnkit.analysis.report import UNFINISHED_MARKER

    root = tmp_path / "all"
    reproduce_all(root, targets=["constructed-pass"], quick=True)
    monkeypatch.setitem(reproduce_module.TARGETS, "constructed-pass", _writes_then_stops)
    with pytest.raises(KeyboardInterrupt):
        reproduce_module.reproduce("constructed-pass", root / "constructed-pass", overwrite=True)
    assert (root / "constructed-pass" / UNFINISHED_MARKER).is_file()
    rebuild_fidelity(root)
    entries = json.loads((root / "fidelity.json").read_text())
    assert [c["held"] for c in entries[0]["claims"]] == [False]
    assert "did not finish" in entries[0]["claims"][0]["evidence"]
    (root / "constructed-pass" / UNFINISHED_MARKER).unlink()
    summary = json.loads((root / "constructed-pass" / "summary.json").read_text())
    summary["claims"][0]["held"] = "false"
    (root / "constructed-pass" / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ValueError, match="held is 'false'; expected true or false"):
        rebuild_fidelity(root)
    (root / UNFINISHED_MARKER).write_text("")
    with pytest.raises(ValueError, match="did not finish, so its summaries mix runs"):
        rebuild_fidelity(root)


def test_a_mark_or_summary_listing_files_no_target_writes_deletes_none_of_them(tmp_path, constructed_targets):
    """A folder the user was given (unpacked from an archive) with a hidden mark listing thesis.tex and a
    data folder: the next run removed both without a word, and --overwrite removed a summary's thesis.tex."""
    from attnkit.analysis.report import UNFINISHED_MARKER

    out = tmp_path / "given"
    (out / "my_data").mkdir(parents=True)
    (out / "my_data" / "table.dat").write_text("data")
    (out / "thesis.tex").write_text("chapter 1")
    (out / UNFINISHED_MARKER).write_text('attnkit\n{"written": ["my_data", "thesis.tex"]}\n')
    reproduce_module.reproduce("constructed-pass", out)
    assert (out / "thesis.tex").read_text() == "chapter 1" and (out / "my_data" / "table.dat").is_file()
    summary = json.loads((out / "summary.json").read_text())
    summary["files"] = ["thesis.tex"]
    (out / "summary.json").write_text(json.dumps(summary))
    reproduce_module.reproduce("constructed-fail", out, overwrite=True)
    assert (out / "thesis.tex").read_text() == "chapter 1"


def test_a_refused_call_holds_no_lock_on_the_folder(tmp_path, constructed_targets):
    """prepare_output_dir took the lock before refusing a non-empty folder: the session kept it, and another
    process was told the folder was in use."""
    from attnkit.analysis.report import _LOCKS

    out = tmp_path / "full"
    out.mkdir()
    (out / "mine.txt").write_text("the user's")
    with pytest.raises(FileExistsError):
        reproduce_module.reproduce("constructed-pass", out)
    with pytest.raises(FileExistsError):
        reproduce_all(out, targets=["constructed-pass"])
    assert str(out.resolve()) not in _LOCKS


def test_a_rebuilt_page_lists_a_target_that_never_finished(tmp_path, monkeypatch, constructed_targets):
    """A target that failed on its first run left no summary.json, and the rebuilt page left it out: every
    claim on it held."""
    from attnkit.analysis.fidelity import rebuild_fidelity

    def broken(result, quick, seed):
        raise KeyboardInterrupt

    monkeypatch.setitem(reproduce_module.TARGETS, "broken", broken)
    with pytest.raises(KeyboardInterrupt):
        reproduce_all(tmp_path / "all", targets=["constructed-pass", "broken"])
    (tmp_path / "all" / ".attnkit-unfinished").unlink()  # the root as if finished: only the target is not
    rebuild_fidelity(tmp_path / "all")
    entries = {e["name"]: e for e in json.loads((tmp_path / "all" / "fidelity.json").read_text())}
    assert [c["held"] for c in entries["broken"]["claims"]] == [False]
    import shutil

    shutil.rmtree(tmp_path / "all" / "constructed-pass")  # only the unfinished target's folder is left
    with pytest.raises(ValueError, match="no target under .* finished .*pass quick= and seed="):
        rebuild_fidelity(tmp_path / "all")  # not "do not record quick", nor "run reproduce all first"
    rebuild_fidelity(tmp_path / "all", quick=False, seed=0)  # a run whose every target failed has a page
    entries = json.loads((tmp_path / "all" / "fidelity.json").read_text())
    assert [e["name"] for e in entries] == ["broken"] and not entries[0]["claims"][0]["held"]
    shutil.rmtree(tmp_path / "all" / "broken")
    with pytest.raises(FileNotFoundError, match="no target ran there"):
        rebuild_fidelity(tmp_path / "all")


def test_an_unfinished_root_names_the_rerun_with_its_budgets(tmp_path, constructed_targets):
    """The advice dropped --quick (and --seed): following it started every target at full budget."""
    from attnkit.analysis.fidelity import rebuild_fidelity
    from attnkit.analysis.report import UNFINISHED_MARKER

    root = tmp_path / "all"
    reproduce_all(root, targets=["constructed-pass"], quick=True, seed=3)
    (root / UNFINISHED_MARKER).write_text("")
    with pytest.raises(ValueError, match=r"'attnkit reproduce all --quick --seed 3 --out .*all'"):
        rebuild_fidelity(root)


def test_a_target_writing_a_folder_overwrites_it_file_by_file(tmp_path, monkeypatch):
    """The second --overwrite run's os.replace of a folder onto the earlier one failed (not empty) after the
    whole run, leaving a mix of both runs."""
    def plots(result, quick, seed):
        (result.out / "plots").mkdir()
        (result.out / "plots" / "a.png").write_text(f"seed {seed}")
        result.add_file(result.out / "plots")

    monkeypatch.setitem(reproduce_module.TARGETS, "plots", plots)
    out = tmp_path / "run"
    reproduce_module.reproduce("plots", out, seed=1)
    (out / "plots" / "mine.txt").write_text("the user's")
    reproduce_module.reproduce("plots", out, seed=2, overwrite=True)
    assert (out / "plots" / "a.png").read_text() == "seed 2"
    assert (out / "plots" / "mine.txt").read_text() == "the user's"
    assert not any(p.name.startswith(".attnkit-") for p in out.iterdir())
