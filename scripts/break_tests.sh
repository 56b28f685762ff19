#!/usr/bin/env bash
# Break tests of the GPU tests: each tests/cuda/breaks/*.patch plants one bug in the CUDA backend,
# and its first line names (as a --gtest_filter) the tests that must then fail. All patches are
# applied together and built once (~1 min on the GPU machine instead of one rebuild per patch);
# then each patch's tests must fail, and every other GPU test must still pass (so the bugs are
# independent: no test is counted as catching a bug another patch planted). The source tree is
# restored on exit, and the objects built with the bugs in are deleted (the next build compiles
# them again).
# Patches whose bugs break the same tests go in different rounds (a header line "# round: N",
# default 1): each round is applied, built and checked on its own, so that every patch's filter
# is caught by its own bug. A header line "# also: FILTER" names tests that the bug may fail as
# well without counting as catching it: tests that compare another path with this one (decoding
# against the prefill, the backward on caller-provided index sets against the reference backward).
# They are left out of the round's check of the other tests.
#
#   scripts/break_tests.sh BUILD_DIR [SOURCE_DIR]      (gpu_check.sh runs it with BREAK_TESTS=1)
#   BREAK_ROUNDS="2 3" scripts/break_tests.sh ...      (only those rounds, e.g. after a run that timed out)
#   BREAK_DEADLINE=500 scripts/break_tests.sh ...      (seconds: a round that would likely end after it
#                                                       is skipped and reported, ROUND_SECONDS (150) each)
#   BREAK_OTHERS=0 scripts/break_tests.sh ...          (each patch's filter only, not the round's check that
#                                                       every other test still passes)
set -u -o pipefail

BUILD_DIR="$1"
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SRC="$(cd "${2:-$SCRIPT_DIR/..}" && pwd)"
cd "$SRC" || exit 1
# A source folder that is no repository of its own (a snapshot inside another checkout): git apply
# would take the outer repository's root as the patches' base and silently skip every path.
[[ -e .git ]] || export GIT_CEILING_DIRECTORIES="$(dirname "$SRC")"
mapfile -t PATCHES < <(ls tests/cuda/breaks/*.patch)
[[ ${#PATCHES[@]} -gt 0 ]] || { echo "no patches"; exit 1; }
patched_sums() { sed -n 's|^+++ b/||p' "$1" | sort -u | xargs md5sum; }
# shellcheck source=scripts/break_patch_header.sh
source "$SCRIPT_DIR/break_patch_header.sh"  # header, round_of, filter_of, also_of

APPLIED=()
restore() {
  local i
  for ((i = ${#APPLIED[@]} - 1; i >= 0; --i)); do git apply -R "${APPLIED[$i]}" || echo "could not revert ${APPLIED[$i]}"; done
  APPLIED=()
}
# Every object, library and test binary built from here on holds a planted bug: on exit they are
# deleted, so that the next build compiles them again from the restored sources even where those
# come back with older modification times than the objects (a source tree copied over again, as
# the device tool does).
STAMP="$BUILD_DIR/.break_tests_start"
touch "$STAMP"
on_exit() {
  restore
  find "$BUILD_DIR" -type f \( -name '*.o' -o -name '*.a' -o -name nsa_cuda_tests \) -newer "$STAMP" -delete
  rm -f "$STAMP"
}
trap on_exit EXIT

rc=0
mapfile -t ROUNDS < <(for p in "${PATCHES[@]}"; do round_of "$p"; done | sort -n | uniq)
if [[ -n "${BREAK_ROUNDS:-}" ]]; then
  wanted=()
  for r in "${ROUNDS[@]}"; do [[ " $BREAK_ROUNDS " == *" $r "* ]] && wanted+=("$r"); done
  [[ ${#wanted[@]} -gt 0 ]] || { echo "BREAK_ROUNDS='$BREAK_ROUNDS': no such round (have: ${ROUNDS[*]})"; exit 2; }
  ROUNDS=("${wanted[@]}")
fi
for round in "${ROUNDS[@]}"; do
  if [[ -n "${BREAK_DEADLINE:-}" ]] && (( SECONDS + ${ROUND_SECONDS:-150} > BREAK_DEADLINE )); then
    echo "round $round: skipped, it would end after BREAK_DEADLINE=$BREAK_DEADLINE s (at $SECONDS s now)"
    rc=1
    continue
  fi
  mine=()
  for p in "${PATCHES[@]}"; do [[ "$(round_of "$p")" == "$round" ]] && mine+=("$p"); done
  echo "round $round: ${#mine[@]} patch(es)"
  for p in "${mine[@]}"; do
    before="$(patched_sums "$p")"
    git apply "$p" || { echo "FAIL: $p does not apply (the code it breaks has changed: update it)"; exit 1; }
    [[ "$(patched_sums "$p")" != "$before" ]] || { echo "FAIL: git apply took $p but changed no file"; exit 1; }
    APPLIED+=("$p")
  done
  cmake --build "$BUILD_DIR" --target nsa_cuda_tests -j "${JOBS:-16}" > "$BUILD_DIR/break_build.log" 2>&1 ||
    { tail -30 "$BUILD_DIR/break_build.log"; exit 1; }
  TESTS="$BUILD_DIR/bin/nsa_cuda_tests"
  [[ -x "$TESTS" ]] || TESTS="$(find "$BUILD_DIR" -name nsa_cuda_tests -type f -perm -u+x | head -1)"

  all_filters=()
  for p in "${mine[@]}"; do
    filter="$(filter_of "$p")"
    [[ -n "$filter" ]] || { echo "FAIL: $p has no '# filter:' line"; exit 1; }
    all_filters+=("$filter")
    also="$(also_of "$p")"
    [[ -z "$also" ]] || all_filters+=("$also")
    if "$SCRIPT_DIR/gtest_sharded.sh" "$TESTS" --gtest_filter="$filter" --gtest_brief=1 > "$BUILD_DIR/break_$(basename "$p" .patch).log" 2>&1; then
      echo "NOT CAUGHT: $(basename "$p"): the tests '$filter' pass with the bug in"
      rc=1
    else
      # (gtest_sharded.sh's own count, from its summary line)
      failed="$(grep -o '[0-9]* failed)$' "$BUILD_DIR/break_$(basename "$p" .patch).log" | grep -o '^[0-9]*')"
      echo "caught: $(basename "$p"): $failed failing test(s) in '$filter'"
    fi
  done
  # Everything else passes with this round's bugs in: each patch breaks only what its filter names.
  # BREAK_OTHERS=0 skips this check (a short device call that only needs each patch caught).
  others="-$(IFS=:; echo "${all_filters[*]}")"  # (the filters have no '-' part of their own)
  if [[ "${BREAK_OTHERS:-1}" == 0 ]]; then
    echo "round $round, the other tests: not run (BREAK_OTHERS=0)"
  elif "$SCRIPT_DIR/gtest_sharded.sh" "$TESTS" --gtest_filter="$others" --gtest_brief=1 > "$BUILD_DIR/break_others_$round.log" 2>&1; then
    echo "round $round, the other tests pass: $(grep -o 'sharded: [0-9]* tests ran in [0-9]* shards' "$BUILD_DIR/break_others_$round.log")"
  else
    echo "round $round, other tests fail too (a patch breaks more than its filter says):"
    grep -E '^\[  FAILED  \] .* \([0-9]+ ms\)$' "$BUILD_DIR/break_others_$round.log" | sort -u
    rc=1
  fi
  restore
done
exit $rc
