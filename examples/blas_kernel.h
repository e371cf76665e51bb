/* blas_kernel.h — run OpenBLAS with the kernel this CPU can run, not a generic fallback. Single header,
   C11 + POSIX (Linux: it restarts the program through /proc/self/exe). Used by the examples and benchmarks
   that call OpenBLAS (fashion_mnist, mlp_reference, bench_tune_regret).

   Why. OpenBLAS built with DYNAMIC_ARCH (Debian's 0.3.21) picks its kernel when the library loads, from
   the CPU's vendor, family and model. A CPU it does not know falls back to the generic SSE3 kernel
   "Prescott": measured on 2 vCPUs reported as "Intel Xeon Processor", family 6 model 207 (AVX-512),
   sgemm of the first layer's shape ran at 24 GFLOP/s with Prescott and at 134 GFLOP/s with
   OPENBLAS_CORETYPE=SkylakeX. The kernel cannot be changed once the library is loaded: only a new process
   with OPENBLAS_CORETYPE in its environment gets another one. Hence:

       int main(int argc, char **argv) {
           blas_kernel_status st;
           ... parse the options (the shapes depend on them) ...
           blas_kernel_ensure(argv, shapes, nshapes, "prog", &st);   // may restart the program
           printf("BLAS: %s\n", st.line);                            // the first line of stdout

   blas_kernel_ensure, when OpenBLAS runs a generic kernel (blas_kernel_is_generic) on a CPU that supports
   AVX-512 (or AVX2), and the user did not set OPENBLAS_CORETYPE:
     1. checks the better kernel (SkylakeX for AVX-512, Haswell for AVX2) in a child process: the program
        itself, run again with OPENBLAS_CORETYPE set and BLAS_KERNEL_CHECK=1 in its environment, which
        makes this function compare sgemm on the caller's shapes (all three transpositions a dense layer
        uses) with a plain double-precision loop and exit. A kernel that crashes (SIGILL), hangs, ignores
        OPENBLAS_CORETYPE or computes wrong results is reported on stderr and the program goes on with the
        generic kernel;
     2. restarts the program (execv of /proc/self/exe, the same argv) with OPENBLAS_CORETYPE set, and
        BLAS_KERNEL_RESTARTED=<the generic kernel's name> so that the new process says what happened
        instead of taking OPENBLAS_CORETYPE for the user's choice.
   Call it before anything the restart would repeat at a cost (loading data, starting threads, MPI_Init),
   and after nothing that must not run twice: everything before it runs once in the child check (up to
   this call) and once more after the restart. It never touches an OPENBLAS_CORETYPE the user set.

   Test hooks (environment): BLAS_KERNEL_ASSUME_AUTO=1 takes a set OPENBLAS_CORETYPE as OpenBLAS's own
   pick (OPENBLAS_CORETYPE=Prescott BLAS_KERNEL_ASSUME_AUTO=1 plays the unknown CPU on any x86 machine);
   BLAS_KERNEL_FAULT=crash|wrong makes the child check die of SIGILL or find a wrong result.

   Errors: nothing here exits or aborts the calling process (the child check ends with _exit, by design);
   what went wrong is printed on stderr, prefixed with the program's name, and the program keeps the kernel
   it has. Thread-safety: call blas_kernel_ensure from main before any other thread exists. */
#ifndef BLAS_KERNEL_H
#define BLAS_KERNEL_H

