"""CUDA IPC benchmark: update and fresh-row traffic between 2 processes on
one GPU (or, with ``--gpus 2``, one each on GPUs 0 and 1), with CUDA IPC on
and off, as a ratio to the copy bandwidth between their memories measured
in the same run.

    python benchmarks/ipc_bench.py [--sizes 16,64,256] [--clocks 20] [--gpus 1|2] [--tables 1,16]
                                   [--part-mib 0,4] [--ipc-only] [--profile DIR] [--out PATH]

For each model size (MiB; one table of rows of 1024 floats, or with
``--tables K`` K equal tables as a model of layers, plus a tiny one), two
worker processes (tests/python/gpu/cuda_ipc_worker.py --bench, on
127.0.0.1) read every row (slack 0), write a constant update and clock; per
clock each process sends the other's shard its half of the update and that
shard sends it its half of the rows: 2 x model bytes cross between the
processes per clock. Each configuration runs twice, IPC on and off
interleaved (IPC only with ``--ipc-only``); the faster run counts. Rate = 2 x model / seconds per clock
(the slower rank's, after 3 warm-up clocks). Baseline: cudaMemcpy device ->
device (torch copy_) of model bytes on the same GPU in this process, or with
two GPUs from GPU 0 to GPU 1 (cudaMemcpyPeer: NVLink where present), best of
20. Ratio = rate / baseline: 1.0 means the clock moves its cross-process
bytes as fast as one copy engine pass moves them on the card; the goal is
>= 0.8. The clock's own work (gathers, the update rule, installs) counts
against the ratio, as it does in training.

Prints a markdown table; --out writes it with the GPU's name. ``--profile
DIR`` instead runs the first setting once more under torch.profiler and
writes each rank's Chrome trace of its timed clocks to DIR (CUPTI records
every kernel and copy of the process, the engine's included; the two ranks'
timestamps share one clock, so their traces can be merged). The profiler's
start makes the reported time per clock meaningless; read the traces
(``trace_timeline.py DIR/rank-0.trace.json DIR/rank-1.trace.json --marker
aten::fill_ --per-clock K``, K = the tables plus one).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

WORKER = Path(__file__).resolve().parent.parent / "tests" / "python" / "gpu" / "cuda_ipc_worker.py"
WIDTH = 1024


def run_pair(size_mib: int, clocks: int, cuda_ipc: bool, timeout_s: float, gpus: int, tables: int,
             part_mib: float | None = None, profile: Path | None = None) -> dict:
    sys.path.insert(0, str(WORKER.parent))
    from ipc_pair import launch_pair

    rows = size_mib * (1 << 20) // (4 * WIDTH)
    with tempfile.TemporaryDirectory() as out:
        codes, outputs = launch_pair(
            Path(out), cuda_ipc, ["--bench", "--clocks", str(clocks), "--rows", str(rows), "--width", str(WIDTH),
                                  "--tables", str(tables)]
            + ([] if part_mib is None else ["--part-bytes", str(int(part_mib * (1 << 20)))])
            + ([] if profile is None else ["--profile", str(profile)]),
            timeout_s=timeout_s, gpus=gpus,
            env={"MLTUNER_CUDA_IPC_SLICE_BYTES": str(max(256 << 20, 4 * size_mib << 20))})
        if any(code != 0 for code in codes):
            raise RuntimeError("a worker failed:\n" + "\n".join(outputs))
        reports = [json.loads((Path(out) / f"rank-{r}.json").read_text()) for r in range(2)]
    return {"seconds": max(r["seconds_per_clock"] for r in reports), "paths": [r["data_paths"] for r in reports],
            "stats": [r["stats"] for r in reports]}


def memcpy_bandwidth(nbytes: int, gpus: int) -> float:
    """Bytes a second of one copy of ``nbytes`` from GPU 0 to GPU gpus - 1."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda:0").fill_(1.0)
    dst = torch.empty_like(src, device=f"cuda:{gpus - 1}")
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(20):
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(src.device)
        torch.cuda.synchronize(dst.device)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="16,64,256", help="model sizes in MiB")
    parser.add_argument("--clocks", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--gpus", type=int, choices=(1, 2), default=1, help="both ranks on GPU 0, or one per GPU")
    parser.add_argument("--ipc-only", action="store_true", help="skip the host-frame runs (slow at large sizes)")
    parser.add_argument("--tables", default="1", help="comma list of table counts: the model as each many equal tables")
    parser.add_argument("--part-mib", help="comma list of Config.clock_part_bytes in MiB to compare (0: each "
                        "shard's rows whole; default: Config's)")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="profile one more IPC run of the first setting instead: torch.profiler traces "
                        "(CUPTI: the engine's copies and kernels too) of each rank's timed clocks in DIR")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    part_settings = [None] if args.part_mib is None else [float(p) for p in args.part_mib.split(",")]
    import torch

    if torch.cuda.device_count() < args.gpus:
        parser.error(f"--gpus {args.gpus}: this machine shows {torch.cuda.device_count()} GPU(s)")
    if args.profile:
        size, tables = int(args.sizes.split(",")[0]), int(args.tables.split(",")[0])
        run = run_pair(size, args.clocks, True, args.timeout, args.gpus, tables, part_settings[0], args.profile)
        print(f"profiled {size} MiB in {tables} table(s): {run['seconds'] * 1e3:.3f} ms a clock; traces in "
              f"{args.profile}", flush=True)
        return 0
    gpu = torch.cuda.get_device_name(0)
    where = "GPU 0" if args.gpus == 1 else "GPUs 0 and 1, one each"
    copy = "same-device" if args.gpus == 1 else "GPU 0 -> GPU 1"
    lines = [f"CUDA IPC benchmark on {gpu}: 2 processes on {where}, update + fresh-row traffic per clock; "
             f"baseline: {copy} copy_", "",
             "| model MiB | tables | parts of MiB | memcpy GB/s | IPC s/clock | IPC GB/s | IPC ratio | host s/clock | "
             "host GB/s | host ratio | IPC / host speed | IPC bytes (rank 0) | host-frame bytes (rank 0) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for size, tables in itertools.product((int(s) for s in args.sizes.split(",")),
                                          (int(k) for k in args.tables.split(","))):
        baseline = memcpy_bandwidth(size << 20, args.gpus)
        best: dict[tuple[float | None, bool], dict] = {}
        for _ in range(2):  # every setting twice, alternated; the faster run counts
            for part_mib in part_settings:
                for cuda_ipc in (True,) if args.ipc_only else (True, False):
                    run = run_pair(size, args.clocks, cuda_ipc, args.timeout, args.gpus, tables, part_mib)
                    key = (part_mib, cuda_ipc)
                    if key not in best or run["seconds"] < best[key]["seconds"]:
                        best[key] = run
        traffic = 2 * (size << 20)
        for part_mib in part_settings:
            on, off = best[(part_mib, True)], best.get((part_mib, False))
            if on["paths"][0].get("1") != "cuda-ipc":
                print(f"warning: IPC run took {on['paths']}", flush=True)
            host = (f"{off['seconds']:.5f} | {traffic / off['seconds'] / 1e9:.1f} | "
                    f"{traffic / off['seconds'] / baseline:.2f} | {off['seconds'] / on['seconds']:.2f}"
                    if off else "- | - | - | -")
            parts = "default" if part_mib is None else f"{part_mib:g}"
            line = (f"| {size} | {tables} | {parts} | {baseline / 1e9:.1f} | {on['seconds']:.5f} | "
                    f"{traffic / on['seconds'] / 1e9:.1f} | {traffic / on['seconds'] / baseline:.2f} | {host} | "
                    f"{on['stats'][0]['cuda_ipc_sent_bytes']} | {on['stats'][0]['device_payload_bytes_by_host']} |")
            lines.append(line)
            print(line, flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
