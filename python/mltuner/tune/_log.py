"""The tuner's decision log: one JSON object per line, one line per decision."""

from __future__ import annotations

import enum
import json
import logging
import math
import os
import time
from pathlib import Path
from collections.abc import Callable, Iterable, Mapping
from typing import IO, Any

__all__ = ["DecisionLog", "Listener", "format_tunables", "run_log_copy"]

_logger = logging.getLogger(__name__)

Listener = Callable[[dict[str, Any]], None]
"""Called with each record (JSON-ready: plain numbers, NaN as None) after it
is written. It must not modify the record."""


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


def format_tunables(tunables: Mapping[str, Any] | None, sep: str = " ") -> str:
    """``lr=0.0123 momentum=0.9 batch_size=32``: floats to 3 significant digits."""
    if not tunables:
        return ""
    return sep.join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in tunables.items())


def run_log_copy(path: str | os.PathLike[str] | None) -> Listener | None:
    """Under ``mltuner run`` (which sets ``$MLTUNER_TUNING_LOG`` and follows
    that file live, then draws it): a listener that appends every record to
    that file too, when the script chose another log file (``path``), whose
    records the run would otherwise never see. None when not under ``mltuner
    run``, or when ``path`` is that file (or None: the default is it)."""
    followed = os.environ.get("MLTUNER_TUNING_LOG")
    if not followed or path is None or Path(path).resolve() == Path(followed).resolve():
        return None
    target = Path(followed)

    def copy(record: dict[str, Any]) -> None:
        with open(target, "a", encoding="utf-8") as file:
            file.write(json.dumps(record, allow_nan=False) + "\n")

    return copy


class DecisionLog:
    """Writes and keeps the tuner's decisions.

    Every record has ``time`` (seconds since the epoch), ``event`` and
    ``phase``, and, where they apply, ``search`` (0 for the initial search,
    then one per re-tune), ``branch``, ``tunables``, ``loss`` and ``accuracy``,
    plus event-specific fields. Each line is flushed when written, so a
    crashed job leaves a readable log.

    Listeners (a live display, :class:`mltuner.tune.LiveDisplay`) see each
    record after it is written, in order, on the tuner's thread. A listener
    that raises is logged (``logging``, with its traceback) and removed: a
    broken display never stops the tuner.

    Args:
        path: a file to append to; None keeps records in memory only.
        clock: the time source (tests pass a fake one).
        listeners: callables given each record after it is written.

    Ownership: the log opens ``path`` itself; call :meth:`close` (or use it
    as a context manager) when done.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *,
                 clock: Callable[[], float] = time.time,
                 listeners: Iterable[Listener] = ()) -> None:
        self._file: IO[str] | None = None if path is None else open(path, "a", encoding="utf-8")
        self.path: Path | None = None if path is None else Path(path)
        """The file the records go to; None for a log in memory."""
        self._clock = clock
        self.records: list[dict[str, Any]] = []
        """Every record written, in order."""
        self.listeners: list[Listener] = list(listeners)
        """Called with each record after it is written; append to add one."""

    def write(self, event: str, *, phase: str, search: int | None = None,
              branch: int | None = None, tunables: Mapping[str, Any] | None = None,
              loss: float | None = None, accuracy: float | None = None,
              **fields: Any) -> dict[str, Any]:
        """Appends one record: the time, ``event``, ``phase``, the optional
        fields that are not None, and ``fields``. It goes to the file (one
        JSON line, flushed) and then to every listener; a listener that
        raises is removed with a warning. Returns the record."""
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
        for listener in list(self.listeners):
            try:
                listener(record)
            except Exception:
                # The log and the tuner matter more than a display: drop the
                # listener so that one failure is reported once, not per event.
                _logger.warning("decision log listener %r raised on a %r record and was "
                                "removed; the tuner goes on", listener, event, exc_info=True)
                self.listeners.remove(listener)
        return record

    def events(self, event: str) -> list[dict[str, Any]]:
        """The records of one event kind."""
        return [r for r in self.records if r["event"] == event]

    def close(self) -> None:
        """Closes the file; the records in memory stay. Closing twice does
        nothing."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> DecisionLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
