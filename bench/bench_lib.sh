# bench_lib.sh — shared by the benchmark scripts (sourced): run a program while watching how much of
# the machine other programs take, and the statistics the scripts print. POSIX sh + awk. Its variables
# start with _bl_ (sh functions share the caller's variables: a loop counter named i would be clobbered).
#
# The machines are shared: another user's compiler can take a core for minutes, which on 2 cores halves
# what two stage threads can do. /proc/stat counts every CPU's busy time; GNU time (/usr/bin/time) the
# program's own; the rest, over the run's wall time, is what other programs used (in cores).

BENCH_HZ=$(getconf CLK_TCK 2>/dev/null || echo 100)
BENCH_MAX_OTHERS=${BENCH_MAX_OTHERS:-0.15} # a run during which others used more is redone
BENCH_RETRIES=${BENCH_RETRIES:-4}
BENCH_REDONE=0

bench_busy() { awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 + $9; exit }' /proc/stat; }
bench_now() { awk '{ print $1 }' /proc/uptime; }

# bench_others_now: cores other programs use over the next half second.
bench_others_now() {
    _bl_b0=$(bench_busy); _bl_t0=$(bench_now); sleep 0.5; _bl_b1=$(bench_busy); _bl_t1=$(bench_now)
    awk -v b0="$_bl_b0" -v b1="$_bl_b1" -v t0="$_bl_t0" -v t1="$_bl_t1" -v hz="$BENCH_HZ" 'BEGIN { d = t1 - t0; printf "%.2f\n", (d > 0 ? (b1 - b0) / hz / d : 0) }'
}

# bench_wait_quiet [SECONDS]: wait (up to SECONDS, default 20) until others use under BENCH_MAX_OTHERS.
bench_wait_quiet() {
    _bl_i=0
    while [ "$_bl_i" -lt $((${1:-20} * 2)) ]; do
        _bl_o=$(bench_others_now)
        awk -v o="$_bl_o" -v m="$BENCH_MAX_OTHERS" 'BEGIN { exit !(o < m) }' && return 0
        _bl_i=$((_bl_i + 1))
    done
    return 0
}

# bench_run OUTFILE CMD...: run CMD (stdout and stderr to OUTFILE) after waiting for a quiet machine; redo
# it (up to BENCH_RETRIES times) while other programs used BENCH_MAX_OTHERS cores or more during it.
# Sets BENCH_OTHERS (cores others used during the kept run); counts redone runs in BENCH_REDONE.
bench_run() {
    _bl_out=$1
    shift
    _bl_try=0
    while :; do
        bench_wait_quiet 30
        _bl_b0=$(bench_busy); _bl_t0=$(bench_now)
        /usr/bin/time -f '%U %S' -o "$_bl_out.cpu" "$@" >"$_bl_out" 2>&1
        _bl_rc=$?
        _bl_b1=$(bench_busy); _bl_t1=$(bench_now)
        BENCH_OTHERS=$(awk -v b0="$_bl_b0" -v b1="$_bl_b1" -v t0="$_bl_t0" -v t1="$_bl_t1" -v hz="$BENCH_HZ" -v f="$_bl_out.cpu" 'BEGIN {
            getline c < f; split(c, a, " "); d = t1 - t0; o = d > 0 ? ((b1 - b0) / hz - a[1] - a[2]) / d : 0
            printf "%.2f\n", (o > 0 ? o : 0) }')
        rm -f "$_bl_out.cpu"
        if [ "$_bl_rc" -ne 0 ]; then echo "bench: '$*' failed (exit $_bl_rc):" >&2; tail -n 5 "$_bl_out" >&2; return "$_bl_rc"; fi
        awk -v o="$BENCH_OTHERS" -v m="$BENCH_MAX_OTHERS" 'BEGIN { exit !(o >= m) }' || return 0
        [ "$_bl_try" -ge "$BENCH_RETRIES" ] && return 0
        _bl_try=$((_bl_try + 1))
        BENCH_REDONE=$((BENCH_REDONE + 1))
    done
}

# Statistics of a list of numbers (one per line on stdin).
bench_median() { sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
bench_spread() { sort -g | awk '{ v[NR] = $1 } END { if (NR && v[1] > 0) printf "%.2f\n", v[NR] / v[1]; else print "-" }'; }
bench_list() { tr ' ' '\n' | sed '/^$/d'; }
