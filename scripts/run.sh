#!/usr/bin/env bash
# Sets up, builds and runs the main job: `nsa bench` (NSA against dense attention on the best
# backend here: CUDA when a GPU is present, else the CPU). Extra arguments go to `nsa bench`.
# Without a GPU the CUDA backend is not compiled (the `cpu` preset): nothing could run it, and
# compiling its kernels takes minutes on a small machine.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
preset=cpu
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then preset=release; fi
cmake --preset "$preset"
cmake --build --preset "$preset" -j "$(nproc 2>/dev/null || echo 2)" --target nsa_cli
exec "build/$preset/bin/nsa" bench "$@"
