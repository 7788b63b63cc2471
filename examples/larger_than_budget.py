"""A model larger than the device memory budget: an MLP whose parameters and
activations need several times the budget trains anyway, and gives the same
parameters as the same run without a budget.

    python3 examples/larger_than_budget.py [--budget-fraction 0.25] [--device cuda]

The engine keeps what does not fit in (pinned) host memory and swaps each
layer's rows and stored activations in on its prefetch stream ahead of use;
the training loop does not change. Synthetic data: the point is the memory.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import mltuner as mlt
import mltuner.torch


def model(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def train(args: argparse.Namespace, budget: int) -> tuple[dict[str, torch.Tensor], dict[str, float], float]:
    torch.manual_seed(0)
    device = torch.device(args.device)
    net = model(args.width, args.depth).to(device)
    x = torch.randn(args.batch, args.width, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    config = mlt.Config(update_rule=mlt.UpdateRule("damped_momentum", learning_rate=0.05, momentum=0.9),
                        device=args.device, device_memory_budget=budget)
    with mlt.LocalCluster(1, config) as cluster:
        worker = cluster.worker(0)
        ps = mltuner.torch.wrap(net, worker, example_input=x, store_activations=True,
                                example_loss=lambda out: nn.functional.cross_entropy(out, y))
        start = time.perf_counter()
        for _ in range(args.clocks):
            nn.functional.cross_entropy(ps(x), y).backward()
            ps.step()
        elapsed = time.perf_counter() - start
        return ps.state_dict(), worker.stats, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--clocks", type=int, default=20)
    parser.add_argument("--budget-fraction", type=float, default=0.25)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() and mlt.cuda_device_count() else "cpu")
    args = parser.parse_args()
    free, free_stats, free_s = train(args, 0)  # 0: no budget
    need = int(free_stats["device_store_bytes"] + free_stats["pool_min_bytes"])
    budget = int(need * args.budget_fraction)
    small, stats, small_s = train(args, budget)
    same = all(torch.equal(free[k], small[k]) for k in free)
    print(f"parameters + activations + buffers: {need / 1e6:.1f} MB; budget {budget / 1e6:.1f} MB "
          f"({args.budget_fraction:.0%}); on the device {stats['device_store_bytes'] / 1e6:.1f} MB, "
          f"in host memory {stats['host_store_bytes'] / 1e6:.1f} MB")
    print(f"swapped in {stats['bytes_swapped_in'] / 1e6 / args.clocks:.1f} MB per clock; time "
          f"{small_s / args.clocks * 1e3:.1f} ms/clock against {free_s / args.clocks * 1e3:.1f} without a budget")
    print("parameters after training: " + ("identical to the run without a budget" if same else "DIFFERENT"))
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
