"""How much a read that lags costs in epochs, and how much read-my-writes
gives back: the straggler benchmark's training (the MNIST-1D CNN, 32
samples per worker and clock, damped momentum) simulated in one process,
with every read D clocks behind the shards.

    python benchmarks/staleness_sim.py [--workers 2] [--lags 0,1,2,3] [--seeds 3] [--lr 0.3] [--momentum 0.9]

Each simulated worker computes its gradient on what it would read: the
shards' parameters after clock c - 1 - D, plus, by the read's kind,

- ``stale``: nothing more (SSP as before stop 51);
- ``own``: this worker's own steps of the missing clocks (read-my-writes);
- ``own+momentum``: and the other workers' momentum carried over them, their
  step at the rows' clock decayed by m a clock (``Config.read_my_writes``
  since stop 51; ``cpp/src/cache/own_updates.h``).

The shards apply damped momentum to the workers' mean gradient, as
``python -m mltuner.apps.mnist1d`` does. Printed: epochs to 70% validation
accuracy per seed (quarter-epoch steps), and their median as a ratio to
D = 0 (BSP). Timing is not simulated: this isolates what staleness costs per
epoch from what it saves per clock.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from mltuner.apps._cnn import mnist1d_cnn
from mltuner.datasets import load_mnist1d

KINDS = ("stale", "own", "own+momentum")
BATCH = 32


def _split() -> tuple[torch.Tensor, ...]:
    """The app's split: the last tenth of the training set is validation."""
    data = load_mnist1d(num_samples=5000)
    cut = len(data.x_train) - len(data.x_train) // 10
    x = torch.tensor(data.x_train, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(data.y_train).long()
    return x[:cut], y[:cut], x[cut:], y[cut:]


def epochs_to_target(lag: int, kind: str, args: argparse.Namespace, seed: int,
                     data: Sequence[torch.Tensor]) -> float:
    """Epochs until validation accuracy reaches the target (inf: never)."""
    x_train, y_train, x_val, y_val = data
    torch.manual_seed(seed)
    model = mnist1d_cnn()
    workers, lr, m = args.workers, args.lr, args.momentum
    params = [p.detach().clone() for p in model.parameters()]
    momentum = [torch.zeros_like(p) for p in params]
    own_momentum = [[torch.zeros_like(p) for p in params] for _ in range(workers)]
    # By clock, kept for the last lag + 1 clocks: the shards' parameters and
    # momentum after it, each worker's momentum share and own step in it.
    history = {-1: ([p.clone() for p in params], [torch.zeros_like(p) for p in params],
                    [[torch.zeros_like(p) for p in params] for _ in range(workers)])}
    own_steps: dict[int, list[list[torch.Tensor]]] = {}
    clocks_per_epoch = len(x_train) // (workers * BATCH)
    clock = 0
    for epoch in range(args.max_epochs):
        order = torch.randperm(len(x_train))
        for i in range(clocks_per_epoch):
            grads = []
            for w in range(workers):
                age = max(clock - 1 - lag, -1)
                rows, shard_momentum, shares = history[age]
                view = [p.clone() for p in rows]
                if kind != "stale":
                    for k in range(age + 1, clock):
                        for v, step in zip(view, own_steps[k][w]):
                            v += step
                if kind == "own+momentum":
                    carried = sum(m ** j for j in range(1, clock - age))
                    for v, total, mine in zip(view, shard_momentum, shares[w]):
                        v -= lr * carried * (total - mine)
                for p, v in zip(model.parameters(), view):
                    p.data.copy_(v)
                batch = order[(i * workers + w) * BATCH:(i * workers + w + 1) * BATCH]
                model.zero_grad()
                nn.functional.cross_entropy(model(x_train[batch]), y_train[batch]).backward()  # type: ignore[no-untyped-call]
                grads.append([p.grad.detach() / workers for p in model.parameters()])  # type: ignore[union-attr]
            for j in range(len(params)):
                momentum[j].mul_(m).add_(sum(g[j] for g in grads), alpha=1 - m)
                params[j] -= lr * momentum[j]
            own_steps[clock] = []
            for w in range(workers):
                for j in range(len(params)):
                    own_momentum[w][j].mul_(m).add_(grads[w][j], alpha=1 - m)
                own_steps[clock].append([-lr * h for h in own_momentum[w]])
            history[clock] = ([p.clone() for p in params], [h.clone() for h in momentum],
                              [[h.clone() for h in share] for share in own_momentum])
            history.pop(clock - lag - 2, None)
            own_steps.pop(clock - lag - 2, None)
            clock += 1
            if (i + 1) % max(1, clocks_per_epoch // 4) == 0:
                for p, v in zip(model.parameters(), params):
                    p.data.copy_(v)
                with torch.no_grad():
                    accuracy = (model(x_val).argmax(1) == y_val).float().mean().item()
                if accuracy >= args.target:
                    return epoch + (i + 1) / clocks_per_epoch
    return float("inf")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--lags", type=lambda text: [int(n) for n in text.split(",")], default=[0, 1, 2, 3])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.3)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--target", type=float, default=0.7)
    parser.add_argument("--max-epochs", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = _split()
    print(f"{args.workers} workers, lr {args.lr}, momentum {args.momentum}, target {args.target:.0%}, "
          f"{args.seeds} seeds; epochs to the target (inf: not in {args.max_epochs})\n")
    print("| lag D | read | epochs by seed | median / BSP's |")
    print("|--:|:--|:--|--:|")
    bsp = None
    for lag in args.lags:
        for kind in KINDS if lag > 0 else ("stale",):
            epochs = [epochs_to_target(lag, kind, args, seed, data) for seed in range(args.seeds)]
            median = statistics.median(epochs)
            if lag == 0:
                bsp = median
            ratio = f"{median / bsp:.2f}" if bsp and np.isfinite(median) else "-"
            shown = ", ".join(f"{e:.2f}" for e in epochs)
            print(f"| {lag} | {'BSP' if lag == 0 else kind} | {shown} | {ratio} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
