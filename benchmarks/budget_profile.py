"""Where a clock goes under a device-memory budget: one model through one
mltuner worker, without a budget and at a fraction of the need, each traced
by torch.profiler (CPU and CUDA activity of every thread, the engine's own
copies and events included). Per clock: wall time, the GPU's busy time
(kernels, copies), host<->device copies (count, bytes, time, bandwidth), the
engine's stall, and each thread's CUDA runtime calls; before the trace, the
forward, backward and step() timed apart (untraced), with the training
thread's CPU time and the engine calls of each thread. A diagnostic, not a
benchmark: budget_bench.py has the comparison.

    python benchmarks/budget_profile.py [--model resnet18|transformer] [--batch 128] [--image-size 32]
                                        [--fraction 0.25] [--clocks 6] [--prefetch-clocks auto] [--trace-dir DIR]

``--trace-dir`` keeps each run's Chrome trace (gzipped JSON) for offline
reading.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import mltuner as mlt
import mltuner.torch as mtorch
from gpu_path_bench import resnet18 as vision_resnet18
from gpu_path_bench import transformer
from torch_loops import measure_need
from trace_timeline import union_us

LR, MOMENTUM = 0.05, 0.9  # budget_bench's rule


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (microseconds in, ms out)."""
    return union_us(intervals) / 1000


def summarize(trace: dict[str, Any], clocks: int) -> list[str]:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    names = {e["tid"]: e["args"]["name"] for e in trace.get("traceEvents", [])
             if e.get("ph") == "M" and e.get("name") == "thread_name" and "args" in e}
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    lines = []
    if gpu:
        span = (max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)) / 1000
        lines.append(f"GPU span {span / clocks:.2f} ms/clock; busy (any stream) "
                     f"{union_ms([(e['ts'], e['ts'] + e['dur']) for e in gpu]) / clocks:.2f}; kernels "
                     f"{union_ms([(e['ts'], e['ts'] + e['dur']) for e in gpu if e['cat'] == 'kernel']) / clocks:.2f}; "
                     f"copies {union_ms([(e['ts'], e['ts'] + e['dur']) for e in gpu if e['cat'] == 'gpu_memcpy']) / clocks:.2f}")
    copies: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for e in gpu:
        if e["cat"] != "gpu_memcpy":
            continue
        kind = e.get("name", "?")
        entry = copies[kind]
        entry[0] += 1
        entry[1] += float(e.get("args", {}).get("bytes", 0))
        entry[2] += e["dur"]
    for kind, (count, nbytes, dur) in sorted(copies.items(), key=lambda kv: -kv[1][2]):
        lines.append(f"  {kind}: {count / clocks:.0f}/clock, {nbytes / clocks / 1e6:.1f} MB/clock, "
                     f"{dur / clocks / 1000:.2f} ms/clock, {nbytes / max(dur, 1) / 1e3:.1f} GB/s, "
                     f"{nbytes / max(count, 1) / 1e3:.1f} KB each")
    kernels: dict[str, float] = collections.defaultdict(float)
    for e in gpu:
        if e["cat"] == "kernel" and not e["name"].startswith(("void at::", "at::", "void cudnn", "sm90", "void cutlass")):
            kernels[e["name"][:60]] += e["dur"]
    for name, dur in sorted(kernels.items(), key=lambda kv: -kv[1])[:6]:
        lines.append(f"  kernel {name}: {dur / clocks / 1000:.2f} ms/clock")
    runtime: dict[int, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))
    for e in events:
        if e.get("cat") == "cuda_runtime" or e.get("cat") == "cuda_driver":
            entry = runtime[e["tid"]][e["name"]]
            entry[0] += 1
            entry[1] += e["dur"]
    for tid, calls in sorted(runtime.items(), key=lambda kv: -sum(v[1] for v in kv[1].values())):
        total = sum(v[1] for v in calls.values())
        top = sorted(calls.items(), key=lambda kv: -kv[1][1])[:6]
        lines.append(f"  thread {names.get(tid, tid)}: CUDA runtime {total / clocks / 1000:.2f} ms/clock: " +
                     ", ".join(f"{n} {c / clocks:.0f}x {d / clocks / 1000:.2f}ms" for n, (c, d) in top))
    return lines


