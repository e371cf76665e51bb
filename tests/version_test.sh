#!/bin/sh
# The version says the same everywhere: the newest release in CHANGELOG.md, avgpipe.h's macros and doc line,
# the version each companion header requires, meson's project version (and so the pkg-config file), and
# what the built implementation reports (avgpipe --version prints avgpipe_version()).
#
#   usage: tests/version_test.sh SOURCE_ROOT MESON_PROJECT_VERSION AVGPIPE_BINARY
# Prints a line per failure and a last line "N passed, M failed"; exits 1 when anything failed.
[ $# -eq 3 ] || { echo "usage: $0 SOURCE_ROOT MESON_PROJECT_VERSION AVGPIPE_BINARY" >&2; exit 2; }
root=$1 meson_version=$2 bin=$3
pass=0
fail=0
check() { # what, got, want
    if [ "$2" = "$3" ]; then
        pass=$((pass + 1))
    else
        fail=$((fail + 1))
        echo "FAIL: $1: '$2', expected '$3' (after CHANGELOG.md's newest entry)"
    fi
}
want=$(sed -n 's/^## \[\([0-9][0-9]*\.[0-9][0-9]*\.[0-9][0-9]*\)\].*/\1/p' "$root/CHANGELOG.md" | head -n 1)
if [ -z "$want" ]; then
    echo "FAIL: CHANGELOG.md has no release heading '## [X.Y.Z] - date'"
    echo "0 passed, 1 failed"
    exit 1
fi
major=${want%%.*} rest=${want#*.}
minor=${rest%%.*} patch=${rest#*.}
number=$((major * 10000 + minor * 100 + patch))
h=$root/avgpipe.h
macro() { sed -n "s/^#define $1 \(.*\)/\1/p" "$h" | head -n 1; }
check "AVGPIPE_VERSION_STRING" "$(macro AVGPIPE_VERSION_STRING)" "\"$want\""
check "AVGPIPE_VERSION_MAJOR.MINOR.PATCH" "$(macro AVGPIPE_VERSION_MAJOR).$(macro AVGPIPE_VERSION_MINOR).$(macro AVGPIPE_VERSION_PATCH)" "$want"
check "avgpipe.h's doc line" "$(sed -n 's/^ *Header-only C11\. Version \([0-9.]*[0-9]\).*/\1/p' "$h" | head -n 1)" "$want"
for c in mpi cuda nccl hwloc; do
    f=$root/avgpipe_$c.h
    check "the avgpipe.h version avgpipe_$c.h requires" "$(sed -n 's/^#if AVGPIPE_VERSION_NUMBER != \([0-9]*\).*/\1/p' "$f" | head -n 1)" "$number"
    check "the version avgpipe_$c.h says it is" "$(sed -n "s/^#error \"avgpipe_$c.h is version \([0-9.]*[0-9]\).*/\1/p" "$f" | head -n 1)" "$want"
done
check "meson's project version" "$meson_version" "$want"
check "avgpipe --version (avgpipe_version())" "$("$bin" --version)" "avgpipe $want"
# the entry has a date and says something
entry=$(awk '/^## \[/{n++} n==1' "$root/CHANGELOG.md")
check "the newest entry's heading has a date" "$(printf '%s\n' "$entry" | head -n 1 | grep -c '^## \[[0-9.]*\] - [0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]$')" "1"
check "the newest entry lists changes (lines starting '- ')" "$(printf '%s\n' "$entry" | grep -c '^- ' | awk '{print ($1 > 0)}')" "1"
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
