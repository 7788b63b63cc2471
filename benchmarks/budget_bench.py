"""Training under a device-memory budget (issue 16's benchmark): mltuner.torch
at a quarter of its need, against PyTorch FSDP with CPU offload, and a model
larger than the GPU. One GPU, every side measured in the same run.

    python benchmarks/budget_bench.py [--only quarter,fsdp,big] [--big] [--big-gb 90]
                                      [--steps 20] [--warmup 5] [--rounds 1] [--out PATH]
                                      [--figures PATH] [--quick] [--device cpu|cuda]

Models (as gpu_path_bench.py): torchvision ``resnet18(num_classes=10)`` (the
CIFAR ResNet-18 of torch_bench.py where torchvision is missing) on 3x32x32
inputs (``--image-size``), batch 128 and 512, cross-entropy; 12 ``nn.TransformerEncoderLayer``
of width 768 (12 heads, sequence 256, batch 16), loss mean(out^2). The rule
is momentum SGD everywhere: the servers' damped momentum
(``h = (1-m) g + m h; w -= lr h``), which is
``torch.optim.SGD(momentum=m, dampening=m)`` on the PyTorch side.

Sections:

- ``quarter``: one worker with no budget against one worker whose
  ``Config.device_memory_budget`` is 1/4 of what the unconstrained plan
  needs (parameters, activations stored as local data and the least buffer
  pool, as the plan's stats report them; torch_bench.py's quarter). Under
  the budget two runs side by side (``--recompute both``, the default):
  every saved activation stored (``wrap(recompute="none")``), and the cheap
  ones recomputed in the backward pass (``recompute="auto"``, wrap()'s
  default under a budget); ``--recompute auto,compute`` runs that and
  ``recompute="compute"`` (convolutions and matrix products recomputed too)
  side by side instead. Ratio = budget / no-budget samples/s (goal >=
  0.70, moonshot 0.85); bytes swapped in and out per clock from the
  engine's stats; activation bytes stored and recomputed per clock from the
  plan.
- ``fsdp``: PyTorch FSDP with the parameters offloaded to the CPU
  (``fully_shard(offload_policy=CPUOffloadPolicy())``, FSDP2, the current
  API; ``FullyShardedDataParallel(cpu_offload=CPUOffload(offload_params=True))``
  with ``--fsdp-api fsdp1`` or where FSDP2 is missing), world size 1 on the
  same device (nccl on CUDA, gloo on the CPU, over a TCP store on
  127.0.0.1), each residual or encoder block sharded as a unit, the
  optimizer stepping on the CPU copies as FSDP's offload does. Its peak GPU
  memory (``torch.cuda.max_memory_allocated`` over the timed steps) becomes
  mltuner's budget, activations stored as local data so that they count
  against it (``--fsdp-activations torch`` leaves them to torch), the cheap
  ones recomputed (wrap()'s default under a budget). Ratio = mltuner / FSDP
  samples/s (goal >= 1.0, moonshot 2).
- ``big`` (``--big``): a stack of ``--big-width`` square ``nn.Linear`` layers
  (no bias, ReLU between) whose float32 weights and momentum take
  ``--big-gb`` GB, built on the device and wrapped with a default Config:
  no budget set by hand. Reports samples/s, or the first error and where it
  came (building the model, ``wrap()``, the first clock): a host too small
  for the plan is the host-memory guard's refusal before the first clock.
  ``--big-host-limit-gb`` sets ``Config.host_memory_limit`` for that run
  (the guard's limit); ``--quick`` adds a run under a 1 MiB limit, which
  the guard must refuse. ``--big-fallback-gb`` takes further sizes
  (comma-separated, largest first), tried in order until one trains (the
  guard refused the larger: the largest size the host holds). The worker chooses the budget (the device's free memory
  less ``Config.device_memory_reserve``) and where the server shard's state
  lives; each run prints its progress, that choice, the plan and the host's
  memory as it goes.

Every run reports the device memory it used: torch's peak allocation and the
memory in use on the device at the end of the timed steps above the level
before the run (``cudaMemGetInfo``: torch's cache and the engine's own
allocations, the server shard's values and optimizer state included).

``--quick`` shrinks every model (CIFAR ResNet-18 of width 8, an 8-layer
transformer of width 32, a big stack of a few MB) and the step counts, for
the CPU; ``--device`` defaults to cuda where there is one.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

import mltuner as mlt
from figures import Figure, spread, write_figures
from gpu_path_bench import resnet18 as vision_resnet18
from gpu_path_bench import transformer
from machine import cpu_name, git_commit, gpu_names, memory_bytes
from torch_bench import resnet18 as cifar_resnet18
from torch_loops import DeviceMemory, MltunerRun, measure_need, mltuner_train, synchronize

LR, MOMENTUM = 0.05, 0.9
MB = 1e6
SECTIONS = ("quarter", "fsdp", "big")


@dataclasses.dataclass
class Case:
    name: str
    make: Callable[[], nn.Module]
    x: torch.Tensor
    loss: Callable[[torch.Tensor], torch.Tensor]
    units: tuple[type, ...]  # module types FSDP shards as one unit

    @property
    def batch(self) -> int:
        return int(self.x.shape[0])


def block_types(model: nn.Module) -> tuple[type, ...]:
    """The residual blocks of a ResNet (torchvision's or torch_bench's) and
    the encoder layers of a transformer: FSDP's units."""
    return tuple({type(m) for m in model.modules()
                  if type(m).__name__ in ("BasicBlock", "Bottleneck") or isinstance(m, nn.TransformerEncoderLayer)})


