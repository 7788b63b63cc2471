"""The baselines (fixed setting, Optuna whole runs, Hyperband) and the Tuner
measured the same way, on simulated systems with known answers."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna
import pytest

from mltuner import InvalidArgumentError
from mltuner.tune import (
    BranchKind,
    ClockReport,
    Choice,
    DecisionLog,
    LogUniform,
    SearchSpace,
    TunerConfig,
    read_log,
    write_report,
)
from mltuner.tune.baselines._baselines import (
    BaselineConfig,
    BaselineResult,
    TimedSystem,
    curve_from_log,
    mltuner_result,
    run_fixed,
    run_hyperband,
    run_mltuner,
    run_optuna,
    running_best,
    time_to_target,
)

pytestmark = pytest.mark.timeout(30)

BEST_LR = 0.03
DIVERGE_LR = 0.3      # from here on the training loss is inf
PEAK = 0.9            # the best accuracy, reached only with BEST_LR
SECONDS = 0.01        # every clock
EPOCH = 10            # clocks per epoch
TEST = 2              # clocks per validation
LR_SPACE = SearchSpace([LogUniform("lr", 1e-4, 1.0)])


def peak(lr: float) -> float:
    """The accuracy lr converges to: a Gaussian in decades around BEST_LR."""
    decades = math.log10(lr / BEST_LR)
    return PEAK * math.exp(-decades * decades / 2)


def accuracy(lr: float, epochs: float) -> float:
    return peak(lr) * (1.0 - math.pow(0.5, epochs))


class LrSystem:
    """A BranchSystem whose validation accuracy after e epochs of training
    with learning rate lr is ``accuracy(lr, e)``; the training loss falls
    as that accuracy rises, and is inf for lr >= DIVERGE_LR. Every clock takes
    SECONDS. ``samples`` // batch_size gives the clocks per epoch when a
    setting has a batch size."""

    def __init__(self, clocks_per_epoch: int = EPOCH, samples: int = 320) -> None:
        self.epoch = clocks_per_epoch
        self.samples = samples
        self.branches: dict[int, tuple[BranchKind, dict[str, Any], int]] = {}
        self.forks: list[tuple[int, int | None, BranchKind]] = []
        self.freed: list[int] = []
        self.clocks_run = 0
        self._next = 0

    def fork(self, parent: int | None, tunables: Mapping[str, Any], kind: BranchKind) -> int:
        trained = 0 if parent is None else self.branches[parent][2]
        branch, self._next = self._next, self._next + 1
        self.branches[branch] = (kind, dict(tunables), trained)
        self.forks.append((branch, parent, kind))
        return branch

    def free(self, branch: int) -> None:
        del self.branches[branch]
        self.freed.append(branch)

    def run(self, branch: int, clocks: int) -> Sequence[ClockReport]:
        assert clocks >= 1
        kind, tunables, trained = self.branches[branch]
        self.clocks_run += clocks
        lr = float(tunables["lr"])
        per_epoch = self.clocks_per_epoch(tunables)
        if kind is BranchKind.TESTING:
            value = accuracy(lr, trained / per_epoch)
            return [ClockReport(0.0, SECONDS, value) for _ in range(clocks)]
        if kind is not BranchKind.TRAINING:
            return [ClockReport(10.0, SECONDS) for _ in range(clocks)]
        self.branches[branch] = (kind, tunables, trained + clocks)
        return [ClockReport(self._loss(lr, (trained + i + 1) / per_epoch), SECONDS)
                for i in range(clocks)]

    def clocks_per_epoch(self, tunables: Mapping[str, Any]) -> int:
        if "batch_size" in tunables:
            return self.samples // int(tunables["batch_size"])
        return self.epoch

    def live(self) -> list[int]:
        return sorted(self.branches)

    @staticmethod
    def _loss(lr: float, epochs: float) -> float:
        return math.inf if lr >= DIVERGE_LR else 10.0 * (1.0 - accuracy(lr, epochs))


def assert_all_freed(system: Any) -> None:
    assert system.live() == []
    assert sorted(system.freed) == sorted(f[0] for f in system.forks)


def config(**changes: Any) -> BaselineConfig:
    fields: dict[str, Any] = {"num_clocks_to_test": TEST, "seed": 0}
    fields.update(changes)
    return BaselineConfig(**fields)


def flat(curve: Sequence[tuple[float, float]]) -> list[float]:
    """A curve as one list, for pytest.approx (which does not nest)."""
    return [x for point in curve for x in point]


def epoch_seconds(epochs: int, validations: int) -> float:
    return (epochs * EPOCH + validations * TEST) * SECONDS


# -- fixed settings ------------------------------------------------------------------------


def test_fixed_reaches_the_target_at_the_expected_epoch_and_time() -> None:
    system = LrSystem()
    # 0.9 (1 - 0.5^e) first reaches 0.8 at e = 4 (0.84; e = 3 gives 0.79).
    result = run_fixed(system, {"lr": BEST_LR}, config(target_accuracy=0.8, max_epochs=20))
    assert (result.name, result.outcome, result.reached_target) == ("fixed", "target", True)
    assert result.epochs == 4 and result.trials == 1
    expected = SECONDS + epoch_seconds(4, 4)          # the INIT clock, 4 epochs, 4 tests
    assert result.time_to_target_s == pytest.approx(expected)
    assert result.time_s == pytest.approx(expected)
    assert [t for t, _ in result.curve] == pytest.approx(
        [SECONDS + epoch_seconds(e, e) for e in range(1, 5)])
    assert [a for _, a in result.curve] == pytest.approx(
        [accuracy(BEST_LR, e) for e in range(1, 5)])
    assert result.best_tunables == {"lr": BEST_LR}
    assert result.runs[0].ended == "target"
    assert_all_freed(system)
    # The INIT root ran once; one training branch; one TESTING branch per epoch.
    kinds = [kind for _, _, kind in system.forks]
    assert kinds == [BranchKind.INIT, BranchKind.TRAINING] + [BranchKind.TESTING] * 4


def test_fixed_stops_on_a_plateau(scripted_system: Any) -> None:
    system = scripted_system(lambda t, c: 1.0, accuracies=[0.5, 0.6, 0.6, 0.6, 0.9],
                             clocks_per_epoch=5)
    result = run_fixed(system, {"lr": 0.1},
                       config(plateau_size_for_convergence=2, max_epochs=10))
    assert result.outcome == "converged" and result.epochs == 4
    assert result.best_accuracy == 0.6 and not result.reached_target
    assert system.live() == []


def test_fixed_stops_at_max_epochs_and_on_divergence() -> None:
    system = LrSystem()
    capped = run_fixed(system, {"lr": 1e-3}, config(target_accuracy=0.8, max_epochs=3))
    assert (capped.outcome, capped.epochs, capped.reached_target) == ("max_epochs", 3, False)
    assert capped.time_to_target_s is None

    diverged = run_fixed(system, {"lr": 0.5}, config(max_epochs=3))
    assert (diverged.outcome, diverged.epochs, diverged.curve) == ("diverged", 1, [])
    assert diverged.best_accuracy is None and diverged.best_tunables is None
    # The diverged epoch is counted; there was no validation after it.
    assert diverged.time_s == pytest.approx(SECONDS + epoch_seconds(1, 0))
    assert_all_freed(system)


def test_time_budget_stops_after_the_validation_that_crosses_it() -> None:
    system = LrSystem()
    result = run_fixed(system, {"lr": 1e-3}, config(max_epochs=50, time_budget_s=0.5))
    assert result.outcome == "time_budget"
    assert 0.5 <= result.time_s < 0.5 + epoch_seconds(1, 1)
    assert_all_freed(system)


# -- Optuna with whole runs; Hyperband -----------------------------------------------------


def test_optuna_whole_runs_find_a_good_lr() -> None:
    system = LrSystem()
    storage = optuna.storages.InMemoryStorage()
    # 0.88 after 6 epochs needs lr within about 0.2 decades of BEST_LR.
    result = run_optuna(system, LR_SPACE, config(target_accuracy=0.88, max_epochs=6, seed=2,
                                                 n_trials=60, storage=storage))
    assert result.outcome == "target" and result.reached_target
    assert 1 < result.trials < 60 and result.runs[-1].ended == "target"
    assert result.best_tunables is not None and result.best_accuracy is not None
    assert abs(math.log10(result.best_tunables["lr"] / BEST_LR)) < 0.5
    assert result.best_accuracy >= 0.88
    # Time is the INIT clock plus every trial's training and validation clocks.
    assert result.time_s == pytest.approx(SECONDS + sum(r.seconds for r in result.runs))
    assert result.time_to_target_s == pytest.approx(result.time_s)   # it stops there
    for run in result.runs:
        validated = len(run.accuracies)
        assert run.seconds == pytest.approx(epoch_seconds(run.epochs, validated))
        assert run.ended in ("target", "max_epochs", "diverged")
        assert (run.ended == "diverged") == (run.tunables["lr"] >= DIVERGE_LR)
    assert result.epochs == sum(r.epochs for r in result.runs)
    assert_all_freed(system)
    # Every trial forked from the INIT root: all start from the initial weights.
    root = system.forks[0][0]
    assert all(parent == root for _, parent, kind in system.forks if kind is BranchKind.TRAINING)

    study = optuna.load_study(study_name=result.study_name, storage=storage)
    assert len(study.trials) == result.trials
    for trial, run in zip(study.trials, result.runs):
        assert trial.user_attrs["ended"] == run.ended
        assert list(trial.intermediate_values.values()) == pytest.approx(run.accuracies)
        assert trial.state is optuna.trial.TrialState.COMPLETE
        # A diverged trial is told the worst accuracy, 0.
        assert trial.value == pytest.approx(max(run.accuracies, default=0.0))


def test_diverged_trials_told_as_failed_leave_tpe_blind_to_them() -> None:
    runs = {}
    for value in (0.0, None):
        system = LrSystem()
        runs[value] = run_optuna(system, LR_SPACE, config(max_epochs=2, n_trials=30,
                                                          n_startup_trials=5,
                                                          diverged_value=value)).runs
        assert_all_freed(system)
    diverged = {v: sum(r.ended == "diverged" for r in rs) for v, rs in runs.items()}
    # TPE ignores FAIL trials and keeps proposing learning rates that diverge.
    assert diverged[0.0] < diverged[None] / 2


def test_hyperband_prunes_bad_trials() -> None:
    whole_system, hb_system = LrSystem(), LrSystem()
    common = config(max_epochs=9, n_trials=30, n_startup_trials=5)
    whole = run_optuna(whole_system, LR_SPACE, common)
    # A fixed study name: the pruner's brackets come from a hash of it (test_logs_hold_... says more).
    hyperband = run_hyperband(hb_system, LR_SPACE, dataclasses.replace(common, study_name="prunes"))
    assert whole.trials == hyperband.trials == 30
    pruned = [r for r in hyperband.runs if r.ended == "pruned"]
    assert pruned and all(r.epochs < 9 for r in pruned)
    assert not any(r.ended == "pruned" for r in whole.runs)
    assert hyperband.epochs < 0.8 * whole.epochs
    assert hyperband.time_s < whole.time_s
    assert hyperband.best_accuracy is not None and hyperband.best_accuracy > 0.7
    assert_all_freed(whole_system)
    assert_all_freed(hb_system)


def test_optuna_time_budget_ends_the_search() -> None:
    system = LrSystem()
    result = run_optuna(system, LR_SPACE, config(max_epochs=5, n_trials=None,
                                                 time_budget_s=1.0))
    assert result.outcome == "time_budget"
    assert 1.0 <= result.time_s < 1.0 + epoch_seconds(1, 1)
    assert_all_freed(system)


class LateDivergence(LrSystem):
    """Every setting's loss becomes inf in its second epoch."""

    def _loss_at(self, branch: int) -> bool:
        return self.branches[branch][2] >= EPOCH

    def run(self, branch: int, clocks: int) -> Sequence[ClockReport]:
        late = self.branches[branch][0] is BranchKind.TRAINING and self._loss_at(branch)
        reports = super().run(branch, clocks)
        return [ClockReport(math.inf, r.seconds) for r in reports] if late else reports


