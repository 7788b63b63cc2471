"""What batch stealing can win against DDP under bursts, by its protocol
alone: the straggler benchmark's clock simulated in one process with the
real claim board (``mltuner.tune.session._steal.ClaimBoard``) on a
simulated clock.

    python benchmarks/steal_sim.py [--workers 4] [--slacks 1,2] [--overheads 0.5,1.5,2.5]
                                   [--late-after 1.5,2] [--clocks 3000] [--seeds 3]

Each rank's clock: claim (the board may answer ``Wait``: claim again
then), read (wait until every rank's update of clock c - slack - 1 counts:
sent, or declared empty once its clock before counts, as the shards do),
compute ``t`` per part it holds, send, a fixed ``overhead`` (the clock's
cost beside the compute, in units of ``t``), then rank 1 sleeps ``burst``
t with probability ``p``. DDP's step is the same compute and overhead,
then an allreduce every rank waits for. Claims, sends and applies take no
time, so the table is the protocol's ceiling: where a measured ratio is far
below it, the system's own costs take the difference; where the ceiling
itself is low, the protocol does. Staleness's cost in accuracy per epoch is
not modelled (``staleness_sim.py`` measures that).

Printed: DDP's time / mltuner's for the same clocks, equal parts (no
stealing), stealing as stop 53 had it (claims never wait: a thief that
reaches the read needing the paused rank's next clock before that rank is
late waits out the pause in its read), and stealing with claims that wait,
at each lateness threshold; the median over seeds.
"""

from __future__ import annotations

import argparse
import heapq
import statistics
from collections.abc import Sequence

import numpy as np

from mltuner.tune.session._steal import ClaimBoard, Wait


class SimulatedJob:
    """One mltuner job of ``clocks`` clocks; returns its simulated time."""

    def __init__(self, workers: int, slack: int, clocks: int, overhead: float, burst: float, p: float,
                 late_after: float | None, seed: int, claims_wait: bool = True, jitter: float = 0.0) -> None:
        self.now = 0.0
        self.workers, self.slack, self.clocks = workers, slack, clocks
        self.claims_wait, self.jitter = claims_wait, jitter
        self.jitter_rng = np.random.default_rng([seed, 2])
        self.overhead, self.burst, self.p = overhead, burst, p
        self.rng = np.random.default_rng([seed, 1])
        self.board = None if late_after is None else ClaimBoard(workers, late_after, now=lambda: self.now)
        self.sent: list[set[int]] = [set() for _ in range(workers)]
        self.empty: list[set[int]] = [set() for _ in range(workers)]
        self.counted = [-1] * workers  # per rank: the last clock of an unbroken run of sent or declared ones
        self.events: list[tuple[float, int, int]] = []  # (time, order, rank)
        self.order = 0
        self.clock = [0] * workers
        self.stage = ["claim"] * workers
        self.parts = [1.0] * workers
        self.blocked: set[int] = set()

    def _at(self, when: float, rank: int) -> None:
        self.order += 1
        heapq.heappush(self.events, (when, self.order, rank))

    def _count(self, q: int) -> None:
        while self.counted[q] + 1 in self.sent[q] or self.counted[q] + 1 in self.empty[q]:
            self.counted[q] += 1

    def run(self) -> float:
        for rank in range(self.workers):
            self._at(0.0, rank)
        while self.events:
            self.now, _, rank = heapq.heappop(self.events)
            self._step(rank)
            # A send or a declaration may free ranks blocked in a read.
            for other in sorted(self.blocked):
                if self._fresh(other):
                    self.blocked.discard(other)
                    self._at(self.now, other)
        return self.now

    def _fresh(self, rank: int) -> bool:
        need = self.clock[rank] - self.slack - 1
        return all(c >= need for c in self.counted)

    def _step(self, rank: int) -> None:
        c = self.clock[rank]
        if c >= self.clocks:
            return
        if self.stage[rank] == "claim":
            if self.board is None:
                self.parts[rank] = 1.0
            else:
                answer = self.board.claim(rank, 0, c, self.slack if self.claims_wait else None)
                if isinstance(answer, Wait):
                    self._at(self.now + answer.seconds, rank)
                    return
                self.parts[rank] = answer.parts_of(rank)
                for late, clock in answer.declare:
                    self.empty[late].add(clock)
                    self._count(late)
            self.stage[rank] = "read"
        if self.stage[rank] == "read":
            if not self._fresh(rank):
                self.blocked.add(rank)
                return
            self.stage[rank] = "compute"
            spread = self.jitter_rng.lognormal(0.0, self.jitter) if self.jitter > 0 else 1.0
            self._at(self.now + self.parts[rank] * spread, rank)  # t = 1 per part
            return
        if self.stage[rank] == "compute":
            self.sent[rank].add(c)
            self._count(rank)
            pause = self.overhead
            if rank == 1 and self.rng.random() < self.p:
                pause += self.burst
            self.clock[rank] += 1
            self.stage[rank] = "claim"
            self._at(self.now + pause, rank)


def ddp_time(workers: int, clocks: int, overhead: float, burst: float, p: float, seed: int,
             jitter: float = 0.0) -> float:
    """Every step waits for the slowest rank; rank 1's pause after its step delays the next."""
    rng = np.random.default_rng([seed, 1])
    spreads = np.random.default_rng([seed, 2])
    now = 0.0
    for _ in range(clocks):
        pause = burst if rng.random() < p else 0.0
        compute = spreads.lognormal(0.0, jitter, workers).max() if jitter > 0 else 1.0
        now += compute + overhead + pause
    return now


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--slacks", default="1,2")
    parser.add_argument("--overheads", default="0.5,1.5,2.5", help="a clock's cost beside its compute, in t")
    parser.add_argument("--late-after", default="1,1.5,2,3", help="the board's thresholds, in typical clocks")
    parser.add_argument("--burst", type=float, default=10.0, help="rank 1's pause, in t")
    parser.add_argument("--p", type=float, default=0.1, help="the chance of a pause after a clock")
    parser.add_argument("--clocks", type=int, default=3000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--jitter", type=float, default=0.0,
                        help="each compute time times a log-normal factor of this sigma (0: none)")
    args = parser.parse_args(argv)
    slacks = [int(s) for s in args.slacks.split(",")]
    overheads = [float(o) for o in args.overheads.split(",")]
    thresholds = [float(v) for v in args.late_after.split(",")]
    names = ["equal", "steal, no claim waits (stop 53)"] + [f"steal, late after {v:g}" for v in thresholds]
    print(f"{args.workers} workers, rank 1 pausing {args.burst:g} t after a clock with p = {args.p:g}; "
          f"compute jitter sigma {args.jitter:g}; {args.clocks} clocks, median of {args.seeds} seeds; DDP's time / mltuner's (above 1: mltuner faster)\n")
    print("| overhead (t) | slack | " + " | ".join(names) + " |")
    print("|--:|--:|" + "--:|" * len(names))
    for overhead in overheads:
        for slack in slacks:
            cells = []
            for late_after, claims_wait in [(None, True), (2.0, False), *((v, True) for v in thresholds)]:
                ratios = []
                for seed in range(args.seeds):
                    ddp = ddp_time(args.workers, args.clocks, overhead, args.burst, args.p, seed, args.jitter)
                    sim = SimulatedJob(args.workers, slack, args.clocks, overhead, args.burst, args.p, late_after,
                                       seed, claims_wait, args.jitter)
                    ratios.append(ddp / sim.run())
                cells.append(f"{statistics.median(ratios):.2f}")
            print(f"| {overhead:g} | {slack} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
