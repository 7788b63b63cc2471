"""Where one worker's clock goes: ResNet-18 through mltuner.torch, for each
slack, the time per clock, the training thread's stall (waiting for a
buffer), the allocator thread's wait for the servers' fresh rows, and a
cProfile of the main thread's Python, or with ``--trace`` a torch.profiler
table of every thread's operators and CUDA API calls (the engine's copies
included). A diagnostic, not a benchmark: no baseline (torch_bench.py has
the comparison with plain PyTorch).

    python benchmarks/clock_profile.py [--device cuda] [--batch 128] [--slacks 0,1,2] [--clocks 40] [--top 12]
                                       [--trace]

The backward's gradient hooks run on autograd's own thread for CUDA
tensors, which cProfile (per thread) does not see; the trace does.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from torch import nn

import mltuner as mlt
import mltuner.torch as mtorch
from torch_bench import resnet18, synchronize


def profile(args: argparse.Namespace, device: torch.device, slack: int) -> None:
    torch.manual_seed(0)
    model = resnet18(args.width).to(device)
    x = torch.randn(args.batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    config = mlt.Config(update_rule=mlt.UpdateRule("momentum", learning_rate=0.05, momentum=0.9),
                        device="cuda" if device.type == "cuda" else "cpu", wait_timeout_s=120)
    with mlt.LocalCluster(1, config) as cluster:
        worker = cluster.worker(0)
        ps = mtorch.wrap(model, worker, example_input=x, slack=slack,
                         example_loss=lambda out: nn.functional.cross_entropy(out, y))

        def step() -> None:
            nn.functional.cross_entropy(ps(x), y).backward()  # type: ignore[no-untyped-call]
            ps.step()

        for _ in range(10):
            step()
        synchronize(device)
        before = worker.stats
        tracer = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                        + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []))
        profiler = cProfile.Profile()
        start = time.perf_counter()
        with tracer if args.trace else profiler:  # one profiler at a time: each slows the clock
            for _ in range(args.clocks):
                step()
            synchronize(device)
        per_clock = (time.perf_counter() - start) / args.clocks
        after = worker.stats
        worker.sync()

    def ms(name: str) -> float:
        return (after[name] - before[name]) / args.clocks * 1e3

    print(f"\n== batch {args.batch}, slack {slack}: {per_clock * 1e3:.2f} ms/clock; training thread stalled "
          f"{ms('stall_seconds'):.2f} ms/clock; allocator waited {ms('wait_fresh_seconds'):.2f} ms/clock for "
          "fresh rows", flush=True)
    if args.trace:
        print(tracer.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    else:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--width", type=int, default=64, help="channels of the first stage (64 = ResNet-18)")
    parser.add_argument("--slacks", default="0,1,2")
    parser.add_argument("--clocks", type=int, default=40)
    parser.add_argument("--top", type=int, default=12, help="functions of the profile to print")
    parser.add_argument("--trace", action="store_true", help="torch.profiler over all threads instead of cProfile")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    for slack in (int(s) for s in args.slacks.split(",")):
        profile(args, device, slack)


if __name__ == "__main__":
    main()
