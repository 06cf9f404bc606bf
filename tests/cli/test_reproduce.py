"""``attnkit reproduce NAME``: a target writes its files and claims, refuses to overwrite, names the valid
targets."""

from __future__ import annotations

import json
import os
import re

import pytest

from attnkit.cli import main


def test_cli_mode_collapse_curves_writes_files_and_claims_hold(tmp_path, capsys):
    out = tmp_path / "curves"
    main(["reproduce", "mode-collapse-curves", "--out", str(out), "--quick"])
    printed = capsys.readouterr().out
    assert "paper claims" in printed and "NO" not in printed
    names = {p.name for p in out.iterdir()}
    assert {"center_distance.png", "closed_form.csv", "simulated.csv", "summary.json"} <= names
    summary = json.loads((out / "summary.json").read_text())
    assert summary["claims"] and all(c["held"] for c in summary["claims"])


def test_cli_refuses_non_empty_output_dir(tmp_path, capsys):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "lemma1", "--out", str(out), "--quick"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--overwrite" in err and len(err.strip().splitlines()) == 1
    assert (out / "mine.txt").read_text() == "keep me"


def test_cli_unknown_target_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "figure-9"])
    assert exc.value.code == 2
    assert "mode-collapse-curves" in capsys.readouterr().err


def _interrupt(result, quick, seed):
    (result.out / "partial.csv").write_text("half a table\n")
    raise KeyboardInterrupt


def test_an_interrupted_run_does_not_block_the_next_one(tmp_path, capsys, monkeypatch):
    from attnkit.analysis import reproduce as repro
    from attnkit.analysis.report import UNFINISHED_MARKER

    out = tmp_path / "lemma"
    real = repro.TARGETS["lemma1"]
    monkeypatch.setitem(repro.TARGETS, "lemma1", _interrupt)
    with pytest.raises(SystemExit) as exc:  # Ctrl-C: exit code 130 and one word, no traceback
        main(["reproduce", "lemma1", "--out", str(out), "--quick"])
    assert exc.value.code == 130 and capsys.readouterr().err.strip().splitlines()[-1] == "interrupted"
    assert (out / UNFINISHED_MARKER).is_file() and not (out / "summary.json").exists()
    monkeypatch.setitem(repro.TARGETS, "lemma1", real)
    main(["reproduce", "lemma1", "--out", str(out), "--quick"])  # no --overwrite needed: it was ours
    assert "did not finish; replacing its files" in capsys.readouterr().err
    assert (out / "summary.json").is_file() and not (out / UNFINISHED_MARKER).exists()
    with pytest.raises(SystemExit) as exc:  # a finished run is the user's: --overwrite is asked for again
        main(["reproduce", "lemma1", "--out", str(out), "--quick"])
    assert exc.value.code == 2 and "--overwrite" in capsys.readouterr().err


def test_an_interrupted_runs_partial_files_are_removed_and_the_users_kept(tmp_path, capsys, monkeypatch):
    """A killed run's files stayed beside the next run's results, with nothing to tell them apart."""
    from attnkit.analysis import reproduce as repro

    out = tmp_path / "run"
    out.mkdir()
    (out / "mine.txt").write_text("the user's")  # there before: --overwrite let the run in

    def partial(result, quick, seed):
        (result.out / "points.csv").write_text("half written")
        result.add_file(result.out / "points.csv")
        (result.out / "plots").mkdir()
        result.add_file(result.out / "plots")
        raise KeyboardInterrupt

    monkeypatch.setitem(repro.TARGETS, "lemma1-partial", partial)
    with pytest.raises(SystemExit):
        main(["reproduce", "lemma1-partial", "--out", str(out), "--quick", "--overwrite"])
    staged = [p for p in out.iterdir() if p.name.startswith(".attnkit-reproduce-")]
    assert not (out / "points.csv").exists() and not (out / "plots").exists()
    assert sorted(p.name for p in staged[0].iterdir()) == ["plots", "points.csv"]  # in its staging folder
    (out / "thesis_fig2.png").write_text("saved after the kill")  # the user's too: it stays
    main(["reproduce", "lemma1", "--out", str(out), "--quick"])
    assert "did not finish; replacing its files" in capsys.readouterr().err
    assert not (out / "points.csv").exists() and not (out / "plots").exists()
    assert not any(p.name.startswith(".attnkit-") for p in out.iterdir())
    assert (out / "mine.txt").read_text() == "the user's" and (out / "summary.json").is_file()
    assert (out / "thesis_fig2.png").read_text() == "saved after the kill"


