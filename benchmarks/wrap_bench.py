"""How long ``mltuner.torch.wrap()`` takes for a large model: a stack of
``Linear(width, width, bias=False)`` layers on one worker (a 1-worker
``LocalCluster``), against one copy of the model's parameters on the host
(``torch.Tensor.clone`` of each, the least any start-up must do with them).
The ratio says how many such copies ``wrap()`` costs: the recording pass, the
plan, and worker 0's write of the initial values into the servers.

    python benchmarks/wrap_bench.py [--device cpu|cuda] [--layers 4] [--width 8192] [--rounds 2]
                                    [--profile]

The rounds alternate the baseline and ``wrap()``; the table gives each
round and the median ratio. ``--profile`` prints cProfile's top functions
of the last ``wrap()``, which says which part of it took the time.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import pstats
import statistics
import time

import torch
from torch import nn

import mltuner as mlt
import mltuner.torch as mtorch
from machine import cpu_name


def build(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])


def copy_seconds(model: nn.Module, repeats: int = 3) -> float:
    """One host copy of every parameter into fresh memory, the best of
    ``repeats`` (a first touch of fresh pages costs as much as the copy and
    varies with the machine's state)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        copies = [p.detach().clone() for p in model.parameters()]
        best = min(best, time.perf_counter() - start)
        del copies
    return best


def wrap_seconds(model: nn.Module, device: str, width: int, profiler: cProfile.Profile | None) -> float:
    config = mlt.Config(update_rule=mlt.UpdateRule("momentum", learning_rate=0.01, momentum=0.9), device=device)
    example = torch.randn(4, width, device=device)
    with mlt.LocalCluster(1, config) as cluster:
        model.to(device)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        wrapped = mtorch.wrap(model, cluster.worker(0), example_input=example)
        if profiler is not None:
            profiler.disable()
        elapsed = time.perf_counter() - start
        wrapped.unwrap()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() and mlt.cuda_device_count() else "cpu")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="cProfile of the last wrap()")
    args = parser.parse_args()
    if args.layers < 1 or args.width < 1 or args.rounds < 1:
        parser.error("need --layers, --width and --rounds >= 1")
    gigabytes = args.layers * args.width * args.width * 4 / 1e9
    rows = []
    profiler = None
    for round_number in range(args.rounds):
        model = build(args.layers, args.width)
        baseline = copy_seconds(model)
        profiler = cProfile.Profile() if args.profile and round_number == args.rounds - 1 else None
        wrapped = wrap_seconds(model, args.device, args.width, profiler)
        rows.append((baseline, wrapped))
        del model
    print(f"# wrap() of {args.layers} x Linear({args.width}, {args.width}): {gigabytes:.2f} GB of float32 weights\n")
    print(f"date {datetime.datetime.now():%Y-%m-%d %H:%M}; device {args.device}; host {cpu_name()}; "
          f"torch {torch.__version__}\n")
    print("| round | host copy of the parameters s | wrap() s | wrap() GB/s | ratio (wrap / copy) |")
    print("|--:|--:|--:|--:|--:|")
    for number, (baseline, wrapped) in enumerate(rows, 1):
        print(f"| {number} | {baseline:.2f} | {wrapped:.2f} | {gigabytes / wrapped:.2f} | {wrapped / baseline:.1f} |")
    print(f"\nmedian ratio {statistics.median(w / b for b, w in rows):.1f} "
          "(how many host copies of the model wrap() costs)")
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