def test_keep_branch_leaves_the_best_runs_branch_alive_and_frees_the_rest() -> None:
    """With keep_branch the branch of the run whose accuracy was best stays
    alive, as that run ended (a TuningSession trains on from it); every other
    branch is freed, the root included, and on an error the kept one too."""
    system = LrSystem()
    result = run_optuna(system, LR_SPACE, config(max_epochs=2, n_trials=6), keep_branch=True)
    best = max((r for r in result.runs if r.best_accuracy is not None), key=lambda r: r.best_accuracy or 0.0)
    assert result.branch is not None and system.live() == [result.branch]
    kind, tunables, trained = system.branches[result.branch]
    assert kind is BranchKind.TRAINING and tunables == best.tunables == result.tunables
    assert trained == best.epochs * EPOCH and result.best_accuracy == best.best_accuracy
    fixed_system = LrSystem()
    fixed = run_fixed(fixed_system, {"lr": BEST_LR}, config(max_epochs=2), keep_branch=True)
    assert fixed.branch is not None and fixed_system.live() == [fixed.branch] and fixed.tunables == {"lr": BEST_LR}
    diverged_system = LrSystem()
    diverged = run_fixed(diverged_system, {"lr": DIVERGE_LR}, config(max_epochs=2), keep_branch=True)
    assert diverged.branch is None and diverged.tunables is None  # no run validated: nothing to keep
    assert_all_freed(diverged_system)
    late = LateDivergence()  # validated in epoch 1, then its loss went inf: its weights are not kept
    after = run_fixed(late, {"lr": BEST_LR}, config(max_epochs=3), keep_branch=True)
    assert after.runs[0].ended == "diverged" and after.best_accuracy is not None
    assert after.branch is None and after.tunables is None
    assert_all_freed(late)
    failing = FailingSystem()
    with pytest.raises(RuntimeError, match="worker lost"):
        run_optuna(failing, LR_SPACE, config(max_epochs=2, n_trials=5), keep_branch=True)
    assert_all_freed(failing)


