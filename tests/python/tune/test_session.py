"""TuningSession on a one-process job: the commands a driver gives become
engine branches and clocks; reports, times and data cursors come back right.

The model is linear regression trained by the servers' momentum rule; a
reference replays the same batches in float64 per branch.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pytest

import mltuner as mlt
from mltuner.launch import detect_environment
from mltuner.tune import BranchKind, BranchSystem, Choice, DecisionLog, LogUniform, SearchSpace, TunerConfig, TuningSession

IN, NUM_TRAIN, NUM_VAL, BATCH = 4, 40, 10, 4
LR = 0.1


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_TRAIN + NUM_VAL, IN))
    return x, x @ rng.normal(size=IN)


def space() -> SearchSpace:
    return SearchSpace([LogUniform("lr", 1e-3, 1.0, default=LR), Choice("batch_size", [BATCH, 2 * BATCH],
                                                                        default=BATCH, search=False)])


def open_job(**overrides: Any) -> mlt.Job:
    settings: dict[str, Any] = dict(update_rule=mlt.UpdateRule("momentum", learning_rate=LR, momentum=0.0),
                                    branches=True, wait_timeout_s=20)
    settings.update(overrides)
    return mlt.Job(mlt.Config(**settings), env=detect_environment({}))


def record_an_update(worker: mlt.Worker) -> tuple[mlt.Table, int]:
    """A one-row table and a clock that only updates it, started; the
    table and the update's handle."""
    table = worker.create_table("w", 1, IN)
    handle = worker.virtual_pre_update(table)
    worker.virtual_update(handle)
    worker.virtual_clock()
    worker.finish_virtual_iteration()
    worker.start_iterations()
    return table, handle


def train(job: mlt.Job, session: TuningSession, seen: list[tuple[int, str, list[int]]],
          record_read_update: Callable[..., tuple[int, int]]) -> None:
    """The training loop every rank runs (its clock recorded by conftest's
    ``record_read_update``); records (branch, kind, indices)."""
    read, grad = record_read_update(job.worker, job.worker.create_table("w", 1, IN))
    iterate(job.worker, session, seen, read, grad)


def iterate(worker: mlt.Worker, session: TuningSession, seen: list[tuple[int, str, list[int]]],
            read: int, grad: int) -> None:
    """train()'s loop over ``session``, its clock already recorded."""
    x, y = data()
    for step in session:
        w = np.asarray(worker.read(read), dtype=np.float64)[0]
        worker.post_read(read)
        seen.append((step.branch, step.kind.value, [int(i) for i in step.indices]))
        if step.kind is BranchKind.TESTING:
            xs, ys = x[NUM_TRAIN:][step.indices], y[NUM_TRAIN:][step.indices]
            worker.pre_update(grad)[:] = 0.0
            step.report(0.0, accuracy=float(np.mean(np.abs(xs @ w - ys) < 1.0)))
        else:
            xs, ys = x[step.indices], y[step.indices]
            residual = xs @ w - ys
            worker.pre_update(grad)[0] = xs.T @ residual / len(xs)
            step.report(float(np.mean(residual ** 2)))
        worker.update(grad)
        worker.clock()


