"""The arguments the simulated systems check, as a real BranchSystem's would:
a driver under test that passes a freed branch or zero clocks gets the
library's own errors, not a KeyError or an assertion."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

from mltuner.exceptions import InvalidArgumentError, NotFoundError


def live_branch(branch: int | None, branches: Mapping[int, Any]) -> int:
    """``branch``, when it is live."""
    if branch not in branches:
        raise NotFoundError(f"branch {branch!r} is not live (live: {sorted(branches)})")
    return branch  # type: ignore[return-value]


def clock_count(clocks: int) -> int:
    if not isinstance(clocks, numbers.Integral) or isinstance(clocks, bool) or clocks < 1:
        raise InvalidArgumentError(f"clocks must be an integer >= 1, got {clocks!r}")
    return int(clocks)


def batch_size_of(tunables: Mapping[str, Any]) -> int:
    """The tunables' batch size (32 without one)."""
    batch = tunables.get("batch_size", 32)
    if not isinstance(batch, numbers.Integral) or isinstance(batch, bool) or batch < 1:
        raise InvalidArgumentError(f"batch_size must be an integer >= 1, got {batch!r}")
    return int(batch)
