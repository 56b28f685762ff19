# The header of a break patch (tests/cuda/breaks/*.patch): the comment lines before its first
# diff, with "# filter: ", "# also: " and "# round: " lines (scripts/break_tests.sh has their
# meaning). Sourced by scripts/break_tests.sh and scripts/check_break_patches.sh.
header() { sed -n '/^diff --git/q;p' "$1"; }
round_of() { local r; r="$(header "$1" | sed -n 's/^# round: //p' | head -1)"; echo "${r:-1}"; }
filter_of() { header "$1" | sed -n 's/^# filter: //p' | head -1; }
also_of() { header "$1" | sed -n 's/^# also: //p' | head -1; }
