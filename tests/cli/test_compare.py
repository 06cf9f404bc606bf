"""``attnkit compare`` on the command line: bad configuration exits with code 2 and one readable line;
two CPU processes through ``accelerate launch`` agree with one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from attnkit.cli import main
from tests.runner._fixtures import write_classification_file

TINY = [
    "--mechanisms",
    "softmax,hnas",
    "--seeds",
    "1",
    "--max-steps",
    "8",
    "--progress",
    "none",
    "--set",
    "batch_size=8",
    "--set",
    "eval_every=4",
    "--set",
    "checkpoint_every=4",
    "--set",
    "d_model=16",
    "--set",
    "nhead=2",
    "--set",
    "num_layers=1",
    "--set",
    "dim_feedforward=32",
    "--set",
    "max_len=16",
    "--set",
    "dropout=0",
    "--set",
    "lr=0.01",
    "--set",
    "warmup_steps=1",
    "--set",
    "explain_away_samples=16",
    "--set",
    "plots=false",
]


def _exit_code_and_stderr(args, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(["compare", *args])
    return exc.value.code, capsys.readouterr().err


@pytest.fixture
def data(tmp_path):
    return write_classification_file(tmp_path / "topics.json")


def _bad_cases(tmp_path, data):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    config = tmp_path / "run.yaml"
    config.write_text("seeds: 1\nlearning_rate: 0.1\n")
    return {
        "unknown mechanism": (["--task", str(data), "--mechanisms", "softmax,flash"], "flash"),
        "negative steps": (["--task", str(data), "--max-steps", "-3"], "max_steps=-3"),
        "negative steps via --set": (["--task", str(data), "--set", "steps=-10"], "steps=-10"),
        "missing dataset": (["--task", str(tmp_path / "missing.json")], "missing.json"),
        "unknown task": (["--task", "imagenet"], "imagenet"),
        "unwritable output": (["--task", str(data), *TINY, "--out", str(blocker / "run")], "a_file"),
        "unknown config key": (["--task", str(data), "--config", str(config)], "learning_rate"),
        "unknown --set key": (["--task", str(data), "--set", "epochs=3"], "epochs"),
        "bad preset": (["--task", str(data), "--preset", "huge"], "huge"),
        "empty --out": (["--task", str(data), "--out", ""], "--out is empty"),  # not "." (the cwd)
    }


@pytest.mark.parametrize(
    "case",
    [
        "unknown mechanism",
        "negative steps",
        "negative steps via --set",
        "missing dataset",
        "unknown task",
        "unwritable output",
        "unknown config key",
        "unknown --set key",
        "bad preset",
        "empty --out",
    ],
)
def test_bad_configuration_exits_2_with_one_line(case, tmp_path, data, capsys):
    args, needle = _bad_cases(tmp_path, data)[case]
    code, err = _exit_code_and_stderr(args, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert needle in lines[0]
    assert "Traceback" not in err


def test_unknown_config_key_lists_the_valid_ones(tmp_path, data, capsys):
    args, _ = _bad_cases(tmp_path, data)["unknown config key"]
    _, err = _exit_code_and_stderr(args, capsys)
    assert "valid keys:" in err and "max_steps" in err and "mechanisms" in err


@pytest.mark.slow
def test_second_run_into_the_same_directory_is_refused(tmp_path, data, capsys):
    out = tmp_path / "out"
    main(
        [
            "compare",
            "--task",
            str(data),
            *TINY,
            "--mechanisms",
            "softmax",
            "--max-steps",
            "2",
            "--out",
            str(out),
        ]
    )
    before = (out / "results.json").read_text()
    capsys.readouterr()
    code, err = _exit_code_and_stderr(["--task", str(data), *TINY, "--out", str(out)], capsys)
    assert code == 2 and "--resume" in err
    assert (out / "results.json").read_text() == before


@pytest.mark.slow
def test_two_cpu_processes_agree_with_one(tmp_path, data):
    """Same seeds, same global batch: 2 processes (gloo) give the metrics of 1 process, up to float
    rounding."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    args = ["compare", "--task", str(data), *TINY]
    one, two = tmp_path / "one", tmp_path / "two"
    subprocess.run([sys.executable, "-m", "attnkit.cli", *args, "--out", str(one)], check=True, env=env,
                   capture_output=True, timeout=300)
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        "0",
        "-m",
        "attnkit.cli",
        *args,
        "--out",
        str(two),
    ]
    proc = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs_one = json.loads((one / "results.json").read_text())["runs"]
    runs_two = json.loads((two / "results.json").read_text())["runs"]
    assert [r["world_size"] for r in runs_two] == [2, 2]
    for a, b in zip(runs_one, runs_two):
        assert (a["mechanism"], a["seed"], a["steps"], a["eval_examples"]) == (
            b["mechanism"],
            b["seed"],
            b["steps"],
            b["eval_examples"],
        )
        assert a["metrics"] == b["metrics"]
        for ha, hb in zip(a["history"], b["history"]):
            assert hb["train_loss"] == pytest.approx(ha["train_loss"], rel=1e-5)
        if a["hybrid_u"] is not None:
            assert b["hybrid_u"][0] == pytest.approx(a["hybrid_u"][0], abs=1e-5)


