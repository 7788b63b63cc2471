"""The MNIST-1D program's settings for benchmarks: the staleness of a run
that does not search it, and the straggler (a slow factor scales with the
samples the rank computes; a burst does not), and how many clocks a
validation takes."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from mltuner.apps import mnist1d
from mltuner.apps.mnist1d import Straggler, build_space, parse_args
from mltuner.exceptions import InvalidArgumentError
from mltuner.tune import TuningSession


@pytest.mark.parametrize("given, expected", [([], 0), (["--staleness", "3"], 3), (["--staleness", "7,1"], 7)])
def test_a_run_that_does_not_search_staleness_trains_at_the_first_given(given: list[str], expected: int) -> None:
    args = parse_args(["--mode", "fixed", "--search", "lr", *given])
    assert build_space(args).defaults()["staleness"] == expected


def test_a_searched_staleness_searches_every_given_value() -> None:
    args = parse_args(["--search", "staleness", "--staleness", "1,3"])
    staleness = next(t for t in build_space(args) if t.name == "staleness")
    assert staleness.search and list(staleness.values) == [1, 3]


def options(**given: float) -> argparse.Namespace:
    values = {"slow_rank": 1, "slow_factor": 1.0, "slow_ms": 0.0, "slow_probability": 1.0, "seed": 0}
    values.update(given)
    return argparse.Namespace(**values)


def linear_cost(samples: int) -> float:
    return 1e-3 + 1e-4 * samples


def test_a_slow_factor_sleeps_its_share_of_the_compute_time_for_the_clocks_samples() -> None:
    measured: list[int] = []

    def cost(samples: int) -> float:
        measured.append(samples)
        return linear_cost(samples)

    straggler = Straggler(options(slow_factor=3.0), 1, cost, max_samples=64)
    assert measured == [1, 2, 4, 8, 16, 32, 64]  # measured once, before training
    for samples in (1, 7, 32, 48, 64, 100):  # between, at and beyond the measured sizes
        assert straggler.sleep_seconds(samples) == pytest.approx(2 * linear_cost(samples))
    assert straggler.sleep_seconds(0) == 0.0  # a validation clock
    assert measured == [1, 2, 4, 8, 16, 32, 64]


def test_fewer_samples_sleep_less_and_other_ranks_never_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(mnist1d.time, "sleep", slept.append)
    slow = Straggler(options(slow_factor=1.5), 1, linear_cost, max_samples=32)
    slow.after_clock(32)
    slow.after_clock(4)
    slow.after_clock(0)
    assert slept == [pytest.approx(0.5 * linear_cost(32)), pytest.approx(0.5 * linear_cost(4))]

    def never(samples: int) -> float:
        raise AssertionError("a rank that is not slowed measures nothing")

    other = Straggler(options(slow_factor=3.0, slow_ms=5.0), 0, never, max_samples=32)
    other.after_clock(32)
    assert len(slept) == 2


def test_a_burst_is_the_same_whatever_the_rank_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(mnist1d.time, "sleep", slept.append)
    straggler = Straggler(options(slow_ms=20.0, slow_probability=0.5), 1)
    for samples in [32, 1] * 200:
        straggler.after_clock(samples)
    assert set(slept) == {0.02}
    assert 150 < len(slept) < 250  # about half the clocks


def test_a_slow_factor_needs_the_compute_time() -> None:
    with pytest.raises(InvalidArgumentError, match="--slow-factor"):
        Straggler(options(slow_factor=2.0), 1)


def test_a_validation_covers_the_set_once_in_as_few_clocks_as_hold_it() -> None:
    args = parse_args(["--batch-size", "32"])
    assert mnist1d.validation_clocks(args, 400, 4) == 1  # one clock, whatever the training batch
    assert mnist1d.validation_clocks(args, 10_000, 2) == 5  # 5 clocks of at most 1024 a worker
    assert mnist1d.validation_clocks(parse_args(["--test-clocks", "3"]), 400, 4) == 3
    # As asked: through a batch a worker, 28 clocks of 400 samples on 2 workers came back as 25.
    assert mnist1d.validation_clocks(parse_args(["--test-clocks", "28"]), 400, 2) == 28
    assert mnist1d.validation_clocks(parse_args(["--test-clocks", "1000"]), 400, 4) == 100  # a sample each
    with pytest.raises(SystemExit):
        parse_args(["--test-clocks", "0"])


class _Made(Exception):
    pass


@pytest.mark.parametrize("given, clocks", [([], 1), (["--test-clocks", "3"], 3)])
def test_the_programs_validation_clocks_reach_its_session(monkeypatch: pytest.MonkeyPatch, given: list[str],
                                                         clocks: int) -> None:
    # --test-clocks once reached only a tuner config the session replaced, and validations
    # kept one training batch a clock.
    made: list[TuningSession] = []

    class Recorded(TuningSession):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)
            raise _Made  # the settings are all this test needs: no training

    monkeypatch.setattr(mnist1d, "TuningSession", Recorded)
    with pytest.raises(_Made):
        mnist1d.main(["--mode", "fixed", "--search", "", "--samples", "500", "--batch-size", "8", *given])
    assert made[0].config.num_clocks_to_test == clocks


def test_the_training_samples_check_args_counts_are_the_ones_load_gives() -> None:
    """check_args refuses a batch larger than the tuner's training split
    without loading the data: its count must be load()'s."""
    for samples in (100, 1000, 5000):
        args = mnist1d.parse_args(["--samples", str(samples)])
        assert len(mnist1d.load(args).x_train) == mnist1d.training_samples(samples)
