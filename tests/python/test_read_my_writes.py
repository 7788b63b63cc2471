"""Read-my-writes (``Config.read_my_writes``): under a slack, a worker's reads
hold its own updates through the previous clock at once, while the other
workers' may come up to the slack late.

One worker's own updates are all the updates, so at any slack its every read
must equal plain sequential training (a numpy reference in float64), however
late the shard's rows arrive. The CUDA variants run where the engine was
built with CUDA and a GPU is visible (the lent device).
"""

from __future__ import annotations

import numpy as np
import pytest

import mltuner as mlt

ROWS, WIDTH, CLOCKS, LR = 16, 8, 15, 0.05

RULES = {
    "add": mlt.UpdateRule("add"),
    "sgd": mlt.UpdateRule("sgd", learning_rate=LR),
    "sgd_momentum": mlt.UpdateRule("sgd", learning_rate=LR, momentum=0.9),
    "damped_momentum": mlt.UpdateRule("damped_momentum", learning_rate=LR, momentum=0.9),
}

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    mlt.cuda_device_count() == 0, reason="needs the CUDA backend and a visible GPU"))]


def _initial() -> np.ndarray:
    return np.random.default_rng(3).normal(size=(ROWS, WIDTH)).astype(np.float32)


def _gradient(weights: np.ndarray, clock: int) -> np.ndarray:
    """A 'gradient' that depends on what was read, so a stale read shows."""
    return (np.tanh(weights) + 0.1 * np.sin(0.3 * clock + np.arange(WIDTH))).astype(np.float32)


def _sequential(rule: str) -> list[np.ndarray]:
    """The parameters before each clock of plain training (float64)."""
    weights = _initial().astype(np.float64)
    history = np.zeros_like(weights)
    seen = []
    for clock in range(CLOCKS):
        seen.append(weights.copy())
        gradient = _gradient(weights.astype(np.float32), clock).astype(np.float64)
        if rule == "add":
            weights += gradient
        elif rule == "sgd":
            weights -= LR * gradient
        elif rule == "sgd_momentum":  # torch: the buffer starts as the first gradient
            history = gradient if clock == 0 else 0.9 * history + gradient
            weights -= LR * history
        else:
            history = 0.1 * gradient + 0.9 * history
            weights -= LR * history
    return seen


def _as_numpy(buffer: object, device: str) -> np.ndarray:
    if device == "cpu":
        return np.array(buffer)
    import torch
    return torch.from_dlpack(buffer).cpu().numpy()


def _write(buffer: object, values: np.ndarray, device: str) -> None:
    if device == "cpu":
        buffer[...] = values  # type: ignore[index]
        return
    import torch
    torch.from_dlpack(buffer).copy_(torch.from_numpy(values))


