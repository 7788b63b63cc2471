"""One process of the CUDA IPC test and benchmark (run as a program, one per rank).

Joins the job of the MLTUNER_* variables with a CUDA engine (both ranks on
GPU MLTUNER_LOCAL_RANK, so two processes may share one GPU), trains two
tables under BSP with updates that depend on what was read, and writes to
OUT/rank-R.npz the values read each clock and the final values, and to
OUT/rank-R.json the data paths chosen per peer, the transport counters, and
with --bench the seconds per clock after a warm-up. CUDA IPC follows
MLTUNER_CUDA_IPC (set by the caller). Prints one line per fact, so the
caller's output tells which path was taken and why.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

import mltuner


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--clocks", type=int, default=10)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--bench", action="store_true", help="constant updates, no host reads: time the traffic")
    parser.add_argument("--tables", type=int, default=1, help="--rows split into this many equal tables")
    parser.add_argument("--part-bytes", type=int, help="Config.clock_part_bytes (default: Config's)")
    parser.add_argument("--profile", type=Path, help="write a torch.profiler trace of the timed clocks here")
    args = parser.parse_args()
    parts = {} if args.part_bytes is None else {"clock_part_bytes": args.part_bytes}
    config = mltuner.Config(device="cuda", wait_timeout_s=60, update_rule=mltuner.UpdateRule("sgd", learning_rate=0.01),
                            **parts)
    try:
        # A table's half may exceed the sockets' default frame (ipc_bench's 1-GiB model): a payload
        # that finds its CUDA IPC slice full still needs the host path.
        with mltuner.Job(config, max_message_bytes=max(256 << 20, args.rows * args.width * 4)) as job:
            torch.cuda.set_device(job.local_rank % torch.cuda.device_count())  # the engine's GPU (ipc_pair's gpus)
            print(f"rank {job.rank}: data paths {job.data_paths}", flush=True)
            result = _train(job, args)
            stats = job.transport_stats
            print(f"rank {job.rank}: transport stats {stats}", flush=True)
            job.barrier("done")
            np.savez(args.out / f"rank-{job.rank}.npz", **result.pop("arrays"))
            (args.out / f"rank-{job.rank}.json").write_text(json.dumps(
                {"data_paths": {str(k): v for k, v in job.data_paths.items()},
                 "peers_by_cuda_ipc": job.worker.peers_by_cuda_ipc, "stats": stats,
                 "same_device_peers": job._node.cuda_ipc_same_device_peers,
                 "messages_received": job.worker.stats["messages_received"], **result}))
    except mltuner.MltunerError as error:
        print(f"FAILED {type(error).__name__}: {error}", flush=True)
        return 3
    return 0


def _train(job: mltuner.Job, args: argparse.Namespace) -> dict:
    worker = job.worker
    # As a model of layers: each table's update leaves, is applied and
    # comes back on its own (the last of them is "big" for the reports).
    parts = [worker.create_table(f"big-{k}", args.rows // args.tables, args.width) for k in range(args.tables - 1)]
    big = worker.create_table("big", args.rows - (args.tables - 1) * (args.rows // args.tables), args.width)
    small = worker.create_table("small", 7, 5)
    tables = [*parts, big, small]
    reads = [worker.virtual_read(t, slack=0) for t in tables]
    updates = []
    for t in reversed(tables):
        updates.append(worker.virtual_pre_update(t))
        worker.virtual_update(updates[-1])
    for h in reads:
        worker.virtual_post_read(h)
    worker.virtual_clock()
    worker.finish_virtual_iteration()
    if worker.rank == 0:
        for i, (h, t) in enumerate(zip(updates, reversed(tables))):
            init = np.random.default_rng(7 + i).normal(size=(t.num_rows, t.row_width)).astype(np.float32)
            torch.from_dlpack(worker.pre_update(h)).copy_(torch.from_numpy(init))
            worker.update(h)
    worker.start_iterations()
    seen = []
    started = 0.0
    warmup = min(3, args.clocks - 1)
    profiler = None
    for clock in range(args.clocks):
        if clock == warmup:
            torch.cuda.synchronize()
            started = time.perf_counter()
            if args.profile:  # CUPTI sees the engine's copies and kernels too: one process, one context
                profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                              torch.profiler.ProfilerActivity.CUDA])
                profiler.start()
        weights = [torch.from_dlpack(worker.read(h)) for h in reads]
        for i, h in enumerate(updates):
            target = torch.from_dlpack(worker.pre_update(h))
            source = weights[len(tables) - 1 - i]
            if args.bench:
                target.fill_(1e-3)
            else:  # depends on what was read, the rank and the clock: a wrong byte anywhere shows
                target.copy_(torch.sin(source * 0.37 + 0.1 * clock + worker.rank) * 0.01)
            worker.update(h)
        if not args.bench:
            seen.append(weights[0].cpu().numpy().copy())
        for h in reads:
            worker.post_read(h)
        worker.clock()
    worker.sync()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - started) / max(args.clocks - warmup, 1)
    if profiler is not None:
        profiler.stop()
        args.profile.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(args.profile / f"rank-{worker.rank}.trace.json"))
    arrays = {"final_big": worker.fetch(big), "final_small": worker.fetch(small)}
    if seen:
        arrays["seen"] = np.stack(seen)
    return {"arrays": arrays, "seconds_per_clock": seconds, "rows": args.rows, "width": args.width}


if __name__ == "__main__":
    sys.exit(main())