def test_a_driver_forks_runs_and_frees_branches(record_read_update: Callable[..., tuple[int, int]]) -> None:
    calls: dict[str, Any] = {}

    def driver(system: BranchSystem) -> Any:
        root = system.fork(None, {"lr": LR, "batch_size": BATCH}, BranchKind.INIT)
        system.run(root, 1)
        first = system.fork(root, {"lr": 0.2, "batch_size": BATCH}, BranchKind.TRAINING)
        calls["first"] = system.run(first, 3)
        second = system.fork(first, {"lr": 0.05, "batch_size": 2 * BATCH}, BranchKind.TRAINING)
        calls["second"] = system.run(second, 2)
        test = system.fork(second, {"lr": 0.05, "batch_size": 2 * BATCH}, BranchKind.TESTING)
        calls["test"] = system.run(test, 3)
        system.free(test)
        system.free(first)
        calls["epoch"] = system.clocks_per_epoch({"lr": 0.1, "batch_size": BATCH})
        return None

    seen: list[tuple[int, str, list[int]]] = []
    with open_job() as job:
        session = TuningSession(job, space(), num_train=NUM_TRAIN, num_validation=NUM_VAL, driver=driver)
        train(job, session, seen, record_read_update)
        assert session.final_branch is None  # the driver returned no branch

    assert [len(calls[k]) for k in ("first", "second", "test")] == [3, 2, 3]
    assert all(r.seconds > 0 and np.isfinite(r.loss) for k in ("first", "second") for r in calls[k])
    assert calls["epoch"] == NUM_TRAIN // BATCH
    branches = [b for b, _, _ in seen]
    assert branches == [1, 1, 1, 2, 2, 3, 3, 3]  # the root ran no clock
    # The child continues the parent's training stream where the parent was
    # at the fork, with its own batch size; the testing branch walks the
    # validation set once.
    order = np.concatenate([idx for _, _, idx in seen[:5]])
    assert len(order) == 3 * BATCH + 2 * 2 * BATCH and len(set(order)) == len(order)
    assert sorted(i for _, _, idx in seen[5:] for i in idx) == list(range(NUM_VAL))
    # Accuracy of TESTING clocks is weighted by samples: clocks are of near-equal size.
    assert all(r.accuracy is not None and 0.0 <= r.accuracy <= 1.0 for r in calls["test"])
    assert sum(r.samples for r in calls["test"]) == NUM_VAL  # each clock's, for the tuner's weighted mean


def fixed_driver(system: BranchSystem) -> Any:
    """Three training clocks, a wider child, a validation pass."""
    root = system.fork(None, {"lr": LR, "batch_size": BATCH}, BranchKind.INIT)
    first = system.fork(root, {"lr": 0.2, "batch_size": BATCH}, BranchKind.TRAINING)
    system.run(first, 3)
    second = system.fork(first, {"lr": 0.05, "batch_size": 2 * BATCH}, BranchKind.TRAINING)
    system.run(second, 2)
    system.run(system.fork(second, {"lr": 0.05, "batch_size": 2 * BATCH}, BranchKind.TESTING), 3)


