"""Distributed training over real processes and sockets on 127.0.0.1.

BSP on N processes must give the parameters of sequential float64 SGD over
the concatenated batches (the reference of the in-process BSP test), and be
bit for bit those of the same training on an in-process LocalCluster of N
workers (whatever path the bytes took: received frames used in place, one
pushed frame shared by the workers of other processes); SSP must keep every
read within its staleness bound while a slowed worker lets the others run
ahead by at most the slack.
"""

from __future__ import annotations

import argparse
import types

import numpy as np
import pytest

import mltuner
from train_worker import BATCH, IN, OUT, linear, make_data, make_layout  # type: ignore[import-not-found]

CLOCKS = 30
LR = 0.05
# The relative error of float32 parameters after 30 steps is about 1e-7; a lost,
# doubled or stale update shows up at 1e-3 or more.
REL_TOL = 1e-6


def sequential(rule: str, num_workers: int, clocks: int = CLOCKS) -> np.ndarray:
    data = make_data(num_workers, clocks, seed=0)
    w, b = data["w0"].astype(np.float64), data["b0"].astype(np.float64)
    h_w, h_b = np.zeros_like(w), np.zeros_like(b)
    for c in range(clocks):
        x = data["x"][c].reshape(num_workers * BATCH, IN)
        y = data["y"][c].reshape(num_workers * BATCH, OUT)
        residual = x @ w + b - y
        g_w, g_b = x.T @ residual / len(x), residual.mean(axis=0)
        if rule == "momentum":
            h_w, h_b = 0.1 * g_w + 0.9 * h_w, 0.1 * g_b + 0.9 * h_b
            g_w, g_b = h_w, h_b
        w, b = w - LR * g_w, b - LR * g_b
    return np.concatenate([w.reshape(-1), b])


def unpack(params: np.ndarray) -> np.ndarray:
    layout = make_layout()
    return np.concatenate([layout.view(params, "weight").reshape(-1), layout.view(params, "bias")]).astype(np.float64)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("n,rule", [(1, "sgd"), (2, "sgd"), (4, "sgd"), (2, "momentum")])
def test_bsp_equals_sequential_sgd(start_workers, n: int, rule: str) -> None:  # type: ignore[no-untyped-def]
    workers = start_workers(n, "--rule", rule, "--clocks", str(CLOCKS))
    for rank, (code, output) in enumerate(workers.wait()):
        assert code == 0, f"rank {rank} failed:\n{output}"
    want = sequential(rule, n)
    finals = [workers.result(rank)["final"] for rank in range(n)]
    for rank, final in enumerate(finals):
        assert relative_error(unpack(final), want) <= REL_TOL, f"rank {rank}"
        np.testing.assert_array_equal(final, finals[0])  # every rank fetched the same servers
        assert int(workers.result(rank)["rejected"]) == 0


# Rows of 64 bytes: a shard's slice of 20480 rows among 4 is 320 KiB, above
# ProcessNode::kBatchBelowBytes (256 KiB; smaller payloads are joined into
# batches, copied at both ends), so this table's payloads go alone and are
# used in place on the CPU backend.
EXTRA_ROWS = 20480


def in_process(rule: str, num_workers: int) -> list[dict[str, np.ndarray]]:
    """The final tables of train_worker's linear scenario with its extra
    table, run by the workers of one LocalCluster (no sockets, no frames)."""
    rate = {} if rule == "add" else {"learning_rate": LR}  # the add rule has none
    config = mltuner.Config(update_rule=mltuner.UpdateRule(rule, **rate), wait_timeout_s=30)  # type: ignore[arg-type]
    args = argparse.Namespace(slack=0, data_workers=0, total_clocks=0, clocks=CLOCKS, seed=0, restore="",
                              die_at=-1, die_rank=-1, slow_rank=-1, slow_s=0.0, nan_rank=-1, nan_at=-1, save_at=-1,
                              checkpoint="", out="", extra_rows=EXTRA_ROWS)
    with mltuner.LocalCluster(num_workers, config) as cluster:
        return cluster.run(lambda worker: linear(types.SimpleNamespace(worker=worker, rank=worker.rank,
                                                                       world_size=num_workers), args))


