"""A wrapped model in a tuning session: after the session, state_dict() and
evaluation read the branch the tuner kept (Worker.trained_branch); an
evaluation forward between the session's steps, which must each be a
training clock, is refused with that reason and leaves the model usable."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import mltuner  # noqa: E402
import mltuner.torch as mt  # noqa: E402
from mltuner.torch._optim import _rate_ratios, _scaled  # noqa: E402
from mltuner.tune import (  # noqa: E402
    BaselineConfig,
    BranchKind,
    BranchSystem,
    TunerConfig,
    TuningSession,
    default_space,
    run_optuna,
)

generator = torch.Generator().manual_seed(1)
X = torch.randn(600, 12, generator=generator)
Y = (X @ torch.randn(12, 3, generator=generator)).argmax(1)
X_TRAIN, Y_TRAIN, X_VAL, Y_VAL = X[:480], Y[:480], X[480:], Y[480:]


def test_after_a_session_the_model_is_the_branch_the_tuner_kept() -> None:
    torch.manual_seed(0)
    config = mltuner.Config(update_rule=mltuner.UpdateRule("damped_momentum", learning_rate=0.01, momentum=0.9),
                            branches=True)
    with mltuner.Job(config) as job:
        model = mt.wrap(nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3)), job.worker,
                        example_input=X_TRAIN[:32])
        session = TuningSession(job, default_space([32], lr_range=(1e-3, 1.0)), num_train=len(X_TRAIN),
                                num_validation=len(X_VAL),
                                config=TunerConfig(max_epochs=1, seed=0, max_trials_per_search=3))
        refused = 0
        for step in session:
            testing = step.kind is BranchKind.TESTING
            x, y = (X_VAL, Y_VAL) if testing else (X_TRAIN, Y_TRAIN)
            rows = torch.as_tensor(step.indices, dtype=torch.long)
            if testing and not refused:  # the usual torch validation: refused, the model untouched
                with pytest.raises(mltuner.OutOfOrderError, match="every step .TESTING ones too. is one training"):
                    with torch.no_grad():
                        model(x[rows])
                refused += 1
            logits = model(x[rows])
            loss = nn.functional.cross_entropy(logits, y[rows])
            loss.backward()
            model.step()
            step.report(loss.item(), accuracy=(logits.argmax(1) == y[rows]).float().mean().item() if testing else None)
        assert refused == 1 and session.final_branch is not None
        assert job.worker.trained_branch == session.final_branch != job.worker.branch
        kept = model.state_dict(branch=session.final_branch)
        default = model.state_dict()  # was the freed validation branch: refused, and the model broken
        for name in kept:
            assert torch.equal(default[name], kept[name]), name
        with torch.no_grad():
            assert torch.isfinite(model(X_VAL)).all()


def run_session(model: mt.PSModule, job: mltuner.Job, **options: Any) -> TuningSession:
    """A session over the model's clocks to its end (``options``: TuningSession's, as a driver)."""
    session = TuningSession(job, default_space([32], lr_range=(1e-3, 1.0)), num_train=len(X_TRAIN),
                            num_validation=len(X_VAL),
                            config=TunerConfig(max_epochs=1, seed=0, max_trials_per_search=3), **options)
    for step in session:
        testing = step.kind is BranchKind.TESTING
        x, y = (X_VAL, Y_VAL) if testing else (X_TRAIN, Y_TRAIN)
        rows = torch.as_tensor(step.indices, dtype=torch.long)
        logits = model(x[rows])
        loss = nn.functional.cross_entropy(logits, y[rows])
        loss.backward()
        model.optimizer.step()
        step.report(loss.item(), accuracy=(logits.argmax(1) == y[rows]).float().mean().item() if testing else None)
    return session


def test_after_a_session_the_loop_trains_on_with_the_tuned_setting(tmp_path: Path) -> None:
    """Clocks after the session run on its final branch, the param groups
    show the setting it trained with, and a checkpoint resumes with it."""
    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))

    config = mltuner.Config(branches=True)
    with mltuner.Job(config) as job:
        module = net()
        model = mt.wrap(module, job.worker, example_input=X_TRAIN[:32],
                        optimizer=torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9))
        session = run_session(model, job)
        tuned = session.final_tunables
        assert session.final_branch is not None and tuned is not None
        groups = model.optimizer.param_groups  # at once: a scheduler made here starts from them
        assert (groups[0]["lr"], groups[0]["momentum"]) == (tuned["lr"], tuned["momentum"])
        kept = model.state_dict()
        for _ in range(3):  # nobody scheduled these clocks: the final branch's
            nn.functional.cross_entropy(model(X_TRAIN[:32]), Y_TRAIN[:32]).backward()
            model.optimizer.step()
        assert job.worker.branch == session.final_branch
        trained = model.state_dict(branch=session.final_branch)
        assert not torch.equal(trained["0.weight"], kept["0.weight"])
        groups = model.optimizer.param_groups
        assert (groups[0]["lr"], groups[0]["momentum"]) == (tuned["lr"], tuned["momentum"])
        model.save_checkpoint(tmp_path)
    with mltuner.Job(config) as job:
        module = net()
        model = mt.wrap(module, job.worker, example_input=X_TRAIN[:32], resume_from=tmp_path,
                        optimizer=torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9))
        groups = model.optimizer.param_groups
        assert (groups[0]["lr"], groups[0]["momentum"]) == (tuned["lr"], tuned["momentum"])
        resumed = model.state_dict()
        for name in trained:
            assert torch.equal(resumed[name], trained[name]), name


def test_param_groups_keep_their_ratio_under_a_session_that_tunes_lr() -> None:
    """The tuned lr is the fastest group's: a group at a fifth of it stays at
    a fifth, and a group at 0 (a part frozen until later) never moves (every
    group trained at the tuned rate, the frozen part too). A group of only
    frozen parameters has no table, so its rate counts for nothing (it was
    taken for the fastest, and the groups showed rates no server applied)."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3),
                           nn.Linear(3, 3).requires_grad_(False))
    frozen, trained = module[0].weight.detach().clone(), module[2].weight.detach().clone()
    with mltuner.Job(mltuner.Config(branches=True)) as job:
        optimizer = torch.optim.SGD([{"params": module[0].parameters(), "lr": 0.0},
                                     {"params": module[2].parameters(), "lr": 0.002},
                                     {"params": module[4].parameters()},
                                     {"params": module[5].parameters(), "lr": 1.0}], lr=0.01, momentum=0.9)
        model = mt.wrap(module, job.worker, example_input=X_TRAIN[:32], optimizer=optimizer)
        session = run_session(model, job)
        assert session.final_tunables is not None
        tuned = session.final_tunables["lr"]
        rates = [group["lr"] for group in model.optimizer.param_groups]
        fifth = float(np.float32(float(np.float32(0.002)) / float(np.float32(0.01)) * float(np.float32(tuned))))
        assert rates == [0.0, fifth, tuned, 1.0]
        for after in (model.state_dict(), model.state_dict(branch=session.final_branch)):
            assert torch.equal(after["0.weight"], frozen)
            assert not torch.equal(after["2.weight"], trained)


