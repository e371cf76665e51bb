/* quiet.h — how much of the machine other programs took while a benchmark measured (Linux /proc), so
   that a measurement disturbed by them can be told apart, redone or flagged. Single header, C11 + POSIX;
   static functions only (include it in one file of each program).

   The machines these benchmarks run on are shared: another user's compiler or fuzzer can take a whole
   core for minutes, which on 2 cores halves what two stage threads can do. /proc/stat counts the busy
   time of every CPU (user, nice, system, irq, softirq, steal: steal is the hypervisor giving the CPU to
   another machine); /proc/self/stat counts this process's own (all its threads). The difference over an
   interval, divided by the interval, is how many cores the rest of the machine used. */
#ifndef QUIET_H
#define QUIET_H

#include <stdio.h>
#include <time.h>
#include <unistd.h>

typedef struct quiet_snap {
    double wall;      /* seconds, CLOCK_MONOTONIC */
    double busy;      /* seconds all CPUs were busy since boot (/proc/stat), -1 when unreadable */
    double self;      /* seconds of CPU this process used (/proc/self/stat utime + stime) */
} quiet_snap;

static quiet_snap quiet_now(void) {
    quiet_snap q;
    struct timespec ts;
    unsigned long long v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    unsigned long ut = 0, st = 0;
    double hz = (double)sysconf(_SC_CLK_TCK);
    FILE *f = fopen("/proc/stat", "r");
    clock_gettime(CLOCK_MONOTONIC, &ts);
    q.wall = (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
    q.busy = -1;
    q.self = 0;
    if (hz <= 0) hz = 100;
    if (f) { /* cpu user nice system idle iowait irq softirq steal */
        if (fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6], &v[7]) == 8)
            q.busy = (double)(v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / hz;
        fclose(f);
    }
    f = fopen("/proc/self/stat", "r");
    if (f) { /* fields 14 and 15; the command name in field 2 may hold spaces, so skip past its ')' */
        int c, field = 2;
        while ((c = fgetc(f)) != EOF && c != ')') continue;
        while (field < 13 && (c = fgetc(f)) != EOF)
            if (c == ' ') field++;
        if (fscanf(f, " %lu %lu", &ut, &st) == 2) q.self = (double)(ut + st) / hz;
        fclose(f);
    }
    return q;
}

/* Cores the rest of the machine used between a and b (0 when unknown or the interval is empty). The
   counters tick at 100 Hz: over less than about a second the figure is rough. */
static double quiet_others(const quiet_snap *a, const quiet_snap *b) {
    double dt = b->wall - a->wall, o;
    if (a->busy < 0 || b->busy < 0 || dt <= 0) return 0;
    o = ((b->busy - a->busy) - (b->self - a->self)) / dt;
    return o > 0 ? o : 0;
}

/* Wait (up to max_s seconds) until the rest of the machine uses under `cores` cores over half a second.
   Returns what it last measured. */
static double quiet_wait(double cores, double max_s) {
    quiet_snap t0 = quiet_now(), a = t0, b;
    struct timespec nap = {0, 500000000L};
    double o = 0;
    for (;;) {
        nanosleep(&nap, NULL);
        b = quiet_now();
        o = quiet_others(&a, &b);
        if (o < cores || b.wall - t0.wall >= max_s) return o;
        a = b;
    }
}

#endif /* QUIET_H */
