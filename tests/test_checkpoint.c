/* Tests of checkpoints (avgpipe_run_save / avgpipe_run_load) with the model of tests/toy_model.h:
   a run that saves, is thrown away, and is resumed from its files by a new run equals the run that never
   stopped, bit for bit (every schedule, N = 1 and 2, ELASTIC with momentum, replicas, ranks split over
   processes); a process killed in the middle of a save leaves the previous checkpoint loadable; any single
   changed byte of any file, a truncated file, a foreign file and a checkpoint of another run are refused
   with a message naming the file (or the field); and the main job resumes to cmp-identical parameters.

   Tests run with the repository root as working directory; they write under /tmp. */
#define _POSIX_C_SOURCE 200809L
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"

#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/toy_model.h"

/* ---- helpers ---------------------------------------------------------------------------------- */

static void fresh_dir(char *dir, size_t cap, const char *what) {
    char cmd[512];
    snprintf(dir, cap, "/tmp/avgpipe_ckpt_%s_%ld", what, (long)getpid());
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && mkdir -p '%s'", dir, dir);
    cr_assert_eq(system(cmd), 0, "cannot make %s", dir);
}
static void remove_dir(const char *dir) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) cr_log_info("could not remove %s", dir);
}

/* User state: the step counts of the rank's stages (what an optimizer's state stands for here). */
static int save_steps(int rank, avgpipe_buf *out, void *user) {
    int g, i;
    (void)user;
    for (g = rank % T.S; g < T.G; g += T.S)
        for (i = 0; i < T.N * (T.D ? T.D : 1); i++)
            if (avgpipe_buf_append(NULL, out, &T.nstep[i][g], sizeof T.nstep[i][g]) != AVGPIPE_OK) return 1;
    return 0;
}
static int load_steps(int rank, const void *data, size_t bytes, void *user) {
    const unsigned char *p = (const unsigned char *)data;
    int g, i;
    (void)user;
    for (g = rank % T.S; g < T.G; g += T.S)
        for (i = 0; i < T.N * (T.D ? T.D : 1); i++) {
            if (bytes < sizeof(long)) return 1;
            memcpy(&T.nstep[i][g], p, sizeof(long));
            p += sizeof(long), bytes -= sizeof(long);
        }
    return bytes != 0;
}

typedef struct shape {
    avgpipe_sched_kind kind;
    int S, N, D, elastic;
} shape;

static void describe(setup *s, const shape *c) {
    int vk = c->kind == AVGPIPE_SCHED_ZBV || c->kind == AVGPIPE_SCHED_DUALPIPEV;
    int V = c->kind == AVGPIPE_SCHED_INTERLEAVED || vk ? 2 : 1, G = c->S * V, D = c->D ? c->D : 1;
    reset_state_d(G, 4, c->N, D);
    setup_init_d(s, G, c->N, D, c->S);
    if (c->kind == AVGPIPE_SCHED_ZBH1 || c->kind == AVGPIPE_SCHED_ZBV) use_split(s, 0);
    if (c->kind == AVGPIPE_SCHED_DUALPIPEV) s->d.cb.overlap = cb_overlap;
    s->d.sched.kind = c->kind, s->d.sched.stages = c->S, s->d.sched.chunks = V, s->d.sched.micro = 4, s->d.sched.pipes = c->N;
    s->d.sched.rounds = 2, s->d.sched.continuous = 1;
    s->d.adaptive = c->kind == AVGPIPE_SCHED_ADVANCE;
    s->d.window = 1;
    s->d.averaging.alpha = c->N > 1 ? 0.3f : AVGPIPE_ZERO;
    if (c->elastic) s->d.averaging.mode = AVGPIPE_EA_ELASTIC, s->d.averaging.momentum = 0.5f;
    s->d.deterministic = 1;
    s->d.cb.save_state = save_steps, s->d.cb.load_state = load_steps;
}

