#!/usr/bin/env bash
# On the GPU machine, after `scripts/ab_branches.sh run NAME...` built the snapshots (AB_STEPS=build,
# or any steps with build): alternated rounds of the same measurements on every snapshot, so that
# a few-percent difference between branches is not the drift of one sitting.
#
#   scripts/ab_rounds.sh NAME...        (the .snap/ names, as ab_branches.sh prints them)
#   scripts/ab_rounds.sh main main:saved_o_cmp_win_win_128
#                                       (NAME:VARIANT: that snapshot with that suite variant, so that
#                                        two kernel choices of one build alternate as two branches do;
#                                        labelled NAME-VARIANT in the files and the summary)
#
# Per round and snapshot: every kernel's ncu time of one forward + backward (scripts/profile_gpu.sh's
# timing pass, --g16-only at T 65536 unless BENCH_FLAGS / T say otherwise) and the event-timed
# backward suite (`nsa bench --suite backward --variant VARIANT` at LENGTHS, --g16-only unless
# SUITE_FLAGS says otherwise). At the end, per snapshot: the kernels matching KERNELS (a regex,
# default the forward's and the backward's large kernels) and the suite's forward and
# forward+backward times, each as the values of the rounds and their median.
# Environment: OUT (default ./out), ROUNDS (default 3), KERNELS, VARIANT (default saved_o_cmp_win),
# LENGTHS (default 8192,65536), SUITE_FLAGS (default --g16-only), BENCH_FLAGS / T (profile_gpu.sh's),
# AB_BUILDS (default /tmp: where ab_branches.sh, given the same AB_BUILDS, leaves ab-build-<name>).
# Files: $OUT/rounds/<name>_<round>/ (profile_gpu.sh's), $OUT/rounds/bench_<name>_<round>.csv,
# $OUT/rounds/summary.txt.
set -u -o pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[[ $# -ge 1 ]] || { echo "usage: $0 NAME[:VARIANT]... (snapshots built by scripts/ab_branches.sh run)" >&2; exit 2; }
OUT="${OUT:-./out}"
mkdir -p "$OUT/rounds"
OUT="$(cd "$OUT" && pwd)"
R="$OUT/rounds"
ROUNDS="${ROUNDS:-3}"
KERNELS="${KERNELS:-cmp_pass1|cmp_scores|win_attention|slc_attention|select_topn|slc_union|dq_kernel|dkv_ws|slc_dq}"
VARIANT="${VARIANT:-saved_o_cmp_win}"
BUILDS="${AB_BUILDS:-/tmp}"
labels=()
for entry in "$@"; do
  snap="${entry%%:*}"
  [[ -x "$BUILDS/ab-build-$snap/bin/nsa" ]] || { echo "no $BUILDS/ab-build-$snap/bin/nsa: build it first (ab_branches.sh)" >&2; exit 1; }
  labels+=("${entry/:/-}")
done
for ((r = 1; r <= ROUNDS; ++r)); do
  for entry in "$@"; do
    snap="${entry%%:*}" variant="$VARIANT" name="${entry/:/-}"
    [[ "$entry" == *:* ]] && variant="${entry#*:}"
    build="$BUILDS/ab-build-$snap"
    mkdir -p "$R/${name}_$r"
    BUILD_DIR="$build" BENCH_FLAGS="${BENCH_FLAGS:---g16-only} --variant $variant" OUT="$R/${name}_$r" \
      timeout 120 "$ROOT/scripts/profile_gpu.sh" > "$R/${name}_$r/log" 2>&1 || echo "round $r $name: profile failed"
    # shellcheck disable=SC2086  # SUITE_FLAGS: several words
    timeout 120 "$build/bin/nsa" bench --suite backward ${SUITE_FLAGS---g16-only} \
      --lengths "${LENGTHS:-8192,65536}" --variant "$variant" --out "$R/bench_${name}_$r.csv" > /dev/null 2>&1 ||
      echo "round $r $name: bench failed"
  done
done
python3 - "$R" "$ROUNDS" "$KERNELS" "${labels[@]}" > "$R/summary.txt" <<'PY'
import csv, os, re, statistics, sys
out, rounds, kernels, names = sys.argv[1], int(sys.argv[2]), re.compile(sys.argv[3]), sys.argv[4:]
def fmt(v):
    return " / ".join(f"{x:.3f}" for x in v) + (f"  (median {statistics.median(v):.3f})" if v else "")
for name in names:
    print(f"== {name}")
    times = {}
    for r in range(1, rounds + 1):
        path = os.path.join(out, f"{name}_{r}", "kernel_by_name.txt")
        if not os.path.exists(path):
            continue
        for line in open(path):
            m = re.match(r"\s*([\d.]+) ms\s+\d+ x\s+(.*)", line)
            if m and kernels.search(m.group(2)):
                times.setdefault(m.group(2).strip(), []).append(float(m.group(1)))
        total = os.path.join(out, f"{name}_{r}", "kernel_total.txt")
        if os.path.exists(total):
            m = re.match(r"\s*([\d.]+) ms\s+total", open(total).readline())
            if m:
                times.setdefault("(all kernels)", []).append(float(m.group(1)))
    for k in sorted(times, key=lambda k: -max(times[k])):
        print(f"  ncu {k[:90]:90s} {fmt(times[k])}")
    rows = {}
    for r in range(1, rounds + 1):
        path = os.path.join(out, f"bench_{name}_{r}.csv")
        if not os.path.exists(path):
            continue
        for row in csv.DictReader(open(path)):
            key = f"hq {row['hq']} T {row['T']}"
            rows.setdefault(key, ([], []))
            rows[key][0].append(float(row["fwd_ms"]))
            rows[key][1].append(float(row["fwd_bwd_ms"]))
    for key, (fwd, both) in sorted(rows.items()):
        print(f"  event {key}: fwd {fmt(fwd)}; fwd+bwd {fmt(both)}")
PY
cat "$R/summary.txt"
