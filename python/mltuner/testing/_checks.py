"""The arguments the simulated systems check, as a real BranchSystem's would:
a driver under test that passes a freed branch or zero clocks gets the
library's own errors, not a KeyError or an assertion."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mltuner._validate import INT64_MAX, integer
from mltuner.exceptions import NotFoundError


def live_branch(branch: int | None, branches: Mapping[int, Any]) -> int:
    """``branch``, when it is live."""
    if branch not in branches:
        raise NotFoundError(f"branch {branch!r} is not live (live: {sorted(branches)})")
    return branch  # type: ignore[return-value]


def clock_count(clocks: int) -> int:
    return integer("clocks", clocks, 1, INT64_MAX)


def batch_size_of(tunables: Mapping[str, Any]) -> int:
    """The tunables' batch size (32 without one)."""
    return integer("batch_size", tunables.get("batch_size", 32), 1, INT64_MAX)
