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

Every rank claims each clock of a run before computing it, from one
:class:`ClaimBoard`: on one host a board file the ranks share
(:mod:`._shared_board`), otherwise rank 0's (directly on rank 0, through
:meth:`mltuner.Job.request` from the others). The first claim of clock k decides who
computes each rank's part of it. A rank is late when it has not claimed
clock k - 1 yet (a whole clock behind the first to arrive) and its last
claim is older than ``late_after`` typical clocks (the median time between
a rank's claims in the run, per part it computed; a thief computing two
parts gets twice that). The time keeps the jitter of ranks in step
from moving parts back and forth: under a slack they drift a clock apart
now and then, and a thief's clock, longer by the parts it took, would make
it the next one robbed. A late rank's part of k is split among the ranks
that are not, in rank order; every other part stays with its rank. Its
parts of the clocks before k that it has not claimed move too: the on-time
ranks compute them in clock k, beside their own (later than their turn),
unless the late rank also had others' parts to compute there. So the
clocks it was still on time for when its delay began are empty too, and no
shard waits for it. The decision is kept until every rank has claimed k,
so each part has exactly one set of owners whatever order the claims come
in.

A claim of clock k whose read would wait anyway, for a rank that has not
claimed a clock up to k - slack - 1 in which it still computes something,
waits (the board answers :class:`Wait`) until that rank claims or turns
late. A thief that ran a clock or two ahead of a rank before its delay
began otherwise went on to its read and waited out the delay there, with
no claim left to move the late rank's parts.

The typical clock carries over from a run to the next of as many samples a
clock (a training branch runs epoch by epoch, between validations): the
first clocks of a run are then judged too, instead of waiting for a new
median.
"""

from __future__ import annotations

import math
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from mltuner.exceptions import InvalidArgumentError

__all__ = ["CARRY_WINDOW", "CLAIM_SERVICE", "LATE_AFTER", "Claim", "ClaimBoard", "ClaimsThroughRankZero", "Owners",
           "Wait"]

CLAIM_SERVICE = "mltuner-batch-claims"

# A rank a clock behind is late once its last claim is this many typical
# clocks old: a thief's clock, longer by the parts it took, stays below it.
LATE_AFTER = 2.0
# Intervals between claims the typical clock is the median of, and how many
# a run needs before anyone can be late.
_INTERVALS = 64
_INTERVALS_TO_JUDGE = 8
# How far back a late rank's unclaimed parts move to the current clock (each
# rank keeps that many clocks' samples); older ones stay with it.
CARRY_WINDOW = 64
# A claim that waits for a rank to turn late asks again this often (per
# typical clock), and not more often than every _LEAST_POLL_S.
_POLLS_PER_CLOCK = 8
_LEAST_POLL_S = 100e-6
# Rank 0's interpreter switch interval while it answers claims over the network.
_SWITCH_INTERVAL_S = 0.0005

Owners = list[list[int]]
"""Per rank's part of a clock (by the run's shares), the ranks that compute
it, in the order they split it: ``[q]`` for a part that stays with rank q,
``[]`` for one computed in another clock."""


@dataclass(frozen=True)
class Claim:
    """The board's answer to a claim of clock k.

    Attributes:
        owners: who computes each rank's part of clock k, in clock k.
        carried: earlier clocks of the run whose parts some ranks compute
            in clock k: clock -> who computes each rank's part of it now
            (``[]`` for a part computed in its own clock).
        declare: ``(rank, clock)`` pairs of the run's clocks that the
            claimant declares empty on every shard: only the claim that
            decided clock k gets any.
    """

    owners: Owners
    carried: dict[int, Owners] = field(default_factory=dict)
    declare: list[tuple[int, int]] = field(default_factory=list)

    def computes(self, rank: int) -> bool:
        """Whether ``rank`` computes any samples in this clock."""
        return self.parts_of(rank) > 0

    def gives(self, rank: int) -> bool:
        """Whether ``rank``'s own part of this clock went to others."""
        return self.owners[rank] != [rank]

    def takes(self, rank: int) -> bool:
        """Whether ``rank`` computes a part of another rank's in this clock."""
        return (any(rank in who for r, who in enumerate(self.owners) if r != rank)
                or any(rank in who for owners in self.carried.values() for who in owners))

    def parts_of(self, rank: int) -> float:
        """How many ranks' parts ``rank`` computes in this clock, counting a
        piece of a part split n ways as 1/n (its own part alone is 1)."""
        return sum(1.0 / len(who) for owners in [self.owners, *self.carried.values()] for who in owners
                   if rank in who)

    def to_wire(self) -> dict[str, Any]:
        return {"owners": self.owners, "carried": [[clock, owners] for clock, owners in self.carried.items()],
                "declare": [list(pair) for pair in self.declare]}

    @staticmethod
    def from_wire(value: Any, world_size: int) -> Claim:
        """The answer rank 0 sent (it came over the network), checked: one
        list of distinct ranks per rank in ``owners`` and in each carried
        clock's, and ``declare`` pairs of a rank and a clock."""
        def owners_ok(owners: Any) -> bool:
            return (isinstance(owners, list) and len(owners) == world_size
                    and all(isinstance(part, list) and len(set(part)) == len(part) and all(_rank_ok(q, world_size)
                                                                                           for q in part)
                            for part in owners))

        def pairs_ok(pairs: Any, second_ok: Callable[[Any], bool]) -> bool:
            return isinstance(pairs, list) and all(isinstance(p, list) and len(p) == 2 and second_ok(p[1])
                                                   for p in pairs)
        carried: Any = value.get("carried") if isinstance(value, dict) else None
        declare: Any = value.get("declare") if isinstance(value, dict) else None
        ok = (isinstance(value, dict) and owners_ok(value.get("owners"))
              and pairs_ok(carried, owners_ok) and all(_clock_ok(c) for c, _ in carried)
              and pairs_ok(declare, _clock_ok) and all(_rank_ok(r, world_size) for r, _ in declare))
        if not ok:
            raise InvalidArgumentError(f"rank 0 answered a batch claim with {str(value)[:200]}")
        return Claim(value["owners"], {int(c): owners for c, owners in carried},
                     [(int(r), int(c)) for r, c in declare])