#ifdef __cplusplus
extern "C" {
#endif

/* What the CPU supports, as far as choosing a kernel goes (blas_kernel_cpu_flags). */
#define BLAS_KERNEL_AVX2 1u   /* AVX2 and FMA: Haswell's kernel */
#define BLAS_KERNEL_AVX512 2u /* AVX-512 F, CD, BW, DQ, VL: SkylakeX's kernel */

/* The shape of one sgemm a caller runs: C (m x n) = A (m x k) B (k x n). */
typedef struct blas_kernel_shape {
    int m, n, k;
} blas_kernel_shape;

typedef struct blas_kernel_status {
    char line[256];      /* "OpenBLAS 0.3.21, kernel SkylakeX (...why...)", for the program's first line */
    char kernel[32];     /* openblas_get_corename() of this process */
    char fallback[32];   /* the generic kernel a restart replaced; "" when there was no restart */
    int restarted;       /* 1: this process is the restart with a better kernel */
    int user_set;        /* 1: OPENBLAS_CORETYPE came from the user and was left alone */
} blas_kernel_status;

/* 1 if `corename` (as openblas_get_corename() spells it; case is ignored) is one of OpenBLAS's kernels
   for CPUs without AVX2: what OpenBLAS falls back to on a CPU it does not know (Prescott, Core2,
   Katmai, Nehalem, Sandybridge, ... and "generic"). A name it does not list (a newer kernel) is not. */
int blas_kernel_is_generic(const char *corename);

/* The kernel to restart with: "SkylakeX" when `corename` is generic and cpu_flags has
   BLAS_KERNEL_AVX512, "Haswell" when it is generic and cpu_flags has BLAS_KERNEL_AVX2, else NULL
   (the kernel is not generic, or the CPU could not run a better one). Pure: tests feed it made-up names
   and flags. */
const char *blas_kernel_better(const char *corename, unsigned cpu_flags);

/* This CPU's BLAS_KERNEL_* flags (cpuid, and the OS's support for the registers, through
   __builtin_cpu_supports); 0 on compilers or machines without it. */
unsigned blas_kernel_cpu_flags(void);

/* Largest |C - C_exact| / ((K + 1) x FLT_EPSILON x sum |A||B|) over the three sgemm variants a dense layer
   runs (X W^T, dZ W, dZ^T X) for shape s on made-up data, C_exact in double: below 1 is what a correct
   float kernel gives (Higham's bound), a broken kernel gives far more. -1 when out of memory. */
double blas_kernel_check_shape(blas_kernel_shape s);

/* See the header comment. shapes[0 .. nshapes-1]: the sgemm shapes the program runs (at most a few;
   each is checked with m capped at 64 rows). prog: the name for messages. *st is filled. Returns 0 when
   the process runs with the kernel it should (possibly after a restart), 1 when it keeps a generic kernel
   on a CPU that could do better (the check failed; st->line says why). In the child check it does not
   return. */
int blas_kernel_ensure(char **argv, const blas_kernel_shape *shapes, int nshapes, const char *prog, blas_kernel_status *st);

#ifdef __cplusplus
}
#endif
#endif /* BLAS_KERNEL_H */

/* ============================================================================================ */
/* Implementation                                                                               */
/* ============================================================================================ */
#if defined(BLAS_KERNEL_IMPLEMENTATION) && !defined(BLAS_KERNEL_IMPLEMENTATION_INCLUDED)
#define BLAS_KERNEL_IMPLEMENTATION_INCLUDED

#include <cblas.h>
#include <errno.h>
#include <float.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

char *openblas_get_corename(void); /* OpenBLAS's own; its cblas.h declares them, netlib's does not */
char *openblas_get_config(void);

#define BLAS_KERNEL__CHECK_ENV "BLAS_KERNEL_CHECK"
#define BLAS_KERNEL__RESTART_ENV "BLAS_KERNEL_RESTARTED"
#define BLAS_KERNEL__CHECK_ROWS 64    /* rows of each checked product: enough to cover the kernel's blocking */
#define BLAS_KERNEL__CHECK_TIMEOUT 60 /* seconds the child check may take (a hung kernel is a failed one) */

static int blas_kernel__same(const char *a, const char *b) {
    for (; *a && *b; a++, b++) {
        char x = *a >= 'A' && *a <= 'Z' ? (char)(*a - 'A' + 'a') : *a, y = *b >= 'A' && *b <= 'Z' ? (char)(*b - 'A' + 'a') : *b;
        if (x != y) return 0;
    }
    return *a == *b;
}

