#!/usr/bin/env bash
# A/B of prepared branches on the GPU machine in one device call: each branch is a snapshot of its
# sources (git archive, ~1 MB) built, tested and benchmarked side by side, so that kernels written
# without a GPU get checked and measured against the same run's baseline.
#
# Here (with git):    scripts/ab_branches.sh prepare main fwd-copy-pieces win-wgmma
#                     -> .snap/<branch>/ for each (ignored by git; carry ".snap" and ".gtest")
# There (no git):     scripts/ab_branches.sh run [NAME...]
#                     -> for each .snap/<branch> (or only the NAMEs given): build (Release, CUDA, sm_90a only), nsa_cuda_tests,
#                        then the forward and backward suites (`nsa bench --suite forward|backward`) at
#                        AB_LENGTHS; logs in $OUT/<branch>/
#                        and one table of the benchmark lines in $OUT/ab_summary.txt.
# Environment: OUT (default ./out), AB_LENGTHS (default 65536), AB_STEPS (default "build tests bench
# bench_backward"; add "profile" for every kernel's ncu time, scripts/profile_gpu.sh (AB_PROFILE_VARIANTS:
# one run per backward-suite variant, e.g. "saved_o_cmp_win saved_o_cmp_win_softmax_no_slack", with
# AB_PROFILE_FLAGS before --variant, default --g16-only, and AB_PROFILE_T, default 65536;
# AB_PROFILE_KERNELS, a kernel regex such as 'slc_attention_tma|slc_dq_kernel': profile_gpu.sh's detail
# sections of its first LAUNCHES launches, their throughputs, L2 bytes, issue and stall lines in the summary;
# "public_ncu": scripts/profile_public.sh, the same lines of the public NSA's selection kernels at AB_PROFILE_T,
# G = AB_PUBLIC_NCU_G (default 16), once per call, carry ".anchors"), and "gather" for
# nsa_gather_bench), AB_BENCH_ARGS (default --no-locality; "" adds the local_q stages),
# AB_BWD_ARGS (more options of the backward suite, e.g. "--shape 64,4,192,128"; a snapshot's bench
# must know them; a snapshot older than the suites, one with bench/cuda_forward_bench.cu, runs its
# own programs nsa_cuda_bench and nsa_cuda_backward_bench with the same options), AB_TEST_TIMEOUT /
# AB_BENCH_TIMEOUT (seconds, default 240 / 180: a hung snapshot fails its step
# instead of the device call), AB_PACK (default 1: the per-snapshot log folders packed into $OUT/ab_logs.tgz,
# since the device tool brings back only a few files), AB_TEST_FILTER
# (a --gtest_filter; the parameterised suites are Cases/CudaForward.*, so write *CudaForward*), JOBS (default 16), AB_ARCH (default 90a),
# AB_BUILDS (default /tmp: the builds go to AB_BUILDS/ab-build-<name>; scripts/ab_rounds.sh reads them there).
# AB_TARGETS (the build step builds only these, e.g. "nsa_cli" for a baseline that is only timed;
# default everything), AB_TARGETS_<name> for one snapshot.
# Per snapshot: AB_STEPS_<name> (the snapshot's folder name with '-' as '_', e.g. AB_STEPS_main="build
# bench") replaces AB_STEPS for that snapshot, e.g. to run the tests only on the new branch.
# Step "break": scripts/break_tests.sh on the snapshot's build (BREAK_ROUNDS, e.g. "2"; BREAK_OTHERS=0: each
# patch's filter only, without the check that the other tests pass; the objects
# it builds with the bugs in are deleted afterwards, so a later call's build step compiles them
# again). Steps "pytest" and "layer": the snapshot's Python package with the CUDA backend (its
# scripts/py_stage.sh, given the extension the build step built in the same build, or without it
# building its own into the snapshot's build-py/), then its GPU tests
# (tests/python/test_cuda.py) or its training layer against the dense twin (bench/layer_bench.py
# with AB_LAYER_ARGS, default "--groups 16 --phi mlp --lens 8192,65536"; CSV rows in the summary). Step "public": the
# same-run table against the fastest public NSA (carry ".anchors" too, laid out by
# ../shared/anchors/mdy_nsa/setup.sh) and dense SDPA at AB_LENGTHS, G in AB_PUBLIC_GROUPS (default "16 4", Hkv 4, D 128):
# the snapshot's backward suite with --variant AB_PUBLIC_VARIANT (default saved_o_cmp_win), merged by its
# bench/public_nsa_prefill.py; the public kernels and the dense baseline are timed once per device call
# (the first snapshot with the step) and shared by the others. AB_DEADLINE (seconds since the start, default 560): a step
# that would likely end after it is skipped (logged), so that the summary and the logs still come
# back inside a 600 s device call.
# Time on the H200 per snapshot (A/B runs from `d01e4ad` to `be59d88`): build 30-45 s (sm_90a
# only; ~1 s when the machine is still warm with the same snapshot), tests 120-150 s, forward
# benchmark at 64K 60-70 s (with the local_q stages), backward benchmark ~70 s, profile ~60-120 s,
# a break round ~150-250 s; three snapshots with tests and benchmarks do not fit in one 600 s call:
# split them with NAMEs.
set -u -o pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cmd="${1:-}"
shift || true

