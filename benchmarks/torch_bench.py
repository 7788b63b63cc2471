"""Throughput of a ResNet-18-sized CNN through mltuner.torch, as a ratio to
plain PyTorch on the same model, data and device in the same run.

    python benchmarks/torch_bench.py [--device cuda] [--batch 128] [--steps 30] [--out PATH]
                                     [--figures PATH]

Three runs of the same training step (forward, cross-entropy, backward,
momentum SGD) on synthetic 32x32 images, 10 classes:

1. plain PyTorch: the model and a torch.optim.SGD on the device;
2. mltuner: one worker (an in-process cluster), the model wrapped with
   mltuner.torch, the servers applying the same momentum rule;
3. mltuner under a budget: device memory for parameters and activations
   (stored as local data) cut to a quarter of what one clock needs, the rest
   in pinned host memory, swapped in ahead of use; the cheap saved
   activations (batch norm and ReLU outputs) are recomputed in the backward
   pass instead of stored (``wrap(recompute="auto")``, the default under a
   budget; budget_bench.py's quarter section compares with storing them).

Each run times ``--steps`` steps after ``--warmup`` untimed ones (CUDA
synchronised at both ends); throughput = images / second. Ratios: (2) / (1)
(goal >= 0.95) and (3) / (2) (goal >= 0.7). Stall time per clock is the
engine's ``stall_seconds`` (the training thread waiting for a buffer; in
brackets ``wait_fresh_seconds``, the allocator thread's wait for the
servers' fresh rows, which the stall includes only where it is not hidden) over
the timed clocks. The BatchNorm running statistics stay on the worker, as
they do with DDP.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import time
from pathlib import Path

import torch
from torch import nn

import mltuner as mlt
from figures import Figure, write_figures
from torch_loops import measure_need, mltuner_train, synchronize  # synchronize: imported from here by other scripts


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


def resnet18(width: int = 64, num_classes: int = 10) -> nn.Module:
    """ResNet-18 for 32x32 inputs (CIFAR layout: 3x3 stem, no max-pool)."""
    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    cin = width
    for stage, cout in enumerate((width, 2 * width, 4 * width, 8 * width)):
        for block in range(2):
            layers.append(BasicBlock(cin, cout, 2 if stage > 0 and block == 0 else 1))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


def make_data(args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 3, 32, 32, generator=generator).to(device)
    y = torch.randint(0, 10, (args.batch,), generator=generator).to(device)
    return x, y


def plain_run(args: argparse.Namespace, device: torch.device) -> float:
    torch.manual_seed(0)
    model = resnet18(args.width).to(device)
    # The servers' rule h = (1-m) g + m h; w -= lr h is torch's SGD with dampening m.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, dampening=0.9)
    x, y = make_data(args, device)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            synchronize(device)
            start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    synchronize(device)
    return args.batch * args.steps / (time.perf_counter() - start)


def mltuner_run(args: argparse.Namespace, device: torch.device, budget_fraction: float | None
                ) -> tuple[float, tuple[float, float], dict[str, float]]:
    """(images/s, (stall, fresh-row wait) seconds per clock, engine stats) of one worker."""
    config = mlt.Config(update_rule=mlt.UpdateRule("momentum", learning_rate=0.05, momentum=0.9),
                        device="cuda" if device.type == "cuda" else "cpu", wait_timeout_s=120)
    x, y = make_data(args, device)

    def make() -> nn.Module:
        return resnet18(args.width)

    def loss(out: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, y)

    store = budget_fraction is not None
    if store:
        need, _ = measure_need(make, x, loss, config, device)
        config = dataclasses.replace(config, device_memory_budget=int(need * budget_fraction))
    run = mltuner_train(make, x, loss, config, device, warmup=args.warmup, steps=args.steps,
                        store_activations=store)
    waits = (run.per_clock("stall_seconds"), run.per_clock("wait_fresh_seconds"))
    return run.samples_per_s, waits, run.after


def ms(waits: tuple[float, ...]) -> str:
    """A run's stall and fresh-row wait per clock, in ms: "stall (wait)"."""
    return f"{waits[0] * 1e3:.2f} ({waits[1] * 1e3:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--width", type=int, default=64, help="channels of the first stage (64 = ResNet-18)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the table here (markdown)")
    parser.add_argument("--figures", metavar="PATH", help="write the headline figures for the suite (JSON)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    params = sum(p.numel() for p in resnet18(args.width).parameters())
    plain = plain_run(args, device)
    ps, ps_stall, _ = mltuner_run(args, device, None)
    small, small_stall, small_stats = mltuner_run(args, device, 0.25)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    lines = [
        f"# mltuner.torch throughput: ResNet-18 ({params / 1e6:.1f} M parameters), batch {args.batch}, 32x32",
        "",
        f"date {datetime.datetime.now():%Y-%m-%d %H:%M}; device {name}; torch {torch.__version__}; "
        f"{args.steps} timed steps after {args.warmup}",
        "",
        "| run | images/s | ratio | goal | stall ms/clock (allocator's fresh-row wait) |",
        "|:--|--:|--:|:-:|--:|",
        f"| plain PyTorch (SGD momentum) | {plain:.0f} | 1.00 | | - |",
        f"| mltuner, 1 worker | {ps:.0f} | {ps / plain:.2f} of plain | >= 0.95 | {ms(ps_stall)} |",
        f"| mltuner, budget 1/4 of need (activations as local data, recompute='auto') | {small:.0f} | "
        f"{small / ps:.2f} of "
        f"unconstrained mltuner | >= 0.70 | {ms(small_stall)} |",
        "",
        f"Under the budget: {small_stats['host_store_bytes'] / 1e6:.0f} MB in host memory, "
        f"{small_stats['device_store_bytes'] / 1e6:.0f} MB on the device, access-buffer pool "
        f"{small_stats['pool_bytes'] / 1e6:.0f} MB; {small_stats['bytes_swapped_in'] / 1e6 / small_stats['clock']:.0f} "
        "MB swapped in per clock; the plan predicts "
        f"{small_stats['predicted_bytes_to_device_per_clock'] / 1e6:.0f} MB host->device and "
        f"{small_stats['predicted_bytes_to_host_per_clock'] / 1e6:.0f} MB device->host per clock.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    model = f"ResNet-18{'' if args.width == 64 else f' (width {args.width})'}, batch {args.batch}, {device.type}"
    write_figures(args.figures, [
        Figure("torch", f"{model}: 1 worker vs plain PyTorch", ps, "images/s", "plain PyTorch", plain, ps / plain,
               "mltuner / plain images/s", goal=0.95,
               note=f"stall (allocator's fresh-row wait) {ms(ps_stall)} ms/clock"),
        Figure("torch", f"{model}: budget 1/4 of need vs no budget", small, "images/s", "mltuner, no budget", ps,
               small / ps, "budget / no-budget images/s", goal=0.70,
               note=f"{small_stats['bytes_swapped_in'] / 1e6 / small_stats['clock']:.0f} MB swapped in per clock"),
    ])


if __name__ == "__main__":
    main()
