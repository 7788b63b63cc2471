"""Where a budgeted clock's loss comes from: the stored-activation path
itself, the budget's size, or the size of the tables. One model through one
mltuner worker, side by side in one process (a diagnostic beside
budget_bench.py, which has the issue's comparison):

- ``free``: no budget, activations left to torch (budget_bench's baseline);
- ``store``: ``store_activations=True`` with no budget: every saved
  activation goes through the engine's local tables, nothing is swapped;
- ``budget F``: ``store_activations=True`` under F x the need (as
  budget_bench measures it), for each F of ``--fractions``;
- ``groups G`` (with ``--groups``): the first fraction with
  ``wrap(group_bytes=G)`` for each G.

    python benchmarks/budget_split.py [--batches 128,512] [--image-size 32]
                                      [--fractions 1,0.5,0.25] [--groups 8388608,2097152,0]
                                      [--recompute none] [--steps 40] [--rounds 2]

Prints ms per clock of each round, the ratio of the medians to ``free``, the
bytes swapped each way per clock and the plan's pool. The rounds alternate
the cases; single rounds on the lent hosts move by 10-30%.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from typing import Any

import torch
from torch import nn

import mltuner as mlt
import mltuner.torch as mtorch
from gpu_path_bench import resnet18
from torch_loops import measure_need, synchronize


def run(x: torch.Tensor, y: torch.Tensor, device: torch.device, steps: int, *, budget: int | None = None,
        store: bool = False, recompute: str = "none", group_bytes: int | None = None) -> dict[str, Any]:
    """ms per clock over ``steps`` timed clocks (after a quarter as many
    untimed), the bytes swapped per clock and the plan's pool."""
    torch.manual_seed(0)
    model = resnet18().to(device)

    def loss(out: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, y)

    config = mlt.Config(device=device.type, **({} if budget is None else {"device_memory_budget": budget}))
    with mlt.LocalCluster(1, config) as cluster:
        worker = cluster.worker(0)
        extra = {} if group_bytes is None else {"group_bytes": group_bytes}
        ps = mtorch.wrap(model, worker, example_input=x, example_loss=loss, store_activations=store,
                         recompute=recompute, **extra)
        warmup = max(2, steps // 4)
        for step in range(warmup + steps):
            if step == warmup:
                synchronize(device)
                before, start = worker.stats, time.perf_counter()
            loss(ps(x)).backward()
            ps.step()
        synchronize(device)
        ms = (time.perf_counter() - start) / steps * 1e3
        after = worker.stats
        pool = re.search(r"pool \d+ B \(([^;)]*)", ps.plan)
        worker.sync()
    return {"ms": ms, "pool": pool.group(1) if pool else "",
            "in": (after["bytes_swapped_in"] - before["bytes_swapped_in"]) / steps / 1e6,
            "out": (after["bytes_swapped_out"] - before["bytes_swapped_out"]) / steps / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", default="128,512")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--fractions", default="1,0.5,0.25", help="budgets as fractions of the need")
    parser.add_argument("--groups", default="", help="wrap(group_bytes=) values tried at the first fraction")
    parser.add_argument("--recompute", default="none")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    device = torch.device(args.device)
    fractions = [float(f) for f in args.fractions.split(",")]
    groups = [int(g) for g in args.groups.split(",") if g]
    print(f"# {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}; torchvision ResNet-18, "
          f"{args.image_size}x{args.image_size}, recompute='{args.recompute}' under budgets")
    for batch in (int(b) for b in args.batches.split(",")):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(batch, 3, args.image_size, args.image_size, generator=generator).to(device)
        y = torch.randint(0, 10, (batch,), generator=generator).to(device)
        need, _ = measure_need(resnet18, x, lambda out: nn.functional.cross_entropy(out, y),
                               mlt.Config(device=device.type), device)
        cases: list[tuple[str, dict[str, Any]]] = [("free", {}), ("store, no budget", {"store": True})]
        cases += [(f"budget {f:g}", {"store": True, "budget": int(need * f), "recompute": args.recompute})
                  for f in fractions]
        cases += [(f"budget {fractions[0]:g}, group_bytes {g}", {"store": True, "budget": int(need * fractions[0]),
                                                                 "recompute": args.recompute, "group_bytes": g})
                  for g in groups]
        results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in cases}
        for _ in range(args.rounds):
            for name, kwargs in cases:
                results[name].append(run(x, y, device, args.steps, **kwargs))
        free = statistics.median(r["ms"] for r in results["free"])
        print(f"\n## batch {batch}: need {need / 1e6:.1f} MB\n")
        print("| case | ms/clock (rounds) | free / case | MB in / out per clock | pool |")
        print("|:--|--:|--:|--:|:--|")
        for name, runs in results.items():
            median = statistics.median(r["ms"] for r in runs)
            last = runs[-1]
            print(f"| {name} | {' / '.join(format(r['ms'], '.2f') for r in runs)} | {free / median:.2f} | "
                  f"{last['in']:.1f} / {last['out']:.1f} | {last['pool']} |")


if __name__ == "__main__":
    main()
