/* bench_ea: bandwidth of the fused averaging pass against memcpy and a three-pass version.

   Build (what we ship: no -march=native):
     gcc -std=c11 -O2 -I. bench/bench_ea.c -o /tmp/bench_ea -lm -pthread
   Run:  /tmp/bench_ea [P floats, default 64 Mi] [repetitions, default 7]

   Byte convention (bytes the algorithm must move; write-allocate traffic is not counted):
     fused pass       20 B per float: reads w, z, acc; writes w, acc           (5 x 4 P)
     memcpy of B      2B: reads B, writes B; B = 20 P / 2 so it moves as many bytes as the pass
     three-pass       40 B per float: d = w - z (12), d *= alpha (8), w -= d and acc += d (20)
     contribute       the library call: the pass plus the non-finite scan of w (4 B/float more, not
                      counted: it shows up as a lower rate)
   Every figure is a median over the repetitions, all variants interleaved in each repetition so that
   the machine's noise hits them alike. Nothing is asserted: the figures are printed. */
#define _POSIX_C_SOURCE 200809L
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAXREP 64

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
static double median(const double *v, int n) {
    double s[MAXREP];
    memcpy(s, v, (size_t)n * sizeof *s);
    qsort(s, (size_t)n, sizeof *s, cmp_double);
    return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
}
static void *xalloc(avgpipe_device *dev, size_t bytes) {
    void *p = NULL;
    if (dev->alloc(dev->user, bytes, &p) != AVGPIPE_OK) {
        fprintf(stderr, "bench_ea: out of memory (%zu bytes)\n", bytes);
        exit(1);
    }
    memset(p, 0, bytes); /* fault the pages in before timing */
    return p;
}

/* The straightforward version: three separate loops, as a library of elementwise ops would run it.
   Written in the same blocked style as the library's kernel so that both are vectorised alike. */
#define BLK 64
static void three_pass(float *restrict w, const float *restrict z, float *restrict acc, float *restrict d, size_t n,
                       float alpha) {
    size_t i, j;
    for (i = 0; i + BLK <= n; i += BLK)
        for (j = 0; j < BLK; j++) d[i + j] = w[i + j] - z[i + j];
    for (; i < n; i++) d[i] = w[i] - z[i];
    for (i = 0; i + BLK <= n; i += BLK)
        for (j = 0; j < BLK; j++) d[i + j] *= alpha;
    for (; i < n; i++) d[i] *= alpha;
    for (i = 0; i + BLK <= n; i += BLK)
        for (j = 0; j < BLK; j++) w[i + j] -= d[i + j], acc[i + j] += d[i + j];
    for (; i < n; i++) w[i] -= d[i], acc[i] += d[i];
}

/* memcpy split over threads, for the multi-thread baseline */
typedef struct mc_job {
    char *dst;
    const char *src;
    size_t n;
} mc_job;
static void *mc_thread(void *p) {
    mc_job *j = (mc_job *)p;
    memcpy(j->dst, j->src, j->n);
    return NULL;
}
static void memcpy_mt(void *dst, const void *src, size_t n, int threads) {
    pthread_t t[AVGPIPE_DEVICE_CPU_MAX_THREADS];
    mc_job jobs[AVGPIPE_DEVICE_CPU_MAX_THREADS];
    size_t chunk = (n / (size_t)threads + 63) & ~(size_t)63;
    int k;
    for (k = 0; k < threads; k++) {
        size_t b = (size_t)k * chunk < n ? (size_t)k * chunk : n, e = b + chunk < n ? b + chunk : n;
        jobs[k].dst = (char *)dst + b, jobs[k].src = (const char *)src + b, jobs[k].n = e - b;
        if (k) pthread_create(&t[k], NULL, mc_thread, &jobs[k]);
    }
    mc_thread(&jobs[0]);
    for (k = 1; k < threads; k++) pthread_join(t[k], NULL);
}