def cases(args: argparse.Namespace, device: torch.device) -> list[Case]:
    generator = torch.Generator().manual_seed(0)
    out: list[Case] = []
    if args.quick:
        resnet: Callable[[], nn.Module] = functools.partial(cifar_resnet18, width=8)
        resnet_name, batches = "CIFAR ResNet-18 width 8", (4, 8)
        width, heads, layers, seq, tbatch = 32, 2, 8, 16, 4
    else:
        resnet = vision_resnet18
        try:
            import torchvision  # noqa: F401
            resnet_name = "torchvision resnet18"
        except ImportError:
            resnet_name = "CIFAR ResNet-18 (no torchvision)"
        batches = (128, 512)
        width, heads, layers, seq, tbatch = 768, 12, 12, 256, 16
    for batch in batches:
        x = torch.randn(batch, 3, args.image_size, args.image_size, generator=generator).to(device)
        y = torch.randint(0, 10, (batch,), generator=generator).to(device)
        size = "" if args.image_size == 32 else f", {args.image_size}x{args.image_size}"
        out.append(Case(f"{resnet_name}{size}, batch {batch}", resnet, x,
                        lambda o, y=y: nn.functional.cross_entropy(o, y), block_types(resnet())))
    x = torch.randn(tbatch, seq, width, generator=generator).to(device)

    def make_transformer() -> nn.Module:
        return transformer(layers, width, heads)

    out.append(Case(f"transformer {layers} x {width}, seq {seq}, batch {tbatch}", make_transformer, x,
                    lambda o: o.float().pow(2).mean(), (nn.TransformerEncoderLayer,)))
    return [c for c in out if args.match in c.name]


def engine_config(device: torch.device, **kwargs: object) -> mlt.Config:
    return mlt.Config(update_rule=mlt.UpdateRule("momentum", learning_rate=LR, momentum=MOMENTUM),
                      device="cuda" if device.type == "cuda" else "cpu", wait_timeout_s=300, **kwargs)


def failure(error: BaseException, limit: int = 400) -> str:
    """An error for a table cell: its type and message, one line, no pipes."""
    text = " ".join(f"{type(error).__name__}: {error}".split()).replace("|", "/")
    return text if len(text) <= limit else text[:limit] + " ..."


def mb(value: float) -> str:
    return f"{value / MB:,.0f}"


def memory_cell(torch_peak: int, in_use: int, device: torch.device) -> str:
    return f"{mb(torch_peak)} / {mb(in_use)}" if device.type == "cuda" else "-"


