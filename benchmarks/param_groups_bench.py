"""What nanoGPT's param groups cost a wrapped model: gpu_path_bench's 12-layer
width-768 transformer (batch 16 x 256, loss mean(out^2)) under torch.optim.AdamW
with one param group, and with weights decayed and biases and norms not (a
module whose own parameters are in several groups is a table per group,
docs/torch.md "Param groups"), each beside plain PyTorch with the same
optimizer, rounds alternated. One GPU; prints a markdown table of samples/s,
the ratio to plain PyTorch and the number of tables.

    python benchmarks/param_groups_bench.py [--rounds 2] [--steps 30] [--warmup 5]
"""

from __future__ import annotations

import argparse
import time

import torch

import mltuner as mlt
import mltuner.torch as mtorch
from gpu_path_bench import transformer

BATCH, SEQUENCE, WIDTH = 16, 256, 768


def make_optimizer(model: torch.nn.Module, groups: bool) -> torch.optim.Optimizer:
    if not groups:
        return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    decayed = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decayed, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
                             lr=1e-4)


def samples_per_second(groups: bool, wrapped: bool, steps: int, warmup: int) -> tuple[float, int]:
    """Samples/s of one run, and the wrapped model's tables (0 for plain PyTorch)."""
    torch.manual_seed(0)
    x = torch.randn(BATCH, SEQUENCE, WIDTH, device="cuda")
    model = transformer().cuda()
    optimizer = make_optimizer(model, groups)
    cluster = mlt.LocalCluster(1, mlt.Config(device="cuda", wait_timeout_s=120)) if wrapped else None
    try:
        step_model: torch.nn.Module = model
        if cluster is not None:
            step_model = mtorch.wrap(model, cluster.worker(0), example_input=x, optimizer=optimizer,
                                     example_loss=lambda out: out.pow(2).mean())
            optimizer = step_model.optimizer
        start = 0.0
        for step in range(warmup + steps):
            if step == warmup:
                torch.cuda.synchronize()
                start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            step_model(x).pow(2).mean().backward()
            optimizer.step()
        torch.cuda.synchronize()
        rate = BATCH * steps / (time.perf_counter() - start)
        return rate, len(step_model.layers) if cluster is not None else 0  # type: ignore[union-attr]
    finally:
        if cluster is not None:
            cluster.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.steps} timed steps")
    print("| round | param groups | plain samples/s | mltuner samples/s | ratio | tables |")
    print("|---|---|---|---|---|---|")
    for round_ in range(args.rounds):
        for groups in (False, True):
            plain, _ = samples_per_second(groups, False, args.steps, args.warmup)
            wrapped, tables = samples_per_second(groups, True, args.steps, args.warmup)
            print(f"| {round_} | {'decayed / not' if groups else 'one'} | {plain:.1f} | {wrapped:.1f} | "
                  f"{wrapped / plain:.2f} | {tables} |", flush=True)


if __name__ == "__main__":
    main()
