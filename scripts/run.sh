#!/usr/bin/env bash
# Sets up, builds and runs the main job: `nsa bench` (NSA against dense attention on the best
# backend here: CUDA when a GPU is present, else the CPU). Extra arguments go to `nsa bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake --preset release
cmake --build --preset release -j "$(nproc 2>/dev/null || echo 2)" --target nsa_cli
exec build/release/bin/nsa bench "$@"