int blas_kernel_is_generic(const char *corename) {
    /* OpenBLAS's x86 kernels for CPUs before AVX2 (its driver/others/dynamic.c names); DYNAMIC_ARCH's
       fallback for an unknown CPU is Prescott, or Nehalem/Sandybridge when the OS hides AVX/AVX2. */
    static const char *const old[] = {"katmai", "coppermine", "northwood", "prescott", "banias", "core2", "penryn", "dunnington",
                                      "nehalem", "atom", "athlon", "opteron", "opteron_sse3", "barcelona", "bobcat", "nano",
                                      "sandybridge", "bulldozer", "piledriver", "steamroller", "generic", "unknown"};
    size_t i;
    if (!corename) return 0;
    for (i = 0; i < sizeof old / sizeof old[0]; i++)
        if (blas_kernel__same(corename, old[i])) return 1;
    return 0;
}

const char *blas_kernel_better(const char *corename, unsigned cpu_flags) {
    if (!blas_kernel_is_generic(corename)) return NULL;
    if (cpu_flags & BLAS_KERNEL_AVX512) return "SkylakeX";
    if (cpu_flags & BLAS_KERNEL_AVX2) return "Haswell";
    return NULL;
}

unsigned blas_kernel_cpu_flags(void) {
    unsigned f = 0;
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) f |= BLAS_KERNEL_AVX2;
    if ((f & BLAS_KERNEL_AVX2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
        f |= BLAS_KERNEL_AVX512;
#endif
    return f;
}

/* Deterministic values in [-1, 1), so that the check does not depend on rand()'s state. */
static void blas_kernel__fill(float *x, size_t n, unsigned seed) {
    size_t i;
    unsigned s = seed * 2654435761u + 1;
    for (i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        x[i] = (float)((double)(s >> 8) / 8388608.0 - 1.0);
    }
}

/* Worst error of C against the double-precision product, in units of Higham's bound (K + 1) eps sum|a||b|
   (K roundings in the sum, one to float).
   a(i, p) and b(p, j) are read through strides so that one loop covers every transposition. */
static double blas_kernel__err(const float *c, const float *a, int sai, int sap, const float *b, int sbp, int sbj, int m, int n, int k) {
    double worst = 0;
    int i, j, p;
    for (i = 0; i < m; i++)
        for (j = 0; j < n; j++) {
            double ex = 0, mag = 0, e;
            for (p = 0; p < k; p++) {
                double t = (double)a[(size_t)i * sai + (size_t)p * sap] * b[(size_t)p * sbp + (size_t)j * sbj];
                ex += t;
                mag += fabs(t);
            }
            e = fabs(c[(size_t)i * n + j] - ex) / ((double)(k + 1) * FLT_EPSILON * (mag > 0 ? mag : 1));
            if (!(e <= worst)) worst = e; /* NaN counts as the worst */
        }
    return worst;
}

double blas_kernel_check_shape(blas_kernel_shape s) {
    int m = s.m < BLAS_KERNEL__CHECK_ROWS ? s.m : BLAS_KERNEL__CHECK_ROWS, n = s.n, k = s.k;
    float *x, *w, *dz, *c;
    double worst = -1, e;
    if (m < 1 || n < 1 || k < 1) return 0;
    x = (float *)malloc(sizeof(float) * (size_t)m * k);   /* m x k input */
    w = (float *)malloc(sizeof(float) * (size_t)n * k);   /* n x k weights */
    dz = (float *)malloc(sizeof(float) * (size_t)m * n);  /* m x n output gradient */
    c = (float *)malloc(sizeof(float) * ((size_t)m * n > (size_t)m * k ? (size_t)m * n : (size_t)m * k) +
                        sizeof(float) * (size_t)n * k);
    if (x && w && dz && c) {
        blas_kernel__fill(x, (size_t)m * k, 1);
        blas_kernel__fill(w, (size_t)n * k, 2);
        blas_kernel__fill(dz, (size_t)m * n, 3);
        /* forward: Y (m x n) = X W^T */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, x, k, w, k, 0.0f, c, n);
        worst = blas_kernel__err(c, x, k, 1, w, 1, k, m, n, k);
        /* input gradient: dX (m x k) = dZ W */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, k, n, 1.0f, dz, n, w, k, 0.0f, c, k);
        e = blas_kernel__err(c, dz, n, 1, w, k, 1, m, k, n);
        if (!(e <= worst)) worst = e;
        /* weight gradient: dW (n x k) = dZ^T X */
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, k, m, 1.0f, dz, n, x, k, 0.0f, c, k);
        e = blas_kernel__err(c, dz, 1, n, x, k, 1, n, k, m);
        if (!(e <= worst)) worst = e;
    }
    free(x);
    free(w);
    free(dz);
    free(c);
    return worst;
}

