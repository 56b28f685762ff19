#!/usr/bin/env bash
# On the GPU machine, in one go: configure + build (Release, ninja), the host tests, the GPU
# tests, a compute-sanitizer memcheck run on a small case, the CUDA benchmark and the dense
# PyTorch SDPA baseline measured right after it. Logs go to $OUT (default ./out).
#
#   scripts/gpu_check.sh [SOURCE_DIR]        (default: this repository)
#
# Environment: OUT (log folder), BUILD_DIR (default /tmp/nsa-gpu-build), JOBS (default 16),
# SKIP="sass_check host_tests cuda_tests memcheck cuda_fuzz racecheck cli_bench bench bench_backward bench_decode gather_bench python_tests
# bench_decode_layer bench_phi bench_layer public_decode public_prefill bench_backbone sm80_tests" (any subset), LAYER_ARGS (bench/layer_bench.py's), PREFILL_LENS (public_prefill's lengths), BENCH_ARGS (options of both `nsa bench --suite` runs, e.g. --quick or --lengths 8192,65536), DECODE_ARGS (nsa_decode_bench's),
# MEMCHECK_FILTER (memcheck's --gtest_filter), RACECHECK_FILTER (racecheck's), BUILD_TARGETS (build only these, e.g. "nsa_cuda_tests nsa_cli"), CUDA_TEST_FILTER (a --gtest_filter for cuda_tests, e.g. '*CudaBackward*'), BREAK_TESTS=1 (last step:
# scripts/break_tests.sh, the GPU tests must catch the bugs planted by tests/cuda/breaks/*.patch),
# PACK=1 (at the end, everything under $OUT but summary.txt moves into $OUT/logs.tgz: for remote
# runners that bring back only a few files).
# To add a step: write a function and call `step NAME function` below; its output lands in
# $OUT/NAME.log and its status in $OUT/summary.txt.
set -u -o pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SRC="$(cd "${1:-$SCRIPT_DIR/..}" && pwd)"
OUT="${OUT:-./out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
BUILD_DIR="${BUILD_DIR:-/tmp/nsa-gpu-build}"
JOBS="${JOBS:-16}"
SKIP="${SKIP:-}"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
FAILED=0

step() {  # step NAME FUNCTION: runs FUNCTION, logs to $OUT/NAME.log, records the status
  local name="$1"; shift
  if [[ " $SKIP " == *" $name "* ]]; then echo "$name: skipped" | tee -a "$SUMMARY"; return 0; fi
  local start=$SECONDS
  echo "== $name" >&2
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc, $((SECONDS - start)) s" | tee -a "$SUMMARY"
  [[ $rc -eq 0 ]] || FAILED=1
  return $rc
}

# GoogleTest: use an installed one, else build the sources carried in .gtest/ (or the system's).
gtest_prefix() {
  local gsrc=""
  for d in "$SRC/.gtest" "$SCRIPT_DIR/../.gtest" /usr/src/googletest; do
    [[ -f "$d/CMakeLists.txt" ]] && { gsrc="$d"; break; }
  done
  if [[ -n "$gsrc" ]] && ! ls /usr/lib/x86_64-linux-gnu/cmake/GTest >/dev/null 2>&1 && ! ls /usr/local/lib/cmake/GTest >/dev/null 2>&1; then
    cmake -S "$gsrc" -B /tmp/gtest-build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=/tmp/gtest-install \
      -DBUILD_GMOCK=OFF >/dev/null && cmake --build /tmp/gtest-build -j "$JOBS" >/dev/null && cmake --install /tmp/gtest-build >/dev/null
    echo /tmp/gtest-install
  fi
}

build() {
  nvidia-smi || true
  nvcc --version | tail -2
  cmake --version | head -1
  local prefix; prefix="$(gtest_prefix)"
  cmake -S "$SRC" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DNSA_CUDA=ON \
    ${prefix:+-DCMAKE_PREFIX_PATH=$prefix} || return 1
  local t0=$SECONDS
  cmake --build "$BUILD_DIR" -j "$JOBS" ${BUILD_TARGETS:+--target $BUILD_TARGETS} || return 1
  echo "build time: $((SECONDS - t0)) s with -j $JOBS"
}

# Path of a built program (the top-level CMake puts executables in bin/).
bin() {
  local d
  for d in "$BUILD_DIR/bin" "$BUILD_DIR" "$BUILD_DIR/tests" "$BUILD_DIR/tests/cuda"; do
    [[ -x "$d/$1" ]] && { echo "$d/$1"; return 0; }
  done
  echo "missing program $1 under $BUILD_DIR" >&2
  return 1
}

