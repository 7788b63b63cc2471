"""The tuner's decision log: one JSON object per line, one line per decision."""

from __future__ import annotations

import enum
import json
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import IO, Any

__all__ = ["DecisionLog"]


def _plain(value: Any) -> Any:
    # JSON has no NaN or inf: a non-finite number (no progress, a diverged
    # loss) is written as null; the record's other fields say which.
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item"):  # numpy scalars
        return _plain(value.item())
    return value


class DecisionLog:
    """Writes and keeps the tuner's decisions.

    Every record has ``time`` (seconds since the epoch), ``event`` and
    ``phase``, and, where they apply, ``search`` (0 for the initial search,
    then one per re-tune), ``branch``, ``tunables``, ``loss`` and ``accuracy``,
    plus event-specific fields. Each line is flushed when written, so a
    crashed job leaves a readable log.

    Args:
        path: a file to append to; None keeps records in memory only.
        clock: the time source (tests pass a fake one).

    Ownership: the log opens ``path`` itself; call :meth:`close` (or use it
    as a context manager) when done.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *,
                 clock: Callable[[], float] = time.time) -> None:
        self._file: IO[str] | None = None if path is None else open(path, "a", encoding="utf-8")
        self._clock = clock
        self.records: list[dict[str, Any]] = []
        """Every record written, in order."""

    def write(self, event: str, *, phase: str, search: int | None = None,
              branch: int | None = None, tunables: Mapping[str, Any] | None = None,
              loss: float | None = None, accuracy: float | None = None,
              **fields: Any) -> dict[str, Any]:
        record: dict[str, Any] = {"time": self._clock(), "event": event, "phase": phase}
        optional = {"search": search, "branch": branch, "tunables": tunables,
                    "loss": loss, "accuracy": accuracy}
        record.update({k: v for k, v in optional.items() if v is not None})
        record.update(fields)
        record = _plain(record)
        self.records.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record, allow_nan=False) + "\n")
            self._file.flush()
        return record

    def events(self, event: str) -> list[dict[str, Any]]:
        """The records of one event kind."""
        return [r for r in self.records if r["event"] == event]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> DecisionLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
