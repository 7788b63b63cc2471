"""Checkpoint housekeeping: a fetch right after restore_checkpoint sees the
restored rows of every shard (restore ends with a barrier), what an
interrupted save left behind is removed at the next save and at a restore,
``keep`` is exact, and names continue the clock across a restore."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mltuner
from mltuner.launch import ProcessEnv, _checkpoint

from test_wire_security import close, start_pair  # type: ignore[import-not-found]


def single_job() -> mltuner.Job:
    env = ProcessEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=0,
                     bind_host="127.0.0.1", secret=None, source="single")
    return mltuner.Job(mltuner.Config(update_rule=mltuner.UpdateRule("add")), env=env)


def listing(root: Path) -> list[str]:
    """What a checkpoint root holds, but the lock of the job that writes there."""
    return sorted(entry.name for entry in root.iterdir() if entry.name != ".writer.lock")


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


@contextlib.contextmanager
def trained(clocks: int = 1) -> Iterator[tuple[mltuner.Job, int]]:
    """A one-worker job of table "t" after ``clocks`` clocks adding 1, and its update handle."""
    with single_job() as job:
        _, update = prepare(job.worker)
        job.worker.start_iterations()
        add_clocks(job.worker, update, clocks, 1.0)
        yield job, update


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


def save_clocks_2_and_4(root: Path) -> None:
    """Checkpoints of clocks 2 and 4 of one worker adding 1 a clock."""
    with single_job() as job:
        _, update = prepare(job.worker)
        job.worker.start_iterations()
        for _ in range(2):
            add_clocks(job.worker, update, 2, 1.0)
            job.save_checkpoint(root)


def test_keep_leaves_the_checkpoints_of_a_run_resumed_from_an_older_one_alone(tmp_path: Path) -> None:
    """A run resumed from clock 2 while clock 4 exists saves clock 3 with
    keep=1: clock 4 (the earlier run's) stayed the newest by clock and the
    save just made was removed, latest naming nothing. Now the later one is
    left alone and the new one kept."""
    save_clocks_2_and_4(tmp_path)
    with single_job() as job:
        _, update = prepare(job.worker)
        job.restore_checkpoint(tmp_path / "clock-00000002")
        job.worker.start_iterations()
        add_clocks(job.worker, update, 1, 1.0)
        assert job.save_checkpoint(tmp_path, keep=1).name == "clock-00000003"
    assert listing(tmp_path) == ["clock-00000003", "clock-00000004", "latest"]
    assert (tmp_path / "latest").read_text().strip() == "clock-00000003"


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
    names = listing(tmp_path)
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
        assert listing(tmp_path) == ["clock-00000004", "latest"]
        job.worker.start_iterations()
        add_clocks(job.worker, update, 2, 1.0)
        saved = job.save_checkpoint(tmp_path)
        assert saved.name == "clock-00000006"
        np.testing.assert_array_equal(job.worker.fetch(table), np.full((10, 3), 6.0, dtype=np.float32))


def test_a_clock_saved_again_and_a_latest_naming_nothing_still_resume(tmp_path: Path) -> None:
    """A run resumed from clock 2 that reaches clock 4 again saves it again:
    the old one moves aside before the new one takes its name. A save cut
    off between the two (latest names a directory gone) resumes from the one
    moved aside, which has its name back before the newest is chosen (a
    probe's restore took clock 2 and the run then saved over clock 4); a
    latest edited by hand resumes from the newest complete checkpoint."""
    save_clocks_2_and_4(tmp_path)
    with single_job() as job:
        table, update = prepare(job.worker)
        assert job.restore_checkpoint(tmp_path / "clock-00000002") == 2
        job.worker.start_iterations()
        add_clocks(job.worker, update, 2, 10.0)
        assert job.save_checkpoint(tmp_path).name == "clock-00000004"
        again = job.worker.fetch(table)
    assert listing(tmp_path) == ["clock-00000002", "clock-00000004", "latest"]
    np.testing.assert_array_equal(again, np.full((10, 3), 22.0, dtype=np.float32))
    (tmp_path / "clock-00000004").rename(tmp_path / ".clock-00000004.old.tmp")  # the save cut off there
    # What reads the root without restoring (read_attachment) names the same
    # checkpoint, where it lies (a review: it took clock 2, the restore clock 4).
    assert _checkpoint.resolve(tmp_path) == tmp_path / ".clock-00000004.old.tmp"
    with single_job() as job:
        table, _ = prepare(job.worker)
        assert job.restore_checkpoint(tmp_path) == 4  # the one latest names, its name given back first
        np.testing.assert_array_equal(job.worker.fetch(table), again)
    assert listing(tmp_path) == ["clock-00000002", "clock-00000004", "latest"]
    (tmp_path / "clock-00000004").rename(tmp_path / ".clock-00000004.old.tmp")
    (tmp_path / "latest").write_text("clock-00000002")
    with single_job() as job:  # a latest naming an older one: that one, and the other has its name back
        table, _ = prepare(job.worker)
        assert job.restore_checkpoint(tmp_path) == 2
        np.testing.assert_array_equal(job.worker.fetch(table), np.full((10, 3), 2.0, dtype=np.float32))
    assert listing(tmp_path) == ["clock-00000002", "clock-00000004", "latest"]
    for latest in ("", "../elsewhere"):  # the newest complete one
        (tmp_path / "latest").write_text(latest)
        with single_job() as job:
            table, _ = prepare(job.worker)
            assert job.restore_checkpoint(tmp_path) == 4
            np.testing.assert_array_equal(job.worker.fetch(table), again)
    (tmp_path / "clock-00000004" / "manifest.json").unlink()
    (tmp_path / "clock-00000002" / "manifest.json").unlink()
    with single_job() as job:
        prepare(job.worker)
        with pytest.raises(mltuner.NotFoundError, match="names '../elsewhere', which holds no complete checkpoint"):
            job.restore_checkpoint(tmp_path)


def test_a_second_job_saving_into_a_root_another_job_writes_is_refused(tmp_path: Path) -> None:
    """Two runs pointed at one root would replace each other's checkpoints
    (or, saving at once, mix their files): the second is refused at its
    first save, naming the holder; once the first closes the root is free."""
    with trained() as (first, first_update), trained() as (second, _):
        first.save_checkpoint(tmp_path)
        with pytest.raises(mltuner.InvalidArgumentError, match=r"another job saves checkpoints into .* \(pid \d+ on "):
            second.save_checkpoint(tmp_path)
        add_clocks(first.worker, first_update, 1, 1.0)
        assert first.save_checkpoint(tmp_path).name == "clock-00000002"
        assert second.save_checkpoint(tmp_path / "own").name == "clock-00000001"
    with single_job() as third:
        _, update = prepare(third.worker)
        assert third.restore_checkpoint(tmp_path) == 2
        third.worker.start_iterations()
        add_clocks(third.worker, update, 1, 1.0)
        assert third.save_checkpoint(tmp_path).name == "clock-00000003"
    assert listing(tmp_path) == ["clock-00000002", "clock-00000003", "latest", "own"]


def test_a_restore_leaves_the_half_written_save_of_a_job_writing_there_alone(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import mltuner.torch as mt

    with trained() as (writer, _):
        writer.save_checkpoint(tmp_path)
        in_progress = tmp_path / ".clock-00000002.0123abcd.tmp"  # the writer's next save, half written
        (in_progress / "shard-0").mkdir(parents=True)
        with single_job() as reader:
            prepare(reader.worker)
            reader.restore_checkpoint(tmp_path)
        assert in_progress.is_dir()
        with mltuner.Job() as reader:  # the PyTorch adapter's resume reads the index first
            with pytest.raises(mltuner.NotFoundError, match="holds no PyTorch model state"):
                mt.wrap(torch.nn.Linear(3, 3), reader.worker, example_input=torch.zeros(1, 3), resume_from=tmp_path)
        assert in_progress.is_dir()
    with single_job() as reader:  # the writer closed: now it is a leftover
        prepare(reader.worker)
        reader.restore_checkpoint(tmp_path)
    assert not in_progress.exists()


def test_a_rank_that_fails_its_part_of_a_save_fails_the_save_on_every_rank(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad attachments on rank 0, or a write error on rank 1: every rank
    raises at once, saying which rank and why (no rank waits at a barrier),
    and the job saves on afterwards."""
    disk_full = threading.Event()
    original = Path.mkdir

    def mkdir(path: Path, *args: Any, **kwargs: Any) -> None:
        if disk_full.is_set() and path.name == "shard-1":
            raise OSError(28, "No space left on device")
        original(path, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    jobs = start_pair()
    try:
        def save_badly(job: mltuner.Job) -> list[str]:
            _, update = prepare(job.worker)
            job.worker.start_iterations()
            add_clocks(job.worker, update, 1, 1.0)
            errors = []
            start = time.monotonic()
            with pytest.raises(mltuner.InvalidArgumentError) as bad:
                job.save_checkpoint(tmp_path, attachments={"../x": b""} if job.rank == 0 else None)
            errors.append(str(bad.value))
            if job.rank == 1:
                disk_full.set()
            with pytest.raises(OSError) as full:
                job.save_checkpoint(tmp_path)
            errors.append(str(full.value))
            assert time.monotonic() - start < 5  # no wait for a rank that gave up
            job.barrier("both-failed")
            disk_full.clear()
            add_clocks(job.worker, update, 1, 1.0)
            job.save_checkpoint(tmp_path)
            return errors

        first, second = on_both(jobs, save_badly)
    finally:
        close(jobs)
    assert "attachment name '../x'" in first[0] and "failed on rank 0" in second[0]  # type: ignore[index]
    assert "No space left" in first[1] and "save_checkpoint failed on rank 1" in first[1]  # type: ignore[index]
    assert "No space left" in second[1]  # type: ignore[index]
    assert listing(tmp_path) == ["clock-00000002", "latest"]


def test_a_process_forked_from_the_writer_does_not_keep_its_root(tmp_path: Path) -> None:
    with trained() as (writer, _):
        writer.save_checkpoint(tmp_path)
        reader, child_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # a data loader worker, say, that outlives the job
            os.close(reader)
            time.sleep(3)
            os._exit(0)
        os.close(child_end)
    try:
        with trained() as (next_job, _):
            assert next_job.save_checkpoint(tmp_path).name == "clock-00000001"
    finally:
        os.waitpid(pid, 0)
        os.close(reader)


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


def test_tables_grouped_otherwise_are_assembled_from_pieces_of_the_saved_ones(tmp_path: Path) -> None:
    """restore_checkpoint(sources=): a job of one table restores from a
    2-process job's two tables, each piece from wherever its rows were
    saved; sources that do not fit are refused before anything changes."""
    jobs = start_pair()
    try:
        def train_and_save(job: mltuner.Job) -> dict[str, np.ndarray]:
            a, b = job.worker.create_table("a", 4, 3), job.worker.create_table("b", 3, 3)
            updates = []
            for t in (a, b):
                updates.append(job.worker.virtual_pre_update(t))
                job.worker.virtual_update(updates[-1])
            job.worker.virtual_clock()
            job.worker.finish_virtual_iteration()
            job.worker.start_iterations()
            for update, values in zip(updates, (np.arange(12.0), 100 + np.arange(9.0))):
                job.worker.pre_update(update)[:] = values.reshape(-1, 3) if job.rank == 0 else 0.0
                job.worker.update(update)
            job.worker.clock()
            job.save_checkpoint(tmp_path)
            return {"a": job.worker.fetch(a).reshape(-1), "b": job.worker.fetch(b).reshape(-1)}

        saved = on_both(jobs, train_and_save)[0]
    finally:
        close(jobs)
    assert isinstance(saved, dict)
    # c's 7 rows of 3: b's last 6 values, a's 12, and 3 values of padding.
    pieces = [(0, "b", 3, 6), (6, "a", 0, 12)]
    with single_job() as job:
        table, _ = prepare(job.worker, rows=7)
        bad = {
            "a table it lacks": ({"t": [(0, "z", 0, 3)]}, "'z'.*is not in it"),
            "a piece past the saved table": ({"t": [(0, "b", 4, 6)]}, r"values \[4, 10\) of 'b' \(3x3\)"),
            "a piece past this job's table": ({"t": [(18, "a", 0, 6)]}, r"cannot go to \[18, 24\) of 't' \(7x3\)"),
            "no pieces for a table": ({}, "nothing says where table 't' comes from"),
            "an empty list of pieces": ({"t": []}, "nothing says where table 't' comes from"),
            "a float offset": ({"t": [(0.0, "a", 0, 3)]}, r"not \(offset, table, offset, count\) with integer"),
        }
        for sources, message in bad.values():
            with pytest.raises(mltuner.InvalidArgumentError, match=message):
                job.restore_checkpoint(tmp_path, sources=sources)
        assert job.restore_checkpoint(tmp_path, sources={"t": pieces}) == 1
        want = np.concatenate([saved["b"][3:9], saved["a"], np.zeros(3, np.float32)]).reshape(7, 3)
        np.testing.assert_array_equal(job.worker.fetch(table), want)
