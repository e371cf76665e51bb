#!/bin/sh
# The bits avgpipe.h promises do not depend on the includer's compiler flags: runs tests/exact_check.c
# as built with the project's flags (the first binary) and as built with each other set of flags (the
# rest: gnu11 -O3 -march=native, -Ofast, -ffast-math, clang, g++, nvcc). Each must pass its own checks
# against the documented formula, and print the same digest of every result's bits as the first.
#
#   usage: tests/exact_flags_test.sh PLAIN_BINARY OTHER_BINARY...
# Prints a line per build and a last line "N passed, M failed"; exits 1 when anything failed.
[ $# -ge 2 ] || { echo "usage: $0 PLAIN_BINARY OTHER_BINARY..." >&2; exit 2; }
pass=0
fail=0
want=""
for bin in "$@"; do
    name=$(basename "$bin")
    out=$(timeout 120 "$bin" 2>&1)
    rc=$?
    got=$(printf '%s\n' "$out" | sed -n 's/^exact_check: digest //p')
    if [ "$rc" -ne 0 ] || [ -z "$got" ]; then
        fail=$((fail + 1))
        echo "FAIL: $name (exit status $rc)"
        printf '%s\n' "$out" | sed 's/^/    /' | head -n 25
        continue
    fi
    [ -n "$want" ] || want=$got
    if [ "$got" != "$want" ]; then
        fail=$((fail + 1))
        echo "FAIL: $name: digest $got, the plain build's $want (its results differ from the plain build's)"
        continue
    fi
    pass=$((pass + 1))
    echo "ok: $name: digest $got, $(printf '%s\n' "$out" | sed -n 's/^exact_check: flush-to-zero at start \([a-z]*\).*/flush-to-zero at start \1/p')"
done
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
