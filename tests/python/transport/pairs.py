"""Two ranks of one job on threads of this process, each Job with its own
ZeroMQ context and sockets, so the traffic between them is real (ipc:// or
tcp:// on 127.0.0.1)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

import mltuner
from mltuner.launch import ProcessEnv
from mltuner.launch._env import free_port

SECRET = "transport-test-secret"


def start_pair(config: mltuner.Config | None = None, **job_kwargs: Any) -> list[mltuner.Job]:
    port = free_port()
    jobs: list[mltuner.Job | None] = [None, None]
    errors: list[BaseException] = []

    def join(rank: int) -> None:
        env = ProcessEnv(rank=rank, world_size=2, local_rank=rank, master_addr="127.0.0.1", master_port=port,
                         bind_host="127.0.0.1", secret=SECRET, source="mltuner")
        try:
            jobs[rank] = mltuner.Job(config or mltuner.Config(update_rule=mltuner.UpdateRule("add"),
                                                              wait_timeout_s=20),
                                     env=env, rendezvous_timeout_s=20, **job_kwargs)
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)

    run_both(join)
    if errors:
        raise errors[0]
    return [job for job in jobs if job is not None]


def run_both(body: Callable[[int], Any], timeout_s: float = 60.0) -> list[Any]:
    """body(rank) for ranks 0 and 1 on two threads; re-raises the first error."""
    results: list[Any] = [None, None]
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    assert not any(thread.is_alive() for thread in threads), "a rank did not finish in time"
    if errors:
        raise errors[0]
    return results


def train_adds(jobs: list[mltuner.Job], rows: int, width: int, clocks: int, *, read: bool = True) -> list[np.ndarray]:
    """Each rank adds (rank + 1) to every row of one table each clock (rule
    "add"), reading it at slack 0 when ``read``; returns the fetched table."""

    def run(rank: int) -> np.ndarray:
        worker = jobs[rank].worker
        table = worker.create_table("t", rows, width)
        handle = worker.virtual_read(table) if read else None
        if handle is not None:
            worker.virtual_post_read(handle)
        update = worker.virtual_pre_update(table)
        worker.virtual_update(update)
        worker.virtual_clock()
        worker.finish_virtual_iteration()
        worker.start_iterations()
        for _ in range(clocks):
            if handle is not None:
                worker.read(handle)
                worker.post_read(handle)
            worker.pre_update(update)[:] = rank + 1
            worker.update(update)
            worker.clock()
        worker.sync()
        return worker.fetch(table)

    return run_both(run)


def close_pair(jobs: list[mltuner.Job]) -> None:
    run_both(lambda rank: jobs[rank].close())