class Report:
    """The lines printed and written to --out, rewritten after each row so
    that a run cut short keeps what it measured."""

    def __init__(self, out: Path | None) -> None:
        self.out, self.lines = out, []  # type: ignore[var-annotated]
        self.figures: list[Figure] = []

    def emit(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)
        if self.out:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.write_text("\n".join(self.lines) + "\n")


def header(args: argparse.Namespace, device: torch.device, report: Report) -> None:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = f"{props.name}, {props.total_memory / 2**30:.1f} GiB"
        drivers = gpu_names()
        if drivers:
            gpu += f" (driver: {drivers[0].split(',')[-1].strip()})"
    else:
        gpu = "none (device cpu)"
    report.emit(f"# mltuner under a device-memory budget{' (--quick)' if args.quick else ''}")
    report.emit()
    report.emit(f"date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
                f"machine: {cpu_name()}, {os.cpu_count()} CPUs, {memory_bytes() / 2**30:.1f} GiB, "
                f"{platform.system()} {platform.release()}; GPU: {gpu}")
    report.emit(f"software: Python {platform.python_version()}, torch {torch.__version__}, mltuner "
                f"{mlt.__version__} (tree at commit {git_commit()}); device {device}; {args.steps} timed steps "
                f"after {args.warmup}, {args.rounds} round(s), medians; prefetch_clocks "
                f"{'chosen by the plan' if args.prefetch_clocks is None else args.prefetch_clocks} under "
                f"the quarter budget; rule momentum SGD "
                f"(lr {LR}, m {MOMENTUM}, dampened)")


# -- quarter: no budget vs 1/4 of the need ----------------------------------------------
RECOMPUTE_MODES = ("none", "cheap", "compute", "auto")


def quarter_modes(text: str) -> tuple[str, ...]:
    """--recompute: "both" (none and auto), or a comma-separated list of wrap()'s choices."""
    modes = ("none", "auto") if text == "both" else tuple(text.split(","))
    unknown = [m for m in modes if m not in RECOMPUTE_MODES]
    if unknown:
        raise argparse.ArgumentTypeError(f"--recompute takes 'both' or a comma-separated list of "
                                         f"{', '.join(RECOMPUTE_MODES)}; got {text!r}")
    return modes


def cells_of(values: list[float], form: str) -> str:
    return "; ".join(form.format(v) for v in values)


def stores_cell(run: MltunerRun) -> str:
    return f"{mb(run.after['host_store_bytes'])} / {mb(run.after['device_store_bytes'])}"


def activations_cell(run: MltunerRun) -> str:
    choices = ", ".join(choice for choice in (run.auto_choice, run.keep_choice) if choice)
    return f"{mb(run.activation_bytes[0])} / {mb(run.activation_bytes[1])}{f' ({choices})' if choices else ''}"


def swaps_cell(run: MltunerRun) -> str:
    return f"{mb(run.per_clock('bytes_swapped_in'))} / {mb(run.per_clock('bytes_swapped_out'))}"


