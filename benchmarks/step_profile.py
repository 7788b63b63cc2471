"""Where the host time of a launch-bound training step goes, plain PyTorch
against one mltuner worker on the same model: torch.profiler (CPU activity
only, which costs little) over the timed steps of each, each operator's and
runtime call's self time per step summed per thread, and the differences
largest first. A diagnostic, not a benchmark (gpu_path_bench.py has the
throughput comparison).

    python benchmarks/step_profile.py [--batch 128] [--slack 0] [--steps 30] [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable

import torch
from torch import nn

import mltuner as mlt
import mltuner.torch as mtorch
from gpu_path_bench import resnet18


def profile_steps(step: Callable[[], None], steps: int) -> tuple[dict[tuple[str, str], float], float]:
    """{(thread role, name): self microseconds per step}, and ms per step."""
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        elapsed = (time.perf_counter() - start) / steps
    main_thread = None
    totals: dict[tuple[int, str], float] = collections.defaultdict(float)
    for event in profiler.events():
        if main_thread is None and event.name.startswith("aten::"):
            main_thread = event.thread  # the first operator runs on the training thread
        totals[(event.thread, event.name)] += event.self_cpu_time_total / steps
    roles = {thread: ("main" if thread == main_thread else f"t{thread % 10000}") for thread, _ in totals}
    return {(roles[t], n): v for (t, n), v in totals.items()}, elapsed * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--slack", type=int, default=0)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    x = torch.randn(args.batch, 3, 32, 32, device="cuda")
    y = torch.randint(0, 10, (args.batch,), device="cuda")

    torch.manual_seed(0)
    model = resnet18().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, dampening=0.9)

    def plain_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    plain, plain_ms = profile_steps(plain_step, args.steps)

    torch.manual_seed(0)
    model = resnet18().cuda()
    config = mlt.Config(update_rule=mlt.UpdateRule("momentum", learning_rate=0.05, momentum=0.9), device="cuda",
                        wait_timeout_s=120)
    with mlt.LocalCluster(1, config) as cluster:
        ps = mtorch.wrap(model, cluster.worker(0), example_input=x, slack=args.slack,
                         example_loss=lambda out: nn.functional.cross_entropy(out, y))

        def ps_step() -> None:
            nn.functional.cross_entropy(ps(x), y).backward()
            ps.step()

        ours, ours_ms = profile_steps(ps_step, args.steps)
        stats = cluster.worker(0).stats
        cluster.worker(0).sync()

    print(f"# step under the profiler: plain {plain_ms:.2f} ms, mltuner {ours_ms:.2f} ms; "
          f"mltuner stall {stats['stall_seconds']:.3f} s in all")
    for name, table in (("plain", plain), ("mltuner", ours)):
        per_role: dict[str, float] = collections.defaultdict(float)
        for (role, _), value in table.items():
            per_role[role] += value
        print(f"## {name}: self CPU per step by thread: "
              + ", ".join(f"{role} {value / 1e3:.2f} ms" for role, value in sorted(per_role.items(), key=lambda kv: -kv[1])))
    keys = set(plain) | set(ours)
    diffs = sorted(keys, key=lambda k: -abs(ours.get(k, 0.0) - plain.get(k, 0.0)))
    print("## largest differences (self CPU us per step): thread, name, plain, mltuner")
    for key in diffs[: args.top]:
        print(f"  {key[0]:>6} {key[1][:70]:70s} {plain.get(key, 0.0):9.1f} {ours.get(key, 0.0):9.1f}")


if __name__ == "__main__":
    main()