def test_a_dataloader_draws_each_steps_batch() -> None:
    """session.batch_sampler() over ConcatDataset([train, validation]): each
    batch holds the samples of the step's indices, validation ones on
    TESTING steps; a loader reading ahead of the session is refused."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import ConcatDataset, DataLoader, TensorDataset

    x, y = data()
    features = torch.from_numpy(x)
    dataset = ConcatDataset([TensorDataset(features[:NUM_TRAIN]), TensorDataset(features[NUM_TRAIN:])])
    with open_job() as job:
        worker = job.worker
        table, handle = record_an_update(worker)
        session = TuningSession(job, space(), num_train=NUM_TRAIN, num_validation=NUM_VAL, driver=fixed_driver)
        sampler = session.batch_sampler()
        with pytest.raises(mlt.InvalidArgumentError, match="ahead of the tuning session"):
            next(iter(sampler))  # no step yet
        kinds = []
        for step, (batch,) in zip(session, DataLoader(dataset, batch_sampler=sampler)):
            source = x[NUM_TRAIN:] if step.kind is BranchKind.TESTING else x[:NUM_TRAIN]
            np.testing.assert_array_equal(batch.numpy(), source[step.indices])
            with pytest.raises(mlt.InvalidArgumentError, match="num_workers=0"):
                next(sampler)  # a second batch for the same step
            kinds.append(step.kind)
            worker.pre_update(handle)[:] = 0.0
            step.report(0.0, accuracy=0.5 if step.kind is BranchKind.TESTING else None)
            worker.update(handle)
            worker.clock()
    assert kinds == [BranchKind.TRAINING] * 5 + [BranchKind.TESTING] * 3


def test_a_branch_keeps_the_rules_settings_the_space_does_not_tune() -> None:
    """Only lr is tuned: the branch's sgd keeps torch's momentum 0.9 (three
    steps of gradient 1 move w by -lr (1 + 1.9 + 2.71), not -3 lr)."""
    def driver(system: BranchSystem) -> Any:
        root = system.fork(None, {"lr": LR, "batch_size": BATCH}, BranchKind.INIT)
        system.run(system.fork(root, {"lr": 0.5, "batch_size": BATCH}, BranchKind.TRAINING), 3)

    rule = mlt.UpdateRule("sgd", learning_rate=LR, momentum=0.9)
    with open_job(update_rule=rule) as job:
        worker = job.worker
        table, handle = record_an_update(worker)
        for step in TuningSession(job, space(), num_train=NUM_TRAIN, num_validation=NUM_VAL, driver=driver):
            worker.pre_update(handle)[:] = 1.0
            step.report(0.0)
            worker.update(handle)
            worker.clock()
        worker.sync()  # fetch gives the servers' current values: wait for the last clock's update
        weights = worker.fetch(table, branch=1)
    np.testing.assert_allclose(weights, np.full((1, IN), -0.5 * (1 + 1.9 + 2.71)), rtol=1e-6)


def test_a_session_ended_on_the_init_root_reports_no_tuned_setting() -> None:
    """A driver that keeps the INIT root (a job that made no progress): the
    model trains on with each table's own rule, so the session's and the
    worker's trained setting is None, not the setting the search started from."""
    def driver(system: BranchSystem) -> Any:
        seen["root"] = root = system.fork(None, {"lr": 0.5, "batch_size": BATCH}, BranchKind.INIT)
        system.run(root, 1)
        return types.SimpleNamespace(branch=root, tunables={"lr": 0.5, "batch_size": BATCH})

    seen: dict[str, int] = {}

    with open_job() as job:
        worker = job.worker
        _, handle = record_an_update(worker)
        session = TuningSession(job, space(), num_train=NUM_TRAIN, num_validation=NUM_VAL, driver=driver)
        for step in session:
            worker.pre_update(handle)[:] = 0.0
            step.report(0.0)
            worker.update(handle)
            worker.clock()
        assert session.final_branch == worker.trained_branch == seen["root"]
        assert session.final_tunables is None and worker.trained_tunables is None


def test_the_tuner_runs_through_a_session(record_read_update: Callable[..., tuple[int, int]]) -> None:
    seen: list[tuple[int, str, list[int]]] = []
    config = TunerConfig(seed=0, num_clocks_to_eval=5, max_trials_per_search=4, max_epochs=2,
                         initial_trial_time_s=0.01, num_branches=6, n_startup_trials=2)
    with open_job(max_branches=8) as job:
        session = TuningSession(job, space(), num_train=NUM_TRAIN, num_validation=NUM_VAL, config=config)
        train(job, session, seen, record_read_update)
        assert session.result is not None and session.result.epochs == 2
        final = session.final_branch
        assert final == session.result.branch
        assert session.final_tunables == session.result.tunables
        weights = job.worker.fetch(job.worker.tables[0], branch=final)
        assert job.worker.trained_branch == final  # what mltuner.torch reads by default afterwards
    assert np.isfinite(weights).all()
    kinds = {kind for _, kind, _ in seen}
    assert kinds == {"evaluation", "training", "testing"}


def test_a_log_of_the_scripts_own_under_mltuner_run_reaches_the_runs_log_too(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, record_read_update: Callable[..., tuple[int, int]]) -> None:
    # `mltuner run` follows $MLTUNER_TUNING_LOG live and draws it; a script
    # that passes log= of its own left that file empty (nothing shown, no report).
    followed, own = tmp_path / "run.jsonl", tmp_path / "mine.jsonl"
    monkeypatch.setenv("MLTUNER_TUNING_LOG", str(followed))
    config = TunerConfig(seed=0, num_clocks_to_eval=5, max_trials_per_search=4, max_epochs=1,
                         initial_trial_time_s=0.01, num_branches=6, n_startup_trials=2)
    with open_job(max_branches=8) as job:
        session = TuningSession(job, space(), num_train=NUM_TRAIN, num_validation=NUM_VAL, config=config,
                                log=str(own))
        train(job, session, [], record_read_update)
    lines = own.read_text().splitlines()
    assert any('"event": "winner"' in line for line in lines)
    assert followed.read_text().splitlines() == lines


