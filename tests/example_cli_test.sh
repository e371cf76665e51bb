#!/bin/sh
# example_cli_test.sh PROGRAM KIND: the command line of the MLP trainers (examples/mlp_app.h).
# KIND is fashion_mnist or cuda_mlp. Every bad command line must exit with status 2 and say what is
# wrong in one line on stderr, before any data is read or any device is touched (so this runs anywhere,
# cuda_mlp included, without a GPU); --help exits with 0.
set -u
prog=$1
kind=$2
fails=0
n=0
out=$(mktemp)
err=$(mktemp)
trap 'rm -f "$out" "$err"' EXIT

# bad EXPECTED-FRAGMENT ARGS...: exit status 2 and the fragment on stderr, one line, nothing on stdout
bad() {
    want=$1
    shift
    n=$((n + 1))
    timeout 20 "$prog" "$@" >"$out" 2>"$err" </dev/null
    rc=$?
    if [ "$rc" -ne 2 ] || ! grep -qF -- "$want" "$err" || [ "$(wc -l <"$err")" -ne 1 ] || [ -s "$out" ]; then
        echo "FAIL: $kind $*: exit status $rc (want 2), stderr:"
        sed 's/^/    /' "$err"
        echo "    (want one line with: $want)"
        fails=$((fails + 1))
    fi
}

n=$((n + 1))
if ! timeout 20 "$prog" --help >"$out" 2>"$err" || ! grep -q "^usage: $kind" "$out" || ! grep -q -- "--stop-after" "$out"; then
    echo "FAIL: $kind --help"
    fails=$((fails + 1))
fi

# the shared flags (both programs)
bad "unknown option '--bogus'" --bogus
bad "unexpected argument 'stray'" stray
bad "missing value after --stages" --stages
bad "--stages expects an integer in [1," --stages 0
bad "--pipes expects an integer" --pipes x
bad "--batch 100 is not a multiple of --micro 8" --batch 100 --micro 8 --pipes 1
bad "--schedule expects afab, 1f1b" --schedule foo
bad "--schedule expects afab, 1f1b" --schedule custom
bad "--schedule interleaved needs fixed --micro and --pipes" --schedule interleaved
bad "--schedule zbv needs fixed --micro and --pipes" --schedule zbv
bad "--stages 4 is not a multiple of 3" --schedule interleaved --micro 4 --pipes 1 --chunks 3
bad "--chunks applies only to --schedule interleaved" --chunks 2
bad "--advance 3 needs fixed --micro and --pipes" --advance 3
bad "--advance 3 applies only to --schedule advance" --advance 3 --micro 4 --pipes 2 --schedule 1f1b
bad "--mem-limit expects a size in bytes" --mem-limit 64Q
bad "--checkpoint-every needs --checkpoint DIR" --checkpoint-every 5
bad "--stop-after 11 is past --epochs 10" --stop-after 11
bad "--alpha expects a number in [0, 1]" --alpha 2
bad "--alpha expects a number" --alpha nan
bad "--seed expects an integer" --seed -1
bad "--replicas expects an integer in [1, 8]" --replicas 9
bad "--schedule dualpipev needs --pipes x --micro >= 2 x ranks" --schedule dualpipev --micro 1 --pipes 1
bad "--trace /nonexistent-dir/x.json: cannot create" --trace /nonexistent-dir/x.json --micro 4 --pipes 1
bad "--save /nonexistent-dir/x: cannot create" --save /nonexistent-dir/x --micro 4 --pipes 1
bad "--objective expects time or throughput, got 'speed'" --objective speed
bad "--objective applies only to the tuner" --objective throughput --micro 4 --pipes 2

case $kind in
fashion_mnist)
    bad "--backend expects threads or mpi, got 'nccl'" --backend nccl
    bad "--mem-limit applies only to the tuner" --mem-limit 64M --micro 4 --pipes 2 --split 1,1,1,1
    bad "--split: 2 stage partitions listed, --stages is 4" --split 1,1
    bad "--evals-per-epoch applies only with --target-acc" --evals-per-epoch 3
    bad "--priorities expects on or off" --priorities maybe
    bad "--bind expects none, report, auto or always" --bind nowhere
    bad "--target-acc expects a number" --target-acc 2
    bad "unknown option '--device'" --device 1
    ;;
cuda_mlp)
    bad "--backend expects threads or nccl, got 'mpi'" --backend mpi
    bad "--mem-limit applies only to the tuner (--micro auto or --pipes auto)" --mem-limit 64M --micro 4 --pipes 2
    bad "--nccl-id applies only to --backend nccl" --nccl-id /tmp/x
    bad "--device expects an integer in [0, 1023]" --device -1
    bad "unknown option '--split'" --split 1,1,1,1
    ;;
*)
    echo "usage: example_cli_test.sh PROGRAM fashion_mnist|cuda_mlp"
    exit 2
    ;;
esac

echo "example_cli_test: $kind: $((n - fails)) of $n command lines handled as expected"
[ "$fails" -eq 0 ]
