#!/bin/sh
# Tests of the avgpipe command-line tool (tools/avgpipe.c): exit codes and key outputs.
#
#   usage: tests/cli_test.sh BINARY [GOLDEN]
#
# GOLDEN is PyTorch's torch_zb1p_2rank_2stagep_compute.csv or the folder that holds it; it defaults to
# tests/data/ of this repository.
# Prints one line per failure and a last line "N passed, M failed"; exits 1 when anything failed.

BIN=$1
if [ -z "$BIN" ] || [ ! -x "$BIN" ]; then
    echo "usage: $0 BINARY [GOLDEN]" >&2
    exit 2
fi
HERE=$(cd "$(dirname "$0")" && pwd)
GOLDEN=${2:-$HERE/data}
if [ -d "$GOLDEN" ]; then GOLDEN=$GOLDEN/torch_zb1p_2rank_2stagep_compute.csv; fi
TMP=$(mktemp -d "${TMPDIR:-/tmp}/avgpipe_cli.XXXXXX") || exit 2
trap 'rm -rf "$TMP"' EXIT
trap 'exit 2' INT TERM
OUT=$TMP/out
ERR=$TMP/err
pass=0
fail=0

ok() { pass=$((pass + 1)); }
bad() {
    fail=$((fail + 1))
    echo "FAIL: $*"
    sed -n '1,3s/^/    stderr: /p' "$ERR"
}

# t NAME WANT_RC ARGS... : run the binary (stdout in $OUT, stderr in $ERR, stdin from $IN) and check
# its exit code.
IN=/dev/null
t() {
    name=$1
    want=$2
    shift 2
    "$BIN" "$@" >"$OUT" 2>"$ERR" <"$IN"
    got=$?
    if [ "$got" = "$want" ]; then ok; else bad "$name: exit $got, expected $want"; fi
}

# usage_error NAME WORD ARGS... : exit 2 and exactly one stderr line, "avgpipe: ...", that contains WORD.
usage_error() {
    name=$1
    word=$2
    shift 2
    t "$name" 2 "$@"
    if [ "$(wc -l <"$ERR")" -eq 1 ] && grep -q '^avgpipe: ' "$ERR" && grep -q -- "$word" "$ERR"; then
        ok
    else
        bad "$name: expected one stderr line 'avgpipe: ...' naming '$word'"
    fi
}

has() { # has NAME FILE PATTERN (fixed string)
    if grep -q -F -- "$3" "$2"; then ok; else bad "$1: '$3' not found"; fi
}

lines() { # lines NAME FILE N
    n=$(wc -l <"$2")
    if [ "$n" -eq "$3" ]; then ok; else bad "$1: $n lines, expected $3"; fi
}

# column NAME VALUE... : the values of a TSV column (by header name) of $OUT, one line.
column() {
    awk -F '\t' -v c="$1" 'NR == 1 { for (i = 1; i <= NF; i++) if ($i == c) k = i; next }
                           { printf "%s%s", sep, (k ? $k : "?"); sep = " " } END { print "" }' "$OUT"
}

eq() { # eq NAME GOT WANT
    if [ "$2" = "$3" ]; then ok; else bad "$1: got '$2', expected '$3'"; fi
}

# ---- help and version ----------------------------------------------------------------------------
t "--help" 0 --help
has "--help" "$OUT" "usage: avgpipe"
has "--help lists tune" "$OUT" "  tune "
t "--version" 0 --version
has "--version" "$OUT" "avgpipe 0."
for c in sim validate compare tune; do
    t "$c --help" 0 "$c" --help
    has "$c --help" "$OUT" "usage: avgpipe $c"
done
t "sim -h" 0 sim -h
t "tune --help" 0 tune --help
has "tune --help: sizes" "$OUT" "KiB"

