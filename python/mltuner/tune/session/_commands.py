"""The commands rank 0's driver sends to every rank, one typed dataclass
each, and the reports every rank sends back at the end of a run. They
travel as JSON objects through ``Job.allgather`` (never pickle):
:meth:`to_wire` writes a command, :func:`parse_command` reads and checks
one, :func:`check_report` checks a report."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, Union

from mltuner.tune._errors import TuningError
from mltuner.tune._system import BranchKind

__all__ = ["ForkCommand", "FreeCommand", "RunCommand", "EndCommand", "ErrorCommand", "Command",
           "parse_command", "check_report"]


@dataclasses.dataclass(frozen=True)
class ForkCommand:
    """Fork ``child`` from ``parent`` (None: the INIT root) with ``tunables``."""

    child: int
    parent: int | None
    tunables: dict[str, Any]
    kind: BranchKind

    def to_wire(self) -> dict[str, Any]:
        return {"op": "fork", "child": self.child, "parent": self.parent,
                "tunables": dict(self.tunables), "kind": self.kind.value}


@dataclasses.dataclass(frozen=True)
class FreeCommand:
    """Free ``branch`` on every worker."""

    branch: int

    def to_wire(self) -> dict[str, Any]:
        return {"op": "free", "branch": self.branch}


@dataclasses.dataclass(frozen=True)
class RunCommand:
    """Run ``branch`` for ``clocks`` clocks, then report the losses. With
    ``shares``, rank r takes that fraction of each clock's samples (batch
    balancing); without, equal parts. With ``steal``, every rank claims each
    clock first (batch stealing, ``_steal.py``)."""

    branch: int
    clocks: int
    shares: tuple[float, ...] | None = None
    steal: bool = False

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"op": "run", "branch": self.branch, "clocks": self.clocks}
        if self.shares is not None:
            wire["shares"] = list(self.shares)
        if self.steal:
            wire["steal"] = True
        return wire


@dataclasses.dataclass(frozen=True)
class EndCommand:
    """The driver is done; ``branch`` (None when it freed it) holds the model."""

    branch: int | None
    tunables: dict[str, Any] | None

    def to_wire(self) -> dict[str, Any]:
        return {"op": "end", "branch": self.branch, "tunables": self.tunables}


@dataclasses.dataclass(frozen=True)
class ErrorCommand:
    """The driver failed with ``message``."""

    message: str

    def to_wire(self) -> dict[str, Any]:
        return {"op": "error", "message": self.message}


Command = Union[ForkCommand, FreeCommand, RunCommand, EndCommand, ErrorCommand]


def _is_number(value: Any) -> bool:
    """A JSON number (bool is an int to Python, not to JSON)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(wire: Mapping[str, Any], key: str, *, optional: bool = False) -> Any:
    value = wire.get(key)
    if value is None and optional:
        return None
    if not _is_int(value):
        raise TuningError(f"rank 0 sent a malformed tuning command ({key!r} is not an integer): "
                          f"{dict(wire)!r}")
    return value


def _dict(wire: Mapping[str, Any], key: str, *, optional: bool = False) -> Any:
    value = wire.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, dict):
        raise TuningError(f"rank 0 sent a malformed tuning command ({key!r} is not an object): "
                          f"{dict(wire)!r}")
    return dict(value)


def _shares(wire: Mapping[str, Any]) -> tuple[float, ...] | None:
    value = wire.get("shares")
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(
            _is_number(f) and math.isfinite(f) and f >= 0 for f in value) or sum(value) <= 0:
        raise TuningError(f"rank 0 sent a malformed tuning command ('shares' is not a list of fractions): "
                          f"{dict(wire)!r}")
    total = float(sum(value))
    return tuple(float(f) / total for f in value)


def parse_command(wire: Any) -> Command:
    """The command in a JSON object from rank 0; raises TuningError for
    anything else."""
    if not isinstance(wire, dict) or "op" not in wire:
        raise TuningError(f"rank 0 sent a malformed tuning command: {wire!r}")
    op = wire["op"]
    if op == "fork":
        try:
            kind = BranchKind(wire.get("kind"))
        except ValueError:
            raise TuningError(f"rank 0 sent a fork of unknown kind: {wire!r}") from None
        return ForkCommand(_int(wire, "child"), _int(wire, "parent", optional=True),
                           _dict(wire, "tunables"), kind)
    if op == "free":
        return FreeCommand(_int(wire, "branch"))
    if op == "run":
        steal = wire.get("steal", False)
        if not isinstance(steal, bool):
            raise TuningError(f"rank 0 sent a malformed tuning command ('steal' is not true or false): {wire!r}")
        return RunCommand(_int(wire, "branch"), _int(wire, "clocks"), _shares(wire), steal)
    if op == "end":
        return EndCommand(_int(wire, "branch", optional=True), _dict(wire, "tunables", optional=True))
    if op == "error":
        return ErrorCommand(str(wire.get("message")))
    raise TuningError(f"unknown tuning command {op!r} from rank 0")


def check_report(rank: int, report: Any, clocks: int, balanced: bool) -> None:
    """Raises TuningError unless ``report`` is a run's report of ``clocks``
    clocks as every rank sends it (it came over the network)."""

    def clocks_of(key: str, check: Callable[[Any], bool]) -> bool:
        values = report.get(key)
        return isinstance(values, list) and len(values) == clocks and all(check(v) for v in values)

    ok = (isinstance(report, dict)
          and clocks_of("loss", _is_number)
          and clocks_of("accuracy", lambda v: v is None or _is_number(v))
          and clocks_of("samples", lambda v: _is_int(v) and v >= 0))
    if ok and balanced:
        busy_clocks = report.get("busy_clocks")
        ok = (_is_number(report.get("busy")) and _is_number(report.get("busy_samples"))
              and isinstance(busy_clocks, list) and all(map(_is_number, busy_clocks)))
    if not ok:
        raise TuningError(f"rank {rank} sent a malformed report of a run of {clocks} clocks: {str(report)[:200]}")