static avgpipe_run *create(avgpipe_context *ctx, const setup *s) {
    avgpipe_run *run = NULL;
    avgpipe_result res = avgpipe_run_create(ctx, &s->d, &run);
    int g;
    cr_assert_eq(res, AVGPIPE_OK, "avgpipe_run_create: %s", avgpipe_last_error(ctx));
    for (g = 0; g < T.G; g++) T.nslots[g] = avgpipe_run_slots(run, g);
    return run;
}
static void iterate(avgpipe_context *ctx, avgpipe_run *run, int n) {
    int i, g;
    for (i = 0; i < n; i++) {
        avgpipe_result res = avgpipe_run_iteration(run, NULL);
        for (g = 0; g < T.G; g++) cr_assert(!T.err[g][0], "stage %d callback: %s", g, T.err[g]);
        cr_assert_eq(res, AVGPIPE_OK, "iteration: %s", avgpipe_last_error(ctx));
        for (g = 0; g < T.G; g++) T.nslots[g] = avgpipe_run_slots(run, g);
    }
}

/* What a run has learnt: every model and every group's reference. */
typedef struct learnt {
    float w[MAXN][MAXG][PMAX], z[MAXD][MAXG][PMAX];
    long nstep[MAXN][MAXG];
} learnt;
static void take(avgpipe_run *run, learnt *l) {
    int d, g;
    memset(l, 0, sizeof *l);
    memcpy(l->w, T.w, sizeof l->w);
    memcpy(l->nstep, T.nstep, sizeof l->nstep);
    for (d = 0; d < (T.D ? T.D : 1); d++)
        for (g = 0; g < T.G; g++) memcpy(l->z[d][g], avgpipe_run_replica_reference(run, d, g, NULL), (size_t)pcount(g) * sizeof(float));
}
static void same(const learnt *a, const learnt *b, const char *what) {
    int i, d, g;
    for (i = 0; i < T.N * (T.D ? T.D : 1); i++)
        for (g = 0; g < T.G; g++) {
            cr_assert(!memcmp(a->w[i][g], b->w[i][g], (size_t)pcount(g) * sizeof(float)), "%s: model %d, stage %d differs", what, i, g);
            cr_assert_eq(a->nstep[i][g], b->nstep[i][g], "%s: the user state (steps of model %d, stage %d) differs", what, i, g);
        }
    for (d = 0; d < (T.D ? T.D : 1); d++)
        for (g = 0; g < T.G; g++)
            cr_assert(!memcmp(a->z[d][g], b->z[d][g], (size_t)pcount(g) * sizeof(float)), "%s: reference of group %d, stage %d differs", what, d, g);
}

/* ---- resume = uninterrupted ------------------------------------------------------------------- */

TestSuite(checkpoint, .timeout = 120);

/* 4 iterations straight, against 2 + save + (a new run) load + 2: bitwise the same models, references
   and user state; and a load then a second save and load in the same directory keeps working. */
static void resume(const shape *c, const char *name) {
    static learnt straight, resumed;
    avgpipe_context ctx;
    avgpipe_run *run;
    setup s;
    char dir[256];
    int k;
    avgpipe_context_init(&ctx, NULL);
    fresh_dir(dir, sizeof dir, "resume");
    describe(&s, c);
    run = create(&ctx, &s);
    iterate(&ctx, run, 4);
    take(run, &straight);
    avgpipe_run_destroy(run);

    describe(&s, c);
    run = create(&ctx, &s);
    iterate(&ctx, run, 2);
    cr_assert_eq(avgpipe_run_save(run, dir), AVGPIPE_OK, "%s: save: %s", name, avgpipe_last_error(&ctx));
    avgpipe_run_destroy(run);

    describe(&s, c); /* a new "process": everything from the initial values again */
    run = create(&ctx, &s);
    cr_assert_eq(avgpipe_run_load(run, dir), AVGPIPE_OK, "%s: load: %s", name, avgpipe_last_error(&ctx));
    cr_assert_eq(avgpipe_run_iterations(run), 2);
    for (k = 0; k < T.G; k++) T.nslots[k] = avgpipe_run_slots(run, k); /* the loaded K may plan other slots */
    iterate(&ctx, run, 1);
    cr_assert_eq(avgpipe_run_save(run, dir), AVGPIPE_OK, "%s: second save: %s", name, avgpipe_last_error(&ctx));
    iterate(&ctx, run, 1);
    take(run, &resumed);
    avgpipe_run_destroy(run);
    same(&straight, &resumed, name);
    { /* the second save replaced the first: its files are gone, the manifest names iteration 3 */
        char path[512];
        struct stat st;
        snprintf(path, sizeof path, "%s/rank-0-iter-2.ckpt", dir);
        cr_assert(stat(path, &st) != 0, "%s: the previous checkpoint's file %s is still there", name, path);
        snprintf(path, sizeof path, "%s/rank-0-iter-3.ckpt", dir);
        cr_assert(stat(path, &st) == 0, "%s: no %s", name, path);
    }
    remove_dir(dir);
}