# ---- compare: the paper's Fig. 7 (S = 2, M = 8, transfer 1): AFAB 29, 1F1B 35, advance K=1 29 ----
t "compare tsv" 0 compare --schedule afab,1f1b,advance --stages 2 --micro 8 --comm-latency 1 --advance 1 --summary tsv
lines "compare tsv" "$OUT" 4
for col in schedule stages micro pipes chunks advance makespan bubble peak_act_max peak_act_stage0 valid; do
    has "compare tsv header" "$OUT" "$col"
done
eq "compare tsv schedules" "$(column schedule)" "afab 1f1b advance"
eq "compare tsv makespans" "$(column makespan)" "29 35 29"
eq "compare tsv stage-0 stash" "$(column peak_act_stage0)" "8 2 3"
eq "compare tsv bubble" "$(column bubble)" "0.1724 0.3143 0.1724"
eq "compare tsv valid" "$(column valid)" "1 1 1"
t "compare range" 0 compare --schedule afab,1f1b,advance --stages 2 --micro 8 --advance 0..3 --summary tsv
eq "compare range rows" "$(column advance)" "0 0 0 1 2 3"
t "compare table" 0 compare --schedule afab,1f1b,advance --stages 2 --micro 8 --comm-latency 1 --advance 1
has "compare table" "$OUT" "makespan"
has "compare table" "$OUT" "1f1b"
t "compare defaults" 0 compare --summary tsv
eq "compare defaults" "$(column schedule)" "afab 1f1b advance zbh1"
t "compare interleaved chunks" 0 compare --schedule 1f1b,interleaved --stages 2 --micro 4 --chunks 2 --summary tsv
eq "compare interleaved chunks" "$(column chunks)" "1 2"

# ---- sim -----------------------------------------------------------------------------------------
t "sim" 0 sim --stages 4 --micro 8
has "sim" "$OUT" "makespan 33"
has "sim" "$OUT" "rank 3"
t "sim tsv" 0 sim --stages 2 --micro 8 --comm-latency 1 --advance 1 --summary tsv
lines "sim tsv" "$OUT" 2
eq "sim tsv makespan" "$(column makespan)" "29"
eq "sim tsv peak" "$(column peak_act_max)" "3"
t "sim quiet" 0 sim --stages 4 --micro 8 --quiet
lines "sim quiet" "$OUT" 7
t "sim files" 0 sim --schedule zbh1 --stages 2 --micro 4 --comm-latency 1 --width 40 \
    --trace "$TMP/t.json" --svg "$TMP/t.svg" --csv "$TMP/t.csv"
has "sim --trace" "$TMP/t.json" "traceEvents"
has "sim --svg" "$TMP/t.svg" "<svg"
has "sim --csv" "$TMP/t.csv" "0F0"
t "validate sim --csv" 0 validate "$TMP/t.csv"
t "sim continuous" 0 sim --stages 3 --micro 3 --pipes 2 --rounds 2 --continuous --blocking-send \
    --comm-latency 0.5 --comm-bytes 100 --bandwidth 50 --cost-f 1.5 --cost-b 3 --cost-w 1.5 --quiet
t "sim interleaved" 0 sim --schedule interleaved --stages 2 --micro 4 --chunks 3 --quiet
# ties and step agreement: placed, written, validated again from the file; bad pairs named
t "sim --tie --agree" 0 sim --stages 4 --micro 4 --pipes 2 --tie 0:3,1:2 --agree --tie-bytes 10 --bandwidth 5 --csv "$TMP/tie.csv" --quiet
has "sim --tie csv" "$TMP/tie.csv" "3TIE0@0"
has "sim --tie csv 2" "$TMP/tie.csv" "1:2TIE0@1"
has "sim --agree csv" "$TMP/tie.csv" "2AGREE0"
t "validate tie csv" 0 validate "$TMP/tie.csv"
usage_error "sim --tie syntax" "STAGE:STAGE" sim --tie 0-3
usage_error "sim --tie out of range" "names stage 9, outside" sim --tie 0:9 --quiet
usage_error "sim --tie itself" "ties stage 1 to itself" sim --tie 1:1 --quiet
t "sim --flag=value" 0 sim --stages=2 --micro=2 --quiet
# a cost of 0 is free (AVGPIPE_ZERO), not the default: 1F1B S=2 M=2 with free backwards = 2 forwards + 1
t "sim --cost-b 0" 0 sim --stages 2 --micro 2 --cost-b 0 --summary tsv
eq "sim --cost-b 0 makespan" "$(column makespan)" "3"

