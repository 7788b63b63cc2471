"""Models no issue names: does ``mltuner.torch.wrap`` take torchvision's
classification models, train them as plain PyTorch does, and at what speed?

    python benchmarks/model_zoo.py [--models all|NAME,...] [--steps 6] [--batch 8] [--workers 1] [--out PATH]

For each model (by default one or two of each family; ``--models all``: every
classification model of torchvision with at most ``--max-params`` millions
of parameters), built with 10 classes from the same seed: plain PyTorch with
``torch.optim.SGD(lr=0.01, momentum=0.9)`` and mltuner (a 1-worker
LocalCluster, ``wrap(..., optimizer=SGD(same))``) train ``--steps`` steps on
the same random batches, the RNG seeded alike before each step (dropout,
stochastic depth).

The verdict is the first step's: the same first loss (with N workers: within
``--tolerance``, their mean rounds apart from the whole batch's), and every parameter
after one step within ``--tolerance`` (relative to the tensor's largest
value) of torch's. The two sides then differ by float rounding only (torch's
SGD rounds its step in another order than the servers' rule, about 1e-7),
where a lost, doubled or wrong update shows at 1e-4 and more. Later losses
are not the test: batch-normed networks at batch 8 on random labels carry a
1e-7 difference to 1e-2 within a few steps, which the table shows beside the
same difference between two plain runs (nonzero where an algorithm is
nondeterministic; on a GPU torch's deterministic algorithms are on unless
``--nondeterministic``, and TF32 is off). Samples/s of each over the steps after the first
two, with the ratio. ``--budget 0.25``: mltuner stores the activations as
local data under a quarter of its device-memory need, and wrap() chooses what
to recompute (issue 16's machinery on models it was not built on).
``--workers N``: mltuner runs N workers of a LocalCluster (on the GPUs there
are, round robin), each training its 1/N of every batch, whose gradients the
servers average; plain PyTorch trains the whole batch in one process. Both
sides then run in eval mode: batch norm normalizes by its running statistics
and dropout is off, so a sample's gradient does not depend on the rest of
its batch, and N workers at slack 0 must train as one process does (the
first loss is the workers' mean). Runs on the GPU when there is one; needs
torchvision.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import sys
import time
import traceback
import types
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mltuner as mlt
import mltuner.torch as mtorch
from torch_loops import measure_need

# One or two of each family of torchvision's classification models.
FAMILIES = [
    "alexnet", "convnext_tiny", "densenet121", "efficientnet_b0", "efficientnet_v2_s", "googlenet",
    "inception_v3", "maxvit_t", "mnasnet0_5", "mobilenet_v2", "mobilenet_v3_small", "regnet_x_400mf",
    "regnet_y_400mf", "resnet50", "resnext50_32x4d", "shufflenet_v2_x0_5", "squeezenet1_1", "swin_t",
    "swin_v2_t", "vgg11_bn", "vit_b_16", "wide_resnet50_2",
]
# Image side per model name prefix: the transformers fix theirs, inception needs >= 75.
SIDES = {"vit_": 224, "swin": 224, "maxvit": 224, "inception": 96}
CLASSES, LR, MOMENTUM = 10, 0.01, 0.9
TIMED_FROM = 2  # the first steps warm caches and allocators up


def import_torchvision() -> Any:
    """torchvision; where its compiled operators do not load (a wheel built
    for another torch, as PyPI's with torch's CPU build), without the
    operators' registrations, which the classification models never use."""
    try:
        import torchvision
    except RuntimeError as error:  # "operator torchvision::nms does not exist"
        print(f"model_zoo: torchvision's operators did not load ({error}); its models need none")
        for name in [m for m in sys.modules if m.startswith("torchvision")]:
            del sys.modules[name]
        sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
        import torchvision
    return torchvision


def build(name: str) -> nn.Module:
    torchvision = import_torchvision()
    extra: dict[str, Any] = {}
    if name in ("googlenet", "inception_v3"):
        extra = {"aux_logits": False, "init_weights": True}  # one output in training
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torchvision.models.get_model(name, weights=None, num_classes=CLASSES, **extra)


def batches(name: str, count: int, size: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    side = next((s for prefix, s in SIDES.items() if name.startswith(prefix)), 64)
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 3, side, side, generator=generator).to(device),
             torch.randint(0, CLASSES, (size,), generator=generator).to(device)) for _ in range(count)]


Trained = tuple[list[float], dict[str, torch.Tensor], float]