class FailingSystem(LrSystem):
    """Breaks when asked to train its third trial."""

    def run(self, branch: int, clocks: int) -> Sequence[ClockReport]:
        trainings = [b for b, _, kind in self.forks if kind is BranchKind.TRAINING]
        if len(trainings) >= 3 and branch == trainings[-1]:
            raise RuntimeError("worker lost")
        return super().run(branch, clocks)


def test_branches_are_freed_and_the_trial_failed_when_the_system_raises() -> None:
    system = FailingSystem()
    storage = optuna.storages.InMemoryStorage()
    with pytest.raises(RuntimeError, match="worker lost"):
        run_optuna(system, LR_SPACE, config(max_epochs=2, n_trials=5, storage=storage,
                                            study_name="broken"))
    assert_all_freed(system)
    states = [t.state for t in optuna.load_study(study_name="broken", storage=storage).trials]
    assert states[-1] is optuna.trial.TrialState.FAIL
    assert optuna.trial.TrialState.RUNNING not in states


# -- logs --------------------------------------------------------------------------------


def test_logs_hold_the_decisions_and_the_report_draws_them(tmp_path: Path) -> None:
    path = tmp_path / "hyperband.jsonl"
    # A fixed study name: HyperbandPruner puts trials in brackets by a hash of it (a name with
    # the time and pid in it, the default, pruned in some runs and not in others).
    result = run_hyperband(LrSystem(), LR_SPACE, config(max_epochs=9, n_trials=12, study_name="logs"), log=path)
    records = read_log(path)
    events = [r["event"] for r in records]
    assert events[:2] == ["start", "init"] and events[-1] == "end"
    for event in ("fork_trial", "train", "validate", "free_trial"):
        assert event in events
    assert events.count("fork_trial") == events.count("free_trial") == result.trials
    assert records[0]["baseline"] == "hyperband" and records[0]["sampler"] == "tpe"
    assert {r["phase"] for r in records} == {"init", "search", "train", "end"}
    assert any(r.get("reason") == "pruned" for r in records if r["event"] == "free_trial")
    end = records[-1]
    assert end["outcome"] == result.outcome and end["trials"] == result.trials
    # A log made by the baseline is timed in counted seconds.
    assert records[-1]["time"] - records[0]["time"] == pytest.approx(result.time_s)
    assert flat(curve_from_log(records)) == pytest.approx(flat(result.curve))
    png = write_report(path)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_a_callers_log_gets_elapsed_seconds() -> None:
    log = DecisionLog()   # wall-clock times
    result = run_fixed(LrSystem(), {"lr": BEST_LR}, config(max_epochs=3), log=log)
    assert [e["event"] for e in log.records] == (
        ["start", "init", "fork_trial"] + ["train", "validate"] * 3 + ["free_trial", "end"])
    assert flat(curve_from_log(log.records)) == pytest.approx(flat(result.curve))


