#!/usr/bin/env bash
# Installs what building and testing nsa needs on a fresh Debian machine (idempotent; quick when
# everything is there). Needs root (or sudo) only when something is missing.
set -euo pipefail

need=()
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
command -v g++ >/dev/null || need+=(g++)
[ -f /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)
if ! command -v python3 >/dev/null; then
  need+=(python3 python3-pip python3-venv)
else
  # The Python tests make a virtual environment: Debian's python3 needs python3-venv for it.
  python3 -c "import ensurepip, venv" 2>/dev/null || need+=(python3-venv)
  python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
fi
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "setup: installing ${need[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}"
fi
# CMake >= 3.25 is required (Debian 12 ships 3.25).
cmake --version | head -1
# With nvcc but without cuobjdump / nvdisasm (the SASS check of the sm_90a kernels, ctest
# sass_wgmma_a_regs): NVIDIA's wheels of them, pinned in tools/requirements-sass.txt, into
# .tools/cuda-sass (no root needed).
# (The paths from the checkout's root, wherever this runs from.)
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cuda_bin="${CUDA_HOME:-/usr/local/cuda}/bin"
have() { command -v "$1" >/dev/null || [ -x "$cuda_bin/$1" ]; }
if have nvcc && ! { have cuobjdump && have nvdisasm; } && [ ! -x "$root/.tools/cuda-sass/nvidia/cu13/bin/nvdisasm" ]; then
  echo "setup: installing cuobjdump and nvdisasm into .tools/cuda-sass (tools/requirements-sass.txt)"
  python3 -m pip install --quiet --no-deps --disable-pip-version-check --root-user-action=ignore \
    --target "$root/.tools/cuda-sass" -r "$root/tools/requirements-sass.txt"
fi
