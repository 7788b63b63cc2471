"""benchmarks/steal_sim.py: the claim board in a simulated job of ranks in
step, one of them pausing 10 clocks' compute now and then. With claims that
wait for a rank to turn late, the others take its parts and finish well
before DDP; with claims that never wait (stop 53) ranks in step reach their
read before the paused rank is late and wait out every pause, as under
equal parts."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def sim(benchmark_module: Callable[[str, str], AbstractContextManager[ModuleType]]) -> Iterator[ModuleType]:
    with benchmark_module("steal_sim.py", "steal_sim") as module:
        yield module


def _speedup(sim: ModuleType, **kwargs: object) -> float:
    settings = {"workers": 4, "slack": 1, "clocks": 400, "overhead": 0.5, "burst": 10.0, "p": 0.1, "seed": 0,
                **kwargs}
    ddp = sim.ddp_time(settings["workers"], settings["clocks"], settings["overhead"], settings["burst"],
                       settings["p"], settings["seed"])
    return ddp / sim.SimulatedJob(**settings).run()


def test_waiting_claims_take_a_paused_ranks_parts(sim: ModuleType) -> None:
    assert _speedup(sim, late_after=None) == pytest.approx(1.0, abs=0.02)  # equal parts: the paused rank's pace
    assert _speedup(sim, late_after=2.0, claims_wait=False) == pytest.approx(1.0, abs=0.02)
    assert _speedup(sim, late_after=2.0) > 1.25


def test_no_pause_no_gain(sim: ModuleType) -> None:
    assert _speedup(sim, late_after=2.0, p=0.0) == pytest.approx(1.0, abs=0.01)
