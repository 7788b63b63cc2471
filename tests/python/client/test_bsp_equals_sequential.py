"""BSP data-parallel training on the parameter server equals sequential SGD.

N workers train a linear-regression model (weight (20, 7) and bias (7,) packed
by a TensorLayout into rows of 16 floats, so both tensors end on a partial
row). Each clock every worker reads the parameters with slack 0, computes the
gradient of the mean loss over its own batch in float64, writes it (as
float32) into its update buffer, updates and clocks. The server averages the
workers' gradients (sgd, momentum, adam) or sums their deltas (add, the
workers sending -lr * grad / N) and applies one step per clock.

Reference: sequential float64 training on the concatenation of all workers'
batches of the same clock. With equal batch sizes the mean gradient over the
concatenation is the mean over workers of the per-worker means, so after c
clocks the server must hold exactly the reference parameters after c steps,
and under BSP the read at clock c must show exactly those parameters too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from mltuner import Config, LocalCluster, TensorLayout, UpdateRule, Worker

IN, OUT, BATCH, CLOCKS, ROW_WIDTH = 20, 7, 8, 30, 16
LR = {"sgd": 0.05, "momentum": 0.05, "add": 0.05, "adam": 0.01}
MOMENTUM = 0.9

# Tolerance: the engine keeps parameters and optimizer state in float32 and
# the workers send float32 gradients computed from float32 parameters, while
# the reference runs in float64. Each of the 30 steps adds a few float32
# roundings (relative 6e-8 each) which the contractive SGD map does not
# amplify, so the accumulated relative error stays well below 1e-5, while any
# real mistake (a lost, doubled, stale or mis-averaged update, a wrong rule)
# shows up at 1e-3 or more.
REL_TOL = 1e-5


def make_layout() -> TensorLayout:
    return TensorLayout(row_width=ROW_WIDTH).add("weight", (IN, OUT)).add("bias", (OUT,))


def make_data(num_workers: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    true_w = rng.normal(size=(IN, OUT))
    true_b = rng.normal(size=OUT)
    x = rng.normal(size=(CLOCKS, num_workers, BATCH, IN))
    y = x @ true_w + true_b + 0.1 * rng.normal(size=(CLOCKS, num_workers, BATCH, OUT))
    # Initial weights: random, non-zero, exactly representable in float32.
    w0 = (rng.uniform(0.1, 1.0, size=(IN, OUT)) * rng.choice([-1, 1], size=(IN, OUT))).astype(np.float32)
    b0 = (rng.uniform(0.1, 1.0, size=OUT) * rng.choice([-1, 1], size=OUT)).astype(np.float32)
    return {"x": x, "y": y, "w0": w0, "b0": b0}


def gradients(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gradient of mean_i 0.5 * ||x_i w + b - y_i||^2, in float64."""
    w = w.astype(np.float64)
    b = b.astype(np.float64)
    residual = x @ w + b - y
    return x.T @ residual / len(x), residual.mean(axis=0)