if [[ "$cmd" == prepare ]]; then
  [[ $# -gt 0 ]] || { echo "usage: $0 prepare BRANCH..."; exit 2; }
  rm -rf "$ROOT/.snap"
  for b in "$@"; do
    git -C "$ROOT" rev-parse --verify --quiet "$b^{commit}" >/dev/null || { echo "no branch or commit '$b'"; exit 2; }
    dir="$ROOT/.snap/${b//\//_}"
    mkdir -p "$dir"
    git -C "$ROOT" archive "$b" | tar -x -C "$dir"
    git -C "$ROOT" rev-parse --short "$b" > "$dir/.commit"
    echo "$b -> .snap/${b//\//_} ($(cat "$dir/.commit"))"
  done
  echo "carry: [\".snap\", \".gtest\"]; command: scripts/ab_branches.sh run"
  exit 0
fi

[[ "$cmd" == run ]] || { echo "usage: $0 prepare BRANCH... | $0 run [NAME...]"; exit 2; }
OUT="${OUT:-./out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
JOBS="${JOBS:-16}"
STEPS="${AB_STEPS:-build tests bench bench_backward}"
LENGTHS="${AB_LENGTHS:-65536}"
SUMMARY="$OUT/ab_summary.txt"
: > "$SUMMARY"
[[ -d "$ROOT/.snap" ]] || { echo "no .snap/: run '$0 prepare BRANCH...' here first and carry .snap"; exit 1; }

# GoogleTest from the carried sources, built once for all snapshots.
GTEST_PREFIX=""
if [[ " $STEPS " == *" build "* && -f "$ROOT/.gtest/CMakeLists.txt" ]]; then
  cmake -S "$ROOT/.gtest" -B /tmp/ab-gtest-build -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_INSTALL_PREFIX=/tmp/ab-gtest-install -DBUILD_GMOCK=OFF > /dev/null &&
    cmake --build /tmp/ab-gtest-build -j "$JOBS" > /dev/null && cmake --install /tmp/ab-gtest-build > /dev/null &&
    GTEST_PREFIX=/tmp/ab-gtest-install
fi

DEADLINE="${AB_DEADLINE:-560}"
# Rough seconds per step on the H200 (above), for the deadline.
step_cost() { case "$1" in build) echo 45 ;; tests) echo 150 ;; bench | bench_backward) echo 75 ;;
                           profile) local v; read -ra v <<< "${AB_PROFILE_VARIANTS:-_}"; echo $((90 * ${#v[@]})) ;;
                           gather) echo 20 ;; break) echo 250 ;; pytest) echo 120 ;; layer) echo 150 ;; public) echo 180 ;;
                           public_ncu) echo 90 ;;
                           *) echo 30 ;; esac; }