@dataclass(frozen=True)
class Wait:
    """The board's answer to a claim it cannot decide yet: a rank the
    claimant's read waits for has neither claimed its clock nor turned late.
    Claim again after ``seconds``."""

    seconds: float

    def to_wire(self) -> dict[str, Any]:
        return {"wait": self.seconds}


def _clock_ok(clock: Any) -> TypeGuard[int]:
    return isinstance(clock, int) and not isinstance(clock, bool) and clock >= 0


def _rank_ok(q: Any, world_size: int) -> bool:
    return isinstance(q, int) and not isinstance(q, bool) and 0 <= q < world_size


class ClaimBoard:
    """Rank 0's record of each rank's claims in the current run.

    Args:
        world_size: the ranks that share each clock's samples.
        late_after: how many typical clocks a rank a clock behind must have
            been silent to be late; 0: no wait (a clock behind is late).
        now: the clock of the claims' times (tests give their own).
    """

    def __init__(self, world_size: int, late_after: float = LATE_AFTER,
                 now: Callable[[], float] = time.monotonic) -> None:
        self._world = world_size
        self._late_after = late_after
        self._now = now
        self._lock = threading.Lock()
        self._run: int | None = None
        self._samples: int | None = None  # the run's samples a clock, when the claims said
        self._last: list[int] = []  # per rank: the last clock it claimed in the run
        self._claimed_at: list[float] = []  # per rank: when
        self._work: list[float] = []  # per rank: the parts it computes in that clock (its own is 1)
        # Recent times between a rank's claims, per part it computed between them.
        self._intervals: deque[float] = deque(maxlen=_INTERVALS)
        # Clocks some rank has not claimed yet: their owners (rewritten when a part moves on) and the
        # earlier clocks' parts computed in them.
        self._owners: dict[int, Owners] = {}
        self._carried: dict[int, dict[int, Owners]] = {}

    def claim(self, rank: int, run: int, clock: int, slack: int | None = None,
              samples: int | None = None) -> Claim | Wait:
        """``rank`` starts ``clock`` (0-based) of ``run``: who computes what
        in that clock. Runs are numbered upwards, and each rank claims the
        clocks of a run in order, once each. A run whose first claim gives
        as many ``samples`` a clock as the run before keeps its typical
        clock.

        With the run's ``slack``, the first claims of a clock wait (a
        :class:`Wait`: ask again) while a rank the claimant's read of it
        waits for anyway is not late yet: one that has not claimed a clock
        up to ``clock - slack - 1`` in which it still computes something.
        Then that rank's parts move when it turns late, however long the
        others' reads would have waited for it."""
        with self._lock:
            now = self._now()
            if self._run is None or run > self._run:
                self._run, self._last, self._owners, self._carried = run, [-1] * self._world, {}, {}
                self._claimed_at, self._work = [now] * self._world, [1.0] * self._world
                if samples is None or samples != self._samples:
                    self._intervals.clear()
                self._samples = samples
            elif run < self._run:
                raise InvalidArgumentError(f"rank {rank} claimed a clock of run {run}, which ended (run "
                                           f"{self._run} is on)")
            if clock != self._last[rank] + 1:
                raise InvalidArgumentError(f"rank {rank} claimed clock {clock} of run {run}; its next is "
                                           f"{self._last[rank] + 1}")
            declare: list[tuple[int, int]] = []
            if clock not in self._owners:
                typical = self._typical()
                wait = self._wait_for_blockers(clock, slack, now, typical)
                if wait is not None:
                    return wait
                declare = self._decide(clock, now, typical)
            if clock > 0 and self._work[rank] >= 0.5:  # a clock of about a part or more: its time per part
                self._intervals.append((now - self._claimed_at[rank]) / self._work[rank])
            answer = Claim([list(p) for p in self._owners[clock]],
                           {c: [list(p) for p in owners] for c, owners in self._carried[clock].items()}, declare)
            self._last[rank], self._claimed_at[rank] = clock, now
            self._work[rank] = answer.parts_of(rank)
            everyone = min(self._last)
            for done in [k for k in self._owners if k <= everyone]:
                del self._owners[done], self._carried[done]
            return answer

    def state(self) -> dict[str, Any]:
        """Everything the board knows, as JSON can hold it (a board shared
        through a file, :mod:`._shared_board`)."""
        with self._lock:
            # Times in whole microseconds: integers cost JSON a fraction of floats.
            return {"run": self._run, "samples": self._samples, "last": list(self._last), "work": list(self._work),
                    "claimed_at": [round(t * 1e6) for t in self._claimed_at],
                    "intervals": [round(t * 1e6) for t in self._intervals],
                    "owners": [[k, [list(p) for p in owners]] for k, owners in self._owners.items()],
                    "carried": [[k, [[c, [list(p) for p in owners]] for c, owners in moved.items()]]
                                for k, moved in self._carried.items()]}

    def load(self, state: dict[str, Any]) -> None:
        """Takes over what :meth:`state` gave (from this job's own ranks)."""
        with self._lock:
            self._run, self._samples = state["run"], state["samples"]
            self._last, self._work = state["last"], state["work"]
            self._claimed_at = [t * 1e-6 for t in state["claimed_at"]]
            self._intervals = deque((t * 1e-6 for t in state["intervals"]), maxlen=_INTERVALS)
            self._owners = {int(k): owners for k, owners in state["owners"]}
            self._carried = {int(k): {int(c): owners for c, owners in moved} for k, moved in state["carried"]}

    def _typical(self) -> float | None:
        """The median time a part of a clock takes in this run, None before
        there are enough clocks to tell."""
        return statistics.median(self._intervals) if len(self._intervals) >= _INTERVALS_TO_JUDGE else None

    def _late_at(self, q: int, typical: float) -> float:
        """When rank ``q``, silent since its last claim, counts as late; a
        rank computing more than its part (a thief) gets the longer time it
        needs."""
        return self._claimed_at[q] + self._late_after * typical * max(self._work[q], 1.0)

    def _wait_for_blockers(self, clock: int, slack: int | None, now: float, typical: float | None) -> Wait | None:
        """Before deciding ``clock``: a :class:`Wait` while a rank that
        still computes something in a clock up to ``clock - slack - 1`` (the
        claimant's read needs its update) and has not claimed it is not late
        yet."""
        if slack is None or self._late_after <= 0 or typical is None:
            return None
        blockers = [self._late_at(q, typical) for q in range(self._world)
                    if any(self._owes(q, k) for k in range(self._last[q] + 1, clock - slack))]
        not_late = [at - now for at in blockers if at >= now]
        if not not_late:
            return None
        # Asked again soon: the blocker's claim, when it comes first, ends the wait as well.
        return Wait(max(min(min(not_late), typical / _POLLS_PER_CLOCK), _LEAST_POLL_S))

    def _owes(self, q: int, clock: int) -> bool:
        """Whether rank ``q`` computes anything in ``clock``, a clock it has
        not claimed: the shards wait for its update of it unless all moved
        (an empty clock, declared)."""
        owners = self._owners.get(clock)
        return owners is None or any(q in who for who in owners) or any(
            q in who for moved in self._carried[clock].values() for who in moved)

    def _decide(self, clock: int, now: float, typical: float | None) -> list[tuple[int, int]]:
        """The first claim of ``clock``: moves the late ranks' parts to the
        ranks on time; the clocks it empties. ``typical``: :meth:`_typical`."""
        behind = [q for q in range(self._world) if self._last[q] < clock - 1]
        if self._late_after <= 0:
            late = behind
        elif typical is None:
            late = []  # no typical clock yet
        else:
            late = [q for q in behind if now > self._late_at(q, typical)]
        on_time = [q for q in range(self._world) if q not in late]
        self._owners[clock] = [list(on_time) if q in late else [q] for q in range(self._world)]
        carried: dict[int, Owners] = {}
        declare = []
        for q in late:
            # Its parts of the clocks it has not claimed, where that was all it had to compute
            # there, move here too: then no shard waits for it.
            for earlier in range(max(self._last[q] + 1, clock - CARRY_WINDOW), clock):
                owners = self._owners[earlier]
                others = [who for r, who in enumerate(owners) if r != q]
                others += [who for moved in self._carried[earlier].values() for who in moved]
                if owners[q] == [q] and not any(q in who for who in others):
                    carried.setdefault(earlier, [[] for _ in range(self._world)])[q] = list(on_time)
                    owners[q] = []
                    declare.append((q, earlier))
            declare.append((q, clock))
        self._carried[clock] = carried
        return sorted(declare)

    def answer(self, rank: int, value: Any) -> dict[str, Any]:
        """:meth:`claim` for a request that came over the network:
        ``value`` is ``{"run": int, "clock": int, "slack": int, "samples":
        int}`` (slack and samples optional); the answer as :meth:`Claim.to_wire` or
        :meth:`Wait.to_wire` puts it."""
        fields = value if isinstance(value, dict) else {}
        run, clock, slack, samples = (fields.get(name) for name in ("run", "clock", "slack", "samples"))
        if not (_clock_ok(run) and _clock_ok(clock) and all(v is None or _clock_ok(v) for v in (slack, samples))):
            raise InvalidArgumentError(f"a batch claim needs non-negative integers run, clock, slack and samples, "
                                       f"got {value!r}")
        if not 0 <= rank < self._world:
            raise InvalidArgumentError(f"a batch claim from rank {rank}, outside 0..{self._world - 1}")
        return self.claim(rank, run, clock, slack, samples).to_wire()


