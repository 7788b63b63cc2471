"""The tuner end to end: a simulated quadratic model, and scripted curves for
the state machine's rules (plateaus, re-tunes, the winner's progress)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pytest

from mltuner.tune import (
    BranchKind,
    DecisionLog,
    LogUniform,
    Outcome,
    SearchSpace,
    Tuner,
    TunerConfig,
    TuningError,
    Uniform,
    default_space,
    plateaued,
    summarize_progress,
)
from mltuner.tune.tuner import LR_STEP, lr_neighbours, no_slower

LR_SPACE = SearchSpace([LogUniform("lr", 1e-5, 1.0)])


def best_lr_by_sweep(system: Any, clocks: int = 60) -> float:
    """The lr with the best slope from the initial weights, over 51 values."""
    root = system.fork(None, {"lr": 0.0}, BranchKind.INIT)
    system.run(root, 1)
    ev = system.fork(root, {"lr": 0.0}, BranchKind.EVALUATION)
    baseline = float(np.mean([r.loss for r in system.run(ev, 100)]))
    best = (math.inf, math.nan)
    for lr in np.logspace(-5, 0, 51):
        branch = system.fork(root, {"lr": float(lr)}, BranchKind.TRAINING)
        reports = system.run(branch, clocks)
        system.free(branch)
        times = list(np.cumsum([r.seconds for r in reports]))
        slope = summarize_progress(times, [r.loss for r in reports], baseline).slope
        if math.isfinite(slope) and slope < best[0]:
            best = (slope, float(lr))
    return best[1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_picks_an_lr_within_a_decade_of_the_best(quadratic_system: Any, seed: int) -> None:
    best = best_lr_by_sweep(quadratic_system(seed=seed))
    system = quadratic_system(seed=seed)
    config = TunerConfig(seed=seed, initial_trial_time_s=0.1, num_clocks_to_test=10,
                         retune="off", max_epochs=1, search_share=None)
    result = Tuner(system, LR_SPACE, config).run()
    assert result.outcome is Outcome.MAX_EPOCHS
    assert abs(math.log10(result.tunables["lr"] / best)) <= 1.0


def full_run(system: Any, tmp_path: Path, seed: int = 0, **config: Any) -> tuple[Any, Tuner]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = TunerConfig(seed=seed, initial_trial_time_s=0.2, num_clocks_to_test=10,
                      max_trials_per_search=40, study_name_prefix="job", **config)
    tuner = Tuner(system, default_space([8, 32, 128]), cfg, log=tmp_path / "decisions.jsonl")
    return tuner.run(), tuner


def test_tunes_retunes_and_stops(quadratic_system: Any, tmp_path: Path) -> None:
    system = quadratic_system(seed=0)
    result, tuner = full_run(system, tmp_path)
    assert result.outcome in (Outcome.CONVERGED, Outcome.NO_PROGRESS)
    assert result.searches >= 2  # the initial search and at least one re-tune
    assert max(result.accuracies) > 0.95
    # Every re-tune followed a plateau of 4 that was not yet one of 5.
    accuracies = [r["accuracy"] for r in tuner.log.events("validate")]
    assert accuracies == pytest.approx(result.accuracies)
    # (Batch checks, after a stretch's first validation, are the other kind.)
    for retune in [r for r in tuner.log.events("retune") if r["reason"] != "batch"]:
        seen = accuracies[: retune["epoch"]]
        assert plateaued(seen, 4) and not plateaued(seen, 5)
    if result.outcome is Outcome.CONVERGED:
        assert plateaued(accuracies, 5)
    # The caller owns the final training branch; everything else was freed.
    assert system.live() == [result.branch]

    # The decision log on disk: one JSON object per line, the same records.
    lines = (tmp_path / "decisions.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["event"] for r in records] == [r["event"] for r in tuner.log.records]
    events = {r["event"] for r in records}
    assert {"start", "init", "search_start", "starting_progress", "fork_trial", "summary",
            "winner", "train", "validate", "retune", "end"} <= events
    assert all({"time", "event", "phase"} <= set(r) for r in records)
    assert records[-1]["event"] == "end" and records[-1]["outcome"] == result.outcome.value


def test_same_seed_same_run(quadratic_system: Any, tmp_path: Path) -> None:
    first, _ = full_run(quadratic_system(seed=1), tmp_path / "a", seed=1, retune="marginal")
    second, _ = full_run(quadratic_system(seed=1), tmp_path / "b", seed=1, retune="marginal")
    assert first == second


# -- the state machine on scripted curves --------------------------------------------


def decaying(t: Mapping[str, Any], c: int) -> float:
    return 10.0 * math.exp(-0.01 * float(t["lr"]) * (c + 1))


SCRIPTED_SPACE = SearchSpace([LogUniform("lr", 0.1, 1.0)])


def scripted_run(system: Any, space: SearchSpace = SCRIPTED_SPACE,
                 **config: Any) -> tuple[Any, DecisionLog]:
    config.setdefault("max_trials_per_search", 4)
    config.setdefault("num_clocks_to_eval", 10)
    cfg = TunerConfig(sampler="random", seed=0, initial_trial_time_s=1.25, num_clocks_to_test=5, **config)
    tuner = Tuner(system, space, cfg)
    return tuner.run(), tuner.log


def test_winner_keeps_its_trial_progress(scripted_system: Any) -> None:
    system = scripted_system(decaying, seconds=lambda t: 0.125, accuracies=[0.5],
                             clocks_per_epoch=100)
    result, log = scripted_run(system)
    winner = log.events("winner")[0]
    first_train = log.events("train")[0]
    # The trial's clocks count toward the first epoch; no branch is re-forked.
    assert 10 <= winner["clocks"] < 100
    assert first_train["branch"] == winner["branch"]
    assert first_train["clocks"] == 100 - winner["clocks"]
    # Later epochs of that branch run whole epochs.
    later = [r for r in log.events("train")[1:] if r["branch"] == winner["branch"]]
    assert later and all(r["clocks"] == 100 for r in later)
    forked_after = [b for b, _, kind, _ in system.forks if b > winner["branch"]
                    and kind is BranchKind.TRAINING]
    assert winner["branch"] not in forked_after


def test_plateau_retune_then_stop(scripted_system: Any) -> None:
    accuracies = [0.1, 0.2, 0.3] + [0.3] * 20
    result, log = scripted_run(scripted_system(decaying, accuracies=accuracies))
    assert [r["epoch"] for r in log.events("retune")] == [7]  # 3 + 4
    assert result.outcome is Outcome.CONVERGED and result.epochs == 8  # 3 + 5
    assert result.searches == 2


def test_a_retune_gets_what_the_jobs_searches_have_left(scripted_system: Any) -> None:
    # The searches together may spend 10% of the job: the re-tune's share is
    # what the initial search left of it.
    accuracies = [0.1, 0.2, 0.3] + [0.3] * 20
    system = scripted_system(decaying, accuracies=accuracies, seconds=lambda t: 0.125,
                             clocks_per_epoch=100)
    result, log = scripted_run(system, max_epochs=12, max_trials_per_search=30, max_search_share=0.1)
    first, retune = log.events("starting_progress")
    spent = log.events("winner")[0]["seconds"]
    job = 12 * (100 + 5) * 0.125  # 12 epochs of training and validation
    assert retune["budget_s"] == pytest.approx(0.1 * job - spent)
    assert result.search_seconds <= 0.1 * job + 10 * 0.125


def test_a_retune_with_nothing_left_is_skipped(scripted_system: Any) -> None:
    # The initial search's evaluation branch alone (200 clocks, 25 s) is
    # past 20% of the job (6 epochs, 79 s): the plateau's re-tune is skipped,
    # and the plateau rule stops the job.
    system = scripted_system(decaying, accuracies=[0.5], seconds=lambda t: 0.125, clocks_per_epoch=100)
    result, log = scripted_run(system, max_epochs=6, num_clocks_to_eval=200, plateau_size_for_retune=2,
                               plateau_size_for_convergence=3)
    assert result.searches == 1 and not log.events("retune")
    skipped = log.events("retune_skipped")
    assert [r["epoch"] for r in skipped] == [3] and skipped[0]["reason"] == "search_budget"
    assert result.outcome is Outcome.CONVERGED and result.epochs == 4


def test_a_retune_keeps_its_share_and_the_floor_what_the_job_has_left(scripted_system: Any) -> None:
    accuracies = [0.1, 0.2, 0.3] + [0.3] * 20
    system = scripted_system(decaying, accuracies=accuracies, seconds=lambda t: 0.125,
                             clocks_per_epoch=100)
    result, log = scripted_run(system, max_epochs=12, max_trials_per_search=30)
    assert result.searches == 2
    first, retune = log.events("starting_progress")
    spent = log.events("winner")[0]["seconds"]
    # The re-tune's share is 10% of the job (12 measured epochs); the floor
    # may raise it to 20% of the job less what the first search spent, and
    # never below its share.
    assert retune["ceiling_s"] == pytest.approx(max(retune["budget_s"], 2 * retune["budget_s"] - spent))
    assert result.search_seconds == pytest.approx(sum(r["seconds"] for r in log.events("winner"))
                                                  + sum(r["seconds"] for r in log.events("no_progress")))


def test_plateau_sizes_are_configurable(scripted_system: Any) -> None:
    accuracies = [0.1, 0.2, 0.3] + [0.3] * 20
    result, log = scripted_run(scripted_system(decaying, accuracies=accuracies),
                               plateau_size_for_retune=2, plateau_size_for_convergence=3)
    assert [r["epoch"] for r in log.events("retune")] == [5]
    assert result.epochs == 6


def test_no_retune_when_off(scripted_system: Any) -> None:
    result, log = scripted_run(scripted_system(decaying, accuracies=[0.1, 0.2, 0.3, 0.3]),
                               retune="off")
    assert not log.events("retune") and result.searches == 1
    assert result.outcome is Outcome.CONVERGED and result.epochs == 8


def test_improvement_after_a_retune_postpones_the_stop(scripted_system: Any) -> None:
    accuracies = [0.1, 0.2, 0.3, 0.3, 0.3, 0.3, 0.3, 0.4] + [0.4] * 20
    result, log = scripted_run(scripted_system(decaying, accuracies=accuracies))
    assert [r["epoch"] for r in log.events("retune")] == [7, 12]
    assert result.epochs == 13 and result.outcome is Outcome.CONVERGED


def test_retune_trials_are_capped_at_the_previous_search(scripted_system: Any) -> None:
    accuracies = [0.1, 0.2, 0.3, 0.3, 0.3, 0.3, 0.3, 0.4] + [0.4] * 20
    _, log = scripted_run(scripted_system(decaying, accuracies=accuracies))
    starts = log.events("search_start")
    ends = log.events("winner")
    assert starts[0]["trial_cap"] == 4
    for start, previous in zip(starts[1:], ends):
        assert start["trial_cap"] == previous["trials"]


def test_retune_forks_trials_from_the_training_branch(scripted_system: Any) -> None:
    system = scripted_system(decaying, accuracies=[0.1, 0.2, 0.3, 0.3])
    result, log = scripted_run(system)
    training = log.events("winner")[0]["branch"]
    retune_start = log.events("search_start")[1]
    assert retune_start["branch"] == training
    retune_trials = {r["branch"] for r in log.events("fork_trial") if r["search"] == 1}
    retune_eval = log.events("starting_progress")[1]["branch"]
    parents = {p for b, p, _, _ in system.forks if b in retune_trials | {retune_eval}}
    assert retune_trials and parents == {training}
    assert training in system.freed  # freed once the re-tune had a winner


def test_a_retune_tries_the_current_setting_then_its_lr_a_step_up_and_down(scripted_system: Any) -> None:
    """The first trials of a re-tune do not hang on the sampler: the current
    setting, then its learning rate LR_STEP times higher and lower (clipped
    to the range); the winner climbs when the higher rate progresses faster."""
    space = SearchSpace([LogUniform("lr", 0.01, 1.0)])
    _, log = scripted_run(scripted_system(decaying, accuracies=[0.1, 0.2, 0.3, 0.3]), space)
    current = log.events("winner")[0]["tunables"]["lr"]
    start = log.events("search_start")[1]
    expected = [current, min(1.0, current * LR_STEP), max(0.01, current / LR_STEP)]
    expected = [lr for i, lr in enumerate(expected) if lr not in expected[:i]]
    assert [s["lr"] for s in start["first"]] == pytest.approx(expected)
    tried = [r["tunables"]["lr"] for r in log.events("fork_trial") if r["search"] == 1]
    assert tried[: len(expected)] == pytest.approx(expected)
    assert log.events("winner")[1]["tunables"]["lr"] >= current  # decaying: a higher rate is faster


def test_lr_neighbours_are_clipped_and_need_a_log_scale_lr() -> None:
    space = SearchSpace([LogUniform("lr", 1e-3, 1.0), Uniform("momentum", 0.0, 0.99)])
    assert lr_neighbours(space, {"lr": 1.0, "momentum": 0.5}) == [{"lr": pytest.approx(1.0 / LR_STEP),
                                                                  "momentum": 0.5}]
    low = lr_neighbours(space, {"lr": 1e-3, "momentum": 0.5})
    assert [n["lr"] for n in low] == [pytest.approx(1e-3 * LR_STEP)]
    assert lr_neighbours(SearchSpace([Uniform("momentum", 0.0, 0.99)]), {"momentum": 0.5}) == []


def test_a_retune_that_finds_nothing_goes_back_to_the_best_model(scripted_system: Any) -> None:
    # Past clock 300 the loss is flat, and so is the lr = 0 evaluation: no
    # trial from there makes progress. Validation never improves after epoch 1.
    def curve(t: Mapping[str, Any], c: int) -> float:
        return decaying(t, c) if c < 300 else 1.0

    system = scripted_system(curve, accuracies=[0.5], clocks_per_epoch=100,
                             baseline=lambda c: 10.0 if c < 300 else 1.0)
    result, log = scripted_run(system, rollback_margin=1.0)
    freeze = log.events("freeze")[0]
    assert freeze["epoch"] == 1
    # The plateau re-tune from the training branch (at clock 500) finds
    # nothing: the job does not end there, it goes back to the model of
    # epoch 1 (no setting is excluded) and searches from it.
    rollback = log.events("rollback")[0]
    assert rollback["reason"] == "search_found_nothing" and rollback["excluded"] is False
    assert rollback["to"] == freeze["branch"]
    assert log.events("search_start")[2]["branch"] == freeze["branch"]
    # The caller owns only the final branch, the best-validated one.
    assert system.live() == [result.branch]
    assert result.best_accuracy == 0.5


def test_a_search_from_the_best_model_that_finds_nothing_ends_the_job(
        scripted_system: Any) -> None:
    # From clock 100 on nothing makes progress any more.
    def curve(t: Mapping[str, Any], c: int) -> float:
        return decaying(t, c) if c < 100 else 20.0

    system = scripted_system(curve, accuracies=[0.5], clocks_per_epoch=100)
    result, log = scripted_run(system, rollback=False)
    assert result.outcome is Outcome.NO_PROGRESS
    assert log.events("no_progress")[0]["search"] == 1
    assert system.live() == [result.branch]


def test_without_initial_tuning_training_starts_at_once(scripted_system: Any) -> None:
    system = scripted_system(decaying, accuracies=[0.1, 0.2, 0.3, 0.3])
    start = {"lr": 0.5}
    result, log = scripted_run(system, initial_tuning=False, initial_setting=start)
    assert log.events("train_untuned")[0]["tunables"] == start
    assert log.events("search_start")[0]["search"] == 0
    assert log.events("retune")[0]["epoch"] == 7  # the only search is a re-tune
    assert [f[3] for f in system.forks if f[2] is BranchKind.TRAINING][0] == start


def test_nothing_to_search_just_trains(scripted_system: Any) -> None:
    space = SearchSpace([Uniform("lr", 0.0, 1.0, default=0.3, search=False)])
    system = scripted_system(decaying, accuracies=[0.1, 0.2, 0.3, 0.3])
    result, log = scripted_run(system, space)
    assert result.searches == 0 and not log.events("search_start")
    assert result.outcome is Outcome.CONVERGED and result.tunables == {"lr": 0.3}


def test_every_trial_branch_is_an_optuna_trial(scripted_system: Any, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'tuning.db'}"
    # Short trials: sqlite commits every intermediate value on its own.
    system = scripted_system(decaying, seconds=lambda t: 0.125, clocks_per_epoch=20,
                             accuracies=[0.1, 0.2, 0.3, 0.3])
    result, log = scripted_run(system, storage=url, study_name_prefix="job")
    assert result.studies == ["job-initial", "job-retune-1"]
    names = {s.study_name for s in optuna.get_all_study_summaries(url)}
    assert names == set(result.studies) | {"job-training"}
    assert result.training_study == "job-training"
    recorded = 0
    for name in result.studies:
        study = optuna.load_study(study_name=name, storage=url)
        assert all(t.state.is_finished() for t in study.trials)
        assert all(t.intermediate_values for t in study.trials)
        assert "winner_trial" in study.user_attrs
        recorded += len(study.trials)
    # The other TRAINING forks are the frozen copies of the best model.
    trial_forks = [f for f in system.forks if f[2] is BranchKind.TRAINING
                   and f[0] not in {r["branch"] for r in log.events("freeze")}]
    assert recorded == result.trials == len(trial_forks) == len(log.events("fork_trial"))


def test_a_periodic_retune_never_tries_a_lower_learning_rate(scripted_system: Any) -> None:
    """Validation still climbs, so the re-tunes are periodic: they search
    from the current learning rate up (short trials favour a lower rate by
    its smaller noise, which would slow a model that is still improving)."""
    system = scripted_system(decaying, accuracies=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7])
    space = SearchSpace([LogUniform("lr", 1e-3, 1.0), Uniform("momentum", 0.0, 0.99)])
    # Unbounded searches: on a job this short no re-tune could pay for two
    # trials at the job's trial time (see the climb-check tests).
    _, log = scripted_run(system, space, retune_every_epochs=2, max_epochs=6, search_share=None)
    retunes = log.events("retune")
    assert retunes and {r["reason"] for r in retunes} == {"periodic"}
    for start in log.events("search_start")[1:]:
        current = start["tunables"]["lr"]
        tried = [r["tunables"]["lr"] for r in log.events("fork_trial")
                 if r["search"] == start["search"]]
        assert tried and min(tried) >= current
        assert [s["lr"] for s in start["first"]] == pytest.approx(
            [current, *([min(1.0, current * LR_STEP)] if current < 1.0 else [])])


def test_no_slower_raises_the_learning_rates_floor() -> None:
    space = SearchSpace([LogUniform("lr", 1e-3, 1.0), Uniform("momentum", 0.0, 0.99)])
    raised = no_slower(space, {"lr": 0.05, "momentum": 0.5})
    assert (raised["lr"].low, raised["lr"].high, raised["lr"].search) == (0.05, 1.0, True)
    assert raised["momentum"] == space["momentum"]
    top = no_slower(space, {"lr": 1.0, "momentum": 0.5})
    assert not top["lr"].search and top["lr"].default == 1.0
    flat = SearchSpace([Uniform("momentum", 0.0, 0.99)])
    assert no_slower(flat, {"momentum": 0.5}) is flat


def test_the_job_ends_at_the_target_accuracy(scripted_system: Any) -> None:
    # Validation climbs 0.1 a epoch: 0.7 is first reached at epoch 7.
    system = scripted_system(decaying, accuracies=[0.1 * (i + 1) for i in range(10)])
    result, log = scripted_run(system, max_epochs=10, target_accuracy=0.7)
    assert result.outcome is Outcome.TARGET and result.epochs == 7
    assert result.best_accuracy == pytest.approx(0.7)
    assert system.live() == [result.branch]
    untargeted, _ = scripted_run(scripted_system(decaying, accuracies=[0.1 * (i + 1) for i in range(10)]),
                                 max_epochs=10)
    assert untargeted.outcome is Outcome.MAX_EPOCHS and untargeted.epochs == 10
    with pytest.raises(ValueError, match="target_accuracy"):
        TunerConfig(target_accuracy=1.5)


def test_the_job_ends_once_its_time_budget_is_spent(scripted_system: Any) -> None:
    # Clocks of 0.125 s, epochs of 100 + 5 validation clocks: 13.125 s each.
    system = scripted_system(decaying, accuracies=[0.1 * (i + 1) for i in range(10)],
                             seconds=lambda t: 0.125, clocks_per_epoch=100)
    result, log = scripted_run(system, max_epochs=10, time_budget_s=60.0, search_share=None)
    assert result.outcome is Outcome.TIME_BUDGET
    # It stops at the first validation past the budget, not before.
    assert result.seconds >= 60.0 > result.seconds - 13.125 - 1e-9
    assert system.live() == [result.branch]


def test_a_validation_weighs_each_clock_by_its_samples(scripted_system: Any) -> None:
    """Five TESTING clocks of 4, 4, 4, 4 and 2 samples, the last one all
    wrong: the split's accuracy is 16/18, not the clocks' mean 0.8 (a
    clock that reports no sample count keeps the plain mean)."""

    class Sized(scripted_system):  # type: ignore[misc, valid-type]
        def run(self, branch: int, clocks: int) -> Any:
            reports = super().run(branch, clocks)
            if self.branches[branch][0] is not BranchKind.TESTING:
                return reports
            sizes = [4] * (clocks - 1) + [2]
            return [type(r)(r.loss, r.seconds, 0.0 if k == clocks - 1 else 1.0, sizes[k])
                    for k, r in enumerate(reports)]

    result, log = scripted_run(Sized(decaying, accuracies=[0.5]), max_epochs=1)
    assert log.events("validate")[0]["accuracy"] == pytest.approx(16 / 18)


def test_a_non_finite_loss_before_a_retune_names_the_trained_model(scripted_system: Any) -> None:
    """The evaluation branch of a re-tune starts from the model trained so
    far: a NaN there is not 'from the first clock'."""
    accuracies = [0.1, 0.2, 0.3] + [0.3] * 20
    system = scripted_system(decaying, accuracies=accuracies, baseline=lambda done: math.nan if done > 10 else 20.0)
    with pytest.raises(TuningError, match="starts search 1, from branch .*the model trained so far"):
        scripted_run(system)


@pytest.mark.parametrize("epochs", [2, 3])
def test_a_first_trial_that_diverges_says_nothing_of_the_other_settings(epochs: int) -> None:
    # A short job's initial search at seed 0 first tries lr 16.7 of [1e-3,
    # 100], which diverges. It ended the search there (the floor paid only for
    # rounds of open trials), and the job with "no setting in the search
    # space trains this model". Now the floor pays for further settings where
    # the budget allows (3 epochs: a winner), and where even that is beyond
    # it (2 epochs) the job trains the start setting, much tamer than 16.7.
    from mltuner.testing import QuadraticSystem

    space = SearchSpace([LogUniform("lr", 1e-3, 100.0, default=1e-2)])
    config = TunerConfig(max_epochs=epochs, seed=0, max_trials_per_search=20, num_clocks_to_test=10)
    tuner = Tuner(QuadraticSystem(samples_per_epoch=6400), space, config)
    result = tuner.run()
    forked = [r["tunables"]["lr"] for r in tuner.log.events("fork_trial") if r["search"] == 0]
    assert forked[0] > 10.0  # the diverging first proposal
    if epochs == 3:
        assert len(forked) > 1 and tuner.log.events("winner")
    else:
        assert tuner.log.events("train_untuned")[0]["reason"] == "search_budget"
    assert max(result.accuracies) > 0.8


def test_the_journal_beside_a_relative_log_is_named_by_its_absolute_path(
        scripted_system: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `mltuner report` printed "optuna-dashboard run/optuna.journal", a path
    # relative to the job's directory, wrong from anywhere else.
    from mltuner.tune.display import dashboard_command

    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    tuner = Tuner(scripted_system(decaying, accuracies=[0.5], clocks_per_epoch=100), SCRIPTED_SPACE,
                  TunerConfig(sampler="random", seed=0, max_epochs=1, num_clocks_to_test=5),
                  log=str(Path("run") / "decisions.jsonl"))
    tuner.run()
    tuner.log.close()
    journal = tmp_path / "run" / "optuna.journal"
    assert tuner.storage == f"journal:{journal}" and journal.exists()
    monkeypatch.chdir(tmp_path / "run")
    assert dashboard_command("decisions.jsonl") == f"optuna-dashboard {journal}"


def test_two_tuners_of_a_process_logging_in_one_folder_name_their_studies_apart(
        scripted_system: Any, tmp_path: Path) -> None:
    # Two sessions of one job within a second: the second's studies had the
    # first's names in their shared journal, and it was refused.
    prefixes = []
    for name in ("first", "second"):
        tuner = Tuner(scripted_system(decaying, accuracies=[0.5], clocks_per_epoch=100), SCRIPTED_SPACE,
                      TunerConfig(sampler="random", seed=0, max_epochs=1, num_clocks_to_test=5),
                      log=str(tmp_path / f"{name}.jsonl"))
        tuner.run()
        prefixes.append(tuner.log.events("start")[0]["prefix"])
    assert prefixes[0] != prefixes[1]