# The wgmma register-clobbering hazards (docs/cuda.md, "sm_80 and sm_90a"): every sm_90a
# kernel's SASS, checked by tools/check_wgmma_a_regs.py (A registers rewritten in a loop, or
# before the wait that retires their wgmma).
sass_check() {
  local lib; lib="$(find "$BUILD_DIR" -name libnsa.a | head -1)"
  "$SRC/scripts/sass_check.sh" "$lib" "$OUT/sass_check_kernels.txt"
}
host_tests() { "$(bin nsa_tests)" --gtest_brief=1; }
# (in NSA_TEST_SHARDS processes at once, default 8: scripts/gtest_sharded.sh)
cuda_tests() { "$SRC/scripts/gtest_sharded.sh" "$(bin nsa_cuda_tests)" ${CUDA_TEST_FILTER:+--gtest_filter=$CUDA_TEST_FILTER}; }
memcheck() {
  compute-sanitizer --tool memcheck --error-exitcode 3 "$(bin nsa_cuda_tests)" \
    --gtest_filter="${MEMCHECK_FILTER:-*f16_d64_G1_packed_linear*:*bf16_d128_G16_paper*:*CudaDecode*f16_d128x64*:*CudaDecodeStatus*:*backbone*:*CudaBackbone*:*CudaRotary*}"
}
# The CUDA fuzz pass: drawn cases (tests/cuda/cases.h: FUZZ_CASES per suite, default 16,
# seed FUZZ_SEED, default 1) through the forward, backward and decode suites' end-to-end tests under
# compute-sanitizer memcheck, in shards; FUZZ_FILTER replaces the test list.
cuda_fuzz() {
  NSA_CUDA_RANDOM_CASES="${FUZZ_CASES:-16}" NSA_CUDA_RANDOM_SEED="${FUZZ_SEED:-1}" \
    NSA_TEST_WRAPPER="compute-sanitizer --tool memcheck --error-exitcode 3" \
    timeout "${FUZZ_TIMEOUT:-480}" "$SRC/scripts/gtest_sharded.sh" "$(bin nsa_cuda_tests)" --gtest_brief=1 \
    --gtest_filter="${FUZZ_FILTER:-Random/CudaForward.ForwardMatchesReferencePipeline/*:Random/CudaForward.SequencesAreIsolated/*:Random/CudaBackward.EveryGradientMatchesReference/*:Random/CudaBackward.SequencesAreIsolated/*:Random/CudaDecode.*}"
}
# compute-sanitizer racecheck (shared-memory hazards) on the decode kernels' pipelines, one case.
racecheck() {
  compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 3 "$(bin nsa_cuda_tests)" \
    --gtest_filter="${RACECHECK_FILTER:-*CudaDecode.Matches*f16_d128x64*}"
}
# `nsa bench` (tools/nsa) takes the CUDA backend when a device is visible: a short smoke run.
cli_bench() { "$(bin nsa)" bench --seqlens 8192 --hq 64 --hkv 4 --phi mean --repeats 3 --no-backward; }
# The forward suite (`nsa bench --suite forward`: whole forward and each stage) and the dense SDPA
# baseline on the same shapes.
bench() {
  "$(bin nsa)" bench --suite forward --out "$OUT/nsa_bench.csv" ${BENCH_ARGS:-} || return 1
  PYTHONUNBUFFERED=1 python3 "$SRC/bench/sdpa_baseline.py" "$OUT/nsa_bench.csv" --markdown "$OUT/bench.md"
}

# Decoding (nsa_decode_bench): batch 1, 8, 64 at 8K-128K, eager and CUDA graphs, the library's dense
# decode, then PyTorch SDPA decoding over the same shapes (bench/sdpa_decode_baseline.py); also the
# public NSA's configuration (shared K/V, mean pooling) for bench/public_nsa_decode.py.
bench_decode() {
  local b; b="$(bin nsa_decode_bench)" || return 1
  "$b" --backend cuda --batch 1,8,64 --lens 8192,16384,32768,65536,131072 --out "$OUT/nsa_decode.csv" ${DECODE_ARGS:-} || return 1
  "$b" --backend cuda --batch 1,8,64 --lens 8192,32768,65536 --phi mean --shared-kv --out "$OUT/nsa_decode_shared_mean.csv" || return 1
  PYTHONUNBUFFERED=1 python3 "$SRC/bench/sdpa_decode_baseline.py" "$OUT/nsa_decode.csv" --markdown "$OUT/bench_decode.md"
}
# The reach backbone's cost: forward and forward+backward at 64K (paper shape, phi = mean) with one
# backbone offset (n unchanged: it takes a learned block's place) against none, in one run.
bench_backbone() {
  local b; b="$(bin nsa)" || return 1
  for offsets in "" "--backbone 64"; do
    echo "== backbone: ${offsets:-off}"
    "$b" bench --seqlens 65536 --hq 64 --hkv 4 --phi mean --repeats 5 --check-tokens 64 $offsets || return 1
  done
}
# The fastest public NSA's decode, laid out in .anchors/mdy_nsa by ../shared/anchors/mdy_nsa/setup.sh.
public_decode() {
  [[ -d "$SRC/.anchors/mdy_nsa/src" ]] || { echo "no .anchors/mdy_nsa (see bench/public_nsa_decode.py)"; return 1; }
  PYTHONUNBUFFERED=1 PYTHONPATH="$SRC/.anchors/mdy_nsa/src" python3 "$SRC/bench/public_nsa_decode.py" \
    --batch 1,8,64 --lens 8192,32768,65536 --markdown "$OUT/public_decode.md"
}

