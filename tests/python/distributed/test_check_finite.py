"""Config(check_finite=True) across real processes: a NaN gradient from one
rank travels to the shards as host values; the shard that owns the value
refuses it and every rank fails with NonFiniteError naming the table and the
rank that sent it (not a PeerLostError from a rank that exited first)."""

from __future__ import annotations

import time


def test_a_nan_gradient_fails_every_rank_with_the_table_and_the_sender(start_workers) -> None:  # type: ignore[no-untyped-def]
    job = start_workers(3, "--clocks", "8", "--nan-rank", "2", "--nan-at", "4", "--check-finite")
    started = time.monotonic()
    results = job.wait(timeout_s=60)
    assert time.monotonic() - started < 30
    for rank, (code, output) in enumerate(results):
        assert code == 3, (rank, output)
        assert "FAILED NonFiniteError: shard 0 refused a message from worker 2: " in output, (rank, output)
        assert "table 'params' (id 0) on branch 0, clock 4: worker 2's update holds 1 of" in output, (rank, output)