def test_an_interrupted_run_of_all_targets_is_replaced_by_the_next(tmp_path, monkeypatch):
    from attnkit.analysis import reproduce as repro
    from attnkit.analysis.fidelity import reproduce_all
    from attnkit.analysis.report import UNFINISHED_MARKER

    root = tmp_path / "all"
    reproduce_all(root, quick=True, targets=["lemma1"])  # lemma1 finished ...
    (root / UNFINISHED_MARKER).write_text("")  # ... and the run was killed in a later target
    monkeypatch.setitem(repro.TARGETS, "mode-collapse-curves", _interrupt)
    with pytest.raises(KeyboardInterrupt):
        reproduce_all(root, quick=True, targets=["lemma1", "mode-collapse-curves"])
    assert (root / UNFINISHED_MARKER).is_file()
    assert (root / "mode-collapse-curves" / UNFINISHED_MARKER).is_file()
    monkeypatch.undo()
    results, page = reproduce_all(root, quick=True, targets=["lemma1", "mode-collapse-curves"])
    assert all(c.held for r in results for c in r.claims) and page.is_file()
    assert not list(root.rglob(UNFINISHED_MARKER))
    with pytest.raises(FileExistsError, match="--overwrite"):
        reproduce_all(root, quick=True, targets=["lemma1"])


def test_cli_empty_out_is_refused_not_taken_as_the_current_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "lemma1", "--out", "", "--quick"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.startswith("error: --out is empty")
    assert list(tmp_path.iterdir()) == []  # it wrote lemma1.csv, lemma1.png, summary.json here


@pytest.mark.parametrize("name", ["lemma1", "all"])
def test_cli_seed_out_of_range_is_refused_before_any_target_runs(name, tmp_path, capsys):
    """Targets seed NumPy with their seed plus offsets of up to 1000; a huge seed failed deep inside one
    ("Overflow when unpacking long long"), and under "all" every target recorded it as a failed claim."""
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", name, "--seed", "4294967295", "--out", str(tmp_path / "out"), "--quick"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == "error: seed=4294967295; expected an integer in [0, 2147483647]\n"
    assert not (tmp_path / "out").exists()


def test_a_second_run_into_a_folder_in_use_is_refused(tmp_path, capsys):
    """A second reproduce into the folder of a running one took its unfinished mark for a killed run's and
    mixed its files with the first's; a folder is now locked while a run writes it."""
    import subprocess
    import sys

    out = tmp_path / "busy"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)"), str(out)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SystemExit) as exc:
            main(["reproduce", "lemma1", "--out", str(out), "--quick", "--overwrite"])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "in use by another attnkit reproduce process" in err
        assert list(out.iterdir()) == []
    finally:
        holder.kill()
        holder.wait()
    main(["reproduce", "lemma1", "--out", str(out), "--quick", "--overwrite"])  # free again
    assert (out / "summary.json").is_file()


def test_jobs_with_a_single_target_is_refused_not_ignored(tmp_path, capsys):
    """``--jobs -5`` with one target ran and exited 0 (the option was never read)."""
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "lemma1", "--quick", "--jobs", "-5", "--out", str(tmp_path / "a")])
    assert exc.value.code == 2 and "--jobs -5 is only used with 'all'" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


def test_a_path_the_system_refuses_is_one_line_not_a_traceback(tmp_path, capsys, monkeypatch):
    """On a read-only file system show, reproduce and convert ended in an OSError traceback."""
    import errno

    from attnkit.analysis import reproduce as repro

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "ro" / "view"))

    monkeypatch.setattr(repro, "reproduce", read_only)
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "lemma1", "--quick", "--out", str(tmp_path / "ro" / "view")])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and "Read-only file system" in err


@pytest.mark.parametrize("name", ["lemma1", "all"])
@pytest.mark.parametrize("below", ["sub", "sub/deeper"])
def test_a_file_above_out_is_named_in_one_line_with_the_fix(name, below, tmp_path, capsys):
    """``--out afile/sub`` printed ``error: [Errno 20] Not a directory: 'afile/sub'``, naming no fix."""
    (tmp_path / "afile").write_text("the user's")
    out = tmp_path / "afile" / below
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", name, "--quick", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1
    assert f"{str(tmp_path / 'afile')!r} is a file" in err and "pass another --out" in err
    assert (tmp_path / "afile").read_text() == "the user's"


