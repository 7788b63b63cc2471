"""LocalCluster: several workers and their server shards in one process."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TypeVar

from mltuner import _core
from mltuner._config import Config
from mltuner._config import MAX_WAIT_S
from mltuner._validate import integer, real
from mltuner.client._host_memory import HostMemory
from mltuner.client._worker import Worker
from mltuner.exceptions import ArgumentTypeError

__all__ = ["LocalCluster"]

T = TypeVar("T")
MAX_WORKERS = 1024  # threads of one process; each also hosts a shard


class LocalCluster:
    """``num_workers`` workers, each with its server shard, joined by an
    in-process transport. Drive each worker from its own thread (blocking calls
    release the GIL), or a single worker from the main thread.

    Example:
        >>> with LocalCluster(num_workers=2) as cluster:
        ...     workers = cluster.workers
    """

    def __init__(self, num_workers: int = 1, config: Config | None = None) -> None:
        num_workers = integer("LocalCluster: num_workers", num_workers, 1, MAX_WORKERS)
        if config is not None and not isinstance(config, Config):
            raise ArgumentTypeError(f"LocalCluster: config must be a Config, got {type(config).__name__}")
        self.config = config or Config()
        self._cluster = _core.LocalCluster(self.config.to_core(), num_workers, self.config.device)
        memory = HostMemory(self.config.host_memory_limit)  # one process: one account for every worker
        self.workers = [Worker(self._cluster.worker(rank), owner=self._cluster, config=self.config, host_memory=memory)
                        for rank in range(num_workers)]

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def worker(self, rank: int) -> Worker:
        return self.workers[rank]

    def run(self, fn: Callable[[Worker], T], *, timeout_s: float | None = None) -> list[T]:
        """Runs ``fn(worker)`` for every worker, each on its own thread, and
        returns the results by rank.

        One worker's exception is re-raised here, the others attached as
        notes: the first by rank that is a cause rather than an effect (a
        worker that failed makes the others time out waiting for it). If a
        worker is still running after ``timeout_s`` (default: the config's
        wait timeout times four), the cluster is shut down, which makes
        every blocked call raise ShutdownError, and
        :class:`~mltuner.WaitTimeoutError` is raised.
        """
        from mltuner.exceptions import ShutdownError, WaitTimeoutError

        results: list[T | None] = [None] * self.num_workers
        errors: list[BaseException | None] = [None] * self.num_workers

        def body(rank: int) -> None:
            try:
                results[rank] = fn(self.workers[rank])
            except BaseException as error:  # noqa: BLE001 - re-raised on the caller's thread
                errors[rank] = error

        # Daemon threads: a worker stuck in user code cannot keep the
        # interpreter alive after we gave up on it.
        threads = [
            threading.Thread(target=body, args=(r,), name=f"mltuner-worker-{r}", daemon=True)
            for r in range(self.num_workers)
        ]
        for thread in threads:
            thread.start()
        limit = (real("LocalCluster.run: timeout_s", timeout_s, 0, MAX_WAIT_S, low_open=True)
                 if timeout_s is not None else 4 * self.config.wait_timeout_s)
        deadline = time.monotonic() + limit
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            self.shutdown()  # every blocked engine call now raises ShutdownError
            for thread in threads:
                thread.join(self.config.wait_timeout_s)
            raise WaitTimeoutError(f"workers still running after {limit} s: {', '.join(stuck)}")
        raised = [(rank, e) for rank, e in enumerate(errors) if e is not None]
        if raised:
            effects = (WaitTimeoutError, ShutdownError)
            raised.sort(key=lambda item: isinstance(item[1], effects))  # stable: by rank within each kind
            rank, first = raised[0]
            for other_rank, other in raised[1:]:
                if hasattr(first, "add_note"):
                    first.add_note(f"worker {other_rank} also failed: {other!r}")
            raise first
        return results  # type: ignore[return-value]

    @property
    def rejected_messages(self) -> int:
        """Messages the transport dropped as invalid for their receiver."""
        return int(self._cluster.rejected_messages)

    def shutdown(self) -> None:
        """Stops every worker and the transport."""
        self._cluster.shutdown()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()