def train(step: Any, parameters: Any, data: list[tuple[torch.Tensor, torch.Tensor]], device: str) -> Trained:
    """Losses of every step, the parameters after the first (``parameters()``:
    name -> tensor), and samples/s from TIMED_FROM on (``device``: a torch
    device name)."""
    cuda = torch.device(device).type == "cuda"
    losses = []
    first: dict[str, torch.Tensor] = {}
    start = 0.0
    for index, (x, y) in enumerate(data):
        if index == 1:
            first = {name: value.detach().to("cpu", torch.float32, copy=True) for name, value in parameters().items()}
        if index == TIMED_FROM:
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
        torch.manual_seed(100 + index)
        losses.append(step(x, y))
    if cuda:
        torch.cuda.synchronize(device)
    timed = sum(len(y) for _, y in data[TIMED_FROM:])
    return losses, first, timed / (time.perf_counter() - start)


def plain(model: nn.Module, data: list, device: str) -> Trained:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    return train(step, lambda: dict(model.named_parameters()), data, device)


def wrapped(model: nn.Module, data: list, device: str, budget: float, recompute: str = "auto",
            overlap: bool | None = None, workers: int = 1) -> Trained:
    """Under a budget (a fraction of the need, see torch_loops.measure_need)
    the activations are local data and wrap() chooses what to recompute.
    Worker r of ``workers`` trains the r-th share of every batch; the loss
    of a step is the workers' mean, the parameters worker 0's, the rate
    the sum of the workers'."""
    shares = [[(x.chunk(workers)[r], y.chunk(workers)[r]) for x, y in data] for r in range(workers)]

    def loss_of(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, shares[0][0][1].to(out.device))

    config = mlt.Config(device=device, wait_timeout_s=120)
    if budget:
        need, _ = measure_need(lambda: copy.deepcopy(model), shares[0][0][0], loss_of, config, torch.device(device))
        config = mlt.Config(device=device, wait_timeout_s=120, device_memory_budget=int(need * budget))
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]

    def run(worker: mlt.Worker) -> Trained:
        mine = copy.deepcopy(model).to(worker.device)
        batches_of_mine = [(x.to(worker.device), y.to(worker.device)) for x, y in shares[worker.rank]]
        optimizer = torch.optim.SGD(mine.parameters(), lr=LR, momentum=MOMENTUM)
        torch.manual_seed(99)
        ps = mtorch.wrap(mine, worker, example_input=batches_of_mine[0][0], optimizer=optimizer,
                         example_loss=loss_of, store_activations=bool(budget), recompute=recompute,
                         overlap_updates=overlap)

        def step(x: torch.Tensor, y: torch.Tensor) -> float:
            loss = F.cross_entropy(ps(x), y)
            loss.backward()
            ps.step()
            return loss.item()

        return train(step, lambda: {name: ps.state_dict()[name] for name in trainable}, batches_of_mine,
                     worker.device)

    with mlt.LocalCluster(workers, config) as cluster:
        results = cluster.run(run, timeout_s=1800)
    losses = [sum(step) / workers for step in zip(*(r[0] for r in results))]
    return losses, results[0][1], sum(r[2] for r in results)