def test_overwrite_removes_the_earlier_targets_outputs_and_keeps_the_users_files(tmp_path, capsys):
    """``reproduce A --out <B's folder> --overwrite`` left B's files beside A's (summary.json listed A's)."""
    out = tmp_path / "shared"
    main(["reproduce", "mode-collapse-curves", "--quick", "--out", str(out)])
    earlier = set(json.loads((out / "summary.json").read_text())["files"])
    assert {"center_distance.png", "closed_form.csv"} <= earlier
    (out / "mine.txt").write_text("keep me")  # not listed in the summary: the user's
    (out / "sub").mkdir()
    (out / "sub" / "closed_form.csv").write_text("the user's too")  # a listed name, but not in the folder
    main(["reproduce", "lemma1", "--quick", "--out", str(out), "--overwrite"])
    capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["name"] == "lemma1"
    assert {p.name for p in out.iterdir()} == set(summary["files"]) | {"summary.json", "mine.txt", "sub"}
    assert not earlier & {p.name for p in out.iterdir()} - set(summary["files"])
    assert (out / "mine.txt").read_text() == "keep me"
    assert (out / "sub" / "closed_form.csv").read_text() == "the user's too"


def test_overwrite_leaves_what_a_summary_lists_outside_its_folder(tmp_path, capsys):
    out, outside = tmp_path / "run", tmp_path / "outside.csv"
    out.mkdir()
    outside.write_text("not ours")
    (out / "link.csv").symlink_to(outside)
    listed = ["../outside.csv", str(outside), "link.csv", "", ".", ".."]
    (out / "summary.json").write_text(json.dumps(
        {"name": "lemma1", "attnkit": "0", "seed": 0, "quick": True, "rows": [], "claims": [],
         "files": listed}
    ))
    main(["reproduce", "lemma1", "--quick", "--out", str(out), "--overwrite"])
    capsys.readouterr()
    assert outside.read_text() == "not ours" and (out / "link.csv").is_symlink()
    assert json.loads((out / "summary.json").read_text())["files"] != listed


def test_overwrite_keeps_the_files_a_summary_json_of_another_program_lists(tmp_path, capsys):
    """A ``summary.json`` with a name and a file list, not a reproduction's, had its files removed."""
    out = tmp_path / "sweep"
    out.mkdir()
    for name in ("results.csv", "notes.txt"):
        (out / name).write_text("the user's")
    (out / "summary.json").write_text(json.dumps({"name": "my sweep", "files": ["results.csv", "notes.txt"]}))
    main(["reproduce", "lemma1", "--quick", "--out", str(out), "--overwrite"])
    capsys.readouterr()
    assert [(out / name).read_text() for name in ("results.csv", "notes.txt")] == ["the user's"] * 2


def test_an_interrupted_overwrite_keeps_the_earlier_results_it_did_not_replace(tmp_path, capsys, monkeypatch):
    """``--overwrite`` removed the earlier run's files before its target ran: a Ctrl-C lost them all."""
    from attnkit.analysis import reproduce as repro

    out = tmp_path / "run"
    main(["reproduce", "mode-collapse-curves", "--quick", "--out", str(out)])
    earlier = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setitem(repro.TARGETS, "lemma1", _interrupt)
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "lemma1", "--quick", "--out", str(out), "--overwrite"])
    assert exc.value.code == 130
    capsys.readouterr()
    assert {name: (out / name).read_bytes() for name in earlier} == earlier


def test_an_interrupted_overwrite_of_all_targets_leaves_the_earlier_page_named_as_earlier(tmp_path,
                                                                                         monkeypatch):
    """The earlier run's page stayed as fidelity.html beside target folders the stopped run had replaced,
    its numbers no longer those of the folders."""
    from attnkit.analysis import reproduce as repro
    from attnkit.analysis.fidelity import reproduce_all

    root = tmp_path / "all"
    reproduce_all(root, quick=True, targets=["lemma1"])
    earlier = (root / "fidelity.md").read_bytes()
    monkeypatch.setitem(repro.TARGETS, "mode-collapse-curves", _interrupt)
    with pytest.raises(KeyboardInterrupt):
        reproduce_all(root, quick=True, targets=["lemma1", "mode-collapse-curves"], overwrite=True)
    assert not any((root / f"fidelity.{ext}").exists() for ext in ("html", "md", "json"))
    assert (root / "fidelity.earlier.md").read_bytes() == earlier
    assert all((root / f"fidelity.earlier.{ext}").is_file() for ext in ("html", "json"))
    monkeypatch.undo()
    reproduce_all(root, quick=True, targets=["lemma1", "mode-collapse-curves"])
    assert "mode-collapse-curves" in (root / "fidelity.md").read_text()
    assert not list(root.glob("fidelity.earlier.*"))


