"""The batch check: a small batch that won the initial search's short
trials from the untrained model (many steps per second) is checked against
larger batches once training has left its steep start, and the job reaches
its target where the old rule, which never revisited the batch size, sat
at the small batch's noise floor."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from mltuner.exceptions import InvalidArgumentError
from mltuner.tune import (BranchKind, Choice, ClockReport, LogUniform, SearchSpace, TunerConfig,
                          Uniform)
from mltuner.tune.baselines import BaselineConfig, run_fixed, run_mltuner
from mltuner.tune.tuner import larger_batch
from mltuner.tune.tuner._batch_check import tail_mean

BATCHES = [16, 32, 64, 128]
SPACE = SearchSpace([LogUniform("lr", 1e-3, 0.5, default=0.01),
                     Uniform("momentum", 0.0, 0.99, default=0.9),
                     Choice("batch_size", BATCHES, default=32)])
TARGET = 0.98


class NoiseFloorSystem:
    """A model whose loss falls by K x lr of its distance to a noise floor
    FLOOR x lr / batch each clock: far from the floor every step helps alike
    whatever its batch (so small batches, with more clocks per second, win
    short trials from the start), near it only a larger batch (or a lower
    rate) gets lower. A clock costs a fixed overhead plus a cost per sample
    (a CPU host: batch 16 costs 5x per sample what batch 128 does); the
    reported loss has noise shrinking with the batch. Accuracy = 1 - loss/2."""

    K, FLOOR, OVERHEAD_S, SAMPLE_S, NOISE, SAMPLES = 0.01, 2.0, 0.004, 0.000025, 0.3, 4096

    def __init__(self, seed: int = 0) -> None:
        self.branches: dict[int, tuple[BranchKind, dict[str, Any], float, random.Random]] = {}
        self._next = 0
        self._rng = random.Random(seed)

    def fork(self, parent: int | None, tunables: Mapping[str, Any], kind: BranchKind) -> int:
        level = 1.0 if parent is None else self.branches[parent][2]
        branch, self._next = self._next, self._next + 1
        self.branches[branch] = (kind, dict(tunables), level, random.Random(self._rng.random()))
        return branch

    def free(self, branch: int) -> None:
        del self.branches[branch]

    def live(self) -> list[int]:
        return sorted(self.branches)

    def clocks_per_epoch(self, tunables: Mapping[str, Any]) -> int:
        return self.SAMPLES // int(tunables["batch_size"])

    def run(self, branch: int, clocks: int) -> Sequence[ClockReport]:
        kind, tunables, level, rng = self.branches[branch]
        batch, lr = int(tunables["batch_size"]), float(tunables["lr"])
        seconds = self.OVERHEAD_S + self.SAMPLE_S * batch
        reports = []
        for _ in range(clocks):
            if kind is BranchKind.TESTING:
                reports.append(ClockReport(level, seconds, 1.0 - 0.5 * level))
                continue
            noise = self.NOISE * math.sqrt(16.0 / batch) * rng.gauss(0.0, 1.0)
            reports.append(ClockReport(level * (1.0 + noise), seconds))
            if kind is BranchKind.TRAINING:
                floor = self.FLOOR * lr / batch
                level = floor + (level - floor) * (1.0 - self.K * lr)
        self.branches[branch] = (kind, tunables, level, rng)
        return reports


def best_fixed_s() -> float:
    """The best fixed setting in hindsight: the fastest to the target over a
    grid of learning rate x batch size (0.5 x 64 here, about 5 s)."""
    times = []
    for lr, batch in itertools.product([0.1, 0.2, 0.5], BATCHES):
        run = run_fixed(NoiseFloorSystem(), {"lr": lr, "momentum": 0.9, "batch_size": batch},
                        BaselineConfig(target_accuracy=TARGET, max_epochs=200,
                                       num_clocks_to_test=10, plateau_size_for_convergence=50))
        if run.time_to_target_s is not None:
            times.append(run.time_to_target_s)
    return min(times)


def tune(seed: int, budget_s: float, batch_check: bool,
         lr_scaling: str = "sqrt") -> tuple[Any, Any, Any]:
    config = TunerConfig(seed=seed, num_clocks_to_test=10, max_epochs=200, time_budget_s=budget_s,
                         target_accuracy=TARGET, batch_check=batch_check,
                         batch_check_lr_scaling=lr_scaling)
    system = NoiseFloorSystem(seed=seed)
    measured, result = run_mltuner(system, SPACE, config, target_accuracy=TARGET, keep_branch=True)
    return measured, result, system


@pytest.fixture(scope="module", name="best")
def best_fixture() -> float:
    return best_fixed_s()


@pytest.mark.parametrize("lr_scaling", ["sqrt", "linear"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_batch_check_reaches_the_target_where_the_old_rule_sat_at_the_floor(
        best: float, seed: int, lr_scaling: str) -> None:
    # The job's budget: six times the best fixed run (as in the large MNIST-1D
    # benchmark, 450 s against 69 s), so each search's share is 0.6 of it.
    budget = 6 * best
    old, old_result, _ = tune(seed, budget, batch_check=False)
    new, new_result, system = tune(seed, budget, batch_check=True, lr_scaling=lr_scaling)
    final = new_result.tunables
    # The initial search picks a small batch on every seed (its short trials
    # from the untrained model see steps, not samples); the old rule keeps
    # it, and no better than twice the best fixed run (seeds 0 and 2 never
    # reach the target within the budget).
    assert old_result.tunables["batch_size"] <= 32
    assert old.time_to_target_s is None or old.time_to_target_s > 2 * best
    # The new rule reaches the target on every seed, within 2.5x of the best
    # fixed run (the initial search alone costs about the best fixed run
    # here): linear 2.28, 1.73, 2.02; sqrt 2.28, 2.19, 2.02 (old: missed,
    # 2.12, missed).
    assert new.time_to_target_s is not None and new.time_to_target_s <= 2.5 * best
    assert system.live() == [new_result.branch]
    if old.time_to_target_s is None:
        assert final["batch_size"] > old_result.tunables["batch_size"]
    elif lr_scaling == "linear":
        # This model's progress per clock is linear in the rate with no limit
        # to it, where the linear rule is exact and wins the check on every
        # seed. The sqrt rule (the default: on a real CNN the linear one
        # killed the network) loses seed 1's checks and is 3% slower there.
        assert new.time_to_target_s < old.time_to_target_s
        assert final["batch_size"] > old_result.tunables["batch_size"]


def test_every_check_is_logged_and_recorded_in_its_study(best: float) -> None:
    measured, result, _ = tune(0, 6 * best, batch_check=True)
    del measured
    # (run_mltuner's log is in memory: run it again with one to read.)
    from mltuner.tune import DecisionLog, Tuner
    config = TunerConfig(seed=0, num_clocks_to_test=10, max_epochs=200, time_budget_s=6 * best,
                         target_accuracy=TARGET)
    tuner = Tuner(NoiseFloorSystem(seed=0), SPACE, config, log=DecisionLog())
    tuned = tuner.run()
    log = tuner.log
    checks = [r for r in log.events("retune") if r["reason"] == "batch"]
    assert checks and all(r["check"] == "batch" for r in checks)
    starts = {r["search"]: r for r in log.events("search_start") if r.get("check") == "batch"}
    assert len(starts) == len(checks)
    # The first check completes the initial search's choice of batch; later
    # ones (after a check the current setting won) are paid from the time
    # trained since the last search, as climb checks are.
    assert checks[0]["paid"] == "choice"
    ends = {r["search"]: r for r in log.records
            if r["event"] in ("winner", "no_progress") and r.get("check") == "batch"}
    for index, start in starts.items():
        forks = [r for r in log.events("fork_trial") if r["search"] == index]
        current, larger = start["first"]
        # The larger batch first, with its learning rate scaled (sqrt).
        assert [f["tunables"] for f in forks] == [larger, current]
        assert larger == larger_batch(SPACE, current)
        # Within its budget: two trials of equal run time.
        assert ends[index]["seconds"] <= start["budget_s"] + 1e-9
        runs = [r["run_time_s"] for r in log.events("summary") if r["search"] == index]
        assert runs[1] == pytest.approx(runs[0], abs=0.01)
        assert len(ends[index]["levels"]) == 2
    for index in starts:
        assert tuned.studies[index].endswith(f"-batch-{index}")
    assert tuned.tunables["batch_size"] > 16


def test_larger_batch_scales_the_learning_rate_and_clips_it() -> None:
    # sqrt by default: batch 16 -> 32 at lr 0.1 * 2 ** 0.5.
    assert larger_batch(SPACE, {"lr": 0.1, "momentum": 0.9, "batch_size": 16}) == {
        "lr": pytest.approx(0.1 * math.sqrt(2)), "momentum": 0.9, "batch_size": 32}
    assert larger_batch(SPACE, {"lr": 0.1, "momentum": 0.9, "batch_size": 16},
                        lr_scaling="linear")["lr"] == pytest.approx(0.2)
    assert larger_batch(SPACE, {"lr": 0.1, "momentum": 0.9, "batch_size": 16},
                        lr_scaling="none")["lr"] == 0.1
    # From 32 to 64 (the next value of the space, not twice the batch).
    assert larger_batch(SPACE, {"lr": 0.4, "momentum": 0.9, "batch_size": 32})["lr"] == 0.5
    assert larger_batch(SPACE, {"lr": 0.1, "momentum": 0.9, "batch_size": 128}) is None
    fixed_lr = SearchSpace([LogUniform("lr", 1e-3, 0.5, default=0.01, search=False),
                            Choice("batch_size", BATCHES, default=32)])
    assert larger_batch(fixed_lr, {"lr": 0.1, "batch_size": 16}) == {"lr": 0.1, "batch_size": 32}
    no_batch = SearchSpace([LogUniform("lr", 1e-3, 0.5)])
    assert larger_batch(no_batch, {"lr": 0.1}) is None
    with pytest.raises(InvalidArgumentError, match="lr_scaling"):
        larger_batch(SPACE, {"lr": 0.1, "batch_size": 16}, lr_scaling="cube")
    with pytest.raises(InvalidArgumentError, match="batch_check_lr_scaling"):
        TunerConfig(batch_check_lr_scaling="linear-ish")


def test_tail_mean_is_the_last_quarter() -> None:
    assert tail_mean([9.0, 9.0, 9.0, 1.0, 3.0, 5.0, 9.0, 2.0]) == pytest.approx(5.5)
    assert tail_mean([4.0]) == 4.0
    assert math.isnan(tail_mean([]))
    assert math.isnan(tail_mean([1.0, 2.0, 3.0, math.nan]))


class RightBatchSystem(NoiseFloorSystem):
    """The batch is already right: a clock costs the same per sample
    whatever its batch (no fixed overhead) and there is no noise floor to
    lower, so a larger batch takes as many seconds for each clock's worth of
    progress as its batch grows, and a learning rate scaled less than
    linearly makes it lose every check."""

    K, FLOOR, OVERHEAD_S, NOISE = 0.00005, 0.0, 0.0, 0.0


def test_a_check_that_keeps_losing_backs_off() -> None:
    share = 0.2
    config = TunerConfig(seed=0, num_clocks_to_test=10, max_epochs=400, time_budget_s=60.0,
                         max_search_share=share, retune="off")
    from mltuner.tune import DecisionLog, Tuner
    tuner = Tuner(RightBatchSystem(seed=0), SPACE, config, log=DecisionLog())
    tuner.run()
    log = tuner.log
    checks = [r for r in log.events("retune") if r["reason"] == "batch"]
    ends = [r for r in log.records
            if r["event"] in ("winner", "no_progress") and r.get("check") == "batch"]
    assert len(checks) >= 3
    # The current setting wins every check (the larger batch is worse here).
    assert all(r["tunables"] == c["tunables"] for r, c in zip(ends, checks))
    # After each lost check, the next waits for twice the training time.
    for check in checks[1:]:
        assert check["paid"] == "trained"
        assert share * check["trained_s"] >= check["budget_s"] * 2 ** (check["lost"] - 1) - 1e-9
    assert [c["lost"] for c in checks] == list(range(len(checks)))
    # So their cost shrinks against the training time: the last check's is
    # at most a quarter of the first retried one's share of its wait.
    assert checks[-1]["budget_s"] / checks[-1]["trained_s"] <= (
        checks[1]["budget_s"] / checks[1]["trained_s"]) / 2 ** (len(checks) - 3) + 1e-9
    trained = log.events("end")[-1]["seconds"] - log.events("end")[-1]["search_seconds"]
    spent = sum(r["seconds"] for r in ends)
    assert spent <= share * trained + checks[0]["budget_s"]


def test_a_job_bounded_by_epochs_alone_gets_no_check() -> None:
    # Its samples are fixed: a larger batch takes fewer steps to the end,
    # which trials of equal time do not see. The same job with a time budget
    # (or a target) does check.
    from mltuner.tune import DecisionLog, Tuner
    checks = {}
    for name, bounds in {"epochs": {}, "time": {"time_budget_s": 60.0}, "target": {"target_accuracy": TARGET}}.items():
        config = TunerConfig(seed=0, num_clocks_to_test=10, max_epochs=30, **bounds)
        assert config.time_bounded == (name != "epochs")
        tuner = Tuner(NoiseFloorSystem(seed=0), SPACE, config, log=DecisionLog())
        tuner.run()
        checks[name] = [r for r in tuner.log.events("retune") if r["reason"] == "batch"]
    assert checks["epochs"] == []
    assert checks["time"] and checks["target"]