def _train_one_worker(device: str, rule: str, slack: int, halves: bool = False,
                      **config: object) -> tuple[list[np.ndarray], int]:
    """One worker at `slack`: what it read before each clock, and the
    engine's count of own steps added to its cache. With `halves`, each
    clock updates the table twice, half its rows each (the engine then sums
    them in an update log)."""
    cfg = mlt.Config(device=device, update_rule=RULES[rule], wait_timeout_s=30, **config)  # type: ignore[arg-type]
    out: dict[str, object] = {}

    def body(worker: mlt.Worker) -> None:
        table = worker.create_table("w", ROWS, WIDTH)
        read = worker.virtual_read(table, slack=slack)
        parts = [list(range(ROWS // 2, ROWS)), list(range(ROWS // 2))] if halves else [list(range(ROWS))]
        updates = []
        for rows in parts:
            updates.append(worker.virtual_pre_update(table, rows=rows))
            worker.virtual_update(updates[-1])
        worker.virtual_post_read(read)
        worker.virtual_clock()
        worker.finish_virtual_iteration()
        for rows, update in zip(parts, updates):
            _write(worker.pre_update(update), _initial()[rows], device)
            worker.update(update)
        worker.start_iterations()
        seen = []
        for clock in range(CLOCKS):
            weights = _as_numpy(worker.read(read), device)
            seen.append(weights)
            gradient = _gradient(weights, clock)
            for rows, update in zip(parts, updates):
                _write(worker.pre_update(update), gradient[rows], device)
                worker.update(update)
            worker.post_read(read)
            worker.clock()
        worker.sync()
        out["seen"] = seen
        out["own_steps"] = int(worker.stats["own_steps"])

    with mlt.LocalCluster(1, cfg) as cluster:
        cluster.run(body, timeout_s=120)
    return out["seen"], out["own_steps"]  # type: ignore[return-value]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rule", sorted(RULES))
def test_one_worker_at_slack_3_reads_what_sequential_training_has(device: str, rule: str) -> None:
    seen, own_steps = _train_one_worker(device, rule, slack=3)
    for clock, (got, want) in enumerate(zip(seen, _sequential(rule))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"clock {clock}")
    assert own_steps == CLOCKS


@pytest.mark.parametrize("device", DEVICES)
def test_a_table_updated_twice_a_clock_is_mirrored_from_its_update_log(device: str) -> None:
    seen, own_steps = _train_one_worker(device, "damped_momentum", slack=3, halves=True)
    for clock, (got, want) in enumerate(zip(seen, _sequential("damped_momentum"))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"clock {clock}")
    assert own_steps == CLOCKS


@pytest.mark.parametrize("device", DEVICES)
def test_it_is_off_where_nothing_is_stale_or_the_rule_is_not_linear(device: str) -> None:
    assert _train_one_worker(device, "damped_momentum", slack=0)[1] == 0
    assert _train_one_worker(device, "damped_momentum", slack=3, read_my_writes=False)[1] == 0
    RULES["adam"] = mlt.UpdateRule("adam", learning_rate=0.01)
    try:
        assert _train_one_worker(device, "adam", slack=3)[1] == 0
    finally:
        del RULES["adam"]


def test_each_worker_sees_its_own_adds_at_once_and_the_others_within_the_slack() -> None:
    """Three workers, each adding 1 to its own row every clock, at slack 2,
    one of them slow: a read at clock c holds exactly c of its own adds, and
    between c - 2 and c of every other worker's."""
    workers, slack = 3, 2
    cfg = mlt.Config(update_rule=mlt.UpdateRule("add"), wait_timeout_s=30)
    problems: list[str] = []

    def body(worker: mlt.Worker) -> None:
        table = worker.create_table("counts", workers, 2)
        read = worker.virtual_read(table, slack=slack)
        update = worker.virtual_pre_update(table, rows=[worker.rank])
        worker.virtual_update(update)
        worker.virtual_post_read(read)
        worker.virtual_clock()
        worker.finish_virtual_iteration()
        worker.start_iterations()
        for clock in range(20):
            if worker.rank == 2 and clock % 5 == 0:
                import time
                time.sleep(0.02)
            counts = np.array(worker.read(read))
            if counts[worker.rank, 0] != clock:
                problems.append(f"worker {worker.rank} clock {clock}: own count {counts[worker.rank, 0]}")
            for other in range(workers):
                if not clock - slack <= counts[other, 0] <= clock:
                    problems.append(f"worker {worker.rank} clock {clock}: worker {other}'s count {counts[other, 0]}")
            worker.pre_update(update)[...] = 1.0
            worker.update(update)
            worker.post_read(read)
            worker.clock()
        worker.sync()

    with mlt.LocalCluster(workers, cfg) as cluster:
        cluster.run(body, timeout_s=120)
    assert problems == []


def test_the_environment_sets_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLTUNER_READ_MY_WRITES", raising=False)
    assert mlt.Config().read_my_writes is True
    monkeypatch.setenv("MLTUNER_READ_MY_WRITES", "0")
    assert mlt.Config().read_my_writes is False
    assert mlt.Config(read_my_writes=True).read_my_writes is True  # an explicit value wins
    monkeypatch.setenv("MLTUNER_READ_MY_WRITES", "1")
    assert mlt.Config().read_my_writes is True
    monkeypatch.setenv("MLTUNER_READ_MY_WRITES", "off")
    with pytest.raises(mlt.InvalidArgumentError, match="MLTUNER_READ_MY_WRITES must be 0 or 1"):
        mlt.Config()


def test_a_fork_that_keeps_rate_ratios_steps_each_table_at_its_own_rate() -> None:
    """Read-my-writes follows each table's rate on a branch as its shard
    applies it: a fork that keeps the rates' ratios (a tuning session's),
    a rate set in between (a scheduler's), and a fork that keeps the
    parent's rates. One worker at slack 3 reads exactly what sequential
    training at those rates has, however late the shard's rows arrive (its
    own steps were taken at the branch's one rate for every table). Without
    momentum: after a fork the mirror's share of it starts at zero, a
    documented approximation (cache/own_updates.h)."""
    rates, momentum, tuned = {"fast": 0.05, "slow": 0.01}, 0.0, 0.2
    schedule = [(1, 5), (2, 5)]  # (branch, clocks): fork 1 keeps ratios at `tuned`; fork 2 keeps 1's rates
    set_slow_at = 3  # the slow table's rate set before this clock of branch 1
    cfg = mlt.Config(branches=True, update_rule=mlt.UpdateRule("sgd", learning_rate=LR, momentum=momentum),
                     wait_timeout_s=30)
    out: dict[str, list[np.ndarray]] = {}

    def body(worker: mlt.Worker) -> None:
        tables = [worker.create_table(name, ROWS, WIDTH, update_rule=mlt.UpdateRule("sgd", learning_rate=rate,
                                                                                       momentum=momentum))
                  for name, rate in rates.items()]
        reads = [worker.virtual_read(table, slack=3) for table in tables]
        updates = []
        for table in tables:
            updates.append(worker.virtual_pre_update(table))
            worker.virtual_update(updates[-1])
        for read in reads:
            worker.virtual_post_read(read)
        worker.virtual_clock()
        worker.finish_virtual_iteration()
        for update in updates:
            worker.pre_update(update)[...] = _initial()
            worker.update(update)
        worker.start_iterations()
        worker.fork_branch(1, 0, learning_rate=tuned, keep_rate_ratios=True)
        seen: list[np.ndarray] = []
        clock = 0
        for branch, clocks in schedule:
            if branch == 2:
                worker.fork_branch(2, 1)
            worker.schedule_branch(branch, clocks)
            for _ in range(clocks):
                if clock == set_slow_at:
                    worker.set_learning_rate(tables[1], 0.03)
                weights = [np.array(worker.read(read)) for read in reads]
                seen.append(np.stack(weights))
                for update, w in zip(updates, weights):
                    worker.pre_update(update)[...] = _gradient(w, clock)
                    worker.update(update)
                for read in reads:
                    worker.post_read(read)
                worker.clock()
                clock += 1
        worker.sync()
        out["seen"] = seen

    with mlt.LocalCluster(1, cfg) as cluster:
        cluster.run(body, timeout_s=120)
    # Sequential training at each table's rate: the fork's tuned x ratio, then the set one.
    weights = [_initial().astype(np.float64) for _ in rates]
    history = [np.zeros_like(w) for w in weights]
    step_rates = [tuned, float(np.float32(tuned * np.float64(np.float32(0.01)) / np.float32(0.05)))]
    for clock, got in enumerate(out["seen"]):
        if clock == set_slow_at:
            step_rates[1] = 0.03
        for k, w in enumerate(weights):
            np.testing.assert_allclose(got[k], w, rtol=1e-5, atol=1e-5, err_msg=f"clock {clock}, table {k}")
            gradient = _gradient(got[k], clock).astype(np.float64)
            history[k] = gradient if clock == 0 else momentum * history[k] + gradient
            w -= np.float32(step_rates[k]) * history[k]
