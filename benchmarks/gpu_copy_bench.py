"""The CUDA backend's data movement against the GPU's own copy ceilings, as
headline figures for the suite: builds ``device_bench`` (benchmarks/
CMakeLists.txt, CUDA on) and runs ``device_bench --device cuda`` (see
benchmarks/cuda_bench.cc and docs/gpu_benchmarks.md for the method).

    python benchmarks/gpu_copy_bench.py [--sizes 64,256] [--cuda-arch 90] [--out PATH] [--figures PATH]

Ceilings, measured in the same run: device-to-device cudaMemcpy of 1 GiB
(gather, scatter-add), pinned host-to-device and device-to-host cudaMemcpy
of 1 GiB (swap-in, swap-out: per-run copies, and the engine's one kernel per
access on mapped pinned memory, ``swap-in-kernel`` / ``swap-out-kernel``). Each figure is the median ratio over table
sizes and row widths of one operation and index shape, with their range.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
from pathlib import Path

from figures import Figure, spread, write_figures

REPO = Path(__file__).resolve().parent.parent
BUILD_DIR = REPO / "build" / "bench-cuda"
CEILING_OF = {"gather": "d2d-copy", "scatter-add": "d2d-copy", "swap-h2d": "h2d-pinned", "swap-d2h": "d2h-pinned",
              "swap-in-kernel": "h2d-pinned", "swap-out-kernel": "d2h-pinned"}


def build(cuda_arch: str) -> Path:
    """Configures and builds device_bench with the CUDA backend; raises with
    the tail of the build's output when that fails."""
    configure = ["cmake", "-S", str(REPO / "benchmarks"), "-B", str(BUILD_DIR), "-DCMAKE_BUILD_TYPE=Release",
                 "-DMLTUNER_CUDA=ON"]
    if cuda_arch:
        configure.append(f"-DCMAKE_CUDA_ARCHITECTURES={cuda_arch}")
    for step in (configure, ["cmake", "--build", str(BUILD_DIR), "--target", "device_bench", "-j",
                             str(os.cpu_count() or 2)]):
        proc = subprocess.run(step, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
            raise RuntimeError(f"{' '.join(step)} failed:\n{tail}")
    return BUILD_DIR / "device_bench"


def headline(rows: list[dict[str, str]]) -> list[Figure]:
    ceilings = {r["op"]: float(r["gbps"]) for r in rows if r["index"] == "ceiling"}
    groups: dict[tuple[str, str], list[dict[str, str]]] = {}
    for r in rows:
        if r["op"] in CEILING_OF:
            groups.setdefault((r["op"], r["index"]), []).append(r)
    figures = []
    for (op, index), cells in groups.items():
        ratios = [float(c["ratio"]) for c in cells]
        ceiling = CEILING_OF[op]
        figures.append(Figure(
            "gpu copy", f"{op} ({index})", statistics.median(float(c["gbps"]) for c in cells), "GB/s", ceiling,
            ceilings.get(ceiling), statistics.median(ratios), "GB/s / ceiling GB/s", "higher",
            float(cells[0]["goal"]) if float(cells[0]["goal"]) > 0 else None,
            f"median of {len(cells)} size x width cells", spread(ratios)))
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64,256", help="table sizes in MB (device_bench --sizes)")
    parser.add_argument("--cuda-arch", default="native", help="CMAKE_CUDA_ARCHITECTURES ('' = CMake's default)")
    parser.add_argument("--out", default="results/gpu_copy_bench.txt", help="device_bench's report")
    parser.add_argument("--figures", metavar="PATH", help="write the headline figures for the suite (JSON)")
    args = parser.parse_args()
    exe = build(args.cuda_arch)
    csv_path = Path(args.out).with_suffix(".csv")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([str(exe), "--device", "cuda", "--sizes", args.sizes, "--out", args.out, "--csv",
                           str(csv_path)], timeout=900)
    if proc.returncode != 0:
        print(f"device_bench --device cuda exited with {proc.returncode}", file=sys.stderr)
        return proc.returncode
    with open(csv_path) as f:
        write_figures(args.figures, headline(list(csv.DictReader(f))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