# ---- bad arguments: exit 2, one line naming the problem --------------------------------------------
usage_error "--stages 0" "--stages" sim --stages 0
usage_error "--stages abc" "'abc'" sim --stages abc
usage_error "--stages missing value" "--stages" sim --stages
usage_error "--stages 100000" "stages" sim --stages 100000
usage_error "--micro 999999999" "micro" sim --micro 999999999
usage_error "--micro overflow" "--micro" sim --micro 99999999999999999999
usage_error "--pipes -1" "--pipes" compare --pipes -1
usage_error "--cost-b -1" "--cost-b" sim --cost-b -1
usage_error "--comm-latency nan" "--comm-latency" sim --comm-latency nan
usage_error "--width 1" "--width" sim --width 1
usage_error "unknown flag" "--bogus" sim --bogus
usage_error "unknown schedule" "foo" compare --schedule afab,foo
usage_error "empty schedule item" "--schedule" compare --schedule afab,
usage_error "sim with a list" "--schedule" sim --schedule afab,1f1b
usage_error "range reversed" "3..1" compare --advance 3..1
usage_error "range open" "2.." compare --advance 2..
usage_error "range in sim" "--advance" sim --advance 0..3
usage_error "--summary xml" "--summary" compare --summary xml
usage_error "flag of another command" "--lower" sim --lower
usage_error "stray argument" "extra" compare extra
usage_error "unknown command" "frobnicate" frobnicate
usage_error "no command" "command"
usage_error "interleaved micro % stages" "multiple" sim --schedule interleaved --stages 3 --micro 8
usage_error "chunks without interleaved" "chunks" sim --schedule 1f1b --chunks 2

# ---- validate ------------------------------------------------------------------------------------
if [ -r "$GOLDEN" ]; then
    t "validate golden" 0 validate "$GOLDEN"
    has "validate golden" "$OUT" "valid: 2 ranks, 4 stages"
    t "validate --lower golden" 0 validate --lower "$GOLDEN"
    has "validate --lower golden" "$OUT" "SEND_F"
    IN=$GOLDEN
    t "validate --lower --quiet golden" 0 validate --lower --quiet "$GOLDEN"
    cp "$OUT" "$TMP/lowered.csv"
    t "validate lowered golden" 0 validate "$TMP/lowered.csv"
    has "validate lowered golden" "$OUT" "with SEND/RECV"
    t "validate stdin" 0 validate -
    IN=/dev/null
    sed 's/2I0/2W0/' "$GOLDEN" >"$TMP/golden_broken.csv"
    t "validate broken golden" 1 validate "$TMP/golden_broken.csv"
    has "validate broken golden" "$OUT" ">2W0<"
else
    : >"$ERR"
    bad "golden schedule '$GOLDEN' not readable (pass its path as the second argument)"
