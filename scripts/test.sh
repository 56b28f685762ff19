#!/usr/bin/env bash
# Sets up and runs every test of nsa: the C++ suite in Release (every backend this machine can
# build; GPU tests skip without a GPU), the same suite under AddressSanitizer + UBSan, and the
# Python package's tests. Exits non-zero on the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc 2>/dev/null || echo 2)

scripts/setup.sh

echo "== C++ tests (Release) =="
cmake --preset release
cmake --build --preset release -j "$jobs"
ctest --preset release -j "$jobs"

echo "== C++ tests (AddressSanitizer + UndefinedBehaviorSanitizer) =="
cmake --preset asan
cmake --build --preset asan -j "$jobs"
ctest --preset asan -j "$jobs"

if [ -x scripts/test_python.sh ]; then
  echo "== Python tests =="
  scripts/test_python.sh
fi
echo "== all tests passed =="