# The snapshot's Python package, its path on stdout: the snapshot's py_stage.sh, given the extension
# of the snapshot's build where the build step made one in this call (`built_py`: the library's
# objects shared, ~50 s less than py_stage.sh's own build), else (or where that one does not
# import with CUDA) with its own build (once per snapshot, sm_90a). py_stage_of SNAPSHOT LOG BUILD.
py_stage_of() {
  local so="" stage
  : > "$2/py_stage.log"
  [[ "$built_py" == ON ]] && so="$(ls "$3"/python/_nsa*.so 2> /dev/null | head -1)"
  if [[ -n "$so" ]] && stage="$(NSA_PY_EXTENSION="$so" bash "$1/scripts/py_stage.sh" 2>> "$2/py_stage.log")"; then
    echo "$stage" | tail -1
    return 0
  fi
  bash "$1/scripts/py_stage.sh" 2>> "$2/py_stage.log" | tail -1
}
# asks STEP: the step is asked for this snapshot (no deadline check, no log).
asks() { [[ " $snap_steps " == *" $1 "* ]]; }
# build_with ON|OFF: configure and build the snapshot (dir) in build, with or without the Python
# extension.
build_with() {
  cmake -S "$dir" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DNSA_CUDA=ON -DNSA_BUILD_PYTHON="$1" \
    -DPython_EXECUTABLE="$(command -v python3)" -DNSA_CUDA_ARCHITECTURES="${AB_ARCH:-90a}" \
    ${GTEST_PREFIX:+-DCMAKE_PREFIX_PATH=$GTEST_PREFIX} && cmake --build "$build" -j "$JOBS" ${targets:+--target $targets}
}
snap_steps="$STEPS"
# has STEP: the step is asked for this snapshot and fits before the deadline (else logged as skipped).
has() {
  [[ " $snap_steps " == *" $1 "* ]] || return 1
  if (( SECONDS + $(step_cost "$1") > DEADLINE )); then
    echo "  $1: skipped (AB_DEADLINE ${DEADLINE} s: ${SECONDS} s gone)" | tee -a "$SUMMARY"
    return 1
  fi
}
# public_step SNAPSHOT BUILD LOG: the snapshot's backward suite at LENGTHS for each G, then (first time in this
# call) SDPA and the public kernels on the same shapes, merged into LOG/public.md and LOG/public.csv.
public_step() {
  local dir="$1" build="$2" log="$3" g csv="$3/public_ours.csv" part="$3/public_part.csv"
  local variant="${AB_PUBLIC_VARIANT:-saved_o_cmp_win}" groups="${AB_PUBLIC_GROUPS:-16 4}" pub=() v
  [[ -d "$ROOT/.anchors/mdy_nsa/src" ]] || { echo "no .anchors/mdy_nsa: carry it (../shared/anchors/mdy_nsa/setup.sh)" > "$log/public.log"; return 1; }
  : > "$csv"
  # (`full` too: the dense baseline times the shapes of the suite's `full` rows)
  for g in $groups; do
    for v in full "$variant"; do
      timeout "${AB_BENCH_TIMEOUT:-180}" "$build/bin/nsa" bench --suite backward --lengths "$LENGTHS" \
        --shape "$((g * 4)),4,128,128" --variant "$v" --out "$part" >> "$log/public.log" 2>&1 || return 1
      if [[ -s "$csv" ]]; then tail -n +2 "$part" >> "$csv"; else cat "$part" > "$csv"; fi
    done
  done
  rm -f "$part"
  if [[ ! -s "$OUT/public_dense.md" ]]; then
    (cd "$dir/bench" && PYTHONUNBUFFERED=1 timeout "${AB_BENCH_TIMEOUT:-180}" python3 sdpa_backward_baseline.py "$csv" \
      --markdown "$OUT/public_dense.md") >> "$log/public.log" 2>&1 || { rm -f "$OUT/public_dense.md"; return 1; }
  fi
  for g in $groups; do
    if [[ ! -s "$OUT/public_g$g.log" ]]; then
      (cd "$ROOT/.anchors/mdy_nsa" && PYTHONUNBUFFERED=1 timeout "${AB_BENCH_TIMEOUT:-180}" python3 bench.py \
        --seqlens "$LENGTHS" --hq "$((g * 4))" --hkv 4 --no-decode --no-check --no-breakdown > "$OUT/public_g$g.log" 2>&1) ||
        { cat "$OUT/public_g$g.log" >> "$log/public.log"; rm -f "$OUT/public_g$g.log"; return 1; }
    fi
    pub+=(--public "$g=$OUT/public_g$g.log")
  done
  python3 "$dir/bench/public_nsa_prefill.py" --ours "$csv" --dense "$OUT/public_dense.md" "${pub[@]}" \
    --variant "$variant" --csv "$log/public.csv" --markdown "$log/public.md" >> "$log/public.log" 2>&1
}
rc_all=0
dirs=()
if [[ $# -gt 0 ]]; then
  for n in "$@"; do [[ -d "$ROOT/.snap/$n" ]] && dirs+=("$ROOT/.snap/$n/") || { echo "no .snap/$n"; exit 1; }; done
else
  dirs=("$ROOT"/.snap/*/)
fi
for dir in "${dirs[@]}"; do
  name="$(basename "$dir")"
  log="$OUT/$name"
  mkdir -p "$log"
  build="${AB_BUILDS:-/tmp}/ab-build-$name"
  var="AB_STEPS_${name//-/_}"
  snap_steps="${!var:-$STEPS}"
  var="AB_TARGETS_${name//-/_}"
  targets="${!var:-${AB_TARGETS:-}}"
  echo "== $name ($(cat "$dir/.commit" 2>/dev/null)): $snap_steps" | tee -a "$SUMMARY"
  built_py=OFF
  if has build; then
    t0=$SECONDS
    # With a step that needs the Python package, its extension joins this build (py_stage_of); where
    # that fails (no nanobind, say), the build runs again without it.
    py=OFF
    if asks pytest || asks layer; then py=ON; fi
    if ! { build_with $py || { [[ $py == ON ]] && py=OFF && echo "== again without the Python extension" &&
                               build_with OFF; }; } > "$log/build.log" 2>&1; then
      echo "  build FAILED (see $name/build.log)" | tee -a "$SUMMARY"
      tail -20 "$log/build.log"
      rc_all=1
      continue
    fi
    echo "  build: $((SECONDS - t0)) s (the Python extension: $py)" | tee -a "$SUMMARY"
    built_py=$py
  fi
  if has tests; then
    timeout "${AB_TEST_TIMEOUT:-240}" "$ROOT/scripts/gtest_sharded.sh" "$build/bin/nsa_cuda_tests" \
      ${AB_TEST_FILTER:+--gtest_filter=$AB_TEST_FILTER} --gtest_brief=1 > "$log/cuda_tests.log" 2>&1
    rc=$?
    echo "  nsa_cuda_tests: rc=$rc, $(grep -o 'sharded: .*' "$log/cuda_tests.log")" | tee -a "$SUMMARY"
    [[ $rc -eq 0 ]] || rc_all=1
  fi
  # The suites' command: `nsa bench --suite NAME`, or a snapshot's own programs from before the suites.
  if [[ -f "$dir/bench/cuda_forward_bench.cu" ]]; then
    fwd_cmd=("$build/bin/nsa_cuda_bench")
    bwd_cmd=("$build/bin/nsa_cuda_backward_bench")
  else
    fwd_cmd=("$build/bin/nsa" bench --suite forward)
    bwd_cmd=("$build/bin/nsa" bench --suite backward)
  fi
  if has bench; then
    # shellcheck disable=SC2086  # AB_BENCH_ARGS: several words (default: no local_q stages)
    timeout "${AB_BENCH_TIMEOUT:-180}" "${fwd_cmd[@]}" --out "$log/nsa_bench.csv" --lengths "$LENGTHS" \
      ${AB_BENCH_ARGS---no-locality} > "$log/bench.log" 2>&1 ||
      { echo "  bench FAILED" | tee -a "$SUMMARY"; rc_all=1; }
    # Every row (the G = 4 shape's too: 3 shapes x ~8 stages per length).
    sed 's/^/  fwd: /' "$log/nsa_bench.csv" | head -60 >> "$SUMMARY"
  fi
  if has bench_backward; then
    # shellcheck disable=SC2086  # AB_BWD_ARGS: several words
    timeout "${AB_BENCH_TIMEOUT:-180}" "${bwd_cmd[@]}" --out "$log/nsa_backward_bench.csv" \
      --lengths "$LENGTHS" ${AB_BWD_ARGS:-} > "$log/bench_backward.log" 2>&1 || { echo "  bench_backward FAILED" | tee -a "$SUMMARY"; rc_all=1; }
    sed 's/^/  bwd: /' "$log/nsa_backward_bench.csv" | head -60 >> "$SUMMARY"
  fi
  if has gather; then  # bench/gather_patterns.cu: the selection's gather patterns (a few seconds)
    timeout 120 "$build/bin/nsa_gather_bench" > "$log/gather.txt" 2>&1 || { echo "  gather FAILED" | tee -a "$SUMMARY"; rc_all=1; }
    sed 's/^/  gather: /' "$log/gather.txt" | tail -6 >> "$SUMMARY"
  fi
  if has profile; then
    # One ncu run of the backward suite's --once (profile_gpu.sh), or one per variant of
    # AB_PROFILE_VARIANTS (their kernels summed by name, side by side in the summary).
    for v in ${AB_PROFILE_VARIANTS:-_}; do
      pdir="$log/profile" flags="${AB_PROFILE_FLAGS---g16-only}" label=""
      [[ "$v" == _ ]] || { pdir="$log/profile_$v"; flags="$flags --variant $v"; label=" $v"; }
      BUILD_DIR="$build" OUT="$pdir" T="${AB_PROFILE_T:-65536}" BENCH_FLAGS="$flags" "$ROOT/scripts/profile_gpu.sh" \
        ${AB_PROFILE_KERNELS:+"$AB_PROFILE_KERNELS"} > "$pdir.log" 2>&1 || { echo "  profile$label FAILED" | tee -a "$SUMMARY"; rc_all=1; }
      if [[ -n "${AB_PROFILE_KERNELS:-}" && -f "$pdir/kernel_detail.txt" ]]; then
        # What bounds each detailed launch (ncu_summary.sh).
        "$ROOT/scripts/ncu_summary.sh" "$pdir/kernel_detail.txt" | sed "s/^ */  ncu detail$label: /" >> "$SUMMARY"
      fi
      if [[ "$v" == _ ]]; then
        sed 's/^/  ncu: /' "$pdir/kernel_times.txt" >> "$SUMMARY" 2>/dev/null
      else
        { head -12 "$pdir/kernel_by_name.txt"; cat "$pdir/kernel_total.txt"; } 2>/dev/null | sed "s/^/  ncu $v: /" >> "$SUMMARY"
      fi
    done
  fi
  if has pytest; then
    if stage="$(py_stage_of "$dir" "$log" "$build")"; then
      (cd "$dir" && PYTHONPATH="$stage" timeout "${AB_TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider \
        tests/python/test_cuda.py) > "$log/pytest.log" 2>&1
      rc=$?
      echo "  pytest: rc=$rc, $(tail -1 "$log/pytest.log")" | tee -a "$SUMMARY"
      [[ $rc -eq 0 ]] || rc_all=1
    else
      echo "  pytest: the package did not build (see $name/py_stage.log)" | tee -a "$SUMMARY"
      rc_all=1
    fi
  fi
  if has layer; then
    if stage="$(py_stage_of "$dir" "$log" "$build")"; then
      # shellcheck disable=SC2086  # AB_LAYER_ARGS: several words
      PYTHONUNBUFFERED=1 PYTHONPATH="$stage" timeout "${AB_BENCH_TIMEOUT:-180}" python3 "$dir/bench/layer_bench.py" \
        ${AB_LAYER_ARGS:---groups 16 --phi mlp --lens 8192,65536} --csv "$log/layer.csv" > "$log/layer.log" 2>&1 ||
        { echo "  layer FAILED" | tee -a "$SUMMARY"; rc_all=1; }
      sed 's/^/  layer: /' "$log/layer.csv" >> "$SUMMARY" 2>/dev/null
    else
      echo "  layer: the package did not build (see $name/py_stage.log)" | tee -a "$SUMMARY"
      rc_all=1
    fi
  fi
  if has public_ncu; then  # the public NSA's selection kernels under ncu (once per call: they are not the snapshot's)
    if [[ ! -s "$OUT/public_ncu.txt" ]]; then
      OUT="$OUT/public_ncu" T="${AB_PROFILE_T:-65536}" G="${AB_PUBLIC_NCU_G:-16}" "$ROOT/scripts/profile_public.sh" \
        > "$OUT/public_ncu.txt" 2>&1 || { echo "  public_ncu FAILED" | tee -a "$SUMMARY"; rc_all=1; }
      sed 's/^ */  public ncu: /' "$OUT/public_ncu.txt" >> "$SUMMARY"
    fi
  fi
  if has public; then  # the same-run table against the public NSA and dense SDPA (once per call, then shared)
    public_step "$dir" "$build" "$log" || { echo "  public FAILED (see $name/public.log)" | tee -a "$SUMMARY"; rc_all=1; }
    sed 's/^/  public: /' "$log/public.md" >> "$SUMMARY" 2>/dev/null
  fi
  if has break; then  # the planted bugs of tests/cuda/breaks in this snapshot (git apply outside the checkout)
    GIT_CEILING_DIRECTORIES="$ROOT/.snap" BREAK_ROUNDS="${BREAK_ROUNDS:-}" timeout 280 \
      "$ROOT/scripts/break_tests.sh" "$build" "$dir" > "$log/break.log" 2>&1 || { echo "  break FAILED" | tee -a "$SUMMARY"; rc_all=1; }
    grep -h "^caught\|^NOT CAUGHT\|^round\|^FAIL" "$log/break.log" | sed 's/^/  break: /' >> "$SUMMARY"
  fi
done
# The device tool brings back only a few files: every snapshot's logs go into one archive
# ($OUT/ab_logs.tgz, with the failing tests' names in the summary) unless AB_PACK=0.
if [[ "${AB_PACK:-1}" == 1 ]]; then
  names=()
  for dir in "${dirs[@]}"; do
    name="$(basename "$dir")"
    names+=("$name")
    grep -hE '^\[  FAILED  \] .* \([0-9]+ ms\)$' "$OUT/$name/cuda_tests.log" 2>/dev/null | head -20 | sed "s/^/  $name: /" >> "$SUMMARY"
  done
  tar czf "$OUT/ab_logs.tgz" -C "$OUT" "${names[@]}" && rm -rf "${names[@]/#/$OUT/}"
fi
cat "$SUMMARY"
exit $rc_all
