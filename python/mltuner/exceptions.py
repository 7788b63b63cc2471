"""Exceptions raised by mltuner.

Every error the engine reports derives from :class:`MltunerError` and also
from the built-in exception a Python user would expect (``ValueError`` for bad
arguments, ``TimeoutError`` for an expired wait, ...), so both
``except MltunerError`` and ``except ValueError`` work.
"""

from __future__ import annotations

__all__ = [
    "MltunerError",
    "InvalidArgumentError",
    "ArgumentTypeError",
    "NotFoundError",
    "OutOfOrderError",
    "WaitTimeoutError",
    "ResourceExhaustedError",
    "ShutdownError",
    "CorruptMessageError",
    "InternalError",
    "PeerLostError",
    "NonFiniteError",
    "InterruptedWaitError",
    "error_for_code",
]


class MltunerError(Exception):
    """Base class of every mltuner error."""


class InvalidArgumentError(MltunerError, ValueError):
    """A wrong shape, dtype, size, row id or name."""


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument of the wrong type (a float where an integer is needed, ...)."""


class NotFoundError(MltunerError, LookupError):
    """An unknown table or handle."""


class OutOfOrderError(MltunerError, RuntimeError):
    """A call that breaks the recorded op order or the engine's phases."""


class WaitTimeoutError(MltunerError, TimeoutError):
    """A bounded wait ran out; the message says what was awaited."""


class ResourceExhaustedError(MltunerError, MemoryError):
    """The memory budget is too small; the message says how much is needed."""


class ShutdownError(MltunerError, RuntimeError):
    """The engine was shut down, or stopped by an earlier error."""


class CorruptMessageError(MltunerError, ValueError):
    """A malformed, truncated or foreign wire message."""


class InternalError(MltunerError, RuntimeError):
    """A broken invariant inside mltuner: please report it."""


class PeerLostError(MltunerError, ConnectionError):
    """Another worker process died or stopped answering; the message names its rank."""


class NonFiniteError(MltunerError, FloatingPointError):
    """An update holding NaN or infinite values was refused (``Config(check_finite=True)``);
    the message names the table, branch, clock and worker that sent it."""


class InterruptedWaitError(MltunerError, InterruptedError):
    """A wait of the engine ended early because the calling thread was
    interrupted. From Python the signal's own exception (KeyboardInterrupt
    for Ctrl-C) is raised instead; this one is what remains where none is."""


# Indexed by the engine's StatusCode (cpp/include/mltuner/status.h).
_BY_CODE: dict[int, type[MltunerError]] = {
    1: InvalidArgumentError,
    2: NotFoundError,
    3: OutOfOrderError,
    4: WaitTimeoutError,
    5: ResourceExhaustedError,
    6: ShutdownError,
    7: CorruptMessageError,
    8: InternalError,
    9: PeerLostError,
    10: NonFiniteError,
    11: InterruptedWaitError,
}


def error_for_code(code: int) -> type[MltunerError]:
    """The exception class for an engine status code (used by the binding)."""
    return _BY_CODE.get(code, InternalError)