def test_a_second_session_starts_from_the_model_the_first_one_trained(
        record_read_update: Callable[..., tuple[int, int]]) -> None:
    # The first session frees branch 0, from which the second forked its
    # root ("cannot fork from branch 0: it does not exist").
    config = TunerConfig(seed=0, num_clocks_to_eval=5, max_trials_per_search=4, max_epochs=1,
                         initial_trial_time_s=0.01, num_branches=6, n_startup_trials=2)
    with open_job(max_branches=8) as job:
        worker = job.worker
        read, grad = record_read_update(worker, worker.create_table("w", 1, IN))
        first = TuningSession(job, space(), num_train=NUM_TRAIN, num_validation=NUM_VAL, config=config)
        iterate(worker, first, [], read, grad)
        worker.sync()  # the last clocks' branch is freed; the values read after a session wait for it
        log = DecisionLog()
        second = TuningSession(job, space(), num_train=NUM_TRAIN, num_validation=NUM_VAL, config=config, log=log)
        iterate(worker, second, [], read, grad)
        assert log.events("init")[0]["branch"] == first.final_branch
        assert second.final_branch is not None and worker.trained_branch == second.final_branch
        assert np.isfinite(worker.fetch(worker.tables[0], branch=second.final_branch)).all()


def test_errors_of_the_driver_reach_the_training_loop(record_read_update: Callable[..., tuple[int, int]]) -> None:
    def driver(system: BranchSystem) -> Any:
        system.fork(None, {"lr": LR, "batch_size": BATCH}, BranchKind.INIT)
        raise RuntimeError("the searcher broke")

    with open_job() as job, pytest.raises(RuntimeError, match="the searcher broke"):
        session = TuningSession(job, space(), num_train=NUM_TRAIN, num_validation=NUM_VAL, driver=driver)
        train(job, session, [], record_read_update)


def test_a_step_must_be_reported() -> None:
    def driver(system: BranchSystem) -> Any:
        root = system.fork(None, {"lr": LR, "batch_size": BATCH}, BranchKind.INIT)
        system.run(system.fork(root, {"lr": LR, "batch_size": BATCH}, BranchKind.TRAINING), 2)

    with open_job() as job:
        worker = job.worker
        _, handle = record_an_update(worker)
        session = TuningSession(job, space(), num_train=NUM_TRAIN, num_validation=NUM_VAL, driver=driver)
        with pytest.raises(mlt.InvalidArgumentError, match="was not reported"):
            for _ in session:
                worker.pre_update(handle)
                worker.update(handle)
                worker.clock()


@pytest.mark.parametrize(("overrides", "kwargs", "message"), [
    ({"branches": False}, {}, "branches=True"),
    ({"update_rule": mlt.UpdateRule("adam", learning_rate=LR)}, {"momentum": True}, "tunes momentum"),
    ({"max_branches": 4}, {}, "max_branches"),
    ({}, {"no_batch": True}, "batch_size"),
    ({}, {"num_validation": 0}, "num_validation"),
    ({}, {"steal_after": -1.0}, "steal_after"),
    ({}, {"steal_after": float("inf")}, "steal_after"),
])
def test_bad_sessions(overrides: Mapping[str, Any], kwargs: Mapping[str, Any], message: str) -> None:
    tunables: list[Any] = [LogUniform("lr", 1e-3, 1.0)]
    if kwargs.get("momentum"):
        tunables.append(LogUniform("momentum", 0.1, 0.9))
    if not kwargs.get("no_batch"):
        tunables.append(Choice("batch_size", [BATCH]))
    with open_job(**overrides) as job, pytest.raises(mlt.InvalidArgumentError, match=message):
        TuningSession(job, SearchSpace(tunables), num_train=NUM_TRAIN,
                      num_validation=int(kwargs.get("num_validation", NUM_VAL)),
                      steal_after=float(kwargs.get("steal_after", 2.0)))


