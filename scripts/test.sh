#!/usr/bin/env bash
# Runs every test of mltuner: the C++ tests (CTest, without the gpu label),
# the type check of the Python package (mypy) and the Python tests (pytest).
# One command on a fresh machine too: it first installs this source tree with
# its test extras and torch into the active Python (the venv's, if one is
# active), so the Python tests never run an older install;
# the fixed build folder keeps that rebuild incremental.
# Every step always runs; the exit status is non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."

PY="${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/python}"
PY="${PY:-python3}"
export PATH="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
jobs="$(nproc 2>/dev/null || echo 2)"

# A normal (not editable) install: editable installs of compiled modules are fragile.
echo "== installing mltuner with test extras into $("$PY" -c 'import sys; print(sys.prefix)')"
# torch is pinned so that the adapter's tests run with the CPU build where one
# is on disk (this project's machines); elsewhere pip fetches that release.
"$PY" -m pip install ".[test,torch]" "torch==2.13.0" || echo "!! pip install failed; the Python tests will fail"
command -v cmake >/dev/null || "$PY" -m pip install cmake ninja

echo "== C++ tests (build/ctest)"
generator=()
if [[ ! -f build/ctest/CMakeCache.txt ]] && command -v ninja >/dev/null; then generator=(-G Ninja); fi
cmake -S . -B build/ctest "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
      -DMLTUNER_BUILD_TESTS=ON -DMLTUNER_BUILD_PYTHON=OFF \
  && cmake --build build/ctest -j "$jobs" \
  && ctest --output-on-failure -j2 --test-dir build/ctest -LE gpu
ctest_rc=$?

echo "== thread-safety analysis (clang -Wthread-safety over cpp/src)"
scripts/check_thread_safety.sh "$PY"
tsa_rc=$?

echo "== data races (the C++ tests again, built with ThreadSanitizer in build/tsan)"
# A race between engine threads shows here on any machine, also one whose
# path only a GPU takes on its own (the GPU-like test device takes it here).
tsan_generator=()
if [[ ! -f build/tsan/CMakeCache.txt ]] && command -v ninja >/dev/null; then tsan_generator=(-G Ninja); fi
cmake -S . -B build/tsan "${tsan_generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMLTUNER_SANITIZE=thread \
      -DMLTUNER_CUDA=OFF -DMLTUNER_BUILD_TESTS=ON -DMLTUNER_BUILD_PYTHON=OFF > /dev/null \
  && cmake --build build/tsan -j "$jobs" \
  && TSAN_OPTIONS="halt_on_error=1" ctest --output-on-failure -j2 --test-dir build/tsan -LE gpu
tsan_rc=$?

echo "== type check (mypy --strict over python/mltuner, pyproject.toml's [tool.mypy])"
"$PY" -m mypy
mypy_rc=$?

echo "== Python tests (tests/python)"
"$PY" -m pytest
pytest_rc=$?   # 5 (no tests collected) counts as a failure

if [[ $ctest_rc -eq 0 && $tsa_rc -eq 0 && $tsan_rc -eq 0 && $mypy_rc -eq 0 && $pytest_rc -eq 0 ]]; then
  echo "mltuner tests: PASSED (ctest ok, thread-safety ok, data races ok, types ok, pytest ok)"
else
  echo "mltuner tests: FAILED (ctest exit $ctest_rc, thread-safety exit $tsa_rc, data races exit $tsan_rc," \
       "mypy exit $mypy_rc, pytest exit $pytest_rc)"
  exit 1
fi
