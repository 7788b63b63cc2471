"""Checkpoint housekeeping: a fetch right after restore_checkpoint sees the
restored rows of every shard (restore ends with a barrier), what an
interrupted save left behind is removed at the next save and at a restore,
``keep`` is exact, and names continue the clock across a restore."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

import mltuner
from mltuner.launch import ProcessEnv

from test_wire_security import close, start_pair  # type: ignore[import-not-found]


def single_job() -> mltuner.Job:
    env = ProcessEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=0,
                     bind_host="127.0.0.1", secret=None, source="single")
    return mltuner.Job(mltuner.Config(update_rule=mltuner.UpdateRule("add")), env=env)


def prepare(worker: mltuner.Worker, rows: int = 10) -> tuple[mltuner.Table, int]:
    table = worker.create_table("t", rows, 3)
    update = worker.virtual_pre_update(table)
    worker.virtual_update(update)
    worker.virtual_clock()
    worker.finish_virtual_iteration()
    return table, update


def add_clocks(worker: mltuner.Worker, update: int, clocks: int, value: float) -> None:
    for _ in range(clocks):
        worker.pre_update(update)[:] = value
        worker.update(update)
        worker.clock()


def on_both(jobs: list[mltuner.Job], body) -> list[object]:  # type: ignore[no-untyped-def]
    results: list[object] = [None, None]
    errors: list[BaseException] = []

    def run(job: mltuner.Job) -> None:
        try:
            results[job.rank] = body(job)
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    if errors:
        raise errors[0]
    return results


def test_a_fetch_right_after_restore_sees_every_shards_rows(tmp_path: Path) -> None:
    jobs = start_pair()
    try:
        def train_and_save(job: mltuner.Job) -> np.ndarray:
            table, update = prepare(job.worker)
            job.worker.start_iterations()
            add_clocks(job.worker, update, 3, job.rank + 1.0)
            job.save_checkpoint(tmp_path)
            return job.worker.fetch(table)

        saved = on_both(jobs, train_and_save)
    finally:
        close(jobs)
    np.testing.assert_array_equal(saved[0], np.full((10, 3), 9.0, dtype=np.float32))
    jobs = start_pair()
    try:
        def restore_and_fetch(job: mltuner.Job) -> tuple[int, np.ndarray]:
            table, _ = prepare(job.worker)
            if job.rank == 1:
                time.sleep(1.0)  # rank 0 must not read shard 1 before it has loaded its rows
            clock = job.restore_checkpoint(tmp_path)
            return clock, job.worker.fetch(table)  # rows of both shards, at once

        for clock, fetched in on_both(jobs, restore_and_fetch):  # type: ignore[misc]
            assert clock == 3
            np.testing.assert_array_equal(fetched, saved[0])
    finally:
        close(jobs)


def test_keep_is_exact_and_leftovers_are_removed_at_the_next_save(tmp_path: Path) -> None:
    leftovers = [tmp_path / ".clock-00000099.tmp" / "shard-0", tmp_path / ".clock-00000001.tmp"]
    for directory in leftovers:
        directory.mkdir(parents=True)
    (tmp_path / "latest.tmp").write_text("half")
    with single_job() as job:
        _, update = prepare(job.worker)
        job.worker.start_iterations()
        for _ in range(5):
            add_clocks(job.worker, update, 1, 1.0)
            job.save_checkpoint(tmp_path, keep=3)
    names = sorted(entry.name for entry in tmp_path.iterdir())
    assert names == ["clock-00000003", "clock-00000004", "clock-00000005", "latest"]
    assert (tmp_path / "latest").read_text().strip() == "clock-00000005"


def test_leftovers_are_removed_at_restore_and_names_continue_the_clock(tmp_path: Path) -> None:
    with single_job() as job:
        _, update = prepare(job.worker)
        job.worker.start_iterations()
        add_clocks(job.worker, update, 4, 1.0)
        job.save_checkpoint(tmp_path)
    (tmp_path / ".clock-00000007.tmp" / "shard-0").mkdir(parents=True)
    (tmp_path / "latest.tmp").write_text("half")
    with single_job() as job:
        table, update = prepare(job.worker)
        assert job.restore_checkpoint(tmp_path) == 4
        assert sorted(entry.name for entry in tmp_path.iterdir()) == ["clock-00000004", "latest"]
        job.worker.start_iterations()
        add_clocks(job.worker, update, 2, 1.0)
        saved = job.save_checkpoint(tmp_path)
        assert saved.name == "clock-00000006"
        np.testing.assert_array_equal(job.worker.fetch(table), np.full((10, 3), 6.0, dtype=np.float32))


def test_attachments_travel_with_the_checkpoint_and_a_branch_is_refused(tmp_path: Path) -> None:
    env = ProcessEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=0,
                     bind_host="127.0.0.1", secret=None, source="single")
    config = mltuner.Config(update_rule=mltuner.UpdateRule("add"), branches=True)
    with mltuner.Job(config, env=env) as job:
        _, update = prepare(job.worker)
        job.worker.start_iterations()
        job.worker.schedule_branch(0, 1)
        add_clocks(job.worker, update, 1, 1.0)
        for bad in ({"../x": b""}, {".hidden": b""}, {"a/b": b""}):
            with pytest.raises(mltuner.InvalidArgumentError, match="attachment name"):
                job.save_checkpoint(tmp_path, attachments=bad)
        with pytest.raises(mltuner.ArgumentTypeError, match="expected bytes"):
            job.save_checkpoint(tmp_path, attachments={"epoch": 3})  # type: ignore[dict-item]
        saved = job.save_checkpoint(tmp_path, attachments={"epoch.json": b'{"epoch": 3}'})
        assert mltuner.read_attachment(tmp_path, "epoch.json") == b'{"epoch": 3}'
        assert mltuner.read_attachment(saved, "other") is None
        job.worker.fork_branch(1, 0)
        job.worker.schedule_branch(1, 1)
        add_clocks(job.worker, update, 1, 1.0)
        with pytest.raises(mltuner.OutOfOrderError, match="branch 1"):
            job.save_checkpoint(tmp_path)
    with pytest.raises(mltuner.NotFoundError):
        mltuner.read_attachment(tmp_path / "nowhere", "epoch.json")


def test_after_a_tuning_session_its_final_branch_is_saved_and_restores_as_branch_0(tmp_path: Path) -> None:
    # A session ends on a branch of its own (Worker.trained_branch): the
    # tuned model could be kept only as values, without the servers' state.
    env = ProcessEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=0,
                     bind_host="127.0.0.1", secret=None, source="single")
    rule = mltuner.UpdateRule("sgd", learning_rate=0.5, momentum=0.9)
    with mltuner.Job(mltuner.Config(update_rule=rule, branches=True), env=env) as job:
        table, update = prepare(job.worker)
        job.worker.start_iterations()
        job.worker.schedule_branch(0, 2)
        add_clocks(job.worker, update, 2, 1.0)
        job.worker.fork_branch(1, 0, learning_rate=0.1)  # "the winner": another rate, momentum carried
        job.worker.schedule_branch(1, 3)
        add_clocks(job.worker, update, 3, 1.0)
        job.worker.fork_branch(2, 1, training=False)  # the session's last validation, on a branch of its own
        job.worker.schedule_branch(2, 1)
        add_clocks(job.worker, update, 1, 0.0)
        with pytest.raises(mltuner.OutOfOrderError, match="ran on branch 2"):
            job.save_checkpoint(tmp_path)  # during the session
        job.worker.trained_branch = 1  # what a session sets at its end
        saved = job.save_checkpoint(tmp_path)
        assert saved.name == "clock-00000006"
        tuned = job.worker.fetch(table, branch=1)
        assert not np.array_equal(tuned, job.worker.fetch(table, branch=0))
    with mltuner.Job(mltuner.Config(update_rule=rule, branches=True), env=env) as job:
        table, update = prepare(job.worker)
        assert job.restore_checkpoint(tmp_path) == 6
        job.worker.start_iterations()
        np.testing.assert_array_equal(job.worker.fetch(table), tuned)
