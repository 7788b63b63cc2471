#!/usr/bin/env bash
# The GPU checks of a lent GPU machine, in one go: installs mltuner (with
# CUDA) into the machine's Python, runs the CUDA C++ tests (CTest label gpu),
# the Python GPU tests, and the GPU data-path benchmark (and, with two GPUs or
# more, the transformer on two against DDP, its hop logs kept). Writes logs to $OUT
# (or ./gpu-out). Offline machines: wheels for pyzmq/optuna in .wheelhouse.
#   bash scripts/gpu_checks.sh [benchmark args...]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [[ -d .wheelhouse ]]; then
  python3 -m pip install -q --no-index --find-links .wheelhouse pyzmq optuna 2>&1 | tail -2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/machine.txt"
echo "== install"
python3 -m pip install -q --no-build-isolation --no-deps . > "$out/install.log" 2>&1 || { tail -30 "$out/install.log"; exit 1; }
echo "== CUDA C++ tests"
cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMLTUNER_BUILD_TESTS=ON -DMLTUNER_BUILD_PYTHON=OFF \
  -DCMAKE_CUDA_ARCHITECTURES=90 > "$out/ctest-build.log" 2>&1 \
  && cmake --build build/gpu -j 16 >> "$out/ctest-build.log" 2>&1 \
  && ctest --test-dir build/gpu -L gpu --output-on-failure 2>&1 | tail -15 | tee "$out/ctest.log"
echo "== Python GPU tests"
# faulthandler, a native stack (scripts/native_stack.c) and the whole log:
# a crash in a CUDA test leaves its trace, also in an engine thread.
preload=""
if cc -shared -fPIC -O1 -o /tmp/native_stack.so scripts/native_stack.c -ldl 2>/dev/null; then preload=/tmp/native_stack.so; fi
LD_PRELOAD="$preload" python3 -X faulthandler -m pytest -q -x tests/python/gpu tests/python/torch/test_cuda.py \
  tests/python/torch/test_mixed_precision.py tests/python/test_read_my_writes.py \
  tests/python/torch/test_interrupted_clock.py -p no:cacheprovider > "$out/pytest-gpu.log" 2>&1
tail -15 "$out/pytest-gpu.log"
echo "== benchmark"
(cd benchmarks && python3 gpu_path_bench.py "$@" 2>&1 | tee "$out/gpu_path_bench.md")
if (( $(nvidia-smi -L | wc -l) >= 2 )); then
  echo "== two GPUs: the transformer against DDP, with each run's message hops"
  (cd benchmarks && python3 throughput_bench.py --device cuda --model transformer --rule adam --workers 2 \
     --slacks 0,1 --hops "$out/hops" 2>&1 | grep '^|' | tee "$out/throughput_transformer.md")
  tar czf "$out/hops.tgz" -C "$out" hops && rm -rf "$out/hops"  # few files to fetch: hop_timeline.py reads them
fi
if (( $(nvidia-smi -L | wc -l) >= 4 )); then
  echo "== four GPUs: ResNet-18 on 1, 2 and 4 workers against DDP"
  (cd benchmarks && python3 throughput_bench.py --device cuda --model resnet18 --workers 1,2,4 \
     --slacks 0,1 2>&1 | grep '^|' | tee "$out/throughput_resnet18_4.md")
fi