class ClaimsThroughRankZero:
    """Claims from rank 0's board over the job's control channel (ranks on
    several hosts): rank 0 claims directly and serves the others'
    :meth:`mltuner.Job.request`.

    The requests' handler runs on the control channel's thread, which must
    take the interpreter lock from rank 0's training loop: at the default
    5 ms switch interval a claim waited up to that long whenever the loop
    ran Python (docs/results.md, "Stop 53"), so rank 0 switches threads
    every 0.5 ms until :meth:`close`.

    Args:
        rank, world_size: this rank's and the job's.
        serve, request: the job's (:meth:`mltuner.Job.serve`, ``request``).
        timeout_s: the longest a request waits for rank 0's answer.
        late_after: :class:`ClaimBoard`'s (rank 0's).
    """

    def __init__(self, rank: int, world_size: int, serve: Callable[[str, Any], None],
                 request: Callable[[str, Any, float], Any], timeout_s: float, late_after: float = LATE_AFTER) -> None:
        self._world = world_size
        self._serve, self._request, self._timeout_s = serve, request, timeout_s
        self._board = ClaimBoard(world_size, late_after) if rank == 0 else None
        self._switch_interval: float | None = None
        if self._board is not None:
            serve(CLAIM_SERVICE, self._board.answer)
            self._switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(min(self._switch_interval, _SWITCH_INTERVAL_S))

    def claim(self, rank: int, run: int, clock: int, slack: int | None = None,
              samples: int | None = None) -> Claim | Wait:
        """:meth:`ClaimBoard.claim`, on rank 0's board."""
        if self._board is not None:
            return self._board.claim(rank, run, clock, slack, samples)
        question = {name: value for name, value in (("run", run), ("clock", clock), ("slack", slack),
                                                     ("samples", samples)) if value is not None}
        answer = self._request(CLAIM_SERVICE, question, self._timeout_s)
        if isinstance(answer, dict) and set(answer) == {"wait"}:
            seconds = answer["wait"]
            if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 <= seconds < math.inf:
                raise InvalidArgumentError(f"rank 0 answered a batch claim with a wait of {seconds!r} s")
            return Wait(float(seconds))
        return Claim.from_wire(answer, self._world)

    def close(self) -> None:
        """Rank 0 stops serving claims and restores its switch interval."""
        if self._board is not None:
            self._serve(CLAIM_SERVICE, None)
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None