def reference(rule: str, data: dict[str, Any]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Parameters after 0..CLOCKS steps of sequential float64 training on the
    concatenated batches."""
    lr = LR[rule]
    w = data["w0"].astype(np.float64)
    b = data["b0"].astype(np.float64)
    history = [(w.copy(), b.copy())]
    state = [np.zeros_like(w), np.zeros_like(b)]
    second = [np.zeros_like(w), np.zeros_like(b)]
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    for c in range(CLOCKS):
        n = data["x"].shape[1]
        x = data["x"][c].reshape(n * BATCH, IN)
        y = data["y"][c].reshape(n * BATCH, OUT)
        grads = gradients(w, b, x, y)
        params = [w, b]
        for i, g in enumerate(grads):
            if rule in ("sgd", "add"):
                params[i] = params[i] - lr * g
            elif rule == "momentum":
                state[i] = (1 - MOMENTUM) * g + MOMENTUM * state[i]
                params[i] = params[i] - lr * state[i]
            elif rule == "adam":
                state[i] = beta1 * state[i] + (1 - beta1) * g
                second[i] = beta2 * second[i] + (1 - beta2) * g * g
                m_hat = state[i] / (1 - beta1 ** (c + 1))
                v_hat = second[i] / (1 - beta2 ** (c + 1))
                params[i] = params[i] - lr * m_hat / (np.sqrt(v_hat) + eps)
        w, b = params
        history.append((w.copy(), b.copy()))
    return history


def train(
    rule: str, num_workers: int, data: dict[str, Any], run_workers: Callable[..., list[Any]],
    clock_part_bytes: int | None = None, stats: dict[str, Any] | None = None,
) -> tuple[np.ndarray, list[list[tuple[np.ndarray, np.ndarray]]]]:
    """Trains on the engine; returns the servers' final rows and, per worker,
    the parameters each clock's read showed; `stats` gets worker 0's, and its plan."""
    layout = make_layout()
    config = Config(
        wait_timeout_s=20,
        clock_part_bytes=clock_part_bytes,
        update_rule=UpdateRule(kind=rule,  # type: ignore[arg-type]
                               **({} if rule == "add" else {"learning_rate": LR[rule]}),  # add has no rate
                               momentum=MOMENTUM if rule == "momentum" else None),
    )
    with LocalCluster(num_workers, config) as cluster:
        setup = []
        for worker in cluster.workers:
            table = worker.create_tensor_table("linear", layout)
            read = worker.virtual_read(table, slack=0)
            worker.virtual_post_read(read)
            update = worker.virtual_pre_update(table)
            worker.virtual_update(update)
            worker.virtual_clock()
            setup.append((table, read, update))
        table0 = setup[0][0]

        def body(worker: Worker) -> list[tuple[np.ndarray, np.ndarray]]:
            table, read, update = setup[worker.rank]
            x_all, y_all = data["x"][:, worker.rank], data["y"][:, worker.rank]
            worker.finish_virtual_iteration()  # a barrier over all workers
            if worker.rank == 0:  # initialisation: worker 0 alone writes the initial weights
                buffer = worker.pre_update(update)
                buffer[...] = layout.pack({"weight": data["w0"], "bias": data["b0"]})
                worker.update(update)
            worker.start_iterations()
            seen = []
            for c in range(CLOCKS):
                params = worker.read(read)
                w = layout.view(params, "weight").copy()
                b = layout.view(params, "bias").copy()
                worker.post_read(read)
                seen.append((w, b))
                grad_w, grad_b = gradients(w, b, x_all[c], y_all[c])
                if rule == "add":  # add sums the workers' deltas
                    grad_w = -LR[rule] * grad_w / num_workers
                    grad_b = -LR[rule] * grad_b / num_workers
                out = worker.pre_update(update)
                layout.view(out, "weight")[...] = grad_w.astype(np.float32)
                layout.view(out, "bias")[...] = grad_b.astype(np.float32)
                worker.update(update)
                worker.clock()
            worker.sync()
            return seen

        seen = run_workers(body, cluster.workers, on_error=cluster.shutdown)
        final = cluster.workers[0].fetch(table0)
        # Every worker sees the same server values.
        for worker in cluster.workers[1:]:
            np.testing.assert_array_equal(worker.fetch(setup[worker.rank][0]), final)
        if stats is not None:
            stats.update(cluster.workers[0].stats, plan=cluster.workers[0].plan)
    return final, seen


# A row is 64 bytes: a part of one or two rows splits each shard's 10 / N
# rows into several parts (Config.clock_part_bytes).
IN_PARTS = 100
CASES = ([(rule, n, 0) for rule in ("sgd", "momentum", "add") for n in (1, 2, 4)] + [("adam", 2, 0)]
         + [("momentum", 2, IN_PARTS), ("adam", 2, IN_PARTS), ("add", 4, IN_PARTS), ("sgd", 1, IN_PARTS)])


@pytest.mark.parametrize(("rule", "num_workers", "part_bytes"), CASES,
                         ids=[f"{r}-N{n}" + ("-parts" if p else "") for r, n, p in CASES])
def test_bsp_training_equals_sequential_sgd(
    rule: str, num_workers: int, part_bytes: int, run_workers: Callable[..., list[Any]],
    rel_error: Callable[..., float]
) -> None:
    data = make_data(num_workers, seed=1000 + 17 * num_workers + len(rule))
    want = reference(rule, data)
    final, seen = train(rule, num_workers, data, run_workers, clock_part_bytes=part_bytes)
    layout = make_layout()

    w_end, b_end = want[CLOCKS]
    # The model must actually have moved, or the comparison proves little.
    assert rel_error(data["w0"], w_end) > 1e-2
    assert rel_error(layout.view(final, "weight"), w_end) <= REL_TOL
    assert rel_error(layout.view(final, "bias"), b_end) <= REL_TOL
    # Padding of the partial last rows never receives anything.
    flat_w = final[: layout.slot("weight").num_rows].reshape(-1)
    assert np.all(flat_w[IN * OUT :] == 0)
    assert np.all(final[layout.slot("bias").first_row, OUT:] == 0)

    # BSP: the read at clock c shows exactly the parameters after c steps.
    for rank, per_clock in enumerate(seen):
        assert len(per_clock) == CLOCKS
        for c, (w, b) in enumerate(per_clock):
            w_ref, b_ref = want[c]
            assert rel_error(w, w_ref) <= REL_TOL, f"worker {rank} read stale/wrong weights at clock {c}"
            assert rel_error(b, b_ref) <= REL_TOL, f"worker {rank} read stale/wrong bias at clock {c}"
        # Clock 0 shows the initial weights bit for bit.
        np.testing.assert_array_equal(per_clock[0][0], data["w0"])
        np.testing.assert_array_equal(per_clock[0][1], data["b0"])


@pytest.mark.parametrize("rule", ["momentum", "adam"])
def test_a_clock_in_parts_is_bit_identical_to_a_whole_one(rule: str, run_workers: Callable[..., list[Any]]) -> None:
    """Each shard's rows moved in parts of one or two rows (each part applied
    and pushed on its own, Adam's step count moving once a clock) give the
    servers' values and every read bit for bit as whole ones do."""
    data = make_data(2, seed=77)
    stats_whole: dict[str, Any] = {}
    stats_parts: dict[str, Any] = {}
    whole, seen_whole = train(rule, 2, data, run_workers, clock_part_bytes=0, stats=stats_whole)
    parts, seen_parts = train(rule, 2, data, run_workers, clock_part_bytes=IN_PARTS, stats=stats_parts)
    # 5 rows a shard, a part a row: 5 updates and 5 pushes where 1 went.
    assert stats_parts["messages_received"] >= 4 * stats_whole["messages_received"]
    assert "clock in parts: 'linear' in up to 5 parts a shard of about 100 B" in stats_parts["plan"]
    assert "clock in parts: none" in stats_whole["plan"]
    np.testing.assert_array_equal(parts, whole)
    for reads_whole, reads_parts in zip(seen_whole, seen_parts):
        for (w0, b0), (w1, b1) in zip(reads_whole, reads_parts):
            np.testing.assert_array_equal(w1, w0)
            np.testing.assert_array_equal(b1, b0)


def test_reads_of_a_stale_clock_would_be_detected(rel_error: Callable[..., float]) -> None:
    """The tolerance separates consecutive clocks: reading clock c-1's values at
    clock c (an off-by-one in BSP) would fail the check above."""
    data = make_data(2, seed=5)
    for rule in ("sgd", "momentum", "adam"):
        want = reference(rule, data)
        for c in range(1, CLOCKS + 1):
            assert rel_error(want[c - 1][0], want[c][0]) > 10 * REL_TOL


@pytest.mark.parametrize("part_bytes", [0, 16 * 4], ids=["whole", "in parts"])
def test_a_read_recorded_after_its_tables_update_sees_that_clock(part_bytes: int,
                                                                 run_workers: Callable[..., list[Any]]) -> None:
    """An update, then a read of the same table in one clock: under BSP the
    read sees that clock's summed update too, every time (it saw clock c - 1
    or c by the race between the gather and the install: 15 of 200 reads
    in a fuzzer's run, and with the rows in parts one read mixed both)."""
    workers, clocks = 2, 60
    config = Config(update_rule=UpdateRule("add"), wait_timeout_s=20, clock_part_bytes=part_bytes)

    def body(worker: Worker) -> list[float]:
        table = worker.create_table("t", 8, 16)
        grad = worker.virtual_pre_update(table)
        worker.virtual_update(grad)
        read = worker.virtual_read(table, slack=0)
        worker.virtual_post_read(read)
        worker.virtual_clock()
        worker.finish_virtual_iteration()
        worker.start_iterations()
        seen = []
        for _ in range(clocks):
            worker.pre_update(grad)[...] = 1.0
            worker.update(grad)
            values = worker.read(read)
            seen.append(np.unique(values).tolist())
            worker.post_read(read)
            worker.clock()
        worker.sync()
        return seen

    with LocalCluster(workers, config) as cluster:
        seen = run_workers(body, cluster.workers, on_error=cluster.shutdown)
    want = [[float(workers * (clock + 1))] for clock in range(clocks)]
    for rank in range(workers):
        assert seen[rank] == want
