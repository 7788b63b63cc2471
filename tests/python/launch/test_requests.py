"""Requests to rank 0's services (``Job.serve`` / ``Job.request``): a rank
gets the answer of rank 0's handler without waiting for the other ranks, and
bad requests fail with a clear error. Both ranks run on threads of this
process with real sockets on 127.0.0.1."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

import mltuner
from mltuner.launch import ProcessEnv
from mltuner.launch._env import free_port


def _env(rank: int, port: int) -> ProcessEnv:
    return ProcessEnv(rank=rank, world_size=2, local_rank=rank, master_addr="127.0.0.1", master_port=port,
                      bind_host="127.0.0.1", secret="requests-test-secret", source="mltuner")


def _echo(rank: int, value: Any) -> Any:
    if value == "refuse":
        raise mltuner.InvalidArgumentError("echo refuses 'refuse'")
    if value == "crash":
        raise RuntimeError("a bug in the handler")
    if value == "set":
        return {1, 2}  # not JSON
    return {"rank": rank, "value": value}


def test_rank_0_answers_each_rank_alone_and_refuses_bad_requests(run_workers: Callable[..., list[Any]]) -> None:
    port = free_port()
    served, asked = threading.Event(), threading.Event()

    def rank(r: int) -> list[Any]:
        answers = []
        with mltuner.Job(env=_env(r, port), rendezvous_timeout_s=20.0) as job:
            if r == 0:
                job.serve("echo", _echo)
                answers.append(job.request("echo", [1, 2]))
                served.set()
                # Rank 1's requests are answered while rank 0 waits here, in no collective call.
                assert asked.wait(30), "rank 1 never finished asking"
                job.serve("echo", None)
                with pytest.raises(mltuner.InvalidArgumentError, match="serves no 'echo'"):
                    job.request("echo", 1)
            else:
                assert served.wait(30)
                answers.append(job.request("echo", {"x": 3}, timeout_s=10))
                with pytest.raises(mltuner.InvalidArgumentError, match="echo refuses"):
                    job.request("echo", "refuse")
                # A handler that fails or answers what JSON cannot hold is reported, and serving goes on.
                with pytest.raises(mltuner.InvalidArgumentError, match="handler failed: RuntimeError: a bug"):
                    job.request("echo", "crash")
                with pytest.raises(mltuner.InvalidArgumentError, match="handler failed: TypeError"):
                    job.request("echo", "set")
                with pytest.raises(mltuner.InvalidArgumentError, match="serves no 'other'"):
                    job.request("other", 1)
                with pytest.raises(mltuner.InvalidArgumentError, match="not JSON"):
                    job.request("echo", {1, 2})
                with pytest.raises(mltuner.InvalidArgumentError, match="only rank 0 serves"):
                    job.serve("echo", _echo)
                answers.append(job.request("echo", None))  # still answered after the refusals
                asked.set()
        return answers

    def release() -> None:  # a failed rank must not leave the other waiting
        served.set()
        asked.set()

    answers = run_workers(rank, [0, 1], on_error=release)
    assert answers[0] == [{"rank": 0, "value": [1, 2]}]
    assert answers[1] == [{"rank": 1, "value": {"x": 3}}, {"rank": 1, "value": None}]


def test_a_job_of_one_process_answers_its_own_requests() -> None:
    with mltuner.Job() as job:
        job.serve("echo", _echo)
        assert job.request("echo", 5) == {"rank": 0, "value": 5}
        with pytest.raises(mltuner.InvalidArgumentError, match="serves no 'other'"):
            job.request("other", 5)
        with pytest.raises(mltuner.ArgumentTypeError, match="must be callable"):
            job.serve("echo", 3)  # type: ignore[arg-type]
