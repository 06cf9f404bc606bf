"""Comma-separated option values (``--lengths 1024,4096``, ``--heads 0,1``), parsed one way for every
command."""

from __future__ import annotations

from typing import Callable, Optional

__all__ = ["parse_list"]


def parse_list(
    text: Optional[str], name: str, cast: Callable = str, example: str = "256,1024"
) -> Optional[list]:
    """The items of ``--name``'s comma-separated ``text`` (``None`` when the option was not given), each
    through ``cast``; a list that names nothing (``","``), an item ``cast`` refuses or an item named twice is
    a ``ValueError`` naming the option."""
    if text is None:
        return None
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"--{name} {text!r} names nothing; pass a comma-separated list or leave it out "
                         "for the default")
    try:
        values = [cast(t) for t in items]
    except ValueError:
        raise ValueError(f"--{name} {text!r}: expected a comma-separated list, e.g. {example}") from None
    repeated = sorted({str(x) for x in values if values.count(x) > 1})
    if repeated:  # each entry is a row, a head or a layer: twice would do (or draw) it twice
        raise ValueError(f"--{name} {text!r} names {', '.join(repeated)} more than once; list each once")
    return values