Test(checkpoint, resume_afab_n1) { shape c = {AVGPIPE_SCHED_AFAB, 3, 1, 1, 0}; resume(&c, "afab N=1"); }
Test(checkpoint, resume_1f1b_n2) { shape c = {AVGPIPE_SCHED_1F1B, 3, 2, 1, 0}; resume(&c, "1f1b N=2"); }
Test(checkpoint, resume_advance_adaptive_n2) { shape c = {AVGPIPE_SCHED_ADVANCE, 3, 2, 1, 0}; resume(&c, "advance (adaptive) N=2"); }
Test(checkpoint, resume_interleaved_n2) { shape c = {AVGPIPE_SCHED_INTERLEAVED, 2, 2, 1, 0}; resume(&c, "interleaved N=2"); }
Test(checkpoint, resume_zbh1_n1) { shape c = {AVGPIPE_SCHED_ZBH1, 3, 1, 1, 0}; resume(&c, "zbh1 N=1"); }
/* V placement: rank r's two stages r and 2S-1-r are its records 0 and 1 */
Test(checkpoint, resume_zbv_n2) { shape c = {AVGPIPE_SCHED_ZBV, 3, 2, 1, 0}; resume(&c, "zbv N=2"); }
Test(checkpoint, resume_dualpipev_n2) { shape c = {AVGPIPE_SCHED_DUALPIPEV, 2, 2, 1, 0}; resume(&c, "dualpipev N=2"); }
Test(checkpoint, resume_elastic_momentum) { shape c = {AVGPIPE_SCHED_1F1B, 2, 2, 1, 1}; resume(&c, "elastic with momentum"); }
Test(checkpoint, resume_replicas) { shape c = {AVGPIPE_SCHED_1F1B, 2, 2, 2, 0}; resume(&c, "2 replica groups"); }

/* Ranks split over processes (threads sharing a comm backend): each process saves its ranks' files,
   every process writes the manifest; the resumed split run equals the uninterrupted threaded run. */
typedef struct proc {
    avgpipe_run_desc d;
    int rank, phase;
    const char *dir;
    avgpipe_result res;
    char msg[AVGPIPE_ERROR_MAX];
} proc;
static void *proc_main(void *arg) {
    proc *p = (proc *)arg;
    avgpipe_context ctx;
    avgpipe_run *run = NULL;
    int i;
    avgpipe_context_init(&ctx, NULL);
    p->res = avgpipe_run_create(&ctx, &p->d, &run);
    if (!p->res && p->phase == 1) p->res = avgpipe_run_load(run, p->dir);
    for (i = 0; i < 2 && !p->res; i++) p->res = avgpipe_run_iteration(run, NULL);
    if (!p->res && p->phase == 0) p->res = avgpipe_run_save(run, p->dir);
    if (p->res) snprintf(p->msg, sizeof p->msg, "%s", avgpipe_last_error(&ctx));
    avgpipe_run_destroy(run);
    return NULL;
}
Test(checkpoint, resume_with_ranks_in_processes) {
    static learnt straight, resumed;
    shape c = {AVGPIPE_SCHED_1F1B, 3, 2, 1, 0};
    avgpipe_context ctx;
    avgpipe_run *run;
    avgpipe_comm comm;
    pthread_t th[3];
    proc p[3];
    setup s;
    char dir[256];
    int phase, k, nslots[MAXG];
    avgpipe_context_init(&ctx, NULL);
    fresh_dir(dir, sizeof dir, "procs");
    describe(&s, &c);
    run = create(&ctx, &s);
    iterate(&ctx, run, 4);
    take(run, &straight);
    avgpipe_run_destroy(run);
    memcpy(nslots, T.nslots, sizeof nslots);
    for (phase = 0; phase < 2; phase++) {
        describe(&s, &c);
        memcpy(T.nslots, nslots, sizeof nslots);
        cr_assert_eq(avgpipe_comm_local_create(NULL, 3, &comm), AVGPIPE_OK);
        for (k = 0; k < 3; k++) {
            memset(&p[k], 0, sizeof p[k]);
            p[k].d = s.d, p[k].rank = k, p[k].phase = phase, p[k].dir = dir;
            p[k].d.local_ranks = &p[k].rank, p[k].d.local_count = 1, p[k].d.comm = &comm;
            cr_assert_eq(pthread_create(&th[k], NULL, proc_main, &p[k]), 0);
        }
        for (k = 0; k < 3; k++) pthread_join(th[k], NULL);
        avgpipe_comm_destroy(&comm);
        for (k = 0; k < 3; k++) cr_assert_eq(p[k].res, AVGPIPE_OK, "phase %d, process of rank %d: %s", phase, k, p[k].msg);
    }
    memcpy(resumed.w, T.w, sizeof resumed.w);
    memcpy(resumed.nstep, T.nstep, sizeof resumed.nstep);
    memcpy(resumed.z, straight.z, sizeof resumed.z); /* the references stayed in the processes: the models say it all */
    same(&straight, &resumed, "ranks in 3 processes");
    remove_dir(dir);
}