@pytest.mark.parametrize("path", ["shared-memory", "host-frames"])
@pytest.mark.parametrize("n,rule", [(2, "adam"), (4, "momentum")])
def test_bsp_processes_equal_the_in_process_cluster_bit_for_bit(start_workers, n: int,  # type: ignore[no-untyped-def]
                                                                rule: str, path: str) -> None:
    env = {"MLTUNER_CUDA_IPC": "1" if path == "shared-memory" else "0"}
    workers = start_workers(n, "--rule", rule, "--clocks", str(CLOCKS), "--extra-rows", str(EXTRA_ROWS), env=env)
    for rank, (code, output) in enumerate(workers.wait()):
        assert code == 0, f"rank {rank} failed:\n{output}"
    want = in_process(rule, n)
    assert np.any(want[0]["extra"] != 0)
    for rank in range(n):
        result = workers.result(rank)
        for name in ("final", "extra"):
            np.testing.assert_array_equal(want[rank][name], want[0][name])
            np.testing.assert_array_equal(result[name], want[0][name], err_msg=f"rank {rank}: {name}")
        # The extra table's payloads (its updates and rows from every other
        # process, every clock) came in place: mapped from the sender's copy
        # into this process's shared memory, or the received frames.
        if path == "shared-memory":
            assert list(result["data_paths"]) == ["shared-memory"]
            assert int(result["ipc_received_bytes"]) >= 2 * (n - 1) * CLOCKS * EXTRA_ROWS * 64 // n
        else:
            assert list(result["data_paths"]) == ["host-frames (turned off (Job(cuda_ipc=False) or MLTUNER_CUDA_IPC=0))"]
            assert int(result["ipc_received_bytes"]) == 0
            assert int(result["in_place"]) >= 2 * (n - 1) * CLOCKS


def test_bsp_processes_in_parts_equal_the_in_process_cluster_whole(start_workers) -> None:  # type: ignore[no-untyped-def]
    """The extra table's 640 KiB a shard moved in parts of 64 KiB between two
    processes (ten updates and ten pushes a clock each way, each part
    applied on its own): the same bits as whole payloads in one process."""
    workers = start_workers(2, "--rule", "adam", "--clocks", str(CLOCKS), "--extra-rows", str(EXTRA_ROWS),
                            "--part-bytes", str(64 << 10))
    for rank, (code, output) in enumerate(workers.wait()):
        assert code == 0, f"rank {rank} failed:\n{output}"
    want = in_process("adam", 2)
    for rank in range(2):
        for name in ("final", "extra"):
            np.testing.assert_array_equal(workers.result(rank)[name], want[0][name], err_msg=f"rank {rank}: {name}")
        # Ten parts from each of the two shards, every clock.
        assert int(workers.result(rank)["messages_received"]) >= 2 * 10 * CLOCKS


@pytest.mark.parametrize("slack", [0, 1, 3])
def test_ssp_bound_with_a_slow_worker(start_workers, slack: int) -> None:  # type: ignore[no-untyped-def]
    n, clocks = 3, 25
    workers = start_workers(n, "--scenario", "counters", "--rule", "add", "--clocks", str(clocks), "--slack", str(slack),
                            "--slow-rank", "1", "--slow-s", "0.03")
    for rank, (code, output) in enumerate(workers.wait()):
        assert code == 0, f"rank {rank} failed:\n{output}"
    ran_ahead = 0
    for rank in range(n):
        seen = workers.result(rank)["seen"]  # seen[c, j]: clocks of worker j applied in the read at clock c
        for clock in range(clocks):
            row = seen[clock]
            # A read at clock c with slack s holds every update through clock c-s-1 (so no worker is
            # more than s clocks behind the reader) and nothing of clocks the reader has not finished.
            assert np.all(row >= clock - slack), (rank, clock, row)
            assert np.all(row <= clock), (rank, clock, row)
            ran_ahead += int(np.any(row < clock))
    if slack == 0:
        assert ran_ahead == 0
    else:
        assert ran_ahead > 0, "with a slow worker and slack > 0 the others should read stale rows"
