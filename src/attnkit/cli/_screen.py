"""How the command line writes to the screen: help without flag types, tables that fit their content.

- Help screens: typer prints a type column for every option, which for a flag reads ``<bool>``
  (``--help <bool>``); a flag takes no value, so its type cell is left empty.
- Help text is plain text: "the [bench] extra" would be read by rich as a style tag and vanish, so
  :func:`escape_help_markup` escapes the brackets of every command's and option's help.
- Tables: rich cuts a table to 80 columns when the output is not a terminal (piped into a file or
  ``less``); :func:`console` gives such output the width the content needs.
"""

from __future__ import annotations

import sys
from typing import Optional, TextIO

__all__ = ["console", "add_fitted_columns", "hide_flag_types", "escape_help_markup", "PIPE_WIDTH"]

PIPE_WIDTH = 400  # wide enough for every table attnkit prints; rich tables take only the width they need


def console(file: Optional[TextIO] = None, stderr: bool = False):
    """A rich ``Console``: the terminal's width on a terminal, ``PIPE_WIDTH`` and no colour codes
    otherwise. Strings print verbatim (no markup): reasons, claims and paths hold brackets such as
    "the [triton] extra", which rich would take for style tags and drop."""
    from rich.console import Console

    stream = file if file is not None else (sys.stderr if stderr else sys.stdout)
    if hasattr(stream, "isatty") and stream.isatty():
        return Console(file=stream, markup=False)
    return Console(
        file=stream, width=PIPE_WIDTH, no_color=True, highlight=False, soft_wrap=False, markup=False
    )


def add_fitted_columns(table, header, rows, left: tuple = ("mechanism",)) -> None:
    """Add ``header``'s columns to a rich ``table`` so that no cell is cut: each column is at least as wide
    as the longest word among its cells (a mechanism's name, a number), and longer text wraps at spaces.
    rich's default cut "2.144e-56" to "2.144e…" and every "sinkhorn" to "sinkho…" on a 60-column terminal.
    Print the table with ``crop=False``: one still wider than the terminal is printed whole, for the
    terminal to wrap, rather than cut at its edge. A header wraps at its spaces, never inside a word
    ("criterion" folded to "criterio" / "n"). Columns named in ``left`` (the row names) are left-justified;
    the others are right-justified when every cell is a number."""
    for i, name in enumerate(header):
        cells = [str(row[i]) for row in rows]
        widest = max([len(word) for cell in (*cells, name) for word in cell.split()] or [0])
        numeric = bool(cells) and all(_is_number(cell) for cell in cells if cell not in ("", "-"))
        justify = "left" if name in left or not numeric else "right"
        table.add_column(name, justify=justify, min_width=widest, overflow="fold")


def _is_number(cell: str) -> bool:
    try:
        float(cell.rstrip("%").lstrip("+"))
    except ValueError:
        return False
    return True


def hide_flag_types() -> None:
    """Leave the type cell of flags (``--overwrite``, ``--help``) empty in typer's help screens."""
    from typer.core import TyperOption

    original = getattr(TyperOption, "display_type_rich", None)
    if original is None or getattr(original, "_attnkit_flags_hidden", False):
        return  # a typer without this hook (other versions draw help differently): its help as it is

    def display_type_rich(self, ctx):
        if getattr(self, "is_flag", False) and self.metavar is None:
            return None
        return original(self, ctx)

    display_type_rich._attnkit_flags_hidden = True
    TyperOption.display_type_rich = display_type_rich


def escape_help_markup(app, _done: Optional[set] = None) -> None:
    """Escape rich markup in the help of ``app``'s commands and their options and arguments, so that text
    in square brackets ("pip install 'attnkit[bench]'") shows as written. Each help is escaped once, also
    where one option object serves several commands."""
    import inspect

    from rich.markup import escape

    done = set() if _done is None else _done
    for info in app.registered_commands:
        if info.help:
            info.help = escape(info.help)
        callback = info.callback
        if callback is None:
            continue
        if callback.__doc__ and not info.help:
            callback.__doc__ = escape(callback.__doc__)
        for parameter in inspect.signature(callback).parameters.values():
            default = parameter.default
            if getattr(default, "help", None) and id(default) not in done:
                done.add(id(default))
                default.help = escape(default.help)
    for group in app.registered_groups:  # sub-commands such as ``attnkit data fetch``
        if group.typer_instance is not None:
            escape_help_markup(group.typer_instance, done)
