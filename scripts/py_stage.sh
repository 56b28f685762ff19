#!/usr/bin/env bash
# The Python package with the CUDA backend, built with CMake into build-py/ and laid out in
# build-py/stage/nsa as pip would (for GPU machines that cannot pip-install; sm_90a only, to
# keep the build short). Does nothing when build-py/stage already imports with a usable CUDA
# backend. Prints the PYTHONPATH entry to use on its last line.
#
#   PYTHONPATH="$(bash scripts/py_stage.sh | tail -1):$PYTHONPATH" python3 ...
#
# Environment: PYTHON (default python3), NSA_PY_ARCH (default 90a), NSA_PY_EXTENSION (an extension
# module built elsewhere, e.g. by a build of the project with -DNSA_BUILD_PYTHON=ON: staged with the
# sources instead of a build of its own; exit status 1 when it does not import with CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
stage="$PWD/build-py/stage"
cuda_ok() { PYTHONPATH="$stage" "$PYTHON" -c "import nsa, sys; sys.exit(0 if nsa.backend_available('cuda') else 1)" 2>/dev/null; }
# stage_with EXTENSION: the sources and the extension laid out in the stage, which must import with CUDA.
stage_with() {
  rm -rf "$stage" && mkdir -p "$stage/nsa"
  cp python/nsa/*.py "$1" "$stage/nsa/"
  cuda_ok || { echo "py_stage: the extension $1 has no usable CUDA backend" >&2; exit 1; }
}
if [[ -n "${NSA_PY_EXTENSION:-}" ]]; then
  stage_with "$NSA_PY_EXTENSION"
  echo "py_stage: the extension $NSA_PY_EXTENSION" >&2
elif ! cuda_ok; then
  start=$SECONDS
  export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
  cmake -S . -B build-py -G Ninja -DNSA_BUILD_PYTHON=ON -DNSA_BUILD_TESTS=OFF -DNSA_BUILD_TOOLS=OFF -DNSA_CUDA=ON \
    -DNSA_CUDA_ARCHITECTURES="${NSA_PY_ARCH:-90a}" -DPython_EXECUTABLE="$(command -v "$PYTHON")" >&2
  cmake --build build-py --target _nsa >&2
  stage_with "$(ls build-py/python/_nsa*.so | head -1)"
  echo "py_stage: extension built in $(( SECONDS - start )) s" >&2
fi
echo "$stage"
