"""Training loops shared by the PyTorch benchmarks (torch_bench.py,
budget_bench.py): one worker of an in-process cluster training a model
through mltuner.torch, what a quarter of its memory need is, and the device
memory a run used.

Every loop is the same step (forward, loss, backward, ``step()``) on one
fixed batch, timed over ``steps`` steps after ``warmup`` untimed ones with the
device synchronised at both ends.
"""

from __future__ import annotations

import dataclasses
import gc
import re
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import mltuner as mlt
import mltuner.torch as mtorch

Loss = Callable[[torch.Tensor], torch.Tensor]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DeviceMemory:
    """What a run used of the GPU: torch's peak allocation (after
    ``reset()``) and the device memory in use at ``read()`` above the level
    at construction (``cudaMemGetInfo``: torch's cache and the engine's own
    ``cudaMalloc``s together). Zeros on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.base = self._used()

    def _used(self) -> int:
        if not self.cuda:
            return 0
        gc.collect()
        synchronize(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> tuple[int, int]:
        """(torch's peak bytes allocated since reset(), device bytes in use
        now above the base)."""
        if not self.cuda:
            return 0, 0
        synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return peak, total - free - self.base


@dataclasses.dataclass
class MltunerRun:
    """One timed run of one worker."""

    samples_per_s: float
    steps: int
    before: dict[str, float]  # worker.stats at the start of the timed steps
    after: dict[str, float]   # ... and at their end
    torch_peak_bytes: int = 0
    device_in_use_bytes: int = 0
    plan: str = ""

    def per_clock(self, key: str) -> float:
        """A counter of the engine's stats per timed clock."""
        return (self.after[key] - self.before[key]) / self.steps

    @property
    def activation_bytes(self) -> tuple[int, int]:
        """(stored, recomputed) bytes of saved activations per clock, from
        the plan's summary; (0, 0) without stored activations."""
        stored = re.search(r"saved activations: \d+ stored \((\d+) B per clock\)", self.plan)
        recomputed = re.search(r"recomputed in the backward pass from stored ones \((\d+) B not stored", self.plan)
        return (int(stored.group(1)) if stored else 0, int(recomputed.group(1)) if recomputed else 0)

    @property
    def auto_choice(self) -> str:
        """What ``recompute="auto"`` chose after its plan with "cheap", from
        the plan's summary: "compute (F flops/B, M MiB/op)" (or "first plan
        kept", or "none" for storing every activation, with the first plan's
        figures), "cheap (another tried)", or ""."""
        found = re.search(r"recompute='auto' (chose 'compute'|kept its first plan|stores every activation): .*?, "
                          r"(\d+) flops of a step per byte and (\d+) B per op", self.plan)
        if found:
            what = {"chose 'compute'": "compute", "kept its first plan": "first plan kept"}.get(found.group(1), "none")
            return f"{what} ({found.group(2)} flops/B, {int(found.group(3)) / 2**20:.2f} MiB/op)"
        return "cheap (another tried)" if "recompute='auto' went back to 'cheap'" in self.plan else ""

    @property
    def keep_choice(self) -> str:
        """What wrap()'s keep step left to autograd on the device, from the
        plan: "none stored (B MB)", "K kept (B MB)", or ""."""
        every = re.search(r"no activation stored: .*?, (\d+) B reserved", self.plan)
        if every:
            return f"none stored ({int(every.group(1)) / 1e6:.0f} MB kept by autograd)"
        some = re.search(r"(\d+) of the stored ones kept by autograd on the device \((\d+) B", self.plan)
        return f"{some.group(1)} kept ({int(some.group(2)) / 1e6:.0f} MB)" if some else ""


def mltuner_train(make: Callable[[], nn.Module], x: torch.Tensor, loss: Loss, config: mlt.Config,
                  device: torch.device, *, warmup: int, steps: int, store_activations: bool = False,
                  slack: int = 0, after_wrap: Callable[[], None] | None = None,
                  recompute: str = "auto", on_wrapped: Callable[[Any, Any], None] | None = None) -> MltunerRun:
    """Trains ``make()`` on ``x`` through one worker of a LocalCluster with
    ``config``; samples/s over the timed steps and the engine's stats.
    ``after_wrap`` is called once wrap() returned (e.g. to report progress).
    ``recompute`` is wrap()'s (the default, "auto", recomputes cheap saved
    activations when they are stored under a budget). ``on_wrapped(worker,
    ps_model)`` is called then too (e.g. to print the plan)."""
    memory = DeviceMemory(device)
    torch.manual_seed(0)
    model = make().to(device)
    with mlt.LocalCluster(1, config) as cluster:
        worker = cluster.worker(0)
        ps = mtorch.wrap(model, worker, example_input=x, store_activations=store_activations, slack=slack,
                         example_loss=loss, recompute=recompute)
        if after_wrap is not None:
            after_wrap()
        if on_wrapped is not None:
            on_wrapped(worker, ps)
        before: dict[str, float] = {}
        start = time.perf_counter()
        for step in range(warmup + steps):
            if step == warmup:
                synchronize(device)
                memory.reset()
                before = worker.stats
                start = time.perf_counter()
            loss(ps(x)).backward()
            ps.step()
        synchronize(device)
        elapsed = time.perf_counter() - start
        after = worker.stats
        peak, in_use = memory.read()
        plan = ps.plan
        worker.sync()
    return MltunerRun(x.shape[0] * steps / elapsed, steps, before, after, peak, in_use, plan)


def measure_need(make: Callable[[], nn.Module], x: torch.Tensor, loss: Loss, config: mlt.Config,
                 device: torch.device) -> tuple[int, dict[str, Any]]:
    """Bytes of device memory the engine places for parameters and local data
    (every saved activation stored as local data: without a budget nothing
    is recomputed) with no budget, plus the least buffer pool it accepts:
    what 'a quarter of the need' is a quarter of; and the stats of that
    plan. ``config`` must have no budget."""
    torch.manual_seed(0)
    model = make().to(device)
    with mlt.LocalCluster(1, config) as cluster:
        worker = cluster.worker(0)
        mtorch.wrap(model, worker, example_input=x, store_activations=True, example_loss=loss)
        stats = worker.stats
    return int(stats["device_store_bytes"] + stats["host_store_bytes"] + stats["pool_min_bytes"]), stats
