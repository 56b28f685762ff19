#!/usr/bin/env bash
# Host-side check of the GPU break patches (tests/cuda/breaks/*.patch, run by scripts/break_tests.sh
# on the GPU machine): every patch names the tests that must catch it (a "# filter:" line), and
# each round's patches apply together to a copy of this tree's sources, so that a change to the
# code a patch breaks is seen here (and in CI) rather than on the GPU machine.
#
#   scripts/check_break_patches.sh [SOURCE_DIR]
set -euo pipefail
SRC="$(cd "${1:-$(dirname "$0")/..}" && pwd)"
cd "$SRC"
mapfile -t PATCHES < <(ls tests/cuda/breaks/*.patch)
[[ ${#PATCHES[@]} -gt 0 ]] || { echo "no patches in tests/cuda/breaks"; exit 1; }
# shellcheck source=scripts/break_patch_header.sh
source "$SRC/scripts/break_patch_header.sh"  # header, round_of, filter_of
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
bad=0
for p in "${PATCHES[@]}"; do
  [[ -n "$(filter_of "$p")" ]] || { echo "FAIL: $p has no '# filter:' line"; bad=1; }
done
mapfile -t ROUNDS < <(for p in "${PATCHES[@]}"; do round_of "$p"; done | sort -n | uniq)
for round in "${ROUNDS[@]}"; do
  rm -rf "$work/tree" && mkdir -p "$work/tree" && cp -r src "$work/tree/"
  for p in "${PATCHES[@]}"; do
    [[ "$(round_of "$p")" == "$round" ]] || continue
    # (outside any repository: git apply then patches relative to the current folder)
    if ! (cd "$work/tree" && GIT_CEILING_DIRECTORIES="$work" git apply "$SRC/$p" 2>"$work/err"); then
      echo "FAIL: $p (round $round) does not apply: $(head -2 "$work/err" | tr '\n' ' ')"
      bad=1
    fi
  done
done
[[ $bad == 0 ]] && echo "${#PATCHES[@]} break patches in ${#ROUNDS[@]} rounds apply"
exit $bad