def phases(ps: Any, worker: Any, x: torch.Tensor, loss: Any, clocks: int) -> str:
    """The forward, backward and step() of ``clocks`` clocks timed apart:
    wall and training-thread CPU ms per clock, and the engine calls
    (``Worker._run_ops``) of the training thread and of autograd's."""
    calls: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    real_run = worker._run_ops

    def timed_run(ops: Any, stream: int) -> Any:
        start = time.perf_counter()
        try:
            return real_run(ops, stream)
        finally:
            entry = calls["training" if threading.current_thread() is threading.main_thread() else "autograd"]
            entry[0] += 1
            entry[1] += time.perf_counter() - start

    worker._run_ops = timed_run
    spent = [[0.0, 0.0] for _ in range(3)]
    try:
        for _ in range(clocks):
            output = None
            for part, call in enumerate((lambda: ps(x), lambda: loss(output).backward(), ps.step)):
                wall, cpu = time.perf_counter(), time.thread_time()
                result = call()
                if part == 0:
                    output = result
                spent[part][0] += time.perf_counter() - wall
                spent[part][1] += time.thread_time() - cpu
        if x.is_cuda:
            torch.cuda.synchronize()
    finally:
        del worker._run_ops
    parts = "; ".join(f"{name} {w / clocks * 1e3:.2f} ms (CPU {c / clocks * 1e3:.2f})"
                      for name, (w, c) in zip(("forward", "backward", "step"), spent))
    engine = "; ".join(f"{thread} {n / clocks:.0f} x {s / clocks * 1e3:.2f} ms" for thread, (n, s) in calls.items())
    return f"phases per clock (untraced): {parts}; engine calls: {engine}"


def run(args: argparse.Namespace, budget: int, label: str, x: torch.Tensor, loss: Any, make: Any) -> None:
    device = torch.device("cuda")
    config = mlt.Config(update_rule=mlt.UpdateRule("momentum", learning_rate=LR, momentum=MOMENTUM),
                        device="cuda", wait_timeout_s=300, device_memory_budget=budget,
                        prefetch_clocks=args.prefetch_clocks if budget > 0 else None)
    torch.manual_seed(0)
    model = make().to(device)
    with mlt.LocalCluster(1, config) as cluster:
        worker = cluster.worker(0)
        ps = mtorch.wrap(model, worker, example_input=x, store_activations=budget > 0, example_loss=loss,
                         recompute=args.recompute)

        def step() -> None:
            loss(ps(x)).backward()
            ps.step()

        def ms_per_clock(clocks: int) -> float:
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(clocks):
                step()
            torch.cuda.synchronize()
            return (time.perf_counter() - start) / clocks * 1000

        ms_per_clock(8)  # warm-up
        torch.cuda.reset_peak_memory_stats()
        plain = ms_per_clock(args.clocks)
        torch_peak = torch.cuda.max_memory_allocated()
        by_phase = phases(ps, worker, x, loss, max(args.clocks, 20))
        before = worker.stats
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            traced = ms_per_clock(args.clocks)
        after = worker.stats
        print(f"\n## {label}: {plain:.2f} ms/clock untraced, {traced:.2f} traced; torch's peak "
              f"{torch_peak / 1e6:.0f} MB", flush=True)
        print(by_phase)
        per = {k: (after[k] - before[k]) / args.clocks for k in after
               if isinstance(after[k], (int, float)) and k in before and after[k] != before[k]}
        print("stats per clock: " + ", ".join(
            f"{k} {v * 1000:.2f}ms" if k.endswith("seconds") else f"{k} {v / 1e6:.1f}MB" if k.startswith("bytes")
            else f"{k} {v:.1f}" for k, v in sorted(per.items())))
        print("\n".join(ps.plan.splitlines()[:12]) if ps.plan else "")
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
            if args.trace_dir:
                Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
                with gzip.open(Path(args.trace_dir) / f"trace-{args.model}-{label.split()[0]}.json.gz", "wt") as f:
                    json.dump(trace, f)
        for line in summarize(trace, args.clocks):
            print(line, flush=True)
        worker.sync()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("resnet18", "transformer"), default="resnet18")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=32, help="ResNet-18's input images, pixels a side")
    parser.add_argument("--fraction", type=float, default=0.25)
    parser.add_argument("--clocks", type=int, default=6)
    parser.add_argument("--recompute", default="auto")
    parser.add_argument("--trace-dir", default=None)
    parser.add_argument("--prefetch-clocks", type=lambda text: None if text == "auto" else int(text), default=None,
                        help="Config.prefetch_clocks under the budget: auto (the default: the plan chooses, as "
                             "budget_bench.py's runs do) or a number")
    args = parser.parse_args()
    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(0)
    if args.model == "resnet18":
        make: Any = vision_resnet18
        x = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=generator).to(device)
        y = torch.randint(0, 10, (args.batch,), generator=generator).to(device)

        def loss(o: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(o, y)
    else:
        def make() -> nn.Module:
            return transformer(12, 768, 12)
        x = torch.randn(args.batch, 256, 768, generator=generator).to(device)

        def loss(o: torch.Tensor) -> torch.Tensor:
            return o.float().pow(2).mean()
    config = mlt.Config(update_rule=mlt.UpdateRule("momentum", learning_rate=LR, momentum=MOMENTUM), device="cuda")
    need, _ = measure_need(make, x, loss, config, device)
    print(f"# {args.model} batch {args.batch}: need {need / 1e6:.0f} MB, budget {args.fraction} of it")
    run(args, 0, "no budget", x, loss, make)
    run(args, int(need * args.fraction), f"{args.fraction} budget", x, loss, make)


if __name__ == "__main__":
    main()