def test_the_groups_rates_equal_the_servers_after_a_chain_of_forks() -> None:
    """A re-tune forks its winner from an earlier winner: the shards round
    the kept ratios once along the chain, as the adapter's mirror does, so
    the param groups show the rates the servers apply, bit for bit (a
    checkpoint saved after the session resumes them). Each table's step of a
    gradient of 1 from 0 is minus its rate."""
    rates, tuned = [0.1, 0.03, 0.0], [0.143, 0.849, 0.766]  # rounded at each fork, the last rate is 1 ulp off
    with mltuner.Job(mltuner.Config(branches=True)) as job:
        worker = job.worker
        tables = [worker.create_table(f"t{k}", 2, 3, update_rule=mltuner.UpdateRule("sgd", learning_rate=rate))
                  for k, rate in enumerate(rates)]
        handles = []
        for table in tables:
            handles.append(worker.virtual_pre_update(table))
            worker.virtual_update(handles[-1])
        worker.virtual_clock()
        worker.finish_virtual_iteration()
        worker.start_iterations()
        parent = 0
        for branch, rate in enumerate(tuned, start=1):
            worker.fork_branch(branch, parent, learning_rate=rate, keep_rate_ratios=True)
            parent = branch
        worker.schedule_branch(parent, 1)
        for handle in handles:
            worker.pre_update(handle)[:] = 1.0
            worker.update(handle)
        worker.clock()
        worker.sync()
        applied = [float(-worker.fetch(table, branch=parent)[0, 0]) for table in tables]
    assert applied == [float(np.float32(rate)) for rate in _scaled(_rate_ratios(rates), tuned[-1], len(rates))]
    assert applied[0] == float(np.float32(tuned[-1])) and applied[2] == 0.0


