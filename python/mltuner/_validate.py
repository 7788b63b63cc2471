"""Argument checks shared by the configuration and the API.

Every setting and argument is checked once, in Python, before it reaches the
engine: the error names the setting and the allowed range, and is the
library's own :class:`~mltuner.InvalidArgumentError` (a ``ValueError``; its
subclass :class:`~mltuner.ArgumentTypeError` is also a ``TypeError``), never
a pybind "incompatible function arguments" or an ``OverflowError``. Integers
must be integers (``10.7`` rows is an error, not 10 rows); reals must be
finite.
"""

from __future__ import annotations

import math
import numbers
from typing import TypeGuard

from mltuner.exceptions import ArgumentTypeError, InvalidArgumentError

__all__ = ["integer", "real", "boolean", "choice", "text", "is_integer", "is_real", "INT32_MAX", "INT64_MAX"]

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


def is_integer(value: object) -> TypeGuard[int]:
    """An int (numpy's too, which the narrowed type does not name), not a
    bool: ``True`` is no count."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: object) -> TypeGuard[float]:
    """A real number (numpy's too, which the narrowed type does not name),
    not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def integer(name: str, value: object, low: int, high: int) -> int:
    """``value`` as an int in ``[low, high]``; bools and non-integral numbers are refused."""
    if not is_integer(value):
        raise ArgumentTypeError(f"{name} must be an integer in [{low}, {_bound(high)}], "
                                   f"got {type(value).__name__} {value!r}")
    number = int(value)
    if not low <= number <= high:
        raise InvalidArgumentError(f"{name} must be in [{low}, {_bound(high)}], got {number}")
    return number


def real(name: str, value: object, low: float, high: float, *, low_open: bool = False,
         high_open: bool = False) -> float:
    """``value`` as a finite float in the interval (open ends as told)."""
    if not is_real(value):
        raise ArgumentTypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    number = float(value)
    below = number <= low if low_open else number < low
    above = number >= high if high_open else number > high
    if not math.isfinite(number) or below or above:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise InvalidArgumentError(f"{name} must be a finite number in {interval}, got {number!r}")
    return number


def boolean(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def choice(name: str, value: object, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise InvalidArgumentError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    return value


def text(name: str, value: object, max_chars: int = 256) -> str:
    """A non-empty string of printable characters (table names go into the
    wire schema and into messages)."""
    if not isinstance(value, str) or not value or len(value) > max_chars or not value.isprintable():
        raise InvalidArgumentError(f"{name} must be a non-empty printable string of at most {max_chars} "
                                   f"characters, got {value!r}")
    return value


def _bound(high: int) -> str:
    for exponent in (31, 32, 40, 62, 63, 64):
        if high == 2**exponent - 1:
            return f"2**{exponent} - 1"
        if high == 2**exponent:
            return f"2**{exponent}"
    return str(high)
