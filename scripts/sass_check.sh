#!/usr/bin/env bash
# The wgmma register-clobbering check (docs/cuda.md, "sm_80 and sm_90a") without a GPU: the sm_90a
# SASS of every kernel in a built library, through tools/check_wgmma_a_regs.py (an HGMMA whose A
# registers are rewritten in a loop, or before the wait that retires it, fails the check).
#
#   scripts/sass_check.sh LIBRARY [REPORT]     (e.g. build/release/libnsa.a; REPORT: the per-kernel lines)
#
# cuobjdump and nvdisasm: from PATH, the CUDA toolkit (CUDA_HOME, /usr/local/cuda), or
# .tools/cuda-sass (scripts/setup.sh installs them there from tools/requirements-sass.txt). Exit
# status: 0 every kernel ok, 1 a kernel clobbered, 2 usage or no sm_90a code, 77 the tools are
# missing (ctest reports the test as skipped).
set -u -o pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
lib="${1:-}"
report="${2:-}"
[[ -f "$lib" ]] || { echo "usage: $0 LIBRARY [REPORT] (no file '$lib')"; exit 2; }
for d in "${CUDA_HOME:-/usr/local/cuda}/bin" "$ROOT/.tools/cuda-sass/nvidia/cu13/bin"; do
  [[ -d "$d" ]] && PATH="$PATH:$d"
done
for tool in cuobjdump nvdisasm; do
  command -v "$tool" > /dev/null || { echo "no $tool: run scripts/setup.sh (installs tools/requirements-sass.txt into .tools/cuda-sass)"; exit 77; }
done
sass="$(mktemp)" lines="$(mktemp)"
trap 'rm -f "$sass" "$lines"' EXIT
cuobjdump -sass -arch sm_90a "$lib" > "$sass" || { echo "cuobjdump failed on $lib"; exit 2; }
grep -q "HGMMA" "$sass" || { echo "no HGMMA in $lib's sm_90a SASS: built without sm_90a?"; exit 2; }
python3 "$ROOT/tools/check_wgmma_a_regs.py" "$sass" > "$lines" 2>&1
rc=$?
[[ -n "$report" ]] && cp "$lines" "$report"
echo "$(grep -c '^ok' "$lines") kernels ok, $(grep -c '^CLOBBERED' "$lines") clobbered"
grep -A1 '^CLOBBERED' "$lines" | head -20
exit $rc
