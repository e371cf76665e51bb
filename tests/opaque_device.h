/* opaque_device.h — the asynchronous test device of tests/async_device.h with memory the host cannot
   touch, as a GPU's memory is to an x86 host: alloc returns addresses of PROT_NONE pages, so a host
   read or write of "device memory" faults at once; the bytes live in a mirror that only the device's
   own entries (copy, memset, the averaging pass, find_nonfinite, flag_nonfinite, scale: each translates its pointers
   when it is enqueued) and the tests' kernels (odev_mirror) use. Streams are async_device.h's (threads
   running queues of tasks), so work enqueued on a stream runs later and elsewhere.

   odev_guard() installs a SIGSEGV handler that names the faulting address, the allocation it falls in
   and the stack, then lets the signal end the test (Criterion reports the crash): a host dereference of
   device memory is a failure that says where. Copies check their kind: an H2D copy whose source is
   device memory (or a D2H copy whose source is not) fails with AVGPIPE_BACKEND_ERROR, as it would
   misbehave on a GPU.

   odev_alloc_over(host, bytes) makes device memory whose mirror is the caller's host buffer: a test
   gives the runtime device addresses for the stage parameters and still reads the parameters it
   trained in its own arrays once the run's work has finished (the view a D2H copy would give).

   Include after avgpipe.h, with _POSIX_C_SOURCE >= 200809L and _DEFAULT_SOURCE defined before any
   include (mmap with MAP_ANONYMOUS, sigaction, nanosleep); links with -pthread. One per test program
   (ODEV, ADEV). */
#ifndef AVGPIPE_TESTS_OPAQUE_DEVICE_H
#define AVGPIPE_TESTS_OPAQUE_DEVICE_H

#include "tests/async_device.h"

#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>

#define ODEV_MAX 8192 /* live allocations */

typedef struct odev_block {
    unsigned char *dev;    /* the PROT_NONE pages (NULL: a free entry) */
    size_t bytes, mapped;  /* asked for; mapped (whole pages) */
    unsigned char *mirror; /* where the bytes are */
    int owned;             /* the mirror is ours (not odev_alloc_over's) */
} odev_block;

typedef struct odev {
    pthread_mutex_t mu;
    odev_block blocks[ODEV_MAX];
    int nblocks; /* entries used (some may be free again) */
    long live;
    long bad_kinds; /* copies whose kind did not match their pointers */
    char error[256];
} odev;

static odev ODEV;

/* The block holding p (device memory, one past its end included), or NULL: host memory. */
static odev_block *odev_find(const void *p) {
    const unsigned char *q = (const unsigned char *)p;
    int i;
    for (i = 0; i < ODEV.nblocks; i++) {
        odev_block *b = &ODEV.blocks[i];
        if (b->dev && q >= b->dev && q <= b->dev + b->bytes) return b;
    }
    return NULL;
}

static int odev_is_device(const void *p) {
    int in;
    pthread_mutex_lock(&ODEV.mu);
    in = p && odev_find(p) != NULL;
    pthread_mutex_unlock(&ODEV.mu);
    return in;
}

/* Where the device keeps the bytes of device address p (host pointers come back unchanged): for the
   device's entries and the tests' kernels only. */
static void *odev_mirror(const void *p) {
    odev_block *b;
    void *m;
    if (!p) return NULL;
    pthread_mutex_lock(&ODEV.mu);
    b = odev_find(p);
    m = b ? (void *)(b->mirror + ((const unsigned char *)p - b->dev)) : (void *)p;
    pthread_mutex_unlock(&ODEV.mu);
    return m;
}

static void *odev_register(size_t bytes, unsigned char *mirror, int owned) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE), mapped = (bytes + page - 1) / page * page;
    void *dev;
    int i;
    if (mapped == 0) mapped = page;
    dev = mmap(NULL, mapped, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (dev == MAP_FAILED) return NULL;
    pthread_mutex_lock(&ODEV.mu);
    for (i = 0; i < ODEV.nblocks && ODEV.blocks[i].dev; i++) {
    }
    if (i == ODEV_MAX) {
        pthread_mutex_unlock(&ODEV.mu);
        munmap(dev, mapped);
        return NULL;
    }
    if (i == ODEV.nblocks) ODEV.nblocks++;
    ODEV.blocks[i].dev = (unsigned char *)dev;
    ODEV.blocks[i].bytes = bytes;
    ODEV.blocks[i].mapped = mapped;
    ODEV.blocks[i].mirror = mirror;
    ODEV.blocks[i].owned = owned;
    ODEV.live++;
    pthread_mutex_unlock(&ODEV.mu);
    return dev;
}

/* Device memory of `bytes` whose bytes are host's (the caller keeps host alive until odev_free). */
static void *odev_alloc_over(void *host, size_t bytes) { return odev_register(bytes, (unsigned char *)host, 0); }

static void odev_release(void *p) {
    odev_block *b, copy;
    pthread_mutex_lock(&ODEV.mu);
    b = odev_find(p);
    if (!b || (unsigned char *)p != b->dev) {
        pthread_mutex_unlock(&ODEV.mu);
        fprintf(stderr, "opaque device: free of %p, which no allocation starts at\n", p);
        abort();
    }
    copy = *b;
    memset(b, 0, sizeof *b);
    ODEV.live--;
    pthread_mutex_unlock(&ODEV.mu);
    munmap(copy.dev, copy.mapped);
    if (copy.owned) free(copy.mirror);
}
static void odev_free_over(void *p) { odev_release(p); }

/* ---- the guard ---- */