def check(name: str, args: argparse.Namespace, device: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = build(name).to(device)
    if args.workers > 1:
        model.eval()  # see the module's docstring
    params = sum(p.numel() for p in model.parameters()) / 1e6
    row: dict[str, Any] = {"model": name, "params": params}
    if params > args.max_params:
        return {**row, "result": f"skipped (over {args.max_params:g} M parameters)"}
    data = batches(name, args.steps, args.batch, device)
    want, want_first, plain_rate = plain(copy.deepcopy(model), data, device)
    again, _, _ = plain(copy.deepcopy(model), data, device)
    row["noise"] = largest_difference(again, want)
    try:
        got, got_first, rate = wrapped(copy.deepcopy(model), data, device, args.budget, args.recompute,
                                        args.overlap, args.workers)
    except (mtorch.UnsupportedModelError, mlt.ResourceExhaustedError) as error:  # a model or budget wrap() declines
        return {**row, "result": f"refused: {str(error).splitlines()[0][:300]}"}
    except Exception as error:  # noqa: BLE001 - the table reports it
        traceback.print_exc()
        return {**row, "result": f"error: {type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    step_error = max(float((got_first[n] - w).abs().max() / w.abs().max().clamp_min(1e-30))
                     for n, w in want_first.items())
    # N workers' mean of their shares' losses rounds apart from the loss of the whole batch.
    first_loss_error = abs(got[0] - want[0]) / max(abs(want[0]), 1e-12)
    same = (first_loss_error == 0 or args.workers > 1 and first_loss_error <= args.tolerance) \
        and step_error <= args.tolerance
    verdict = "trains, as plain PyTorch" if same else "**differs from plain PyTorch at the first step**"
    return {**row, "result": verdict, "step_error": step_error, "difference": largest_difference(got, want),
            "plain": plain_rate, "mltuner": rate}


def table_of(rows: list[dict[str, Any]], args: argparse.Namespace, device: str, torchvision_version: str) -> str:
    machine = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    lines = [
        f"# wrap() over torchvision's models ({datetime.date.today()}, {machine}, torch {torch.__version__}, "
        f"torchvision {torchvision_version})",
        "",
        f"batch {args.batch}, {args.steps} steps of SGD (lr {LR}, momentum {MOMENTUM}); samples/s over steps "
        f"{TIMED_FROM + 1}-{args.steps}; deterministic algorithms "
        f"{'off' if args.nondeterministic or device == 'cpu' else 'on'}"
        + (f"; mltuner under a budget of {args.budget:g} of its need, activations stored, recompute="
           f"{args.recompute!r}" if args.budget else "")
        + ("; updates shipped from the backward pass (overlap_updates=True)" if args.overlap else "")
        + (f"; mltuner on {args.workers} workers (a LocalCluster), each on {args.batch // args.workers} samples "
           "of every batch, both sides in eval mode" if args.workers > 1 else ""),
        "",
        "| model | M params | result | parameters after step 1 | losses of every step | two plain runs "
        "| plain samples/s | mltuner samples/s | ratio |",
        "|:--|--:|:--|--:|--:|--:|--:|--:|--:|",
    ]
    for row in rows:
        speed = (f"{row['plain']:,.0f} | {row['mltuner']:,.0f} | {row['mltuner'] / row['plain']:.2f}"
                 if "mltuner" in row else " | | ")
        figures = " | ".join(f"{row[key]:.1e}" if key in row else "" for key in ("step_error", "difference", "noise"))
        lines.append(f"| {row['model']} | {row['params']:.1f} | {row['result']} | {figures} | {speed} |")
    return "\n".join(lines)


def largest_difference(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="", help="comma list, or 'all' (default: one or two per family)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-params", type=float, default=100.0, help="millions; larger models are skipped")
    parser.add_argument("--tolerance", type=float, default=1e-5,
                        help="largest relative parameter difference after the first step")
    parser.add_argument("--budget", type=float, default=0.0,
                        help="mltuner's device_memory_budget as a fraction of the need (0: none), activations stored")
    parser.add_argument("--recompute", choices=["auto", "none", "cheap", "compute"], default="auto",
                        help="wrap(recompute=) under --budget")
    parser.add_argument("--overlap", action="store_true", default=None,
                        help="wrap(overlap_updates=True): each layer's update ships from the backward pass")
    parser.add_argument("--workers", type=int, default=1,
                        help="mltuner workers, each on its share of every batch (both sides in eval mode)")
    parser.add_argument("--nondeterministic", action="store_true",
                        help="leave torch's nondeterministic GPU algorithms on (faster; see above)")
    parser.add_argument("--out", default="results/model_zoo.md")
    args = parser.parse_args()
    if args.steps <= TIMED_FROM:
        parser.error(f"--steps must exceed {TIMED_FROM}")
    if args.workers < 1 or args.batch % args.workers:
        parser.error("--workers must be >= 1 and divide --batch")
    try:
        torchvision = import_torchvision()
    except ImportError as error:
        print(f"model_zoo: needs torchvision ({error})")
        return 2
    device = "cuda" if mlt.cuda_device_count() > 0 and torch.cuda.is_available() else "cpu"
    if device == "cuda" and not args.nondeterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's condition for determinism
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        # TF32 off: the workers' shares of a batch run other kernels than the
        # whole batch, and TF32 rounds each product to 1e-3, which sums that
        # nearly cancel (a zero-initialised bias's gradient) carry to 1e-1.
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    if args.models == "all":
        names = torchvision.models.list_models(module=torchvision.models)
    else:
        names = args.models.split(",") if args.models else FAMILIES
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in names:
        row = check(name, args, device)
        rows.append(row)
        print(f"{name}: {row['result']}", flush=True)
        out.write_text(table_of(rows, args, device, torchvision.__version__) + "\n")  # what ran, should a limit stop the rest
    print(table_of(rows, args, device, torchvision.__version__))
    failed = [r for r in rows if r["result"].startswith(("error", "**"))]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
