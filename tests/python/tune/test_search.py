"""One search episode (mltuner.md §1.1 steps 1-4) on scripted loss curves."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping
from typing import Any

import pytest

from mltuner.tune import (
    BranchKind,
    Choice,
    DecisionLog,
    LogUniform,
    ProgressState,
    SearchBudget,
    SearchEpisode,
    SearchResult,
    SearchSpace,
    Searcher,
    TunerConfig,
)
from mltuner.testing import ScriptedSystem
from mltuner.tune.tuner import halving_cost, halving_size
from mltuner.tune.tuner._design import startup_design

LR_SPACE = SearchSpace([LogUniform("lr", 1e-3, 1.0)])
# 0.125 s clocks and a 1.25 s first trial time: exact binary fractions, so
# floor(trial_time / time_per_clock) is exact.
CLOCK_S = 0.125


def run_search(system: Any, space: SearchSpace = LR_SPACE, *, sampler: str = "random",
               trial_cap: int | None = 6, seed: int = 0, budget_s: float | None = None,
               budget: SearchBudget | None = None, enqueue: dict[str, Any] | None = None,
               untrained: bool = False, **config: Any) -> tuple[SearchResult, DecisionLog, int]:
    config.setdefault("initial_trial_time_s", 1.25)
    cfg = TunerConfig(sampler=sampler, num_clocks_to_eval=10, seed=seed, **config)
    root = system.fork(None, space.defaults(), BranchKind.INIT)
    system.run(root, 1)
    log = DecisionLog()
    searcher = Searcher(space, sampler=sampler, seed=seed, n_startup_trials=2)
    if enqueue is not None:
        searcher.enqueue(enqueue)
    episode = SearchEpisode(system, cfg, searcher, log, index=0, parent=root,
                            parent_tunables=space.defaults(), trial_cap=trial_cap,
                            budget_s=budget_s, budget=budget, untrained=untrained)
    return episode.run(), log, root


def clocks_by_branch(system: Any) -> Counter[int]:
    total: Counter[int] = Counter()
    for branch, clocks in system.runs:
        total[branch] += clocks
    return total


def trial_branches(system: Any) -> list[int]:
    return [b for b, parent, kind, _ in system.forks if kind is BranchKind.TRAINING]


def decaying(t: Mapping[str, Any], c: int) -> float:
    return 10.0 * math.exp(-float(t["lr"]) * (c + 1))


def rising(t: Mapping[str, Any], c: int) -> float:
    return 10.0 + 0.001 * c


def test_starting_progress_is_the_mean_loss_of_an_lr0_branch(scripted_system: Any) -> None:
    system = scripted_system(decaying, baseline=7.5)
    result, log, root = run_search(system)
    assert result.starting_progress == 7.5
    evals = [(b, p) for b, p, kind, _ in system.forks if kind is BranchKind.EVALUATION]
    assert len(evals) == 1 and evals[0][1] == root
    assert clocks_by_branch(system)[evals[0][0]] == 10
    assert evals[0][0] in system.freed


def test_converging_trials_then_successive_halving(scripted_system: Any) -> None:
    system = scripted_system(decaying, seconds=lambda t: CLOCK_S)
    result, log, root = run_search(system, trial_cap=6)
    # The first trial converges in its first 10 clocks: it sets the start length.
    assert result.trial_time == pytest.approx(10 * CLOCK_S)
    assert result.trials == 6
    trials = trial_branches(system)
    lrs = {b: t["lr"] for b, _, kind, t in system.forks if kind is BranchKind.TRAINING}
    # Rung 0 runs all six to the start length; each rung keeps the better
    # half and doubles their length: 6 -> 3 (20 clocks) -> 2 (40 clocks) -> 1.
    assert [r["rung"] for r in log.events("halving")] == [0, 1, 2]
    assert [r["length_s"] for r in log.events("halving")] == [1.25, 2.5, 5.0]
    ran = sorted(clocks_by_branch(system)[b] for b in trials)
    assert ran == [10, 10, 10, 20, 40, 40]
    assert result.winner is not None
    assert result.winner.tunables["lr"] == max(lrs.values())
    assert result.winner.summary is not None
    assert result.winner.summary.state is ProgressState.CONVERGING
    # The parent stays (the tuner frees it once the winner validated); of
    # the trials only the winner is alive.
    assert system.live() == [root, result.winner.branch]
    assert log.events("search_stop")[0]["reason"] == "trial_cap"
    assert {r["reason"] for r in log.events("free_trial")} == {"halved"}


def test_a_trial_that_cannot_beat_the_best_stops_early(scripted_system: Any) -> None:
    # The first trial falls fast; the others 100x slower: each stops after
    # 30 of its 80 clocks.
    def curve(t: Mapping[str, Any], c: int) -> float:
        return 10.0 - (0.1 if t["lr"] > 0.5 else 0.001) * (c + 1)

    space = SearchSpace([LogUniform("lr", 1e-3, 1.0)])
    system = scripted_system(curve, seconds=lambda t: CLOCK_S)
    searcher = Searcher(space, sampler="random", seed=0)
    searcher.enqueue({"lr": 0.9})
    cfg = TunerConfig(sampler="random", initial_trial_time_s=10.0, num_clocks_to_eval=10)
    root = system.fork(None, space.defaults(), BranchKind.INIT)
    log = DecisionLog()
    result = SearchEpisode(system, cfg, searcher, log, index=0, parent=root,
                           parent_tunables=space.defaults(), trial_cap=4).run()
    assert result.winner is not None and result.winner.tunables == {"lr": 0.9}
    stopped = [r for r in log.events("free_trial") if r["reason"] == "cannot_beat"]
    lrs = [t["lr"] for _, _, kind, t in system.forks if kind is BranchKind.TRAINING]
    assert len(stopped) == sum(1 for lr in lrs if lr <= 0.5) == 3
    # Its 10 first clocks, then one quarter of the 80 (the first check).
    assert [clocks_by_branch(system)[r["branch"]] for r in stopped] == [30] * 3


@pytest.mark.parametrize("epochs", [2, 10, 50])
def test_the_search_stays_within_its_budget(scripted_system: Any, epochs: int) -> None:
    # A rising loss: nothing converges, so without a budget the trial time
    # would double to the one-epoch cap and every trial would run it.
    system = scripted_system(rising,
                             seconds=lambda t: CLOCK_S, clocks_per_epoch=400)
    epoch_s = 400 * CLOCK_S
    budget = 0.1 * epochs * epoch_s
    result, log, _ = run_search(system, trial_cap=100, budget_s=budget, num_branches=30)
    # Within one trial run (its first samples) of the budget, the
    # evaluation branch included.
    assert result.seconds <= budget + 10 * CLOCK_S
    assert result.seconds == pytest.approx(
        sum(clocks for _, clocks in system.runs) * CLOCK_S - 1 * CLOCK_S)  # less the INIT clock
    assert log.events("search_stop")[0]["reason"] == "budget"


def test_no_progress_doubles_the_trial_time_and_ends_without_winner(
        scripted_system: Any) -> None:
    system = scripted_system(rising, seconds=lambda t: CLOCK_S, clocks_per_epoch=40)
    result, log, root = run_search(system, trial_cap=5)
    assert result.winner is None and not result.all_diverged
    assert result.trials == 5
    # 5 s is 40 clocks, the cap: once every open trial is capped, the time
    # stops doubling and each new trial runs straight to the cap.
    times = [r["trial_time_s"] for r in log.events("trial_time")]
    assert times == [1.25, 2.5, 5.0]
    # The one-epoch cap: no trial runs past 40 clocks, and all of them reach it.
    assert all(clocks_by_branch(system)[b] == 40 for b in trial_branches(system))
    assert {r["reason"] for r in log.events("free_trial")} == {"capped"}
    # Without a winner the parent (the model) stays; every trial is freed.
    assert system.live() == [root]
    assert log.events("no_progress")


def spiked(t: Mapping[str, Any], c: int) -> float:
    """One early spike, larger than any drop: the summariser finds no slope
    for any trial; for lr >= 0.1 the level then lies well below the start."""
    level = 6.0 if float(t["lr"]) >= 0.1 else 10.0 + 0.001 * c
    return level + (400.0 if c == 2 else 0.0)


def test_a_trial_clearly_below_the_start_wins_without_a_slope(scripted_system: Any) -> None:
    # Seen in the demo: every trial's short curve was too noisy for a slope,
    # the search ended with nothing and the job trained the start setting
    # (lr 0.01) to 44%. A trial whose losses lie clearly below the start wins.
    system = scripted_system(spiked, seconds=lambda t: CLOCK_S, clocks_per_epoch=40)
    result, log, _ = run_search(system, trial_cap=5, seed=1, untrained=True)
    lrs = [float(r["tunables"]["lr"]) for r in log.events("fork_trial")]
    assert any(lr >= 0.1 for lr in lrs) and any(lr < 0.1 for lr in lrs)  # both kinds were tried
    assert result.winner is not None and float(result.winner.tunables["lr"]) >= 0.1
    assert not math.isfinite(result.winner.slope)  # it won on its level, not its slope
    # From a trained model the level alone does not choose.
    again, _, _ = run_search(scripted_system(spiked, seconds=lambda t: CLOCK_S, clocks_per_epoch=40),
                             trial_cap=5, seed=1)
    assert again.winner is None


def test_concurrent_trials_grow_by_one_per_round(scripted_system: Any) -> None:
    system = scripted_system(rising, seconds=lambda t: CLOCK_S, clocks_per_epoch=1000)
    run_search(system, trial_cap=5)
    assert system.max_live == 1 + 5  # the parent and all five trials at once


def test_num_branches_bounds_concurrent_trials(scripted_system: Any) -> None:
    system = scripted_system(rising, seconds=lambda t: CLOCK_S, clocks_per_epoch=80)
    result, _, _ = run_search(system, trial_cap=6, num_branches=3)
    assert result.trials == 6
    assert system.max_live == 3  # the parent and two trials


def spiky(t: Mapping[str, Any], c: int) -> float:
    # Falls by d per clock with a rise of 2d at clock 4: UNSTABLE but progressing.
    d = float(t["lr"])
    return 10.0 - d * (c + 1) + (3 * d if c == 4 else 0.0)


def test_best_unstable_trial_wins_when_nothing_is_left(scripted_system: Any) -> None:
    system = scripted_system(spiky, seconds=lambda t: CLOCK_S, clocks_per_epoch=10)
    result, log, _ = run_search(system, trial_cap=4)
    lrs = [t["lr"] for _, _, kind, t in system.forks if kind is BranchKind.TRAINING]
    assert result.winner is not None
    assert result.winner.summary is not None
    assert result.winner.summary.state is ProgressState.UNSTABLE
    assert result.winner.tunables["lr"] == max(lrs)
    # Every trial hit the cap in its first round, so the time never doubled
    # and no sequential search followed.
    assert [r["reason"] for r in log.events("trial_time")] == ["initial"]
    assert not log.events("halving")
    assert system.live() == [0, result.winner.branch]


def test_diverged_trials_are_killed(scripted_system: Any) -> None:
    system = scripted_system(lambda t, c: math.nan, seconds=lambda t: CLOCK_S)
    result, log, root = run_search(system, trial_cap=3)
    assert result.winner is None and result.all_diverged
    assert {r["reason"] for r in log.events("free_trial")} == {"diverged"}
    assert all(clocks_by_branch(system)[b] == 10 for b in trial_branches(system))
    assert system.live() == [root]


def test_progress_is_judged_per_second(scripted_system: Any) -> None:
    # Two batch sizes with the same progress per clock; batch 64's clocks take
    # 4x longer, so batch 8 makes 4x the progress per second.
    space = SearchSpace([Choice("batch_size", [8, 64])])
    for seed in (0, 1):  # both grid orders
        system = scripted_system(lambda t, c: 10.0 - 0.1 * (c + 1),
                                 seconds=lambda t: CLOCK_S * t["batch_size"] / 8)
        result, _, _ = run_search(system, space, sampler="grid", seed=seed, trial_cap=None)
        assert result.trials == 2
        assert result.winner is not None and result.winner.tunables["batch_size"] == 8


def test_trial_time_counts_only_the_branchs_own_clocks(scripted_system: Any) -> None:
    # A slow trial gets fewer clocks for the same trial time.
    space = SearchSpace([Choice("batch_size", [8, 64])])
    system = scripted_system(lambda t, c: 10.0 - 0.1 * (c + 1),
                             seconds=lambda t: CLOCK_S * t["batch_size"] / 8,
                             clocks_per_epoch=1000)
    result, _, _ = run_search(system, space, sampler="grid", seed=0, trial_cap=None,
                              initial_trial_time_s=10.0)
    ran = {t["batch_size"]: clocks_by_branch(system)[b]
           for b, _, kind, t in system.forks if kind is BranchKind.TRAINING}
    assert ran == {8: 80, 64: 10}  # 10 s of 0.125 s clocks, and of 1 s clocks


def test_top5_rule_stops_a_model_based_search(scripted_system: Any) -> None:
    # Every lr gives (nearly) the same slope, so the first 5 are within 10%.
    system = scripted_system(lambda t, c: 10.0 - 0.1 * (c + 1) - 1e-4 * float(t["lr"]),
                             seconds=lambda t: CLOCK_S)
    result, log, _ = run_search(system, sampler="tpe", trial_cap=None)
    assert result.trials == 5
    assert log.events("search_stop")[0]["reason"] == "top_k_close"


def test_every_trial_is_recorded_in_the_study(scripted_system: Any) -> None:
    system = scripted_system(decaying, seconds=lambda t: CLOCK_S)
    cfg = TunerConfig(sampler="random", initial_trial_time_s=1.25, num_clocks_to_eval=10)
    root = system.fork(None, LR_SPACE.defaults(), BranchKind.INIT)
    searcher = Searcher(LR_SPACE, sampler="random", seed=0)
    result = SearchEpisode(system, cfg, searcher, DecisionLog(), index=0, parent=root,
                           parent_tunables=LR_SPACE.defaults(), trial_cap=4).run()
    study = searcher.study
    assert len(study.trials) == result.trials == 4
    assert all(t.state.is_finished() for t in study.trials)
    assert all(len(t.intermediate_values) == t.user_attrs["clocks"] for t in study.trials)
    assert result.winner is not None
    assert study.user_attrs["winner_trial"] == result.winner.proposal.number
    assert study.user_attrs["starting_progress"] == 10.0


# -- the budget's floor ------------------------------------------------------------------

# Mini-batch noise that cancels only over windows of 8 clocks: the summariser
# (K = 10 windows) sees a trial CONVERGING from 80 clocks on (10 s of 0.125 s
# clocks), never before. The trial-time rule asks for 10 s trials.
NOISE = (0.2,) * 4 + (-0.2,) * 4
RULE_CLOCKS = 80
EPOCH_CLOCKS = 400
EPOCH_S = EPOCH_CLOCKS * CLOCK_S


def noisy(t: Mapping[str, Any], c: int) -> float:
    return 10.0 - 0.01 * float(t["lr"]) * c + NOISE[c % len(NOISE)]


def job_budget(epochs: int, share: float = 0.1, ceiling: float | None = 0.2) -> SearchBudget:
    """A search's budget in a job of ``epochs`` epochs, as the tuner makes it."""
    return SearchBudget(share * epochs * EPOCH_S, None if ceiling is None else ceiling * epochs * EPOCH_S)


