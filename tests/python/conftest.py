"""Shared helpers of the mltuner test suite.

``run_workers`` drives one function per worker on its own thread (the engine's
blocking calls release the GIL), re-raises the first exception a thread raised
and fails the test when a thread does not finish in time, so that a hang or an
error on a worker thread can never pass silently.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from mltuner import Worker

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

# Generous enough for a loaded 2-core machine, far below pytest's 300 s timeout.
DEFAULT_THREAD_TIMEOUT_S = 60.0


def run_workers(
    fn: Callable[[Worker], Any] | Sequence[Callable[[Worker], Any]],
    workers: Sequence[Worker],
    *,
    timeout_s: float = DEFAULT_THREAD_TIMEOUT_S,
    on_error: Callable[[], Any] | None = None,
) -> list[Any]:
    """Runs ``fn(worker)`` (or ``fn[rank](worker)``) for every worker on its own
    thread and returns the results in rank order.

    The first exception raised on any thread is re-raised here (its traceback
    attached). ``on_error`` (e.g. ``cluster.shutdown``) is called as soon as a
    thread fails, so the other workers, which may be blocked waiting for the
    failed one, are released instead of waiting out their wait_timeout_s.
    A thread still running after ``timeout_s`` fails the test.
    """
    fns = list(fn) if isinstance(fn, Sequence) else [fn] * len(workers)
    assert len(fns) == len(workers), "one function per worker"
    results: list[Any] = [None] * len(workers)
    errors: list[tuple[int, BaseException]] = []
    lock = threading.Lock()
    failed = threading.Event()

    def body(rank: int) -> None:
        try:
            results[rank] = fns[rank](workers[rank])
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller
            with lock:
                errors.append((rank, error))
            failed.set()

    threads = [
        threading.Thread(target=body, args=(rank,), name=f"mltuner-worker-{rank}", daemon=True)
        for rank in range(len(workers))
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    cleaned_up = False
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        if failed.is_set() and not cleaned_up and on_error is not None:
            cleaned_up = True
            on_error()
        for thread in threads:
            thread.join(timeout=0.05)
    stuck = [t.name for t in threads if t.is_alive()]
    if errors:
        rank, error = errors[0]
        if not cleaned_up and on_error is not None:
            on_error()
        raise AssertionError(f"worker {rank} raised {type(error).__name__}: {error}") from error
    if stuck:
        if on_error is not None:
            on_error()
        pytest.fail(f"worker threads {stuck} did not finish within {timeout_s} s")
    return results


def rel_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want| (norm-wise relative error)."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    scale = float(np.max(np.abs(want)))
    assert scale > 0, "reference is all zero: the test would not detect anything"
    return float(np.max(np.abs(got - want))) / scale


def nonzero_uniform(rng: np.random.Generator, shape: Sequence[int] | int, low: float = 0.25,
                    high: float = 1.0) -> np.ndarray:
    """Random float32 values with random signs and |x| in [low, high): never zero."""
    magnitude = rng.uniform(low, high, size=shape)
    sign = rng.choice(np.array([-1.0, 1.0]), size=shape)
    return (magnitude * sign).astype(np.float32)


@contextlib.contextmanager
def benchmark_module(file_name: str, module_name: str) -> Iterator[ModuleType]:
    """benchmarks/``file_name`` imported as ``module_name`` while in use:
    registered in sys.modules (dataclasses look their module up there), with
    benchmarks/ on sys.path for the modules beside it that it imports."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / file_name)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(module_name, None)
        sys.path.remove(str(BENCHMARKS))


def record_read_update(worker: Worker, table: Any, slack: int = 0) -> tuple[int, int]:
    """Records the simplest clock, a read of every row (with ``slack``) and
    an update of every row, finishes the virtual iteration and starts;
    returns the read's and the update's handles."""
    read = worker.virtual_read(table, slack=slack)
    worker.virtual_post_read(read)
    update = worker.virtual_pre_update(table)
    worker.virtual_update(update)
    worker.virtual_clock()
    worker.finish_virtual_iteration()
    worker.start_iterations()
    return read, update


@pytest.fixture(name="benchmark_module", scope="session")
def benchmark_module_fixture() -> Callable[[str, str], contextlib.AbstractContextManager[ModuleType]]:
    """The :func:`benchmark_module` helper."""
    return benchmark_module


@pytest.fixture(name="run_workers")
def run_workers_fixture() -> Callable[..., list[Any]]:
    """The :func:`run_workers` helper (test modules are imported with
    --import-mode=importlib, so they get helpers through fixtures)."""
    return run_workers


@pytest.fixture(name="record_read_update")
def record_read_update_fixture() -> Callable[[Worker, Any], tuple[int, int]]:
    return record_read_update


@pytest.fixture(name="rel_error")
def rel_error_fixture() -> Callable[[np.ndarray, np.ndarray], float]:
    return rel_error


@pytest.fixture(name="nonzero_uniform")
def nonzero_uniform_fixture() -> Callable[..., np.ndarray]:
    return nonzero_uniform


@pytest.fixture(autouse=True)
def private_key_directory(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Jobs without MLTUNER_SECRET use this user's loopback key: keep the
    tests' key out of the real run-time directory (child processes inherit it)."""
    directory = tmp_path_factory.getbasetemp() / "xdg-runtime"
    directory.mkdir(mode=0o700, exist_ok=True)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(directory))
    return directory
