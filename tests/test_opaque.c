/* Tests of the runtime on a device whose memory the host cannot touch (tests/opaque_device.h), as a
   GPU's memory is to an x86 host: every buffer the runtime allocates and every stage partition the
   trainer hands it are PROT_NONE pages, so any host read or write of them (a memcpy in the comm
   backend, a host-side sum, a check) faults, and the fault names the address, the allocation and the
   stack. The stage callbacks enqueue the toy model's computation (tests/toy_model.h) on op->stream,
   where a task sees the bytes through the device's mirror, as a kernel would.

   Checked, each bit for bit against the same run on the CPU device with the toy's synchronous
   callbacks: N = 2 elastic averaging (deterministic) over the in-process comm (the runtime makes the
   device-aware one: avgpipe_comm_local_create_on); V placement (ZB-V with split backward); replica
   groups (the reference allreduce through the device's copies); checkpoints saved and loaded, the
   gathered reference and parameters; a profile. And the device-aware in-process comm on its own:
   device-ordered transfers with events, a mismatch between a device and a host message, the allreduce
   of device memory. That the memory really is opaque is checked too (a host read dies of SIGSEGV).
   Ties and step agreement on this device are tests/test_tie_run.c's (their model lives there).

   Build and run from the repository root (meson: test_opaque):
     gcc -std=c11 -O2 -Wall -Wextra -Werror -I. tests/test_opaque.c -o /tmp/test_opaque -lcriterion -lm -pthread */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS (tests/opaque_device.h) */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"

#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tests/toy_model.h"
#include "tests/opaque_device.h"

#define ITERS 3
#define DELAY_US 20 /* every task sleeps this long first: a missing order shows */

/* ---- callbacks that enqueue the toy model's work, on the bytes behind the device addresses ------- */

static int async_failed; /* the first nonzero return of a task (read after the run) */

