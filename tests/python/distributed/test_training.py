"""Distributed training over real processes and sockets on 127.0.0.1.

BSP on N processes must give the parameters of sequential float64 SGD over
the concatenated batches (the reference of the in-process BSP test); SSP must
keep every read within its staleness bound while a slowed worker lets the
others run ahead by at most the slack.
"""

from __future__ import annotations

import numpy as np
import pytest

from train_worker import BATCH, IN, OUT, make_data, make_layout  # type: ignore[import-not-found]

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
