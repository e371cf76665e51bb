#!/bin/sh
# gpt_cmp_test.sh GPT GPT_REFERENCE [MPIRUN]: the pipelined GPT trainer (examples/gpt.c) against the plain
# loop (examples/gpt_reference.c), bit for bit. With --deterministic and one pipeline, every schedule kind
# must write the same --save file as the reference given the same model, batch, micro-batches, split, steps
# and seed (cmp): the runtime's tie (a + b in both wte copies) and its step agreement (the global norm of
# avgpipe_grad_sumsq / avgpipe_agree_combine, the clip scale of avgpipe_clip_scale) are the reference's
# arithmetic. Also: a checkpoint after half the steps and a resumed run equal one run; with MPIRUN (a build
# with MPI) every kind again with one rank per process. A tiny model, a few steps; every run under timeout.
# Needs the fortunes corpus (exit 77, skipped, without it).
set -u
gpt=$1
ref=$2
mpirun=${3:-}
data=/usr/share/games/fortunes
[ -d "$data" ] || { echo "skipped: no fortunes corpus at $data (apt-get install fortunes)"; exit 77; }
tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpt_cmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
fails=0
n=0
# clip 0.5: the clip scale is below 1 in most of these steps, so the agreement's arithmetic matters
shape="--layers 2 --channels 16 --heads 2 --seq 16 --batch 8 --micro 4 --steps 16 --warmup 4 --clip 0.5 --seed 3 --sample-len 0 --eval-every 0"

# run NAME CMD...: run it (bounded), its output in $tmp/NAME.log; 1 on failure (reported)
run() {
    name=$1
    shift
    timeout -k 5 120 "$@" >"$tmp/$name.log" 2>&1
    rc=$?
    [ "$rc" -eq 0 ] && return 0
    echo "FAIL: $name: exit status $rc ($*)"
    sed 's/^/    /' "$tmp/$name.log" | tail -n 15
    fails=$((fails + 1))
    return 1
}

# same NAME FILE REF: the two files are cmp-identical
same() {
    n=$((n + 1))
    if cmp -s "$2" "$3"; then
        echo "ok: $1"
    else
        echo "FAIL: $1: $2 and $3 differ ($(cmp "$2" "$3" 2>&1 | head -n 1))"
        fails=$((fails + 1))
    fi
}

# the references: 2 partitions (2 layers each), 3 and 4 (one layer each: middle partitions too); M = 4, and
# for 2 partitions M = 1 and 2 (the later --micro wins)
run ref2 "$ref" $shape --stages 2 --split 2,2 --save "$tmp/ref2" || exit 1
run ref3 "$ref" $shape --stages 3 --split 1,2,1 --save "$tmp/ref3" || exit 1
run ref4 "$ref" $shape --stages 4 --split 1,1,1,1 --save "$tmp/ref4" || exit 1
run ref2m1 "$ref" $shape --micro 1 --stages 2 --split 2,2 --save "$tmp/ref2m1" || exit 1
run ref2m2 "$ref" $shape --micro 2 --stages 2 --split 2,2 --save "$tmp/ref2m2" || exit 1

# KIND STAGES SPLIT REF [EXTRA...]: the threaded run, and over MPI (ranks = stages / partitions per rank)
check() {
    kind=$1 g=$2 split=$3 want=$4
    shift 4
    name="$kind-$g-threads"
    if run "$name" "$gpt" $shape --deterministic --pipes 1 --schedule "$kind" --stages "$g" --split "$split" --rounds 4 "$@" --save "$tmp/$name"; then
        same "$kind, $g partitions, threads${*:+ ($*)}" "$tmp/$name" "$tmp/$want"
    fi
    [ -n "$mpirun" ] || return 0
    case $kind in zbv | dualpipev | interleaved) np=$((g / 2)) ;; *) np=$g ;; esac
    name="$kind-$g-mpi"
    if run "$name" "$mpirun" --allow-run-as-root --oversubscribe --bind-to none -np "$np" "$gpt" --backend mpi $shape --deterministic --pipes 1 \
        --schedule "$kind" --stages "$g" --split "$split" --rounds 4 "$@" --save "$tmp/$name"; then
        same "$kind, $g partitions, MPI ($np processes)${*:+ ($*)}" "$tmp/$name" "$tmp/$want"
    fi
}

check afab 2 2,2 ref2
check 1f1b 2 2,2 ref2
check advance 2 2,2 ref2 --advance 1
check advance 2 2,2 ref2            # adaptive K
check zbh1 2 2,2 ref2
check 1f1b 2 2,2 ref2m1 --micro 1
check zbh1 2 2,2 ref2m2 --micro 2
check 1f1b 3 1,2,1 ref3
check advance 3 1,2,1 ref3 --advance 2
check 1f1b 4 1,1,1,1 ref4
check zbh1 4 1,1,1,1 ref4
check afab 4 1,1,1,1 ref4 --sync
check interleaved 4 1,1,1,1 ref4
check zbv 4 1,1,1,1 ref4
check dualpipev 4 1,1,1,1 ref4

# half the steps, a checkpoint, the other half resumed: the same file as one run
ck="$tmp/ckpt"
if run ckpt-first "$gpt" $shape --deterministic --pipes 1 --schedule 1f1b --stages 2 --split 2,2 --rounds 4 --stop-after 8 --checkpoint "$ck" &&
    run ckpt-resumed "$gpt" $shape --deterministic --pipes 1 --schedule 1f1b --stages 2 --split 2,2 --rounds 4 --resume "$ck" --save "$tmp/resumed"; then
    if grep -q "resumed from" "$tmp/ckpt-resumed.log"; then
        same "checkpoint after 8 of 16 steps + resumed run = one run" "$tmp/resumed" "$tmp/ref2"
    else
        echo "FAIL: the resumed run does not say it resumed"
        fails=$((fails + 1))
    fi
fi

echo "gpt_cmp_test: $n comparisons, $fails failures"
[ "$fails" -eq 0 ]
