"""Rejection sampling of the generated datasets' splits: draws that avoid a held-out set."""

from __future__ import annotations

from typing import Callable, Hashable, TypeVar

__all__ = ["draw_avoiding"]

T = TypeVar("T")


def draw_avoiding(
    n: int,
    draw: Callable[[int], T],
    held_out: set,
    why: str,
    *,
    key: Callable[[T], Hashable] = lambda item: item,
    hold: bool = False,
) -> list[T]:
    """``n`` items of ``draw(i)`` (``i``: how many are kept so far) whose ``key`` is not in ``held_out``;
    with ``hold`` each kept key joins ``held_out`` (distinct items). After ``100 n`` draws a ``ValueError``
    ``why`` (the space is nearly exhausted)."""
    kept: list[T] = []
    attempts = 0
    while len(kept) < n:
        attempts += 1
        if attempts > 100 * n:
            raise ValueError(why)
        item = draw(len(kept))
        if key(item) not in held_out:
            kept.append(item)
            if hold:
                held_out.add(key(item))
    return kept