fi
printf '0F0,0F1,0B0,0B1\n1B0,1F0,1F1,1B1\n' >"$TMP/broken.csv"
t "validate broken" 1 validate "$TMP/broken.csv"
has "validate broken names the op" "$OUT" "rank 1, position 0, op 1B0"
has "validate broken marks the op" "$OUT" ">1B0<"
t "validate broken quiet" 1 validate --quiet "$TMP/broken.csv"
lines "validate broken quiet" "$OUT" 0
printf '0F0,0F1,0B0,0B1\n1F0,1B0,1F1\n' >"$TMP/short.csv"
t "validate missing op" 1 validate "$TMP/short.csv"
has "validate missing op" "$OUT" "no backward"
: >"$TMP/empty.csv"
usage_error "validate empty file" "empty.csv" validate "$TMP/empty.csv"
printf '\001\377\376garbage\000\n\342\202' >"$TMP/garbage.bin"
usage_error "validate binary garbage" "garbage.bin' is not a schedule (text): byte 0 is 0x01" validate "$TMP/garbage.bin"
usage_error "validate missing file" "nonexistent" validate "$TMP/nonexistent.csv"
usage_error "validate directory" "directory" validate "$TMP"
usage_error "validate no file" "FILE" validate
awk 'BEGIN { for (i = 0; i < 5000; i++) print i "F0" }' >"$TMP/ranks.csv"
usage_error "validate 5000 ranks" "5000 ranks" validate "$TMP/ranks.csv"
printf '0F99999999999\n' >"$TMP/huge.csv"
usage_error "validate huge micro-batch" "huge.csv" validate "$TMP/huge.csv"
# Standard input is read up to 1 GiB like files (it had no cap: '</dev/zero' grew without end).
if head -c 1 /dev/zero >/dev/null 2>&1; then
    head -c 1073741825 /dev/zero | tr '\000' ' ' | "$BIN" validate - >"$OUT" 2>"$ERR"
    if [ $? -eq 2 ] && grep -q "standard input.*1 GiB" "$ERR"; then ok; else bad "validate - over 1 GiB: expected exit 2 naming the 1 GiB cap"; fi
    # Not text: refused at the first NUL byte, not after reading a gigabyte of it (it took 2 s and 1 GB).
    IN=/dev/zero
    usage_error "validate - of /dev/zero" "not a schedule (text): byte 0 is 0x00" validate -
    IN=/dev/null
    usage_error "validate /dev/zero" "not a schedule (text): byte 0 is 0x00" validate /dev/zero
    usage_error "tune /dev/zero" "not a profile (text): byte 0 is 0x00" tune --profile /dev/zero --batch 32 --mem-limit 1M
    printf '0F0,0B0\n0F0,0\0011B0\n' >"$TMP/ctl.csv"
    usage_error "validate control character" "byte 13 is 0x01" validate "$TMP/ctl.csv"
fi
# An invalid schedule of 2 million ops on one rank: the error and a window of the grid around the op it
# names, a few lines (the whole grid was lines of megabytes).
awk 'BEGIN { printf "0F0"; for (i = 1; i < 1000000; i++) printf ",0F%d", i; for (i = 0; i < 1000000; i++) printf (i == 500000 ? ",0F%d" : ",0B%d"), i; print "" }' >"$TMP/long.csv"
t "validate 2M-op invalid schedule" 1 validate "$TMP/long.csv"
has "validate 2M-op invalid schedule" "$OUT" "of 2000000 around the marked op"
if [ "$(wc -c <"$OUT")" -lt 20000 ] && [ "$(wc -l <"$OUT")" -le 6 ]; then ok; else bad "validate 2M-op invalid schedule: $(wc -c <"$OUT") bytes, $(wc -l <"$OUT") lines of output (a window is a few lines)"; fi
# Sparse numbering: two ops naming 100 pipelines x 10^5 micro-batches; the validator allocated a table
# for them (one op of pipeline 5999 on stage 32766 asked the simulator for 6 GB); refused at once.
printf '99:0F0,0F99999\n' >"$TMP/sparse.csv"
t "validate sparse numbering" 1 validate "$TMP/sparse.csv"
has "validate sparse numbering" "$OUT" "missing forwards"
printf '5:13333333F0\n' >"$TMP/farstage.csv"
usage_error "validate stage over the limit" "stage number too large" validate "$TMP/farstage.csv"

