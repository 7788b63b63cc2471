"""Reads torch.profiler Chrome traces of one job's ranks (``ipc_bench.py
--profile``, ``throughput_bench.py --trace``, ``budget_profile.py
--trace-dir``) as one timeline: where each clock's time goes on every GPU.

    python benchmarks/trace_timeline.py TRACE [TRACE ...] --marker aten::fill_ [--per-clock K]
                                        [--phases NAME,...] [--clock N] [--out PATH]

CUPTI records every kernel, copy and memset of a process, the engine's
included, and the ranks' timestamps share one clock, so the traces of a
job's processes merge into one timeline. Clocks are cut at the marker: an
operator name the training loop runs a fixed number of times a clock
(``--per-clock``) in the first trace, e.g. ``aten::fill_`` in ipc_bench's
workers (one per table), or ``ProfilerStep#`` style annotations.

Prints one row per whole clock: its wall time, each rank's GPU busy time
(the union of its kernels, copies and memsets) and its busiest streams, the
longest stretch in which each rank's compute stream (its busiest over the
whole trace: the training's kernels) did nothing, a GPU waiting for data
while copies and the shard's kernels may still run beside it, and the
longest stretch in which no rank's GPU did anything, a hint of a wait
between processes or threads. ``--phases`` adds, per rank, the host time a
clock spent in each named annotation (``throughput_bench.py``'s
``step.forward,step.backward,step.update``): where the training thread
waited. ``--clock N`` also prints clock N's device operations of every rank
in time order.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# Host events by name: a record_function annotation (torch also draws it on
# the GPU's timeline as "gpu_user_annotation", which is not host time) or an operator.
HOST_CATEGORIES = ("user_annotation", "cpu_op")


@dataclass(frozen=True)
class DeviceOp:
    rank: int
    start_us: float
    duration_us: float
    stream: str
    name: str
    nbytes: int | None

    @property
    def end_us(self) -> float:
        return self.start_us + self.duration_us


def load_trace(path: Path) -> list[dict]:
    """The complete ('X') events of one Chrome trace, gzipped or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        trace = json.load(handle)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [event for event in events if event.get("ph") == "X" and "ts" in event and "dur" in event]


def device_ops(events: Sequence[dict], rank: int) -> list[DeviceOp]:
    ops = []
    for event in events:
        if event.get("cat") not in DEVICE_CATEGORIES:
            continue
        args = event.get("args", {})
        ops.append(DeviceOp(rank, float(event["ts"]), float(event["dur"]), str(args.get("stream", "?")),
                            str(event.get("name", "")), args.get("bytes")))
    return ops


def host_spans(events: Sequence[dict], names: Sequence[str]) -> dict[str, list[tuple[float, float]]]:
    """Per name, the (start, end) of every host event of that name (the
    annotations a training loop makes with ``record_function``)."""
    spans: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for event in events:
        name = event.get("name")
        if name in spans and event.get("cat") in HOST_CATEGORIES:
            start = float(event["ts"])
            spans[name].append((start, start + float(event["dur"])))
    return spans


def phase_ms(spans: dict[str, list[tuple[float, float]]], start: float, stop: float) -> dict[str, float]:
    """Per name, the milliseconds of its spans that begin in [start, stop)."""
    return {name: sum(end - begin for begin, end in found if start <= begin < stop) / 1e3
            for name, found in spans.items()}


def clock_starts(events: Sequence[dict], marker: str, per_clock: int) -> list[float]:
    """The start of every per_clock-th marker operation: one per clock."""
    times = sorted(float(e["ts"]) for e in events if e.get("name") == marker and e.get("cat") != "cuda_runtime")
    return times[::per_clock]


def union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def longest_idle_us(intervals: list[tuple[float, float]], start: float, stop: float) -> float:
    """The longest stretch of [start, stop) that no interval covers."""
    longest, covered = 0.0, start
    for begin, end in sorted(intervals):
        if begin > covered:
            longest = max(longest, min(begin, stop) - covered)
        covered = max(covered, end)
        if covered >= stop:
            break
    return max(longest, stop - covered)


def clip(op: DeviceOp, start: float, stop: float) -> tuple[float, float] | None:
    begin, end = max(op.start_us, start), min(op.end_us, stop)
    return (begin, end) if end > begin else None


def compute_streams(ops: Sequence[DeviceOp], ranks: int) -> list[str]:
    """Each rank's busiest stream over all its operations: the one the
    training's kernels run on ("?" for a rank without any)."""
    totals: list[dict[str, float]] = [collections.defaultdict(float) for _ in range(ranks)]
    for op in ops:
        totals[op.rank][op.stream] += op.duration_us
    return [max(total.items(), key=lambda item: item[1])[0] if total else "?" for total in totals]