# -- the Tuner, measured the same way ------------------------------------------------------


def test_mltuner_is_measured_like_the_baselines(tmp_path: Path) -> None:
    # The target is what the design's first setting reaches (the search stops
    # after one trial, out of budget): the test is about the measurement.
    system = LrSystem(clocks_per_epoch=20)
    path = tmp_path / "mltuner.jsonl"
    tuner_config = TunerConfig(seed=0, initial_trial_time_s=0.05, num_clocks_to_test=TEST,
                               num_clocks_to_eval=5, max_trials_per_search=8,
                               retune="off", max_epochs=6)
    result, tuning = run_mltuner(system, LR_SPACE, tuner_config, target_accuracy=0.5, log=path)
    assert result.name == "mltuner" and result.outcome == tuning.outcome.value
    # Every clock of every branch counts: INIT, evaluation, trials, training, tests.
    assert result.time_s == pytest.approx(system.clocks_run * SECONDS)
    assert [a for _, a in result.curve] == pytest.approx(tuning.accuracies)
    assert result.trials == tuning.trials and result.epochs == tuning.epochs
    assert result.reached_target
    assert result.time_to_target_s == time_to_target(result.curve, 0.5)
    assert_all_freed(system)
    # The file log is timed in counted seconds: read back, it gives the same numbers.
    again = mltuner_result(read_log(path), 0.5, tuning=tuning)
    assert flat(again.curve) == pytest.approx(flat(result.curve))
    assert again.time_s == pytest.approx(result.time_s)
    # And the baselines take the Tuner's validation and stop settings.
    matching = BaselineConfig.matching(tuner_config, target_accuracy=0.5)
    assert (matching.num_clocks_to_test, matching.max_epochs, matching.seed) == (TEST, 6, 0)
    fixed = run_fixed(LrSystem(clocks_per_epoch=20), tuning.tunables, matching)
    assert isinstance(fixed, BaselineResult) and fixed.reached_target