def test_a_session_that_ends_on_its_root_leaves_the_groups_as_the_servers_train() -> None:
    """A job without progress ends on the INIT root, which trains with each
    table's own rate, not the setting the tuner started from: the groups
    keep theirs. A scheduler made before the session restarts from the
    adopted rates where a session tuned them (its initial_lr)."""
    space = default_space([32], lr_range=(1e-7, 1.0))
    start = {**space.defaults(), "lr": 5e-7}

    class Result:
        def __init__(self, branch: int) -> None:
            self.branch, self.tunables = branch, start

    def no_progress(system: BranchSystem) -> Result:
        root = system.fork(None, start, BranchKind.INIT)
        system.run(root, 1)
        return Result(root)

    module = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))
    with mltuner.Job(mltuner.Config(branches=True)) as job:
        optimizer = torch.optim.SGD([{"params": module[0].parameters(), "lr": 1e-4},
                                     {"params": module[2].parameters()}], lr=1e-3, momentum=0.9)
        model = mt.wrap(module, job.worker, example_input=X_TRAIN[:32], optimizer=optimizer)
        session = TuningSession(job, space, num_train=len(X_TRAIN), num_validation=len(X_VAL), driver=no_progress)
        for step in session:
            rows = torch.as_tensor(step.indices, dtype=torch.long)
            loss = nn.functional.cross_entropy(model(X_TRAIN[rows]), Y_TRAIN[rows])
            loss.backward()
            model.optimizer.step()
            step.report(loss.item())
        assert session.final_branch == job.worker.trained_branch and job.worker.trained_tunables is None
        assert [group["lr"] for group in model.optimizer.param_groups] == [1e-4, 1e-3]
        torch.optim.lr_scheduler.StepLR(model.optimizer, step_size=10)  # sets initial_lr
        session = run_session(model, job)
        assert session.final_tunables is not None
        adopted = [group["lr"] for group in model.optimizer.param_groups]
        assert adopted[1] == session.final_tunables["lr"]
        torch.optim.lr_scheduler.LambdaLR(model.optimizer, lambda epoch: 1.0)
        assert [group["lr"] for group in model.optimizer.param_groups] == adopted


def test_rates_written_before_a_session_are_refused_only_where_their_ratios_changed() -> None:
    """A step of a scheduler between the last clock and the session keeps
    the groups' ratios: the session sets the rates anyway. Unfreezing a
    group (0 -> a rate) changes them, which the servers have not seen: the
    session is refused before it forks anything, and goes on after a clock."""
    module = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))
    with mltuner.Job(mltuner.Config(branches=True)) as job:
        optimizer = torch.optim.SGD([{"params": module[0].parameters(), "lr": 0.0},
                                     {"params": module[2].parameters()}], lr=0.01, momentum=0.9)
        model = mt.wrap(module, job.worker, example_input=X_TRAIN[:32], optimizer=optimizer)
        job.worker.schedule_branch(0, 1)
        nn.functional.cross_entropy(model(X_TRAIN[:32]), Y_TRAIN[:32]).backward()
        model.optimizer.step()
        model.optimizer.param_groups[0]["lr"] = 0.001  # unfrozen
        session = TuningSession(job, default_space([32], lr_range=(1e-3, 1.0)), num_train=len(X_TRAIN),
                                num_validation=len(X_VAL), config=TunerConfig(max_epochs=1, seed=0))
        with pytest.raises(mltuner.InvalidArgumentError, match="their ratios changed with them"):
            next(iter(session))
        assert job.worker.scheduled_ahead == 0
        job.worker.schedule_branch(0, 1)
        nn.functional.cross_entropy(model(X_TRAIN[:32]), Y_TRAIN[:32]).backward()
        model.optimizer.step()
        for group in model.optimizer.param_groups:
            group["lr"] *= 0.1  # StepLR's gamma: the same ratios, float32 aside
        session = run_session(model, job)
        assert session.final_tunables is not None
        rates = [group["lr"] for group in model.optimizer.param_groups]
        assert rates[1] == session.final_tunables["lr"]
        assert rates[0] == pytest.approx(rates[1] / 10, rel=1e-6)


