"""Who computes which part of a clock when a worker falls behind
(``TuningSession(steal_batches=True)``).

Under a slack, a worker hit by a delay (a burst of load on its host, a
pause) falls up to ``slack`` clocks behind, and the others then wait for it.
With stealing, its part of a clock goes to the workers that are on time,
so the clock's samples are still computed once each, by someone else, and
the late worker's own clock is empty: it only reads and clocks, catches up
fast, and sends an update of zero. Its empty clocks cost the others no
staleness either (read-my-writes carries the shards' momentum over them),
where the clocks it computed late would. (That holds for two workers: with
more, the on-time ones still miss each other's steps while the shards wait
for the clock the late one held when its delay began.) The session steals
only in runs at slack >= 1: under BSP the thief would wait for the late
worker's previous clock anyway.

Rank 0 keeps a :class:`ClaimBoard`; every rank claims each clock of a run
before computing it (rank 0 directly, the others through
:meth:`mltuner.Job.request`). The first claim of clock k decides who
computes each rank's part of it: a rank that has not claimed clock k - 1
yet is late (a whole clock behind the first to arrive), and its part is
split among the ranks that are not, in rank order; every other part stays
with its rank. The decision is kept until every rank has claimed k, so each
part has exactly one set of owners whatever order the claims come in.
"""

from __future__ import annotations

import threading
from typing import Any

from mltuner.exceptions import InvalidArgumentError

__all__ = ["CLAIM_SERVICE", "ClaimBoard", "Owners", "check_owners"]

CLAIM_SERVICE = "mltuner-batch-claims"

Owners = list[list[int]]
"""Per rank's part of a clock (by the run's shares), the ranks that compute
it, in the order they split it: ``[q]`` for a part that stays with rank q."""


class ClaimBoard:
    """Rank 0's record of each rank's claims in the current run.

    Args:
        world_size: the ranks that share each clock's samples.
    """

    def __init__(self, world_size: int) -> None:
        self._world = world_size
        self._lock = threading.Lock()
        self._run: int | None = None
        self._last: list[int] = []  # per rank: the last clock it claimed in the run
        self._owners: dict[int, Owners] = {}  # clocks some rank has not claimed yet

    def claim(self, rank: int, run: int, clock: int) -> Owners:
        """``rank`` starts ``clock`` (0-based) of ``run``: the owners of
        every part of that clock. Runs are numbered upwards, and each rank
        claims the clocks of a run in order, once each."""
        with self._lock:
            if self._run is None or run > self._run:
                self._run, self._last, self._owners = run, [-1] * self._world, {}
            elif run < self._run:
                raise InvalidArgumentError(f"rank {rank} claimed a clock of run {run}, which ended (run "
                                           f"{self._run} is on)")
            if clock != self._last[rank] + 1:
                raise InvalidArgumentError(f"rank {rank} claimed clock {clock} of run {run}; its next is "
                                           f"{self._last[rank] + 1}")
            owners = self._owners.get(clock)
            if owners is None:
                late = {q for q in range(self._world) if self._last[q] < clock - 1}
                on_time = [q for q in range(self._world) if q not in late]
                owners = [list(on_time) if q in late else [q] for q in range(self._world)]
                self._owners[clock] = owners
            self._last[rank] = clock
            everyone = min(self._last)
            for done in [k for k in self._owners if k <= everyone]:
                del self._owners[done]
            return owners

    def answer(self, rank: int, value: Any) -> Owners:
        """:meth:`claim` for a request that came over the network:
        ``value`` is ``{"run": int, "clock": int}``."""
        run = value.get("run") if isinstance(value, dict) else None
        clock = value.get("clock") if isinstance(value, dict) else None
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (run, clock)):
            raise InvalidArgumentError(f"a batch claim needs non-negative integers run and clock, got {value!r}")
        if not 0 <= rank < self._world:
            raise InvalidArgumentError(f"a batch claim from rank {rank}, outside 0..{self._world - 1}")
        return self.claim(rank, run, clock)  # type: ignore[arg-type]


def check_owners(owners: Any, world_size: int) -> Owners:
    """``owners`` as rank 0 answered it (it came over the network): a list
    of one non-empty list of distinct ranks per rank."""
    ok = (isinstance(owners, list) and len(owners) == world_size
          and all(isinstance(part, list) and part and len(set(part)) == len(part)
                  and all(isinstance(q, int) and not isinstance(q, bool) and 0 <= q < world_size for q in part)
                  for part in owners))
    if not ok:
        raise InvalidArgumentError(f"rank 0 answered a batch claim with {str(owners)[:200]}")
    return owners  # type: ignore[no-any-return]
