"""A barrier or allgather that times out names the ranks it waited for:
the waiting rank asks rank 0's coordinator thread, which answers even where
rank 0's own loop is stuck (it said only "not every worker reached it")."""

from __future__ import annotations

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
