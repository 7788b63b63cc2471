"""Compares two torch.profiler traces of the same training loop (plain
PyTorch's and mltuner's, ``throughput_bench.py --trace DIR``) phase by
phase: per clock, each phase's host time, the CUDA runtime calls of each
kind of thread and the CPU operators, largest differences first. Where a
wrapped model's clock spends host time that plain PyTorch's does not.

    python benchmarks/trace_compare.py DIR/plain-1w-s0-rank0.json.gz DIR/mltuner-1w-s0-rank0.json.gz

Phases are the loop's ``record_function`` annotations ``step.forward``,
``step.backward`` and ``step.update``; the first third of the traced clocks
is skipped (warm-up). Threads: ``main`` (the one that runs the annotations),
``autograd`` (the backward's device thread: the trace gives it a small id),
``other`` (the engine's threads, whose ids are pthread handles).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from typing import Any

PHASES = ("step.forward", "step.backward", "step.update")
Counts = collections.Counter[tuple[str, str]]


def per_clock(path: str) -> dict[str, tuple[float, Counts, Counts]]:
    """Per phase: host ms a clock, CUDA runtime calls and CPU operators a clock, by (thread, name)."""
    with gzip.open(path) as file:
        events = [e for e in json.load(file)["traceEvents"] if e.get("ph") == "X"]
    marks = [e for e in events if e.get("cat") == "user_annotation" and e.get("name") in PHASES]
    if not marks:
        raise SystemExit(f"{path}: no step.* annotations")
    marks = marks[len(marks) // 3:]
    main = marks[0]["tid"]
    result = {}
    for phase in PHASES:
        windows = sorted((m["ts"], m["ts"] + m["dur"]) for m in marks if m["name"] == phase)
        clocks = max(len(windows), 1)
        calls: Counts = collections.Counter()
        operators: Counts = collections.Counter()
        for event in events:
            if event.get("cat") not in ("cuda_runtime", "cpu_op") or not _inside(event["ts"], windows):
                continue
            counts = calls if event["cat"] == "cuda_runtime" else operators
            counts[(_thread(event["tid"], main), event["name"])] += 1
        host_ms = sum(end - start for start, end in windows) / clocks / 1e3
        result[phase] = (host_ms, _scaled(calls, clocks), _scaled(operators, clocks))
    return result


def _inside(ts: float, windows: list[tuple[float, float]]) -> bool:
    return any(start <= ts < end for start, end in windows)


def _thread(tid: Any, main: Any) -> str:
    if tid == main:
        return "main"
    return "autograd" if isinstance(tid, int) and tid < 1 << 20 else "other"


def _scaled(counts: Counts, clocks: int) -> Counts:
    return collections.Counter({key: value / clocks for key, value in counts.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plain")
    parser.add_argument("mltuner")
    parser.add_argument("--rows", type=int, default=15, help="rows per table")
    args = parser.parse_args()
    plain, ours = per_clock(args.plain), per_clock(args.mltuner)
    for phase in PHASES:
        (plain_ms, plain_calls, plain_ops), (our_ms, our_calls, our_ops) = plain[phase], ours[phase]
        print(f"## {phase}: host {plain_ms:.2f} ms a clock plain, {our_ms:.2f} mltuner")
        for title, left, right in (("CUDA runtime calls", plain_calls, our_calls), ("CPU operators", plain_ops, our_ops)):
            print(f"| {title} a clock | thread | plain | mltuner |\n|:--|:--|--:|--:|")
            for key in sorted(set(left) | set(right), key=lambda k: -abs(right[k] - left[k]))[:args.rows]:
                print(f"| {key[1][:70]} | {key[0]} | {left[key]:.1f} | {right[key]:.1f} |")
        print()


if __name__ == "__main__":
    main()
