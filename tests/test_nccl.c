/* Tests of avgpipe_nccl.h that need no GPU: argument checking, the id file protocol (threads and
   processes exchanging a 128-byte id through it, its atomic write, damaged, stale and foreign files,
   failure records, timeouts), and creation failing cleanly, with CUDA's text and nothing left allocated,
   on a machine without a GPU. Real CUDA and NCCL are linked; nothing is mocked. What needs a GPU
   (transfers, groups, collectives, split, abort) is tests/gpu/nccl_check.c, run by bench/gpu/run.sh.

   Criterion forks per test, so CUDA is first touched inside a test, never before the fork. */
#define _POSIX_C_SOURCE 200809L
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"
#include "avgpipe_nccl.h"

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
