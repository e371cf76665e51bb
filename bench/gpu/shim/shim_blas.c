/* bench/gpu/shim/shim_blas.c: cblas_sgemm and OpenBLAS's corename/config/threads functions for builds
   without OpenBLAS's headers (see blas/cblas.h beside it): either forwarded to a library loaded with
   dlopen (AVGPIPE_BLAS_SHIM_LIB, e.g. NumPy's bundled OpenBLAS), or plain loops in two summation orders
   (AVGPIPE_NAIVE_BLAS=dot|axpy). C11 + POSIX (dlopen, pthread_once). Build:
       cc -std=c11 -O2 -c bench/gpu/shim/shim_blas.c -I bench/gpu/shim/blas    (link with -ldl -pthread)
   A library that cannot be loaded, or lacks sgemm, is reported on stderr once and the process exits with
   status 3: a reference run must not quietly fall back to other numerics than the ones it announced. */
#define _POSIX_C_SOURCE 200809L
#include "cblas.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* OpenBLAS's sgemm with 32-bit (LP64) or 64-bit (ILP64, NumPy's) integers; enums are ints in both. */
typedef void (*sgemm32_fn)(int, int, int, int32_t, int32_t, int32_t, float, const float *, int32_t, const float *, int32_t, float,
                           float *, int32_t);
typedef void (*sgemm64_fn)(int, int, int, int64_t, int64_t, int64_t, float, const float *, int64_t, const float *, int64_t, float,
                           float *, int64_t);
typedef char *(*str_fn)(void);
typedef void (*threads_fn)(int);

static pthread_once_t shim_once = PTHREAD_ONCE_INIT;
static sgemm32_fn shim_sgemm32;
static sgemm64_fn shim_sgemm64;
static str_fn shim_corename_fn, shim_config_fn;
static threads_fn shim_threads_fn;
static int shim_axpy; /* naive loops: 1 = axpy order, 0 = dot order */
static char shim_config[512];

/* The first of the symbol's spellings the library has: plain, NumPy's ("scipy_" + name + "64_"), or
   OpenBLAS's ILP64 builds' (name + "64_"). *wide = 1 for the 64-bit-integer spellings. */
static void *shim_sym(void *lib, const char *name, int *wide) {
    static const char *const pre[] = {"", "scipy_", ""}, *const post[] = {"", "64_", "64_"};
    char buf[128];
    int i;
    for (i = 0; i < 3; i++) {
        void *p;
        snprintf(buf, sizeof buf, "%s%s%s", pre[i], name, post[i]);
        if ((p = dlsym(lib, buf)) != NULL) {
            if (wide) *wide = i > 0;
            return p;
        }
    }
    return NULL;
}

static void shim_init(void) {
    const char *path = getenv("AVGPIPE_BLAS_SHIM_LIB"), *order = getenv("AVGPIPE_NAIVE_BLAS");
    if (path && *path) {
        void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        void *sg;
        int wide = 0;
        if (!lib) {
            fprintf(stderr, "shim_blas: AVGPIPE_BLAS_SHIM_LIB=%s: %s\n", path, dlerror());
            exit(3);
        }
        if (!(sg = shim_sym(lib, "cblas_sgemm", &wide))) {
            fprintf(stderr, "shim_blas: %s has no cblas_sgemm (plain, scipy_..64_ or ..64_)\n", path);
            exit(3);
        }
        if (wide) shim_sgemm64 = (sgemm64_fn)(uintptr_t)sg;
        else shim_sgemm32 = (sgemm32_fn)(uintptr_t)sg;
        shim_corename_fn = (str_fn)(uintptr_t)shim_sym(lib, "openblas_get_corename", NULL);
        shim_config_fn = (str_fn)(uintptr_t)shim_sym(lib, "openblas_get_config", NULL);
        shim_threads_fn = (threads_fn)(uintptr_t)shim_sym(lib, "openblas_set_num_threads", NULL);
        return;
    }
    if (order && *order && strcmp(order, "dot") != 0 && strcmp(order, "axpy") != 0) {
        fprintf(stderr, "shim_blas: AVGPIPE_NAIVE_BLAS=%s: expected dot or axpy\n", order);
        exit(3);
    }
    shim_axpy = order && !strcmp(order, "axpy");
}

/* Row-major C (m x n) = alpha op(A) op(B) + beta C, op(A) m x k, op(B) k x n. */
static void shim_naive_rowmajor(int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda, const float *b, int ldb,
                                float beta, float *c, int ldc) {
    int i, j, p;
    for (i = 0; i < m; i++) {
        float *ci = c + (size_t)i * (size_t)ldc;
        if (shim_axpy) {
            for (j = 0; j < n; j++) ci[j] = beta == 0.0f ? 0.0f : beta * ci[j];
            for (p = 0; p < k; p++) {
                float ap = alpha * (ta ? a[(size_t)p * lda + i] : a[(size_t)i * lda + p]);
                if (tb)
                    for (j = 0; j < n; j++) ci[j] += ap * b[(size_t)j * ldb + p];
                else
                    for (j = 0; j < n; j++) ci[j] += ap * b[(size_t)p * ldb + j];
            }
        } else {
            for (j = 0; j < n; j++) {
                float s = 0.0f;
                for (p = 0; p < k; p++)
                    s += (ta ? a[(size_t)p * lda + i] : a[(size_t)i * lda + p]) * (tb ? b[(size_t)j * ldb + p] : b[(size_t)p * ldb + j]);
                ci[j] = alpha * s + (beta == 0.0f ? 0.0f : beta * ci[j]);
            }
        }
    }
}

void cblas_sgemm(const enum CBLAS_ORDER order, const enum CBLAS_TRANSPOSE transa, const enum CBLAS_TRANSPOSE transb, const int m,
                 const int n, const int k, const float alpha, const float *a, const int lda, const float *b, const int ldb,
                 const float beta, float *c, const int ldc) {
    int ta = transa != CblasNoTrans, tb = transb != CblasNoTrans;
    pthread_once(&shim_once, shim_init);
    if (shim_sgemm32) {
        shim_sgemm32((int)order, (int)transa, (int)transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    if (shim_sgemm64) {
        shim_sgemm64((int)order, (int)transa, (int)transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    if (m <= 0 || n <= 0) return;
    if (order == CblasRowMajor) shim_naive_rowmajor(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    else shim_naive_rowmajor(tb, ta, n, m, k, alpha, b, ldb, a, lda, beta, c, ldc); /* C^T = op(B)^T op(A)^T, row-major */
}

char *openblas_get_corename(void) {
    static char naive_dot[] = "naive-dot", naive_axpy[] = "naive-axpy", unknown[] = "unknown";
    pthread_once(&shim_once, shim_init);
    if (shim_sgemm32 || shim_sgemm64) return shim_corename_fn ? shim_corename_fn() : unknown;
    return shim_axpy ? naive_axpy : naive_dot;
}

char *openblas_get_config(void) {
    pthread_once(&shim_once, shim_init);
    if (shim_sgemm32 || shim_sgemm64) {
        snprintf(shim_config, sizeof shim_config, "%s (through bench/gpu/shim_blas.c, dlopen)",
                 shim_config_fn ? shim_config_fn() : "OpenBLAS");
    } else {
        snprintf(shim_config, sizeof shim_config, "naive-loops %s (bench/gpu/shim_blas.c: no OpenBLAS)", shim_axpy ? "axpy" : "dot");
    }
    return shim_config;
}

void openblas_set_num_threads(int num_threads) {
    pthread_once(&shim_once, shim_init);
    if (shim_threads_fn) shim_threads_fn(num_threads);
}