# The same-run prefill table against the fastest public NSA (laid out in .anchors/mdy_nsa by
# ../shared/anchors/mdy_nsa/setup.sh): this library's backward suite (variants full, saved_o_cmp_win
# and saved_o_branch) at G = 16 and G = 4, dense SDPA on those shapes, the public NSA's bench.py at
# the same lengths, merged by bench/public_nsa_prefill.py into $OUT/public_prefill.md and the plot
# CSV $OUT/public_nsa_prefill.csv (bench/plot_speed.py --csv), and with saved_o_branch (the public
# kernels' saved memory) into $OUT/public_prefill_o_branch.md and its CSV. PREFILL_LENS (default 8K-64K).
public_prefill() {
  [[ -d "$SRC/.anchors/mdy_nsa/src" ]] || { echo "no .anchors/mdy_nsa (../shared/anchors/mdy_nsa/setup.sh)"; return 1; }
  local b lens="${PREFILL_LENS:-8192,16384,32768,65536}" csv="$OUT/prefill_ours.csv" v shape
  b="$(bin nsa)" || return 1
  : > "$csv"
  for v in full saved_o_cmp_win saved_o_branch; do
    for shape in 64,4,128,128 16,4,128,128; do
      "$b" bench --suite backward --lengths "$lens" --shape "$shape" --variant "$v" --out "$OUT/prefill_part.csv" || return 1
      if [[ -s "$csv" ]]; then tail -n +2 "$OUT/prefill_part.csv" >> "$csv"; else cat "$OUT/prefill_part.csv" > "$csv"; fi
    done
  done
  rm -f "$OUT/prefill_part.csv"
  (cd "$SRC/bench" && PYTHONUNBUFFERED=1 python3 sdpa_backward_baseline.py "$csv" --markdown "$OUT/prefill_dense.md") || return 1
  local g hq
  for g in 16 4; do
    hq=$((g * 4))
    (cd "$SRC/.anchors/mdy_nsa" && PYTHONUNBUFFERED=1 python3 bench.py --seqlens "$lens" --hq "$hq" --hkv 4 --no-decode \
      --no-check --no-breakdown > "$OUT/prefill_public_g$g.log" 2>&1) || { tail -20 "$OUT/prefill_public_g$g.log"; return 1; }
  done
  # saved_o_cmp_win (the layer's default) and saved_o_branch (every branch's output kept, as the
  # public kernels keep them for the backward), one table and CSV each.
  local sfx
  for v in saved_o_cmp_win saved_o_branch; do
    sfx=""; [[ "$v" == saved_o_cmp_win ]] || sfx="_o_branch"
    python3 "$SRC/bench/public_nsa_prefill.py" --ours "$csv" --dense "$OUT/prefill_dense.md" \
      --public "16=$OUT/prefill_public_g16.log" --public "4=$OUT/prefill_public_g4.log" --variant "$v" \
      --csv "$OUT/public_nsa_prefill$sfx.csv" --markdown "$OUT/public_prefill$sfx.md" || return 1
  done
}

# The selection's gather patterns (bench/gather_patterns.cu, docs/cuda.md, "what bounds the
# selection"): a few seconds.
gather_bench() { timeout 120 "$(bin nsa_gather_bench)"; }  # (a hung pattern must not eat the call)
bench_backward() {  # the backward suite (forward+backward and its variants) against SDPA forward+backward, same run
  "$(bin nsa)" bench --suite backward --out "$OUT/nsa_backward_bench.csv" ${BENCH_ARGS:-} || return 1
  PYTHONUNBUFFERED=1 python3 "$SRC/bench/sdpa_backward_baseline.py" "$OUT/nsa_backward_bench.csv" --markdown "$OUT/bench_backward.md"
}