def summarize(ops: Sequence[DeviceOp], starts: Sequence[float], ranks: int) -> list[dict]:
    """Per whole clock (between consecutive starts): wall, each rank's busy
    time, busiest streams and its compute stream's longest idle stretch, and
    the longest idle stretch of all GPUs."""
    compute = compute_streams(ops, ranks)
    rows = []
    for number, (start, stop) in enumerate(zip(starts, starts[1:])):
        busy: list[float] = []
        streams: list[list[tuple[str, float]]] = []
        compute_idle: list[float] = []
        every: list[tuple[float, float]] = []
        for rank in range(ranks):
            intervals: list[tuple[float, float]] = []
            on_compute: list[tuple[float, float]] = []
            by_stream: dict[str, float] = collections.defaultdict(float)
            for op in ops:
                span = clip(op, start, stop) if op.rank == rank else None
                if span:
                    intervals.append(span)
                    by_stream[op.stream] += span[1] - span[0]
                    if op.stream == compute[rank]:
                        on_compute.append(span)
            every += intervals
            busy.append(union_us(intervals))
            streams.append(sorted(by_stream.items(), key=lambda item: -item[1])[:3])
            compute_idle.append(longest_idle_us(on_compute, start, stop))
        rows.append({"clock": number, "wall_us": stop - start, "busy_us": busy, "streams": streams,
                     "compute_stream": compute, "compute_idle_us": compute_idle,
                     "idle_us": longest_idle_us(every, start, stop)})
    return rows


def table(rows: Sequence[dict], ranks: int) -> list[str]:
    compute = rows[0]["compute_stream"] if rows else ["?"] * ranks
    head = ["clock", "wall ms"] + [f"rank {r} GPU busy ms (busiest streams, ms)" for r in range(ranks)]
    head += [f"rank {r} longest idle of s{compute[r]} ms" for r in range(ranks)]
    lines = ["| " + " | ".join(head + ["longest idle of all GPUs ms"]) + " |",
             "|" + "--:|" * (len(head) + 1)]
    for row in rows:
        cells = [str(row["clock"]), f"{row['wall_us'] / 1e3:.3f}"]
        for busy, streams in zip(row["busy_us"], row["streams"]):
            named = ", ".join(f"s{stream} {us / 1e3:.3f}" for stream, us in streams)
            cells.append(f"{busy / 1e3:.3f} ({named})")
        cells += [f"{idle / 1e3:.3f}" for idle in row["compute_idle_us"]]
        cells.append(f"{row['idle_us'] / 1e3:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def phase_table(phases: Sequence[dict[str, list[tuple[float, float]]]], starts: Sequence[float],
                names: Sequence[str]) -> list[str]:
    head = ["clock"] + [f"rank {rank} {name}" for rank in range(len(phases)) for name in names]
    lines = ["| " + " | ".join(head) + " |", "|" + "--:|" * len(head)]
    for number, (start, stop) in enumerate(zip(starts, starts[1:])):
        cells = [str(number)]
        for spans in phases:
            found = phase_ms(spans, start, stop)
            cells += [f"{found[name]:.3f}" for name in names]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def timeline(ops: Sequence[DeviceOp], start: float, stop: float) -> list[str]:
    lines = ["| rank | start us | us | stream | operation | bytes |", "|--:|--:|--:|--:|:--|--:|"]
    for op in sorted(ops, key=lambda op: op.start_us):
        if op.end_us > start and op.start_us < stop:
            lines.append(f"| {op.rank} | {op.start_us - start:.1f} | {op.duration_us:.1f} | {op.stream} | "
                         f"{op.name[:70]} | {'' if op.nbytes is None else op.nbytes} |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", type=Path, help="one Chrome trace per rank, rank order")
    parser.add_argument("--marker", required=True, help="an operator the loop runs --per-clock times a clock")
    parser.add_argument("--per-clock", type=int, default=1)
    parser.add_argument("--phases", default="", help="comma list of host annotations to sum a clock, per rank")
    parser.add_argument("--clock", type=int, help="also list this clock's device operations")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.per_clock < 1:
        parser.error("--per-clock must be at least 1")
    names = [name for name in args.phases.split(",") if name]
    ops: list[DeviceOp] = []
    starts: list[float] = []
    phases: list[dict[str, list[tuple[float, float]]]] = []
    for rank, path in enumerate(args.traces):
        events = load_trace(path)
        ops += device_ops(events, rank)
        phases.append(host_spans(events, names))
        if rank == 0:
            starts = clock_starts(events, args.marker, args.per_clock)
    if len(starts) < 2:
        print(f"{args.traces[0]}: fewer than two clocks start with {args.marker!r}", file=sys.stderr)
        return 2
    rows = summarize(ops, starts, len(args.traces))
    lines = table(rows, len(args.traces))
    if names:
        lines += ["", "Host time a clock in each annotation (ms; an annotation counts in the clock it begins in):", ""]
        lines += phase_table(phases, starts, names)
    if args.clock is not None:
        if not 0 <= args.clock < len(rows):
            parser.error(f"--clock {args.clock}: the traces hold clocks 0-{len(rows) - 1}")
        lines += ["", f"Clock {args.clock}'s device operations (start: us from the clock's start):", ""]
        lines += timeline(ops, starts[args.clock], starts[args.clock + 1])
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