def quarter_section(args: argparse.Namespace, device: torch.device, report: Report) -> None:
    modes = args.recompute
    report.emit()
    report.emit("## A quarter of the need vs no budget (goal >= 0.70, moonshot 0.85)")
    report.emit()
    report.emit("need = device + host stores + least pool of the unconstrained plan with activations "
                "as local data; the budgeted runs store activations as local data, the unconstrained "
                "one leaves them to torch. Under the budget, side by side: " +
                " and ".join({"none": "every saved activation stored (recompute='none')",
                              "cheap": "cheap ones recomputed in the backward pass (recompute='cheap')",
                              "compute": "convolutions and matrix products recomputed too "
                                         "(recompute='compute')",
                              "auto": "wrap()'s choice among those (recompute='auto')"}[m]
                             for m in modes) +
                "; cells with two values give them in that order; recompute='auto' names what it chose "
                "after its plan with 'cheap' moved bytes over the link. Device memory: torch peak / in use on "
                "the device after the run (MB).")
    report.emit()
    report.emit("| model | no budget samples/s | 1/4 budget samples/s | ratio (min-max) | need MB | budget MB | "
                "activations stored / recomputed MB per clock | host / device stores MB (1/4) | swapped in / "
                "out MB per clock (1/4) | stall ms/clock (none; 1/4) | device MB (none) | device MB (1/4) |")
    report.emit("|:--|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for case in cases(args, device):
        try:
            need, _ = measure_need(case.make, case.x, case.loss, engine_config(device), device)
            budget = need // 4
            runs: list[tuple[MltunerRun, list[MltunerRun]]] = []
            for _ in range(args.rounds):
                free = mltuner_train(case.make, case.x, case.loss, engine_config(device), device,
                                     warmup=args.warmup, steps=args.steps)
                small = [mltuner_train(case.make, case.x, case.loss,
                                       engine_config(device, device_memory_budget=budget,
                                                     prefetch_clocks=args.prefetch_clocks), device,
                                       warmup=args.warmup, steps=args.steps, store_activations=True, recompute=mode)
                         for mode in modes]
                runs.append((free, small))
        except Exception as error:  # noqa: BLE001 - a failed row is reported, the others go on
            report.emit(f"| {case.name} | failed: {failure(error)} ||||||||||")
            continue
        free_sps = statistics.median(f.samples_per_s for f, _ in runs)
        ratios = [[s[k].samples_per_s / f.samples_per_s for f, s in runs] for k in range(len(modes))]
        values = [statistics.median(r) for r in ratios]
        small_sps = [statistics.median(s[k].samples_per_s for _, s in runs) for k in range(len(modes))]
        free, small = runs[-1]

        def cells(cell: Callable[[MltunerRun], str]) -> str:  # one value per budgeted run, in mode order
            return "; ".join(cell(run) for run in small)

        span = [f" ({min(r):.2f}-{max(r):.2f})" if len(r) > 1 else "" for r in ratios]
        report.emit(
            f"| {case.name} | {free_sps:,.0f} | {cells_of(small_sps, '{:,.0f}')} | "
            f"{'; '.join(f'{v:.2f}{s}' for v, s in zip(values, span))} | {mb(need)} | {mb(budget)} | "
            f"{cells(activations_cell)} | "
            f"{cells(stores_cell)} | {cells(swaps_cell)} | "
            f"{free.per_clock('stall_seconds') * 1e3:.2f}; "
            f"{cells(lambda r: format(r.per_clock('stall_seconds') * 1e3, '.2f'))} | "
            f"{memory_cell(free.torch_peak_bytes, free.device_in_use_bytes, device)} | "
            f"{cells(lambda r: memory_cell(r.torch_peak_bytes, r.device_in_use_bytes, device))} |")
        for mode, run, value, sps, ratio in zip(modes, small, values, small_sps, ratios):
            report.figures.append(Figure(
                "budget", f"{case.name}: budget 1/4 of need (recompute='{mode}') vs no budget", sps, "samples/s",
                "mltuner, no budget", free_sps, value, "budget / no-budget samples/s", goal=0.70,
                ratio_range=spread(ratio),
                note=f"{mb(run.per_clock('bytes_swapped_in'))} MB in, {mb(run.per_clock('bytes_swapped_out'))} MB "
                     "out per clock"))


# -- fsdp: PyTorch FSDP with CPU offload vs mltuner at FSDP's peak --------------------------
def fsdp_api(requested: str) -> str:
    if requested == "fsdp2":
        try:
            from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard  # noqa: F401
        except ImportError:
            return "fsdp1"
    return requested


@contextlib.contextmanager
def process_group(device: torch.device) -> Iterator[None]:
    """A world of one: nccl on CUDA, gloo on the CPU, over a TCP store on
    127.0.0.1; destroyed at the end."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=120))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fsdp_wrap(model: nn.Module, case: Case, device: torch.device, api: str) -> nn.Module:
    if api == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        mesh = init_device_mesh(device.type, (1,))
        policy = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        for module in [m for m in model.modules() if isinstance(m, case.units)]:
            fully_shard(module, mesh=mesh, offload_policy=policy)
        fully_shard(model, mesh=mesh, offload_policy=policy)
        return model
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(model, cpu_offload=CPUOffload(offload_params=True),
                                    auto_wrap_policy=ModuleWrapPolicy(set(case.units)),
                                    device_id=device if device.type == "cuda" else None)


def fsdp_train(case: Case, args: argparse.Namespace, device: torch.device, api: str) -> tuple[float, int, int]:
    """(samples/s, torch's peak bytes over the timed steps, device bytes in use after them)."""
    memory = DeviceMemory(device)
    torch.manual_seed(0)
    model = fsdp_wrap(case.make(), case, device, api)  # built on the CPU: FSDP moves, shards and offloads it
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, dampening=MOMENTUM)
    start = time.perf_counter()
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            synchronize(device)
            memory.reset()
            start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        case.loss(model(case.x)).backward()
        optimizer.step()
    synchronize(device)
    elapsed = time.perf_counter() - start
    peak, in_use = memory.read()
    del model, optimizer
    return case.batch * args.steps / elapsed, peak, in_use


def fsdp_section(args: argparse.Namespace, device: torch.device, report: Report) -> None:
    api = fsdp_api(args.fsdp_api)
    name = ("FSDP2 fully_shard(offload_policy=CPUOffloadPolicy())" if api == "fsdp2" else
            "FSDP1 FullyShardedDataParallel(cpu_offload=CPUOffload(offload_params=True))")
    store = args.fsdp_activations == "store"
    report.emit()
    report.emit(f"## Against {name} (goal >= 1.0, moonshot 2)")
    report.emit()
    report.emit("mltuner's device_memory_budget = FSDP's peak GPU memory (torch.cuda.max_memory_allocated over "
                f"its timed steps); activations {'stored as local data (inside the budget)' if store else 'left to torch (outside the budget)'}. "
                "Device memory: torch peak / in use on the device after the run (MB); mltuner's includes "
                "the server shard's values and momentum, which live on the device outside the budget.")
    report.emit()
    report.emit("| model | FSDP samples/s | FSDP peak MB = budget | mltuner samples/s | ratio (min-max) | "
                "swapped in / out MB per clock | activations stored / recomputed MB per clock | device MB (FSDP) | "
                "device MB (mltuner) |")
    report.emit("|:--|--:|--:|--:|--:|--:|--:|--:|--:|")
    with process_group(device):
        for case in cases(args, device):
            try:
                rows: list[tuple[float, int, int, MltunerRun]] = []
                for _ in range(args.rounds):
                    fsdp_sps, peak, fsdp_in_use = fsdp_train(case, args, device, api)
                    # On the CPU there is no GPU peak to take: a quarter of the need stands in for it.
                    budget = peak if device.type == "cuda" else measure_need(
                        case.make, case.x, case.loss, engine_config(device), device)[0] // 4
                    ours = mltuner_train(case.make, case.x, case.loss,
                                         engine_config(device, device_memory_budget=budget), device,
                                         warmup=args.warmup, steps=args.steps, store_activations=store)
                    rows.append((fsdp_sps, peak, fsdp_in_use, ours))
            except Exception as error:  # noqa: BLE001
                report.emit(f"| {case.name} | failed: {failure(error)} |||||||")
                continue
            ratios = [r[3].samples_per_s / r[0] for r in rows]
            value = statistics.median(ratios)
            fsdp_sps = statistics.median(r[0] for r in rows)
            ours_sps = statistics.median(r[3].samples_per_s for r in rows)
            _, peak, fsdp_in_use, ours = rows[-1]
            span = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
            budget_cell = mb(peak) if device.type == "cuda" else f"- (cpu: 1/4 of need, {mb(budget)})"
            report.emit(
                f"| {case.name} | {fsdp_sps:,.0f} | {budget_cell} | {ours_sps:,.0f} | {value:.2f}{span} | "
                f"{mb(ours.per_clock('bytes_swapped_in'))} / {mb(ours.per_clock('bytes_swapped_out'))} | "
                f"{activations_cell(ours)} | {memory_cell(peak, fsdp_in_use, device)} | "
                f"{memory_cell(ours.torch_peak_bytes, ours.device_in_use_bytes, device)} |")
            report.figures.append(Figure(
                "budget", f"{case.name}: budget = FSDP peak vs FSDP CPU offload ({api})", ours_sps, "samples/s",
                f"{api} CPU offload", fsdp_sps, value, "mltuner / FSDP samples/s", goal=1.0,
                ratio_range=spread(ratios), note=f"budget {mb(peak)} MB"))


# -- big: a model larger than the GPU -----------------------------------------------------
def big_model(args: argparse.Namespace, device: torch.device) -> tuple[Callable[[], nn.Module], int, int]:
    """(builder, layers, parameters) of the Linear stack whose weights and
    momentum take --big-gb GB (4 + 4 bytes a parameter)."""
    width = args.big_width
    layers = max(1, math.ceil(args.big_gb * 1e9 / 8 / (width * width)))

    def make() -> nn.Module:
        modules: list[nn.Module] = []
        for i in range(layers):
            modules.append(nn.Linear(width, width, bias=False, device=device))
            if i + 1 < layers:
                modules.append(nn.ReLU())
        return nn.Sequential(*modules)

    return make, layers, layers * width * width


def host_memory_line() -> str:
    """MemAvailable and this process's resident memory, for the log."""
    fields = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            fields[name] = int(rest.split()[0]) * 1024
    rss = 0
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return (f"host: MemAvailable {fields.get('MemAvailable', -1) / 1e9:.1f} GB of {fields.get('MemTotal', -1) / 1e9:.1f}"
            f" GB, this process's RSS {rss / 1e9:.1f} GB")


def big_run(args: argparse.Namespace, device: torch.device, make: Callable[[], nn.Module],
            host_limit: int | None) -> tuple[str, MltunerRun | None]:
    """Trains the big stack with no budget; ("trained", run) or (where it
    failed and why, None). Prints its progress, the plan the worker chose
    (budget, shard placement, host memory) and the host's memory as it goes."""
    stage = "building the model on the device"
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.big_batch, args.big_width, generator=generator).to(device)
    config = engine_config(device, host_memory_limit=host_limit)
    holder = {"stage": stage}

    def wrapped() -> None:
        holder["stage"] = "the first clock"
        print(f"  wrap() done after {time.perf_counter() - started:.1f} s; {host_memory_line()}", flush=True)

    def show(worker: Any, ps: Any) -> None:
        stats = worker.stats
        print("  chosen: " + ", ".join(f"{k}={stats[k]}" for k in (
            "budget_bytes", "automatic_budget", "device_free_at_plan_bytes", "device_reserve_bytes",
            "shard_in_host_memory", "pool_bytes", "device_store_bytes", "host_store_bytes", "host_memory_bytes")),
            flush=True)
        print("  plan: " + " | ".join(worker.plan.splitlines()), flush=True)
        print(f"  hold_reads: {ps.hold_reads}", flush=True)

    started = time.perf_counter()
    try:
        synchronize(device)
        probe = make()  # built once here, to tell a build failure from the adapter's
        synchronize(device)
        print(f"  model built in {time.perf_counter() - started:.1f} s; {host_memory_line()}", flush=True)
        del probe
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the probe's memory back to the device, where the engine can see it
        holder["stage"] = "wrap() (recording pass, plan, host-memory guard)"
        started = time.perf_counter()
        run = mltuner_train(make, x, lambda o: o.pow(2).mean(), config, device, warmup=args.big_warmup,
                            steps=args.big_steps, after_wrap=wrapped, on_wrapped=show)
    except Exception as error:  # noqa: BLE001
        why = f"failed at {holder['stage']}: {failure(error, 700)}"
        # The traceback's frames hold the model (on the device) and the
        # engine's host stores: let them go before the next size is tried.
        error.__traceback__ = None
        del error
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"  {why} after {time.perf_counter() - started:.1f} s; {host_memory_line()}", flush=True)
        return why, None
    print(f"  trained: {run.samples_per_s:.2f} samples/s; {host_memory_line()}", flush=True)
    return "trained", run