int main(int argc, char **argv) {
    size_t P = argc > 1 ? (size_t)strtoull(argv[1], NULL, 10) : (size_t)64 << 20;
    int reps = argc > 2 ? atoi(argv[2]) : 7, r, threads = 2;
    const size_t B = 10 * P; /* memcpy bytes: 2B = 20P, the pass's bytes */
    const double pass_bytes = 20.0 * (double)P, copy_bytes = 2.0 * (double)B, three_bytes = 40.0 * (double)P;
    double t_copy[MAXREP], t_mean[MAXREP], t_elastic[MAXREP], t_contrib[MAXREP], t_three[MAXREP], t_scan[MAXREP];
    double t_copy_mt[MAXREP], t_mean_mt[MAXREP], t_contrib_mt[MAXREP], t_scan_mt[MAXREP];
    avgpipe_device one, many;
    avgpipe_device_cpu_desc dd;
    avgpipe_ea_desc ed;
    avgpipe_ea *ea1, *ea2;
    avgpipe_ea_pass pass;
    float *w, *z, *acc, *d;
    char *src, *dst;
    size_t idx;
    double t0, m_copy, m_mean, m_el, m_con, m_three, m_scan, m_copy_mt, m_mean_mt, m_con_mt, m_scan_mt;
    if (reps < 1 || reps > MAXREP || P < 64) {
        fprintf(stderr, "usage: bench_ea [P >= 64] [repetitions 1..%d]\n", MAXREP);
        return 2;
    }
    memset(&dd, 0, sizeof dd);
    dd.threads = 1;
    avgpipe_device_cpu_create(NULL, &dd, &one);
    dd.threads = threads;
    avgpipe_device_cpu_create(NULL, &dd, &many);
    w = (float *)xalloc(&one, P * sizeof(float));
    z = (float *)xalloc(&one, P * sizeof(float));
    acc = (float *)xalloc(&one, P * sizeof(float));
    d = (float *)xalloc(&one, P * sizeof(float));
    src = (char *)xalloc(&one, B);
    dst = (char *)xalloc(&one, B);
    for (idx = 0; idx < P; idx++) w[idx] = (float)(idx % 1000) * 1e-3f, z[idx] = 0.5f, acc[idx] = 0.25f;

    /* the library calls: N large so that every timed contribution is a middle one (reads acc) */
    memset(&ed, 0, sizeof ed);
    ed.count = P, ed.pipes = 2 * MAXREP + 4, ed.initial = z, ed.device = &one;
    if (avgpipe_ea_create(NULL, &ed, &ea1) != AVGPIPE_OK) return fprintf(stderr, "%s\n", avgpipe_last_error(NULL)), 1;
    ed.device = &many;
    if (avgpipe_ea_create(NULL, &ed, &ea2) != AVGPIPE_OK) return fprintf(stderr, "%s\n", avgpipe_last_error(NULL)), 1;
    avgpipe_ea_contribute(NULL, ea1, 0, 0, w, NULL); /* the first one stores */
    avgpipe_ea_contribute(NULL, ea2, 0, 0, w, NULL);

    memset(&pass, 0, sizeof pass);
    pass.w = w, pass.z = z, pass.acc = acc, pass.count = P, pass.alpha = 0.1f, pass.scale = 0.5f;
    for (r = 0; r < reps; r++) {
        t0 = now(), memcpy(dst, src, B), t_copy[r] = now() - t0;
        pass.mode = AVGPIPE_EA_MEAN;
        t0 = now(), one.ea_pass(one.user, &pass, NULL), t_mean[r] = now() - t0;
        pass.mode = AVGPIPE_EA_ELASTIC;
        t0 = now(), one.ea_pass(one.user, &pass, NULL), t_elastic[r] = now() - t0;
        t0 = now(), avgpipe_ea_contribute(NULL, ea1, r + 1, 0, w, NULL), t_contrib[r] = now() - t0;
        t0 = now(), three_pass(w, z, acc, d, P, 0.1f), t_three[r] = now() - t0;
        t0 = now(), one.find_nonfinite(one.user, w, P, &idx, NULL), t_scan[r] = now() - t0;
        t0 = now(), memcpy_mt(dst, src, B, threads), t_copy_mt[r] = now() - t0;
        pass.mode = AVGPIPE_EA_MEAN;
        t0 = now(), many.ea_pass(many.user, &pass, NULL), t_mean_mt[r] = now() - t0;
        t0 = now(), avgpipe_ea_contribute(NULL, ea2, r + 1, 0, w, NULL), t_contrib_mt[r] = now() - t0;
        t0 = now(), many.find_nonfinite(many.user, w, P, &idx, NULL), t_scan_mt[r] = now() - t0;
    }
    m_copy = median(t_copy, reps), m_mean = median(t_mean, reps), m_el = median(t_elastic, reps);
    m_con = median(t_contrib, reps), m_three = median(t_three, reps), m_scan = median(t_scan, reps);
    m_copy_mt = median(t_copy_mt, reps), m_mean_mt = median(t_mean_mt, reps), m_con_mt = median(t_contrib_mt, reps);
    m_scan_mt = median(t_scan_mt, reps);

    printf("bench_ea: P = %zu floats (%.0f MiB per array), %d repetitions, medians\n", P,
           (double)P * 4.0 / 1048576.0, reps);
    printf("bytes: pass 20 B/float (r w,z,acc; w w,acc); memcpy of B = 2B (B = %.0f MiB); three-pass 40 B/float\n",
           (double)B / 1048576.0);
    printf("%-44s %9s %10s\n", "", "ms", "GB/s");
#define ROW(name, t, bytes) printf("%-44s %9.2f %10.2f\n", name, 1e3 * (t), (bytes) / (t) / 1e9)
    ROW("memcpy, 1 thread", m_copy, copy_bytes);
    ROW("fused pass MEAN, 1 thread", m_mean, pass_bytes);
    ROW("fused pass ELASTIC, 1 thread", m_el, pass_bytes);
    ROW("avgpipe_ea_contribute (pass + scan), 1 thread", m_con, pass_bytes);
    ROW("non-finite scan alone (4 B/float), 1 thread", m_scan, 4.0 * (double)P);
    ROW("three-pass ELASTIC, 1 thread (40 B/float)", m_three, three_bytes);
    ROW("memcpy, 2 threads", m_copy_mt, copy_bytes);
    ROW("fused pass MEAN, 2 threads", m_mean_mt, pass_bytes);
    ROW("avgpipe_ea_contribute, 2 threads", m_con_mt, pass_bytes);
    ROW("non-finite scan alone, 2 threads", m_scan_mt, 4.0 * (double)P);
#undef ROW
    printf("ratios (targets in brackets):\n");
    printf("  fused MEAN rate / memcpy rate, 1 thread      %.3f  [>= 0.85]\n", (pass_bytes / m_mean) / (copy_bytes / m_copy));
    printf("  fused ELASTIC rate / memcpy rate, 1 thread   %.3f  [>= 0.85]\n", (pass_bytes / m_el) / (copy_bytes / m_copy));
    printf("  contribute rate / memcpy rate, 1 thread      %.3f\n", (pass_bytes / m_con) / (copy_bytes / m_copy));
    printf("  three-pass time / fused ELASTIC time         %.2fx [>= 2]\n", m_three / m_el);
    printf("  fused MEAN rate / memcpy rate, 2 threads     %.3f\n",
           (pass_bytes / m_mean_mt) / (copy_bytes / m_copy_mt));
    printf("  contribute rate / memcpy rate, 2 threads     %.3f\n", (pass_bytes / m_con_mt) / (copy_bytes / m_copy_mt));
    printf("  fused MEAN speed-up, 2 threads over 1        %.2fx\n", m_mean / m_mean_mt);
    printf("  guard cost: contribute time / pass time      %.2fx (1 thread), %.2fx (2 threads)\n", m_con / m_mean,
           m_con_mt / m_mean_mt);
    avgpipe_ea_destroy(ea1);
    avgpipe_ea_destroy(ea2);
    one.free(one.user, w), one.free(one.user, z), one.free(one.user, acc), one.free(one.user, d);
    one.free(one.user, src), one.free(one.user, dst);
    avgpipe_device_destroy(&many);
    avgpipe_device_destroy(&one);
    return 0;
}
