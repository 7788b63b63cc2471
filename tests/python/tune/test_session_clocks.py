"""What a TuningSession makes of its branches' slack and of its validation
clocks, on rank 0 of a two-rank job simulated in one process.

- A branch's slack in the session is the slack the engine's branch has:
  EVALUATION and TESTING branches are forked at slack 0, so an EVALUATION
  run (lr = 0, training data) never steals batches whatever the trial's
  staleness; a TRAINING run at staleness >= 1 does.
- ``TunerConfig.num_clocks_to_test`` is None by default (cover the validation
  set once); a number the user sets is honoured, and one that disagrees with
  ``validation_batch_size`` is refused rather than silently replaced.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from mltuner.exceptions import InvalidArgumentError
from mltuner.tune import (
    BaselineConfig,
    BranchKind,
    BranchSystem,
    Choice,
    LogUniform,
    Outcome,
    SearchSpace,
    Tuner,
    TunerConfig,
    TuningSession,
)
from mltuner.tune._config import DEFAULT_CLOCKS_TO_TEST

NUM_TRAIN, NUM_VAL, BATCH, WORLD = 64, 10, 4, 2
READ_SLACK = 2  # the least slack of the fake worker's recorded reads
SETTING = {"lr": 0.1, "batch_size": BATCH, "staleness": 1}


class FakeWorker:
    """The engine calls a session makes, recorded."""

    read_slack = READ_SLACK
    stall_seconds = 0.0
    trained_branch = None  # no session ran before
    tuned_settings: frozenset[str] = frozenset()
    scheduled_ahead = 0  # nothing left of an earlier schedule
    next_branch = None

    def __init__(self) -> None:
        self.forks: dict[int, int | None] = {}  # child -> the slack it was forked with
        self.scheduled: list[tuple[int, int]] = []
        self.declared: list[tuple[int, int, int]] = []

    def fork_branch(self, child: int, parent: int, *, learning_rate: float | None = None,
                    momentum: float | None = None, training: bool = True, slack: int | None = None,
                    keep_rate_ratios: bool = False) -> None:
        self.forks[child] = slack

    def free_branch(self, branch: int) -> None:
        pass

    def check_session_start(self, settings: frozenset[str]) -> None:
        pass

    def schedule_branch(self, branch: int, clocks: int) -> None:
        self.scheduled.append((branch, clocks))

    def declare_empty_clock(self, worker: int, branch: int, clock: int) -> None:
        self.declared.append((worker, branch, clock))

    def set_trained(self, branch: int | None, tunables: dict[str, Any] | None) -> None:
        self.trained_branch = branch


class TwoRanks:
    """Rank 0 of a two-rank job: every allgather hands back rank 0's value
    as rank 1's too (a rank 1 in lockstep), and rank 0 answers its own
    requests. Records what went through the allgathers."""

    rank = 0
    world_size = WORLD

    def __init__(self) -> None:
        self.worker: Any = FakeWorker()  # the Worker calls the session makes
        self.gathered: list[tuple[str, Any]] = []
        self._handlers: dict[str, Callable[[int, Any], Any]] = {}

    def allgather(self, name: str, value: Any, timeout_s: float | None = None) -> list[Any]:
        self.gathered.append((name, value))
        return [value] * self.world_size

    def serve(self, name: str, handler: Callable[[int, Any], Any] | None) -> None:
        if handler is None:
            self._handlers.pop(name, None)
        else:
            self._handlers[name] = handler

    def request(self, name: str, value: Any, timeout_s: float | None = None) -> Any:
        return self._handlers[name](0, value)

    def run_commands(self) -> list[dict[str, Any]]:
        return [value for name, value in self.gathered if name.endswith("-command") and value["op"] == "run"]


def space() -> SearchSpace:
    return SearchSpace([LogUniform("lr", 1e-3, 1.0, default=0.1),
                        Choice("batch_size", [BATCH], default=BATCH, search=False),
                        Choice("staleness", [0, 1], default=1)])


def loop(session: TuningSession) -> list[tuple[BranchKind, int, bool, int, list[int]]]:
    """The training loop: (kind, branch, whether the run steals, its slack,
    indices) per step."""
    seen = []
    for step in session:
        seen.append((step.kind, step.branch, session._run_steals, session._run_slack,
                     [int(i) for i in step.indices]))
        step.report(0.5, accuracy=1.0 if step.kind is BranchKind.TESTING else None)
    return seen


# -- 1. a branch's slack is the engine's --------------------------------------------------


def test_the_sessions_slack_of_each_kind_is_the_slack_its_fork_gave_the_engine() -> None:
    job = TwoRanks()
    session = TuningSession(job, space(), num_train=NUM_TRAIN, num_validation=NUM_VAL, steal_batches=True)
    stale = {**SETTING, "staleness": 3}
    session._fork(0, None, stale, BranchKind.INIT)  # the root: not forked in the engine
    session._fork(1, 0, SETTING, BranchKind.TRAINING)
    session._fork(2, 0, {"lr": 0.1, "batch_size": BATCH}, BranchKind.TRAINING)  # no staleness in the space
    session._fork(3, 0, stale, BranchKind.EVALUATION)
    session._fork(4, 1, stale, BranchKind.TESTING)
    assert job.worker.forks == {1: 1, 2: None, 3: 0, 4: 0}  # what the engine's branches got (as before)
    slack = {branch: session._slack_of(session._branches[branch]) for branch in range(5)}
    assert slack == {0: READ_SLACK, 1: 1, 2: READ_SLACK, 3: 0, 4: 0}
    for branch, forked in job.worker.forks.items():  # None: each read's own
        assert slack[branch] == (READ_SLACK if forked is None else forked)
    assert session._slack_of(None) == READ_SLACK


def test_an_evaluation_run_does_not_steal_and_a_training_run_at_staleness_1_does() -> None:
    def driver(system: BranchSystem) -> None:
        root = system.fork(None, SETTING, BranchKind.INIT)
        evaluation = system.fork(root, SETTING, BranchKind.EVALUATION)  # the trial's staleness 1
        system.run(evaluation, 2)
        system.free(evaluation)
        training = system.fork(root, SETTING, BranchKind.TRAINING)
        system.run(training, 2)
        bsp = system.fork(root, {**SETTING, "staleness": 0}, BranchKind.TRAINING)
        system.run(bsp, 2)
        testing = system.fork(training, SETTING, BranchKind.TESTING)
        system.run(testing, 2)

    job = TwoRanks()
    session = TuningSession(job, space(), num_train=NUM_TRAIN, num_validation=NUM_VAL, driver=driver,
                            steal_batches=True)
    seen = loop(session)
    assert [(c["branch"], c["steal"]) for c in job.run_commands()] == [(1, False), (2, True), (3, False),
                                                                        (4, False)]
    assert [(kind, branch, steals, slack) for kind, branch, steals, slack, _ in seen] == [
        (BranchKind.EVALUATION, 1, False, 0), (BranchKind.EVALUATION, 1, False, 0),
        (BranchKind.TRAINING, 2, True, 1), (BranchKind.TRAINING, 2, True, 1),
        (BranchKind.TRAINING, 3, False, 0), (BranchKind.TRAINING, 3, False, 0),
        (BranchKind.TESTING, 4, False, 0), (BranchKind.TESTING, 4, False, 0)]
    # The stealing run's clocks were claimed; nobody was late, so rank 0 kept its own half.
    assert session.clocks_given == session.clocks_taken == 0 and not job.worker.declared
    for _, _, _, _, indices in seen[2:4]:
        assert len(indices) == BATCH * WORLD // 2


# -- 2. the validation clocks -------------------------------------------------------------


def test_tuner_config_leaves_the_validation_clocks_to_the_session_by_default() -> None:
    assert TunerConfig().num_clocks_to_test is None
    assert TunerConfig(num_clocks_to_test=None).num_clocks_to_test is None
    assert TunerConfig(num_clocks_to_test=3).num_clocks_to_test == 3


@pytest.mark.parametrize("bad", [0, -1, 2.5, "3", True])
def test_tuner_config_refuses_a_number_of_validation_clocks_below_1(bad: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="num_clocks_to_test must be an integer >= 1"):
        TunerConfig(num_clocks_to_test=bad)


def test_an_explicit_num_clocks_to_test_is_honoured_without_a_validation_batch() -> None:
    def driver(system: BranchSystem) -> None:
        root = system.fork(None, SETTING, BranchKind.INIT)
        system.run(system.fork(root, SETTING, BranchKind.TESTING), session.config.num_clocks_to_test or 0)

    job = TwoRanks()
    session = TuningSession(job, space(), num_train=NUM_TRAIN, num_validation=NUM_VAL,
                            config=TunerConfig(num_clocks_to_test=3), driver=driver)
    # The training batch would give ceil(10 / (4 x 2)) = 2 clocks: the config's 3 stay.
    assert session.config.num_clocks_to_test == 3
    seen = loop(session)
    # Three clocks of near-equal size, each split between the two ranks (rank 0's first half).
    parts = np.array_split(np.arange(NUM_VAL), 3)
    assert [indices for *_, indices in seen] == [np.array_split(p, WORLD)[0].tolist() for p in parts]
    # More clocks than validation samples would leave clocks empty: one sample a clock.
    more = TuningSession(TwoRanks(), space(), num_train=NUM_TRAIN, num_validation=NUM_VAL,
                         config=TunerConfig(num_clocks_to_test=50))
    assert more.config.num_clocks_to_test == NUM_VAL


def test_a_validation_batch_and_a_different_num_clocks_to_test_are_refused() -> None:
    # 10 samples at 5 a worker on 2 workers: one clock.
    conflict = r"validation_batch_size=5 .* 1 clock\(s\) .* num_clocks_to_test is 3"
    with pytest.raises(InvalidArgumentError, match=conflict):
        TuningSession(TwoRanks(), space(), num_train=NUM_TRAIN, num_validation=NUM_VAL, validation_batch_size=5,
                      config=TunerConfig(num_clocks_to_test=3))
    agreeing = TuningSession(TwoRanks(), space(), num_train=NUM_TRAIN, num_validation=NUM_VAL,
                             validation_batch_size=5, config=TunerConfig(num_clocks_to_test=1))
    assert agreeing.config.num_clocks_to_test == 1
    with pytest.raises(InvalidArgumentError, match="validation_batch_size must be an integer >= 1"):
        TuningSession(TwoRanks(), space(), num_train=NUM_TRAIN, num_validation=NUM_VAL, validation_batch_size=0)


@pytest.mark.parametrize(("kwargs", "clocks"), [
    ({}, math.ceil(NUM_VAL / (BATCH * WORLD))),  # the space's batch
    ({"validation_batch_size": 1}, math.ceil(NUM_VAL / WORLD)),
    ({"config": TunerConfig(seed=3)}, math.ceil(NUM_VAL / (BATCH * WORLD))),
])
def test_by_default_the_clocks_cover_the_validation_set_once(kwargs: dict[str, Any], clocks: int) -> None:
    session = TuningSession(TwoRanks(), space(), num_train=NUM_TRAIN, num_validation=NUM_VAL, **kwargs)
    assert session.config.num_clocks_to_test == clocks
    if "config" in kwargs:
        assert session.config.seed == 3  # the rest of the config is kept


def test_without_a_session_a_validation_runs_the_default_clocks(quadratic_system: Any) -> None:
    system = quadratic_system(seed=0)
    config = TunerConfig(seed=0, initial_trial_time_s=0.1, retune="off", max_epochs=1, search_share=None)
    runs: list[tuple[BranchKind, int]] = []
    run = system.run

    def recorded(branch: int, clocks: int) -> Any:
        runs.append((system._branches[branch].kind, clocks))
        return run(branch, clocks)

    system.run = recorded
    result = Tuner(system, SearchSpace([LogUniform("lr", 1e-5, 1.0)]), config).run()
    assert result.outcome is Outcome.MAX_EPOCHS
    tests = [clocks for kind, clocks in runs if kind is BranchKind.TESTING]
    assert tests and all(clocks == DEFAULT_CLOCKS_TO_TEST == 100 for clocks in tests)


def test_a_baseline_validates_like_the_tuner_config_it_matches() -> None:
    assert BaselineConfig().num_clocks_to_test == DEFAULT_CLOCKS_TO_TEST
    assert BaselineConfig.matching(TunerConfig()).num_clocks_to_test == DEFAULT_CLOCKS_TO_TEST
    assert BaselineConfig.matching(TunerConfig(num_clocks_to_test=7)).num_clocks_to_test == 7
    session = TuningSession(TwoRanks(), space(), num_train=NUM_TRAIN, num_validation=NUM_VAL)
    assert BaselineConfig.matching(session.config).num_clocks_to_test == session.config.num_clocks_to_test == 2


# -- 3. every rank's arguments ------------------------------------------------------------


class RankOneDiffers(TwoRanks):
    """Rank 1 started its session with ``differ`` among its arguments."""

    def __init__(self, differ: dict[str, Any]) -> None:
        super().__init__()
        self._differ = differ

    def allgather(self, name: str, value: Any, timeout_s: float | None = None) -> list[Any]:
        values = super().allgather(name, value, timeout_s)
        return [values[0], {**values[1], **self._differ}] if name.endswith("-arguments") else values


@pytest.mark.parametrize("differ, message", [
    ({"seed": 1}, "seed=0 here, 1 on rank 1"),
    ({"num_train": NUM_TRAIN // 2}, f"num_train={NUM_TRAIN} here, {NUM_TRAIN // 2} on rank 1"),
    ({"steal_batches": True}, "steal_batches=False here, True on rank 1"),
])
def test_a_rank_started_with_other_arguments_is_refused_before_the_first_step(differ: dict[str, Any],
                                                                               message: str) -> None:
    # Ranks cut each clock's samples from one shuffled order: another seed or
    # set size trained on overlapping samples silently; stealing on one rank
    # only waited out the timeout in a gather the others never joined.
    def driver(system: BranchSystem) -> None:
        system.run(system.fork(None, SETTING, BranchKind.TRAINING), 1)

    session = TuningSession(RankOneDiffers(differ), space(), num_train=NUM_TRAIN, num_validation=NUM_VAL,
                            driver=driver, seed=0)
    with pytest.raises(InvalidArgumentError, match=f"same arguments; {message}"):
        loop(session)


def test_a_step_without_samples_of_this_rank_is_a_batch_of_zero_samples() -> None:
    # A stolen part, or the last validation clock of a set that does not
    # split evenly: torch's default collate raised IndexError on [].
    torch = pytest.importorskip("torch")
    from torch.utils.data import TensorDataset

    from mltuner.tune.session import collate_allowing_empty

    dataset = TensorDataset(torch.randn(5, 3, 2), torch.arange(5))
    collate = collate_allowing_empty(dataset)
    x, y = collate([])
    assert x.shape == (0, 3, 2) and x.dtype == torch.float32 and y.shape == (0,) and y.dtype == torch.int64
    x, y = collate([dataset[1], dataset[3]])
    assert torch.equal(x, dataset.tensors[0][[1, 3]]) and torch.equal(y, torch.tensor([1, 3]))


@pytest.mark.parametrize("accuracy", [95.0, -0.1])
def test_an_accuracy_that_is_no_fraction_is_refused(accuracy: float) -> None:
    def driver(system: BranchSystem) -> None:
        root = system.fork(None, SETTING, BranchKind.INIT)
        system.run(system.fork(root, SETTING, BranchKind.TESTING), 1)

    session = TuningSession(TwoRanks(), space(), num_train=NUM_TRAIN, num_validation=NUM_VAL, driver=driver)
    steps = iter(session)
    with pytest.raises(InvalidArgumentError, match="accuracy must be a fraction in \\[0, 1\\]"):
        next(steps).report(0.5, accuracy=accuracy)  # a percentage, or a slip
    with pytest.warns(UserWarning, match="left the tuning session"):
        steps.close()