def big_section(args: argparse.Namespace, device: torch.device, report: Report) -> None:
    sizes = [args.big_gb] + (args.big_fallback_gb or [])
    plans: list[str] = []
    for number, size in enumerate(sizes):
        trained = big_size(args, device, report, size, plans, fallback=number > 0)
        if trained:
            break
    for plan in plans:
        report.emit()
        report.emit(plan)


def big_size(args: argparse.Namespace, device: torch.device, report: Report, size_gb: float, plans: list[str],
             *, fallback: bool) -> bool:
    """The runs at one size; True when the one without a host limit trained."""
    args = argparse.Namespace(**{**vars(args), "big_gb": size_gb})
    make, layers, params = big_model(args, device)
    weights = params * 4
    card = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else memory_bytes()
    report.emit()
    report.emit(f"## A model larger than the {'GPU' if device.type == 'cuda' else 'device (cpu: host memory)'}"
                + (" (the largest size tried that the host holds)" if fallback else ""))
    report.emit()
    report.emit(f"{layers} x Linear({args.big_width}, {args.big_width}, bias=False), ReLU between; "
                f"{params / 1e6:,.1f} M parameters: {weights / 1e9:.3g} GB of float32 weights, "
                f"{2 * weights / 1e9:.3g} GB with momentum, against {card / 1e9:.1f} GB of device memory and "
                f"{memory_bytes() / 1e9:.1f} GB of host memory; batch {args.big_batch}, {args.big_steps} timed "
                f"clocks after {args.big_warmup}. No budget set by hand: Config's device_memory_budget left at its "
                f"default ({mlt.Config().device_memory_budget}); what the worker chose shows in the stores column "
                "and the plan below the table.")
    report.emit()
    report.emit("| run | result | samples/s | s/clock | swapped in / out GB per clock | "
                "device / host stores, pool GB | budget GB (automatic?) | shard state | device GB in use |")
    report.emit("|:--|:--|--:|--:|--:|--:|--:|:--|--:|")
    runs = [("no budget set", int(args.big_host_limit_gb * 1e9) if args.big_host_limit_gb else None)]
    if args.quick:
        runs.append(("host_memory_limit 1 MiB (the guard must refuse)", 1 << 20))
    trained = False
    for title, limit in runs:
        print(f"big: {2 * weights / 1e9:.3g} GB of weights + momentum, {title}", flush=True)
        result, run = big_run(args, device, make, limit)
        if run is None:
            report.emit(f"| {title} | {result} | - | - | - | - | - | - | - |")
            continue
        trained = trained or limit is None
        plans.append(f"plan of '{title}' at {2 * weights / 1e9:.3g} GB: {' '.join(run.plan.split())[:1200]}")
        gb = 1e9
        report.emit(
            f"| {title} | trained | {run.samples_per_s:,.1f} | {args.big_batch / run.samples_per_s:.3f} | "
            f"{run.per_clock('bytes_swapped_in') / gb:.2f} / {run.per_clock('bytes_swapped_out') / gb:.2f} | "
            f"{run.after['device_store_bytes'] / gb:.2f} / {run.after['host_store_bytes'] / gb:.2f}, "
            f"{run.after['pool_bytes'] / gb:.2f} | {run.after['budget_bytes'] / gb:.2f} "
            f"({'yes' if run.after['automatic_budget'] else 'no'}) | "
            f"{'host' if run.after['shard_in_host_memory'] else 'device'} | "
            f"{f'{run.device_in_use_bytes / gb:.1f}' if device.type == 'cuda' else '-'} |")
        report.figures.append(Figure("budget", f"{2 * weights / 1e9:.0f} GB of weights + momentum, no budget set",
                                     run.samples_per_s, "samples/s", "none", None, None, "-",
                                     note=f"{layers} x {args.big_width}^2 Linear"))
    return trained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only", default=None, help=f"comma-separated sections of {','.join(SECTIONS)}")
    parser.add_argument("--big", action="store_true", help="add the big-model section")
    parser.add_argument("--quick", action="store_true", help="tiny models and few steps (CPU test)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 20, quick 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5, quick 1)")
    parser.add_argument("--rounds", type=int, default=1, help="alternating runs of both sides; medians reported")
    parser.add_argument("--match", default="", help="only the models whose name contains this")
    parser.add_argument("--image-size", type=int, default=32,
                        help="ResNet-18's input height and width (default 32; 224 is ImageNet's, where the "
                             "GPU's work, not the host's, bounds the clock)")
    parser.add_argument("--recompute", type=quarter_modes, default=quarter_modes("both"),
                        help="quarter: the budgeted runs' wrap(recompute=), side by side: both (none and auto), "
                             "or a comma-separated list of none, cheap, compute, auto")
    parser.add_argument("--prefetch-clocks", type=lambda text: None if text == "auto" else int(text), default=None,
                        help="Config.prefetch_clocks of the quarter-budget runs: auto (the default: the plan "
                             "chooses), or 0 (one pool region, half the least pool, more of the budget for "
                             "lookahead) or 1")
    parser.add_argument("--fsdp-api", choices=("fsdp2", "fsdp1"), default="fsdp2")
    parser.add_argument("--fsdp-activations", choices=("store", "torch"), default="store",
                        help="mltuner's activations against FSDP: local data inside the budget, or torch's")
    parser.add_argument("--big-gb", type=float, default=None, help="weights + momentum, GB (default 90, quick 0.004)")
    parser.add_argument("--big-width", type=int, default=None, help="features per Linear (default 16384, quick 256)")
    parser.add_argument("--big-batch", type=int, default=None, help="rows per batch (default 64, quick 8)")
    parser.add_argument("--big-steps", type=int, default=None, help="timed clocks (default 3)")
    parser.add_argument("--big-warmup", type=int, default=1)
    parser.add_argument("--big-fallback-gb", type=lambda text: [float(size) for size in text.split(",")],
                        default=None,
                        help="weights + momentum, GB, of further sizes (comma-separated, largest first) tried in "
                             "order when --big-gb does not train (e.g. the guard refused it)")
    parser.add_argument("--big-host-limit-gb", type=float, default=None,
                        help="Config.host_memory_limit of the big run (the guard's limit), GB")
    parser.add_argument("--out", type=Path, help="write the tables here (markdown)")
    parser.add_argument("--figures", type=Path, help="write the headline figures (JSON)")
    args = parser.parse_args()
    q = args.quick
    args.steps = args.steps if args.steps is not None else (3 if q else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if q else 5)
    args.big_gb = args.big_gb if args.big_gb is not None else (0.004 if q else 90.0)
    args.big_width = args.big_width or (256 if q else 16384)
    args.big_batch = args.big_batch or (8 if q else 64)
    args.big_steps = args.big_steps or 3
    if args.only:
        sections = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = [s for s in sections if s not in SECTIONS]
        if unknown:
            parser.error(f"--only: unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    else:
        sections = ["quarter", "fsdp"] + (["big"] if args.big or q else [])
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available() or not mlt.cuda_built():
            raise SystemExit("--device cuda needs a CUDA GPU, CUDA torch and mltuner built with CUDA")
        torch.backends.cudnn.benchmark = True
        if device.index is None:  # nccl's device_id and the memory queries want an index
            device = torch.device("cuda", torch.cuda.current_device())
    elif not q:
        print("note: a full-size run on the CPU is slow; --quick sizes it for a test", flush=True)
    report = Report(args.out)
    header(args, device, report)
    for section in SECTIONS:
        if section in sections:
            {"quarter": quarter_section, "fsdp": fsdp_section, "big": big_section}[section](args, device, report)
    write_figures(str(args.figures) if args.figures else None, report.figures)


if __name__ == "__main__":
    main()