# ---- tune ------------------------------------------------------------------------------------------
# A synthetic profile of S = 2 stages at two micro-batch sizes (4 and 8 samples): F takes 1000 + 1 x samples
# microseconds, B twice that; 1000 parameters per stage, 64 activation bytes per sample. The per-op
# constant dominates, so the fewest, largest micro-batches (M = 1) and the most pipelines win.
synth_profile() { # synth_profile FILE [extra awk program run after each section's stage lines]
    awk 'BEGIN {
        print "# avgpipe profile v1"
        for (k = 4; k <= 8; k += 4) {
            M = 32 / k
            printf "shape kind=1f1b stages=2 chunks=1 micro=%d pipes=1 rounds=1 advance=0 continuous=0 samples=%d seconds=0.1\n", M, k
            printf "stage 0 param_floats=1000 act_bytes=%d slots=2\nstage 1 param_floats=1000 act_bytes=0 slots=1\n", 64 * k
            t = 0
            for (g = 0; g < 2; g++) for (u = 0; u < M; u++) {
                f = 0.001 + 0.000001 * k
                printf "op rank=%d kind=F pipe=0 stage=%d micro=%d start=%.9f end=%.9f bytes=0\n", g, g, u, t, t + f
                printf "op rank=%d kind=B pipe=0 stage=%d micro=%d start=%.9f end=%.9f bytes=0\n", g, g, u, t + f, t + 3 * f
                t += 3 * f
            }
        }
    }' >"$1"
}
PROF=$TMP/synth.prof
synth_profile "$PROF"
t "tune table" 0 tune --profile "$PROF" --batch 32 --mem-limit 1M --max-pipes 3
has "tune table: fitted F" "$OUT" "stage 0: F 1000 + 1 x samples us, B 2000 + 2 x samples us"
has "tune table: fitted stage 1" "$OUT" "stage 1: F 1000 + 1 x samples us"
has "tune table: latency" "$OUT" "transfer latency 0 us"
has "tune table: header" "$OUT" "us_per_sample"
has "tune table: limit" "$OUT" "memory limit 1 MiB per rank"
has "tune table: best" "$OUT" "best: "
has "tune table: extrapolation noted" "$OUT" "outside the profiled 4..8"
lines "tune table: --top 10" "$OUT" 20 # 4 model lines, blank, summary, header, 10 rows, more, best, note
t "tune tsv" 0 tune --profile "$PROF" --batch 32 --mem-limit 1M --max-pipes 3 --top 5 --summary tsv
lines "tune tsv" "$OUT" 6
for col in rank schedule micro pipes advance continuous pred_time_per_sample pred_seconds pred_peak_bytes fits; do
    has "tune tsv header" "$OUT" "$col"
done
eq "tune tsv ranks" "$(column rank)" "1 2 3 4 5"
eq "tune tsv best micro" "$(column micro | cut -d' ' -f1)" "1"
eq "tune tsv best pipes" "$(column pipes | cut -d' ' -f1)" "3"
eq "tune tsv fits" "$(column fits)" "1 1 1 1 1"
sorted=$(column pred_time_per_sample | tr ' ' '\n' | sort -g | tr '\n' ' ')
eq "tune tsv fastest first" "$(column pred_time_per_sample) " "$sorted"
cp "$OUT" "$TMP/tune_1M.tsv"
# --noise-scale: by time to target. At 16 samples N pipelines of 32 take 1 + 2N times the epochs: the
# most pipelines (fastest per sample) lose to one, and each row's efficiency and time to target say why.
t "tune --noise-scale" 0 tune --profile "$PROF" --batch 32 --mem-limit 1M --max-pipes 3 --top 0 --summary tsv --noise-scale 16
has "tune --noise-scale header" "$OUT" "pred_time_to_target"
eq "tune --noise-scale best pipes" "$(column pipes | cut -d' ' -f1)" "1"
eq "tune --noise-scale efficiency" "$(awk -F '\t' 'NR > 1 && $12 != 1 + 2 * $4 { bad = bad " " $1 } END { print bad == "" ? "ok" : bad }' "$OUT")" "ok"
eq "tune --noise-scale time to target" "$(awk -F '\t' 'NR > 1 { d = $13 - $8 * $12; if (d < -1e-8 * $13 || d > 1e-8 * $13) bad = bad " " $1 }
        END { print bad == "" ? "ok" : bad }' "$OUT")" "ok"
