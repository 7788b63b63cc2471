"""A model larger than the GPU budget: time per clock through the engine on
CUDA, with the budget at 1/4 of parameters + local data, against the same run
unconstrained and against plain PyTorch with everything resident.

The model is GeePS's Caffe mapping of an MLP: per layer, forward reads the
weights (slack 0) and keeps the activation as local data; backward reads the
weights again, fetches the activation, writes the gradient as an update. Under
the small budget the allocator thread swaps weights and activations in (one
kernel per access over mapped pinned memory, on the low-priority swap-in
stream) while earlier layers compute, and the reclaimer adds gradients into
the host log and writes activations back behind. The table prints the bytes
swapped per clock and the rate they need, beside the pinned-copy bandwidth
measured in the same run.

    python benchmarks/gpu_model_bench.py [--layers 20] [--dim 2048] [--batch 1024] [--clocks 20]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time

import numpy as np

import mltuner as mlt

try:
    import torch
except ImportError:  # pragma: no cover - the benchmark needs torch
    raise SystemExit("gpu_model_bench needs torch with CUDA") from None


def aligned(nbytes: int) -> int:
    return (nbytes + 255) // 256 * 256


def build(worker: mlt.Worker, layers: int, dim: int, batch: int) -> dict[str, list[int]]:
    weights = [worker.create_table(f"w{i}", dim, dim) for i in range(layers)]
    acts = [worker.create_table(f"a{i}", batch, dim, local=True) for i in range(layers)]
    h: dict[str, list[int]] = {"fw_read": [], "fw_act": [], "bw_read": [], "bw_act": [], "grad": []}
    for i in range(layers):
        r = worker.virtual_read(weights[i], slack=0)
        a = worker.virtual_local_access(acts[i], fetch=False)
        worker.virtual_post_local_access(a, keep=True)
        worker.virtual_post_read(r)
        h["fw_read"].append(r)
        h["fw_act"].append(a)
    for i in reversed(range(layers)):
        r = worker.virtual_read(weights[i], slack=0)
        a = worker.virtual_local_access(acts[i], fetch=True)
        g = worker.virtual_pre_update(weights[i])
        worker.virtual_update(g)
        worker.virtual_post_local_access(a, keep=False)
        worker.virtual_post_read(r)
        h["bw_read"].insert(0, r)
        h["bw_act"].insert(0, a)
        h["grad"].insert(0, g)
    worker.virtual_clock()
    worker.finish_virtual_iteration()
    return h


def engine_run(layers: int, dim: int, batch: int, clocks: int, budget: int) -> tuple[float, dict[str, float]]:
    config = mlt.Config(device="cuda", device_memory_budget=budget, wait_timeout_s=120,
                        update_rule=mlt.UpdateRule("sgd", learning_rate=1e-4))
    x0 = torch.randn(batch, dim, device="cuda")
    times: list[float] = []
    with mlt.LocalCluster(1, config) as cluster:
        worker = cluster.worker(0)
        h = build(worker, layers, dim, batch)
        for g in h["grad"]:  # initial weights (initialisation phase: added directly)
            w = torch.from_dlpack(worker.pre_update(g))
            w.copy_(torch.randn(dim, dim, device="cuda") / dim**0.5)
            worker.update(g)
        worker.start_iterations()
        for clock in range(clocks):
            torch.cuda.synchronize()
            start = time.perf_counter()
            x = x0
            for i in range(layers):
                w = torch.from_dlpack(worker.read(h["fw_read"][i]))
                a = torch.from_dlpack(worker.local_access(h["fw_act"][i]))
                a.copy_(x)
                x = torch.tanh(x @ w)
                worker.post_local_access(h["fw_act"][i])
                worker.post_read(h["fw_read"][i])
            grad_out = torch.ones_like(x) / x.numel()
            for i in reversed(range(layers)):
                w = torch.from_dlpack(worker.read(h["bw_read"][i]))
                a = torch.from_dlpack(worker.local_access(h["bw_act"][i]))
                g = torch.from_dlpack(worker.pre_update(h["grad"][i]))
                y = torch.tanh(a @ w)
                delta = grad_out * (1 - y * y)
                g.copy_(a.t() @ delta)
                grad_out = delta @ w.t()
                worker.update(h["grad"][i])
                worker.post_local_access(h["bw_act"][i])
                worker.post_read(h["bw_read"][i])
            worker.clock()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        worker.sync()
        stats = worker.stats
    return float(np.median(times[2:])), stats


def pinned_copy_gbps(mib: int = 256, reps: int = 5) -> tuple[float, float]:
    """The baseline swaps are measured against: GB/s of one plain copy of
    `mib` MiB between pinned host memory and the GPU, host -> device and
    device -> host (median of `reps`)."""
    n = mib * 2**20 // 4
    host = torch.empty(n, dtype=torch.float32, pin_memory=True)
    dev = torch.empty(n, dtype=torch.float32, device="cuda")
    rates = []
    for copy in (lambda: dev.copy_(host, non_blocking=True), lambda: host.copy_(dev, non_blocking=True)):
        times = []
        for _ in range(reps + 1):
            torch.cuda.synchronize()
            start = time.perf_counter()
            copy()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        rates.append(n * 4 / float(np.median(times[1:])) / 1e9)
    return rates[0], rates[1]


def torch_run(layers: int, dim: int, batch: int, clocks: int) -> float:
    weights = [torch.randn(dim, dim, device="cuda") / dim**0.5 for _ in range(layers)]
    x0 = torch.randn(batch, dim, device="cuda")
    times = []
    for _ in range(clocks):
        torch.cuda.synchronize()
        start = time.perf_counter()
        x, acts = x0, []
        for w in weights:
            acts.append(x)
            x = torch.tanh(x @ w)
        grad_out = torch.ones_like(x) / x.numel()
        for i in reversed(range(layers)):
            y = torch.tanh(acts[i] @ weights[i])
            delta = grad_out * (1 - y * y)
            weights[i] -= 1e-4 * (acts[i].t() @ delta)
            grad_out = delta @ weights[i].t()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return float(np.median(times[2:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--clocks", type=int, default=12)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    layer_bytes = args.dim * args.dim * 4
    act_bytes = args.batch * args.dim * 4
    total = args.layers * (layer_bytes + act_bytes)
    peak = aligned(layer_bytes) * 2 + aligned(act_bytes)  # backward: weights, gradient, activation
    budget = max(total // 4, 2 * peak)
    print(f"gpu_model_bench {datetime.datetime.now():%Y-%m-%d %H:%M}, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, {platform.node()}")
    print(f"{args.layers} layers of {args.dim}x{args.dim} weights, batch {args.batch}: parameters + local "
          f"data {total / 2**20:.0f} MiB, budget {budget / 2**20:.0f} MiB ({total / budget:.1f}x smaller), "
          f"2 x peak {2 * peak / 2**20:.0f} MiB")
    plain = torch_run(args.layers, args.dim, args.batch, args.clocks)
    free, free_stats = engine_run(args.layers, args.dim, args.batch, args.clocks, budget=0)
    tight, tight_stats = engine_run(args.layers, args.dim, args.batch, args.clocks, budget=budget)
    h2d, d2h = pinned_copy_gbps()
    print(f"pinned copy baseline: host -> device {h2d:.1f} GB/s, device -> host {d2h:.1f} GB/s")
    print(f"{'run':<34} {'ms/clock':>9} {'vs unconstrained':>17} {'vs plain torch':>15} {'stall s':>8} "
          f"{'in MB/clock':>12} {'out MB/clock':>13} {'in GB/s':>8} {'out GB/s':>9}")
    print(f"{'plain PyTorch (all resident)':<34} {plain * 1e3:9.2f} {'':>17} {1.0:15.2f}")
    for name, t, stats in (("engine, unlimited budget", free, free_stats), ("engine, budget = total / 4", tight, tight_stats)):
        # Bytes swapped per clock (the stats count every clock the run made),
        # and the rate they need at the measured time per clock: against the
        # pinned baseline above, the share of PCIe the swaps take.
        clocks = max(int(stats["clock"]), 1)
        swapped_in = stats["bytes_swapped_in"] / clocks
        swapped_out = stats["bytes_swapped_out"] / clocks
        print(f"{name:<34} {t * 1e3:9.2f} {t / free:17.2f} {t / plain:15.2f} {stats['stall_seconds']:8.2f} "
              f"{swapped_in / 1e6:12.1f} {swapped_out / 1e6:13.1f} {swapped_in / t / 1e9:8.2f} "
              f"{swapped_out / t / 1e9:9.2f}")
    print(f"goal: budget run <= 1.4 x unconstrained: {'met' if tight / free <= 1.4 else 'NOT met'} ({tight / free:.2f})")


if __name__ == "__main__":
    main()