# The sm_80 path (mma.sync bodies, the fused compressed kernel, the ring window, no TMA) on this
# GPU: a second build whose only code is sm_90 SASS compiled from compute_80 (what an A100 build's
# PTX becomes on a Hopper GPU), so every kernel runs the body an A100 runs; cuda::runs_wgmma_body
# tells the host (ptxVersion 80). Then the GPU tests (SM80_TEST_FILTER, default all). The SASS must
# hold no wgmma: checked first.
sm80_tests() {
  local dir="${BUILD_DIR}-sm80" prefix; prefix="$(gtest_prefix)"
  cmake -S "$SRC" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DNSA_CUDA=ON -DNSA_CUDA_ARCHITECTURES=OFF \
    "-DCMAKE_CUDA_FLAGS=--generate-code=arch=compute_80,code=sm_90" -DNSA_BUILD_TOOLS=OFF \
    ${prefix:+-DCMAKE_PREFIX_PATH=$prefix} > "$OUT/sm80_configure.log" 2>&1 || { tail -20 "$OUT/sm80_configure.log"; return 1; }
  local t0=$SECONDS
  cmake --build "$dir" -j "$JOBS" --target nsa_cuda_tests || return 1
  echo "sm80 build time: $((SECONDS - t0)) s"
  local lib; lib="$(find "$dir" -name libnsa.a | head -1)"
  local wg; wg="$(cuobjdump -sass "$lib" | grep -c -E 'HGMMA|WARPGROUP' || true)"
  echo "wgmma instructions (HGMMA, WARPGROUP) in the sm80 build's SASS: $wg"
  [[ "$wg" == 0 ]] || return 1
  local tests; tests="$(find "$dir" -name nsa_cuda_tests -type f | head -1)"
  "$SRC/scripts/gtest_sharded.sh" "$tests" ${SM80_TEST_FILTER:+--gtest_filter=$SM80_TEST_FILTER} --gtest_brief=1
}

# The whole Python suite with the CUDA backend built in (the GPU machine has torch, numpy,
# nanobind and pytest; the extension is built with CMake, no network needed).
python_tests() { NSA_PY_BUILD=cmake NSA_PY_CUDA=ON PYTHON=python3 "$SRC/scripts/test_python.sh"; }
# phi's cost in the kernels: `nsa bench` forward+backward at 8K and 64K (Hq 64, Hkv 4, D 128) with
# phi = mean and phi = mlp (F = 4D), same run.
bench_phi() {
  local phi
  for phi in mean mlp; do
    "$(bin nsa)" bench --seqlens 8192,65536 --hq 64 --hkv 4 --phi $phi --phi-hidden 512 --repeats 3 || return 1
  done
}
# The training layer against its dense twin (bench/layer_bench.py; the package from scripts/py_stage.sh).
bench_layer() {
  local stage; stage=$(bash "$SRC/scripts/py_stage.sh" | tail -1) || return 1
  PYTHONUNBUFFERED=1 PYTHONPATH="$stage:${PYTHONPATH:-}" python3 "$SRC/bench/layer_bench.py" ${LAYER_ARGS:-} \
    --csv "$OUT/layer_bench.csv" --markdown "$OUT/bench_layer.md"
}
# The layer's decode step (needs the package python_tests built in build-py/stage).
bench_decode_layer() {
  PYTHONUNBUFFERED=1 PYTHONPATH="$SRC/build-py/stage:${PYTHONPATH:-}" python3 "$SRC/bench/decode_layer_bench.py" \
    --markdown "$OUT/bench_decode_layer.md"
}

step build build || { echo "build failed: see $OUT/build.log"; tail -40 "$OUT/build.log"; exit 1; }
step sass_check sass_check
step host_tests host_tests
step cuda_tests cuda_tests
step memcheck memcheck
step cuda_fuzz cuda_fuzz
step racecheck racecheck
step cli_bench cli_bench
step bench bench
step bench_backward bench_backward
step bench_decode bench_decode
step bench_backbone bench_backbone
step public_decode public_decode
step public_prefill public_prefill
step gather_bench gather_bench
step python_tests python_tests
step bench_decode_layer bench_decode_layer
step bench_phi bench_phi
step bench_layer bench_layer
step sm80_tests sm80_tests
# Last: it rebuilds the GPU tests with the planted bugs (the source tree is restored).
[[ "${BREAK_TESTS:-0}" == 1 ]] && step break_tests "$SRC/scripts/break_tests.sh" "$BUILD_DIR" "$SRC"
cat "$SUMMARY"
if [[ "${PACK:-0}" == 1 ]]; then
  (cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name summary.txt ! -name logs.tgz -print0 | sort -z |
     tar czf logs.tgz --null -T - --remove-files)
fi
exit $FAILED