def floor_search(scripted_system: Any, budget: SearchBudget, **config: Any
                 ) -> tuple[SearchResult, DecisionLog, Any]:
    system = scripted_system(noisy, seconds=lambda t: CLOCK_S, clocks_per_epoch=EPOCH_CLOCKS)
    result, log, _ = run_search(system, trial_cap=30, budget=budget, enqueue={"lr": 1.0}, **config)
    return result, log, system


def test_halving_cost_counts_every_rung() -> None:
    # 8 trials at L: 7 new ones to L, then 4 on to 2L, then 2 on to 4L.
    assert halving_cost(8, 1.0) == 7 + 4 + 2 * 2
    assert halving_cost(4, 2.0) == (3 + 2) * 2.0
    assert halving_cost(2, 1.0) == 1 and halving_cost(1, 1.0) == 0
    assert halving_size(5.0, 1.0, 30) == 4 and halving_size(4.9, 1.0, 30) == 3
    assert halving_size(100.0, 1.0, 6) == 6


def test_the_floor_pays_for_the_trial_time_and_halving_on_a_short_job(scripted_system: Any) -> None:
    # 8 epochs: a 10% share is 40 s, and the rule needs 41.25 s (the
    # evaluation branch and 4 trials of 80 clocks) to find its 10 s trial
    # time; halving over 4 trials of 10 s costs 50 s more. The floor raises
    # the search for both, up to the 80 s ceiling (20% of the job).
    budget = job_budget(8)
    result, log, system = floor_search(scripted_system, budget)
    raises = log.events("budget_floor")
    assert [r["reason"] for r in raises] == ["trial_time", "halving"]
    assert all(r["share_s"] == 40.0 and r["ceiling_s"] == 80.0 for r in raises)
    assert raises[1]["needed_s"] == pytest.approx(41.25 + 50.0) and raises[1]["budget_s"] == 80.0
    # The trial time is the one the rule asks for, and the winner converged.
    assert result.trial_time == pytest.approx(RULE_CLOCKS * CLOCK_S)
    assert result.winner is not None and result.winner.summary is not None
    assert result.winner.summary.state is ProgressState.CONVERGING
    # Halving ran over new trials of that length; the search went past its
    # share, and stayed within the ceiling.
    halving = log.events("halving")[0]["time"]
    assert len([r for r in log.events("fork_trial") if r["time"] >= halving]) >= 3
    assert budget.share < result.seconds <= 80.0
    assert result.share_s == 40.0 and result.budget_s == 80.0