def _launch_two(args, env):
    """``attnkit compare ARGS`` in 2 CPU processes through ``accelerate launch``."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", "0", "-m", "attnkit.cli", "compare", *args]
    return subprocess.run(launch, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_two_processes_with_tensorboard_finish_and_another_process_count_is_not_mixed_in(tmp_path, data):
    """``--log-with tensorboard`` under 2 processes exits 0 (Accelerate's ``end_training`` ends the process
    group, so nothing may wait on it afterwards), and resuming its finished runs with 1 process is refused
    (step times of different process counts would sit side by side)."""
    pytest.importorskip("tensorboard")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "two"
    args = ["--task", str(data), *TINY, "--out", str(out), "--log-with", "tensorboard", "--progress", "none"]
    proc = _launch_two(args, env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "results.json").is_file() and (out / "tensorboard").is_dir()
    before = (out / "results.json").read_text()
    one = subprocess.run([sys.executable, "-m", "attnkit.cli", "compare", *args, "--resume"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 2 and "finished with 2 process(es)" in one.stderr, one.stderr[-2000:]
    assert len(one.stderr.strip().splitlines()) == 1
    assert (out / "results.json").read_text() == before


@pytest.mark.slow
def test_two_processes_refuse_an_uneven_batch_once_and_leave_no_run_directory(tmp_path, data):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "uneven"
    proc = _launch_two(["--task", str(data), *TINY, "--set", "batch_size=3", "--out", str(out)], env)
    assert proc.returncode != 0
    message = "error: batch_size=3 does not split evenly over 2 processes; use a multiple of 2"
    # each process says it once, rank 1 with its rank; the launcher may end process 1 before it prints its
    # line once process 0 has exited (seen under load), and the launcher relays the two processes' output
    # to one stream, where their lines were once seen run together: counted, not split into lines
    ranked = proc.stderr.count(f"[rank 1] {message}")
    assert proc.stderr.count(message) - ranked == 1 and ranked <= 1, proc.stderr[-2000:]
    # no traceback of ours (the launcher prints its own failure report, with its own traceback)
    assert "site-packages/attnkit" not in proc.stderr and "/src/attnkit/" not in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("flags", [[], ["--resume"], ["--overwrite"]])
def test_damaged_config_file_is_named_and_nothing_is_deleted(flags, tmp_path, data, capsys):
    out = tmp_path / "out"
    (out / "runs" / "softmax-seed0").mkdir(parents=True)
    (out / "runs" / "softmax-seed0" / "result.json").write_text("{}")
    (out / "config.json").write_bytes(b'{"created_by": "attnkit compare", "conf')  # cut short
    code, err = _exit_code_and_stderr(["--task", str(data), *TINY, "--out", str(out), *flags], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "config.json" in lines[0] and "damaged" in lines[0]
    assert "--resume" not in lines[0] and "--overwrite" not in lines[0]  # neither can help
    assert (out / "runs" / "softmax-seed0" / "result.json").is_file()


@pytest.mark.slow
def test_a_checkpoint_part_damaged_for_one_process_stops_every_process_with_one_line(tmp_path, data):
    """Process 1 could not read its RNG file and stopped with one line; process 0 went on and died in the
    next collective with a gloo traceback."""
    from attnkit.runner import build_config, run_compare
    from tests.runner._fixtures import tiny_overrides

    class Killed(Exception):
        pass

    def kill_at_3(mechanism, seed, step):
        if step == 3:
            raise Killed

    out = tmp_path / "cut"
    common = dict(mechanisms="softmax", seeds=1, steps=4, checkpoint_every=2, eval_every=2)
    with pytest.raises(Killed):
        run_compare(build_config(tiny_overrides(data, out, **common)), on_step=kill_at_3)
    checkpoint = next((out / "runs" / "softmax-seed0" / "checkpoints").iterdir())
    trainer = json.loads((checkpoint / "trainer.json").read_text())
    (checkpoint / "trainer.json").write_text(json.dumps({**trainer, "world_size": 2}))  # as 2 processes wrote
    (checkpoint / "rng-rank1.safetensors").write_text("garbage")  # process 1's part, damaged
    saved = json.loads((out / "config.json").read_text())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = _launch_two(["--resume", "--out", str(out), "--progress", "none"], env)
    assert proc.returncode != 0 and saved
    # the launcher's own failure report stays (README); no process dies in a collective with a traceback
    assert "Connection closed" not in proc.stderr and "[rank0]:" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert any("rng-rank1.safetensors" in line and "cannot be read" in line for line in errors), errors
    # process 0 stops too ("error: process 1 could not resume: ..."), but the launcher may end it before its
    # line is printed, once process 1 has exited
    assert all(line.startswith(("error: process 1 could not resume", "[rank 1] error:")) for line in errors)


def test_overwrite_refuses_to_delete_the_config_file_it_was_given(tmp_path, data, capsys):
    out = tmp_path / "run"
    main(["compare", "--task", str(data), *TINY, "--out", str(out)])
    config = out / "runs" / "run.yaml"  # among the earlier run's outputs
    config.write_text("seeds: 1\n")
    args = ["--task", str(data), *TINY, "--out", str(out), "--overwrite", "--config", str(config)]
    code, err = _exit_code_and_stderr(args, capsys)
    assert code == 2 and "would delete" in err and "the --config file" in err
    assert config.read_text() == "seeds: 1\n"
    kept = out / "run.yaml"  # beside them: kept, as every file of the user's in --out
    kept.write_text("seeds: 1\n")
    (out / "notes.txt").write_text("the user's")
    main(["compare", "--task", str(data), *TINY, "--out", str(out), "--overwrite", "--config", str(kept)])
    assert kept.read_text() == "seeds: 1\n" and (out / "notes.txt").read_text() == "the user's"
    assert (out / "results.json").is_file() and not config.exists()


@pytest.mark.parametrize("resume", [[], ["--resume"]])
def test_a_config_file_out_that_is_not_a_path_is_one_line_with_or_without_resume(tmp_path, capsys, resume):
    """With --resume the run directory was read before the value was checked: a TypeError traceback."""
    config = tmp_path / "run.yaml"
    config.write_text("out: [a, b]\n")
    code, err = _exit_code_and_stderr(["--config", str(config), *resume], capsys)
    assert code == 2 and err.strip() == "error: out=['a', 'b']: expected a directory path"


def test_a_defect_in_training_shows_its_traceback_and_keeps_the_checkpoints(tmp_path, monkeypatch):
    """A ValueError raised by a bug (Python's "too many values to unpack") read as a setting to correct: one
    line, exit 2, and the run directory the command had made removed with its checkpoints."""
    import attnkit.runner.train as train_module

    data = write_classification_file(tmp_path / "topics.json")
    out = tmp_path / "run"
    real = train_module.batch_indices

    def broken(step, *args, **kwargs):
        if step == 5:  # after the checkpoint of step 4
            a, b = (1, 2, 3)  # noqa: F841 - the defect
        return real(step, *args, **kwargs)

    monkeypatch.setattr(train_module, "batch_indices", broken)
    with pytest.raises(ValueError, match="too many values to unpack") as exc:
        main(["compare", "--task", str(data), "--out", str(out), *TINY])
    assert any(frame.name == "broken" for frame in _frames(exc.value))  # the traceback goes back to it
    assert list(out.glob("runs/softmax-seed0/checkpoints/step-*"))


def _frames(exc: BaseException):
    import traceback

    while exc is not None:
        yield from traceback.extract_tb(exc.__traceback__)
        exc = exc.__cause__


@pytest.mark.parametrize("package, extra", [("matplotlib", "plot"), ("accelerate", "hf")])
def test_a_missing_optional_package_is_one_line_naming_its_extra_before_any_training(
    package, extra, tmp_path, data, capsys, monkeypatch
):
    """Without accelerate compare ended in a 43-line traceback; without matplotlib it trained every run,
    then crashed (exit 1) before the report."""
    monkeypatch.setitem(sys.modules, package, None)  # import of it fails as when it is not installed
    out = tmp_path / "out"
    args = ["--task", str(data), "--mechanisms", "softmax", "--seeds", "1", "--max-steps", "1", "--progress",
            "none", "--out", str(out)]
    code, err = _exit_code_and_stderr(args, capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"pip install 'attnkit[{extra}]'" in lines[0], err
    assert not out.exists()


def test_a_module_missing_inside_an_installed_package_keeps_its_traceback():
    """ModuleNotFoundError for transformers.models.does_not_exist (transformers installed: a version mismatch
    or a defect) was told to install the 'hf' extra."""
    from attnkit.cli import _missing_extra

    assert _missing_extra(ModuleNotFoundError("No module named 'accelerate'", name="accelerate")) is not None
    inner = ModuleNotFoundError("No module named 'transformers.models.gone'", name="transformers.models.gone")
    assert _missing_extra(inner) is None


def test_the_summary_on_a_narrow_terminal_keeps_every_name_and_number(tmp_path, data, monkeypatch):
    """Up to 70 columns the table cut the mechanism column to nothing (no row said which mechanism it was),
    and at 40 rich cropped the columns past the edge."""
    import io

    from rich.console import Console

    import attnkit.cli._screen as screen

    screen_out = io.StringIO()
    monkeypatch.setattr(screen, "console", lambda *a, **k: Console(file=screen_out, width=40, markup=False,
                                                                    force_terminal=True, no_color=True))
    args = [*TINY, "--task", str(data), "--out", str(tmp_path / "run"), "--mechanisms", "softmax,hnas,coda"]
    main(["compare", *args])
    text = screen_out.getvalue()
    rows = {name: line for line in text.splitlines() for name in ("softmax", "hnas", "coda")
            if line.startswith(f"│ {name} ")}
    assert set(rows) == {"softmax", "hnas", "coda"} and "…" not in text
    records = json.loads((tmp_path / "run" / "results.json").read_text())["results"]
    u = next(r for r in records if r["mechanism"] == "hnas")["hybrid_u_mean"]
    assert f"{u:.3f}" in rows["hnas"]  # the last column too


def test_characters_the_output_encoding_lacks_print_as_question_marks(monkeypatch):
    """On a cp1252 or ASCII stdout compare finished and saved its results, then exited 2 with "'charmap'
    codec can't encode characters" when it printed its table's "×" and "Σπ"."""
    import io

    from attnkit.cli import _replace_unencodable_output

    raw = io.BytesIO()
    stdout = io.TextIOWrapper(raw, encoding="ascii", errors="strict")
    monkeypatch.setattr(sys, "stdout", stdout)
    _replace_unencodable_output()
    print("step × min n_k·Σπ ≥ 1")
    stdout.flush()
    assert raw.getvalue().decode("ascii") == "step ? min n_k??? ? 1\n"


def test_main_sets_the_output_encoding_errors_back_when_it_returns(monkeypatch):
    """main() left stdout and stderr on errors="replace" after it returned: a program calling it in its own
    process then printed "?" for characters its encoding lacks instead of failing as it had asked."""
    import io

    from attnkit.cli import _replace_unencodable_output, main

    raw = io.BytesIO()
    stdout = io.TextIOWrapper(raw, encoding="ascii", errors="strict")
    stderr = io.TextIOWrapper(io.BytesIO(), encoding="ascii", errors="strict")
    monkeypatch.setattr(sys, "stdout", stdout)
    monkeypatch.setattr(sys, "stderr", stderr)
    main(["--version"])
    assert (sys.stdout.errors, sys.stderr.errors) == ("strict", "strict")
    assert "attnkit" in raw.getvalue().decode("ascii")
    # text written under "replace" and still buffered when the streams are set back prints as "?"
    from attnkit.cli import _restore_output

    _restore_output(_replace_unencodable_output())
    assert sys.stdout.errors == "strict"
    changed = _replace_unencodable_output()
    print("a × b", end="")
    _restore_output(changed)
    stdout.flush()
    assert raw.getvalue().decode("ascii").endswith("a ? b")


def test_a_home_folder_in_an_out_option_or_config_file_is_expanded(tmp_path, data, monkeypatch):
    """``--out=~/runs`` (the shell leaves a "~" after "=" alone) and ``out: ~/runs`` in a config file made a
    folder named "~" in the working directory."""
    from attnkit.cli import _expand_home
    from attnkit.runner import build_config

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    home = str(tmp_path / "home")
    assert _expand_home(["compare", "--out=~/runs", "--task=~/t.json", "--text=~x", "--out", "~/y"]) == [
        "compare", f"--out={home}/runs", f"--task={home}/t.json", "--text=~x", "--out", "~/y"]
    config = build_config({"task": str(data), "out": "~/runs/a"})
    assert config.out == f"{home}/runs/a"


@pytest.mark.parametrize("task", ["", "nosuch"])
def test_an_empty_or_unknown_task_lists_every_task(task, capsys):
    """An empty --task listed 7 task names, leaving out reuters52, 20newsgroups, sst2, mrpc and snli, which an
    unknown name listed."""
    from attnkit.data import DATASETS
    from attnkit.runner.transduction import TRANSDUCTION_TASKS

    code, err = _exit_code_and_stderr(["--task", task], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert all(name in err for name in [*DATASETS, *TRANSDUCTION_TASKS]) and "dataset file" in err


def test_the_command_line_expands_home_and_prints_on_an_ascii_stdout(tmp_path, data, monkeypatch):
    """The two entry-point fixes as a user meets them (the helpers were tested alone, and main() could drop
    either call unnoticed): ``attnkit reproduce lemma1 --out=~/r`` writes under the home folder, and any
    command leaves an ASCII stdout printing "?" for what it cannot encode."""
    import io

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    main(["reproduce", "lemma1", "--quick", "--out=~/r"])
    assert (tmp_path / "home" / "r" / "summary.json").is_file() and not (tmp_path / "~").exists()
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="ascii", errors="strict"))
    main(["compare", *TINY, "--task", str(data), "--out", str(tmp_path / "run"), "--mechanisms", "softmax"])
    sys.stdout.flush()
    text = raw.getvalue().decode("ascii")  # the summary's "×" and "Σπ"
    assert "softmax" in text and "?" in text and sys.stdout.errors == "strict"
