#!/usr/bin/env bash
# On the GPU machine: Nsight Compute on the fastest public NSA's selection kernels (Triton, laid
# out in .anchors/mdy_nsa by ../shared/anchors/mdy_nsa/setup.sh): its forward (`_fwd_kernel`), dq
# (`_dq_kernel`) and dK / dV (`_dkdv_kernel`) of one forward + backward
# (bench/public_nsa_kernels.py), with the sections that say what bounds them and the bytes they
# move through L2, to set beside this library's (scripts/profile_gpu.sh KERNEL_REGEX, which asks
# for the same metrics).
#
#   scripts/profile_public.sh
#
# -> $OUT/public_kernel_detail.txt (ncu's report) and, on stdout, its lines that say what bounds
# each launch (scripts/ncu_summary.sh).
# Environment: OUT (default ./out), T (default 65536), G (default 16: Hq = 4 G, Hkv 4, D 128),
# KERNELS (default '^(_fwd_kernel|_dq_kernel|_dkdv_kernel)$'; the names are the Triton functions',
# which no other public kernel shares), LAUNCHES (default 3: one step's launch of each; the
# kernels' launch configurations are fixed, so the first step's launches are the measured ones').
set -u -o pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-./out}"
mkdir -p "$OUT"
ANCHOR="$ROOT/.anchors/mdy_nsa/src"
[[ -d "$ANCHOR/flash_nsa" ]] || { echo "no $ANCHOR/flash_nsa: carry .anchors (../shared/anchors/mdy_nsa/setup.sh)"; exit 1; }
command -v ncu >/dev/null || { echo "ncu (Nsight Compute) is not installed here"; exit 1; }
detail="$OUT/public_kernel_detail.txt"
PYTHONPATH="$ANCHOR" ncu --clock-control none -k "regex:${KERNELS:-^(_fwd_kernel|_dq_kernel|_dkdv_kernel)$}" \
  --launch-count "${LAUNCHES:-3}" --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
  --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
  --metrics lts__t_bytes.sum,l1tex__m_xbar2l1tex_read_bytes.sum \
  python3 "$ROOT/bench/public_nsa_kernels.py" --groups "${G:-16}" --lens "${T:-65536}" --steps 1 > "$detail" 2>&1
rc=$?
"$ROOT/scripts/ncu_summary.sh" "$detail"
echo "public kernels' details: $detail (rc=$rc)"
exit "$rc"
