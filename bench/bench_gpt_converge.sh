#!/bin/sh
# bench_gpt_converge: time to a validation loss on the main job's transformer (build/gpt: the byte-level GPT,
# 4 blocks of 128 channels, on the fortunes corpus). The paper's claim: elastic averaging of N parallel
# pipelines reaches a loss sooner than one pipeline with an N times larger batch. Five configurations, all on
# the same fixed pipeline (no tuner): 2 stages, --split 3,3, --schedule zbh1, --micro 8 (the tuner's choice on
# this model: README, "ZB-H1 with M = 8 micro-batches of 2 windows, N = 1 and the split 3,3"), and the tuner's:
#   N=1, batch B        --pipes 1 --batch 16          (plain training; 8 micro-batches of 2 windows)
#   N=2, batch B each   --pipes 2 --batch 16          (elastic averaging, alpha 0.1: gpt's default)
#   N=4, batch B each   --pipes 4 --batch 16
#   N=1, batch 2B       --pipes 1 --batch 32          (same M = 8, so micro-batches of 4 windows)
#   N=1, batch 4B       --pipes 1 --batch 64          (micro-batches of 8 windows)
#   tuner (N auto)      --stages 2 alone               (split, schedule, M, N and the batch, 16, 32 or 64, the tuner's
#                                                       choice by time to target; --steps K, divided by the tuner
#                                                       when it takes a larger batch: the same tokens)
# The same training tokens for every configuration. gpt's --steps K counts batches (of --batch windows per
# pipeline) over the whole run, each of the N models taking K / N of them, so N = 1, 2, 4 pipelines of batch B
# all get --steps K (K x 16 windows), and one pipeline of batch kB gets --steps K / k: it takes K / k optimizer
# steps, as each of the k averaged models does. The learning rate (3e-3) is the same everywhere (no scaling
# for the larger batch); the warm-up is 5% of each model's own steps (gpt's default shape: 100 of 2,000), then
# cosine decay. K = 640 x TOKENS_SCALE (a multiple of 32: whole runtime iterations for N = 4 and batch 4B);
# K = 640 is 10,240 windows, about 0.55M tokens: about a minute of training per run here.
# The validation loss (gpt's 60 fixed validation micro-batches, of the reference model: the average of the N)
# is printed every K / 10 batches of B windows (every K / 10k for batch kB: the same tokens), with the progress
# line of that step (--log-every = --eval-every) whose last field is the training time so far (the runtime's
# iterations only: no start-up, no evaluations). gpt skips that evaluation at the last step and evaluates all
# validation windows instead, a different set: the curves (9 points) end at 90% of the tokens, and "final" is
# that last full evaluation.
# Time to a threshold: the first evaluation at or below it, linearly interpolated (time and tokens) from the one
# before; median over the seeds, a seed that never reached it counting as infinitely slow (so the median is
# "-" unless most seeds reached it); spread = slowest / fastest of the seeds that reached it. Thresholds: by
# default three, from the medians over the seeds of each configuration's last curve point: the worst
# configuration's + 0.02 (every configuration gets there), N=1 batch B's + 0.02 (what plain training reaches at
# its end), and halfway between, + 0.02; or a list (THRESHOLDS, e.g. 3.8,3.5). Tokens are non-padding targets, pro rata of
# the run's total (gpt's done line). "vs N=1" divides by N=1 batch B's median; "vs Nx batch" divides N pipelines'
# median by that of one pipeline with the N times larger batch (< 1: elastic averaging reached it sooner).
# Runs interleave: for each seed every configuration once, the order rotated by the seed. Runs during which
# other programs used >= BENCH_MAX_OTHERS cores (default 0.15) are waited out and redone, at most BENCH_RETRIES
# times (default here 1: the runs are long), after waiting up to CONVERGE_WAIT seconds (default 120) for a quiet
# machine before each run (bench/bench_lib.sh); CONVERGE_KEEP=DIR keeps every run's output, CONVERGE_FROM=DIR
# prints the tables again from such a directory without running anything (missing runs left out).
# Default: 6 configurations x 3 seeds, about 10 minutes on 2 cores at 26k tokens/s (12-04; 5 took 17 at 11k on 12-03).
# Not part of the tests.
# Figures (2026-12-03, 06:14-06:44 UTC; 2 vCPUs, Xeon with AVX-512, OpenBLAS 0.3.21 kernel SkylakeX; the
# defaults: 3 seeds, K = 640, 0.555M tokens per run; 6 runs redone, and 4 kept runs had other programs on 0.2-0.8
# cores, so time spreads reach 1.8). Tokens/s are about equal (medians 11.2k N=1, 11.1k N=2, 11.5k N=4, 11.7k
# batch 2x, 11.5k batch 4x), so time follows tokens. The elastic averaging of N pipelines does NOT reach a loss
# sooner than one pipeline with the N x batch here, and both lose to plain N=1 batch 16. Median bits/byte at the
# last curve point (0.50M tokens): N=1 3.265, N=2 3.552, N=4 3.776, batch 2x 3.418, batch 4x 3.710 (final, all
# windows: 3.232, 3.536, 3.763, 3.389, 3.689). Time (tokens) to 3.80, which all reach: N=1 12.9 s (0.14M); N=2
# 17.4 s (0.19M) against batch 2x 17.5 s (0.20M), 0.99x; N=4 35.1 s (0.41M) against batch 4x 32.4 s (0.32M),
# 1.09x. To 3.54: N=1 27.4 s, batch 2x 34.5 s (3/3 seeds), N=2 only 1 seed of 3 within the run, N=4 and batch
# 4x none. To 3.29: N=1 only, 42.0 s. At every token count the N models' average is behind the N x batch
# (N=2 reaches the 3.80 plateau as early, then falls behind). Not varied here: alpha, the lr of the larger batch,
# longer runs.
# The tuner's row: per threshold its time per seed against the grid's best configuration (the least median
# time of the five), the regret (target <= 10%), its choice and predicted windows/s; and the noise scale the 2x
# and 4x rows imply (avgpipe_tune_noise_from_ratio's formula on their tokens to the threshold over N=1's), which
# is how gpt.c's TUNE_NOISE_RATIO was set. 2026-12-04 (21:43-21:53 UTC, 2 vCPUs, Haswell kernel, 26-27k tokens/s
# for every configuration; the runs are deterministic, so the grid's tokens to each threshold equal the 12-03
# run's): the tuner chose ZB-H1, batch 16, M = 8, N = 1 for all 3 seeds, the grid's best and fixed pipeline
# (its final bits equal N=1's); regret to 3.80: -4.5%, +0.6%, -6.8% (median -4.5%); to 3.54: +3.2, +2.1, -2.7%;
# to 3.28: +0.7, +2.2, -2.8% (the same setting's own timing noise); implied noise scale 20.6 (2x) and 21.0 (4x)
# windows. That confirms the choice the calibrated noise scale makes, not the calibration on new data.
# Usage: sh bench/bench_gpt_converge.sh [BUILD_DIR] [SEEDS] [TOKENS_SCALE] [THRESHOLDS]
#        (tiny: sh bench/bench_gpt_converge.sh build 1 0.2)
set -eu
B=${1:-build}
SEEDS=${2:-3}
SCALE=${3:-1}
THRESHOLDS=${4:-auto}
BENCH_RETRIES=${BENCH_RETRIES:-1}
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/bench_lib.sh"
[ -x "$B/gpt" ] || { echo "bench_gpt_converge: build first (sh scripts/build.sh gpt gpt_reference)" >&2; exit 2; }
[ -d /usr/share/games/fortunes ] || { echo "bench_gpt_converge: no fortunes corpus (apt-get install fortunes)" >&2; exit 2; }
TMP=$(mktemp -d "${TMPDIR:-/tmp}/bench_gpt_converge.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

BATCH=16
K=$(awk -v s="$SCALE" 'BEGIN { k = int(640 * s / 32 + 0.5) * 32; print (k < 64 ? 64 : k) }')
E=$(awk -v k="$K" 'BEGIN { e = int(k / 10 / 32 + 0.5) * 32; print (e < 32 ? 32 : e) }')
NCFG=6
PIPE="--stages 2 --split 3,3 --schedule zbh1 --micro 8"
TUNED="--stages 2" # the tuner's row: split, schedule, M, N and the batch (16, 32 or 64) its choice
# cfg_* I: label, flags, divisor of the steps (N for N pipelines: each model's own steps; k for batch kB)
cfg_label() { case $1 in 1) echo "N=1, batch $BATCH" ;; 2) echo "N=2, batch $BATCH each" ;; 3) echo "N=4, batch $BATCH each" ;;
    4) echo "N=1, batch $((2 * BATCH)) (2x)" ;; 5) echo "N=1, batch $((4 * BATCH)) (4x)" ;; 6) echo "tuner (N auto)" ;; esac; }
