"""What read-my-writes costs a clock where nothing hides it: two in-process
CPU workers at slack 1, one table, every row read and updated with
constants, no compute; ``Config.read_my_writes`` on against off.

    python benchmarks/read_my_writes_cost.py [--mib 16] [--clocks 30]

With it, each clock makes the worker's own step and adds it to the cache (one
pass over the table, ``Device::OwnStep``), each install adds the kept steps
back (``Device::Carry`` with momentum), and a read waits for the step of the
clock before it. Printed: ms a clock (after 5 warm-up clocks) and the ratio
with it / without it, for sgd and damped momentum.
"""

from __future__ import annotations

import argparse
import time

import mltuner as mlt

WIDTH = 256  # floats a row
WARMUP = 5


def ms_per_clock(read_my_writes: bool, rule: mlt.UpdateRule, rows: int, clocks: int) -> float:
    config = mlt.Config(update_rule=rule, read_my_writes=read_my_writes, wait_timeout_s=60)
    seconds: dict[int, float] = {}

    def body(worker: mlt.Worker) -> None:
        table = worker.create_table("w", rows, WIDTH)
        read = worker.virtual_read(table, slack=1)
        update = worker.virtual_pre_update(table)
        worker.virtual_update(update)
        worker.virtual_post_read(read)
        worker.virtual_clock()
        worker.finish_virtual_iteration()
        worker.start_iterations()
        start = time.perf_counter()
        for clock in range(clocks):
            if clock == WARMUP:
                start = time.perf_counter()
            worker.read(read)
            worker.pre_update(update)[...] = 0.001
            worker.update(update)
            worker.post_read(read)
            worker.clock()
        worker.sync()
        seconds[worker.rank] = (time.perf_counter() - start) / (clocks - WARMUP)

    with mlt.LocalCluster(2, config) as cluster:
        cluster.run(body, timeout_s=600)
    return 1e3 * max(seconds.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=16.0, help="the table's size")
    parser.add_argument("--clocks", type=int, default=30)
    args = parser.parse_args()
    rows = max(1, int(args.mib * 2**20 / (4 * WIDTH)))
    rules = {"sgd": mlt.UpdateRule("sgd", learning_rate=0.1),
             "damped momentum": mlt.UpdateRule("damped_momentum", learning_rate=0.1, momentum=0.9)}
    print(f"2 workers in one process, slack 1, one table of {rows * WIDTH * 4 / 2**20:.1f} MiB, no compute\n")
    print("| rule | without, ms/clock | with, ms/clock | with / without |")
    print("|:--|--:|--:|--:|")
    for name, rule in rules.items():
        off = ms_per_clock(False, rule, rows, args.clocks)
        on = ms_per_clock(True, rule, rows, args.clocks)
        print(f"| {name} | {off:.1f} | {on:.1f} | {on / off:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