def test_after_an_interrupted_overwrite_the_finished_results_still_ask_for_overwrite(tmp_path, capsys,
                                                                                     monkeypatch):
    """The unfinished mark let any later run in without --overwrite, and it removed the finished results
    that the summary listed (another target's, which the interrupted run had not replaced)."""
    from attnkit.analysis import reproduce as repro

    out = tmp_path / "run"
    main(["reproduce", "mode-collapse-curves", "--quick", "--out", str(out)])
    earlier = {p.name: p.read_bytes() for p in out.iterdir()}
    real = repro.TARGETS["mode-collapse-curves"]
    monkeypatch.setitem(repro.TARGETS, "mode-collapse-curves", _interrupt)
    with pytest.raises(SystemExit):
        main(["reproduce", "mode-collapse-curves", "--quick", "--out", str(out), "--overwrite", "--seed=1"])
    monkeypatch.setitem(repro.TARGETS, "mode-collapse-curves", real)
    capsys.readouterr()
    err = _error_line(capsys, ["reproduce", "lemma1", "--quick", "--out", str(out)])
    assert "finished results of 'mode-collapse-curves'" in err and "--overwrite" in err
    assert {name: (out / name).read_bytes() for name in earlier} == earlier
    main(["reproduce", "lemma1", "--quick", "--out", str(out), "--overwrite"])
    assert json.loads((out / "summary.json").read_text())["name"] == "lemma1"


def _error_line(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1, err
    return err[0]


def test_a_dangling_out_link_is_named_in_one_line_before_any_work(tmp_path, capsys):
    """A link to nothing as --out gave "[Errno 17] File exists" (and would have created its target)."""
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "nowhere" / "deep")
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "lemma1", "--quick", "--out", str(link)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "symbolic link" in err and "--out" in err, err
    assert not (tmp_path / "nowhere").exists()


def test_a_full_disk_during_a_run_is_one_line(tmp_path, capsys, monkeypatch):
    """write_csv's write() raised ENOSPC, which names no file: the CLI took it for a defect (a traceback,
    exit code 1)."""
    import errno

    from attnkit.analysis import reproduce as repro

    def full(result, quick, seed):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setitem(repro.TARGETS, "lemma1", full)
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "lemma1", "--out", str(tmp_path / "r"), "--quick"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2
    assert err[-1].startswith("error: No space left on device while writing the output")


@pytest.mark.parametrize("raised", [
    lambda: __import__("safetensors").SafetensorError("Error while serializing: No space left on device "
                                                      "(os error 28)"),
    lambda: RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 11456 vs 11408"),
], ids=["safetensors", "torch.save"])
def test_a_full_disk_inside_a_library_is_one_line(raised, tmp_path, capsys, monkeypatch):
    """safetensors and torch.save wrap the refused write in their own error types: show and compare ended in
    a traceback, exit code 1."""
    from attnkit.analysis import reproduce as repro

    def full(result, quick, seed):
        raise raised()

    monkeypatch.setitem(repro.TARGETS, "lemma1", full)
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "lemma1", "--out", str(tmp_path / "r"), "--quick"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and err[-1].startswith("error: ") and "free the space" in err[-1]


def test_an_interrupted_run_of_all_targets_leaves_no_empty_target_folders(tmp_path, monkeypatch):
    """Stopped in its first target, a run of all targets left an empty folder for every target it had not
    reached (11 of them after a SIGTERM)."""
    from attnkit.analysis import reproduce as repro
    from attnkit.analysis.fidelity import reproduce_all
    from attnkit.analysis.report import UNFINISHED_MARKER

    root = tmp_path / "all"
    monkeypatch.setitem(repro.TARGETS, "lemma1", _interrupt)
    with pytest.raises(KeyboardInterrupt):
        reproduce_all(root, quick=True, targets=["lemma1", "mode-collapse-curves"], jobs=1)
    assert sorted(p.name for p in root.iterdir()) == [UNFINISHED_MARKER, "lemma1"]  # its staging and mark
    assert (root / "lemma1" / UNFINISHED_MARKER).is_file()