/* "OpenBLAS 0.3.21" from the config string (its first two words). */
static void blas_kernel__version(char *buf, size_t cap) {
    const char *cfg = openblas_get_config(), *p;
    size_t n;
    p = cfg ? strchr(cfg, ' ') : NULL;
    p = p ? strchr(p + 1, ' ') : NULL;
    n = cfg ? (p ? (size_t)(p - cfg) : strlen(cfg)) : 0;
    if (n >= cap) n = cap - 1;
    memcpy(buf, cfg ? cfg : "", n);
    buf[n] = '\0';
    if (!n) snprintf(buf, cap, "OpenBLAS");
}

/* The child check (BLAS_KERNEL_CHECK=1): exit 0 when the kernel OpenBLAS loaded is the one asked for and
   its products are right, 3 when they are wrong, 4 when OpenBLAS ignored OPENBLAS_CORETYPE. */
static void blas_kernel__child(const blas_kernel_shape *shapes, int nshapes) {
    const char *want = getenv("OPENBLAS_CORETYPE"), *fault = getenv("BLAS_KERNEL_FAULT");
    int i;
    if (!want || !blas_kernel__same(want, openblas_get_corename())) _exit(4);
    if (fault && !strcmp(fault, "crash")) raise(SIGILL);
    for (i = 0; i < nshapes; i++) {
        double e = blas_kernel_check_shape(shapes[i]);
        if (fault && !strcmp(fault, "wrong")) e = 1e9;
        if (!(e >= 0 && e < 1)) _exit(3);
    }
    _exit(0);
}

/* Run the program again as the child check with OPENBLAS_CORETYPE=kernel. Returns 0 when it passed, else
   -1 with why in `why`. */
static int blas_kernel__run_check(char **argv, const char *kernel, char *why, size_t cap) {
    pid_t pid;
    int status = 0, waited = 0;
    long ticks;
    struct timespec nap = {0, 5000000L};
    fflush(stdout);
    fflush(stderr);
    pid = fork();
    if (pid < 0) {
        snprintf(why, cap, "cannot fork the check: %s", strerror(errno));
        return -1;
    }
    if (pid == 0) {
        setenv("OPENBLAS_CORETYPE", kernel, 1);
        setenv(BLAS_KERNEL__CHECK_ENV, "1", 1);
        unsetenv(BLAS_KERNEL__RESTART_ENV);
        execv("/proc/self/exe", argv);
        _exit(5);
    }
    for (ticks = 0; !waited; ticks++) { /* bounded: a kernel that hangs fails the check */
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid) {
            waited = 1;
        } else if (r < 0 && errno != EINTR) {
            snprintf(why, cap, "cannot wait for its check: %s", strerror(errno));
            return -1;
        } else if (ticks > BLAS_KERNEL__CHECK_TIMEOUT * 200) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            snprintf(why, cap, "its check did not finish within %d s", BLAS_KERNEL__CHECK_TIMEOUT);
            return -1;
        } else {
            nanosleep(&nap, NULL); /* 5 ms */
        }
    }
    if (WIFSIGNALED(status)) {
        snprintf(why, cap, "its check was killed by signal %d (%s)", WTERMSIG(status), strsignal(WTERMSIG(status)));
        return -1;
    }
    switch (WIFEXITED(status) ? WEXITSTATUS(status) : -1) {
    case 0: return 0;
    case 3: snprintf(why, cap, "its sgemm disagrees with a plain loop on the model's shapes"); return -1;
    case 4: snprintf(why, cap, "OpenBLAS did not load it (OPENBLAS_CORETYPE ignored)"); return -1;
    case 5: snprintf(why, cap, "cannot run /proc/self/exe for its check"); return -1;
    default: snprintf(why, cap, "its check exited with status %d", WIFEXITED(status) ? WEXITSTATUS(status) : -1); return -1;
    }
}