def test_the_ceiling_bounds_the_floor(scripted_system: Any) -> None:
    # 4 epochs: the rule's 40 s and halving's 50 s are past the 40 s ceiling.
    result, log, _ = floor_search(scripted_system, job_budget(4))
    assert log.events("budget_floor")
    assert result.seconds <= 40.0 + 10 * CLOCK_S  # within one trial's first samples
    assert log.events("search_stop")[0]["reason"] == "budget" and result.budget_exhausted


@pytest.mark.parametrize("epochs", [30, 60])
def test_a_long_job_keeps_its_share(scripted_system: Any, epochs: int) -> None:
    # The share (150 s, 300 s) is above the floor (91 s): it holds and
    # nothing raises it.
    budget = job_budget(epochs)
    result, log, _ = floor_search(scripted_system, budget)
    assert not log.events("budget_floor")
    assert result.seconds <= budget.share
    assert result.budget_s == result.share_s == budget.share


def test_without_a_ceiling_the_share_is_a_hard_limit(scripted_system: Any) -> None:
    result, log, _ = floor_search(scripted_system, job_budget(10, ceiling=None))
    assert not log.events("budget_floor")
    assert result.seconds <= 50.0 + 10 * CLOCK_S


def test_earlier_searches_count_against_the_ceiling(scripted_system: Any) -> None:
    # A re-tune after searches that spent 80 s of a 100 s ceiling: the floor
    # may not raise it past what is left, but it keeps its own 50 s share.
    budget = dataclasses.replace(job_budget(10), spent_before_s=80.0)
    result, log, _ = floor_search(scripted_system, budget)
    assert not log.events("budget_floor")
    assert result.seconds <= 50.0 + 10 * CLOCK_S
    budget = dataclasses.replace(job_budget(10), spent_before_s=30.0)
    result, log, _ = floor_search(scripted_system, budget)
    assert all(r["ceiling_s"] == 70.0 for r in log.events("budget_floor"))
    assert result.seconds <= 70.0 + 10 * CLOCK_S


