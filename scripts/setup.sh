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
