"""The checks of a call's options, written once: an int in a range (never a bool, which is an
int to Python), an optional one, a set of ints. Each raises
:class:`~maxent_arrow.errors.ArgumentError` naming the option, what it expects and what it
got, so every option of every package reads the same when it is wrong::

    ArgumentError: batch_groups: expected an int >= 1, got 0
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any, TypeGuard

from maxent_arrow.errors import ArgumentError

__all__ = ["check_int", "check_optional_int", "int_set", "is_int"]


def is_int(value: object) -> TypeGuard[numbers.Integral]:
    """Whether ``value`` is an integer (Python's or numpy's), and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _expected(low: int | None, high: int | None) -> str:
    if low is not None and high is not None:
        return f"an int in {low}..{high}"
    if low is not None:
        return f"an int >= {low}"
    if high is not None:
        return f"an int <= {high}"
    return "an int"


def check_int(value: Any, name: str, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an ``int``: an integer (not a bool) within ``low..high`` (each bound
    inclusive, ``None``: none); else an :class:`ArgumentError` naming ``name``."""
    if not _within(value, low, high):
        raise ArgumentError(f"{name}: expected {_expected(low, high)}, got {value!r}")
    return int(value)


def _within(value: Any, low: int | None, high: int | None) -> bool:
    if not is_int(value):
        return False
    number = int(value)
    return (low is None or number >= low) and (high is None or number <= high)


def check_optional_int(
    value: Any, name: str, *, low: int | None = None, high: int | None = None
) -> int | None:
    """:func:`check_int`, with ``None`` allowed (and returned)."""
    if value is None:
        return None
    if not _within(value, low, high):
        raise ArgumentError(f"{name}: expected None or {_expected(low, high)}, got {value!r}")
    return int(value)


def int_set(values: Iterable[int] | int, *, what: str) -> set[int]:
    """``values`` (an int, or an iterable of ints) as a set; anything else (a string, whose
    characters would read as digits, a float, a bool) is an :class:`ArgumentError` naming
    ``what``."""
    if is_int(values):
        return {int(values)}
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise ArgumentError(f"{what}: expected an int or a list of ints, got {values!r}")
    out = set()
    for value in values:
        if not is_int(value):
            raise ArgumentError(f"{what}: expected ints, got {value!r} in {values!r}")
        out.add(int(value))
    return out