cfg_flags() { case $1 in 1) echo "--pipes 1 --batch $BATCH" ;; 2) echo "--pipes 2 --batch $BATCH" ;; 3) echo "--pipes 4 --batch $BATCH" ;;
    4) echo "--pipes 1 --batch $((2 * BATCH))" ;; 5) echo "--pipes 1 --batch $((4 * BATCH))" ;; 6) echo "$TUNED" ;; esac; }
cfg_pipe() { [ "$1" = 6 ] || echo "$PIPE"; }
cfg_own() { case $1 in 1) echo 1 ;; 2) echo 2 ;; 3) echo 4 ;; 4) echo 2 ;; 5) echo 4 ;; 6) echo 1 ;; esac; } # models' steps = K / this
cfg_steps() { case $1 in 4) echo $((K / 2)) ;; 5) echo $((K / 4)) ;; *) echo "$K" ;; esac; }
cfg_eval() { case $1 in 4) echo $((E / 2)) ;; 5) echo $((E / 4)) ;; *) echo "$E" ;; esac; }

if [ -x "$B/gpt_reference" ]; then
    kernel=$("$B/gpt_reference" --steps 1 --eval-every 0 --sample-len 0 --layers 1 --channels 16 --heads 1 --seq 8 | sed -n 's/^BLAS: \(.*\), 1 thread per.*/\1/p')