def test_running_best_and_time_to_target() -> None:
    curve = [(1.0, 0.2), (2.0, 0.5), (3.0, 0.4), (4.0, 0.7)]
    assert running_best(curve) == [(1.0, 0.2), (2.0, 0.5), (3.0, 0.5), (4.0, 0.7)]
    assert time_to_target(curve, 0.5) == 2.0
    assert time_to_target(curve, 0.8) is None and time_to_target(curve, None) is None


def test_timed_system_counts_clocks_and_live_branches() -> None:
    timed = TimedSystem(LrSystem())
    root = timed.fork(None, {"lr": 0.01}, BranchKind.INIT)
    timed.run(root, 3)
    assert timed.seconds == pytest.approx(3 * SECONDS)
    assert (timed.clocks, timed.live) == (3, {root})
    timed.free_all()
    assert timed.live == set()


# -- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize("target", [0.0, -0.1, 1.5, math.nan])
def test_target_outside_zero_one(target: float) -> None:
    with pytest.raises(InvalidArgumentError, match=r"target_accuracy must be in \(0, 1\]"):
        BaselineConfig(target_accuracy=target)
    with pytest.raises(InvalidArgumentError, match="target_accuracy"):
        mltuner_result([{"time": 0.0, "event": "start"}], target)


@pytest.mark.parametrize("field", ["max_epochs", "num_clocks_to_test", "n_trials",
                                   "plateau_size_for_convergence"])
