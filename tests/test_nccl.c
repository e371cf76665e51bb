/* Tests of avgpipe_nccl.h that need no GPU: argument checking, the id file protocol (threads and
   processes exchanging a 128-byte id through it, its atomic write, damaged, stale and foreign files,
   failure records, timeouts), creation failing cleanly, with CUDA's text and nothing left allocated,
   on a machine without a GPU, and (suite nccl_emu) the CUDA error state the backend leaves in the
   threads that call it, over an emulation of the CUDA runtime and NCCL (tests/nccl_emu.h).

   Real CUDA and NCCL are linked. The backend's calls go through tests/nccl_emu.h, which passes them to
   the real functions unless a test turned the emulation on (emu_begin): every suite but nccl_emu sees
   CUDA's and NCCL's own answers. What needs a GPU for real (transfers, groups, collectives, split, abort
   on NCCL) is tests/gpu/nccl_check.c, run by bench/gpu/run.sh.

   Criterion forks per test, so CUDA is first touched inside a test, never before the fork. */
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime_api.h>
#include <nccl.h>
#include "tests/nccl_emu.h" /* from here to its second inclusion, the CUDA and NCCL calls are the emulation's */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"
#include "avgpipe_nccl.h"
#define NCCL_EMU_DEFINE
#include "tests/nccl_emu.h"

#include <criterion/criterion.h>
#include <dirent.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void sleep_s(double s) {
    struct timespec ts;
    ts.tv_sec = (time_t)s;
    ts.tv_nsec = (long)((s - (double)ts.tv_sec) * 1e9);
    nanosleep(&ts, NULL);
}

/* A fresh directory per test (tests run in parallel processes). */
static void tmpdir(char *out, size_t cap) {
    snprintf(out, cap, "/tmp/avgpipe-nccl-test-XXXXXX");
    cr_assert(mkdtemp(out) != NULL, "mkdtemp");
}