else
    kernel="(see the first run)"
fi
tok=$(awk -v k="$K" -v b="$BATCH" 'BEGIN { printf "%.2fM", k * b * 54.5 / 1e6 }')
echo "bench_gpt_converge: $NCFG configurations x $SEEDS seeds, interleaved; $K batches of $BATCH windows each (about $tok tokens), validation every $E; $(nproc) cores; $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "pipeline: $PIPE; lr 3e-3, warm-up 5% of each model's steps, alpha 0.1 (N >= 2)"
echo "BLAS: $kernel"
[ -n "${CONVERGE_FROM:-}" ] && echo "(no runs: the tables from the outputs kept in $CONVERGE_FROM)"

# run_one I SEED: one run; appends "I SEED step time tokens bpb" lines to $TMP/curves, "I SEED ..." to $TMP/runs
nrun=0
total=$((NCFG * SEEDS))
run_one() {
    i=$1; rs=$2
    st=$(cfg_steps "$i"); ev=$(cfg_eval "$i")
    wu=$(awk -v k="$K" -v d="$(cfg_own "$i")" 'BEGIN { w = int(k / d / 20 + 0.5); print (w < 1 ? 1 : w) }')
    out="$TMP/out.$i.$rs"
    bench_wait_quiet "${CONVERGE_WAIT:-120}" # a build takes minutes: wait longer than bench_run's 30 s
    # shellcheck disable=SC2046
    bench_run "$out" "$B/gpt" $(cfg_pipe "$i") $(cfg_flags "$i") --steps "$st" --warmup "$wu" --eval-every "$ev" --log-every "$ev" --sample-len 0 --seed "$rs"
    if [ -n "${CONVERGE_KEEP:-}" ]; then
        mkdir -p "$CONVERGE_KEEP" && cp "$out" "$CONVERGE_KEEP/run.cfg$i.seed$rs.txt" && echo "$BENCH_OTHERS" >"$CONVERGE_KEEP/run.cfg$i.seed$rs.others"
    fi
    parse_out "$out" "$i" "$rs" "$BENCH_OTHERS"
    nrun=$((nrun + 1))
    last=$(tail -n 1 "$TMP/runs")
    echo "run $nrun/$total: seed $rs, $(cfg_label "$i"): --steps $st --warmup $wu: $(echo "$last" | awk '{ printf "%s s of training at %s tokens/s, curve ends at %s, final %s bits/byte; others %s cores", $4, $6, $7, $3, $8 }')" >&2
}

