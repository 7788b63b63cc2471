"""Who computes which part of a clock when a worker falls behind
(``TuningSession(steal_batches=True)``).

Under a slack, a worker hit by a delay (a burst of load on its host, a
pause) falls up to ``slack`` clocks behind, and the others then wait for it.
With stealing, its parts go to the workers that are on time, so every
sample is still computed once, by someone else, and the late worker's own
clocks are empty: it only reads and clocks, catches up fast, and sends
updates of zero. The shards need not wait for those: the worker that made
the decision declares the late worker's empty clocks on every shard
(:meth:`mltuner.Worker.declare_empty_clock`), which then apply each clock
as soon as the on-time workers' updates are in, and drop the late worker's
zeros when they come. The session steals only in runs at slack >= 1: under
BSP the thief would wait for the late worker's previous clock anyway.

Rank 0 keeps a :class:`ClaimBoard`; every rank claims each clock of a run
before computing it (rank 0 directly, the others through
:meth:`mltuner.Job.request`). The first claim of clock k decides who
computes each rank's part of it: a rank that has not claimed clock k - 1
yet is late (a whole clock behind the first to arrive), and its part of k
is split among the ranks that are not, in rank order; every other part
stays with its rank. The late rank's part of k - 1, unclaimed, moves too:
the on-time ranks compute it in clock k, beside their own (one clock later
than its turn), unless the late rank also had others' parts to compute in
k - 1. So the clock the late rank was on time for when its delay began is
empty too, and no shard waits for it. The decision is kept until every
rank has claimed k, so each part has exactly one set of owners whatever
order the claims come in.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from mltuner.exceptions import InvalidArgumentError

__all__ = ["CLAIM_SERVICE", "Claim", "ClaimBoard", "Owners"]

CLAIM_SERVICE = "mltuner-batch-claims"

Owners = list[list[int]]
"""Per rank's part of a clock (by the run's shares), the ranks that compute
it, in the order they split it: ``[q]`` for a part that stays with rank q,
``[]`` for one computed in another clock."""


@dataclass(frozen=True)
class Claim:
    """The board's answer to a claim of clock k.

    Attributes:
        owners: who computes each rank's part of clock k, in clock k.
        carried: who computes each rank's part of clock k - 1 in clock k
            (``[]`` for a part computed in its own clock).
        declare: ``(rank, clock)`` pairs of the run's clocks that the
            claimant declares empty on every shard: only the claim that
            decided clock k gets any.
    """

    owners: Owners
    carried: Owners
    declare: list[tuple[int, int]] = field(default_factory=list)

    def computes(self, rank: int) -> bool:
        """Whether ``rank`` computes any samples in this clock."""
        return any(rank in who for who in self.owners + self.carried)

    def to_wire(self) -> dict[str, Any]:
        return {"owners": self.owners, "carried": self.carried, "declare": [list(p) for p in self.declare]}

    @staticmethod
    def from_wire(value: Any, world_size: int) -> Claim:
        """The answer rank 0 sent (it came over the network), checked: one
        list of distinct ranks per rank in ``owners`` and ``carried``, and
        ``declare`` pairs of a rank and a clock."""
        def owners_ok(owners: Any) -> bool:
            return (isinstance(owners, list) and len(owners) == world_size
                    and all(isinstance(part, list) and len(set(part)) == len(part) and all(_rank_ok(q, world_size)
                                                                                           for q in part)
                            for part in owners))
        declare = value.get("declare") if isinstance(value, dict) else None
        ok = (isinstance(value, dict) and owners_ok(value.get("owners")) and owners_ok(value.get("carried"))
              and isinstance(declare, list)
              and all(isinstance(p, list) and len(p) == 2 and _rank_ok(p[0], world_size)
                      and isinstance(p[1], int) and not isinstance(p[1], bool) and p[1] >= 0 for p in declare))
        if not ok:
            raise InvalidArgumentError(f"rank 0 answered a batch claim with {str(value)[:200]}")
        return Claim(value["owners"], value["carried"], [(int(r), int(c)) for r, c in declare])


def _rank_ok(q: Any, world_size: int) -> bool:
    return isinstance(q, int) and not isinstance(q, bool) and 0 <= q < world_size


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
        # Clocks some rank has not claimed yet: their owners (rewritten when a part is carried on) and carried parts.
        self._owners: dict[int, Owners] = {}
        self._carried: dict[int, Owners] = {}

    def claim(self, rank: int, run: int, clock: int) -> Claim:
        """``rank`` starts ``clock`` (0-based) of ``run``: who computes what
        in that clock. Runs are numbered upwards, and each rank claims the
        clocks of a run in order, once each."""
        with self._lock:
            if self._run is None or run > self._run:
                self._run, self._last, self._owners, self._carried = run, [-1] * self._world, {}, {}
            elif run < self._run:
                raise InvalidArgumentError(f"rank {rank} claimed a clock of run {run}, which ended (run "
                                           f"{self._run} is on)")
            if clock != self._last[rank] + 1:
                raise InvalidArgumentError(f"rank {rank} claimed clock {clock} of run {run}; its next is "
                                           f"{self._last[rank] + 1}")
            declare: list[tuple[int, int]] = []
            if clock not in self._owners:
                declare = self._decide(clock)
            self._last[rank] = clock
            answer = Claim([list(p) for p in self._owners[clock]], [list(p) for p in self._carried[clock]], declare)
            everyone = min(self._last)
            for done in [k for k in self._owners if k <= everyone]:
                del self._owners[done], self._carried[done]
            return answer

    def _decide(self, clock: int) -> list[tuple[int, int]]:
        """The first claim of ``clock``: moves the late ranks' parts to the
        ranks on time; the clocks it empties."""
        late = [q for q in range(self._world) if self._last[q] < clock - 1]
        on_time = [q for q in range(self._world) if q not in late]
        owners = [list(on_time) if q in late else [q] for q in range(self._world)]
        carried: Owners = [[] for _ in range(self._world)]
        declare = []
        previous, previous_carried = self._owners.get(clock - 1), self._carried.get(clock - 1)
        for q in late:
            # Its part of the clock before, if that was all it had to compute there, moves here too.
            if (previous is not None and previous_carried is not None and previous[q] == [q]
                    and not any(q in who for r, who in enumerate(previous + previous_carried) if r != q)):
                carried[q], previous[q] = list(on_time), []
                declare.append((q, clock - 1))
            declare.append((q, clock))
        self._owners[clock], self._carried[clock] = owners, carried
        return declare

    def answer(self, rank: int, value: Any) -> dict[str, Any]:
        """:meth:`claim` for a request that came over the network:
        ``value`` is ``{"run": int, "clock": int}``; the answer as
        :meth:`Claim.to_wire` puts it."""
        run = value.get("run") if isinstance(value, dict) else None
        clock = value.get("clock") if isinstance(value, dict) else None
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (run, clock)):
            raise InvalidArgumentError(f"a batch claim needs non-negative integers run and clock, got {value!r}")
        if not 0 <= rank < self._world:
            raise InvalidArgumentError(f"a batch claim from rank {rank}, outside 0..{self._world - 1}")
        return self.claim(rank, run, clock).to_wire()  # type: ignore[arg-type]