sorted=$(column pred_time_to_target | tr ' ' '\n' | sort -g | tr '\n' ' ')
eq "tune --noise-scale soonest first" "$(column pred_time_to_target) " "$sorted"
t "tune --noise-scale table" 0 tune --profile "$PROF" --batch 32 --mem-limit 1M --max-pipes 3 --noise-scale 16
has "tune --noise-scale table: columns" "$OUT" "efficiency  us_to_target"
has "tune --noise-scale table: best" "$OUT" "efficiency 3: "
# sizes: 1M = 1024K = 1048576 bytes
t "tune --mem-limit 1024K" 0 tune --profile "$PROF" --batch 32 --mem-limit 1024K --max-pipes 3 --top 5 --summary tsv
if cmp -s "$OUT" "$TMP/tune_1M.tsv"; then ok; else bad "tune: --mem-limit 1024K differs from 1M"; fi
t "tune --mem-limit 1048576" 0 tune --profile "$PROF" --batch 32 --mem-limit 1048576 --max-pipes 3 --top 5 --summary tsv
if cmp -s "$OUT" "$TMP/tune_1M.tsv"; then ok; else bad "tune: --mem-limit 1048576 differs from 1M"; fi
# A limit just under the best setting's peak: it no longer fits; every fitting row is within the limit
# and ranked before every row that does not fit.
peak=$(awk -F '\t' 'NR == 2 { print $10 }' "$TMP/tune_1M.tsv")
limit=$((peak - 1))
t "tune tight limit" 0 tune --profile "$PROF" --batch 32 --mem-limit "$limit" --max-pipes 3 --top 0 --summary tsv
eq "tune tight limit: best pipes" "$(column pipes | cut -d' ' -f1)" "2"
eq "tune tight limit: fits flags and order" "$(awk -F '\t' -v L="$limit" 'NR > 1 {
        if ($11 != ($10 <= L ? 1 : 0)) bad = bad " flag@" $1; if ($11 == 1 && seen0) bad = bad " order@" $1; if ($11 == 0) seen0 = 1 }
        END { print bad == "" ? "ok" : bad }' "$OUT")" "ok"
# Adam's state: 8 bytes per parameter and pipeline on top of the 4-byte weights
t "tune --opt-bytes-per-param 8" 0 tune --profile "$PROF" --batch 32 --mem-limit 1M --max-pipes 3 --top 1 --summary tsv \
    --opt-bytes-per-param 8
eq "tune optimizer bytes" "$(column pred_peak_bytes)" "$((peak + 3 * 1000 * 8))"
t "tune --schedule --no-continuous" 0 tune --profile "$PROF" --batch 32 --mem-limit 1M --schedule afab,1f1b --no-continuous \
    --top 0 --summary tsv
