"""Every ``attnkit`` command written in the README and docs/ names a real command and real options of it,
and the command lines of code blocks (indented) without placeholders parse as written (without running)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from attnkit.cli import app

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# `attnkit ...` in backticks, an indented `attnkit ...` line, or `... -m attnkit.cli ...`
_LINE = re.compile(r"`attnkit ([^`]*)`|^ +attnkit (.*)$|-m attnkit\.cli ([^`\n]*)", re.M)
_PLACEHOLDER = re.compile(r"\[|\||\.\.\.|\b[A-Z][A-Z_]+\b|\bN\b")


def _documented() -> list[tuple[str, str, bool]]:
    """``(where, line, in_code)``: in_code for a command line of a code block, not a mention in prose."""
    found = []
    for path in DOCS:
        for match in _LINE.finditer(path.read_text(encoding="utf-8")):
            line = next(group for group in match.groups() if group is not None)
            line = line.split("  #")[0].replace("\\|", "|").strip()
            found.append((f"{path.name}: attnkit {line}", line, match.group(1) is None))
    return found


def _command(words: list[str]):
    """The (sub)command the words name (typer's click command), its path and the words after it."""
    command = typer.main.get_command(app)
    path = []
    while words and words[0] in getattr(command, "commands", {}):
        path.append(words[0])
        command = command.commands[words.pop(0)]
    return command, path, words


def _options(command) -> set[str]:
    names = {"--help", "-h"}
    for param in command.params:
        if param.param_type_name == "option":
            names.update(param.opts, param.secondary_opts)
    return names


DOCUMENTED = _documented()


@pytest.mark.parametrize("where, line", [d[:2] for d in DOCUMENTED], ids=[d[0] for d in DOCUMENTED])
def test_documented_command_names_real_options(where, line):
    words = shlex.split(re.sub(r"[|\[\]]", " ", line))
    command, path, rest = _command(words)
    assert path or rest and rest[0].startswith("-"), f"{where}: no such command"
    flags = [w.split("=")[0] for w in rest if w.startswith("--")]
    unknown = [flag for flag in flags if flag not in _options(command)]
    assert not unknown, f"{where}: {' '.join(path)} has no option {unknown}"


CONCRETE = [(where, line) for where, line, in_code in DOCUMENTED if in_code and not _PLACEHOLDER.search(line)]


@pytest.mark.parametrize("where, line", CONCRETE, ids=[w for w, _ in CONCRETE])
def test_documented_command_parses(where, line):
    command, path, rest = _command(shlex.split(line))
    if "--help" in rest or "-h" in rest:
        return
    try:
        command.make_context(" ".join(["attnkit", *path]), list(rest), resilient_parsing=False)
    except Exception as exc:  # typer's click: a UsageError (bad option, bad value, missing argument)
        raise AssertionError(f"{where}: {type(exc).__name__}: {exc}") from None


def test_the_docs_name_commands():
    assert len(DOCUMENTED) > 20 and len(CONCRETE) >= 3
