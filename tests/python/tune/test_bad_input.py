"""Bad input gives a clear error, quickly, never a hang."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

import mltuner
from mltuner import InvalidArgumentError
from mltuner.testing import QuadraticSystem, ScriptedSystem
from mltuner.tune import (
    BranchKind,
    ClockReport,
    LogUniform,
    SearchSpace,
    Tuner,
    TunerConfig,
    TuningError,
    default_space,
)

pytestmark = pytest.mark.timeout(30)

FAST: dict[str, Any] = {"initial_trial_time_s": 0.1, "num_clocks_to_test": 5, "seed": 0}


def test_empty_search_space() -> None:
    with pytest.raises(InvalidArgumentError, match="search space is empty"):
        SearchSpace([])


def test_batch_size_larger_than_an_epoch(quadratic_system: Any) -> None:
    system = quadratic_system(samples_per_epoch=100)
    tuner = Tuner(system, default_space([16, 64, 256]), TunerConfig(**FAST))
    with pytest.raises(InvalidArgumentError, match=r"batch_size.*256.*larger than the whole epoch"):
        tuner.run()
    assert system.forks == []  # refused before any branch existed


def test_nan_loss_from_the_first_clock(quadratic_system: Any) -> None:
    system = quadratic_system(nan_from_start=True)
    tuner = Tuner(system, default_space([8, 32]), TunerConfig(**FAST))
    with pytest.raises(TuningError, match="non-finite loss from the first clock"):
        tuner.run()
    assert system.clocks_run <= 1 + 100  # the init clock and the evaluation branch


def test_every_trial_diverging_ends_the_initial_search(scripted_system: Any) -> None:
    system = scripted_system(lambda t, c: math.inf if c > 2 else 10.0)
    config = TunerConfig(max_trials_per_search=8, **FAST)
    with pytest.raises(TuningError, match="every one of the 8 trials of the initial search"):
        Tuner(system, SearchSpace([LogUniform("lr", 1e-3, 1.0)]), config).run()


def test_training_loss_turning_nan_after_tuning(scripted_system: Any) -> None:
    # Every setting turns NaN at clock 50, after its trial: each winner is
    # rolled back, and after max_rollbacks the job gives up.
    system = scripted_system(lambda t, c: 10.0 - 0.01 * c if c < 50 else math.nan)
    tuner = Tuner(system, SearchSpace([LogUniform("lr", 1e-3, 1.0)]),
                  TunerConfig(max_trials_per_search=2, max_rollbacks=2, **FAST))
    with pytest.raises(TuningError, match=r"training collapsed \(diverged\) 3 time\(s\) before any "
                                          "validation"):
        tuner.run()
    assert [r["reason"] for r in tuner.log.events("rollback")] == ["diverged"] * 3
    assert system.live() == []


def test_training_loss_turning_nan_without_the_guard(scripted_system: Any) -> None:
    system = scripted_system(lambda t, c: 10.0 - 0.01 * c if c < 50 else math.nan)
    tuner = Tuner(system, SearchSpace([LogUniform("lr", 1e-3, 1.0)]),
                  TunerConfig(max_trials_per_search=2, rollback=False, **FAST))
    with pytest.raises(TuningError, match="training loss of branch .* became nan in epoch 1"):
        tuner.run()


class ShortSystem:
    """Runs one clock fewer than asked."""

    def __init__(self, base: Any) -> None:
        self.base = base

    def fork(self, parent: int | None, tunables: Mapping[str, Any], kind: BranchKind) -> int:
        return int(self.base.fork(parent, tunables, kind))

    def free(self, branch: int) -> None:
        self.base.free(branch)

    def run(self, branch: int, clocks: int) -> Sequence[ClockReport]:
        return list(self.base.run(branch, clocks))[:-1]

    def clocks_per_epoch(self, tunables: Mapping[str, Any]) -> int:
        return int(self.base.clocks_per_epoch(tunables))


def test_a_system_that_runs_too_few_clocks(scripted_system: Any) -> None:
    system = ShortSystem(scripted_system(lambda t, c: 10.0 - 0.01 * c))
    tuner = Tuner(system, SearchSpace([LogUniform("lr", 1e-3, 1.0)]), TunerConfig(**FAST))
    # Caught at the first run: the INIT branch's one clock.
    with pytest.raises(TuningError, match="returned 0 clock reports for branch 0, asked to run 1"):
        tuner.run()


def test_testing_branch_without_accuracy(scripted_system: Any) -> None:
    system = scripted_system(lambda t, c: 10.0 - 0.01 * c, accuracies=[math.nan])
    tuner = Tuner(system, SearchSpace([LogUniform("lr", 1e-3, 1.0)]),
                  TunerConfig(max_trials_per_search=2, **FAST))
    with pytest.raises(TuningError, match="finite accuracy"):
        tuner.run()


def test_not_a_branch_system() -> None:
    with pytest.raises(InvalidArgumentError, match="must implement BranchSystem"):
        Tuner(object(), default_space([8]))  # type: ignore[arg-type]


def test_initial_setting_outside_the_space(scripted_system: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="outside"):
        Tuner(scripted_system(lambda t, c: 1.0), SearchSpace([LogUniform("lr", 1e-3, 1.0)]),
              TunerConfig(initial_tuning=False, initial_setting={"lr": 5.0}))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"sampler": "bohb"}, "unknown sampler"),
        ({"retune": "sometimes"}, "unknown retune mode"),
        ({"plateau_size_for_retune": 5, "plateau_size_for_convergence": 5}, "must be smaller"),
        ({"num_branches": 1}, "num_branches"),
        ({"num_clocks_to_eval": 0}, "num_clocks_to_eval"),
        ({"max_trials_per_search": 0}, "max_trials_per_search"),
        ({"max_epochs": 0}, "max_epochs"),
        ({"initial_trial_time_s": 0.0}, "initial_trial_time_s"),
        ({"initial_trial_time_s": math.nan}, "initial_trial_time_s"),
        ({"n_startup_trials": -1}, "n_startup_trials"),
        # Taken before (2.5 epochs ran 3; True counted as 1):
        ({"max_epochs": 2.5}, "max_epochs must be an integer"),
        ({"max_trials_per_search": 1.5}, "max_trials_per_search must be an integer"),
        ({"num_branches": 2.5}, "num_branches must be an integer"),
        ({"num_clocks_to_eval": True}, "num_clocks_to_eval must be an integer"),
        ({"target_accuracy": True}, "target_accuracy must be in"),
        ({"time_budget_s": True}, "time_budget_s must be"),
        ({"max_rollbacks": 1.0}, "max_rollbacks must be an integer"),
    ],
)
def test_bad_config(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        TunerConfig(**fields)


def test_plateau_sizes_may_be_equal_without_retuning() -> None:
    TunerConfig(retune="off", plateau_size_for_retune=5, plateau_size_for_convergence=5)


@pytest.mark.parametrize("system", [QuadraticSystem(), ScriptedSystem(lambda tunables, clock: 1.0)],
                         ids=["quadratic", "scripted"])
def test_the_simulated_systems_refuse_bad_calls_as_a_real_one(system: Any) -> None:
    branch = system.fork(None, {"batch_size": 32}, BranchKind.TRAINING)
    with pytest.raises(mltuner.InvalidArgumentError, match=r"clocks must be in \[1, 2\*\*63 - 1\], got 0"):
        system.run(branch, 0)
    with pytest.raises(mltuner.NotFoundError, match="branch 7 is not live"):
        system.run(7, 1)
    system.free(branch)
    with pytest.raises(mltuner.NotFoundError, match=f"branch {branch} is not live"):
        system.free(branch)
    if isinstance(system, QuadraticSystem):
        with pytest.raises(mltuner.InvalidArgumentError, match=r"batch_size must be in \[1, 2\*\*63 - 1\], got 0"):
            system.clocks_per_epoch({"batch_size": 0})
