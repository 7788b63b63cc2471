"""The job's searches once their allowance is spent: a periodic re-tune still
climbs from a learning rate that is too low (a climb check paid from the
time trained since the last search), a re-tune that could not compare two
settings is not run, and the searches stay within their share bound."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pytest

from mltuner.tune import LogUniform, SearchSpace, Tuner, TunerConfig
from mltuner.tune.tuner import LR_STEP

CLOCK_S = 0.125
EPOCH = 100          # training clocks per epoch
TEST_CLOCKS = 5      # clocks of each validation
EPOCH_S = (EPOCH + TEST_CLOCKS) * CLOCK_S  # one epoch of the tuner's own clocks
SPACE = SearchSpace([LogUniform("lr", 0.01, 1.0)])
UNSTABLE_LR = 0.05   # rates at or above it kill the model...
UNSTABLE = (200, 500)  # ...while it trains through these clocks (an early instability)


def dead(t: Mapping[str, Any], c: int) -> bool:
    return float(t["lr"]) >= UNSTABLE_LR and UNSTABLE[0] <= c < UNSTABLE[1]


def loss(t: Mapping[str, Any], c: int) -> float:
    # A larger rate falls faster, so the initial search picks a fast one,
    # which dies at clock 200; the search after the rollback can only keep
    # a rate below 0.05, too low once the instability is over.
    return 10.0 if dead(t, c) else 10.0 * math.exp(-0.02 * float(t["lr"]) * (c + 1)) + 0.1


def accuracy(t: Mapping[str, Any], c: int) -> float:
    # Still improving at every validation: no plateau, only periodic re-tunes.
    return 0.1 if dead(t, c) else 0.9 * (1.0 - math.exp(-c / 1500.0))


def run(scripted_system: Any, epochs: int, **config: Any) -> tuple[Any, Tuner]:
    system = scripted_system(loss, seconds=lambda t: CLOCK_S, clocks_per_epoch=EPOCH,
                             accuracy=accuracy)
    cfg = TunerConfig(sampler="random", seed=0, initial_trial_time_s=1.25,
                      num_clocks_to_eval=10, num_clocks_to_test=TEST_CLOCKS,
                      max_trials_per_search=6, max_epochs=epochs, retune_every_epochs=5,
                      **config)
    tuner = Tuner(system, SPACE, cfg)
    return tuner.run(), tuner


def searches(log: Any) -> list[dict[str, Any]]:
    """Each search: its search_start record, its end record (winner or
    no_progress) and the retune record just before it (None for the
    initial search and one after a rollback)."""
    out: list[dict[str, Any]] = []
    previous = None
    for record in log.records:
        if record["event"] == "search_start":
            retune = previous if previous is not None and previous["event"] == "retune" else None
            out.append({"start": record, "retune": retune})
        elif record["event"] in ("winner", "no_progress"):
            out[-1]["end"] = record
        previous = record
    return out


def tuner_seconds_between(log: Any, after: float, before: float) -> float:
    """The tuner's own clock seconds (training and validation) between two
    log times."""
    inside = [r for r in log.records if after < r["time"] <= before]
    return (sum(r["seconds"] for r in inside if r["event"] == "train")
            + TEST_CLOCKS * CLOCK_S * sum(1 for r in inside if r["event"] == "validate"))


def test_a_rate_too_low_after_a_rollback_search_spent_the_allowance_still_climbs(
        scripted_system: Any) -> None:
    result, tuner = run(scripted_system, 24)
    log = tuner.log
    config = TunerConfig()
    job = 24 * EPOCH_S
    allowance = config.max_search_share * job
    # The initial search's choice died at clock 200, and the search after
    # the rollback spent what was left of the job's allowance on choosing a
    # rate below 0.05.
    rollback = log.events("rollback")[0]
    initial, after_rollback, *checks = searches(log)
    chosen = after_rollback["end"]["tunables"]["lr"]
    assert chosen < UNSTABLE_LR <= rollback["tunables"]["lr"]
    spent = initial["end"]["seconds"] + after_rollback["end"]["seconds"]
    skipped = log.events("retune_skipped")[0]
    assert skipped["left_s"] == pytest.approx(allowance - spent)
    assert skipped["left_s"] < skipped["least_s"]
    # No full re-tune could be paid for: every later search is a climb check
    # of the current setting and its rate one step up, which wins here.
    assert checks and all(c["start"]["check"] and c["start"]["trial_cap"] == 2 for c in checks)
    current = chosen
    for check in checks:
        forks = [r for r in log.events("fork_trial") if r["search"] == check["start"]["search"]]
        assert [f["tunables"]["lr"] for f in forks] == pytest.approx([current, current * LR_STEP])
        assert all(f["enqueued"] for f in forks)
        assert check["end"]["tunables"]["lr"] == pytest.approx(current * LR_STEP)
        # Within its budget, a hard limit no floor raises.
        assert check["start"]["ceiling_s"] is None
        assert check["end"]["seconds"] <= check["start"]["budget_s"]
        current *= LR_STEP
    assert result.tunables["lr"] == pytest.approx(current) and current > UNSTABLE_LR
    assert not [r for r in log.events("budget_floor")
                if r["search"] in {c["start"]["search"] for c in checks}]


def test_a_climb_check_waits_until_the_time_trained_since_the_last_search_pays_for_it(
        scripted_system: Any) -> None:
    _, tuner = run(scripted_system, 24)
    log = tuner.log
    share = TunerConfig().max_search_share
    ends = [r for r in log.records if r["event"] in ("winner", "no_progress")]
    skipped = [r for r in log.events("retune_skipped") if r["reason"] == "search_budget"]
    checks = [r for r in log.events("retune") if r["check"]]
    assert skipped and checks  # the first periodic epochs could not pay for a check
    least = skipped[0]["least_s"]
    for record in [*skipped, *checks]:
        last_end = max(e["time"] for e in ends if e["time"] < record["time"])
        trained = tuner_seconds_between(log, last_end, record["time"])
        if record["event"] == "retune":
            # The share of the time trained since pays for the least a
            # re-tune needs, which is its budget.
            assert record["budget_s"] == pytest.approx(least)
            assert least <= share * trained
        else:
            assert record["retune"] == "periodic"
            assert share * trained < record["least_s"] == pytest.approx(least)


def test_no_climb_into_a_setting_at_least_as_aggressive_as_one_that_collapsed(
        scripted_system: Any) -> None:
    # 48 epochs: the checks climb until the next step up would reach the
    # rate that died (excluded since the rollback); then they stop, however
    # long the job trains on.
    result, tuner = run(scripted_system, 48)
    log = tuner.log
    failed = log.events("rollback")[0]["tunables"]["lr"]
    tried = [r["tunables"]["lr"] for r in log.events("fork_trial")
             if r["time"] > log.events("rollback")[0]["time"]]
    assert tried and max(tried) < failed
    assert result.tunables["lr"] * LR_STEP >= failed


def test_a_retune_that_cannot_compare_two_settings_is_not_run(scripted_system: Any) -> None:
    # A plateau re-tune (it may lower the rate, so no climb check) with less
    # left than the evaluation branch and two trials of the job's trial
    # time: skipped, where it used to spend what was left on one trial.
    system = scripted_system(lambda t, c: 10.0 * math.exp(-0.02 * float(t["lr"]) * (c + 1)) + 0.1,
                             seconds=lambda t: CLOCK_S, clocks_per_epoch=EPOCH,
                             accuracies=[0.5, 0.6, 0.7] + [0.7] * 20)
    cfg = TunerConfig(sampler="random", seed=0, initial_trial_time_s=1.25, num_clocks_to_eval=10,
                      num_clocks_to_test=TEST_CLOCKS, max_trials_per_search=6, max_epochs=10,
                      max_search_share=0.12, search_share=0.1)
    tuner = Tuner(system, SPACE, cfg)
    result = tuner.run()
    skipped = tuner.log.events("retune_skipped")
    assert skipped and skipped[0]["retune"] == "plateau"
    assert 0 < skipped[0]["left_s"] < skipped[0]["least_s"]
    assert result.searches == 1 and not tuner.log.events("retune")


def test_a_periodic_retune_gets_no_floor(scripted_system: Any) -> None:
    # It goes on with the current setting when it finds nothing, so it keeps
    # to its share; the floor is for searches that must choose.
    _, tuner = run(scripted_system, 48)
    log = tuner.log
    periodic = [s for s in searches(log) if s["retune"] is not None
                and s["retune"]["reason"] == "periodic"]
    assert any(not s["start"]["check"] for s in periodic)
    for search in periodic:
        assert search["start"]["ceiling_s"] is None
        assert search["end"]["budget_s"] == pytest.approx(search["start"]["budget_s"])
    floors = {r["search"] for r in log.events("budget_floor")}
    assert not floors & {s["start"]["search"] for s in periodic}


@pytest.mark.parametrize("epochs", [12, 24, 48, 96])
def test_the_searches_stay_within_their_share_bound(scripted_system: Any, epochs: int) -> None:
    """The bound (docs/tuner.md, "The search budget"): the searches other
    than climb checks spend at most max_search_share of the job's budget,
    the initial and rollback searches their own shares whatever is left;
    each climb check at most max_search_share of the tuner's time since the
    search before it; a search ends within one trial of its budget."""
    result, tuner = run(scripted_system, epochs)
    log = tuner.log
    config = TunerConfig()
    job = epochs * EPOCH_S
    found = searches(log)
    ends = [s["end"] for s in found]
    assert result.search_seconds == pytest.approx(sum(e["seconds"] for e in ends))
    full, checks = [], []
    for i, search in enumerate(found):
        start, end = search["start"], search["end"]
        (checks if start["check"] else full).append(end["seconds"])
        if start["check"]:
            previous = ends[i - 1]["time"]
            trained = tuner_seconds_between(log, previous, start["time"])
            assert end["seconds"] <= start["budget_s"] <= config.max_search_share * trained
        elif i > 0 and search["retune"] is not None:
            # A re-tune starts only with its budget inside what is left.
            spent = sum(e["seconds"] for e in ends[:i])
            assert spent + start["budget_s"] <= config.max_search_share * job + 1e-9
    # One trial of overshoot per full search at most (a trial is at most an
    # epoch of clocks), plus the rollback search's own share.
    rollback_share = config.search_share * job * len(log.events("rollback"))
    assert sum(full) <= (config.max_search_share * job + rollback_share
                         + len(full) * EPOCH * CLOCK_S)
    assert sum(checks) <= config.max_search_share * result.seconds