# parse_out FILE I SEED OTHERS: the curve of one run's output to $TMP/curves, its summary to $TMP/runs
parse_out() {
    [ "$kernel" = "(see the first run)" ] && kernel=$(sed -n 's/^BLAS: \(.*\), 1 thread per.*/\1/p' "$1" | head -n 1)
    [ "$2" = 6 ] && sed -n "s/^gpt: tuner: chose \([^:]*\): predicted \([0-9]*\) windows.*tuning took \([0-9.]*\) s.*/$3 \1|\2|\3/p" "$1" >>"$TMP/chose"
    awk -v i="$2" -v s="$3" -v oth="$4" -v runs="$TMP/runs" '
        /^step +[0-9]+\/[0-9]+ \|/ { split($2, a, "/"); t[a[1] + 0] = $(NF - 1) }
        /^step +[0-9]+ \| validation/ { n++; st[n] = $2 + 0; for (f = 1; f <= NF; f++) if ($f == "bits/byte") v[n] = $(f - 1) }
        /^done:/ { steps = $2; for (f = 1; f <= NF; f++) { if ($f == "tokens" && $(f + 1) == "in") tokens = $(f - 1); if ($f == "training:") tps = $(f + 1) }
                   sub(/.* tokens in /, ""); train = $1 + 0 }
        /^validation:/ { final = $4 }
        END {
            for (j = 1; j <= n; j++) printf "%s %s %d %s %.0f %s\n", i, s, st[j], t[st[j]], tokens * st[j] / steps, v[j]
            printf "%s %s %s %s %s %s %s %s\n", i, s, final, train, tokens, tps, (n ? v[n] : "-"), oth >> runs
        }' "$1" >>"$TMP/curves"
}

: >"$TMP/curves"
: >"$TMP/runs"
: >"$TMP/chose"
s=1
while [ "$s" -le "$SEEDS" ]; do
    j=0
    while [ "$j" -lt "$NCFG" ]; do
        c=$(((j + s - 1) % NCFG + 1))
        if [ -z "${CONVERGE_FROM:-}" ]; then
            run_one "$c" "$s"
        elif [ -f "$CONVERGE_FROM/run.cfg$c.seed$s.txt" ]; then # the tables again from kept outputs (missing runs left out)
            o=$(cat "$CONVERGE_FROM/run.cfg$c.seed$s.others" 2>/dev/null || echo "?")
            parse_out "$CONVERGE_FROM/run.cfg$c.seed$s.txt" "$c" "$s" "$o"
        fi
        j=$((j + 1))
    done
    s=$((s + 1))
done

L1=$(cfg_label 1); L2=$(cfg_label 2); L3=$(cfg_label 3); L4=$(cfg_label 4); L5=$(cfg_label 5); L6=$(cfg_label 6)
echo
echo "validation bits/byte (60 micro-batches) by training tokens: median over $SEEDS seeds, and the median training seconds"
awk -v n="$NCFG" -v S="$SEEDS" -v l1="$L1" -v l2="$L2" -v l3="$L3" -v l4="$L4" -v l5="$L5" -v l6="$L6" '
    function med(arr, cnt,   a, b, x, k) { for (a = 1; a <= cnt; a++) x[a] = arr[a]
        for (a = 2; a <= cnt; a++) for (b = a; b > 1 && x[b - 1] > x[b]; b--) { k = x[b]; x[b] = x[b - 1]; x[b - 1] = k }
        return cnt % 2 ? x[(cnt + 1) / 2] : (x[cnt / 2] + x[cnt / 2 + 1]) / 2 }
    { c = $1; s = $2; p = ++np[c, s]; tk[c, p] += $5; tn[c, p]++; B[c, p, s] = $6; T[c, p, s] = $4; if (p > P) P = p }
    END {
        lab[1] = l1; lab[2] = l2; lab[3] = l3; lab[4] = l4; lab[5] = l5; lab[6] = l6
        printf "%9s", "Mtokens"; for (c = 1; c <= n; c++) printf "  %-24s", lab[c]; printf "\n"
        for (p = 1; p <= P; p++) {
            printf "%9.3f", tn[1, p] ? tk[1, p] / tn[1, p] / 1e6 : 0
            for (c = 1; c <= n; c++) { m = 0; for (s = 1; s <= S; s++) if ((c, p, s) in B) { m++; xb[m] = B[c, p, s]; xt[m] = T[c, p, s] }
                if (m) printf "  %5.3f %7.1f s          ", med(xb, m), med(xt, m); else printf "  %-24s", "-" }
            printf "\n"
        }
    }' "$TMP/curves"

