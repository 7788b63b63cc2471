"""Ranks whose data runs out first: their clocks lent to the ranks that
train on.

Data splits are often uneven (a dataset of 1,000 samples over 3 ranks, a
sampler without padding): one rank closes the job after N clocks while
another still trains. Under BSP the other's read of clock N + 1 waits for
the closed rank's clock N, which never comes. PyTorch DDP hangs there too,
unless the loop runs under ``Join``, whose joined ranks shadow the others'
all-reduces with zeros. Here the closing rank does that by itself: while it
waits in ``Job.close`` for every rank to arrive, it declares its own next
clocks empty on the shards (``Worker.declare_empty_clock``, the message
batch stealing uses), a few clocks ahead of what every rank has finished, so
the ranks that train on never wait for it. Each such clock counts the closed
rank's update as zero, as DDP's ``Join`` with its default
``divide_by_initial_world_size``.

Only where clocks are branch 0's (no ``Config.branches``): a tuning
session's clocks run on branches it schedules, and its ranks run the same
clocks anyway.
"""

from __future__ import annotations

from mltuner.client._worker import Table, Worker

__all__ = ["ClockLender", "LEND_AHEAD"]

# Clocks declared beyond the last one every rank finished: enough that a rank
# training on at slack s never waits on a poll (the closing rank looks every
# few milliseconds), few enough to be nothing for the shards.
LEND_AHEAD = 8


class ClockLender:
    """Declares a closing worker's clocks empty ahead of the others'
    progress (module docstring); :meth:`step` is called while it waits."""

    def __init__(self, worker: Worker, table: Table) -> None:
        self._worker = worker
        self._table = table
        self._ahead = (worker.read_slack or 0) + LEND_AHEAD
        self._next = int(worker.stats["clock"])  # the first clock this worker will not run
        self.first = self._next
        self._age = worker.data_age(table)

    @classmethod
    def for_worker(cls, worker: Worker) -> ClockLender | None:
        """A lender for ``worker``'s job, or None where it cannot lend (not
        started, clocks on branches, no communicated table)."""
        if not worker.iterations_started or worker.config.branches:
            return None
        table = next((t for t in worker.tables if not t.local), None)
        return None if table is None else cls(worker, table)

    @property
    def lent(self) -> int:
        """Clocks declared empty so far."""
        return self._next - self.first

    def step(self) -> bool:
        """Declares the clocks up to ``LEND_AHEAD`` past the last one every
        worker finished; True when the others finished a clock since the
        last call."""
        age = self._worker.data_age(self._table)  # every worker finished clock `age`
        progressed = age > self._age
        self._age = age
        while self._next <= age + 1 + self._ahead:
            self._worker.declare_empty_clock(self._worker.rank, 0, self._next)
            self._next += 1
        return progressed