def test_a_budget_in_epochs_is_measured_at_the_best_trials_setting(scripted_system: Any) -> None:
    # Batch 64 (the parent's) has 100 clocks per epoch, batch 16 400: a share
    # of 1 epoch is 12.5 s at the parent's setting and 50 s at batch 16's,
    # the setting that wins and will train.
    class ByBatch(ScriptedSystem):
        def clocks_per_epoch(self, tunables: Mapping[str, Any]) -> int:
            return 6400 // int(tunables["batch_size"])

    space = SearchSpace([LogUniform("lr", 1e-3, 1.0), Choice("batch_size", [16, 64], default=64)])
    system = ByBatch(lambda t, c: 10.0 - 0.01 * float(t["lr"]) * 64 / t["batch_size"] * c,
                     seconds=lambda t: CLOCK_S)
    result, log, _ = run_search(system, space, trial_cap=4, budget=SearchBudget(1.0, unit="epochs"),
                                enqueue={"lr": 1.0, "batch_size": 16})
    assert log.events("starting_progress")[0]["budget_s"] == 100 * CLOCK_S
    assert result.winner is not None and result.winner.tunables["batch_size"] == 16
    assert result.share_s == result.budget_s == 400 * CLOCK_S


def test_a_measured_trial_time_starts_at_the_first_samples(scripted_system: Any) -> None:
    # The searcher decides in well under a clock: rounds shorter than a
    # trial's first 10 clocks would only fork trials.
    system = scripted_system(rising, seconds=lambda t: CLOCK_S, clocks_per_epoch=80)
    _, log, _ = run_search(system, trial_cap=3, initial_trial_time_s=None)
    first = log.events("trial_time")[0]
    assert first["reason"] == "initial" and first["decision_s"] < first["samples_s"]
    assert first["trial_time_s"] == first["samples_s"] == pytest.approx(10 * CLOCK_S)
    assert [r["trial_time_s"] for r in log.events("trial_time")][1:3] == pytest.approx(
        [20 * CLOCK_S, 40 * CLOCK_S])


