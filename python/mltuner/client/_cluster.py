"""LocalCluster: several workers and their server shards in one process."""

from __future__ import annotations

from types import TracebackType

from mltuner import _core
from mltuner._config import Config
from mltuner.client._worker import Worker

__all__ = ["LocalCluster"]


class LocalCluster:
    """``num_workers`` workers, each with its server shard, joined by an
    in-process transport. Drive each worker from its own thread (blocking calls
    release the GIL), or a single worker from the main thread.

    Example:
        >>> with LocalCluster(num_workers=2) as cluster:
        ...     workers = cluster.workers
    """

    def __init__(self, num_workers: int = 1, config: Config | None = None) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.config = config or Config()
        self._cluster = _core.LocalCluster(self.config.to_core(), int(num_workers))
        self.workers = [Worker(self._cluster.worker(rank), owner=self._cluster) for rank in range(num_workers)]

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def worker(self, rank: int) -> Worker:
        return self.workers[rank]

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
