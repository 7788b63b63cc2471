"""The rollback guard: a frozen copy of the best-validated model, and a way
back to it when training collapses (issue 18 item 1)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import optuna
import pytest

from mltuner.tune import (
    Choice,
    LogUniform,
    Outcome,
    SearchSpace,
    Tuner,
    TunerConfig,
    TrainingGuard,
    Uniform,
    at_least_as_aggressive,
)
from mltuner.tune.tuner import validation_collapsed

CLOCK_S = 0.125
SPACE = SearchSpace([LogUniform("lr", 0.1, 1.0)])
COLLAPSE_LR = 0.3   # settings at or above it kill the model...
COLLAPSE_CLOCK = 250  # ...once it has trained this many clocks (2.5 epochs)


def collapsed(t: Mapping[str, Any], c: int) -> bool:
    return float(t["lr"]) >= COLLAPSE_LR and c >= COLLAPSE_CLOCK


def loss(t: Mapping[str, Any], c: int) -> float:
    # A larger lr falls faster, so the search picks one; a dead network sits
    # at its starting loss.
    return 10.0 if collapsed(t, c) else 10.0 * math.exp(-0.02 * float(t["lr"]) * (c + 1)) + 0.1


def accuracy(t: Mapping[str, Any], c: int) -> float:
    return 0.1 if collapsed(t, c) else 0.9 * (1.0 - math.exp(-c / 150.0))


def run(system: Any, tmp_path: Path, space: SearchSpace = SPACE,
        **config: Any) -> tuple[Any, Tuner]:
    cfg = TunerConfig(sampler="random", seed=0, initial_trial_time_s=1.25, num_clocks_to_eval=10,
                      num_clocks_to_test=5, max_trials_per_search=6, study_name_prefix="job",
                      storage=f"journal:{tmp_path / 'optuna.journal'}", **config)
    tuner = Tuner(system, space, cfg)
    return tuner.run(), tuner


def test_a_winner_that_collapses_two_epochs_later_is_rolled_back(
        scripted_system: Any, tmp_path: Path) -> None:
    system = scripted_system(loss, seconds=lambda t: CLOCK_S, clocks_per_epoch=100,
                             accuracy=accuracy)
    result, tuner = run(system, tmp_path, max_epochs=12)
    log = tuner.log
    first = log.events("winner")[0]
    assert first["tunables"]["lr"] >= COLLAPSE_LR  # the fastest start: the search's choice

    # The guard saw the loss climb back to where it started, before the
    # validation, and went back to the model frozen at epoch 2.
    rollback = log.events("rollback")[0]
    assert rollback["reason"] == "loss_rise" and rollback["excluded"] is True
    assert rollback["tunables"] == first["tunables"]
    frozen = [r for r in log.events("freeze") if r["time"] < rollback["time"]][-1]
    assert rollback["to"] == frozen["branch"] and frozen["epoch"] == 2
    # The search after it starts from the frozen model and never proposes a
    # setting at least as aggressive as the one that failed.
    after = [r for r in log.events("fork_trial") if r["time"] > rollback["time"]]
    assert after and all(r["tunables"]["lr"] < first["tunables"]["lr"] for r in after)
    assert log.events("search_start")[1]["branch"] == frozen["branch"]
    # The first of them backs off: the failed setting with half its learning rate.
    assert after[0]["enqueued"] and after[0]["tunables"]["lr"] == pytest.approx(
        max(SPACE["lr"].low, first["tunables"]["lr"] / 2))

    # The job ends with the best-validated model, which is healthy; the
    # caller owns it and nothing else is alive.
    kind, tunables, clocks = system.branches[result.branch]
    assert not collapsed(tunables, clocks)
    assert result.best_accuracy == pytest.approx(accuracy(tunables, clocks))
    assert result.best_accuracy == max(result.accuracies)
    assert system.live() == [result.branch]
    assert result.rollbacks >= 1 and result.outcome is Outcome.MAX_EPOCHS

    # The study of the search that chose the setting records its collapse.
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(tmp_path / "optuna.journal")))
    initial = optuna.load_study(study_name="job-initial", storage=storage)
    failed = [t for t in initial.trials if t.state is optuna.trial.TrialState.FAIL]
    assert len(failed) == 1 and failed[0].params["lr"] == first["tunables"]["lr"]
    assert failed[0].user_attrs["outcome"] == "rolled_back"
    assert failed[0].user_attrs["reason"] == "loss_rise"
    training = optuna.load_study(study_name="job-training", storage=storage)
    ended = [t.user_attrs["ended"] for t in training.trials]
    assert ended[0] == "rolled_back: loss_rise" and ended[-1] == "end"


def test_a_validation_collapse_the_loss_does_not_show_is_rolled_back(
        scripted_system: Any, tmp_path: Path) -> None:
    # The loss stays healthy; only validation accuracy collapses.
    def healthy(t: Mapping[str, Any], c: int) -> float:
        return 10.0 * math.exp(-0.02 * float(t["lr"]) * (c + 1)) + 0.1

    system = scripted_system(healthy, seconds=lambda t: CLOCK_S, clocks_per_epoch=100,
                             accuracy=accuracy)
    result, tuner = run(system, tmp_path, max_epochs=8)
    rollback = tuner.log.events("rollback")[0]
    assert rollback["reason"] == "accuracy" and rollback["accuracy"] == pytest.approx(0.1)
    kind, tunables, clocks = system.branches[result.branch]
    assert not collapsed(tunables, clocks)
    assert result.best_accuracy == max(result.accuracies)


def test_the_job_returns_the_best_validated_branch(scripted_system: Any, tmp_path: Path) -> None:
    system = scripted_system(lambda t, c: 10.0 * math.exp(-0.01 * c) + 0.1,
                             seconds=lambda t: CLOCK_S, accuracies=[0.5, 0.6, 0.58])
    result, tuner = run(system, tmp_path, max_epochs=3, retune="off")
    freeze = tuner.log.events("freeze")[-1]
    # Epoch 3 (0.58) is within the margin: no rollback, but the result is
    # the copy frozen at epoch 2.
    assert not tuner.log.events("rollback")
    assert result.branch == freeze["branch"] and result.best_accuracy == 0.6
    assert system.live() == [result.branch]


def test_without_the_guard_nothing_is_frozen(scripted_system: Any, tmp_path: Path) -> None:
    system = scripted_system(lambda t, c: 10.0 * math.exp(-0.01 * c) + 0.1,
                             seconds=lambda t: CLOCK_S, accuracies=[0.5, 0.6, 0.58])
    result, tuner = run(system, tmp_path, max_epochs=3, retune="off", rollback=False)
    assert not tuner.log.events("freeze")
    assert system.max_live <= 1 + 6  # the parent and the trials, never a copy
    assert result.accuracies == [0.5, 0.6, 0.58] and system.live() == [result.branch]


# -- the guard's rules on their own ----------------------------------------------------


def chunk(values: list[float]) -> tuple[list[float], list[float]]:
    return [0.1] * len(values), values


def test_noise_at_the_floor_raises_no_alarm() -> None:
    guard = TrainingGuard(start_loss=10.0)
    wiggle = [1.0 + 0.05 * math.sin(i) for i in range(25)]
    assert guard.check(*chunk([5.0 - 0.1 * i for i in range(25)])) is None
    for shift in (0.0, 0.3, -0.2, 0.4, 0.1):
        assert guard.check(*chunk([v + shift for v in wiggle])) is None


def test_a_loss_back_at_its_start_raises_the_alarm_on_the_second_chunk() -> None:
    guard = TrainingGuard(start_loss=10.0)
    assert guard.check(*chunk([1.0] * 25)) is None
    assert guard.check(*chunk([9.5] * 25)) is None
    alarm = guard.check(*chunk([9.8] * 25))
    assert alarm is not None and alarm.reason == "loss_rise"
    assert alarm.reference == 1.0 and alarm.band == pytest.approx(0.5 * 9.0)


def test_a_non_finite_loss_is_divergence() -> None:
    guard = TrainingGuard(start_loss=10.0)
    alarm = guard.check(*chunk([1.0, math.nan]))
    assert alarm is not None and alarm.reason == "diverged"
    alarm = TrainingGuard(start_loss=10.0).check(*chunk([200.0] * 10))
    assert alarm is not None and alarm.reason == "diverged"


def test_small_batch_losses_spread_over_decades_are_not_divergence() -> None:
    # Late in training: a mean of 0.02, single batches from 0.001 to 0.3.
    guard = TrainingGuard(start_loss=2.3)
    spread = [0.001, 0.002, 0.01, 0.3, 0.004, 0.001, 0.02, 0.003, 0.25, 0.005] * 3
    for _ in range(6):
        assert guard.check(*chunk(spread)) is None


def test_at_least_as_aggressive() -> None:
    failed = {"lr": 0.5, "momentum": 0.9, "batch_size": 16, "staleness": 1}
    assert at_least_as_aggressive(failed, failed)
    assert at_least_as_aggressive({**failed, "lr": 0.8, "batch_size": 8}, failed)
    assert not at_least_as_aggressive({**failed, "lr": 0.8, "batch_size": 32}, failed)
    assert not at_least_as_aggressive({**failed, "momentum": 0.5}, failed)
    assert at_least_as_aggressive({"lr": 0.6}, {"lr": 0.5})


# -- a network that dies in its first epoch (the demo's lr 0.6 on MNIST-1D) ---------------

DEATH_LR = 0.3     # settings at or above it drop fastest at first...
DEATH_CLOCK = 80   # ...then sit at the starting loss from this clock on, which the
                   # guard sees only after the first validation (at chance)


def dies_early(t: Mapping[str, Any], c: int) -> bool:
    return float(t["lr"]) >= DEATH_LR and c >= DEATH_CLOCK


def early_loss(t: Mapping[str, Any], c: int) -> float:
    # Before it dies, the fast setting has made 5% progress: far inside the
    # rise band (whose floor is a tenth of the loss), so only its return to
    # the starting loss shows the death.
    if float(t["lr"]) >= DEATH_LR:
        return 10.0 if c >= DEATH_CLOCK else 10.0 - 0.5 * min(c, 40) / 40
    return 10.0 * math.exp(-0.004 * float(t["lr"]) * c)


def early_accuracy(t: Mapping[str, Any], c: int) -> float:
    return 0.1 if dies_early(t, c) else 0.9 * (1.0 - math.exp(-c / 150.0))


def test_a_winner_dead_before_its_first_validation_goes_back_to_the_parent(
        scripted_system: Any, tmp_path: Path) -> None:
    system = scripted_system(early_loss, seconds=lambda t: CLOCK_S, clocks_per_epoch=100,
                             accuracy=early_accuracy)
    result, tuner = run(system, tmp_path, max_epochs=6, initial_setting={"lr": 0.15})
    log = tuner.log
    first = log.events("winner")[0]
    assert first["tunables"]["lr"] >= DEATH_LR  # the fastest start: the search's choice

    # It validated at chance and was frozen as the best model; its loss was
    # not yet clearly below the start, so the parent (the root) was kept. The
    # guard sees the loss back at the start in epoch 2 and goes back to the
    # root, not to the copy of the dead model.
    assert log.events("validate")[0]["accuracy"] == pytest.approx(0.1)
    rollback = log.events("rollback")[0]
    assert rollback["reason"] == "collapsed" and rollback["excluded"] is True
    assert rollback["best_accuracy"] == pytest.approx(0.1) and rollback["epoch"] == 1
    assert rollback["target"] == "parent" and rollback["to"] == log.events("init")[0]["branch"]

    # The job ends with a trained model, the best-validated one.
    kind, tunables, clocks = system.branches[result.branch]
    assert not dies_early(tunables, clocks) and tunables["lr"] < DEATH_LR
    assert result.best_accuracy == pytest.approx(early_accuracy(tunables, clocks))
    assert result.best_accuracy == max(result.accuracies) and result.best_accuracy > 0.5
    assert system.live() == [result.branch]


def test_a_search_after_a_rollback_to_the_root_chooses_every_tunable(
        scripted_system: Any, tmp_path: Path) -> None:
    # Re-tunes search lr only here; a search from the untrained root after a
    # rollback chooses momentum too, with the initial search's trial cap.
    space = SearchSpace([LogUniform("lr", 0.1, 1.0), Uniform("momentum", 0.0, 0.9)])
    system = scripted_system(early_loss, seconds=lambda t: CLOCK_S, clocks_per_epoch=100,
                             accuracy=early_accuracy)
    cfg = TunerConfig(sampler="random", seed=0, initial_trial_time_s=1.25, num_clocks_to_eval=10,
                      num_clocks_to_test=5, max_trials_per_search=6, max_epochs=6,
                      initial_setting={"lr": 0.15, "momentum": 0.5}, retune_tunables=("lr",))
    tuner = Tuner(system, space, cfg)
    tuner.run()
    log = tuner.log
    rollback = log.events("rollback")[0]
    assert rollback["target"] == "parent" and rollback["to"] == log.events("init")[0]["branch"]
    after = [r for r in log.events("search_start") if r["time"] > rollback["time"]][0]
    assert after["from_start"] is True
    assert after["searched"] == ["lr", "momentum"] and after["trial_cap"] == 6
    # Its first trial is the failed setting with half the learning rate; the
    # root's own (untrained) setting is not tried first.
    failed = rollback["tunables"]
    assert after["first"] == [{**failed, "lr": pytest.approx(failed["lr"] / 2)}]


def test_a_loss_that_dies_before_it_got_far_raises_the_alarm() -> None:
    # 2.30 -> 2.23 -> back at 2.31: the whole progress is inside the rise
    # band; the return to the starting loss after a clear drop is the death.
    guard = TrainingGuard(start_loss=2.3033)
    down = [2.23 + 0.01 * math.sin(i) for i in range(50)]
    dead = [2.31 + 0.003 * math.sin(i) for i in range(50)]
    assert guard.check(*chunk(down)) is None and guard.trained
    assert guard.check(*chunk(dead)) is None and not guard.trained
    alarm = guard.check(*chunk(dead))
    assert alarm is not None and alarm.reason == "collapsed"


def test_a_slow_start_near_the_starting_loss_raises_no_alarm() -> None:
    # A small learning rate: chunk means wander around the start for a while
    # without ever going clearly below it, then come down.
    guard = TrainingGuard(start_loss=2.3033)
    for mean in (2.304, 2.303, 2.3035, 2.302, 2.3034, 2.3036, 2.29, 2.27, 2.2):
        values = [mean + 0.01 * math.sin(i) for i in range(50)]
        assert guard.check(*chunk(values)) is None
    assert guard.trained


def test_a_loss_clearly_above_the_start_raises_the_alarm() -> None:
    # A network that died within its trial never goes below the start in
    # training; it sits above it (worse than the untrained network).
    guard = TrainingGuard(start_loss=2.3033)
    dead = [2.36 + 0.01 * math.sin(i) for i in range(50)]
    assert guard.check(*chunk(dead)) is None
    alarm = guard.check(*chunk(dead))
    assert alarm is not None and alarm.reason == "collapsed"


def test_chunks_of_one_clock_are_too_short_to_call_a_collapse() -> None:
    # An epoch of one clock (40 samples, batches of 32) gives chunks of one
    # loss, without a spread: each a hair above the start counted as
    # "clearly above" it, and a job rolled back five times on noise.
    guard = TrainingGuard(start_loss=2.3033)
    for loss in (2.31, 2.305, 2.32, 2.29, 2.306, 2.31):
        assert guard.check([0.01], [loss]) is None
    assert guard.check([0.01], [math.nan]) is not None  # divergence is still caught


def test_one_small_dip_is_noise_two_or_a_deep_one_a_collapse() -> None:
    margin = 0.05
    assert not validation_collapsed([], 0.8, margin)
    assert not validation_collapsed([0.7], 0.8, margin)             # one dip of 10 points
    assert validation_collapsed([0.72, 0.7], 0.8, margin)           # two in a row
    assert not validation_collapsed([0.7, 0.78], 0.8, margin)       # recovered
    assert validation_collapsed([0.8, 0.1], 0.8, margin)            # deeper than 3 margins
    assert not validation_collapsed([0.76, 0.7], 0.8, margin)       # the first was within


def test_a_single_dip_of_a_noisy_setting_is_not_rolled_back(
        scripted_system: Any, tmp_path: Path) -> None:
    system = scripted_system(lambda t, c: 10.0 * math.exp(-0.01 * c) + 0.1,
                             seconds=lambda t: CLOCK_S, accuracies=[0.5, 0.6, 0.5, 0.65])
    result, tuner = run(system, tmp_path, max_epochs=4, retune="off")
    assert not tuner.log.events("rollback")
    assert result.accuracies == [0.5, 0.6, 0.5, 0.65] and result.best_accuracy == 0.65


def test_the_backoff_after_a_collapse_also_drops_the_staleness(
        scripted_system: Any, tmp_path: Path) -> None:
    space = SearchSpace([LogUniform("lr", 0.1, 1.0), Choice("staleness", [0, 1, 3], default=3)])
    system = scripted_system(loss, seconds=lambda t: CLOCK_S, clocks_per_epoch=100,
                             accuracy=accuracy)
    _, tuner = run(system, tmp_path, space, max_epochs=12)
    rollback = tuner.log.events("rollback")[0]
    after = [r for r in tuner.log.events("fork_trial") if r["time"] > rollback["time"]]
    failed = rollback["tunables"]
    assert after[0]["enqueued"] and after[0]["tunables"] == {
        "lr": pytest.approx(max(0.1, failed["lr"] / 2)), "staleness": 0}


def test_after_a_rollback_that_finds_nothing_in_budget_training_goes_on_safer(
        scripted_system: Any, tmp_path: Path) -> None:
    # From clock 200 on every healthy loss creeps up from 1.0, the level of
    # the lr = 0 branch there: the search after the collapse (from the model
    # frozen at epoch 2, made by the setting that collapsed) sees no progress
    # and runs out of budget. The job goes on with the backoff, not ends.
    def late(t: Mapping[str, Any], c: int) -> float:
        if collapsed(t, c):
            return 10.0
        return loss(t, c) if c < 200 else 1.0 + 0.001 * (c - 200)

    system = scripted_system(late, seconds=lambda t: CLOCK_S, clocks_per_epoch=100,
                             accuracy=accuracy, baseline=lambda c: 10.0 if c < 200 else 1.0)
    result, tuner = run(system, tmp_path, max_epochs=8)
    rollback = tuner.log.events("rollback")[0]
    failed = rollback["tunables"]
    assert tuner.log.events("no_progress")[-1]["time"] > rollback["time"]
    resume = tuner.log.events("resume")[0]
    assert resume["tunables"]["lr"] == pytest.approx(max(0.1, failed["lr"] / 2))
    assert result.outcome is Outcome.MAX_EPOCHS and len(result.accuracies) == 8


def test_collapsed_validations_are_no_plateau_when_the_search_after_them_runs_out_of_budget(
        scripted_system: Any, tmp_path: Path) -> None:
    # Best at the third validation, two slightly lower ones (a plateau shorter
    # than the re-tune's four), then a collapse. The search from the best model
    # sees no progress (every loss creeps up from clock 200) and runs out of
    # budget: that says nothing about the model, and the collapsed validation
    # is no sign of a plateau of the model gone back to, then or after (the
    # validations after it equal the best: no convergence yet). Training goes on.
    def late(t: Mapping[str, Any], c: int) -> float:
        return loss(t, c) if c < 200 else 1.0 + 0.001 * (c - 200)

    system = scripted_system(late, seconds=lambda t: CLOCK_S, clocks_per_epoch=100,
                             accuracies=[0.5, 0.6, 0.7, 0.68, 0.69, 0.67, 0.1, 0.70],
                             baseline=lambda c: 10.0 if c < 200 else 1.0)
    result, tuner = run(system, tmp_path, max_epochs=9, retune="off")
    rollback = tuner.log.events("rollback")[0]
    assert rollback["reason"] == "accuracy" and rollback["epoch"] == 7
    assert tuner.log.events("resume") and tuner.log.events("resume")[0]["time"] > rollback["time"]
    assert result.outcome is Outcome.MAX_EPOCHS and len(result.accuracies) == 9