def test_the_job_records_every_trial_in_a_journal_beside_its_log(
        tmp_path: Any, record_read_update: Callable[..., tuple[int, int]]) -> None:
    # What `mltuner tune` leaves in its output folder: decisions.jsonl and,
    # beside it, optuna.journal, which optuna.load_study opens as it is.
    import json

    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    searched = SearchSpace([LogUniform("lr", 1e-3, 1.0, default=LR),
                            Choice("batch_size", [BATCH, 2 * BATCH], default=BATCH)])
    # Noisy 4-sample batches and 10-clock epochs: with 4 trials the first
    # search may see no progress at all, so it gets 8.
    config = TunerConfig(seed=0, num_clocks_to_eval=5, max_trials_per_search=8, max_epochs=2,
                         initial_trial_time_s=0.01, num_branches=8, n_startup_trials=2,
                         search_share=None, study_name_prefix="job")
    log = tmp_path / "decisions.jsonl"
    with open_job(max_branches=10) as job:
        session = TuningSession(job, searched, num_train=NUM_TRAIN, num_validation=NUM_VAL,
                                config=config, log=str(log))
        train(job, session, [], record_read_update)
    storage = JournalStorage(JournalFileBackend(str(tmp_path / "optuna.journal")))
    names = {s.study_name for s in optuna.get_all_study_summaries(storage)}
    assert {"job-initial", "job-training"} <= names
    study = optuna.load_study(study_name="job-initial", storage=storage)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    forked = [r for r in records if r["event"] == "fork_trial" and r["search"] == 0]
    assert len(study.trials) == len(forked) >= 2
    for trial, fork in zip(study.trials, forked):
        assert trial.params["batch_size"] in (BATCH, 2 * BATCH)  # the real value
        assert trial.params == {k: fork["tunables"][k] for k in ("lr", "batch_size")}
        assert trial.value is not None and trial.value <= 0.0
        # The loss curve against milliseconds of the trial's own run time.
        assert len(trial.intermediate_values) == trial.user_attrs["clocks"]
        steps = sorted(trial.intermediate_values)
        assert steps[-1] >= round(trial.user_attrs["run_time_s"] * 1000) - 1
    training = optuna.load_study(study_name="job-training", storage=storage)
    assert [t.user_attrs["ended"] for t in training.trials][-1] == "end"
    assert list(training.trials[-1].intermediate_values) == [1, 2]  # validation accuracy per epoch


def test_a_batch_size_the_servers_cannot_run_is_refused() -> None:
    lr_only = SearchSpace([LogUniform("lr", 1e-3, 1.0, default=LR)])
    with open_job() as job:
        for bad in (0, -8, 2.5, True):
            with pytest.raises(mlt.InvalidArgumentError, match="batch_size must be an integer >= 1"):
                TuningSession(job, lr_only, num_train=NUM_TRAIN, num_validation=NUM_VAL, batch_size=bad)


def test_a_loop_that_leaves_the_session_early_is_warned_about() -> None:
    config = TunerConfig(seed=0, num_clocks_to_eval=5, max_trials_per_search=4, max_epochs=2,
                         initial_trial_time_s=0.01, num_branches=6, n_startup_trials=2)
    with open_job(max_branches=8) as job:
        worker = job.worker
        _, handle = record_an_update(worker)
        session = TuningSession(job, space(), num_train=NUM_TRAIN, num_validation=NUM_VAL, config=config)
        with pytest.warns(UserWarning, match="left the tuning session after 3 steps"):
            for number, step in enumerate(session):
                worker.pre_update(handle)[:] = 0.0
                step.report(1.0, accuracy=0.5 if step.kind is BranchKind.TESTING else None)
                worker.update(handle)
                worker.clock()
                if number == 2:
                    break  # a data loader that ran out, say
        assert session.final_branch is None