eq "tune schedules" "$(column schedule | tr ' ' '\n' | sort -u | tr '\n' ' ')" "1f1b afab "
eq "tune synchronous only" "$(column continuous | tr ' ' '\n' | sort -u | tr -d '\n')" "0"
t "tune --rounds 2 --top 0" 0 tune --profile "$PROF" --batch 8 --mem-limit 4G --rounds 2 --max-pipes 2 --top 0 --summary tsv
eq "tune row count" "$(wc -l <"$OUT")" "$((1 + $(column rank | wc -w)))"
t "tune --min-micro --max-advance" 0 tune --profile "$PROF" --batch 32 --mem-limit 1M --min-micro 8 --max-advance 2 --top 0 --summary tsv
eq "tune --min-micro: micro-batch sizes" "$(column samples | tr ' ' '\n' | sort -gu | tr '\n' ' ')" "8 16 32 "
eq "tune --max-advance: largest K" "$(column advance | tr ' ' '\n' | sort -g | tail -n 1)" "2"
usage_error "tune search too large" "--batch" tune --profile "$PROF" --batch 65536 --mem-limit 1M
usage_error "tune --min-micro over --batch" "--min-micro" tune --profile "$PROF" --batch 4 --mem-limit 1M --min-micro 8
# One core for both ranks: an iteration lasts at least all compute; at M = 1 that is 2 stages x (F + B) =
# 2 x 3 x (1000 + 32) us per 32 samples = 193.5 us per sample.
t "tune --cores 1" 0 tune --profile "$PROF" --batch 32 --mem-limit 1M --cores 1 --top 1 --summary tsv
eq "tune --cores 1: time per sample" "$(column pred_time_per_sample)" "0.0001935"
usage_error "tune --cores -1" "--cores" tune --profile "$PROF" --batch 32 --mem-limit 1M --cores -1
t "tune nothing fits" 1 tune --profile "$PROF" --batch 32 --mem-limit 1
has "tune nothing fits" "$ERR" "no setting fits --mem-limit"
usage_error "tune no --profile" "--profile" tune --batch 32 --mem-limit 1M
usage_error "tune no --batch" "--batch" tune --profile "$PROF" --mem-limit 1M
usage_error "tune no --mem-limit" "--mem-limit" tune --profile "$PROF" --batch 32
usage_error "tune --batch 0" "--batch" tune --profile "$PROF" --batch 0 --mem-limit 1M
usage_error "tune --max-pipes 0" "--max-pipes" tune --profile "$PROF" --batch 32 --mem-limit 1M --max-pipes 0
usage_error "tune --top -1" "--top" tune --profile "$PROF" --batch 32 --mem-limit 1M --top -1
usage_error "tune interleaved" "interleaved" tune --profile "$PROF" --batch 32 --mem-limit 1M --schedule interleaved
usage_error "tune --opt-bytes-per-param -8" "--opt-bytes-per-param" tune --profile "$PROF" --batch 32 --mem-limit 1M --opt-bytes-per-param -8
for size in 0 -1 12Q K 1.5X 1e400 0.5 ""; do
    usage_error "tune --mem-limit '$size'" "--mem-limit" tune --profile "$PROF" --batch 32 --mem-limit "$size"
done
usage_error "tune flag of another command" "--stages" tune --profile "$PROF" --batch 32 --mem-limit 1M --stages 4
usage_error "tune missing profile file" "nonexistent" tune --profile "$TMP/nonexistent.prof" --batch 32 --mem-limit 1M
usage_error "tune profile is a directory" "directory" tune --profile "$TMP" --batch 32 --mem-limit 1M
# Broken profiles: the library's message, naming the line; exit 2.
broken() { # broken NAME WORD SED-EXPRESSION : the synthetic profile edited by sed must fail naming WORD
    sed "$3" "$PROF" >"$TMP/broken.prof"
    usage_error "tune profile $1" "$2" tune --profile "$TMP/broken.prof" --batch 32 --mem-limit 1M
}
broken "missing field" "line 5: missing field 'end'" '5s/ end=[^ ]*//'
broken "wrong units" "line 5: field 'end' needs a number" '5s/ end=[^ ]*/ end=1ms/'
broken "negative time" "line 6: field 'start' needs a number" '6s/start=[^ ]*/start=-0.5/'
broken "end before start" "line 7: end" '7s/end=[^ ]*/end=0.000000001/'
broken "unknown op kind" "line 8: field 'kind'" '8s/kind=B/kind=X/'
broken "unknown schedule kind" "line 2: field 'kind'" '2s/kind=1f1b/kind=pipedream/'
broken "shape without samples" "line 2: missing field 'samples'" '2s/ samples=[^ ]*//'
broken "garbage line" "line 9: unknown record" '9s/^op/qp/'
broken "no header" "line 1" '1d'
broken "op before shape" "line 2: 'op' before any 'shape' line" '2,4d'
broken "nan" "line 5" '5s/start=[^ ]*/start=nan/'
broken "huge shape" "whole number in 1..1000000" '2s/micro=8/micro=1000000000/'
broken "activations beyond 2^50 bytes" "line 3: field 'act_bytes' needs a number from 0 to 1125899906842624" '3s/act_bytes=[^ ]*/act_bytes=1e30/'
printf '\001\377\376garbage\000\n\342\202' >"$TMP/garbage.prof"
usage_error "tune binary garbage" "not a profile (text): byte 0 is 0x01" tune --profile "$TMP/garbage.prof" --batch 32 --mem-limit 1M
: >"$TMP/empty.prof"
usage_error "tune empty profile" "empty.prof" tune --profile "$TMP/empty.prof" --batch 32 --mem-limit 1M

