"""MLTUNER_DEBUG_BUFFERS=1 / Config(debug_buffers=True): a buffer handed back
to the engine is filled with NaN once the engine is done with it, so code that
keeps using it after its post reads NaN instead of another clock's values,
and training is otherwise unchanged."""

from __future__ import annotations

import numpy as np
import pytest

import mltuner

ROWS, WIDTH = 6, 4


def _setup(worker: mltuner.Worker) -> tuple[int, int, int, int]:
    table = worker.create_table("t", ROWS, WIDTH)
    local = worker.create_table("l", 3, WIDTH, local=True)
    read = worker.virtual_read(table)
    worker.virtual_post_read(read)
    update = worker.virtual_pre_update(table)
    worker.virtual_update(update)
    keep = worker.virtual_local_access(local, fetch=True)
    worker.virtual_post_local_access(keep, keep=True)
    worker.virtual_clock()
    worker.finish_virtual_iteration()
    return read, update, keep, table.id


def _config(debug: bool) -> mltuner.Config:
    return mltuner.Config(update_rule=mltuner.UpdateRule("sgd", learning_rate=0.5), wait_timeout_s=20,
                          debug_buffers=debug)


def test_buffers_read_as_nan_after_their_post() -> None:
    with mltuner.LocalCluster(1, _config(True)) as cluster:
        worker = cluster.workers[0]
        read, update, keep, _ = _setup(worker)
        # Initialisation phase: a read, posted, is poisoned at once.
        init_read = worker.read(read)
        assert np.isfinite(init_read).all()
        worker.post_read(read)
        assert np.isnan(init_read).all()
        worker.start_iterations()
        for clock in range(3):
            params = worker.read(read)
            assert np.isfinite(params).all()
            worker.post_read(read)
            assert np.isnan(params).all()  # poisoned by the post itself
            gradient = worker.pre_update(update)
            assert (gradient == 0).all()   # a fresh update buffer is zeroed, never NaN
            gradient[...] = 1.0
            worker.update(update)
            data = worker.local_access(keep)
            np.testing.assert_array_equal(data, clock)  # what was kept last clock, not NaN
            data[...] = clock + 1
            worker.post_local_access(keep)
            worker.clock()
            worker.flush()  # the reclaimer shipped the update and wrote the local data back
            assert np.isnan(gradient).all()
            assert np.isnan(data).all()
        worker.sync()
        np.testing.assert_allclose(worker.fetch(cluster.workers[0].tables[0]), -0.5 * 3)


def _train(worker: mltuner.Worker) -> np.ndarray:
    read, update, keep, table_id = _setup(worker)
    worker.start_iterations()
    rng = np.random.default_rng(worker.rank)
    for _ in range(6):
        params = np.array(worker.read(read))
        worker.post_read(read)
        worker.pre_update(update)[...] = params * 0.1 + rng.normal(size=params.shape)
        worker.update(update)
        data = worker.local_access(keep)
        data += 1
        worker.post_local_access(keep)
        worker.clock()
    worker.sync()
    return worker.fetch(worker.tables[table_id])


def test_training_is_unchanged_by_the_poison() -> None:
    results = []
    for debug in (False, True):
        with mltuner.LocalCluster(2, _config(debug)) as cluster:
            results.append(cluster.run(_train, timeout_s=60))
    for plain, poisoned in zip(results[0], results[1]):
        np.testing.assert_array_equal(plain, poisoned)
        assert np.isfinite(poisoned).all()


def test_the_environment_variable_sets_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLTUNER_DEBUG_BUFFERS", raising=False)
    assert mltuner.Config().debug_buffers is False
    monkeypatch.setenv("MLTUNER_DEBUG_BUFFERS", "1")
    assert mltuner.Config().debug_buffers is True
    assert mltuner.Config().to_core().debug_buffers is True
    assert mltuner.Config(debug_buffers=False).debug_buffers is False  # an explicit setting wins
    monkeypatch.setenv("MLTUNER_DEBUG_BUFFERS", "0")
    assert mltuner.Config().debug_buffers is False
    monkeypatch.setenv("MLTUNER_DEBUG_BUFFERS", "yes")
    with pytest.raises(mltuner.InvalidArgumentError, match="MLTUNER_DEBUG_BUFFERS must be 0 or 1, got 'yes'"):
        mltuner.Config()
    with pytest.raises(mltuner.InvalidArgumentError, match="Config.debug_buffers must be True or False"):
        mltuner.Config(debug_buffers="1")  # type: ignore[arg-type]
