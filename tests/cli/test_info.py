"""``attnkit info``: version, mechanisms, backends, the torch build and the route of typical calls."""

from __future__ import annotations

import json

import pytest

import attnkit as ak
from attnkit.cli import main


def test_info_json_lists_every_mechanism_backend_and_a_route_per_mechanism(capsys):
    main(["info", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["attnkit"] == ak.__version__
    assert data["mechanisms"] == list(ak.MECHANISMS)
    assert data["backends"] == list(ak.BACKENDS)
    routes = data["dispatch (backend='auto')"]
    assert routes and all(set(by_mechanism) == set(ak.MECHANISMS) for by_mechanism in routes.values())
    padded = routes["L=128, key padding"]
    from attnkit.kernels import cpu_ext

    # the fused C++ CoDA kernel at every size; without it small CoDA calls stay materialized
    assert padded["coda"].startswith("coda_cpp: " if cpu_ext.load(warn=False) else "reference: ")
    assert data["cpu_kernels"].startswith(("C++", "PyTorch fallback"))


def test_info_routes_are_what_explain_dispatch_says(capsys):
    from attnkit.cli.info import dispatch_examples

    import torch

    q = torch.zeros(1, 8, 2048, 64)
    expected = {m: str(ak.explain_dispatch(q, q, q, m)) for m in ak.MECHANISMS}
    assert dispatch_examples()["L=2048, no mask"] == expected


def test_info_table_names_the_mechanisms(capsys):
    main(["info"])
    out = capsys.readouterr().out
    assert all(name in out for name in ak.MECHANISMS) and "route" in out


def test_info_table_prints_the_reasons_verbatim(capsys):
    """The reasons name extras in brackets ("the [triton] extra"), which the table must not read as markup."""
    import re

    from attnkit.cli.info import dispatch_examples

    reasons = " ".join(r for by_mechanism in dispatch_examples().values() for r in by_mechanism.values())
    main(["info"])
    out = capsys.readouterr().out
    assert all(token in out for token in re.findall(r"\[[^\]]+\]", reasons))


def test_info_rejects_an_unknown_option(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["info", "--bogus"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("raw, shown", [(None, "64 MiB (default; ATTNKIT_SCORE_CACHE_MB)"),
                                        ("256", "256 MiB (ATTNKIT_SCORE_CACHE_MB)")])
def test_info_shows_the_sinkhorn_score_budget_and_where_it_comes_from(raw, shown, capsys, monkeypatch):
    monkeypatch.delenv("ATTNKIT_SCORE_CACHE_MB", raising=False)
    if raw is not None:
        monkeypatch.setenv("ATTNKIT_SCORE_CACHE_MB", raw)
    main(["info", "--json"])
    assert json.loads(capsys.readouterr().out)["sinkhorn_score_cache"] == shown


def test_info_names_a_bad_score_budget_in_one_line(capsys, monkeypatch):
    monkeypatch.setenv("ATTNKIT_SCORE_CACHE_MB", "lots")
    with pytest.raises(SystemExit) as exc:
        main(["info"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ATTNKIT_SCORE_CACHE_MB='lots'") and len(err.strip().splitlines()) == 1


def test_a_bad_score_budget_stops_a_command_before_it_writes_but_not_its_help(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNKIT_SCORE_CACHE_MB", "64MB")
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--max-steps", "1", "--out", str(out)])
    assert exc.value.code == 2 and not out.exists()
    assert capsys.readouterr().err.startswith("error: ATTNKIT_SCORE_CACHE_MB='64MB'")
    main(["compare", "--help"])  # returns: the help is printed, no error
    assert "Usage" in capsys.readouterr().out


@pytest.mark.parametrize("name, raw", [("ATTNKIT_NO_CPP", "maybe"), ("ATTNKIT_EXT_LOCK_TIMEOUT", "nan")])
def test_a_bad_kernel_setting_is_named_before_any_work(monkeypatch, tmp_path, capsys, name, raw):
    """ATTNKIT_NO_CPP=maybe was reported after compare had started its first run and written a run folder."""
    monkeypatch.setenv(name, raw)
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--out", str(tmp_path / "run"), "--max-steps", "1"])
    assert exc.value.code == 2 and capsys.readouterr().err.startswith(f"error: {name}={raw!r}")
    assert not (tmp_path / "run").exists()


def test_ctrl_c_while_the_command_starts_is_interrupted_not_a_traceback():
    """Importing attnkit.cli (torch, transformers) takes seconds: a Ctrl-C then ended the command with
    Python's KeyboardInterrupt traceback and exit code 1."""
    import signal
    import subprocess
    import sys
    import time

    # Ctrl-C as a terminal delivers it, whatever the test harness did to the signal (ignored, blocked), then
    # a line that says the command's import is about to start
    code = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); sys.argv = ['attnkit', 'info']; "
            "from _attnkit_entry import main; print('starting', flush=True); main()")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    assert child.stdout.readline().strip() == "starting"
    time.sleep(0.2)  # inside main's imports (they take seconds)
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 130 and err.strip() == "interrupted", (child.returncode, err[-500:])


def test_python_dash_m_attnkit_runs_the_command():
    """``python -m attnkit`` said "No module named attnkit.__main__" (exit 1)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "attnkit", "--version"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"attnkit {ak.__version__}", done.stderr
    bad = subprocess.run([sys.executable, "-m", "attnkit", "compare", "--seeds", "0"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == ["error: seeds=0: expected an integer >= 1"]


def test_info_says_once_when_it_builds_the_cpp_kernels(capsys, monkeypatch, tmp_path):
    """A first ``attnkit info`` was silent for a minute while the compiler ran; then it printed its own line
    beside the build's (two lines that disagreed), also where no build could start."""
    from attnkit.cli.info import _cpu_kernels
    from attnkit.kernels import cpu_ext

    monkeypatch.setenv("ATTNKIT_CACHE", str(tmp_path))
    monkeypatch.delenv("ATTNKIT_NO_CPP", raising=False)
    monkeypatch.setattr(cpu_ext, "_state", {"loaded": False, "ok": False, "error": None})

    def fake_build(path, verbose):
        raise RuntimeError("compiler not run in this test")

    monkeypatch.setattr(cpu_ext, "_build", fake_build)
    assert _cpu_kernels().startswith("PyTorch fallback (RuntimeError: compiler not run")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attnkit: building the C++ CPU kernels into ")
    _cpu_kernels()  # loaded (or failed) once: nothing said again
    assert capsys.readouterr().err == ""



def test_info_on_a_narrow_terminal_folds_and_cuts_nothing(monkeypatch):
    """On a 60-column terminal the C++ kernels' folder printed as "(/root/.cache/attnkit/ext/torch-…"."""
    import io

    from rich.console import Console

    import attnkit.cli._screen as screen
    from attnkit.cli.info import info_dict

    out = io.StringIO()
    monkeypatch.setattr(screen, "console", lambda *a, **k: Console(file=out, width=40, markup=False,
                                                                    force_terminal=True, no_color=True))
    main(["info"])
    text = out.getvalue()
    assert "…" not in text
    joined = "".join(line.split("│")[2].strip() for line in text.splitlines() if line.count("│") == 3)
    for key, value in info_dict().items():
        if isinstance(value, str):
            assert value.replace(" ", "") in joined.replace(" ", ""), key
