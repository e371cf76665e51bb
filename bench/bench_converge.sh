#!/bin/sh
# bench_converge: time to accuracy. Does averaging over parallel pipelines reach a test accuracy sooner?
# The main job's model (784-512-256-128-10, 4 stages, the tuned schedule, M and K: --micro auto, split
# auto) is trained until its reference model reaches TARGET test accuracy (fashion_mnist --target-acc,
# evaluated 4 times per epoch: a quarter-epoch resolution, the evaluations outside train_s; at most
# MAX_EPOCHS epochs, the learning rate cosine-decayed over them) by:
#   N = 1 pipeline, batch 128 (plain training);
#   N = 2 and N = 4 pipelines with alpha 0.1 and 0.3, batch 128 each (every model takes 1/N of the steps
#   of an epoch: the pipelines share each epoch's samples);
#   one pipeline with an N times larger batch (256, 512): the same samples per round as N pipelines;
#   the tuner's own choice (N auto too: what a user who gives no flags gets), whose time to the target is
#   then compared per seed with the best setting of the grid above (regret: its time over the best
#   median, minus 1; target <= 10%), with the N it chose and its tuning time (not in train_s).
# Each from SEEDS seeds (weights and sample order); the table gives the median epochs and seconds to the
# target over the seeds that reached it. Seconds: training time (iterations) and wall time (with the
# evaluations); the machine is shared, so the others column says how many cores other programs used
# during the runs (runs are redone while they use >= BENCH_MAX_OTHERS, default 0.15, up to 3 times).
# Default run: 8 settings x 3 seeds, about 4 minutes on a quiet 2-core machine (longer when runs are
# redone). Not part of the tests.
# Usage: sh bench/bench_converge.sh [BUILD_DIR] [SEEDS] [MAX_EPOCHS] [TARGET]
set -eu
B=${1:-build}
SEEDS=${2:-3}
MAXE=${3:-12}
TARGET=${4:-0.88}
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/bench_lib.sh"
[ -x "$B/fashion_mnist" ] || { echo "bench_converge: build first (sh scripts/build.sh)" >&2; exit 2; }
TMP=$(mktemp -d "${TMPDIR:-/tmp}/bench_converge.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

echo "bench_converge: 784-512-256-128-10 to test accuracy $TARGET (at most $MAXE epochs, cosine lr over them), $SEEDS seeds; $(nproc) cores"
"$B/fashion_mnist" --epochs 1 --limit-train 1024 --micro 4 --pipes 1 2>/dev/null | sed -n 's/^BLAS: /BLAS: /p'
printf '%-28s %7s %8s %9s %9s %9s  %s\n' setting reached epochs train_s wall_s samples/s "others (cores) / tuned setting of seed 1"
# setting LABEL FLAGS...: SEEDS runs, one table row
setting() {
    label=$1
    shift
    ep=""; tr=""; wa=""; rt=""; ok=0; oth=""; tuned=""; seeds=""
    s=1
    while [ "$s" -le "$SEEDS" ]; do
        bench_run "$TMP/out" "$B/fashion_mnist" --epochs "$MAXE" --target-acc "$TARGET" --evals-per-epoch 4 --seed "$s" "$@"
        oth="$oth $BENCH_OTHERS"
        [ "$s" = 1 ] && tuned=$(sed -n 's/.*tuner: chose \([^:]*\):.*/\1/p' "$TMP/out" | tail -n 1)
        line=$(grep '^reached' "$TMP/out" || true)
        t="-"
        if [ -n "$line" ]; then
            ok=$((ok + 1))
            t=$(echo "$line" | sed -n 's/.*: \([0-9.]*\) s training.*/\1/p')
            ep="$ep $(echo "$line" | sed -n 's/.* after \([0-9.]*\) epochs.*/\1/p')"
            tr="$tr $t"
            wa="$wa $(echo "$line" | sed -n 's/.*, \([0-9.]*\) s wall.*/\1/p')"
        fi
        sps=$(grep '^trained' "$TMP/out" | sed -n 's/.*(\([0-9][0-9]*\) samples\/s).*/\1/p')
        rt="$rt $sps"
        # per seed: training seconds to the target, the choice (N), the tuning time, predicted and measured samples/s
        seeds="$seeds;$t,$(sed -n 's/.*tuner: chose [^:]*N = \([0-9]*\).*/\1/p' "$TMP/out" | tail -n 1),$(sed -n 's/.*tuning took \([0-9.]*\) s.*/\1/p' "$TMP/out" | tail -n 1)"
        seeds="$seeds,$(sed -n 's/.*tuner: chose .*predicted \([0-9]*\) samples\/s.*/\1/p' "$TMP/out" | tail -n 1),$sps"
        s=$((s + 1))
    done
    med() { if [ -n "$1" ]; then echo $1 | bench_list | bench_median; else echo "-"; fi; }
    printf '%-28s %7s %8s %9s %9s %9s  %s / %s\n' "$label" "$ok/$SEEDS" "$(med "$ep")" "$(med "$tr")" "$(med "$wa")" "$(med "$rt")" \
        "$(echo $oth | tr ' ' ',')" "$tuned"
    echo "$label|$ok|$(med "$tr")|$(med "$ep")|$seeds" >>"$TMP/rows"
}
setting "N=1, batch 128" --pipes 1
setting "N=2, alpha 0.1, batch 128" --pipes 2 --alpha 0.1
setting "N=2, alpha 0.3, batch 128" --pipes 2 --alpha 0.3
setting "N=1, batch 256 (2x)" --pipes 1 --batch 256
setting "N=4, alpha 0.1, batch 128" --pipes 4 --alpha 0.1
setting "N=4, alpha 0.3, batch 128" --pipes 4 --alpha 0.3
setting "N=1, batch 512 (4x)" --pipes 1 --batch 512
setting "tuner (N auto)"
echo "(medians over the seeds that reached $TARGET; train_s: training time to the target, wall_s: with the evaluations;"
echo " samples/s over the whole run; $BENCH_REDONE runs redone because other programs used >= $BENCH_MAX_OTHERS cores)"
awk -F '|' -v seeds="$SEEDS" '
    NR == 1 { base = $3; basename = $1 }
    NR > 1 && $1 ~ /^N=[24]/ { if ($2 == seeds && $3 != "-" && (best == "" || $3 + 0 < best + 0)) { best = $3; bestname = $1 } }
    END {
        if (base == "-") { print "verdict: N=1 did not reach the target in every seed"; exit }
        if (best == "") print "verdict: no setting with parallel pipelines reached the target in every seed"
        else if (best + 0 < base + 0) printf "verdict: yes: %s reached it in %s s of training, N=1 in %s s (%.2fx sooner)\n", bestname, best, base, base / best
        else printf "verdict: no: the fastest with parallel pipelines, %s, took %s s of training, N=1 %s s\n", bestname, best, base
    }' "$TMP/rows"
# The tuner's regret: its time to the target per seed over the best median of the grid (every row but the
# tuner's that reached the target in every seed).
awk -F '|' -v seeds="$SEEDS" '
    $1 ~ /^tuner/ { tuner = $5; next }
    $2 == seeds && $3 != "-" && (best == "" || $3 + 0 < best + 0) { best = $3; bestname = $1; bestseeds = $5 }
    END {
        if (best == "") { print "tuner: no setting of the grid reached the target in every seed: no regret to report"; exit }
        n = split(tuner, s, ";"); k = 0; line = ""
        for (i = 2; i <= n; i++) {
            split(s[i], f, ",")
            if (f[1] == "-") { line = line sprintf("  seed %d: N = %s, did not reach the target\n", i - 1, f[2]); miss++; continue }
            r[++k] = f[1] / best - 1
            line = line sprintf("  seed %d: N = %s, %s s training (tuning %s s): regret %+.1f%%; predicted %s samples/s, measured %s (%+.0f%%)\n",
                                i - 1, f[2], f[1], f[3], 100 * r[k], f[4], f[5], f[5] > 0 ? 100 * (f[4] / f[5] - 1) : 0)
        }
        m = split(bestseeds, bs, ";"); own = ""
        for (i = 2; i <= m; i++) { split(bs[i], f, ","); own = own (i > 2 ? ", " : "") f[1] }
        printf "tuner: time to the target against the grid'"'"'s best, %s (median %s s; its seeds: %s s):\n%s", bestname, best, own, line
        if (miss) { printf "tuner: regret target (<= 10%%) NOT met: %d seed(s) missed the target\n", miss; exit }
        for (i = 1; i <= k; i++) for (j = i + 1; j <= k; j++) if (r[j] < r[i]) { t = r[i]; r[i] = r[j]; r[j] = t }
        med = k % 2 ? r[(k + 1) / 2] : (r[k / 2] + r[k / 2 + 1]) / 2
        printf "tuner: median regret %+.1f%%, worst %+.1f%% (target <= 10%%: %s)\n", 100 * med, 100 * r[k], med <= 0.10 ? "met" : "NOT met"
    }' "$TMP/rows"
