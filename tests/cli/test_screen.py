"""The command line's surface: ``--version``, ``attnkit`` alone, help screens, tables when piped."""

from __future__ import annotations

import io

import pytest

import attnkit
from attnkit.cli import app, main
from attnkit.cli._screen import console


def _run(argv, capsys) -> tuple[int, str, str]:
    """The exit code ``main`` gives (returning normally is 0), stdout and stderr."""
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_version_prints_the_package_version(capsys):
    code, out, _ = _run(["--version"], capsys)
    assert code == 0 and out.strip() == f"attnkit {attnkit.__version__}"


def test_bare_command_prints_help_and_exits_0(capsys):
    code, out, err = _run([], capsys)
    assert code == 0 and "Usage:" in out and "compare" in out and err == ""


def test_a_command_group_alone_prints_its_help_and_exits_0_as_attnkit_alone_does(capsys):
    """``attnkit data`` alone printed its help and exited 2 (a usage error), ``attnkit`` alone 0."""
    code, out, err = _run(["data"], capsys)
    assert code == 0 and " data [OPTIONS] COMMAND" in out and "fetch" in out and err == ""
    code, _, err = _run(["data", "bogus"], capsys)
    assert code == 2 and "No such command 'bogus'" in err


def _commands() -> list[str]:
    import typer.main

    return sorted(typer.main.get_command(app).commands)


@pytest.mark.parametrize("command", [None, *_commands()])
def test_help_screens_show_no_type_for_flags(command, capsys):
    code, out, _ = _run(([command] if command else []) + ["--help"], capsys)
    assert code == 0 and "--help" in out
    assert "<bool>" not in out


def test_tables_are_not_cut_when_piped():
    from rich.table import Table

    long = "a description that is much longer than eighty columns " * 3
    table = Table()
    table.add_column("name")
    table.add_column("description")
    table.add_row("reuters8", long.strip())
    stream = io.StringIO()  # not a terminal
    console(stream).print(table)
    text = stream.getvalue()
    assert long.strip() in text and "\x1b[" not in text


def test_data_list_piped_keeps_whole_rows(capsys):
    main(["data", "list"])
    out = capsys.readouterr().out
    assert any(
        "MLU arithmetic (CoDA paper sec. 3.6)" in line and "seeded 9:1 split" in line
        for line in out.splitlines()
    )


def test_console_prints_brackets_verbatim():
    """Messages name extras ("attnkit[align]"): not rich markup, so they must print as written."""
    stream = io.StringIO()
    console(file=stream).print("install attnkit[align] or attnkit[triton]; interval [-1.5, +2.0]")
    assert "install attnkit[align] or attnkit[triton]; interval [-1.5, +2.0]" in stream.getvalue()


def test_help_shows_bracketed_text_as_written(capsys):
    """"the [bench] extra" in an option's help: rich would take [bench] for a style tag and drop it."""
    code, out, _ = _run(["bench", "--help"], capsys)
    assert code == 0 and "[bench]" in " ".join(out.replace("│", " ").split())
    for command in [None, *_commands()]:
        _, out, _ = _run(([command] if command else []) + ["--help"], capsys)
        assert "\\[" not in out, command


def test_a_typer_without_the_flag_type_hook_is_left_alone(monkeypatch):
    """Other typer versions have no ``display_type_rich`` (nor call it): hiding the flag types then does
    nothing, instead of failing when the command line is imported."""
    from typer.core import TyperOption

    from attnkit.cli import _screen

    for cls in TyperOption.__mro__:  # typer defines it on a base class too
        if "display_type_rich" in vars(cls):
            monkeypatch.delattr(cls, "display_type_rich")
    assert not hasattr(TyperOption, "display_type_rich")
    _screen.hide_flag_types()
    assert not hasattr(TyperOption, "display_type_rich")


def test_errors_of_other_ranks_are_printed_with_their_rank(monkeypatch, capsys):
    """Under accelerate launch an error only one process met must not be lost: ranks other than 0 print
    theirs with the rank in front; a single process prints plain lines even where RANK is set."""
    from attnkit.cli import _error

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    _error("damaged file")
    monkeypatch.setenv("WORLD_SIZE", "1")
    _error("plain")
    assert capsys.readouterr().err.splitlines() == ["[rank 1] error: damaged file", "error: plain"]