int blas_kernel_ensure(char **argv, const blas_kernel_shape *shapes, int nshapes, const char *prog, blas_kernel_status *st) {
    const char *user = getenv("OPENBLAS_CORETYPE"), *prev = getenv(BLAS_KERNEL__RESTART_ENV), *better;
    const char *assume = getenv("BLAS_KERNEL_ASSUME_AUTO");
    char ver[64], why[160];
    unsigned cpu = blas_kernel_cpu_flags();
    const char *isa = cpu & BLAS_KERNEL_AVX512 ? "AVX-512" : cpu & BLAS_KERNEL_AVX2 ? "AVX2" : "no AVX2";
    if (getenv(BLAS_KERNEL__CHECK_ENV)) blas_kernel__child(shapes, nshapes);
    memset(st, 0, sizeof *st);
    blas_kernel__version(ver, sizeof ver);
    snprintf(st->kernel, sizeof st->kernel, "%s", openblas_get_corename());
    if (prev) { /* the restart: say what it replaced, and leave OPENBLAS_CORETYPE for our own children */
        st->restarted = 1;
        snprintf(st->fallback, sizeof st->fallback, "%s", prev);
        snprintf(st->line, sizeof st->line, "%s, kernel %s (OpenBLAS picked %s on this %s CPU: restarted with OPENBLAS_CORETYPE=%s, "
                 "its sgemm checked)", ver, st->kernel, prev, isa, st->kernel);
        unsetenv(BLAS_KERNEL__RESTART_ENV);
        return 0;
    }
    if (user && !(assume && !strcmp(assume, "1"))) {
        st->user_set = 1;
        snprintf(st->line, sizeof st->line, "%s, kernel %s (OPENBLAS_CORETYPE=%s, left as set)", ver, st->kernel, user);
        return 0;
    }
    better = blas_kernel_better(st->kernel, cpu);
    if (!better) {
        snprintf(st->line, sizeof st->line, "%s, kernel %s (%s CPU)", ver, st->kernel, isa);
        return 0;
    }
    if (blas_kernel__run_check(argv, better, why, sizeof why) == 0) {
        setenv("OPENBLAS_CORETYPE", better, 1);
        setenv(BLAS_KERNEL__RESTART_ENV, st->kernel, 1);
        fflush(stdout);
        fflush(stderr);
        execv("/proc/self/exe", argv);
        snprintf(why, sizeof why, "cannot restart through /proc/self/exe: %s", strerror(errno));
        unsetenv(BLAS_KERNEL__RESTART_ENV);
        if (user) setenv("OPENBLAS_CORETYPE", user, 1);
        else unsetenv("OPENBLAS_CORETYPE");
    }
    fprintf(stderr, "%s: OpenBLAS runs its generic kernel %s on this %s CPU; kernel %s would be faster, but %s: staying with %s\n",
            prog, st->kernel, isa, better, why, st->kernel);
    snprintf(st->line, sizeof st->line, "%s, kernel %s (generic: %s failed its check, see stderr)", ver, st->kernel, better);
    return 1;
}

#endif /* BLAS_KERNEL_IMPLEMENTATION */