/* ---- crashes, corruption, mismatches ----------------------------------------------------------- */

static int die_in_save(int rank, avgpipe_buf *out, void *user) {
    if (rank == 2) raise(SIGKILL); /* ranks 0 and 1 have written their new files, the manifest is not there yet */
    return save_steps(rank, out, user);
}

/* A process killed in the middle of a save: the previous checkpoint stays loadable and whole. */
Test(checkpoint, kill_during_save_leaves_the_previous_checkpoint) {
    static learnt two;
    shape c = {AVGPIPE_SCHED_1F1B, 3, 2, 1, 0};
    avgpipe_context ctx;
    avgpipe_run *run;
    setup s;
    char dir[256], path[512];
    struct stat st;
    pid_t pid;
    int status = 0;
    avgpipe_context_init(&ctx, NULL);
    fresh_dir(dir, sizeof dir, "kill");
    fflush(NULL);
    pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) { /* the training process: a checkpoint at 2 iterations, then dies saving the one at 4 */
        int g;
        describe(&s, &c);
        if (avgpipe_run_create(&ctx, &s.d, &run)) _exit(10);
        for (g = 0; g < T.G; g++) T.nslots[g] = avgpipe_run_slots(run, g);
        if (avgpipe_run_iteration(run, NULL) || avgpipe_run_iteration(run, NULL) || avgpipe_run_save(run, dir)) _exit(11);
        if (avgpipe_run_iteration(run, NULL) || avgpipe_run_iteration(run, NULL)) _exit(12);
        s.d.cb.save_state = die_in_save;
        avgpipe_run_destroy(run);
        describe(&s, &c);
        s.d.cb.save_state = die_in_save;
        if (avgpipe_run_create(&ctx, &s.d, &run) || avgpipe_run_load(run, dir)) _exit(13);
        for (g = 0; g < T.G; g++) T.nslots[g] = avgpipe_run_slots(run, g);
        if (avgpipe_run_iteration(run, NULL) || avgpipe_run_iteration(run, NULL)) _exit(14);
        avgpipe_run_save(run, dir);
        _exit(15);
    }
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL, "the child did not die in its save (status %d)", status);
    snprintf(path, sizeof path, "%s/rank-0-iter-4.ckpt", dir);
    cr_assert(stat(path, &st) == 0, "the new save had not started: no %s", path);
    /* what 2 iterations give, computed here */
    describe(&s, &c);
    run = create(&ctx, &s);
    iterate(&ctx, run, 2);
    take(run, &two);
    avgpipe_run_destroy(run);
    describe(&s, &c);
    run = create(&ctx, &s);
    cr_assert_eq(avgpipe_run_load(run, dir), AVGPIPE_OK, "the previous checkpoint does not load: %s", avgpipe_last_error(&ctx));
    cr_assert_eq(avgpipe_run_iterations(run), 2);
    {
        static learnt loaded;
        take(run, &loaded);
        same(&two, &loaded, "the checkpoint at iteration 2, after a crash while saving the next");
    }
    avgpipe_run_destroy(run);
    remove_dir(dir);
}

static long file_size(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 ? (long)st.st_size : -1;
}
static void poke(const char *path, long at, unsigned char x) {
    FILE *f = fopen(path, "r+b");
    int c;
    cr_assert(f != NULL);
    fseek(f, at, SEEK_SET);
    c = fgetc(f);
    fseek(f, at, SEEK_SET);
    fputc(c ^ x, f);
    fclose(f);
}