def test_counts_below_one(field: str) -> None:
    changes: dict[str, Any] = {field: 0}
    with pytest.raises(InvalidArgumentError, match=f"{field} must be an integer >= 1"):
        BaselineConfig(**changes)


def test_other_bad_config_values() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"time_budget_s": 0.0}, "time_budget_s"),
        ({"sampler": "grid"}, "unknown baseline sampler"),
        ({"reduction_factor": 1}, "reduction_factor"),
        ({"n_startup_trials": -1}, "n_startup_trials"),
        ({"diverged_value": math.inf}, "diverged_value"),
    ]
    for changes, message in cases:
        with pytest.raises(InvalidArgumentError, match=message):
            BaselineConfig(**changes)


def test_batch_larger_than_an_epoch() -> None:
    system = LrSystem(clocks_per_epoch=0)
    with pytest.raises(InvalidArgumentError, match="larger than the whole epoch"):
        run_fixed(system, {"lr": 0.01}, config())
    space = SearchSpace([LogUniform("lr", 1e-4, 1.0), Choice("batch_size", [32, 640])])
    for baseline in (run_optuna, run_hyperband):
        with pytest.raises(InvalidArgumentError, match=r"'batch_size': 640.*0 clocks per epoch"):
            baseline(system, space, config())
    assert system.forks == []   # refused before any branch existed


def test_nothing_to_search_and_no_stop_rule() -> None:
    fixed_only = SearchSpace([LogUniform("lr", 1e-4, 1.0, search=False)])
    for baseline in (run_optuna, run_hyperband):
        with pytest.raises(InvalidArgumentError, match="nothing for the .* baseline to search"):
            baseline(LrSystem(), fixed_only, config())
        with pytest.raises(InvalidArgumentError, match="needs n_trials or time_budget_s"):
            baseline(LrSystem(), LR_SPACE, config(n_trials=None))


def test_not_a_branch_system_and_a_bad_setting() -> None:
    with pytest.raises(InvalidArgumentError, match="must implement BranchSystem"):
        run_fixed(object(), {"lr": 0.01})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="outside its declaration"):
        run_fixed(LrSystem(), {"lr": 5.0}, space=LR_SPACE)


def test_study_name_taken() -> None:
    storage = optuna.storages.InMemoryStorage()
    run_optuna(LrSystem(), LR_SPACE, config(max_epochs=1, n_trials=1, storage=storage,
                                            study_name="taken"))
    with pytest.raises(InvalidArgumentError, match="already has a study named 'taken'"):
        run_optuna(LrSystem(), LR_SPACE, config(max_epochs=1, n_trials=1, storage=storage,
                                                study_name="taken"))
