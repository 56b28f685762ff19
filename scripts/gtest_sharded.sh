#!/usr/bin/env bash
# Runs a GoogleTest binary as N processes at once (GoogleTest's own sharding: GTEST_TOTAL_SHARDS /
# GTEST_SHARD_INDEX, after --gtest_filter), then prints every shard's output in shard order and one
# summary line. The GPU tests spend most of their time in the single-threaded fp64 reference on the
# host, so on the GPU machine's 16 cores eight shards take a fraction of one process's time.
#
#   scripts/gtest_sharded.sh BINARY [GTEST ARGS...]
#
# Environment: NSA_TEST_SHARDS (default 8, or 1 where nvidia-smi reports a non-Default compute mode);
# NSA_TEST_WRAPPER, a command every shard runs under (e.g. "compute-sanitizer --tool memcheck").
# Exit status: 0 when every shard passed, else the first failing shard's. The summary line, last
# (also with one shard, so that callers read one format):
#   [==========] sharded: T tests ran in N shards (P passed, F failed)
# where T and P sum the shards' own "N tests from M test suites ran" / "[  PASSED  ] N tests"
# lines, and F counts the failed tests' result lines "[  FAILED  ] name (N ms)" (not the failure
# list at the end, which names each failed test again: ", where GetParam() = ..." for a
# parameterised one).
set -u -o pipefail
[[ $# -ge 1 ]] || { echo "usage: $0 BINARY [GTEST ARGS...]" >&2; exit 2; }
bin="$1"
shift
shards="${NSA_TEST_SHARDS:-8}"
[[ "$shards" =~ ^[1-9][0-9]*$ ]] || { echo "NSA_TEST_SHARDS='$shards': a positive integer is needed" >&2; exit 2; }
if [[ -z "${NSA_TEST_SHARDS:-}" ]] && command -v nvidia-smi >/dev/null 2>&1; then
  # A GPU in an exclusive compute mode takes one process at a time: then one shard.
  mode="$(nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2>/dev/null | head -1)"
  if [[ -n "$mode" && "$mode" != Default ]]; then
    echo "gtest_sharded: compute mode '$mode': one process" >&2
    shards=1
  fi
fi
dir="$(mktemp -d)"
pids=()
trap 'rm -rf "$dir"' EXIT
trap 'kill "${pids[@]}" 2>/dev/null; exit 143' TERM INT  # (a timeout around this script stops the shards too)
for ((i = 0; i < shards; ++i)); do
  GTEST_TOTAL_SHARDS="$shards" GTEST_SHARD_INDEX="$i" ${NSA_TEST_WRAPPER:-} "$bin" "$@" > "$dir/$i.log" 2>&1 &
  pids+=("$!")
done
rc=0
for ((i = 0; i < shards; ++i)); do
  wait "${pids[$i]}"
  s=$?
  [[ $rc -eq 0 && $s -ne 0 ]] && rc=$s
done
total=0 passed=0 failed=0
for ((i = 0; i < shards; ++i)); do
  echo "---- shard $i of $shards"
  cat "$dir/$i.log"
  n="$(grep -o '^\[==========\] [0-9]* tests\? from [0-9]* test suites\? ran' "$dir/$i.log" | grep -o '[0-9]* test' | head -1 | grep -o '[0-9]*')"
  p="$(grep -o '^\[  PASSED  \] [0-9]*' "$dir/$i.log" | grep -o '[0-9]*$' | head -1)"
  f="$(grep -cE '^\[  FAILED  \] .* \([0-9]+ ms\)$' "$dir/$i.log")"
  total=$((total + ${n:-0})) passed=$((passed + ${p:-0})) failed=$((failed + f))
done
echo "[==========] sharded: $total tests ran in $shards shards ($passed passed, $failed failed)"
exit $rc