/* Every single byte of the manifest and of a rank file, flipped: the load is refused, naming the
   file; flipped back, the checkpoint loads again. */
Test(checkpoint, any_corrupted_byte_is_detected, .timeout = 300) {
    shape c = {AVGPIPE_SCHED_1F1B, 2, 1, 1, 0};
    avgpipe_context ctx;
    avgpipe_run *run;
    setup s;
    char dir[256], files[2][512];
    int f;
    long i, n, refused = 0;
    avgpipe_context_init(&ctx, NULL);
    fresh_dir(dir, sizeof dir, "corrupt");
    describe(&s, &c);
    run = create(&ctx, &s);
    iterate(&ctx, run, 1);
    cr_assert_eq(avgpipe_run_save(run, dir), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    snprintf(files[0], sizeof files[0], "%s/manifest", dir);
    snprintf(files[1], sizeof files[1], "%s/rank-1-iter-1.ckpt", dir);
    for (f = 0; f < 2; f++) {
        const char *name = strrchr(files[f], '/') + 1;
        n = file_size(files[f]);
        cr_assert(n > 64, "%s: %ld bytes", files[f], n);
        for (i = 0; i < n; i++) {
            avgpipe_result res;
            poke(files[f], i, (unsigned char)(1u << (i % 8)));
            res = avgpipe_run_load(run, dir);
            cr_assert_neq(res, AVGPIPE_OK, "%s: byte %ld changed, the load succeeded", files[f], i);
            cr_assert(strstr(avgpipe_last_error(&ctx), f ? name : "manifest") != NULL, "%s, byte %ld: the message does not name the file: %s",
                      files[f], i, avgpipe_last_error(&ctx));
            poke(files[f], i, (unsigned char)(1u << (i % 8)));
            refused++;
        }
    }
    cr_assert_eq(avgpipe_run_load(run, dir), AVGPIPE_OK, "the restored files do not load: %s", avgpipe_last_error(&ctx));
    cr_log_info("%ld corrupted files refused", refused);
    avgpipe_run_destroy(run);
    remove_dir(dir);
}

static void expect_refused(avgpipe_run *run, avgpipe_context *ctx, const char *dir, avgpipe_result want, const char *word) {
    avgpipe_result res = avgpipe_run_load(run, dir);
    cr_assert_eq(res, want, "%s: got %s: %s", word, avgpipe_result_string(res), avgpipe_last_error(ctx));
    cr_assert(strstr(avgpipe_last_error(ctx), word) != NULL, "the message does not say '%s': %s", word, avgpipe_last_error(ctx));
}

Test(checkpoint, truncated_foreign_missing_and_mismatched_are_refused) {
    shape c = {AVGPIPE_SCHED_1F1B, 2, 1, 1, 0};
    avgpipe_context ctx;
    avgpipe_run *run, *other;
    setup s;
    char dir[256], path[512], cmd[1600];
    FILE *f;
    avgpipe_context_init(&ctx, NULL);
    fresh_dir(dir, sizeof dir, "refused");
    describe(&s, &c);
    run = create(&ctx, &s);
    iterate(&ctx, run, 1);
    cr_assert_eq(avgpipe_run_save(run, dir), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    /* another run (micro = 8): refused, naming the field */
    s.d.sched.micro = 8;
    other = create(&ctx, &s);
    expect_refused(other, &ctx, dir, AVGPIPE_MISMATCH, "sched.micro");
    avgpipe_run_destroy(other);
    /* truncated rank file */
    snprintf(path, sizeof path, "%s/rank-0-iter-1.ckpt", dir);
    snprintf(cmd, sizeof cmd, "cp '%s' '%s.keep' && truncate -s 100 '%s'", path, path, path);
    cr_assert_eq(system(cmd), 0);
    expect_refused(run, &ctx, dir, AVGPIPE_PARSE_ERROR, "rank-0-iter-1.ckpt");
    snprintf(cmd, sizeof cmd, "mv '%s.keep' '%s'", path, path);
    cr_assert_eq(system(cmd), 0);
    /* a foreign manifest */
    snprintf(path, sizeof path, "%s/manifest", dir);
    snprintf(cmd, sizeof cmd, "cp '%s' '%s.keep'", path, path);
    cr_assert_eq(system(cmd), 0);
    f = fopen(path, "wb");
    cr_assert(f != NULL);
    fputs("hello, this is not a checkpoint\n", f);
    fclose(f);
    expect_refused(run, &ctx, dir, AVGPIPE_PARSE_ERROR, "manifest");
    snprintf(cmd, sizeof cmd, "mv '%s.keep' '%s'", path, path);
    cr_assert_eq(system(cmd), 0);
    /* a missing rank file, a missing directory */
    snprintf(path, sizeof path, "%s/rank-1-iter-1.ckpt", dir);
    snprintf(cmd, sizeof cmd, "mv '%s' '%s.keep'", path, path);
    cr_assert_eq(system(cmd), 0);
    expect_refused(run, &ctx, dir, AVGPIPE_IO_ERROR, "rank-1-iter-1.ckpt");
    snprintf(cmd, sizeof cmd, "mv '%s.keep' '%s'", path, path);
    cr_assert_eq(system(cmd), 0);
    expect_refused(run, &ctx, "/nonexistent/avgpipe", AVGPIPE_IO_ERROR, "/nonexistent/avgpipe/manifest");
    /* and the intact checkpoint still loads */
    cr_assert_eq(avgpipe_run_load(run, dir), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    avgpipe_run_destroy(run);
    remove_dir(dir);
}

/* ---- the main job ----------------------------------------------------------------------------- */

static const char *env(const char *name) {
    const char *v = getenv(name);
    return v ? v : "";
}

/* fashion_mnist 2 epochs in one go, and 1 epoch + checkpoint + a new process that resumes for the
   second: cmp-identical saved parameters (deterministic mode; a subset of the training set). */
static void main_job_resume(const char *schedule, int pipes) {
    char dir[256], a[300], b[300], cmd[2048];
    const char *fm = env("AVGPIPE_FMNIST");
    struct stat st;
    char data[1024];
    snprintf(data, sizeof data, "%s/train-images-idx3-ubyte.gz", env("AVGPIPE_FMNIST_DATA"));
    if (!fm[0] || stat(data, &st) != 0) cr_skip_test("no Fashion-MNIST build or data");
    fresh_dir(dir, sizeof dir, schedule);
    snprintf(a, sizeof a, "%s/straight.bin", dir);
    snprintf(b, sizeof b, "%s/resumed.bin", dir);
#define FLAGS "--epochs 2 --micro 4 --pipes %d --schedule %s --deterministic --limit-train 8192 --rounds 2 >/dev/null 2>&1"
    snprintf(cmd, sizeof cmd, "timeout 120 %s " FLAGS " --save %s", fm, pipes, schedule, a);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    snprintf(cmd, sizeof cmd, "timeout 120 %s " FLAGS " --stop-after 1 --checkpoint %s/ck", fm, pipes, schedule, dir);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    snprintf(cmd, sizeof cmd, "timeout 120 %s " FLAGS " --resume %s/ck --save %s", fm, pipes, schedule, dir, b);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
#undef FLAGS
    snprintf(cmd, sizeof cmd, "cmp %s %s", a, b);
    cr_assert_eq(system(cmd), 0, "%s, N = %d: the resumed run's parameters differ from the uninterrupted run's", schedule, pipes);
    remove_dir(dir);
}
Test(checkpoint, main_job_resume_afab_n1, .timeout = 300) { main_job_resume("afab", 1); }
Test(checkpoint, main_job_resume_afab_n2, .timeout = 300) { main_job_resume("afab", 2); }
Test(checkpoint, main_job_resume_1f1b_n1, .timeout = 300) { main_job_resume("1f1b", 1); }
Test(checkpoint, main_job_resume_1f1b_n2, .timeout = 300) { main_job_resume("1f1b", 2); }
Test(checkpoint, main_job_resume_advance_n1, .timeout = 300) { main_job_resume("advance", 1); }
Test(checkpoint, main_job_resume_advance_n2, .timeout = 300) { main_job_resume("advance", 2); }
Test(checkpoint, main_job_resume_interleaved_n1, .timeout = 300) { main_job_resume("interleaved", 1); }
Test(checkpoint, main_job_resume_interleaved_n2, .timeout = 300) { main_job_resume("interleaved", 2); }
Test(checkpoint, main_job_resume_zbh1_n1, .timeout = 300) { main_job_resume("zbh1", 1); }
Test(checkpoint, main_job_resume_zbh1_n2, .timeout = 300) { main_job_resume("zbh1", 2); }