def test_an_optuna_baseline_that_keeps_its_best_branch_leaves_the_model_trained() -> None:
    """run_optuna(keep_branch=True) as the session's driver: the model is its
    best trial's branch afterwards and trains on from it (without
    keep_branch every branch is freed and no values are left)."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))
    with mltuner.Job(mltuner.Config(branches=True)) as job:
        model = mt.wrap(module, job.worker, example_input=X_TRAIN[:32],
                        optimizer=torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9))
        space = default_space([32], lr_range=(1e-3, 1.0))
        session = run_session(model, job, driver=lambda system: run_optuna(system, space, BaselineConfig(
            max_epochs=1, n_trials=2, seed=0), keep_branch=True))
        result = session.result
        assert result is not None and result.branch is not None
        assert session.final_branch == job.worker.trained_branch == result.branch
        assert session.final_tunables == result.best_tunables
        kept = model.state_dict()
        assert model.optimizer.param_groups[0]["lr"] == result.best_tunables["lr"]
        nn.functional.cross_entropy(model(X_TRAIN[:32]), Y_TRAIN[:32]).backward()
        model.optimizer.step()
        assert job.worker.branch == result.branch
        assert not torch.equal(model.state_dict()["0.weight"], kept["0.weight"])


def test_a_rate_the_loop_changes_during_a_session_that_tunes_it_is_refused() -> None:
    """A scheduler stepped inside the session's loop would overwrite the rate
    the tuner gave the branch that runs next (it did, silently)."""
    config = mltuner.Config(branches=True)
    with mltuner.Job(config) as job:
        module = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))
        model = mt.wrap(module, job.worker, example_input=X_TRAIN[:32],
                        optimizer=torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9))
        scheduler = torch.optim.lr_scheduler.StepLR(model.optimizer, step_size=1, gamma=0.5)
        session = TuningSession(job, default_space([32], lr_range=(1e-3, 1.0)), num_train=len(X_TRAIN),
                                num_validation=len(X_VAL), config=TunerConfig(max_epochs=1, seed=0))
        with pytest.raises(mltuner.InvalidArgumentError, match="during a tuning session that tunes lr"), \
                pytest.warns(UserWarning, match="left the tuning session"):
            for step in session:
                rows = torch.as_tensor(step.indices, dtype=torch.long)
                loss = nn.functional.cross_entropy(model(X_TRAIN[rows]), Y_TRAIN[rows])
                loss.backward()
                model.optimizer.step()
                scheduler.step()
                step.report(loss.item())
        assert job.worker.tuned_settings == frozenset()  # the session is over


def test_a_clock_no_branch_will_run_is_refused_before_it_starts() -> None:
    """Nothing scheduled and no trained branch to go on from: the clock is
    refused before it starts, and the model goes on once one is scheduled
    (the engine's refusal at the clock's first read left it broken); a
    session that finds clocks still scheduled is refused."""
    with mltuner.Job(mltuner.Config(branches=True)) as job:
        module = nn.Sequential(nn.Linear(12, 3))
        model = mt.wrap(module, job.worker, example_input=X_TRAIN[:32],
                        optimizer=torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9))
        with pytest.raises(mltuner.OutOfOrderError, match="clock 0 of the wrapped model is not scheduled"):
            model(X_TRAIN[:32])
        job.worker.schedule_branch(0, 1)

        def clock() -> None:
            nn.functional.cross_entropy(model(X_TRAIN[:32]), Y_TRAIN[:32]).backward()
            model.optimizer.step()

        clock()
        job.worker.fork_branch(1, 0, learning_rate=0.5)
        job.worker.schedule_branch(1, 1)
        clock()
        for branch in (0, 1):  # the branch asked for, whatever the module's own hooks bind by default
            want = job.worker.fetch(job.worker.tables[0], branch=branch).reshape(-1)[:36].reshape(3, 12)
            assert torch.equal(model.state_dict(branch=branch)["0.weight"], torch.from_numpy(want))
        assert job.worker.scheduled_ahead == 0 and job.worker.next_branch is None
        job.worker.schedule_branch(0, 2)
        assert job.worker.scheduled_ahead == 2 and job.worker.next_branch == 0
        session = TuningSession(job, default_space([32], lr_range=(1e-3, 1.0)), num_train=len(X_TRAIN),
                                num_validation=len(X_VAL), config=TunerConfig(max_epochs=1, seed=0))
        with pytest.raises(mltuner.OutOfOrderError, match="2 clocks are still scheduled .*, the next on branch 0"):
            next(iter(session))


def test_each_branch_keeps_its_own_grad_scaler_state() -> None:
    """A branch starts from its parent's scale at the fork and keeps its own:
    a diverging trial backing the scale off leaves the others' alone (it
    backed it off for every branch after it). The reference is plain
    PyTorch with a model, optimizer and scaler per branch, each a copy of
    its parent's at the fork (SGD without momentum: an overflowing clock's
    zero update is then the skipped step)."""
    batches = [(X_TRAIN[i * 32:(i + 1) * 32], Y_TRAIN[i * 32:(i + 1) * 32]) for i in range(12)]
    # (branch, clocks, diverging) runs and ("fork", child, parent) / ("free", branch) events
    # Forks before any clock (the root's own state kept), a freed branch's id
    # forked again while the scaler held its state (it kept the freed one's).
    plan: list[tuple[Any, ...]] = [("fork", 1, 0), (1, 2, True), ("free", 1), ("fork", 1, 0), (1, 1, False),
                                   (0, 2, False), ("fork", 2, 0), ("fork", 3, 1), (2, 3, True), (3, 2, False),
                                   (0, 1, True), ("fork", 4, 2), ("free", 2), (4, 1, False), (3, 1, False),
                                   (0, 1, False)]

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))

    def clock(model: Any, optimizer: Any, scaler: torch.amp.GradScaler, batch: int,
              diverging: bool) -> tuple[float, float]:
        optimizer.zero_grad()
        x, y = batches[batch]
        loss = nn.functional.cross_entropy(model(x), y) * (1e38 if diverging else 1.0)  # inf once scaled
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss.item(), scaler.get_scale()

    plain_net = net()
    plain_optimizer = torch.optim.SGD(plain_net.parameters(), lr=0.1)
    plain = {0: (plain_net, plain_optimizer, torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2))}
    want, got, batch = [], [], 0
    for step in plan:
        if step[0] == "fork":
            plain[step[1]] = copy.deepcopy(plain[step[2]])
        elif step[0] == "free":
            del plain[step[1]]
        else:
            for _ in range(step[1]):
                want.append(clock(*plain[step[0]], batch % len(batches), step[2]))
                batch += 1
    with mltuner.Job(mltuner.Config(branches=True)) as job:
        module = net()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        model = mt.wrap(module, job.worker, example_input=X_TRAIN[:32], grad_scaler=scaler,
                        optimizer=torch.optim.SGD(module.parameters(), lr=0.1))
        batch = 0
        for step in plan:
            if step[0] == "fork":
                job.worker.fork_branch(step[1], step[2])
            elif step[0] == "free":
                job.worker.free_branch(step[1])
            else:
                job.worker.schedule_branch(step[0], step[1])
                for _ in range(step[1]):
                    got.append(clock(model, model.optimizer, scaler, batch % len(batches), step[2]))
                    batch += 1
    assert [scale for _, scale in got] == [scale for _, scale in want]
    assert [loss for loss, _ in got] == pytest.approx([loss for loss, _ in want], rel=1e-5)