def test_a_run_still_going_is_in_use_not_a_run_that_did_not_finish(tmp_path, monkeypatch):
    """The refusal after an interrupted --overwrite was checked before the lock: a second run beside one
    still going was told to pass --overwrite, which then said the folder was in use."""
    import os

    from attnkit._files import lock_folder
    from attnkit.analysis import reproduce as repro

    out = tmp_path / "run"
    main(["reproduce", "mode-collapse-curves", "--quick", "--out", str(out)])
    monkeypatch.setitem(repro.TARGETS, "mode-collapse-curves", _interrupt)
    with pytest.raises(SystemExit):  # leaves the unfinished mark, as a run still going has
        main(["reproduce", "mode-collapse-curves", "--quick", "--out", str(out), "--overwrite"])
    held = lock_folder(out, "test")  # the run still going
    try:
        with pytest.raises(ValueError, match="is in use by another attnkit reproduce process"):
            repro.reproduce("lemma1", out, quick=True)
    finally:
        os.close(held)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs a folder no one can write in (/proc)")
def test_a_default_out_the_system_cannot_make_is_one_line_naming_out(capsys, monkeypatch):
    """Run from a folder that cannot be written, the default --out printed "[Errno 2] No such file or
    directory: 'runs'", naming neither --out nor the fix."""
    monkeypatch.chdir("/proc")
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "lemma1", "--quick"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1, err
    assert "--out 'runs/reproduce/lemma1' cannot be made" in err[0] and "choose another --out" in err[0]


@pytest.mark.parametrize("width", [40, 60])
def test_the_tables_on_a_narrow_terminal_cut_no_name_or_number(width, tmp_path, monkeypatch):
    """On a 60-column terminal lemma1's table printed "2.144e…" for softmax's 2.144e-56 and "sinkho…"."""
    import io
    import json

    from rich.console import Console

    import attnkit.cli._screen as screen

    out = io.StringIO()
    monkeypatch.setattr(screen, "console", lambda *a, **k: Console(file=out, width=width, markup=False,
                                                                    force_terminal=True, no_color=True))
    main(["reproduce", "lemma1", "--quick", "--out", str(tmp_path / "r")])
    text = out.getvalue()
    assert "…" not in text
    plain = re.sub(r"\x1b\[[0-9;]*m", "", text)  # the headers' bold
    assert " criterion " in plain and " mechanism " in plain  # headers wrap at spaces only ("criterio" / "n")
    rows = json.loads((tmp_path / "r" / "summary.json").read_text())["rows"]
    lines = [line for line in text.splitlines() if line.startswith("│ ")]
    for row in rows:  # each row's name and its number sit whole on one line
        value = row["min n_k*sum"]
        assert any(line.split()[1] == row["mechanism"] and f" {value:.4g} " in line for line in lines), row


def test_a_read_only_out_is_refused_naming_out_not_the_hidden_mark(tmp_path, capsys, monkeypatch):
    """An existing read-only --out printed "[Errno 13] Permission denied: 'OUT/.attnkit-unfinished'" (a hidden
    file the user never made) instead of naming --out and the fix, as compare and finetune do."""
    import pathlib

    out = tmp_path / "empty555"
    out.mkdir()
    real = pathlib.Path.write_text

    def read_only(self, *args, **kwargs):  # the folder's mode 0555, for a user who is not root
        if self.parent == out:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", read_only)
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "mode-collapse-curves", "--quick", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1
    assert err == f"error: --out {out} cannot be written (Permission denied); choose another --out"


def test_the_attnkit_script_ignores_a_second_ctrl_c_while_it_exits(capsys, monkeypatch):
    """Two Ctrl-C 20 ms apart: the second landed in the interpreter's exit handlers (torch's
    dump_compile_times) and printed a 20-44-line "Exception ignored ... KeyboardInterrupt" traceback under
    "interrupted". A caller of main(argv) in its own process keeps its handlers."""
    import signal
    import sys

    from attnkit.analysis import reproduce as repro

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(repro, "reproduce", interrupted)
    argv = ["reproduce", "lemma1", "--quick", "--out", "unused"]
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as exc:
            main(argv)  # in-process: the handlers stay
        assert exc.value.code == 130 and {s: signal.getsignal(s) for s in before} == before
        monkeypatch.setattr(sys, "argv", ["attnkit", *argv])
        with pytest.raises(SystemExit) as exc:
            main()  # the script: the process exits, and a second Ctrl-C is ignored meanwhile
        assert exc.value.code == 130 and "interrupted" in capsys.readouterr().err
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