# -- breadth where doubling is unaffordable ------------------------------------------------


def test_a_budget_too_small_to_double_buys_new_trials_at_the_trial_time(
        scripted_system: Any) -> None:
    # Only the design's first setting trains. The evaluation branch and the
    # enqueued setting's first round (10 clocks each) leave 2.5 of 5 s: too
    # little to double the trial time (3.75 s), enough for new settings at
    # 1.25 s; the first of them trains, and wins.
    good = startup_design(LR_SPACE, 1, seed=0)[0]["lr"]

    def only_good(t: Mapping[str, Any], c: int) -> float:
        return decaying({"lr": 0.05}, c) if t["lr"] == good else rising(t, c)

    system = scripted_system(only_good, seconds=lambda t: CLOCK_S, clocks_per_epoch=400)
    result, log, _ = run_search(system, sampler="tpe", trial_cap=10, budget_s=5.0,
                                enqueue={"lr": 1e-3})
    assert [r["reason"] for r in log.events("trial_time")][:2] == ["initial", "widened"]
    assert result.winner is not None and result.winner.tunables["lr"] == good
    # Every trial ran the trial time, no more; the search kept to its budget.
    assert all(clocks_by_branch(system)[b] == 10 for b in trial_branches(system))
    assert result.seconds <= 5.0


def test_without_budget_for_a_new_trial_the_search_stops(scripted_system: Any) -> None:
    system = scripted_system(rising, seconds=lambda t: CLOCK_S, clocks_per_epoch=400)
    result, log, _ = run_search(system, trial_cap=10, budget_s=3.0)
    assert not [r for r in log.events("trial_time") if r["reason"] == "widened"]
    assert result.trials == 1 and result.winner is None and result.budget_exhausted
