"""Config(check_finite=True): the servers refuse a NaN or infinite update and
fail the clock on every worker with a NonFiniteError naming the table, branch,
clock and the worker that sent it; off (the default), the update is applied as
before. Both workers of a LocalCluster pass their updates to the shards as
device buffers (the device path of the check); tests/python/distributed covers
host payloads between processes."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

import mltuner

ROWS, WIDTH, CLOCKS, BAD_CLOCK, BAD_WORKER = 8, 4, 5, 2, 1
Recorder = Callable[[mltuner.Worker, mltuner.Table], tuple[int, int]]


def _train(worker: mltuner.Worker, bad_value: float, record: Recorder) -> np.ndarray:
    """SGD on a constant gradient; BAD_WORKER puts `bad_value` into one value
    of its gradient at BAD_CLOCK. `record`: the record_read_update fixture."""
    table = worker.create_table("weights", ROWS, WIDTH)
    read, update = record(worker, table)
    for clock in range(CLOCKS):
        worker.read(read)
        worker.post_read(read)
        gradient = worker.pre_update(update)
        gradient[...] = 0.5
        if worker.rank == BAD_WORKER and clock == BAD_CLOCK:
            gradient[3, 1] = bad_value  # row 3 belongs to shard 0, the other worker's
        worker.update(update)
        worker.clock()
    worker.sync()
    return worker.fetch(table)


def _config(check_finite: bool) -> mltuner.Config:
    return mltuner.Config(update_rule=mltuner.UpdateRule("sgd", learning_rate=0.1), wait_timeout_s=20,
                          check_finite=check_finite)


@pytest.mark.parametrize("bad_value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_a_non_finite_gradient_fails_every_worker_naming_table_and_worker(bad_value: float,
                                                                          record_read_update: Recorder) -> None:
    with mltuner.LocalCluster(num_workers=2, config=_config(True)) as cluster:
        errors: dict[int, BaseException] = {}

        def body(worker: mltuner.Worker) -> None:
            try:
                _train(worker, bad_value, record_read_update)
            except mltuner.MltunerError as error:
                errors[worker.rank] = error

        cluster.run(body, timeout_s=30)
    assert sorted(errors) == [0, 1]
    for error in errors.values():
        assert isinstance(error, mltuner.NonFiniteError), repr(error)
        assert isinstance(error, FloatingPointError)
        text = str(error)
        assert f"refused a message from worker {BAD_WORKER}" in text, text
        assert "table 'weights' (id 0) on branch 0" in text, text
        assert f"clock {BAD_CLOCK}: worker {BAD_WORKER}'s update holds 1 of" in text, text


def test_without_the_check_the_non_finite_update_is_applied(record_read_update: Recorder) -> None:
    with mltuner.LocalCluster(num_workers=2, config=_config(False)) as cluster:
        finals = cluster.run(lambda worker: _train(worker, math.nan, record_read_update), timeout_s=30)
    for final in finals:
        assert np.isnan(final[3, 1])
        assert np.isfinite(np.delete(final.ravel(), 3 * WIDTH + 1)).all()


def test_finite_training_is_unchanged_by_the_check(record_read_update: Recorder) -> None:
    runs = []
    for check in (False, True):
        with mltuner.LocalCluster(num_workers=2, config=_config(check)) as cluster:
            runs.append(cluster.run(lambda worker: _train(worker, 0.5, record_read_update), timeout_s=30))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_allclose(runs[0][0], -0.1 * 0.5 * CLOCKS, rtol=1e-6)


def test_check_finite_is_a_boolean_setting() -> None:
    assert mltuner.Config().check_finite is False
    assert mltuner.Config(check_finite=True).to_core().check_finite is True
    with pytest.raises(mltuner.InvalidArgumentError, match="Config.check_finite must be True or False"):
        mltuner.Config(check_finite=1)  # type: ignore[arg-type]
