"""A barrier or allgather that times out names the ranks it waited for:
the waiting rank asks rank 0's coordinator thread, which answers even where
rank 0's own loop is stuck (it said only "not every worker reached it")."""

from __future__ import annotations

import threading

import pytest

import mltuner

from test_wire_security import close, start_pair  # type: ignore[import-not-found]


def test_a_collective_that_times_out_names_the_ranks_it_waited_for() -> None:
    jobs = start_pair(wait_timeout_s=5)
    try:
        with pytest.raises(mltuner.WaitTimeoutError, match=r"barrier 'x' timed out after 1 s: rank 1 did not reach it"):
            jobs[0].barrier("x", timeout_s=1)
        with pytest.raises(mltuner.WaitTimeoutError,
                           match=r"allgather 'y' timed out after 1 s: rank 0 did not reach it"):
            jobs[1].allgather("y", 5, timeout_s=1)
    finally:
        close(jobs)


def test_a_second_job_of_a_rank_on_the_same_rendezvous_is_refused_with_the_way_out() -> None:
    """One Job per model (a GAN) under one launcher: the second Job of a rank
    read the same rendezvous, and rank 0 failed to bind it ('another program
    holds that port') while rank 1 met the first job ('two processes claim
    rank 1'). Refused before anything binds; its own port works."""
    import dataclasses

    from mltuner.launch import ProcessEnv
    from test_wire_security import free_port  # type: ignore[import-not-found]

    ports = free_port(), free_port()
    refused: list[BaseException] = []
    joined: list[int] = []

    def rank(r: int) -> None:  # each rank's script, on its own thread as a process would be
        env = ProcessEnv(rank=r, world_size=2, local_rank=r, master_addr="127.0.0.1", master_port=ports[0],
                         bind_host="127.0.0.1", secret="pair-secret", source="mltuner")
        with mltuner.Job(env=env, rendezvous_timeout_s=20) as first:
            try:
                mltuner.Job(env=env)
            except mltuner.InvalidArgumentError as error:
                refused.append(error)
            with mltuner.Job(env=dataclasses.replace(first.env, master_port=ports[1]), rendezvous_timeout_s=20) as two:
                joined.append(two.rank)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(refused) == 2
    assert all("already has an open Job on the rendezvous 127.0.0.1:" in str(e) and "master_port=" in str(e)
               for e in refused)
    assert sorted(joined) == [0, 1]
