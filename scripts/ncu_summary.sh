#!/usr/bin/env bash
# The lines of an Nsight Compute detail report that say what bounds each launch: its name, duration,
# throughputs, L2 bytes, issue, occupancy, registers and block size. Used on the reports of
# scripts/profile_gpu.sh (KERNEL_REGEX, through ab_branches.sh's profile step) and
# scripts/profile_public.sh.
#
#   scripts/ncu_summary.sh REPORT.txt
set -u -o pipefail
[[ $# -eq 1 && -f "$1" ]] || { echo "usage: $0 NCU_REPORT.txt"; exit 2; }
grep -E '^  [a-zA-Z_<].*\(.*\)x\(|Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|lts__t_bytes.sum|l1tex__m_xbar2l1tex_read_bytes.sum|Issue Slots Busy|No Eligible|Warp Cycles Per Issued Instruction|Achieved Occupancy|Registers Per Thread|Block Size' \
  "$1"
