#!/usr/bin/env bash
# Builds and tests the Python package: installs the test requirements, `pip install .` (the
# extension from the same CMake project), then pytest on tests/python. Exits non-zero on any
# failure, including "no tests collected".
#
# Environment:
#   PYTHON        interpreter to use (default python3)
#   NSA_PY_VENV   virtual environment to create/reuse (default ~/.cache/nsa/py-venv, made with
#                 --system-site-packages so an installed torch is reused); "none" installs into
#                 PYTHON's own environment
#   NSA_PY_CUDA   NSA_CUDA for the extension: AUTO builds the CUDA backend when nvcc is found.
#                 Default: AUTO when nvidia-smi sees a GPU, else OFF (compiling the CUDA kernels
#                 takes long on 2 cores and nothing could run them)
#   NSA_PY_BUILD  pip (default) or cmake: build the extension and the nsa program with CMake into
#                 build-py/ and test them from there (no scikit-build-core, no network: for
#                 machines that have torch, numpy, nanobind and pytest but cannot install
#                 anything; tests/python/test_packaging.py skips without scikit-build-core)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${NSA_PY_VENV:-${HOME:-/tmp}/.cache/nsa/py-venv}
BUILD=${NSA_PY_BUILD:-pip}
if [ -z "${NSA_PY_CUDA:-}" ]; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then NSA_PY_CUDA=AUTO; else NSA_PY_CUDA=OFF; fi
fi
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)}
echo "test_python: interpreter $PYTHON, venv $VENV, build $BUILD, NSA_CUDA=$NSA_PY_CUDA"

if [ "$BUILD" = cmake ]; then
  cmake -S . -B build-py -G Ninja -DNSA_BUILD_PYTHON=ON -DNSA_BUILD_TESTS=OFF -DNSA_BUILD_TOOLS=ON \
    -DNSA_BUILD_BENCHMARKS=OFF -DNSA_INSTALL=OFF -DNSA_CUDA="$NSA_PY_CUDA" -DPython_EXECUTABLE="$(command -v "$PYTHON")"
  cmake --build build-py --target _nsa nsa_cli
  # The package as pip lays it out: the sources, the extension, and the program in nsa/bin.
  stage=build-py/stage
  rm -rf "$stage" && mkdir -p "$stage/nsa/bin"
  cp python/nsa/*.py "$stage/nsa/"
  cp build-py/python/_nsa*.so "$stage/nsa/"
  cp build-py/bin/nsa "$stage/nsa/bin/"
  export PYTHONPATH="$PWD/$stage${PYTHONPATH:+:$PYTHONPATH}"
else
  if [ "$VENV" != none ]; then
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv --system-site-packages "$VENV"
    PYTHON="$VENV/bin/python"
  fi
  start=$(date +%s)
  "$PYTHON" -m pip install -q --disable-pip-version-check -r python/requirements-test.txt
  echo "test_python: requirements ready in $(( $(date +%s) - start )) s"
  start=$(date +%s)
  # --no-build-isolation: the build backend came with the requirements above.
  "$PYTHON" -m pip install -q --disable-pip-version-check --no-build-isolation --force-reinstall --no-deps \
    --config-settings=cmake.define.NSA_CUDA="$NSA_PY_CUDA" .
  echo "test_python: package built and installed in $(( $(date +%s) - start )) s"
fi

# From the repository root, `import nsa` finds the installed package (the sources live in python/).
set +e
"$PYTHON" -m pytest tests/python -q -ra
status=$?
set -e
if [ $status -eq 5 ]; then
  echo "test_python: no tests were collected" >&2
  exit 1
fi
exit $status
