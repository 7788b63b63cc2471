"""Time slicing of one trial (mltuner.md §1.2)."""

from __future__ import annotations

import pytest

from mltuner.tune import ClockReport, Proposal, Trial


def make_trial(cap: int = 100) -> Trial:
    return Trial(Proposal(0, {"lr": 0.1}, {"lr": 0.1}), branch=7, cap=cap)


def test_a_new_trial_first_runs_ten_clocks() -> None:
    assert make_trial().clocks_to_reach(trial_time=1e-9) == 10
    assert make_trial().clocks_to_reach(trial_time=1e9, first_clocks=3) == 3
    # ... but never past the one-epoch cap.
    assert make_trial(cap=4).clocks_to_reach(trial_time=1e9) == 4


def test_time_per_clock_skips_the_first_clock() -> None:
    trial = make_trial()
    trial.record([ClockReport(1.0, 5.0)] + [ClockReport(1.0, 0.5)] * 9)
    assert trial.time_per_clock() == pytest.approx(0.5)
    assert trial.run_time == pytest.approx(9.5)
    # floor(12.0 / 0.5) = 24 clocks in all, 10 already run.
    assert trial.clocks_to_reach(trial_time=12.0) == 14
    assert trial.clocks_to_reach(trial_time=12.2) == 14
    assert trial.clocks_to_reach(trial_time=3.0) == 0


def test_trials_are_capped_at_one_epoch() -> None:
    trial = make_trial(cap=30)
    trial.record([ClockReport(1.0, 0.5)] * 10)
    assert trial.clocks_to_reach(trial_time=1000.0) == 20
    trial.record([ClockReport(1.0, 0.5)] * 20)
    assert trial.capped
    assert trial.clocks_to_reach(trial_time=1000.0) == 0


def test_clocks_that_take_no_time_run_to_the_cap() -> None:
    trial = make_trial(cap=50)
    trial.record([ClockReport(1.0, 0.0)] * 10)
    assert trial.clocks_to_reach(trial_time=1.0) == 40


def test_summarize_uses_the_branchs_own_time() -> None:
    trial = make_trial()
    trial.record([ClockReport(9.0, 2.0), ClockReport(8.0, 2.0)])
    summary = trial.summarize(baseline=10.0)
    assert summary.span == pytest.approx(4.0)
    assert summary.slope == pytest.approx(-0.5)
    assert trial.slope == summary.slope
