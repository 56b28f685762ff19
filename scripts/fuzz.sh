#!/usr/bin/env bash
# The long fuzz run (docs/errors.md, "The fuzzer"): the C++ API fuzzer (tests/fuzz/, fuzz_main.cpp)
# in Release and under AddressSanitizer + UBSan, then the Python package's fuzzer
# (tests/python/fuzz_cases.py), each for several seeds. Every case must end in a result that
# matches the reference backend or an nsa::Error / nsa.Error naming the parameter it broke; a
# crash, a hang (per-case watchdog), another exception or a wrong result fails the run. Exits
# non-zero on the first failing fuzzer. scripts/test.sh runs the short runs.
#
# Usage: scripts/fuzz.sh [CASES per seed and fuzzer, default 5000] [SEEDS, default "1 2 3"]
# Environment:
#   NSA_FUZZ_CPU_DIR, NSA_FUZZ_ASAN_DIR  build folders of the cpu and asan presets (defaults:
#                                         the presets' own, build/cpu and build/asan)
#   NSA_PY_VENV                           the environment scripts/test_python.sh installs the
#                                         package into (default ~/.cache/nsa/py-venv); the Python
#                                         fuzzer is skipped, with a message, where nsa is not
#                                         importable
set -euo pipefail
cd "$(dirname "$0")/.."
cases=${1:-5000}
seeds=${2:-"1 2 3"}
jobs=$(nproc 2>/dev/null || echo 2)
cpu_dir=${NSA_FUZZ_CPU_DIR:-build/cpu}
asan_dir=${NSA_FUZZ_ASAN_DIR:-build/asan}

cmake --preset cpu -B "$cpu_dir" >/dev/null
cmake --build "$cpu_dir" --target nsa_fuzz -j "$jobs"
cmake --preset asan -B "$asan_dir" >/dev/null
cmake --build "$asan_dir" --target nsa_fuzz -j "$jobs"

for seed in $seeds; do
  echo "== C++ fuzzer, Release, seed $seed =="
  "$cpu_dir/bin/nsa_fuzz" --seed "$seed" --cases "$cases"
  echo "== C++ fuzzer, AddressSanitizer + UBSan, seed $seed =="
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    "$asan_dir/bin/nsa_fuzz" --seed "$seed" --cases "$cases"
done

venv=${NSA_PY_VENV:-${HOME:-/tmp}/.cache/nsa/py-venv}
python=python3
[ -x "$venv/bin/python" ] && python="$venv/bin/python"
if "$python" -c "import nsa" 2>/dev/null; then
  for seed in $seeds; do
    echo "== Python fuzzer, seed $seed =="
    "$python" tests/python/fuzz_cases.py --seed "$seed" --cases "$cases"
  done
else
  echo "fuzz: nsa is not importable with $python; run scripts/test_python.sh first (Python fuzzer skipped)"
fi
echo "== fuzz: every case ended in a match or a named error =="