# ---- tune with per-layer costs: the stage partitioner ----------------------------------------------
# The synthetic profile plus 'layer' lines: 4 layers whose costs per sample are 3, 1, 1, 1 (forward
# x 1e-6 s, backward twice that), no constant term, and an 'averaging' line. Two stages balance as 1,3
# (3 against 3); four as one layer each. The profiled grouping is 2 + 2 (stage 0 holds layers 0-1).
cp "$PROF" "$TMP/layers.prof"
awk 'BEGIN { split("3 1 1 1", w, " "); for (l = 0; l < 4; l++)
    printf "layer %d stage=%d f_a=0 f_b=%g b_a=0 b_b=%g param_floats=500 act_bytes=16\n", l, (l >= 2 ? 1 : 0), w[l + 1] * 1e-6, 2 * w[l + 1] * 1e-6
    print "averaging floats=1000 seconds=1e-6" }' >>"$TMP/layers.prof"
t "tune layers" 0 tune --profile "$TMP/layers.prof" --batch 32 --mem-limit 1G --max-pipes 2
has "tune layers: split 1,3" "$OUT" "split 1,3 (layers per stage, of 4 layers)"
has "tune layers: the bound" "$OUT" "the busiest stage does 50.0% of the work"
has "tune layers: averaging fitted" "$OUT" "averaging 1 ns per parameter"
t "tune layers --stages 4 tsv" 0 tune --profile "$TMP/layers.prof" --batch 32 --mem-limit 1G --max-pipes 2 --stages 4 --top 2 --summary tsv
eq "tune layers --stages 4: split column" "$(column split)" "1,1,1,1 1,1,1,1"
t "tune layers --stages 1" 0 tune --profile "$TMP/layers.prof" --batch 32 --mem-limit 1G --max-pipes 2 --stages 1 --top 1 --summary tsv
eq "tune layers --stages 1: split column" "$(column split)" "4"
usage_error "tune layers --stages 5" "stages" tune --profile "$TMP/layers.prof" --batch 32 --mem-limit 1G --stages 5
usage_error "tune --stages without layers" "no 'layer' lines" tune --profile "$PROF" --batch 32 --mem-limit 1M --stages 3
t "tune without layers: no split column" 0 tune --profile "$PROF" --batch 32 --mem-limit 1M --top 1 --summary tsv
eq "tune without layers: columns" "$(head -n 1 "$OUT" | tr '\t' '\n' | tail -n 1)" "fits"
sed 's/^layer 2 stage=1/layer 2 stage=0/; s/^layer 3 stage=1/layer 3 stage=3/' "$TMP/layers.prof" >"$TMP/broken.prof"
usage_error "tune layer stage out of order" "stage" tune --profile "$TMP/broken.prof" --batch 32 --mem-limit 1M
sed 's/^layer 1 /layer 7 /' "$TMP/layers.prof" >"$TMP/broken.prof"
usage_error "tune layer out of order" "layer 7 where layer 1 comes next" tune --profile "$TMP/broken.prof" --batch 32 --mem-limit 1M

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
