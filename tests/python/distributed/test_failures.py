"""Failures and restarts across real processes: a worker killed with SIGKILL
mid-training, checkpoints restored on the same and on a different number of
processes, and a rendezvous that cannot complete."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

import mltuner
from mltuner.launch import ProcessEnv
from mltuner.launch._env import free_port

HEARTBEAT_TIMEOUT_S = 3.0


def test_kill_minus_9_then_restore_from_the_last_checkpoint(start_workers, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ckpt = tmp_path / "ckpt"
    # The uninterrupted run, for reference.
    whole = start_workers(3, "--clocks", "20")
    assert all(code == 0 for code, _ in whole.wait()), whole.wait()
    want = whole.result(0)["final"]

    # Rank 1 kills itself at clock 12, after a checkpoint at clock 8.
    crashed = start_workers(3, "--clocks", "20", "--save-at", "8", "--checkpoint", str(ckpt), "--die-rank", "1",
                            "--die-at", "12", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S))
    started = time.monotonic()
    results = crashed.wait(timeout_s=60)
    elapsed = time.monotonic() - started
    assert results[1][0] == -9
    for rank in (0, 2):
        code, output = results[rank]
        assert code == 3, output
        assert "FAILED PeerLostError: worker rank 1 stopped answering" in output, output
    assert elapsed < 25, f"the survivors took {elapsed:.1f} s to notice"
    checkpoint = ckpt / "clock-00000008"
    assert (checkpoint / "manifest.json").is_file()
    assert (ckpt / "latest").read_text().strip() == "clock-00000008"

    # Restored on 3 processes with no training: bit-identical to what was saved.
    at_save = crashed.result(0, "saved")["at_save"]
    for n in (3, 2):
        restored = start_workers(n, "--clocks", "0", "--restore", str(ckpt))
        assert all(code == 0 for code, _ in restored.wait()), restored.wait()
        for rank in range(n):
            np.testing.assert_array_equal(restored.result(rank)["final"], at_save)
            assert int(restored.result(rank)["first_clock"]) == 8

    # Resumed on 3 processes for the remaining 12 clocks: the same parameters
    # as the run that was never interrupted, bit for bit.
    resumed = start_workers(3, "--clocks", "12", "--total-clocks", "20", "--restore", str(ckpt))
    assert all(code == 0 for code, _ in resumed.wait()), resumed.wait()
    np.testing.assert_array_equal(resumed.result(0)["final"], want)


def test_adam_state_survives_a_restore_on_fewer_processes(start_workers, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Adam's moments and step count are re-split from 3 shards onto 2: the
    resumed run (same data stream) matches the uninterrupted one."""
    ckpt = tmp_path / "ckpt"
    whole = start_workers(3, "--rule", "adam", "--lr", "0.01", "--clocks", "12")
    assert all(code == 0 for code, _ in whole.wait())
    first = start_workers(3, "--rule", "adam", "--lr", "0.01", "--clocks", "6", "--total-clocks", "12",
                          "--save-at", "6", "--checkpoint", str(ckpt))
    assert all(code == 0 for code, _ in first.wait())
    # Two processes continue the 3-worker data stream: ranks 0 and 1 take their
    # own batches, so compare against the checkpoint only through the restore.
    restored = start_workers(2, "--rule", "adam", "--lr", "0.01", "--clocks", "0", "--restore", str(ckpt))
    assert all(code == 0 for code, _ in restored.wait())
    np.testing.assert_array_equal(restored.result(0)["final"], first.result(0, "saved")["at_save"])
    resumed = start_workers(3, "--rule", "adam", "--lr", "0.01", "--clocks", "6", "--total-clocks", "12",
                            "--restore", str(ckpt))
    assert all(code == 0 for code, _ in resumed.wait())
    np.testing.assert_array_equal(resumed.result(0)["final"], whole.result(0)["final"])


def _record_a_read(worker: mltuner.Worker) -> None:
    """A clock of one read of a 3 x 4 table "params" (unlike start_workers' tables)."""
    table = worker.create_table("params", 3, 4)
    handle = worker.virtual_read(table)
    worker.virtual_post_read(handle)
    worker.virtual_clock()
    worker.finish_virtual_iteration()


def _saved_checkpoint(start_workers, path: Path) -> mltuner.Job:  # type: ignore[no-untyped-def]
    """A checkpoint of start_workers' tables saved at ``path`` by one worker,
    and a job of one process whose worker recorded a clock of other tables."""
    first = start_workers(1, "--clocks", "2", "--save-at", "2", "--checkpoint", str(path))
    assert all(code == 0 for code, _ in first.wait())
    job = mltuner.Job(env=_single_env())
    try:
        _record_a_read(job.worker)
    except BaseException:
        job.close()
        raise
    return job


def test_restore_refuses_a_checkpoint_of_other_tables(start_workers, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ckpt = tmp_path / "ckpt"
    job = _saved_checkpoint(start_workers, ckpt)
    try:
        try:
            job.restore_checkpoint(ckpt)
        except mltuner.InvalidArgumentError as error:
            assert "does not match this job's tables" in str(error)
        else:
            raise AssertionError("restore accepted a checkpoint of other tables")
        try:
            job.restore_checkpoint(tmp_path / "nothing-here")
        except mltuner.NotFoundError as error:
            assert "no complete checkpoint" in str(error)
        else:
            raise AssertionError("restore accepted a missing checkpoint")
    finally:
        job.close()


def test_restore_after_start_iterations_is_refused(start_workers, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """After start_iterations (which mltuner.torch.wrap runs) the worker may
    hold reads of the old values and its clocks would not restart."""
    ckpt = tmp_path / "ckpt"
    job = _saved_checkpoint(start_workers, ckpt)
    try:
        job.worker.start_iterations()
        with pytest.raises(mltuner.OutOfOrderError, match="after start_iterations.*resume_from"):
            job.restore_checkpoint(ckpt)
    finally:
        job.close()


def test_rendezvous_timeout_names_the_missing_ranks() -> None:
    env = ProcessEnv(rank=0, world_size=3, local_rank=0, master_addr="127.0.0.1", master_port=free_port(),
                     bind_host="127.0.0.1", secret=None, source="mltuner")
    started = time.monotonic()
    try:
        mltuner.Job(env=env, rendezvous_timeout_s=1.0)
    except mltuner.WaitTimeoutError as error:
        assert "ranks [1, 2] never joined" in str(error)
    else:
        raise AssertionError("a rendezvous with missing ranks succeeded")
    assert time.monotonic() - started < 10


def _single_env() -> ProcessEnv:
    return ProcessEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=0,
                      bind_host="127.0.0.1", secret=None, source="single")


def test_launch_stops_the_job_when_a_worker_is_killed(tmp_path: Path) -> None:
    """Under `mltuner launch`, the survivors report the lost rank themselves
    (within the heartbeat bound) and the launcher exits with the killed
    worker's status."""
    import io
    import sys

    from mltuner.launch import launch

    worker = Path(__file__).with_name("train_worker.py")  # not `from conftest`: other folders have one too

    out = io.StringIO()
    started = time.monotonic()
    code = launch([sys.executable, str(worker), "--out", str(tmp_path), "--clocks", "400", "--die-rank", "2",
                   "--die-at", "5", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)], 3, stdout=out,
                  grace_seconds=20)
    assert code == 128 + 9
    assert time.monotonic() - started < 30
    text = out.getvalue()
    assert "rank 2 exited with code" in text
    for rank in (0, 1):
        assert f"[rank {rank}] FAILED PeerLostError: worker rank 2 stopped answering" in text, text
