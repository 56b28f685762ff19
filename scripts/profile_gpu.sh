#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu_check.sh built $BUILD_DIR: Nsight Compute on one forward
# and one backward (`nsa bench --suite backward --once`: every kernel of both runs exactly once).
#
#   scripts/profile_gpu.sh [KERNEL_REGEX]
#
# Always: the time of every kernel (ncu gpu__time_duration, clocks not locked) -> $OUT/kernel_times.txt,
# summed by kernel -> $OUT/kernel_by_name.txt, and their total -> $OUT/kernel_total.txt.
# With KERNEL_REGEX (e.g. 'dkv_kernel|dq_kernel'): the first launch of each matching kernel with
# the sections that say what bounds it (throughput, warp stalls, scheduler issue, occupancy, each
# pipe's utilisation and the instruction mix) and
# the bytes it moves through L2 (as scripts/profile_public.sh asks of the public NSA's) ->
# $OUT/kernel_detail.txt.
# Environment: OUT (default ./out), BUILD_DIR (default /tmp/nsa-gpu-build), T (default 65536),
# BENCH_FLAGS (default --g16-only: Hq 64 / Hkv 4, D 128; empty for every shape's first length),
# LAUNCHES (default 8: how many matching launches get the detail sections), SOURCE_REGEX (below).
set -u -o pipefail
OUT="${OUT:-./out}"
mkdir -p "$OUT"
BUILD_DIR="${BUILD_DIR:-/tmp/nsa-gpu-build}"
# The backward suite of the nsa program; a build from before the suites (scripts/ab_branches.sh
# profiles older snapshots too) has it as its own program, nsa_cuda_backward_bench, same options.
if [[ -x "$BUILD_DIR/bin/nsa" && "$("$BUILD_DIR/bin/nsa" --help)" == *"--suite"* ]]; then
  BENCH=("$BUILD_DIR/bin/nsa" bench --suite backward)
elif [[ -x "$BUILD_DIR/bin/nsa_cuda_backward_bench" ]]; then
  BENCH=("$BUILD_DIR/bin/nsa_cuda_backward_bench")
else
  echo "no $BUILD_DIR/bin/nsa with \`nsa bench --suite\`: run scripts/gpu_check.sh first"; exit 1
fi
command -v ncu >/dev/null || { echo "ncu (Nsight Compute) is not installed here"; exit 1; }
# shellcheck disable=SC2206  # BENCH_FLAGS: several words
ARGS=(--once --lengths "${T:-65536}" ${BENCH_FLAGS---g16-only} --out /tmp/profile_bench.csv)

ncu --clock-control none --metrics gpu__time_duration.sum "${BENCH[@]}" "${ARGS[@]}" > "$OUT/ncu_times.log" 2>&1 || {
  tail -20 "$OUT/ncu_times.log"; exit 1; }
# "  void name<...>(...) (grid)x(block), ..." followed by "gpu__time_duration.sum  ms  12.34"; a
# kernel in a file's anonymous namespace is "<unnamed>::name".
awk '/^  [a-zA-Z_<].*\(.*\)x\(/ { name = $0; sub(/^  (void )?/, "", name); sub(/\(.*/, "", name) }
     /gpu__time_duration.sum/ { unit = $2; v = $3; if (unit == "us") v /= 1000; if (unit == "ns") v /= 1e6;
                                printf "%10.3f ms  %s\n", v, name }' "$OUT/ncu_times.log" > "$OUT/kernel_times.txt"
echo "kernel times (ms), in launch order:"
cat "$OUT/kernel_times.txt"
# The same by kernel (launches summed, the template arguments kept), largest first, and the total:
# against the benchmark's event time of the same call, the total says how much of it is kernels
# and how much gaps between them (launch latency, host work), which matters at short lengths. The
# suite's own input fills (tools/nsa/cuda_fill.cu, before the timed calls) are listed but left out
# of the total, which is then the library's kernels of one forward + backward.
awk '{ k = substr($0, index($0, " ms  ") + 5); t[k] += $1; n[k] += 1
       if (k ~ /(^|::)fill_(uniform|local)$/) fills += $1; else all += $1 }
     END { for (k in t) printf "%10.3f ms  %3d x  %s\n", t[k], n[k], k
           printf "%10.3f ms  total\n", all > "/dev/stderr"
           if (fills > 0) printf "%10.3f ms  the suite'"'"'s input fills, left out of the total\n", fills > "/dev/stderr" }' \
  "$OUT/kernel_times.txt" 2> "$OUT/kernel_total.txt" | sort -rn > "$OUT/kernel_by_name.txt"
echo "by kernel (ms, launches):"
cat "$OUT/kernel_by_name.txt" "$OUT/kernel_total.txt"

if [[ $# -ge 1 && -n "$1" ]]; then
  # SourceCounters: the SASS lines where the warps stall most (sampled), and uncoalesced accesses.
  ncu --clock-control none -k "regex:$1" --launch-count "${LAUNCHES:-8}" --section SpeedOfLight --section WarpStateStats \
    --section SchedulerStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
    --section ComputeWorkloadAnalysis --section InstructionStats --section SourceCounters --metrics lts__t_bytes.sum,l1tex__m_xbar2l1tex_read_bytes.sum \
    "${BENCH[@]}" "${ARGS[@]}" > "$OUT/kernel_detail.txt" 2>&1
  echo "details of '$1': $OUT/kernel_detail.txt (rc=$?)"
fi

# SOURCE_REGEX (e.g. 'dkv_kernel'): per-SASS-instruction counters (instructions executed, sampled
# warp stalls) of the first SOURCE_LAUNCHES (default 1) matching launches -> $OUT/source.csv.gz
# (one row per instruction; tools/sass_hotspots.py summarises it).
if [[ -n "${SOURCE_REGEX:-}" ]]; then
  ncu --clock-control none -k "regex:$SOURCE_REGEX" --launch-count "${SOURCE_LAUNCHES:-1}" --section SourceCounters \
    --section WarpStateStats --import-source no -f -o /tmp/nsa_source "${BENCH[@]}" "${ARGS[@]}" > "$OUT/source_run.log" 2>&1
  ncu -i /tmp/nsa_source.ncu-rep --page source --csv --print-source sass 2> "$OUT/source_page.err" | gzip > "$OUT/source.csv.gz"
  echo "per-instruction counters of '$SOURCE_REGEX': $OUT/source.csv.gz ($(zcat "$OUT/source.csv.gz" | wc -l) lines)"
fi
