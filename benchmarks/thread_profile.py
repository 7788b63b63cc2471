"""Where a clock's CPU goes, thread by thread: each process of a job runs
transport_bench.py's clock (every table read, then updated, slack 0) and
prints, per clock, the CPU time and context switches of each of its threads
(the training thread, the engine's allocator, reclaimer and installer, the
shard, the send and receive threads, ZeroMQ's I/O thread), read from
/proc/PID/task. A diagnostic, not a benchmark: transport_bench.py has the
comparison with raw pyzmq. Linux only.

    mltuner launch -n 2 -- python benchmarks/thread_profile.py [--tables 16] [--mib 1] [--clocks 600] [--part-mib 1]

Stop 39 used it to find that each table's trip through the threads, not its
bytes, set the clock of many small tables (docs/results.md, "Transport").
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import mltuner as mlt

ROW_WIDTH = 256  # floats per row, as transport_bench.py


def thread_counters() -> dict[str, tuple[str, float, int]]:
    """Per thread id: its name, CPU seconds so far and context switches so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    counters = {}
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            status = dict(line.split(":\t") for line in (task / "status").read_text().splitlines() if "ctxt" in line)
        except OSError:  # the thread ended meanwhile
            continue
        cpu = (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
        switches = int(status["voluntary_ctxt_switches"]) + int(status["nonvoluntary_ctxt_switches"])
        counters[task.name] = (name, cpu, switches)
    return counters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", type=int, default=16, help="the model as this many equal tables")
    parser.add_argument("--mib", type=float, default=1.0, help="the model's size in MiB")
    parser.add_argument("--clocks", type=int, default=600,
                        help="timed clocks (after 50 untimed); /proc counts CPU in 10-ms ticks, so keep it long")
    parser.add_argument("--part-mib", type=float,
                        help="Config.clock_part_bytes in MiB (0: every shard's rows whole; default: Config's)")
    args = parser.parse_args()
    if args.tables < 1 or args.clocks < 1:
        parser.error("need --tables >= 1 and --clocks >= 1")
    rows = int(args.mib * (1 << 20) / 4 / ROW_WIDTH) // args.tables
    if rows < 1:
        parser.error(f"--mib {args.mib:g} leaves no row of {ROW_WIDTH} floats for each of {args.tables} tables")
    parts = {} if args.part_mib is None else {"clock_part_bytes": int(args.part_mib * (1 << 20))}
    with mlt.Job(mlt.Config(update_rule=mlt.UpdateRule("add"), wait_timeout_s=60, **parts)) as job:
        worker = job.worker
        tables = [worker.create_table(f"model-{k}", rows, ROW_WIDTH) for k in range(args.tables)]
        reads = [worker.virtual_read(table, slack=0) for table in tables]
        for read in reads:
            worker.virtual_post_read(read)
        updates = []
        for table in tables:
            updates.append(worker.virtual_pre_update(table))
            worker.virtual_update(updates[-1])
        worker.virtual_clock()
        worker.finish_virtual_iteration()
        worker.start_iterations()

        def clock() -> None:
            for read in reads:
                worker.read(read)
            for read in reads:
                worker.post_read(read)
            for update in updates:
                worker.pre_update(update)
                worker.update(update)
            worker.clock()

        for _ in range(50):
            clock()
        before = thread_counters()
        start = time.perf_counter()
        for _ in range(args.clocks):
            clock()
        ms_per_clock = (time.perf_counter() - start) / args.clocks * 1e3
        after = thread_counters()
    per_name: dict[str, list[float]] = {}
    for tid, (name, cpu, switches) in after.items():
        if tid in before:
            totals = per_name.setdefault(name, [0.0, 0.0])
            totals[0] += (cpu - before[tid][1]) / args.clocks * 1e6
            totals[1] += (switches - before[tid][2]) / args.clocks
    busy = sorted(((name, us, sw) for name, (us, sw) in per_name.items() if us >= 1 or sw >= 0.5),
                  key=lambda item: -item[1])
    print(f"rank {worker.rank}: {args.tables} tables, {args.mib:g} MiB: {ms_per_clock:.2f} ms a clock; per clock "
          "and thread, CPU us / context switches: " + ", ".join(f"{n} {us:.0f}/{sw:.1f}" for n, us, sw in busy),
          flush=True)


if __name__ == "__main__":
    main()