static void rmtree(const char *dir) {
    DIR *d = opendir(dir);
    struct dirent *e;
    char p[512];
    if (!d) return;
    while ((e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        remove(p);
    }
    closedir(d);
    rmdir(dir);
}

/* Entries of dir whose name contains `what`. */
static int count_entries(const char *dir, const char *what) {
    DIR *d = opendir(dir);
    struct dirent *e;
    int n = 0;
    if (!d) return -1;
    while ((e = readdir(d)) != NULL) n += strstr(e->d_name, what) != NULL;
    closedir(d);
    return n;
}

static int count_fds(void) { return count_entries("/proc/self/fd", ""); }

/* An allocator that counts, so that a failed creation can be shown to give everything back. */
typedef struct counting {
    pthread_mutex_t mu;
    long allocs, frees;
} counting;
static void *counting_alloc(size_t n, void *user) {
    counting *c = (counting *)user;
    void *p = malloc(n);
    pthread_mutex_lock(&c->mu);
    c->allocs += p != NULL;
    pthread_mutex_unlock(&c->mu);
    return p;
}
static void counting_free(void *p, void *user) {
    counting *c = (counting *)user;
    if (!p) return;
    pthread_mutex_lock(&c->mu);
    c->frees++;
    pthread_mutex_unlock(&c->mu);
    free(p);
}
static void counting_ctx(avgpipe_context *ctx, counting *c) {
    avgpipe_context_desc d;
    memset(c, 0, sizeof *c);
    pthread_mutex_init(&c->mu, NULL);
    memset(&d, 0, sizeof d);
    d.allocator.alloc = counting_alloc;
    d.allocator.free = counting_free;
    d.allocator.user = c;
    cr_assert_eq(avgpipe_context_init(ctx, &d), AVGPIPE_OK);
}

static void fill_id(unsigned char *id, size_t n, unsigned seed) {
    size_t i;
    for (i = 0; i < n; i++) id[i] = (unsigned char)((seed * 2654435761u + (unsigned)i * 40503u) >> 7);
}

/* ---- the description ---------------------------------------------------------------------------- */

TestSuite(nccl_args, .timeout = 60);

/* A creation that must be refused before CUDA is touched: the result, the detail, *out zeroed, no
   allocation left behind. */
static void refused(const avgpipe_nccl_desc *d, const char *expect) {
    avgpipe_context ctx;
    counting c;
    avgpipe_comm out;
    avgpipe_result r;
    counting_ctx(&ctx, &c);
    memset(&out, 0xab, sizeof out);
    r = avgpipe_nccl_create(&ctx, d, &out);
    cr_assert_eq(r, AVGPIPE_INVALID_ARG, "got %s: %s", avgpipe_result_string(r), avgpipe_last_error(&ctx));
    cr_assert(strstr(avgpipe_last_error(&ctx), expect) != NULL, "detail \"%s\" lacks \"%s\"", avgpipe_last_error(&ctx), expect);
    cr_assert(out.isend == NULL && out.user == NULL && out.size == 0, "*out not zeroed on failure");
    cr_assert_eq(c.allocs, c.frees, "%ld allocations, %ld frees", c.allocs, c.frees);
}

Test(nccl_args, null_out_and_desc) {
    avgpipe_context ctx;
    avgpipe_nccl_desc d;
    avgpipe_comm out;
    avgpipe_context_init(&ctx, NULL);
    memset(&d, 0, sizeof d);
    cr_assert_eq(avgpipe_nccl_create(&ctx, &d, NULL), AVGPIPE_INVALID_ARG);
    cr_assert(strstr(avgpipe_last_error(&ctx), "out is NULL"));
    cr_assert_eq(avgpipe_nccl_create(&ctx, NULL, &out), AVGPIPE_INVALID_ARG);
    cr_assert(strstr(avgpipe_last_error(&ctx), "desc is NULL"));
}

Test(nccl_args, exactly_one_source) {
    avgpipe_nccl_desc d;
    ncclUniqueId id;
    memset(&d, 0, sizeof d);
    memset(&id, 0, sizeof id);
    d.size = 2;
    refused(&d, "exactly one of desc->id, desc->id_file and desc->comm (0 given)");
    d.id = &id;
    d.id_file = "/tmp/x";
    refused(&d, "(2 given)");
    d.id = NULL;
    d.id_file = "";
    refused(&d, "desc->id_file is empty");
}

Test(nccl_args, rank_size_device_timeouts_peers_token) {
    avgpipe_nccl_desc d;
    ncclUniqueId id;
    char token[100];
    int peers[2] = {0, 1};
    memset(&id, 0, sizeof id);
    memset(&d, 0, sizeof d);
    d.id = &id;
    refused(&d, "desc->size must be >= 1 (is 0)");
    d.size = 2, d.rank = 2;
    refused(&d, "desc->rank 2 is not in 0..1");
    d.rank = -1;
    refused(&d, "desc->rank -1 is not in 0..1");
    d.rank = 1, d.device = -2;
    refused(&d, "desc->device -2");
    d.device = 0, d.timeout_s = -1;
    refused(&d, "desc->timeout_s must be > 0");
    d.timeout_s = 0, d.spin_us = -5;
    refused(&d, "desc->spin_us and desc->max_sleep_us must be >= 0");
    d.spin_us = 0, d.npeers = 2;
    refused(&d, "desc->peers is NULL for npeers 2");
    d.peers = peers, d.npeers = -1;
    refused(&d, "npeers < 0");
    d.npeers = 0;
    memset(token, 'x', sizeof token - 1);
    token[sizeof token - 1] = 0;
    d.file_token = token;
    refused(&d, "desc->file_token has more than 63 bytes");
}

Test(nccl_args, defaults) {
    avgpipe_nccl_desc in, d;
    memset(&in, 0, sizeof in);
    d = avgpipe_nccl_query_defaults(NULL);
    cr_assert_eq(d.timeout_s, 120);
    cr_assert_eq(d.spin_us, 50);
    cr_assert_eq(d.max_sleep_us, 200);
    cr_assert_str_eq(d.file_token, "");
    cr_assert_eq(d.device, 0);
    in.timeout_s = 3, in.device = AVGPIPE_NCCL_DEVICE_LOCAL, in.file_token = "t";
    d = avgpipe_nccl_query_defaults(&in);
    cr_assert_eq(d.timeout_s, 3);
    cr_assert_eq(d.device, AVGPIPE_NCCL_DEVICE_LOCAL);
    cr_assert_str_eq(d.file_token, "t");
}

Test(nccl_args, rank_and_device_of_other_tables) {
    avgpipe_comm local;
    cr_assert_eq(avgpipe_nccl_rank(NULL), -1);
    cr_assert_eq(avgpipe_nccl_device(NULL), -1);
    cr_assert_eq(avgpipe_comm_local_create(NULL, 2, &local), AVGPIPE_OK);
    cr_assert_eq(avgpipe_nccl_rank(&local), -1);
    cr_assert_eq(avgpipe_nccl_device(&local), -1);
    avgpipe_comm_destroy(&local);
}

Test(nccl_args, local_rank_from_the_environment) {
    static const char *const names[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK",
                                        "SLURM_LOCALID", "LOCAL_RANK", "PMI_LOCAL_RANK"};
    size_t i;
    for (i = 0; i < sizeof names / sizeof names[0]; i++) unsetenv(names[i]);
    cr_assert_eq(avgpipe_nccl_local_rank(), -1);
    setenv("LOCAL_RANK", "3", 1);
    cr_assert_eq(avgpipe_nccl_local_rank(), 3);
    setenv("SLURM_LOCALID", "5", 1); /* earlier in the list: wins */
    cr_assert_eq(avgpipe_nccl_local_rank(), 5);
    setenv("SLURM_LOCALID", "five", 1); /* not a number: skipped */
    cr_assert_eq(avgpipe_nccl_local_rank(), 3);
}

/* ---- the id file ------------------------------------------------------------------------------------ */

TestSuite(nccl_file, .timeout = 120);

Test(nccl_file, write_then_read) {
    char dir[64], path[128];
    unsigned char id[128], got[128];
    avgpipe_context ctx;
    avgpipe_context_init(&ctx, NULL);
    tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/nccl.id", dir);
    fill_id(id, sizeof id, 7);
    cr_assert_eq(avgpipe_nccl_id_file_write(&ctx, path, "job-1", 4, id, sizeof id, NULL), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    memset(got, 0, sizeof got);
    cr_assert_eq(avgpipe_nccl_id_file_read(&ctx, path, "job-1", 4, got, sizeof got, 0, 0), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    cr_assert(memcmp(id, got, sizeof id) == 0, "the id read differs from the id written");
    cr_assert_eq(count_entries(dir, ".tmp-"), 0, "a temporary file was left behind");
    rmtree(dir);
}

typedef struct exchange {
    const char *path;
    unsigned seed;
    double delay, timeout;
    avgpipe_result res;
    unsigned char id[128];
    char err[AVGPIPE_ERROR_MAX];
} exchange;

static void *writer_thread(void *arg) {
    exchange *x = (exchange *)arg;
    avgpipe_context ctx;
    avgpipe_context_init(&ctx, NULL);
    sleep_s(x->delay);
    fill_id(x->id, sizeof x->id, x->seed);
    x->res = avgpipe_nccl_id_file_write(&ctx, x->path, "tok", 5, x->id, sizeof x->id, NULL);
    snprintf(x->err, sizeof x->err, "%s", avgpipe_last_error(&ctx));
    return NULL;
}

static void *reader_thread(void *arg) {
    exchange *x = (exchange *)arg;
    avgpipe_context ctx;
    avgpipe_context_init(&ctx, NULL);
    x->res = avgpipe_nccl_id_file_read(&ctx, x->path, "tok", 5, x->id, sizeof x->id, x->timeout, 30);
    snprintf(x->err, sizeof x->err, "%s", avgpipe_last_error(&ctx));
    return NULL;
}

/* Rank 0 (a thread) writes 300 ms after four readers started polling: each reads the same 128 bytes. */
Test(nccl_file, exchange_between_threads) {
    char dir[64], path[128];
    pthread_t t[5];
    exchange x[5];
    int i;
    double t0 = now_s();
    tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/nccl.id", dir);
    memset(x, 0, sizeof x);
    for (i = 0; i < 5; i++) x[i].path = path, x[i].timeout = 20, x[i].seed = 11, x[i].delay = 0.3;
    for (i = 1; i < 5; i++) pthread_create(&t[i], NULL, reader_thread, &x[i]);
    pthread_create(&t[0], NULL, writer_thread, &x[0]);
    for (i = 0; i < 5; i++) pthread_join(t[i], NULL);
    cr_assert_eq(x[0].res, AVGPIPE_OK, "writer: %s", x[0].err);
    for (i = 1; i < 5; i++) {
        cr_assert_eq(x[i].res, AVGPIPE_OK, "reader %d: %s", i, x[i].err);
        cr_assert(memcmp(x[i].id, x[0].id, 128) == 0, "reader %d read another id", i);
    }
    cr_assert(now_s() - t0 < 5, "took %.2f s", now_s() - t0);
    rmtree(dir);
}

/* The same between processes, as ranks of a job: three children wait for the file, the parent writes it. */
Test(nccl_file, exchange_between_processes) {
    char dir[64], path[128];
    unsigned char id[128];
    pid_t kids[3];
    int i, status;
    avgpipe_context ctx;
    avgpipe_context_init(&ctx, NULL);
    tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/nccl.id", dir);
    fill_id(id, sizeof id, 99);
    for (i = 0; i < 3; i++) {
        kids[i] = fork();
        cr_assert(kids[i] >= 0, "fork");
        if (kids[i] == 0) {
            unsigned char got[128];
            avgpipe_context c;
            avgpipe_context_init(&c, NULL);
            if (avgpipe_nccl_id_file_read(&c, path, "tok", 4, got, sizeof got, 20, 30) != AVGPIPE_OK) _exit(2);
            _exit(memcmp(got, id, sizeof got) == 0 ? 0 : 3);
        }
    }
    sleep_s(0.2);
    cr_assert_eq(avgpipe_nccl_id_file_write(&ctx, path, "tok", 4, id, sizeof id, NULL), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    for (i = 0; i < 3; i++) {
        cr_assert_eq(waitpid(kids[i], &status, 0), kids[i]);
        cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "rank %d: status %d (2: no id, 3: another id)", i + 1, status);
    }
    rmtree(dir);
}

typedef struct churn {
    const char *path;
    atomic_int stop, writes, failed; /* shared with the reader while it runs */
    avgpipe_result res;               /* read after the join */
} churn;

/* Rewrites the file again and again, each id 128 copies of one byte (a mix of two would show). */
static void *churn_thread(void *arg) {
    churn *c = (churn *)arg;
    unsigned char id[128];
    avgpipe_context ctx;
    avgpipe_context_init(&ctx, NULL);
    while (!atomic_load(&c->stop)) {
        memset(id, (unsigned char)(atomic_load(&c->writes) % 251), sizeof id);
        c->res = avgpipe_nccl_id_file_write(&ctx, c->path, "tok", 2, id, sizeof id, NULL);
        if (c->res) {
            atomic_store(&c->failed, 1);
            break;
        }
        atomic_fetch_add(&c->writes, 1);
    }
    return NULL;
}

/* The write is atomic: a reader that looks while the file is being replaced thousands of times sees a
   whole record every time, never a damaged one, never a mix of two ids. */
Test(nccl_file, readers_never_see_a_partial_file) {
    char dir[64], path[128];
    unsigned char id[128];
    pthread_t t;
    churn c;
    int looks = 0, ok = 0, i;
    double t0;
    avgpipe_context ctx;
    avgpipe_context_init(&ctx, NULL);
    tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/nccl.id", dir);
    memset(&c, 0, sizeof c);
    c.path = path;
    memset(id, 0, sizeof id);
    cr_assert_eq(avgpipe_nccl_id_file_write(&ctx, path, "tok", 2, id, sizeof id, NULL), AVGPIPE_OK);
    pthread_create(&t, NULL, churn_thread, &c);
    /* Until both sides have done enough to overlap (the writer's create + rename is far slower than a
       read, and on a loaded machine it may barely run at first), bounded by time, not by a look count. */
    t0 = now_s();
    while ((atomic_load(&c.writes) < 2000 || looks < 2000) && now_s() - t0 < 20.0 && !atomic_load(&c.failed)) {
        avgpipe_result r = avgpipe_nccl_id_file_read(&ctx, path, "tok", 2, id, sizeof id, 0, 0);
        looks++;
        cr_assert_eq(r, AVGPIPE_OK, "look %d after %d writes: %s", looks, atomic_load(&c.writes), avgpipe_last_error(&ctx));
        for (i = 1; i < 128; i++) cr_assert_eq(id[i], id[0], "a mix of two ids at byte %d", i);
        ok++;
    }
    atomic_store(&c.stop, 1);
    pthread_join(t, NULL);
    cr_assert_eq(c.res, AVGPIPE_OK, "writer failed");
    cr_assert(atomic_load(&c.writes) > 100 && ok > 100, "too little overlap to mean anything: %d writes, %d looks in %.1f s",
              atomic_load(&c.writes), ok, now_s() - t0);
    cr_assert_eq(count_entries(dir, ".tmp-"), 0, "temporary files left behind");
    rmtree(dir);
}

static size_t slurp(const char *path, unsigned char *buf, size_t cap) {
    FILE *f = fopen(path, "rb");
    size_t n;
    cr_assert(f != NULL, "open %s", path);
    n = fread(buf, 1, cap, f);
    fclose(f);
    return n;
}

static void spill(const char *path, const unsigned char *buf, size_t n) {
    FILE *f = fopen(path, "wb");
    cr_assert(f != NULL, "open %s", path);
    cr_assert_eq(fwrite(buf, 1, n, f), n);
    fclose(f);
}

/* What a writer without temporary name + rename could leave (half a file), or a flipped byte: refused
   as damaged, and the reader keeps waiting. The check the test above relies on can fail. */
Test(nccl_file, damaged_files_are_refused) {
    char dir[64], path[128];
    unsigned char id[128], rec[1024];
    size_t n;
    avgpipe_context ctx;
    avgpipe_result r;
    avgpipe_context_init(&ctx, NULL);
    tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/nccl.id", dir);
    fill_id(id, sizeof id, 3);
    cr_assert_eq(avgpipe_nccl_id_file_write(&ctx, path, "", 2, id, sizeof id, NULL), AVGPIPE_OK);
    n = slurp(path, rec, sizeof rec);
    cr_assert_eq(n, 104 + 128 + 8);
    spill(path, rec, n / 2);
    r = avgpipe_nccl_id_file_read(&ctx, path, "", 2, id, sizeof id, 0, 0);
    cr_assert_eq(r, AVGPIPE_TIMEOUT);
    cr_assert(strstr(avgpipe_last_error(&ctx), "damaged"), "%s", avgpipe_last_error(&ctx));
    rec[150] ^= 1;
    spill(path, rec, n);
    r = avgpipe_nccl_id_file_read(&ctx, path, "", 2, id, sizeof id, 0, 0);
    cr_assert_eq(r, AVGPIPE_TIMEOUT);
    cr_assert(strstr(avgpipe_last_error(&ctx), "checksum"), "%s", avgpipe_last_error(&ctx));
    spill(path, (const unsigned char *)"hello\n", 6);
    r = avgpipe_nccl_id_file_read(&ctx, path, "", 2, id, sizeof id, 0, 0);
    cr_assert_eq(r, AVGPIPE_TIMEOUT);
    cr_assert(strstr(avgpipe_last_error(&ctx), "not an avgpipe NCCL id"), "%s", avgpipe_last_error(&ctx));
    rmtree(dir);
}

/* A file older than max_age_s (an earlier job's) is ignored; once rank 0 replaces it, it is read. */
Test(nccl_file, stale_file_ignored_until_replaced) {
    char dir[64], path[128];
    unsigned char id[128], got[128];
    avgpipe_context ctx;
    avgpipe_result r;
    pthread_t t;
    exchange w;
    double t0;
    avgpipe_context_init(&ctx, NULL);
    tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/nccl.id", dir);
    fill_id(id, sizeof id, 1);
    cr_assert_eq(avgpipe_nccl_id_file_write(&ctx, path, "tok", 5, id, sizeof id, NULL), AVGPIPE_OK);
    sleep_s(1.3);
    r = avgpipe_nccl_id_file_read(&ctx, path, "tok", 5, got, sizeof got, 0.2, 1.0);
    cr_assert_eq(r, AVGPIPE_TIMEOUT);
    cr_assert(strstr(avgpipe_last_error(&ctx), "a stale file, written 1."), "%s", avgpipe_last_error(&ctx));
    /* still there and still stale while a reader waits; a writer replaces it 300 ms in */
    memset(&w, 0, sizeof w);
    w.path = path, w.seed = 2, w.delay = 0.3;
    t0 = now_s();
    pthread_create(&t, NULL, writer_thread, &w);
    r = avgpipe_nccl_id_file_read(&ctx, path, "tok", 5, got, sizeof got, 10, 1.0);
    pthread_join(t, NULL);
    cr_assert_eq(r, AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    cr_assert(memcmp(got, w.id, sizeof got) == 0, "read the stale id");
    cr_assert(now_s() - t0 >= 0.29 && now_s() - t0 < 5, "%.2f s", now_s() - t0);
    rmtree(dir);
}

Test(nccl_file, timeout_when_nobody_writes) {
    char dir[64], path[128];
    unsigned char id[128];
    avgpipe_context ctx;
    double t0, dt;
    avgpipe_result r;
    avgpipe_context_init(&ctx, NULL);
    tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/nccl.id", dir);
    t0 = now_s();
    r = avgpipe_nccl_id_file_read(&ctx, path, "", 3, id, sizeof id, 0.5, 0);
    dt = now_s() - t0;
    cr_assert_eq(r, AVGPIPE_TIMEOUT);
    cr_assert(dt >= 0.5 && dt < 2.0, "returned after %.3f s for a 0.5 s timeout", dt);
    cr_assert(strstr(avgpipe_last_error(&ctx), path) && strstr(avgpipe_last_error(&ctx), "no file yet"), "%s", avgpipe_last_error(&ctx));
    rmtree(dir);
}

/* Another job's file (token), or one for another number of ranks or id size, is not this job's. */
Test(nccl_file, foreign_files_ignored) {
    char dir[64], path[128];
    unsigned char id[128], got[128];
    avgpipe_context ctx;
    avgpipe_context_init(&ctx, NULL);
    tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/nccl.id", dir);
    fill_id(id, sizeof id, 5);
    cr_assert_eq(avgpipe_nccl_id_file_write(&ctx, path, "job-1", 4, id, sizeof id, NULL), AVGPIPE_OK);
    cr_assert_eq(avgpipe_nccl_id_file_read(&ctx, path, "job-2", 4, got, sizeof got, 0, 0), AVGPIPE_TIMEOUT);
    cr_assert(strstr(avgpipe_last_error(&ctx), "another job (token \"job-1\", this job's \"job-2\")"), "%s", avgpipe_last_error(&ctx));
    cr_assert_eq(avgpipe_nccl_id_file_read(&ctx, path, "job-1", 3, got, sizeof got, 0, 0), AVGPIPE_TIMEOUT);
    cr_assert(strstr(avgpipe_last_error(&ctx), "a file for 4 ranks (this job has 3)"), "%s", avgpipe_last_error(&ctx));
    cr_assert_eq(avgpipe_nccl_id_file_read(&ctx, path, "job-1", 4, got, 64, 0, 0), AVGPIPE_TIMEOUT);
    cr_assert(strstr(avgpipe_last_error(&ctx), "an id of 128 bytes (expected 64)"), "%s", avgpipe_last_error(&ctx));
    cr_assert_eq(avgpipe_nccl_id_file_read(&ctx, path, "job-1", 4, got, sizeof got, 0, 0), AVGPIPE_OK);
    rmtree(dir);
}

/* Rank 0 that cannot make an id writes its failure: the others stop at once with its text. */
Test(nccl_file, failure_record_stops_readers_at_once) {
    char dir[64], path[128];
    unsigned char id[128];
    avgpipe_context ctx;
    double t0;
    avgpipe_context_init(&ctx, NULL);
    tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/nccl.id", dir);
    cr_assert_eq(avgpipe_nccl_id_file_write(&ctx, path, "t", 2, NULL, 0, "rank 0: no usable CUDA device"), AVGPIPE_OK);
    t0 = now_s();
    cr_assert_eq(avgpipe_nccl_id_file_read(&ctx, path, "t", 2, id, sizeof id, 30, 0), AVGPIPE_BACKEND_ERROR);
    cr_assert(now_s() - t0 < 5, "waited %.2f s (of a 30 s timeout)", now_s() - t0);
    cr_assert(strstr(avgpipe_last_error(&ctx), "rank 0 failed: rank 0: no usable CUDA device"), "%s", avgpipe_last_error(&ctx));
    /* another job's failure record is not ours */
    cr_assert_eq(avgpipe_nccl_id_file_read(&ctx, path, "u", 2, id, sizeof id, 0, 0), AVGPIPE_TIMEOUT);
    rmtree(dir);
}

Test(nccl_file, write_errors_name_the_path) {
    char dir[64], path[160];
    unsigned char id[128];
    avgpipe_context ctx;
    avgpipe_context_init(&ctx, NULL);
    tmpdir(dir, sizeof dir);
    memset(id, 1, sizeof id);
    snprintf(path, sizeof path, "%s/missing/nccl.id", dir);
    cr_assert_eq(avgpipe_nccl_id_file_write(&ctx, path, "", 2, id, sizeof id, NULL), AVGPIPE_IO_ERROR);
    cr_assert(strstr(avgpipe_last_error(&ctx), "missing/nccl.id.tmp-") && strstr(avgpipe_last_error(&ctx), "No such file"), "%s",
              avgpipe_last_error(&ctx));
    /* the rename fails (a non-empty directory is in the way): the temporary file goes away */
    snprintf(path, sizeof path, "%s/in-the-way", dir);
    cr_assert_eq(mkdir(path, 0755), 0);
    {
        char inner[200];
        snprintf(inner, sizeof inner, "%s/x", path);
        spill(inner, (const unsigned char *)"x", 1);
    }
    cr_assert_eq(avgpipe_nccl_id_file_write(&ctx, path, "", 2, id, sizeof id, NULL), AVGPIPE_IO_ERROR);
    cr_assert(strstr(avgpipe_last_error(&ctx), "cannot write") && strstr(avgpipe_last_error(&ctx), "in-the-way"), "%s", avgpipe_last_error(&ctx));
    cr_assert_eq(count_entries(dir, ".tmp-"), 0, "the temporary file was left behind");
    {
        char inner[200];
        snprintf(inner, sizeof inner, "%s/x", path);
        remove(inner);
        rmdir(path);
    }
    rmtree(dir);
}

Test(nccl_file, bad_arguments) {
    unsigned char id[128];
    char token[80];
    avgpipe_context ctx;
    avgpipe_context_init(&ctx, NULL);
    memset(token, 'a', sizeof token - 1);
    token[sizeof token - 1] = 0;
    cr_assert_eq(avgpipe_nccl_id_file_write(&ctx, NULL, "", 2, id, sizeof id, NULL), AVGPIPE_INVALID_ARG);
    cr_assert_eq(avgpipe_nccl_id_file_write(&ctx, "", "", 2, id, sizeof id, NULL), AVGPIPE_INVALID_ARG);
    cr_assert_eq(avgpipe_nccl_id_file_write(&ctx, "/tmp/x", "", 0, id, sizeof id, NULL), AVGPIPE_INVALID_ARG);
    cr_assert_eq(avgpipe_nccl_id_file_write(&ctx, "/tmp/x", "", 2, NULL, sizeof id, NULL), AVGPIPE_INVALID_ARG);
    cr_assert_eq(avgpipe_nccl_id_file_write(&ctx, "/tmp/x", "", 2, id, 0, NULL), AVGPIPE_INVALID_ARG);
    cr_assert_eq(avgpipe_nccl_id_file_write(&ctx, "/tmp/x", token, 2, id, sizeof id, NULL), AVGPIPE_INVALID_ARG);
    cr_assert(strstr(avgpipe_last_error(&ctx), "the token has 79 bytes (at most 63)"), "%s", avgpipe_last_error(&ctx));
    cr_assert_eq(avgpipe_nccl_id_file_read(&ctx, NULL, "", 2, id, sizeof id, 0, 0), AVGPIPE_INVALID_ARG);
    cr_assert_eq(avgpipe_nccl_id_file_read(&ctx, "/tmp/x", "", 0, id, sizeof id, 0, 0), AVGPIPE_INVALID_ARG);
    cr_assert_eq(avgpipe_nccl_id_file_read(&ctx, "/tmp/x", "", 2, NULL, sizeof id, 0, 0), AVGPIPE_INVALID_ARG);
    cr_assert_eq(avgpipe_nccl_id_file_read(&ctx, "/tmp/x", "", 2, id, sizeof id, -1, 0), AVGPIPE_INVALID_ARG);
    cr_assert_eq(avgpipe_nccl_id_file_read(&ctx, "/tmp/x", token, 2, id, sizeof id, 0, 0), AVGPIPE_INVALID_ARG);
}

/* ---- creation without a GPU -------------------------------------------------------------------------- */

TestSuite(nccl_nogpu, .timeout = 120);

/* This suite checks the failure path; on a machine with a GPU the GPU check covers creation instead. */
static void skip_if_gpu(char *cuda_text, size_t cap) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e == cudaSuccess && n > 0) cr_skip_test("a GPU is present (%d): tests/gpu/nccl_check.c covers creation", n);
    snprintf(cuda_text, cap, "%s", e == cudaSuccess ? "no CUDA device" : cudaGetErrorString(e));
}

/* Every bootstrap fails with CUDA's own text, *out zeroed, every allocation given back, no descriptor
   left open. */
Test(nccl_nogpu, create_fails_with_cudas_text_and_leaks_nothing) {
    char text[256], dir[64], path[128];
    avgpipe_context ctx;
    counting c;
    avgpipe_nccl_desc d;
    avgpipe_comm out;
    ncclUniqueId id;
    avgpipe_result r;
    int fds, k;
    skip_if_gpu(text, sizeof text);
    tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/nccl.id", dir);
    fds = count_fds();
    for (k = 0; k < 3; k++) {
        counting_ctx(&ctx, &c);
        memset(&d, 0, sizeof d);
        memset(&id, 0, sizeof id);
        d.size = 2, d.rank = 1, d.timeout_s = 5;
        if (k == 0) d.id = &id;
        if (k == 1) d.id_file = path;
        if (k == 2) d.id = &id, d.device = AVGPIPE_NCCL_DEVICE_LOCAL;
        memset(&out, 0x5a, sizeof out);
        r = avgpipe_nccl_create(&ctx, &d, &out);
        cr_assert_eq(r, AVGPIPE_BACKEND_ERROR, "bootstrap %d: %s: %s", k, avgpipe_result_string(r), avgpipe_last_error(&ctx));
        cr_assert(strstr(avgpipe_last_error(&ctx), "avgpipe_nccl_create: rank 1: no usable CUDA device: cudaGetDeviceCount: ") != NULL,
                  "%s", avgpipe_last_error(&ctx));
        cr_assert(strstr(avgpipe_last_error(&ctx), text) != NULL, "CUDA's text \"%s\" missing: %s", text, avgpipe_last_error(&ctx));
        cr_assert(out.isend == NULL && out.user == NULL, "*out not zeroed");
        cr_assert_eq(c.allocs, c.frees, "bootstrap %d: %ld allocations, %ld frees", k, c.allocs, c.frees);
        cr_assert(c.allocs > 0, "the counting allocator was not used (the test would prove nothing)");
    }
    cr_assert_eq(count_fds(), fds, "file descriptors leaked");
    cr_assert_eq(count_entries(dir, "nccl.id"), 0, "rank 1 wrote a file");
    rmtree(dir);
}

/* Rank 0 without a GPU (file bootstrap) fails with CUDA's text and leaves a failure record, so that a
   rank 1 whose GPU works stops at once instead of at its timeout. */
Test(nccl_nogpu, rank0_failure_reaches_the_other_ranks) {
    char text[256], dir[64], path[128];
    avgpipe_context ctx;
    counting c;
    avgpipe_nccl_desc d;
    avgpipe_comm out;
    unsigned char id[128];
    avgpipe_result r;
    double t0;
    skip_if_gpu(text, sizeof text);
    tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/nccl.id", dir);
    counting_ctx(&ctx, &c);
    memset(&d, 0, sizeof d);
    d.size = 3, d.rank = 0, d.id_file = path, d.file_token = "job-7";
    r = avgpipe_nccl_create(&ctx, &d, &out);
    cr_assert_eq(r, AVGPIPE_BACKEND_ERROR, "%s", avgpipe_last_error(&ctx));
    cr_assert(strstr(avgpipe_last_error(&ctx), text), "%s", avgpipe_last_error(&ctx));
    cr_assert_eq(c.allocs, c.frees);
    t0 = now_s();
    r = avgpipe_nccl_id_file_read(&ctx, path, "job-7", 3, id, sizeof id, 30, 60);
    cr_assert_eq(r, AVGPIPE_BACKEND_ERROR, "%s", avgpipe_last_error(&ctx));
    cr_assert(now_s() - t0 < 5, "the reader waited %.2f s (of a 30 s timeout)", now_s() - t0);
    cr_assert(strstr(avgpipe_last_error(&ctx), "rank 0 failed: rank 0: no usable CUDA device") && strstr(avgpipe_last_error(&ctx), text), "%s",
              avgpipe_last_error(&ctx));
    rmtree(dir);
}

/* ---- no CUDA error state left behind, over the emulation --------------------------------------------------
   CUDA keeps a last error per host thread: a call that returns an error sets it, cudaGetLastError returns
   and clears it. cudaStreamQuery and cudaEventQuery answer cudaErrorNotReady while work is pending, and
   that answer is recorded like any error: a backend that polls and does not consume it leaves "device not
   ready" for the next cudaGetLastError on that thread, e.g. a trainer's callback checking its own launch
   (examples/cuda_mlp.cu) on the worker thread after a comm call. These tests run the backend's ranks as
   threads over tests/nccl_emu.h, whose every query answers "not ready" a few times before "done", and
   check after every backend call, on the thread that made it, what cudaGetLastError would tell a callback
   there, and at the end, in every thread the emulation saw, the last error. */

TestSuite(nccl_emu, .timeout = 120);

#define ER 3     /* ranks: one thread each, as one process's worker thread */
#define EB 200   /* bytes of a ring message */
#define EF 37    /* floats of an allreduce */
#define EITER 4  /* iterations of the ring */
#define EPOLLS 3 /* "not ready" answers of every query before "done" */

/* One thread's record: the first backend call after which the thread's last error was not cudaSuccess,
   the first failure, and its last error and not-ready answers at the end. */
typedef struct checked {
    char who[32];
    int bad;
    char first[320];
    char which[400]; /* the calls that left it, each named once */
    avgpipe_result res;
    char msg[AVGPIPE_ERROR_MAX + 64];
    cudaError_t at_end;
    long not_ready, calls;
} checked;

/* After a backend call on this thread: what cudaGetLastError would tell a callback now (read without
   clearing; cleared once recorded, so that a later report is about a later call). */
static void after(checked *c, const char *what) {
    cudaError_t e = emu_cudaPeekAtLastError();
    c->calls++;
    if (e == cudaSuccess) return;
    if (!c->bad++)
        snprintf(c->first, sizeof c->first, "%s: after %s, cudaGetLastError() is %s (%s)", c->who, what, cudaGetErrorName(e),
                 cudaGetErrorString(e));
    if (!strstr(c->which, what)) {
        size_t n = strlen(c->which);
        snprintf(c->which + n, sizeof c->which - n, "%s%s", n ? ", " : "", what);
    }
    (void)emu_cudaGetLastError();
}

/* after(), then the call's result: 1 when AVGPIPE_OK, else the failure is recorded (first only). */
static int called(checked *c, avgpipe_result res, const char *detail, const char *what) {
    after(c, what);
    if (res == AVGPIPE_OK) return 1;
    if (c->res == AVGPIPE_OK) {
        c->res = res;
        snprintf(c->msg, sizeof c->msg, "%s: %s: %s: %s", c->who, what, avgpipe_result_string(res), detail ? detail : "");
    }
    return 0;
}

static const char *table_error(const avgpipe_comm *t, int self) { return t->last_error ? t->last_error(t->user, self) : ""; }

/* The test's own emulated calls (its buffers, streams, events) must work: a failure is the test's. */
static int setup_ok(checked *c, cudaError_t e, const char *what) {
    if (e == cudaSuccess) return 1;
    if (c->res == AVGPIPE_OK) c->res = AVGPIPE_BACKEND_ERROR, snprintf(c->msg, sizeof c->msg, "%s: test setup: %s: %s", c->who, what, cudaGetErrorName(e));
    return 0;
}

/* The test's own wait for its stream, consuming "not ready" as a caller should. */
static int stream_sync(checked *c, cudaStream_t s) {
    double t0 = now_s();
    for (;;) {
        cudaError_t e = emu_cudaStreamQuery(s);
        if (e == cudaSuccess) return 1;
        if (e != cudaErrorNotReady) return setup_ok(c, e, "cudaStreamQuery");
        (void)emu_cudaGetLastError();
        if (now_s() - t0 > 20) return setup_ok(c, cudaErrorLaunchTimeout, "the test's stream did not finish");
        sleep_s(20e-6);
    }
}

static void pattern(unsigned char *p, size_t n, int rank, int it) {
    size_t i;
    for (i = 0; i < n; i++) p[i] = (unsigned char)(rank * 31 + it * 7 + (int)i * 3);
}

typedef struct erank {
    int rank, size, deterministic;
    const ncclUniqueId *id;
    avgpipe_comm comm, avg;
    checked worker, averager;
} erank;

/* The averaging thread: allreduce_sum on the split table, host memory (staged) and device memory, while
   the worker moves messages on the parent table. Its last call is a device allreduce (no staging copy
   after the collective's wait). */
static void *eaverager(void *arg) {
    erank *r = (erank *)arg;
    checked *c = &r->averager;
    float h[EF], *dv = NULL;
    cudaStream_t us = NULL;
    int k, i, q;
    if (!setup_ok(c, emu_cudaSetDevice(r->rank), "cudaSetDevice") || !setup_ok(c, emu_cudaMalloc((void **)&dv, sizeof h), "cudaMalloc") ||
        !setup_ok(c, emu_cudaStreamCreateWithFlags(&us, cudaStreamNonBlocking), "cudaStreamCreateWithFlags"))
        goto out;
    for (k = 0; k < 3; k++) {
        for (i = 0; i < EF; i++) h[i] = (float)(r->rank * 8 + k) + 0.25f * (float)i;
        if (!called(c, r->avg.allreduce_sum(r->avg.user, r->rank, h, EF, 20), table_error(&r->avg, r->rank), "allreduce_sum (host memory)"))
            goto out;
        for (i = 0; i < EF; i++) {
            float want = 0;
            for (q = 0; q < r->size; q++) want += (float)(q * 8 + k) + 0.25f * (float)i;
            if (h[i] != want) {
                called(c, AVGPIPE_MISMATCH, "", "allreduce_sum (host memory): a wrong sum");
                goto out;
            }
        }
        for (i = 0; i < EF; i++) h[i] = (float)(r->rank + k) - 0.5f * (float)i;
        if (!setup_ok(c, emu_cudaMemcpyAsync(dv, h, sizeof h, cudaMemcpyHostToDevice, us), "cudaMemcpyAsync") || !stream_sync(c, us)) goto out;
        if (!called(c, r->avg.allreduce_sum(r->avg.user, r->rank, dv, EF, 20), table_error(&r->avg, r->rank), "allreduce_sum (device memory)"))
            goto out;
        if (!setup_ok(c, emu_cudaMemcpyAsync(h, dv, sizeof h, cudaMemcpyDeviceToHost, us), "cudaMemcpyAsync") || !stream_sync(c, us)) goto out;
        for (i = 0; i < EF; i++) {
            float want = 0;
            for (q = 0; q < r->size; q++) want += (float)(q + k) - 0.5f * (float)i;
            if (h[i] != want) {
                called(c, AVGPIPE_MISMATCH, "", "allreduce_sum (device memory): a wrong sum");
                goto out;
            }
        }
    }
out:
    c->at_end = emu_cudaGetLastError(); /* the thread's own check, after its last backend call */
    c->not_ready = emu_not_ready_here();
    if (us) emu_cudaStreamDestroy(us);
    if (dv) emu_cudaFree(dv);
    return NULL;
}

/* One rank's worker thread: create (init, the up/down splits, connecting the neighbours, the barrier),
   split for the averaging thread, then a ring each iteration: device-ordered isend_on/irecv_on in a group
   (test polled), plain isend/irecv of host memory (staged, waited for), a barrier; destroy both tables. */
static void *eworker(void *arg) {
    erank *r = (erank *)arg;
    checked *c = &r->worker;
    avgpipe_context ctx;
    avgpipe_nccl_desc d;
    pthread_t avg_thread;
    int avg_started = 0, made = 0, split = 0, it, i, members[ER];
    int next = (r->rank + 1) % r->size, prev = (r->rank + r->size - 1) % r->size;
    unsigned char *dsend = NULL, *drecv = NULL, hsend[EB], hrecv[EB], want[EB];
    cudaStream_t us = NULL;
    cudaEvent_t ready = NULL, sdone = NULL, rdone = NULL;
    avgpipe_context_init(&ctx, NULL);
    memset(&d, 0, sizeof d);
    d.id = r->id, d.rank = r->rank, d.size = r->size, d.device = r->rank;
    d.timeout_s = 20, d.spin_us = 1, d.max_sleep_us = 50, d.deterministic_allreduce = r->deterministic;
    if (!called(c, avgpipe_nccl_create(&ctx, &d, &r->comm), avgpipe_last_error(&ctx), "avgpipe_nccl_create")) goto out;
    made = 1;
    for (i = 0; i < r->size; i++) members[i] = i;
    if (!called(c, r->comm.split(r->comm.user, r->rank, members, r->size, &r->avg), table_error(&r->comm, r->rank), "split")) goto out;
    split = 1;
    if (pthread_create(&avg_thread, NULL, eaverager, r) != 0) goto out;
    avg_started = 1;
    if (!setup_ok(c, emu_cudaSetDevice(r->rank), "cudaSetDevice") || !setup_ok(c, emu_cudaMalloc((void **)&dsend, EB), "cudaMalloc") ||
        !setup_ok(c, emu_cudaMalloc((void **)&drecv, EB), "cudaMalloc") ||
        !setup_ok(c, emu_cudaStreamCreateWithFlags(&us, cudaStreamNonBlocking), "cudaStreamCreateWithFlags") ||
        !setup_ok(c, emu_cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreateWithFlags") ||
        !setup_ok(c, emu_cudaEventCreateWithFlags(&sdone, cudaEventDisableTiming), "cudaEventCreateWithFlags") ||
        !setup_ok(c, emu_cudaEventCreateWithFlags(&rdone, cudaEventDisableTiming), "cudaEventCreateWithFlags"))
        goto out;
    for (it = 0; it < EITER; it++) {
        avgpipe_comm_request sreq = NULL, rreq = NULL, hs = NULL, hr = NULL;
        avgpipe_comm_status st;
        int sd = 0, rd = 0;
        double t0;
        /* the producer: a copy on the test's stream, `ready` after it (the transfer waits on the device) */
        pattern(hsend, EB, r->rank, it);
        if (!setup_ok(c, emu_cudaMemcpyAsync(dsend, hsend, EB, cudaMemcpyHostToDevice, us), "cudaMemcpyAsync") ||
            !setup_ok(c, emu_cudaEventRecord(ready, us), "cudaEventRecord"))
            goto out;
        if (!called(c, r->comm.group_begin(r->comm.user, r->rank), table_error(&r->comm, r->rank), "group_begin") ||
            !called(c, r->comm.isend_on(r->comm.user, r->rank, next, dsend, EB, 10u + (unsigned)it, (avgpipe_device_event)(void *)ready,
                                        (avgpipe_device_event)(void *)sdone, &sreq),
                    table_error(&r->comm, r->rank), "isend_on") ||
            !called(c, r->comm.irecv_on(r->comm.user, r->rank, prev, drecv, EB, 10u + (unsigned)it, NULL, (avgpipe_device_event)(void *)rdone,
                                        &rreq),
                    table_error(&r->comm, r->rank), "irecv_on") ||
            !called(c, r->comm.group_end(r->comm.user, r->rank), table_error(&r->comm, r->rank), "group_end"))
            goto out;
        for (t0 = now_s(); !sd || !rd;) {
            if (!sd && !called(c, r->comm.test(r->comm.user, r->rank, sreq, &sd, NULL), table_error(&r->comm, r->rank), "test (isend_on)")) goto out;
            if (!rd && !called(c, r->comm.test(r->comm.user, r->rank, rreq, &rd, &st), table_error(&r->comm, r->rank), "test (irecv_on)")) goto out;
            if (now_s() - t0 > 20) {
                called(c, AVGPIPE_TIMEOUT, "", "test: the ring's transfers never finished");
                goto out;
            }
            if (!sd || !rd) sleep_s(20e-6);
        }
        /* the consumer orders itself after `done`, on its own stream */
        memset(hrecv, 0, EB);
        if (!setup_ok(c, emu_cudaStreamWaitEvent(us, rdone, 0), "cudaStreamWaitEvent") ||
            !setup_ok(c, emu_cudaMemcpyAsync(hrecv, drecv, EB, cudaMemcpyDeviceToHost, us), "cudaMemcpyAsync") || !stream_sync(c, us))
            goto out;
        pattern(want, EB, prev, it);
        if (memcmp(hrecv, want, EB) != 0) {
            called(c, AVGPIPE_MISMATCH, "", "irecv_on: the bytes received are not the sender's");
            goto out;
        }
        /* host memory: staged through device buffers */
        pattern(hsend, EB, r->rank, it + 50);
        memset(hrecv, 0, EB);
        if (!called(c, r->comm.irecv(r->comm.user, r->rank, prev, hrecv, EB, 99, &hr), table_error(&r->comm, r->rank), "irecv") ||
            !called(c, r->comm.isend(r->comm.user, r->rank, next, hsend, EB, 99, &hs), table_error(&r->comm, r->rank), "isend") ||
            !called(c, r->comm.wait(r->comm.user, r->rank, hs, 20, NULL), table_error(&r->comm, r->rank), "wait (isend)") ||
            !called(c, r->comm.wait(r->comm.user, r->rank, hr, 20, &st), table_error(&r->comm, r->rank), "wait (irecv)"))
            goto out;
        pattern(want, EB, prev, it + 50);
        if (st.bytes != EB || memcmp(hrecv, want, EB) != 0) {
            called(c, AVGPIPE_MISMATCH, "", "irecv: the bytes received are not the sender's");
            goto out;
        }
        if (!called(c, r->comm.barrier(r->comm.user, r->rank, 20), table_error(&r->comm, r->rank), "barrier")) goto out;
    }
out:
    if (avg_started) pthread_join(avg_thread, NULL);
    if (split) {
        avgpipe_comm_destroy(&r->avg);
        after(c, "destroy (the split)");
    }
    if (made) {
        avgpipe_comm_destroy(&r->comm);
        after(c, "destroy");
    }
    c->at_end = emu_cudaGetLastError();
    c->not_ready = emu_not_ready_here();
    if (ready) emu_cudaEventDestroy(ready);
    if (sdone) emu_cudaEventDestroy(sdone);
    if (rdone) emu_cudaEventDestroy(rdone);
    if (us) emu_cudaStreamDestroy(us);
    if (dsend) emu_cudaFree(dsend);
    if (drecv) emu_cudaFree(drecv);
    return NULL;
}

static void fill_emu_id(ncclUniqueId *id, unsigned seed) {
    memset(id, 0, sizeof *id);
    fill_id((unsigned char *)id->internal, sizeof id->internal, seed);
}

/* What every thread the emulation saw has as its last error now, and what it left allocated. */
static void assert_threads_clean(int min_threads) {
    emu_thread_info info[EMU_MAX_THREADS];
    char text[400];
    int n = emu_threads(info, EMU_MAX_THREADS), i, allocs, streams, events;
    cr_assert_eq(emu_problems(text, sizeof text), 0, "the emulation saw a problem: %s", text);
    cr_assert(n >= min_threads, "only %d threads called the emulation (expected at least %d)", n, min_threads);
    for (i = 0; i < n; i++)
        cr_assert_eq(info[i].last, cudaSuccess, "thread %d of %d (%ld calls): cudaGetLastError() would return %s", i, n, info[i].calls,
                     cudaGetErrorName(info[i].last));
    emu_live(&allocs, &streams, &events);
    cr_assert(allocs == 0 && streams == 0 && events == 0, "left behind: %d device allocations, %d streams, %d events", allocs, streams, events);
}

static void assert_checked(const checked *c) {
    cr_assert_eq(c->res, AVGPIPE_OK, "%s", c->msg);
    cr_assert_eq(c->bad, 0, "%d backend calls left CUDA error state on the calling thread; the first: %s; the calls that did: %s", c->bad,
                 c->first, c->which);
    cr_assert_eq(c->at_end, cudaSuccess, "%s: cudaGetLastError() at the end is %s", c->who, cudaGetErrorName(c->at_end));
    cr_assert(c->not_ready >= EPOLLS, "%s got %ld \"not ready\" answers: the polls the test is about did not happen", c->who, c->not_ready);
}

static void ring_and_averaging(int deterministic) {
    erank r[ER];
    pthread_t th[ER];
    ncclUniqueId id;
    int k;
    emu_begin(ER, EPOLLS);
    fill_emu_id(&id, 17u + (unsigned)deterministic);
    memset(r, 0, sizeof r);
    for (k = 0; k < ER; k++) {
        r[k].rank = k, r[k].size = ER, r[k].deterministic = deterministic, r[k].id = &id;
        snprintf(r[k].worker.who, sizeof r[k].worker.who, "rank %d's worker", k);
        snprintf(r[k].averager.who, sizeof r[k].averager.who, "rank %d's averager", k);
        cr_assert_eq(pthread_create(&th[k], NULL, eworker, &r[k]), 0);
    }
    for (k = 0; k < ER; k++) pthread_join(th[k], NULL);
    for (k = 0; k < ER; k++) {
        assert_checked(&r[k].worker);
        assert_checked(&r[k].averager);
    }
    assert_threads_clean(2 * ER);
    emu_end();
}

/* Every poll of the backend (creation's connection and barrier, test and wait, the staging copies, the
   collectives and their copies, destroy) sees "not ready" and leaves nothing behind, in each rank's worker
   and averaging thread. */
Test(nccl_emu, no_cuda_error_left_in_any_thread) { ring_and_averaging(0); }
Test(nccl_emu, no_cuda_error_left_in_any_thread_deterministic_allreduce) { ring_and_averaging(1); }

typedef struct epending {
    int rank;
    const ncclUniqueId *id;
    int inject; /* rank 0: a real CUDA error in its wait */
    checked c;
    avgpipe_result late; /* a call after the abort */
    char err[AVGPIPE_ERROR_MAX];
} epending;

/* Two ranks; each posts a receive that no one sends. Rank 0 polls it (not done) and cancels it, which
   aborts its table; rank 1 polls it and destroys its table with the receive pending. Or (inject) rank 0's
   wait meets a real CUDA error: reported with CUDA's text, the table aborted, and nothing left behind. */
static void *epending_rank(void *arg) {
    epending *p = (epending *)arg;
    checked *c = &p->c;
    avgpipe_context ctx;
    avgpipe_nccl_desc d;
    avgpipe_comm comm;
    avgpipe_comm_request req = NULL, other = NULL;
    unsigned char *buf = NULL;
    int done = 0, made = 0;
    avgpipe_context_init(&ctx, NULL);
    memset(&d, 0, sizeof d);
    d.id = p->id, d.rank = p->rank, d.size = 2, d.device = p->rank, d.timeout_s = 20, d.spin_us = 1, d.max_sleep_us = 50;
    p->late = AVGPIPE_OK;
    if (!called(c, avgpipe_nccl_create(&ctx, &d, &comm), avgpipe_last_error(&ctx), "avgpipe_nccl_create")) goto out;
    made = 1;
    if (!setup_ok(c, emu_cudaSetDevice(p->rank), "cudaSetDevice") || !setup_ok(c, emu_cudaMalloc((void **)&buf, EB), "cudaMalloc")) goto out;
    if (!called(c, comm.irecv_on(comm.user, p->rank, 1 - p->rank, buf, EB, 5, NULL, NULL, &req), table_error(&comm, p->rank), "irecv_on") ||
        !called(c, comm.test(comm.user, p->rank, req, &done, NULL), table_error(&comm, p->rank), "test"))
        goto out;
    if (done) {
        called(c, AVGPIPE_STATE_ERROR, "", "test: a receive nobody sends finished");
        goto out;
    }
    if (p->rank == 0 && p->inject) {
        avgpipe_result res;
        emu_inject(cudaErrorInvalidResourceHandle);
        res = comm.wait(comm.user, p->rank, req, 20, NULL);
        after(c, "wait (a CUDA error)");
        snprintf(p->err, sizeof p->err, "%s", table_error(&comm, p->rank));
        if (res != AVGPIPE_BACKEND_ERROR) called(c, res == AVGPIPE_OK ? AVGPIPE_STATE_ERROR : res, p->err, "wait (expected AVGPIPE_BACKEND_ERROR)");
        req = NULL; /* released by the failed wait */
        p->late = comm.irecv_on(comm.user, p->rank, 1, buf, EB, 6, NULL, NULL, &other);
        after(c, "irecv_on (after the abort)");
    } else if (p->rank == 0) {
        comm.cancel(comm.user, p->rank, req);
        after(c, "cancel (unfinished)");
        req = NULL;
        p->late = comm.irecv_on(comm.user, p->rank, 1, buf, EB, 6, NULL, NULL, &other);
        after(c, "irecv_on (after the abort)");
    }
out:
    if (made) {
        avgpipe_comm_destroy(&comm); /* rank 1: with its receive pending */
        after(c, "destroy");
    }
    c->at_end = emu_cudaGetLastError();
    c->not_ready = emu_not_ready_here();
    if (buf) emu_cudaFree(buf);
    return NULL;
}

static void pending_pair(int inject, epending *p) {
    pthread_t th[2];
    ncclUniqueId id;
    int k;
    emu_begin(2, EPOLLS);
    fill_emu_id(&id, 23u + (unsigned)inject);
    memset(p, 0, 2 * sizeof *p);
    for (k = 0; k < 2; k++) {
        p[k].rank = k, p[k].id = &id, p[k].inject = inject;
        snprintf(p[k].c.who, sizeof p[k].c.who, "rank %d", k);
        cr_assert_eq(pthread_create(&th[k], NULL, epending_rank, &p[k]), 0);
    }
    for (k = 0; k < 2; k++) pthread_join(th[k], NULL);
    for (k = 0; k < 2; k++) assert_checked(&p[k].c);
    cr_assert_eq(p[0].late, AVGPIPE_ABORTED, "rank 0's table is not aborted: %s", avgpipe_result_string(p[0].late));
    assert_threads_clean(2);
    emu_end();
}

Test(nccl_emu, cancel_and_destroy_with_pending_transfers_leave_no_error) {
    epending p[2];
    pending_pair(0, p);
}

/* A real error from the same poll is reported as before, with CUDA's text, and not left behind either. */
Test(nccl_emu, a_real_cuda_error_keeps_its_text_and_is_not_left_behind) {
    epending p[2];
    pending_pair(1, p);
    cr_assert(strstr(p[0].err, "rank 0: wait: invalid resource handle (cudaErrorInvalidResourceHandle)") != NULL, "%s", p[0].err);
}