static void failed(int rc) {
    if (rc) __atomic_compare_exchange_n(&async_failed, &(int){0}, rc, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

/* What a kernel sees: the op's buffers through the device's mirror. */
static void to_mirror(avgpipe_op_ctx *op) {
    op->params = (float *)odev_mirror(op->params);
    op->input = odev_mirror(op->input);
    op->output = odev_mirror(op->output);
    op->grad_output = odev_mirror(op->grad_output);
    op->grad_input = odev_mirror(op->grad_input);
}

typedef struct cb_task {
    int (*fn)(avgpipe_op_ctx *);
    avgpipe_op_ctx a;
} cb_task;
static void cb_task_run(void *p) {
    cb_task *t = (cb_task *)p;
    to_mirror(&t->a);
    failed(t->fn(&t->a));
}
/* The runtime's slot buffers start at multiples of 256 bytes (the device's pages are aligned): a kernel
   may use vector loads on them. (Address arithmetic only: nothing is read.) */
static int misaligned(const void *p) { return p && (uintptr_t)p % 256 != 0; }

static int enqueue_cb(int (*fn)(avgpipe_op_ctx *), avgpipe_op_ctx *op) {
    cb_task t;
    if (misaligned(op->input) || misaligned(op->output) || misaligned(op->grad_output) || misaligned(op->grad_input)) failed(256);
    memset(&t, 0, sizeof t);
    t.fn = fn;
    t.a = *op;
    return adev_enqueue(op->stream, cb_task_run, &t, sizeof t) ? 1 : 0;
}
static int dev_forward(avgpipe_op_ctx *op) { return enqueue_cb(cb_forward, op); }
static int dev_backward(avgpipe_op_ctx *op) { return enqueue_cb(cb_backward, op); }
static int dev_backward_input(avgpipe_op_ctx *op) { return enqueue_cb(cb_backward_input, op); }
static int dev_backward_weight(avgpipe_op_ctx *op) { return enqueue_cb(cb_backward_weight, op); }

typedef struct step_task {
    int rank, pipe, stage, round;
    float *params;
} step_task;
static void step_task_run(void *p) {
    step_task *t = (step_task *)p;
    failed(cb_step(t->rank, t->pipe, t->stage, t->round, (float *)odev_mirror(t->params), NULL));
}
static int dev_step(int rank, int pipe, int stage, int round, float *params, avgpipe_device_stream stream, void *user) {
    step_task t = {rank, pipe, stage, round, params};
    (void)user;
    return adev_enqueue(stream, step_task_run, &t, sizeof t) ? 1 : 0;
}

/* ---- one configuration, on the CPU device and on the opaque device ------------------------------ */

typedef struct cfg {
    avgpipe_sched_kind kind;
    int S, V, M, D, split;
} cfg;

typedef struct outcome {
    float w[MAXN][MAXG][PMAX];
    float z[MAXD][MAXG][PMAX];
    float zg[MAXG][PMAX]; /* avgpipe_run_gather_reference's copy */
    float wg[MAXG][PMAX]; /* avgpipe_run_gather_params of model (0, 1) */
    avgpipe_result res;
    char msg[AVGPIPE_ERROR_MAX];
    int task_error;
    size_t events;
} outcome;

static int cfg_stages(const cfg *c) { return c->S * (c->V > 0 ? c->V : 1); }
static int cfg_groups(const cfg *c) { return c->D > 0 ? c->D : 1; }

/* N = 2, alpha 0.3, MEAN, deterministic, `iters` iterations. On `dev` (NULL: the CPU device with the
   toy's synchronous callbacks), the stage partitions given as device memory over T's arrays. load_dir:
   resume from that checkpoint first; save_dir: save at the end and gather; profile: record events. */
static void train_ex(const cfg *c, avgpipe_device *dev, outcome *out, int iters, const char *load_dir, const char *save_dir, int profile) {
    const int N = 2, G = cfg_stages(c), D = cfg_groups(c);
    avgpipe_context ctx;
    avgpipe_run *run = NULL;
    avgpipe_run_stats st;
    setup s;
    int it, g, i, d;
    memset(out, 0, sizeof *out);
    async_failed = 0;
    avgpipe_context_init(&ctx, NULL);
    reset_state_d(G, c->M, N, D);
    setup_init_d(&s, G, N, D, c->S);
    s.d.sched.kind = c->kind;
    s.d.sched.stages = c->S;
    s.d.sched.chunks = c->V;
    s.d.sched.micro = c->M;
    s.d.sched.pipes = N;
    s.d.deterministic = 1;
    s.d.averaging.alpha = 0.3f;
    s.d.averaging.mode = AVGPIPE_EA_MEAN;
    s.d.timeout_s = 20;
    s.d.profile = profile;
    if (c->split) use_split(&s, 0);
    if (dev) {
        s.d.device = dev;
        s.d.cb.forward = dev_forward;
        s.d.cb.backward = c->split ? NULL : dev_backward;
        if (c->split) s.d.cb.backward_input = dev_backward_input, s.d.cb.backward_weight = dev_backward_weight;
        s.d.cb.step = NULL, s.d.cb.step_async = dev_step;
        for (i = 0; i < N * D; i++)
            for (g = 0; g < G; g++) {
                s.params[i * G + g] = (float *)odev_alloc_over(T.w[i][g], (size_t)pcount(g) * sizeof(float));
                cr_assert(s.params[i * G + g] != NULL, "device memory for model %d, stage %d", i, g);
            }
    }
    out->res = avgpipe_run_create(&ctx, &s.d, &run);
    if (out->res == AVGPIPE_OK) {
        for (g = 0; g < G; g++) T.nslots[g] = avgpipe_run_slots(run, g);
        if (load_dir) out->res = avgpipe_run_load(run, load_dir);
        for (it = 0; it < iters && out->res == AVGPIPE_OK; it++) out->res = avgpipe_run_iteration(run, &st);
        if (save_dir && out->res == AVGPIPE_OK) out->res = avgpipe_run_save(run, save_dir);
        if (save_dir && out->res == AVGPIPE_OK) {
            float *dst[MAXG] = {0};
            for (g = 0; g < G; g++) dst[g] = out->zg[g];
            out->res = avgpipe_run_gather_reference(run, dst);
            for (g = 0; g < G; g++) dst[g] = out->wg[g];
            if (out->res == AVGPIPE_OK) out->res = avgpipe_run_gather_params(run, 0, 1, dst);
        }
        if (profile && out->res == AVGPIPE_OK) avgpipe_run_events(run, &out->events);
        /* the iteration returned: its work has finished on the device, and T's arrays are the mirrors */
        for (i = 0; i < N * D; i++)
            for (g = 0; g < G; g++) memcpy(out->w[i][g], T.w[i][g], sizeof out->w[i][g]);
        for (d = 0; d < D && out->res == AVGPIPE_OK; d++)
            for (g = 0; g < G; g++) {
                size_t count = 0;
                const float *z = avgpipe_run_replica_reference(run, d, g, &count);
                if (z) memcpy(out->z[d][g], dev ? odev_mirror(z) : z, count * sizeof(float));
            }
    }
    if (out->res) snprintf(out->msg, sizeof out->msg, "%s", avgpipe_last_error(&ctx));
    avgpipe_run_destroy(run);
    if (dev)
        for (i = 0; i < N * D; i++)
            for (g = 0; g < G; g++) odev_free_over(s.params[i * G + g]);
    out->task_error = async_failed;
    for (g = 0; g < G && !out->task_error; g++)
        if (T.err[g][0]) out->task_error = -1;
}

static long differences(const cfg *c, const outcome *ref, const outcome *got) {
    long n = 0;
    int i, g, j, d, G = cfg_stages(c), D = cfg_groups(c);
    for (i = 0; i < 2 * D; i++)
        for (g = 0; g < G; g++)
            for (j = 0; j < pcount(g); j++) n += memcmp(&ref->w[i][g][j], &got->w[i][g][j], sizeof(float)) != 0;
    for (d = 0; d < D; d++)
        for (g = 0; g < G; g++)
            for (j = 0; j < pcount(g); j++) n += memcmp(&ref->z[d][g][j], &got->z[d][g][j], sizeof(float)) != 0;
    return n;
}

static avgpipe_device open_device(void) {
    avgpipe_device d = odev_open(DELAY_US);
    ADEV.allocs = ADEV.frees = 0;
    ADEV.pass_delay_us = 500;
    odev_guard();
    return d;
}

static void close_device(const char *name) {
    cr_assert_eq(ODEV.bad_kinds, 0, "%s: %ld copies of the wrong kind (%s)", name, ODEV.bad_kinds, ODEV.error);
    cr_assert(ADEV.allocs > 0 && ADEV.allocs == ADEV.frees, "%s: %ld device allocations, %ld frees", name, ADEV.allocs, ADEV.frees);
    cr_assert_eq(ODEV.live, 0, "%s: %ld device allocations still live", name, ODEV.live);
    cr_assert(ADEV.nstreams == 1, "%s: %d streams left (the default one only expected)", name, ADEV.nstreams);
    odev_close();
}

static outcome ref_out, dev_out, first_out;

static void check_same(const cfg *c, const char *name) {
    avgpipe_device dev;
    int g;
    train_ex(c, NULL, &ref_out, ITERS, NULL, NULL, 0);
    cr_assert_eq(ref_out.res, AVGPIPE_OK, "%s, CPU device: %s: %s", name, avgpipe_result_string(ref_out.res), ref_out.msg);
    for (g = 0; g < cfg_stages(c); g++) cr_assert(!T.err[g][0], "%s, CPU device, stage %d: %s", name, g, T.err[g]);
    cr_assert(memcmp(ref_out.w[0][0], ref_out.w[1][0], sizeof ref_out.w[0][0]) != 0, "%s: the two models are identical", name);
    dev = open_device();
    train_ex(c, &dev, &dev_out, ITERS, NULL, NULL, 0);
    cr_assert_eq(dev_out.res, AVGPIPE_OK, "%s, opaque device: %s: %s", name, avgpipe_result_string(dev_out.res), dev_out.msg);
    for (g = 0; g < cfg_stages(c); g++) cr_assert(!T.err[g][0], "%s, opaque device, stage %d: %s", name, g, T.err[g]);
    cr_assert_eq(dev_out.task_error, 0, "%s: a task failed (%d; 256: a slot buffer not 256-byte aligned)", name, dev_out.task_error);
    cr_assert_eq(differences(c, &ref_out, &dev_out), 0, "%s: %ld parameters differ from the CPU device's run", name,
                 differences(c, &ref_out, &dev_out));
    close_device(name);
}

TestSuite(opaque, .timeout = 120);

#ifndef AVGPIPE_TSAN_CRITERION_H /* Criterion's own runner (a process per test): not the TSan stand-in, which has one process */
Test(opaque, host_read_of_device_memory_faults, .signal = SIGSEGV) {
    avgpipe_device dev = open_device();
    void *p = NULL;
    volatile float x;
    cr_assert_eq(dev.alloc(dev.user, 64, &p), AVGPIPE_OK);
    x = *(volatile float *)p; /* the host touches device memory: the guard names it, then the fault ends the test */
    (void)x;
}
#endif

Test(opaque, averaging_n2_1f1b) {
    cfg c = {AVGPIPE_SCHED_1F1B, 4, 0, 8, 1, 0};
    check_same(&c, "1f1b N=2");
}
Test(opaque, v_placement_zbv_split) {
    cfg c = {AVGPIPE_SCHED_ZBV, 2, 2, 4, 1, 1};
    check_same(&c, "zbv I/W");
}
Test(opaque, interleaved) {
    cfg c = {AVGPIPE_SCHED_INTERLEAVED, 2, 2, 4, 1, 0};
    check_same(&c, "interleaved V=2");
}
Test(opaque, replica_groups) {
    cfg c = {AVGPIPE_SCHED_1F1B, 2, 0, 4, 2, 0};
    check_same(&c, "1f1b D=2");
}

/* Two iterations saved, a new run loads them and runs the third: the CPU device's three, to the bit;
   the gathered reference and parameters are the run's. */
Test(opaque, checkpoint_and_gather) {
    cfg c = {AVGPIPE_SCHED_1F1B, 3, 0, 4, 1, 0};
    char dir[] = "/tmp/avgpipe-opaque-XXXXXX", cmd[128];
    avgpipe_device dev;
    int g;
    cr_assert(mkdtemp(dir) != NULL);
    train_ex(&c, NULL, &ref_out, ITERS, NULL, NULL, 0);
    cr_assert_eq(ref_out.res, AVGPIPE_OK, "CPU device: %s", ref_out.msg);
    dev = open_device();
    train_ex(&c, &dev, &first_out, ITERS - 1, NULL, dir, 0);
    cr_assert_eq(first_out.res, AVGPIPE_OK, "opaque device, saving: %s: %s", avgpipe_result_string(first_out.res), first_out.msg);
    for (g = 0; g < cfg_stages(&c); g++) {
        cr_assert(memcmp(first_out.zg[g], first_out.z[0][g], (size_t)pcount(g) * sizeof(float)) == 0, "stage %d: the gathered reference differs",
                  g);
        cr_assert(memcmp(first_out.wg[g], first_out.w[1][g], (size_t)pcount(g) * sizeof(float)) == 0, "stage %d: the gathered parameters differ",
                  g);
    }
    train_ex(&c, &dev, &dev_out, 1, dir, NULL, 0);
    cr_assert_eq(dev_out.res, AVGPIPE_OK, "opaque device, resuming: %s: %s", avgpipe_result_string(dev_out.res), dev_out.msg);
    cr_assert_eq(differences(&c, &ref_out, &dev_out), 0, "resumed on the opaque device: %ld parameters differ from the CPU device's run",
                 differences(&c, &ref_out, &dev_out));
    close_device("checkpoint");
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}

Test(opaque, profile) {
    cfg c = {AVGPIPE_SCHED_1F1B, 2, 0, 4, 1, 0};
    avgpipe_device dev = open_device();
    train_ex(&c, &dev, &dev_out, 1, NULL, NULL, 1);
    cr_assert_eq(dev_out.res, AVGPIPE_OK, "%s: %s", avgpipe_result_string(dev_out.res), dev_out.msg);
    cr_assert(dev_out.events > 0, "no events recorded");
    close_device("profile");
}

/* ---- the device-aware in-process comm on its own --------------------------------------------------- */

Test(opaque, local_comm_moves_device_memory_on_the_device) {
    avgpipe_device dev = open_device();
    avgpipe_comm comm;
    avgpipe_comm_request sreq, rreq;
    avgpipe_comm_status st;
    avgpipe_device_event ready, done;
    avgpipe_device_stream s;
    float host[16], back[16], *a = NULL, *b = NULL;
    int i;
    for (i = 0; i < 16; i++) host[i] = (float)i * 0.5f - 3.0f;
    cr_assert_eq(dev.alloc(dev.user, sizeof host, (void **)&a), AVGPIPE_OK);
    cr_assert_eq(dev.alloc(dev.user, sizeof host, (void **)&b), AVGPIPE_OK);
    cr_assert_eq(dev.stream_create(dev.user, &s), AVGPIPE_OK);
    cr_assert_eq(dev.event_create(dev.user, &ready), AVGPIPE_OK);
    cr_assert_eq(dev.event_create(dev.user, &done), AVGPIPE_OK);
    cr_assert_eq(avgpipe_comm_local_create_on(NULL, 2, &dev, &comm), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
    cr_assert(comm.isend_on && comm.irecv_on, "no device-ordered transfers");
    /* the producer: a slow copy into a on stream s, then `ready`; the transfer must wait for it */
    ADEV.delay_us = 3000;
    cr_assert_eq(dev.copy(dev.user, a, host, sizeof host, AVGPIPE_DEVICE_COPY_H2D, s), AVGPIPE_OK);
    cr_assert_eq(dev.event_record(dev.user, ready, s), AVGPIPE_OK);
    cr_assert_eq(comm.irecv_on(comm.user, 1, 0, b, sizeof host, 7, NULL, done, &rreq), AVGPIPE_OK);
    cr_assert_eq(comm.isend_on(comm.user, 0, 1, a, sizeof host, 7, ready, NULL, &sreq), AVGPIPE_OK);
    cr_assert_eq(comm.wait(comm.user, 1, rreq, 10, &st), AVGPIPE_OK, "%s", comm.last_error(comm.user, 1));
    cr_assert(st.tag == 7 && st.bytes == sizeof host);
    cr_assert_eq(comm.wait(comm.user, 0, sreq, 10, NULL), AVGPIPE_OK);
    ADEV.delay_us = DELAY_US;
    cr_assert_eq(dev.stream_wait_event(dev.user, s, done), AVGPIPE_OK);
    cr_assert_eq(dev.copy(dev.user, back, b, sizeof back, AVGPIPE_DEVICE_COPY_D2H, s), AVGPIPE_OK);
    cr_assert_eq(dev.stream_synchronize(dev.user, s), AVGPIPE_OK);
    cr_assert(memcmp(back, host, sizeof host) == 0, "the message arrived wrong");
    /* a device message met by a host receive: refused, not copied */
    cr_assert_eq(comm.irecv(comm.user, 1, 0, back, sizeof back, 8, &rreq), AVGPIPE_OK);
    cr_assert_eq(comm.isend_on(comm.user, 0, 1, a, sizeof host, 8, NULL, NULL, &sreq), AVGPIPE_OK);
    cr_assert_eq(comm.wait(comm.user, 1, rreq, 10, NULL), AVGPIPE_MISMATCH);
    cr_assert(strstr(comm.last_error(comm.user, 1), "device-ordered send") != NULL, "%s", comm.last_error(comm.user, 1));
    cr_assert_eq(comm.wait(comm.user, 0, sreq, 10, NULL), AVGPIPE_MISMATCH);
    avgpipe_comm_destroy(&comm);
    dev.event_destroy(dev.user, ready);
    dev.event_destroy(dev.user, done);
    dev.stream_destroy(dev.user, s);
    dev.free(dev.user, a);
    dev.free(dev.user, b);
    close_device("local comm");
}

Test(opaque, comm_check_wants_device_entries_together) {
    avgpipe_device dev = open_device();
    avgpipe_comm comm, half;
    cr_assert_eq(avgpipe_comm_local_create_on(NULL, 2, &dev, &comm), AVGPIPE_OK);
    cr_assert_eq(avgpipe_comm_check(NULL, &comm), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
    half = comm, half.irecv_on = NULL;
    cr_assert_eq(avgpipe_comm_check(NULL, &half), AVGPIPE_INVALID_ARG);
    cr_assert(strstr(avgpipe_last_error(NULL), "isend_on and irecv_on") != NULL, "%s", avgpipe_last_error(NULL));
    half = comm, half.isend_on = NULL, half.irecv_on = NULL;
    cr_assert_eq(avgpipe_comm_check(NULL, &half), AVGPIPE_INVALID_ARG, "wait_issued without the device entries");
    avgpipe_comm_destroy(&comm);
    cr_assert_eq(avgpipe_comm_local_create_on(NULL, 2, NULL, &comm), AVGPIPE_OK);
    cr_assert(!comm.isend_on && !comm.irecv_on && !comm.wait_issued, "no device: the host backend");
    avgpipe_comm_destroy(&comm);
    odev_close();
}

typedef struct ar_arg {
    avgpipe_comm *comm;
    int rank;
    float *buf;
    avgpipe_result res;
} ar_arg;
static void *ar_main(void *p) {
    ar_arg *a = (ar_arg *)p;
    a->res = a->comm->allreduce_sum(a->comm->user, a->rank, a->buf, 5, 10);
    return NULL;
}

Test(opaque, local_comm_allreduce_of_device_memory) {
    avgpipe_device dev = open_device();
    avgpipe_comm comm;
    pthread_t th[3];
    ar_arg args[3];
    float host[3][5], want[5], got[5], *buf[3];
    int r, i;
    cr_assert_eq(avgpipe_comm_local_create_on(NULL, 3, &dev, &comm), AVGPIPE_OK);
    for (r = 0; r < 3; r++) {
        for (i = 0; i < 5; i++) host[r][i] = 0.1f * (float)(r + 1) + (float)i / 3.0f;
        cr_assert_eq(dev.alloc(dev.user, sizeof host[r], (void **)&buf[r]), AVGPIPE_OK);
        cr_assert_eq(dev.copy(dev.user, buf[r], host[r], sizeof host[r], AVGPIPE_DEVICE_COPY_H2D, NULL), AVGPIPE_OK);
    }
    cr_assert_eq(dev.stream_synchronize(dev.user, NULL), AVGPIPE_OK);
    avgpipe_comm_sum_ranks(want, host[0], 5, 3, 5);
    for (r = 0; r < 3; r++) {
        args[r].comm = &comm, args[r].rank = r, args[r].buf = buf[r], args[r].res = AVGPIPE_OK;
        pthread_create(&th[r], NULL, ar_main, &args[r]);
    }
    for (r = 0; r < 3; r++) pthread_join(th[r], NULL);
    for (r = 0; r < 3; r++) {
        cr_assert_eq(args[r].res, AVGPIPE_OK, "rank %d: %s", r, comm.last_error(comm.user, r));
        cr_assert_eq(dev.copy(dev.user, got, buf[r], sizeof got, AVGPIPE_DEVICE_COPY_D2H, NULL), AVGPIPE_OK);
        cr_assert_eq(dev.stream_synchronize(dev.user, NULL), AVGPIPE_OK);
        cr_assert(memcmp(got, want, sizeof want) == 0, "rank %d: not the sum in rank order", r);
        dev.free(dev.user, buf[r]);
    }
    avgpipe_comm_destroy(&comm);
    close_device("allreduce");
}
