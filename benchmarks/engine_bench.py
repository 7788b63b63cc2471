"""Engine micro-benchmark: gather (read) and scatter-add (update) throughput,
and the time per clock of a 20-layer virtual-iteration cycle, each stated as a
ratio to a baseline measured side by side in the same run.

    python benchmarks/engine_bench.py [--quick] [--csv PATH] [--figures PATH]
                                      [--sizes 1,16,64,256] [--widths 128,512,1024,4096]
                                      [--no-device-bench | --device-bench PATH]

Three parts:

1. Device kernels (C++, no Python): benchmarks/device_bench.cc times the CPU
   backend's Gather and ScatterAdd over prebuilt RunIndex lists against
   std::memcpy and an ``a += b`` loop. Built with CMake into build/bench when
   cmake is available, otherwise skipped with a message.
2. Engine read / update paths (Python API, 1-worker LocalCluster, update rule
   "add"): one table read whole (slack 0) and updated whole every clock. Three
   runs per cell: read only, update only, and both (the full cycle). The
   baselines are numpy's ``np.copyto(dst, src)`` (reads) and ``dst += src``
   (updates) over the same bytes.
3. A 20-layer model: forward reads of each layer in order, then backward
   pre_update/update/post_read in reverse order, then clock (GeePS's Caffe
   mapping). Time per clock for 1 and 2 workers, with an unlimited device
   budget and with one that keeps only ~1/4 of the parameters device-resident.
   The baseline moves the same bytes with numpy (copy each layer into a read
   buffer, add a gradient buffer into an accumulator) in the same process.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

import mltuner as mt
from figures import Figure, spread, write_figures
from machine import cpu_name

REPO = Path(__file__).resolve().parent.parent
BUILD_DIR = REPO / "build" / "bench"
MB = 1 << 20
BUFFER_ALIGNMENT = 256  # the engine rounds every access buffer up to this (placement.cc)
GOAL = 0.70  # issue goal: gather and scatter-add at >= 70% of memcpy bandwidth


# -- summary rows ---------------------------------------------------------------
@dataclass
class Result:
    section: str
    case: str
    size_mb: float
    width: int
    value: float
    unit: str
    baseline: float
    baseline_name: str
    ratio: float
    ratio_meaning: str
    goal: str = ""
    extra: dict[str, object] = field(default_factory=dict)


RESULTS: list[Result] = []


def goal_mark(ratio: float) -> str:
    return "yes" if ratio >= GOAL else "NO"


# -- machine ----------------------------------------------------------------------
def header(args: argparse.Namespace) -> str:
    return (
        f"mltuner engine micro-benchmark, {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}\n"
        f"machine: {cpu_name()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, numpy {np.__version__}, mltuner {mt.__version__}\n"
        f"mode: {'quick' if args.quick else 'full'}; sizes {args.sizes} MB; widths {args.widths} floats"
    )


# -- timing helpers ----------------------------------------------------------------
def best_time(fn: Callable[[], object], min_time: float, min_reps: int = 5) -> float:
    """Best (smallest) time of one call of fn, after one warm-up call."""
    fn()
    best, total, reps = float("inf"), 0.0, 0
    while reps < min_reps or total < min_time:
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        best = min(best, elapsed)
        total += elapsed
        reps += 1
    return best


def numpy_baselines(nbytes: int, min_time: float) -> tuple[float, float]:
    """Best time of np.copyto and of dst += src over nbytes of float32."""
    n = nbytes // 4
    src = np.full(n, 0.5, dtype=np.float32)
    dst = np.ones(n, dtype=np.float32)
    t_copy = best_time(lambda: np.copyto(dst, src), min_time)
    t_add = best_time(lambda: np.add(dst, src, out=dst), min_time)
    return t_copy, t_add


# -- part 1: device kernels (C++) -------------------------------------------------
def build_device_bench() -> Path | None:
    if shutil.which("cmake") is None:
        print("device_bench: cmake not found; skipping the C++ kernel benchmark.")
        return None
    exe = BUILD_DIR / "device_bench"
    steps = []
    if not (BUILD_DIR / "CMakeCache.txt").exists():
        steps.append(["cmake", "-S", str(REPO / "benchmarks"), "-B", str(BUILD_DIR), "-DCMAKE_BUILD_TYPE=Release"])
    steps.append(["cmake", "--build", str(BUILD_DIR), "--target", "device_bench", "-j", str(os.cpu_count() or 2)])
    print(f"device_bench: building in {BUILD_DIR} (first build compiles the engine, ~30 s) ...", flush=True)
    for step in steps:
        proc = subprocess.run(step, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            print(f"device_bench: build failed ({' '.join(step)}); skipping the C++ kernel benchmark.\n{tail}")
            return None
    return exe if exe.exists() else None


def run_device_bench(exe: Path, sizes: list[int], widths: list[int], min_time: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        csv_path = Path(tmp) / "device.csv"
        cmd = [str(exe), "--sizes", ",".join(map(str, sizes)), "--widths", ",".join(map(str, widths)),
               "--min-time", str(min_time), "--csv", str(csv_path)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        print(proc.stdout, end="")
        if proc.returncode != 0:
            print(f"device_bench exited with {proc.returncode}: {proc.stderr.strip()}")
            return
        with open(csv_path) as f:
            rows = list(csv.DictReader(f))
    memcpy = {(r["table_mb"], r["width"]): r for r in rows if r["op"] == "memcpy"}
    for r in rows:
        if r["index"] == "baseline":
            continue
        base = memcpy[(r["table_mb"], r["width"])]
        ratio = float(r["x_memcpy"])
        RESULTS.append(Result(
            "kernel", f"{r['op']} ({r['index']}, {r['runs']} runs)", float(r["table_mb"]), int(r["width"]),
            float(r["payload_gbps"]), "GB/s", float(base["payload_gbps"]), "memcpy GB/s", ratio,
            "op/memcpy (payload)", goal_mark(ratio),
            {"moved_ratio": float(r["x_memcpy_moved"]), "x_add": float(r["x_add"])},
        ))


# -- part 2: engine read / update paths ------------------------------------------
def run_engine_mode(num_rows: int, width: int, mode: str, target_s: float) -> dict[str, float]:
    """Per-clock time of a 1-worker cluster whose iteration reads and/or updates
    one whole table; mode is 'read', 'update' or 'full'."""
    config = mt.Config(update_rule=mt.UpdateRule("add"))
    with mt.LocalCluster(1, config) as cluster:
        worker = cluster.workers[0]
        table = worker.create_table("t", num_rows, width)
        do_read, do_update = mode in ("read", "full"), mode in ("update", "full")
        read = update = -1
        if do_read:
            read = worker.virtual_read(table, slack=0)
            worker.virtual_post_read(read)
        if do_update:
            update = worker.virtual_pre_update(table)
            worker.virtual_update(update)
        worker.virtual_clock()
        worker.finish_virtual_iteration()
        worker.start_iterations()

        def clocks(k: int) -> None:
            for _ in range(k):
                if do_read:
                    worker.read(read)
                    worker.post_read(read)
                if do_update:
                    worker.pre_update(update)
                    worker.update(update)
                worker.clock()

        clocks(2)  # warm-up: first-touch page faults, thread start
        start = time.perf_counter()
        clocks(1)
        one = time.perf_counter() - start
        # Three segments of k clocks; the best segment gives the time per
        # clock (other processes on a 2-core machine only ever add time).
        k = int(min(200, max(2, target_s / 3 / max(one, 1e-6))))
        before = worker.stats
        segments = []
        for _ in range(3):
            start = time.perf_counter()
            clocks(k)
            segments.append(time.perf_counter() - start)
        after = worker.stats
    elapsed = sum(segments)
    delta = {name: float(after[name]) - float(before[name]) for name in after}
    k_total = 3 * k
    return {
        "clock_s": min(segments) / k,
        "clocks": k_total,
        "stall_frac": delta["stall_seconds"] / elapsed,
        "fresh_wait_frac": delta["wait_fresh_seconds"] / elapsed,
        "gathered_per_clock": delta["bytes_gathered"] / k_total,
        "scattered_per_clock": delta["bytes_scattered"] / k_total,
    }


def bench_engine(sizes: list[int], widths: list[int], target_s: float, numpy_min_time: float) -> None:
    print("\n== Engine read / update paths (1 worker, update rule 'add', slack 0, Python API) ==")
    print("Each cell runs three clusters: read only (read + post_read + clock), update only (pre_update +\n"
          "update + clock) and both. GB/s = table bytes / time per clock. Baselines in the same run:\n"
          "np.copyto(dst, src) for reads and dst += src for updates over the same bytes (best of several).\n"
          "A read clock includes the allocator's gather and the slack-0 wait for the clock's round trip to\n"
          "the server; an update clock includes zeroing the buffer, the scatter-add into the update log,\n"
          "copying the log into a message, the server applying it and the fresh rows' install into the cache.\n"
          "stall% = share of the clock the application waited for a buffer (worker.stats).")
    hdr = (f"{'MB':>4} {'width':>5} {'rows':>7} | {'read ms':>8} {'GB/s':>6} {'x copy':>6} | "
           f"{'upd ms':>8} {'GB/s':>6} {'x +=':>6} | {'full ms':>8} {'x c+a':>6} {'stall%':>6} | "
           f"{'np copy':>7} {'np +=':>6} GB/s")
    print(hdr)
    print("-" * len(hdr))
    for size_mb in sizes:
        for width in widths:
            num_rows = size_mb * MB // (4 * width)
            if num_rows < 1:
                continue
            nbytes = num_rows * width * 4
            t_copy, t_add = numpy_baselines(nbytes, numpy_min_time)
            res = {mode: run_engine_mode(num_rows, width, mode, target_s) for mode in ("read", "update", "full")}
            gc.collect()
            # The counters must show the bytes the figures are computed from
            # (within two clocks: the allocator runs ahead, the reclaimer behind).
            for mode, key in (("read", "gathered_per_clock"), ("update", "scattered_per_clock")):
                tolerance = 2 * nbytes / res[mode]["clocks"]
                if abs(res[mode][key] * res[mode]["clocks"] - nbytes * res[mode]["clocks"]) > tolerance:
                    print(f"warning: {mode} run moved {res[mode][key]:.0f} bytes per clock by the engine's "
                          f"counters, expected {nbytes}")
            r_s, u_s, f_s = res["read"]["clock_s"], res["update"]["clock_s"], res["full"]["clock_s"]
            x_read, x_upd, x_full = t_copy / r_s, t_add / u_s, (t_copy + t_add) / f_s
            print(f"{size_mb:>4} {width:>5} {num_rows:>7} | {r_s * 1e3:>8.3f} {nbytes / r_s / 1e9:>6.2f} "
                  f"{x_read:>6.2f} | {u_s * 1e3:>8.3f} {nbytes / u_s / 1e9:>6.2f} {x_upd:>6.2f} | "
                  f"{f_s * 1e3:>8.3f} {x_full:>6.2f} {100 * res['full']['stall_frac']:>6.1f} | "
                  f"{nbytes / t_copy / 1e9:>7.2f} {nbytes / t_add / 1e9:>6.2f}", flush=True)
            RESULTS.append(Result("engine", "read (gather) path", size_mb, width, nbytes / r_s / 1e9, "GB/s",
                                  nbytes / t_copy / 1e9, "np.copyto GB/s", x_read, "engine/numpy",
                                  goal_mark(x_read), {"clocks": res["read"]["clocks"]}))
            RESULTS.append(Result("engine", "update (scatter-add) path", size_mb, width, nbytes / u_s / 1e9,
                                  "GB/s", nbytes / t_add / 1e9, "np += GB/s", x_upd, "engine/numpy",
                                  goal_mark(x_upd), {"clocks": res["update"]["clocks"]}))
            RESULTS.append(Result("engine", "read+update clock", size_mb, width, f_s * 1e3, "ms/clock",
                                  (t_copy + t_add) * 1e3, "copy+add ms", x_full, "numpy/engine time",
                                  "", {"stall_frac": res["full"]["stall_frac"]}))


# -- part 3: the 20-layer model cycle ---------------------------------------------
def aligned(nbytes: int) -> int:
    return (nbytes + BUFFER_ALIGNMENT - 1) // BUFFER_ALIGNMENT * BUFFER_ALIGNMENT


def model_peak_bytes(layers: int, layer_bytes: int) -> int:
    """Largest set of buffers open at once in the recorded op order (as the
    engine's placement computes it): forward reads stay open until backward."""
    ops = [("open", layer_bytes) for _ in range(layers)]
    for _ in range(layers):
        ops += [("open", layer_bytes), ("close", layer_bytes), ("close", layer_bytes)]
    open_bytes = peak = 0
    for kind, nbytes in ops:
        open_bytes += aligned(nbytes) if kind == "open" else -aligned(nbytes)
        peak = max(peak, open_bytes)
    return peak


def run_model(workers: int, layers: int, rows: int, width: int, budget: int, target_s: float) -> dict[str, float]:
    config = mt.Config(device_memory_budget=budget, update_rule=mt.UpdateRule("add"))
    with mt.LocalCluster(workers, config) as cluster:
        handles = []
        for worker in cluster.workers:
            tables = [worker.create_table(f"layer{i}", rows, width) for i in range(layers)]
            reads = [worker.virtual_read(t, slack=0) for t in tables]
            updates = [0] * layers
            for i in reversed(range(layers)):
                updates[i] = worker.virtual_pre_update(tables[i])
                worker.virtual_update(updates[i])
                worker.virtual_post_read(reads[i])
            worker.virtual_clock()
            handles.append((reads, updates))
        # finish_virtual_iteration checks the tables with every shard, so all
        # workers must have created theirs first; finish them concurrently.
        finishers = [threading.Thread(target=w.finish_virtual_iteration, daemon=True) for w in cluster.workers]
        for t in finishers:
            t.start()
        for t in finishers:
            t.join()
        plans = [w.plan for w in cluster.workers]

        def clocks(worker: mt.Worker, k: int) -> None:
            reads, updates = handles[worker.rank]
            for _ in range(k):
                for h in reads:
                    worker.read(h)
                for i in reversed(range(layers)):
                    worker.pre_update(updates[i])
                    worker.update(updates[i])
                    worker.post_read(reads[i])
                worker.clock()

        errors: list[BaseException] = []
        per_worker: list[dict[str, float]] = [{} for _ in range(workers)]
        k_shared: list[int] = []
        barrier = threading.Barrier(workers)

        def body(worker: mt.Worker) -> None:
            try:
                worker.start_iterations()
                clocks(worker, 3)  # warm-up
                barrier.wait()
                start = time.perf_counter()
                clocks(worker, 2)
                barrier.wait()
                if worker.rank == 0:
                    one = (time.perf_counter() - start) / 2
                    k_shared.append(int(min(400, max(3, target_s / 3 / max(one, 1e-6)))))
                barrier.wait()
                k = k_shared[0]
                before = worker.stats
                segments = []
                for _ in range(3):
                    barrier.wait()
                    start = time.perf_counter()
                    clocks(worker, k)
                    segments.append(time.perf_counter() - start)
                after = worker.stats
                per_worker[worker.rank] = {
                    "elapsed": sum(segments), "segments": segments, "clocks": 3 * k,
                    "stall": float(after["stall_seconds"]) - float(before["stall_seconds"]),
                    "swapped_in": float(after["bytes_swapped_in"]) - float(before["bytes_swapped_in"]),
                    "swapped_out": float(after["bytes_swapped_out"]) - float(before["bytes_swapped_out"]),
                }
            except BaseException as error:  # re-raised below
                errors.append(error)
                barrier.abort()
                cluster.shutdown()

        threads = [threading.Thread(target=body, args=(w,), daemon=True) for w in cluster.workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
    k = per_worker[0]["clocks"]
    # Best segment; a segment lasts as long as its slowest worker.
    best = min(max(p["segments"][i] for p in per_worker) for i in range(3))
    return {
        "clock_s": best / (k // 3),
        "clocks": k,
        "stall_frac": sum(p["stall"] for p in per_worker) / sum(p["elapsed"] for p in per_worker),
        "swapped_in_per_clock": per_worker[0]["swapped_in"] / k,
        "swapped_out_per_clock": per_worker[0]["swapped_out"] / k,
        "plan": plans[0],
    }


def numpy_model_clock(workers: int, layers: int, rows: int, width: int, min_time: float) -> float:
    """Time per clock of the same bytes moved by numpy: copy each layer's
    params into a read buffer (forward), add each layer's gradient into an
    accumulator (backward, reverse order); one thread per worker."""
    def make() -> tuple[list[np.ndarray], ...]:
        params = [np.full((rows, width), 0.5, np.float32) for _ in range(layers)]
        bufs = [np.empty((rows, width), np.float32) for _ in range(layers)]
        grads = [np.full((rows, width), 1e-3, np.float32) for _ in range(layers)]
        accs = [np.zeros((rows, width), np.float32) for _ in range(layers)]
        return params, bufs, grads, accs

    sets = [make() for _ in range(workers)]

    def one_clock(s: tuple[list[np.ndarray], ...]) -> None:
        params, bufs, grads, accs = s
        for i in range(layers):
            np.copyto(bufs[i], params[i])
        for i in reversed(range(layers)):
            np.add(accs[i], grads[i], out=accs[i])

    if workers == 1:
        return best_time(lambda: one_clock(sets[0]), min_time)

    # One thread per worker, each running k clocks on its own arrays (like the
    # engine's worker threads); wall time / k, best of 3.
    start = time.perf_counter()
    one_clock(sets[0])
    k = int(max(5, min_time / max(time.perf_counter() - start, 1e-6)))

    def run_k(s: tuple[list[np.ndarray], ...]) -> None:
        for _ in range(k):
            one_clock(s)

    best = float("inf")
    for _ in range(3):
        threads = [threading.Thread(target=run_k, args=(s,)) for s in sets]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        best = min(best, (time.perf_counter() - start) / k)
    return best


def bench_model(layers: int, rows: int, width: int, target_s: float, numpy_min_time: float) -> None:
    layer_bytes = rows * width * 4
    params = layers * layer_bytes
    peak = model_peak_bytes(layers, layer_bytes)
    # The pool needs 2 x peak; each device-resident parameter row also costs
    # its cache row and its update-log row, so this budget keeps about 1/4 of
    # the parameters on the device and swaps the rest from host memory.
    budget = 2 * peak + 2 * (params // 4)
    print(f"\n== {layers}-layer model: time per clock of the full virtual-iteration cycle ==")
    print(f"{layers} layers x {rows} rows x {width} floats = {layer_bytes / MB:.3f} MB per layer, "
          f"{params / MB:.2f} MB of parameters.\n"
          f"Forward: read (slack 0) each layer in order; backward, in reverse order: pre_update, update,\n"
          f"post_read of each layer; then clock. Reads stay open through the forward pass, so the peak set of\n"
          f"open buffers is {peak / MB:.2f} MB (all reads + one update buffer); the limited budget is\n"
          f"2 x peak (pool) + cache and log rows for 1/4 of the parameters = {budget / MB:.2f} MB.\n"
          f"Baseline: numpy moves the same bytes per worker (np.copyto of each layer into a read buffer,\n"
          f"+= of a gradient into an accumulator), one thread per worker, same process.\n"
          f"x numpy = engine time per clock / numpy time per clock (lower is better; 1.0 = as fast as numpy).")
    hdr = (f"{'workers':>7} {'budget':>10} | {'ms/clock':>9} {'numpy ms':>9} {'x numpy':>8} | "
           f"{'stall%':>6} {'swap-in MB/clk':>14} {'clocks':>6}")
    print(hdr)
    print("-" * len(hdr))
    for workers in (1, 2):
        t_numpy = numpy_model_clock(workers, layers, rows, width, numpy_min_time)
        for label, b in (("unlimited", 0), (f"{budget / MB:.1f} MB", budget)):
            res = run_model(workers, layers, rows, width, b, target_s)
            gc.collect()
            ratio = res["clock_s"] / t_numpy
            print(f"{workers:>7} {label:>10} | {res['clock_s'] * 1e3:>9.3f} {t_numpy * 1e3:>9.3f} {ratio:>8.2f} | "
                  f"{100 * res['stall_frac']:>6.1f} {res['swapped_in_per_clock'] / MB:>14.2f} {res['clocks']:>6}",
                  flush=True)
            RESULTS.append(Result(
                "model", f"{layers}-layer cycle, {workers} worker(s), budget {label}", params / MB, width,
                res["clock_s"] * 1e3, "ms/clock", t_numpy * 1e3, "numpy ms/clock", ratio, "engine/numpy time",
                "", {"stall_frac": res["stall_frac"], "swapped_in_per_clock": res["swapped_in_per_clock"],
                     "plan": res["plan"]},
            ))


# -- summary -------------------------------------------------------------------------
def print_summary() -> None:
    print("\n== Summary (every figure against a baseline measured in this run) ==")
    print(f"goal: gather and scatter-add >= {GOAL:.0%} of memcpy bandwidth for rows of 512 B and up "
          f"(all widths here are >= 128 floats = 512 B).\n"
          f"kernel ratios are op/memcpy on payload bytes (scatter-add's moved-bytes ratio is 1.5x that);\n"
          f"engine read/update ratios are engine GB/s / numpy GB/s; the engine 'read+update clock' row is\n"
          f"numpy time / engine time; model rows are engine time / numpy time (slowdown, lower is better).")
    hdr = (f"{'section':<7} {'case':<44} {'MB':>7} {'width':>5} | {'value':>9} {'unit':<8} | "
           f"{'baseline':>9} {'':<15} | {'ratio':>6} {'goal':>4}")
    print(hdr)
    print("-" * len(hdr))
    for r in RESULTS:
        print(f"{r.section:<7} {r.case:<44} {r.size_mb:>7.4g} {r.width:>5} | {r.value:>9.3f} {r.unit:<8} | "
              f"{r.baseline:>9.3f} {r.baseline_name:<15} | {r.ratio:>6.2f} {r.goal:>4}")
    for section in ("kernel", "engine"):
        marked = [r for r in RESULTS if r.section == section and r.goal]
        if marked:
            met = sum(r.goal == "yes" for r in marked)
            print(f"{section}: {met} of {len(marked)} gather/scatter-add figures meet the {GOAL:.0%} goal")


def headline_figures() -> list[Figure]:
    """The suite's figures: per kind of row, the median ratio over every
    table size and row width, and their range."""
    groups: dict[tuple[str, str], list[Result]] = {}
    for r in RESULTS:
        case = re.sub(r", \d+ runs\)", ")", r.case)  # kernel cases name their run count per width
        groups.setdefault((r.section, case), []).append(r)
    figures = []
    for (section, case), rows in groups.items():
        ratios = [r.ratio for r in rows]
        better = "lower" if rows[0].ratio_meaning == "engine/numpy time" else "higher"
        goal = GOAL if rows[0].goal else None
        cells = f"median of {len(rows)} size x width cells"
        figures.append(Figure(
            "engine", f"{section}: {case}", statistics.median(r.value for r in rows), rows[0].unit,
            rows[0].baseline_name, statistics.median(r.baseline for r in rows), statistics.median(ratios),
            rows[0].ratio_meaning, better, goal, cells if len(rows) > 1 else "", spread(ratios)))
    return figures


def write_csv(path: str, head: str) -> None:
    with open(path, "w", newline="") as f:
        for line in head.splitlines():
            f.write(f"# {line}\n")
        writer = csv.writer(f)
        writer.writerow(["section", "case", "size_mb", "width", "value", "unit", "baseline", "baseline_name",
                         "ratio", "ratio_meaning", "goal", "extra"])
        for r in RESULTS:
            extra = ";".join(f"{k}={v}" for k, v in r.extra.items() if k != "plan")
            writer.writerow([r.section, r.case, r.size_mb, r.width, f"{r.value:.6g}", r.unit, f"{r.baseline:.6g}",
                             r.baseline_name, f"{r.ratio:.4f}", r.ratio_meaning, r.goal, extra])
    print(f"wrote {path}")


def parse_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes and short timings (< 40 s)")
    parser.add_argument("--csv", metavar="PATH", help="also write every summary figure to PATH")
    parser.add_argument("--figures", metavar="PATH", help="write the headline figures for the suite (JSON)")
    parser.add_argument("--sizes", type=parse_list, help="table sizes in MB (default 1,16,64,256; quick 1,16)")
    parser.add_argument("--widths", type=parse_list, help="row widths in floats (default 128,512,1024,4096)")
    parser.add_argument("--layers", type=int, default=20, help="layers of the model cycle (default 20)")
    parser.add_argument("--layer-rows", type=int, help="rows per layer (default 256; quick 64) of 512 floats")
    parser.add_argument("--no-device-bench", action="store_true", help="skip the C++ kernel benchmark")
    parser.add_argument("--device-bench", metavar="PATH", help="use this device_bench binary instead of building")
    args = parser.parse_args()
    if args.sizes is None:
        args.sizes = [1, 16] if args.quick else [1, 16, 64, 256]
    if args.widths is None:
        args.widths = [128, 512, 1024, 4096]
    layer_rows = args.layer_rows or (64 if args.quick else 256)
    # Seconds per measurement: engine mode runs, numpy baselines, C++ kernels.
    engine_target, numpy_min, kernel_min = (0.1, 0.05, 0.03) if args.quick else (0.3, 0.15, 0.12)
    model_target = 0.4 if args.quick else 1.0

    head = header(args)
    print(head)
    start = time.perf_counter()

    print("\n== Device kernels: Gather / ScatterAdd of the CPU backend (C++, no Python) ==")
    exe = None
    if args.device_bench:
        exe = Path(args.device_bench)
    elif not args.no_device_bench:
        exe = build_device_bench()
    else:
        print("skipped (--no-device-bench)")
    if exe is not None:
        run_device_bench(exe, args.sizes, args.widths, kernel_min)

    bench_engine(args.sizes, args.widths, engine_target, numpy_min)
    bench_model(args.layers, layer_rows, 512, model_target, numpy_min)
    print_summary()
    print(f"\ntotal {time.perf_counter() - start:.1f} s")
    if args.csv:
        write_csv(args.csv, head)
    write_figures(args.figures, headline_figures())
    return 0


if __name__ == "__main__":
    sys.exit(main())
