#!/usr/bin/env bash
# Clang's thread-safety analysis over the engine (cpp/src): every GUARDED_BY
# field read or written without its lock, every REQUIRES/EXCLUDES broken, is
# an error. Objects go to a temporary folder at -O0 (zig's driver fails on
# -fsyntax-only: it wants to rename an output). Uses clang++ from PATH, else the clang
# that the `ziglang` package bundles (python -m ziglang c++, its own libc++).
# Exits 0 with a notice when neither exists. Usage: scripts/check_thread_safety.sh [python]
set -uo pipefail
cd "$(dirname "$0")/.."

PY="${1:-${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/python}}"
PY="${PY:-python3}"
if command -v clang++ >/dev/null; then
  cxx=(clang++)
elif "$PY" -c "import ziglang" 2>/dev/null; then
  cxx=("$PY" -m ziglang c++)
else
  echo "thread-safety check: skipped (no clang++ on PATH and no ziglang module in $PY)"
  exit 0
fi

flags=(-std=c++17 -O0 -Wthread-safety -Werror=thread-safety -Icpp/include -Icpp/src)
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
jobs="${JOBS:-2}"
mapfile -t sources < <(find cpp/src -name '*.cc' | sort)
echo "thread-safety check: ${cxx[*]} over ${#sources[@]} files"
export out
check_one() { "$@" -c -o "$out/$(echo "${@: -1}" | tr / _).o"; }
export -f check_one
printf '%s\n' "${sources[@]}" | xargs -P "$jobs" -I{} bash -c 'check_one "$@"' _ "${cxx[@]}" "${flags[@]}" {}
rc=$?
if [[ $rc -eq 0 ]]; then echo "thread-safety check: OK"; else echo "thread-safety check: FAILED"; fi
exit $rc