if [ "$THRESHOLDS" = auto ]; then
    f=$(awk '$1 == 1 && $7 != "-" { print $7 }' "$TMP/runs" | bench_median)
    w=$f
    for c in 2 3 4 5; do
        m=$(awk -v c="$c" '$1 == c && $7 != "-" { print $7 }' "$TMP/runs" | bench_median)
        [ -n "$m" ] && w=$(awk -v a="$w" -v b="$m" 'BEGIN { print (b > a ? b : a) }')
    done
    THRESHOLDS=$(awk -v f="$f" -v w="$w" 'BEGIN { printf "%.2f,%.2f,%.2f", w + 0.02, (w + f) / 2 + 0.02, f + 0.02 }')
    echo "thresholds: the worst configuration's last curve point (median $w) + 0.02 (every configuration reaches it), halfway to N=1 batch $BATCH's (median $f) + 0.02, and that + 0.02 bits/byte"
fi

for th in $(echo "$THRESHOLDS" | tr ',' ' '); do
    echo
    echo "to $th bits/byte (60 validation micro-batches):"
    printf '%-24s %7s %8s %7s %8s %8s %11s %9s %9s %8s\n' configuration reached train_s spread Mtokens "vs N=1" "vs Nx batch" final_bpb tokens/s others
    awk -v n="$NCFG" -v S="$SEEDS" -v th="$th" -v runs="$TMP/runs" -v l1="$L1" -v l2="$L2" -v l3="$L3" -v l4="$L4" -v l5="$L5" -v l6="$L6" -v chose="$TMP/chose" -v bt="$BATCH" '
        function med(arr, cnt,   a, b, x, k) { for (a = 1; a <= cnt; a++) x[a] = arr[a]
            for (a = 2; a <= cnt; a++) for (b = a; b > 1 && x[b - 1] > x[b]; b--) { k = x[b]; x[b] = x[b - 1]; x[b - 1] = k }
            return cnt % 2 ? x[(cnt + 1) / 2] : (x[cnt / 2] + x[cnt / 2 + 1]) / 2 }
        { c = $1; s = $2
          if (!((c, s) in hit) && $6 <= th) {
              if ((c, s) in pt && pb[c, s] > th) { w = (pb[c, s] - th) / (pb[c, s] - $6); ht[c, s] = pt[c, s] + w * ($4 - pt[c, s]); hk[c, s] = pk[c, s] + w * ($5 - pk[c, s]) }
              else { ht[c, s] = $4; hk[c, s] = $5 }
              hit[c, s] = 1 }
          pt[c, s] = $4; pk[c, s] = $5; pb[c, s] = $6 }
        END {
            INF = 1e30
            while ((getline line < runs) > 0) { split(line, r, " "); fin[r[1], r[2]] = r[3]; tps[r[1], r[2]] = r[6]; oth[r[1], r[2]] = oth[r[1], r[2]] (oth[r[1], r[2]] == "" ? "" : ",") r[8] }
            lab[1] = l1; lab[2] = l2; lab[3] = l3; lab[4] = l4; lab[5] = l5; lab[6] = l6
            for (c = 1; c <= n; c++) {
                ok = 0; m = 0; lo = INF; hi = 0; os = ""
                for (s = 1; s <= S; s++) {
                    if (!((c, s) in fin)) continue
                    m++; xt[m] = (c, s) in hit ? ht[c, s] : INF; xk[m] = (c, s) in hit ? hk[c, s] : INF
                    if ((c, s) in hit) { ok++; if (ht[c, s] < lo) lo = ht[c, s]; if (ht[c, s] > hi) hi = ht[c, s] }
                    xf[m] = fin[c, s]; xr[m] = tps[c, s]; os = os (m > 1 ? "," : "") oth[c, s] }
                if (!m) { mt[c] = mk[c] = INF; mf[c] = mr[c] = 0; rc[c] = 0; cn[c] = 0; sp[c] = "-"; ot[c] = "-"; continue }
                mt[c] = med(xt, m); mk[c] = med(xk, m); mf[c] = med(xf, m); mr[c] = med(xr, m); rc[c] = ok; cn[c] = m; sp[c] = ok ? sprintf("%.2f", hi / lo) : "-"; ot[c] = os }
            for (c = 1; c <= n; c++) {
                vs1 = mt[c] < INF && mt[1] < INF ? sprintf("%.2fx", mt[c] / mt[1]) : "-"
                ref = c == 2 ? 4 : c == 3 ? 5 : 0
                vsb = ref && mt[c] < INF && mt[ref] < INF ? sprintf("%.2fx", mt[c] / mt[ref]) : ref ? "-" : ""
                printf "%-24s %7s %8s %7s %8s %8s %11s %9s %9s %8s\n", lab[c], rc[c] "/" cn[c], mt[c] < INF ? sprintf("%.1f", mt[c]) : "-", sp[c],
                    mk[c] < INF ? sprintf("%.3f", mk[c] / 1e6) : "-", vs1, vsb, cn[c] ? sprintf("%.3f", mf[c]) : "-", cn[c] ? sprintf("%.0f", mr[c]) : "-", ot[c]
            }
            for (k = 2; k <= 4; k *= 2) { # the noise scale the larger batches imply (avgpipe_tune_noise_from_ratio)
                c = k == 2 ? 4 : 5
                if (mk[1] < INF && mk[c] < INF) { rt = mk[c] / mk[1]; lo = 1 + 0.001 * (k - 1); hi = 1 + 0.999 * (k - 1); rt = rt < lo ? lo : rt > hi ? hi : rt
                    printf "noise scale implied by %s: %.2fx the tokens of %s, so B_noise = %.1f windows\n", lab[c], mk[c] / mk[1], lab[1], bt * (k - rt) / (rt - 1) }
            }
            if (n < 6 || !cn[6]) exit
            best = 0 # the best of the grid: the least median time among configurations 1-5
            for (c = 1; c <= 5; c++) if (cn[c] && mt[c] < INF && (!best || mt[c] < mt[best])) best = c
            while ((getline line < chose) > 0) { k = index(line, " "); ch[substr(line, 1, k - 1)] = substr(line, k + 1) }
            if (!best) { print "tuner: no configuration of the grid reached it"; exit }
            bs = ""; for (s = 1; s <= S; s++) if ((best, s) in fin) bs = bs (bs == "" ? "" : ", ") ((best, s) in hit ? sprintf("%.1f", ht[best, s]) : "-")
            printf "tuner: time to %s against the grid'"'"'s best, %s (median %.1f s; its seeds: %s):\n", th, lab[best], mt[best], bs
            m = 0
            for (s = 1; s <= S; s++) {
                if (!((6, s) in fin)) continue
                split(ch[s], q, "|")
                if ((6, s) in hit) { x[++m] = 100 * (ht[6, s] / mt[best] - 1); rg = sprintf("%.1f s: regret %+.1f%%", ht[6, s], x[m]) } else { x[++m] = INF; rg = "not reached" }
                printf "  seed %d: %s (predicted %s windows/s; tuning %s s): %s\n", s, q[1], q[2], q[3], rg
            }
            w = x[1]; for (k = 2; k <= m; k++) if (x[k] > w) w = x[k]
            v = med(x, m)
            printf "tuner: median regret %s, worst %s (target <= 10%%: %s)\n", v < INF ? sprintf("%+.1f%%", v) : "-", w < INF ? sprintf("%+.1f%%", w) : "-",
                v < INF && v <= 10 ? "met" : "not met"
        }' "$TMP/curves"
done
echo
echo "train_s: training seconds (median over seeds) to the threshold; final_bpb: all validation windows at the end (median); others: cores other programs used during each seed's run"
echo "$BENCH_REDONE runs redone because other programs used >= $BENCH_MAX_OTHERS cores; kernel: $kernel; $(nproc) cores"
