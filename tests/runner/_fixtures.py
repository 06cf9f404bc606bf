"""Tiny fixtures for the runner tests: dataset files written on the fly, and a small configuration."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from attnkit.cli import main


WORDS = {
    "sport": ["goal", "match", "team", "score", "league", "coach"],
    "money": ["bank", "stock", "price", "market", "profit", "trade"],
    "<b>&tag": ["alpha", "beta", "gamma", "delta", "omega", "sigma"],
}


def write_classification_file(path: Path, n_train: int = 96, n_test: int = 32, seed: int = 0) -> Path:
    """Three separable topics (one label name holds HTML characters, to check escaping)."""
    rng = random.Random(seed)
    names = list(WORDS)
    filler = ["the", "a", "of", "and", "to", "in"]

    def example() -> dict:
        label = rng.randrange(len(names))
        words = rng.choices(WORDS[names[label]], k=3) + rng.choices(filler, k=rng.randrange(2, 6))
        rng.shuffle(words)
        return {"text": " ".join(words), "label": names[label]}

    data = {"kind": "classification", "label_names": names,
            "train": [example() for _ in range(n_train)], "test": [example() for _ in range(n_test)]}
    data["test"][0]["text"] = "<script>alert('x')</script> goal team"
    path.write_text(json.dumps(data))
    return path


def tiny_overrides(path: Path, out: Path, **extra) -> dict:
    values = dict(task=str(path), mechanisms="softmax,hnas", seeds=1, steps=12, batch_size=8, eval_every=4,
                  checkpoint_every=4, d_model=16, nhead=2, num_layers=1, dim_feedforward=32, max_len=16,
                  explain_away_samples=16, lr=1e-2, warmup_steps=1, out=str(out), progress="none")
    values.update(extra)
    return values


def write_seq2seq_jsonl(path: Path, n_train: int = 64, n_test: int = 16, seed: int = 0) -> Path:
    """Reverse a short digit string (a .jsonl dataset file: a kind line, then one example per line)."""
    rng = random.Random(seed)
    lines = [json.dumps({"kind": "seq2seq"})]
    for split, n in (("train", n_train), ("test", n_test)):
        for _ in range(n):
            s = "".join(rng.choices("0123456789", k=rng.randrange(2, 6)))
            lines.append(json.dumps({"split": split, "source": s, "target": s[::-1]}))
    path.write_text("\n".join(lines) + "\n")
    return path


class Killed(Exception):
    """Raised by ``kill_at``'s hook: a run stopped as by a kill."""


def kill_at(step_to_kill: int):
    """An ``on_step`` hook of ``run_compare`` that stops the run at ``step_to_kill``."""
    def hook(mechanism, seed, step):
        if step == step_to_kill:
            raise Killed

    return hook


def ctrl_c_at(step_to_stop: int):
    """An ``on_step`` hook of ``run_compare`` that stops the run at ``step_to_stop`` as Ctrl-C does."""
    def hook(mechanism, seed, step):
        if step == step_to_stop:
            raise KeyboardInterrupt

    return hook


def resume_cli(out, capsys) -> tuple[int, str]:
    """``attnkit compare --out OUT --resume``: its exit code and standard error."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--out", str(out), "--resume", "--progress", "none"])
    return exc.value.code, capsys.readouterr().err


def assert_one_line(err: str, *needles: str) -> None:
    """The error is one ``error: ...`` line holding each of ``needles``; the progress line "run k of N: ..."
    may come before it."""
    lines = [line for line in err.strip().splitlines() if not re.match(r"run \d+ of \d+: ", line)]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


def resume_with_edited_result(out, edit, capsys) -> tuple[Path, int, str]:
    """Apply ``edit`` to the record of ``out``'s finished softmax seed 0 run, then resume ``out`` in the CLI:
    the result file, the exit code and standard error."""
    result = out / "runs" / "softmax-seed0" / "result.json"
    record = json.loads(result.read_text())
    edit(record)
    result.write_text(json.dumps(record))
    return (result, *resume_cli(out, capsys))


def write_finished_run(root: Path, **extra) -> Path:
    """A finished 3-step softmax run on a dataset file written in ``root``: its run folder ``root/done``."""
    data = write_classification_file(root / "topics.json")
    common = dict(mechanisms="softmax", seeds=1, steps=3, checkpoint_every=2, eval_every=3)
    from attnkit.runner import build_config, run_compare

    run_compare(build_config(tiny_overrides(data, root / "done", **{**common, **extra})))
    return root / "done"
