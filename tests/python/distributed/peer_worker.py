"""A peer for tests that drive rank 0 in the test process: joins the job of
the MLTUNER_* variables and, each clock, reads table "t" (6 x 4, slack 0) and
adds rank + 1 to every row, until it has done --clocks clocks or is killed.
Prints "CLOCK c" after each clock so the test can follow it."""

from __future__ import annotations

import argparse
import time

import mltuner


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clocks", type=int, default=1000)
    parser.add_argument("--sleep", type=float, default=0.02)
    parser.add_argument("--heartbeat-timeout", type=float, default=3.0)
    args = parser.parse_args()
    config = mltuner.Config(update_rule=mltuner.UpdateRule("add"), wait_timeout_s=30)
    with mltuner.Job(config, heartbeat_timeout_s=args.heartbeat_timeout, rendezvous_timeout_s=30) as job:
        worker = job.worker
        table, read, update = add_loop_tables(worker)
        worker.start_iterations()
        for clock in range(args.clocks):
            add_clock(worker, read, update, job.rank + 1)
            print(f"CLOCK {clock}", flush=True)
            time.sleep(args.sleep)
    return 0


def add_loop_tables(worker: mltuner.Worker) -> tuple[mltuner.Table, int, int]:
    """Table "t" with one read and one update per clock (shared with the tests)."""
    table = worker.create_table("t", 6, 4)
    read = worker.virtual_read(table)
    worker.virtual_post_read(read)
    update = worker.virtual_pre_update(table)
    worker.virtual_update(update)
    worker.virtual_clock()
    worker.finish_virtual_iteration()
    return table, read, update


def add_clock(worker: mltuner.Worker, read: int, update: int, value: float) -> None:
    """One clock of :func:`add_loop_tables`' table: its read, and ``value``
    added to every row."""
    worker.read(read)
    worker.post_read(read)
    worker.pre_update(update)[:] = value
    worker.update(update)
    worker.clock()


if __name__ == "__main__":
    raise SystemExit(main())
