"""Runs benchmark jobs side by side on a many-core host, each pinned to a
few cores of its own with `taskset`, so that every job still sees the small
machine it is measured on (demo_seeds.py, tuner_bench.py)."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import threading
from collections.abc import Callable, Sequence
from typing import Optional, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")
Cores = Optional[list[int]]


def core_slots(per_job: int, parallel: Optional[int] = None) -> list[Cores]:
    """One entry per job that may run at once: the cores it is pinned to, or
    None (unpinned, one job at a time: ``per_job`` cores or fewer, or no
    taskset). ``parallel`` caps the count (default: cores // per_job)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) <= per_job or shutil.which("taskset") is None:
        return [None]
    most = len(cores) // per_job
    count = most if parallel is None else max(1, min(parallel, most))
    return [cores[i * per_job:(i + 1) * per_job] for i in range(count)]


def pinned(command: Sequence[str], cores: Cores) -> list[str]:
    """``command`` under ``taskset -c CORES`` (its children inherit the
    pinning), or as it is when ``cores`` is None."""
    if cores is None:
        return list(command)
    return ["taskset", "-c", ",".join(map(str, cores)), *command]


def run_pinned(items: Sequence[Item], slots: list[Cores],
               job: Callable[[Item, Cores], Result]) -> list[Result]:
    """``job(item, cores)`` for every item, as many at once as there are
    slots, each on a slot's cores; results in the order of ``items``."""
    free = list(slots)
    lock = threading.Lock()

    def one(item: Item) -> Result:
        with lock:
            cores = free.pop(0)
        try:
            return job(item, cores)
        finally:
            with lock:
                free.append(cores)

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(slots)) as pool:
        return list(pool.map(one, items))
