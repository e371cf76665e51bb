#!/bin/sh
# gpt_cli_test.sh PROGRAM: the command line of the GPT trainer (examples/gpt.c). Every bad command line must
# exit with status 2 and say what is wrong in one line on stderr, with nothing on stdout, before any data is
# read; --help exits with 0; a missing corpus is an error (status 1, one line) that names the Debian package.
set -u
prog=$1
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
        echo "FAIL: gpt $*: exit status $rc (want 2), stderr:"
        sed 's/^/    /' "$err"
        echo "    (want one line with: $want)"
        fails=$((fails + 1))
    fi
}

n=$((n + 1))
if ! timeout 20 "$prog" --help >"$out" 2>"$err" || ! grep -q "^usage: gpt" "$out" || ! grep -q -- "--seq T" "$out" ||
    ! grep -q -- "--stop-after" "$out"; then
    echo "FAIL: gpt --help"
    fails=$((fails + 1))
fi

bad "unknown option '--bogus'" --bogus
bad "unexpected argument 'stray'" stray
bad "missing value after --stages" --stages
bad "--stages expects an integer in [1," --stages 0
bad "--stages 7: the model has 6 layers" --stages 7
bad "--pipes expects an integer" --pipes x
bad "--layers expects an integer in [0," --layers -1
bad "heads 3: want a divisor of the channels (128)" --heads 3
bad "--batch 10 is not a multiple of --micro 4" --batch 10 --micro 4
bad "--schedule expects afab, 1f1b" --schedule foo
bad "--schedule expects afab, 1f1b" --schedule custom
bad "--schedule interleaved needs fixed --micro and --pipes" --schedule interleaved
bad "--schedule zbv needs fixed --micro and --pipes" --schedule zbv
bad "--chunks applies only to --schedule interleaved" --chunks 2
bad "--stages 2 is not a multiple of 3" --schedule interleaved --micro 4 --pipes 1 --chunks 3
bad "--advance 3 needs fixed --micro and --pipes" --advance 3
bad "--advance 3 applies only to --schedule advance" --advance 3 --micro 4 --pipes 1 --schedule 1f1b
bad "--schedule dualpipev needs --pipes x --micro >= 2 x ranks" --schedule dualpipev --stages 4 --micro 1 --pipes 1
bad "--split: 3 stage partitions listed, --stages is 2" --split 2,2,2
bad "--split adds up to 4 layers; the model has 6" --split 2,2
bad "--split: split '3,x'" --split 3,x
bad "--mem-limit expects a size in bytes" --mem-limit 64Q
bad "--mem-limit applies only to the tuner" --mem-limit 64M --micro 4 --pipes 1 --split 3,3
bad "--objective expects time or throughput, got 'fast'" --objective fast
bad "--objective applies only to the tuner" --objective throughput --micro 4 --pipes 1
bad "--noise-scale applies only to the tuner" --noise-scale 100 --micro 4 --pipes 1
bad "--noise-scale expects a number in [0," --noise-scale -3
bad "--checkpoint-every needs --checkpoint DIR" --checkpoint-every 5
bad "--stop-after 5000 is past --steps 2000" --stop-after 5000
bad "--alpha expects a number in [0, 1]" --alpha 2
bad "--alpha expects a number" --alpha nan
bad "--seed expects an integer" --seed -1
bad "--replicas expects an integer in [1, 8]" --replicas 9
bad "--backend expects threads or mpi, got 'nccl'" --backend nccl
bad "--lr expects a number" --lr 0
bad "--save /nonexistent-dir/x: cannot create" --save /nonexistent-dir/x --micro 4 --pipes 1 --split 3,3

# a missing corpus: one line naming the package (after the BLAS line on stdout)
n=$((n + 1))
timeout 60 "$prog" --data /nonexistent-fortunes --micro 2 --pipes 1 --split 3,3 >"$out" 2>"$err" </dev/null
rc=$?
if [ "$rc" -ne 1 ] || ! grep -qF "/nonexistent-fortunes" "$err" || ! grep -qF "apt-get install fortunes" "$err" || [ "$(wc -l <"$err")" -ne 1 ]; then
    echo "FAIL: gpt --data /nonexistent-fortunes: exit status $rc (want 1), stderr:"
    sed 's/^/    /' "$err"
    fails=$((fails + 1))
fi

echo "gpt_cli_test: $n command lines, $fails failures"
[ "$fails" -eq 0 ]