static void odev_on_fault(int sig, siginfo_t *si, void *uc) {
    char msg[512];
    void *frames[64];
    int n, i, len;
    const unsigned char *a = (const unsigned char *)si->si_addr;
    (void)uc;
    len = snprintf(msg, sizeof msg, "\nopaque device: the host touched %p", si->si_addr);
    for (i = 0; i < ODEV.nblocks; i++) { /* no lock: the program is ending */
        const odev_block *b = &ODEV.blocks[i];
        if (b->dev && a >= b->dev && a < b->dev + b->mapped) {
            len += snprintf(msg + len, sizeof msg - (size_t)len, ", byte %zu of a device allocation of %zu bytes at %p", (size_t)(a - b->dev),
                            b->bytes, (void *)b->dev);
            break;
        }
    }
    if (i == ODEV.nblocks) len += snprintf(msg + len, sizeof msg - (size_t)len, " (not device memory: an ordinary crash)");
    len += snprintf(msg + len, sizeof msg - (size_t)len, "; the stack:\n");
    if (write(2, msg, (size_t)len) < 0) {
    }
    n = backtrace(frames, 64);
    backtrace_symbols_fd(frames, n, 2);
    signal(sig, SIG_DFL); /* the fault happens again and ends the program */
}

static void odev_guard(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = odev_on_fault;
    sa.sa_flags = SA_SIGINFO | SA_RESETHAND;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, NULL);
}

/* ---- the table: async_device.h's, over translated pointers ---- */

static avgpipe_result odev_alloc(void *u, size_t bytes, void **out) {
    unsigned char *mirror = (unsigned char *)aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
    (void)u;
    *out = mirror ? odev_register(bytes, mirror, 1) : NULL;
    if (!*out) {
        free(mirror);
        return AVGPIPE_OUT_OF_MEMORY;
    }
    __atomic_add_fetch(&ADEV.allocs, 1, __ATOMIC_RELAXED);
    return AVGPIPE_OK;
}
static void odev_free(void *u, void *p) {
    (void)u;
    if (!p) return;
    __atomic_add_fetch(&ADEV.frees, 1, __ATOMIC_RELAXED);
    odev_release(p);
}
static avgpipe_result odev_copy(void *u, void *dst, const void *src, size_t n, avgpipe_device_copy_kind k, avgpipe_device_stream s) {
    int ddev = odev_is_device(dst), sdev = odev_is_device(src);
    int want_d = k != AVGPIPE_DEVICE_COPY_D2H, want_s = k != AVGPIPE_DEVICE_COPY_H2D;
    if (n && (ddev != want_d || sdev != want_s)) {
        pthread_mutex_lock(&ODEV.mu);
        ODEV.bad_kinds++;
        snprintf(ODEV.error, sizeof ODEV.error, "copy of kind %d from %s %p to %s %p", (int)k, sdev ? "device" : "host", src,
                 ddev ? "device" : "host", dst);
        pthread_mutex_unlock(&ODEV.mu);
        return AVGPIPE_BACKEND_ERROR;
    }
    return adev_copy(u, odev_mirror(dst), odev_mirror(src), n, k, s);
}
static avgpipe_result odev_memset(void *u, void *dst, int v, size_t n, avgpipe_device_stream s) {
    return adev_memset(u, odev_mirror(dst), v, n, s);
}
static avgpipe_result odev_ea_pass(void *u, const avgpipe_ea_pass *p, avgpipe_device_stream s) {
    avgpipe_ea_pass q = *p;
    q.w = (float *)odev_mirror(p->w);
    q.z = (const float *)odev_mirror(p->z);
    q.z_prev = (const float *)odev_mirror(p->z_prev);
    q.acc = (float *)odev_mirror(p->acc);
    q.skip = (const uint32_t *)odev_mirror(p->skip);
    return adev_ea_pass(u, &q, s);
}
static avgpipe_result odev_find_nonfinite(void *u, const float *x, size_t n, size_t *index, avgpipe_device_stream s) {
    return adev_find_nonfinite(u, (const float *)odev_mirror(x), n, index, s);
}
static avgpipe_result odev_scale(void *u, float *x, float f, size_t n, avgpipe_device_stream s) {
    return adev_scale(u, (float *)odev_mirror(x), f, n, s);
}
static avgpipe_result odev_flag_nonfinite(void *u, const float *x, size_t n, uint32_t *flag, uint32_t bits, uint32_t tag,
                                          avgpipe_device_stream s) {
    return adev_flag_nonfinite(u, (const float *)odev_mirror(x), n, (uint32_t *)odev_mirror(flag), bits, tag, s);
}
static const char *odev_error_string(void *u) {
    (void)u;
    return ODEV.error;
}

/* The device table (call once per device's life; odev_close at the end). */
static avgpipe_device odev_open(long delay_us) {
    avgpipe_device t = adev_open(delay_us);
    static int once;
    if (!once) pthread_mutex_init(&ODEV.mu, NULL), once = 1;
    ODEV.bad_kinds = 0;
    ODEV.error[0] = 0;
    t.name = "opaque-test";
    t.alloc = odev_alloc;
    t.free = odev_free;
    t.copy = odev_copy;
    t.memset = odev_memset;
    t.ea_pass = odev_ea_pass;
    t.find_nonfinite = odev_find_nonfinite;
    t.scale = odev_scale;
    t.flag_nonfinite = odev_flag_nonfinite;
    t.error_string = odev_error_string;
    return t;
}
static void odev_close(void) { adev_close(); }

#endif
