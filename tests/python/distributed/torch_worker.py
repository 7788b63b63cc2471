"""One worker process of the distributed PyTorch tests (run as a program,
one per rank): trains the MNIST-1D CNN through :func:`mltuner.torch.wrap`
for some clocks on batches made from a seed (rank r takes batch (clock, r)),
then writes the servers' parameters and what wrap() chose to OUT/rank-R.npz.
:func:`train` is also the tests' in-process reference, run by the workers of
a LocalCluster.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np
import torch
from torch import nn

import mltuner
import mltuner.torch as mt
from mltuner.apps._cnn import mnist1d_cnn

BATCH, LENGTH, CLASSES = 16, 40, 10


def config() -> mltuner.Config:
    return mltuner.Config(update_rule=mltuner.UpdateRule("damped_momentum", learning_rate=0.1, momentum=0.9),
                          wait_timeout_s=30)


def batches(clocks: int, num_workers: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(clocks, num_workers, BATCH, 1, LENGTH, generator=generator)
    y = torch.randint(0, CLASSES, (clocks, num_workers, BATCH), generator=generator)
    return x, y


def initialized(model: nn.Module) -> nn.Module:
    """The same initial weights in every process and thread (worker 0's
    count), from a generator of its own: the workers of a LocalCluster are
    threads of one process, and seeding torch's global generator there races
    with the other worker's own initialisation."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return model


def train(worker: mltuner.Worker, rank: int, num_workers: int, clocks: int, *, overlap: bool | None = None,
          slack: int = 0, save_at: int = -1, root: str | None = None, resume: bool = False) -> dict[str, Any]:
    """Trains and returns the servers' parameters (numpy) and wrap()'s choice.
    With ``root``: saves a checkpoint there after clock ``save_at``, or
    (``resume``) starts from its newest and trains the clocks after it."""
    torch.set_num_threads(1)
    x, y = batches(clocks, num_workers)
    model = mt.wrap(initialized(mnist1d_cnn(LENGTH, CLASSES)), worker, example_input=x[0, rank],
                    overlap_updates=overlap, slack=slack, resume_from=root if resume else None)
    first = model.resumed.clock if model.resumed is not None else 0
    for clock in range(first, clocks):
        loss = nn.functional.cross_entropy(model(x[clock, rank]), y[clock, rank])
        loss.backward()  # type: ignore[no-untyped-call]
        model.step()
        if clock + 1 == save_at and root is not None:
            model.save_checkpoint(root, user_state={"clock": clock + 1})
    state = model.state_dict()
    result: dict[str, Any] = {name: value.numpy() for name, value in state.items()}
    result["overlap_updates"] = np.array(model.overlap_updates)
    result["plan"] = np.array(model.plan)
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--clocks", type=int, default=10)
    parser.add_argument("--overlap", choices=["auto", "true", "false"], default="auto")
    parser.add_argument("--slack", type=int, default=0)
    parser.add_argument("--checkpoints", help="save a checkpoint here after --save-at clocks, or --resume from it")
    parser.add_argument("--save-at", type=int, default=-1)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    overlap = None if args.overlap == "auto" else args.overlap == "true"
    try:
        with mltuner.Job(config()) as job:
            result = train(job.worker, job.rank, job.world_size, args.clocks, overlap=overlap, slack=args.slack,
                           save_at=args.save_at, root=args.checkpoints, resume=args.resume)
            job.barrier("done")
        np.savez(os.path.join(args.out, f"rank-{job.rank}.npz"), **result)
    except mltuner.MltunerError as error:
        print(f"FAILED {type(error).__name__}: {error}", flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
