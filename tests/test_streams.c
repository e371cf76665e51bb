/* Tests of the runtime on a device with asynchronous streams (avgpipe.h, "Devices and streams"),
   without a GPU: tests/async_device.h is a device whose streams are threads running queues of tasks,
   so work enqueued on a stream really runs later and elsewhere, as on a GPU. The stage callbacks
   enqueue the toy model's computation (tests/toy_model.h) on op->stream and return at once; the step
   enqueues the optimizer (step_async) or runs on the host (step). Every task first sleeps a little, so
   a wait the runtime leaves out shows as a consumer running before its producer.

   Checked: N = 2 elastic averaging (alpha 0.3, deterministic) gives bit for bit the parameters and
   references of the same run on the CPU device with synchronous callbacks, with step_async and with a
   host step, with device-ordered transfers (tests/ordered_comm.h: isend_on / irecv_on, nothing waited
   on the host), on V-placed schedules and split backward; profiles are timed by device events (the
   ops' durations are the tasks', not the host calls'); every slot, event and stream the run made is
   freed.

   Built a second time for each of the runtime's device waits with -DAVGPIPE_TEST_SKIP_WAIT=k (meson:
   streams-skip-wait-k): the build then has one test, which passes only if leaving out that wait breaks
   the run (different bits or an error), so each wait is shown to be needed and to be the one tested. */
#define _POSIX_C_SOURCE 200809L
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"

#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tests/toy_model.h"
#include "tests/async_device.h"
#include "tests/ordered_comm.h"

#define ITERS 3
#if AVGPIPE_TEST_SKIP_WAIT
#define DELAY_US 100 /* every task sleeps this long first */
#else
#define DELAY_US 30
#endif

/* ---- callbacks that enqueue the toy model's work ---------------------------------------------- */

static int async_failed; /* the first nonzero return of a task (read after the run) */

typedef struct cb_task {
    int (*fn)(avgpipe_op_ctx *);
    int (*pair)(avgpipe_op_ctx *, avgpipe_op_ctx *);
    avgpipe_op_ctx a, b;
} cb_task;

static void cb_task_run(void *p) {
    cb_task *t = (cb_task *)p;
    int rc = t->pair ? t->pair(&t->a, &t->b) : t->fn(&t->a);
    if (rc) __atomic_compare_exchange_n(&async_failed, &(int){0}, rc, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

static int enqueue_cb(int (*fn)(avgpipe_op_ctx *), avgpipe_op_ctx *op) {
    cb_task t;
    memset(&t, 0, sizeof t);
    t.fn = fn;
    t.a = *op;
    return adev_enqueue(op->stream, cb_task_run, &t, sizeof t) ? 1 : 0;
}
/* Variable sizes over device-ordered transfers (cfg.varb): the producer of boundary g's data for
   (pipe, micro) says it wrote vsize() bytes (it writes them all: the payload moves at the maximum,
   the size in a host message after it), and the consumer, on the host before it enqueues, must see
   that size. The toy's arithmetic is unchanged, so the bits must still be the CPU run's. */
static int VARB;
static const size_t *VACT;
static char varb_err[160];
static size_t vsize(int g, int pipe, int micro) { return VACT[g] - sizeof(float) * (size_t)((pipe + 2 * micro + g) % 3); }
static int varb_host(avgpipe_op_ctx *op) {
    int g = op->stage, G = op->stages, fwd = op->kind == AVGPIPE_OP_F;
    if (!VARB) return 0;
    if (g > 0 && op->input_bytes != vsize(g - 1, op->pipe, op->micro)) {
        snprintf(varb_err, sizeof varb_err, "stage %d kind %d: input_bytes %zu, want %zu", g, op->kind, op->input_bytes, vsize(g - 1, op->pipe, op->micro));
        return 77;
    }
    if (!fwd && g + 1 < G && op->grad_output_bytes != vsize(g, op->pipe, op->micro)) {
        snprintf(varb_err, sizeof varb_err, "stage %d kind %d: grad_output_bytes %zu, want %zu", g, op->kind, op->grad_output_bytes,
                 vsize(g, op->pipe, op->micro));
        return 78;
    }
    if (fwd && g + 1 < G) op->output_bytes = vsize(g, op->pipe, op->micro);
    if (!fwd && op->kind != AVGPIPE_OP_W && g > 0) op->grad_input_bytes = vsize(g - 1, op->pipe, op->micro);
    return 0;
}
static int async_forward(avgpipe_op_ctx *op) { return varb_host(op) ? 1 : enqueue_cb(cb_forward, op); }
static int async_backward(avgpipe_op_ctx *op) { return varb_host(op) ? 1 : enqueue_cb(cb_backward, op); }
static int async_backward_input(avgpipe_op_ctx *op) { return varb_host(op) ? 1 : enqueue_cb(cb_backward_input, op); }
static int async_backward_weight(avgpipe_op_ctx *op) { return varb_host(op) ? 1 : enqueue_cb(cb_backward_weight, op); }
static int async_overlap(avgpipe_op_ctx *f, avgpipe_op_ctx *b) {
    cb_task t;
    if (varb_host(f) || varb_host(b)) return 1;
    memset(&t, 0, sizeof t);
    t.pair = cb_overlap;
    t.a = *f, t.b = *b;
    return adev_enqueue(f->stream, cb_task_run, &t, sizeof t) ? 1 : 0;
}

typedef struct step_task {
    int rank, pipe, stage, round;
    float *params;
} step_task;
static void failed_step(int rc) {
    if (rc) __atomic_compare_exchange_n(&async_failed, &(int){0}, rc, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}
static void step_task_run(void *p) {
    step_task *t = (step_task *)p;
    int rc;
    if (AVGPIPE_TEST_SKIP_WAIT == 3) adev_nap(5000); /* a slow optimizer: the averaging must wait for it */
    rc = cb_step(t->rank, t->pipe, t->stage, t->round, t->params, NULL);
    failed_step(rc);
}
static int async_step(int rank, int pipe, int stage, int round, float *params, avgpipe_device_stream stream, void *user) {
    step_task t = {rank, pipe, stage, round, params};
    (void)user;
    return adev_enqueue(stream, step_task_run, &t, sizeof t) ? 1 : 0;
}

/* ---- one configuration, run on the CPU device (synchronous) and on the async device ------------- */

typedef struct cfg {
    avgpipe_sched_kind kind;
    int S, V, M, split, overlap;
    int host_step; /* step() on the host instead of step_async */
    int ordered;   /* 0: a host comm (the device's memory is the host's here, as with CUDA-aware MPI);
                      1: device-ordered transfers of tests/ordered_comm.h (isend_on / irecv_on);
                      2: the runtime's own device-aware in-process comm (desc.comm NULL) */
    int rounds;    /* averaging rounds per iteration (0: 1) */
    int varb;      /* on the device: desc.variable_bytes, every boundary's size set and checked (VARB) */
} cfg;

typedef struct outcome {
    float w[MAXN][MAXG][PMAX];
    float z[MAXG][PMAX];
    float zg[MAXG][PMAX]; /* avgpipe_run_gather_reference's copy */
    avgpipe_result res;
    char msg[AVGPIPE_ERROR_MAX];
    int task_error;
    long posted; /* transfers through isend_on / irecv_on */
} outcome;

static int cfg_stages(const cfg *c) { return c->S * (c->V > 0 ? c->V : 1); }

/* N = 2, alpha 0.3, MEAN, deterministic, `iters` iterations. On `dev` (NULL: the CPU device with the
   toy's synchronous callbacks). load_dir: resume from that checkpoint first; save_dir: save at the end
   (and gather the references into out->zg). */
static void train_ex(const cfg *c, avgpipe_device *dev, outcome *out, int iters, const char *load_dir, const char *save_dir) {
    const int N = 2, G = cfg_stages(c);
    avgpipe_context ctx;
    avgpipe_run *run = NULL;
    avgpipe_run_stats st;
    avgpipe_comm comm, host_comm;
    setup s;
    int it, g, i;
    memset(out, 0, sizeof *out);
    async_failed = 0;
    avgpipe_context_init(&ctx, NULL);
    reset_state(G, c->M, N);
    setup_init(&s, G, N);
    s.d.sched.kind = c->kind;
    s.d.sched.stages = c->S;
    s.d.sched.chunks = c->V;
    s.d.sched.micro = c->M;
    s.d.sched.pipes = N;
    s.d.sched.rounds = c->rounds ? c->rounds : 1;
    s.d.deterministic = 1;
    s.d.averaging.alpha = 0.3f;
    s.d.averaging.mode = AVGPIPE_EA_MEAN;
    s.d.timeout_s = 10;
    if (c->split) use_split(&s, 0);
    if (c->overlap) s.d.cb.overlap = cb_overlap;
    VARB = dev && c->varb, VACT = s.d.act_bytes, varb_err[0] = 0;
    s.d.variable_bytes = VARB;
    if (dev) {
        s.d.device = dev;
        s.d.cb.forward = async_forward;
        s.d.cb.backward = c->split ? NULL : async_backward;
        if (c->split) s.d.cb.backward_input = async_backward_input, s.d.cb.backward_weight = async_backward_weight;
        if (c->overlap) s.d.cb.overlap = async_overlap;
        if (!c->host_step) s.d.cb.step = NULL, s.d.cb.step_async = async_step;
        if (c->ordered == 1) {
            comm = ocomm_open(c->S, dev, s.d.timeout_s);
            s.d.comm = &comm;
        } else if (c->ordered == 0) {
            cr_assert_eq(avgpipe_comm_local_create(&ctx, c->S, &host_comm), AVGPIPE_OK);
            s.d.comm = &host_comm;
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
        }
        /* read right after the iteration returned: its work must have finished on the device */
        for (i = 0; i < N; i++)
            for (g = 0; g < G; g++) memcpy(out->w[i][g], T.w[i][g], sizeof out->w[i][g]);
        for (g = 0; g < G && out->res == AVGPIPE_OK; g++) {
            size_t count = 0;
            const float *z = avgpipe_run_reference(run, g, &count);
            if (z) memcpy(out->z[g], z, count * sizeof(float));
        }
    }
    if (out->res) snprintf(out->msg, sizeof out->msg, "%.800s%s%.160s", avgpipe_last_error(&ctx), varb_err[0] ? ": " : "", varb_err);
    avgpipe_run_destroy(run);
    if (dev && c->ordered == 1) {
        out->posted = OCOMM.posted;
        ocomm_close();
    }
    if (dev && c->ordered == 0) avgpipe_comm_destroy(&host_comm);
    out->task_error = async_failed;
    for (g = 0; g < G && !out->task_error; g++)
        if (T.err[g][0]) out->task_error = -1;
    VARB = 0, VACT = NULL; /* the wrappers of later tests (one process runs them all under TSan) */
}

static void train(const cfg *c, avgpipe_device *dev, outcome *out) { train_ex(c, dev, out, ITERS, NULL, NULL); }

static avgpipe_device open_device(void) {
    avgpipe_device d = adev_open(DELAY_US);
    ADEV.allocs = ADEV.frees = 0;
    /* a slow averaging kernel; without wait 2 a pipeline's next forward would otherwise still find
       the pass done, its host having issued the other pipeline's backward work meanwhile */
    ADEV.pass_delay_us = AVGPIPE_TEST_SKIP_WAIT == 2 ? 25000 : 1000;
    return d;
}


/* How far the async run got from the synchronous reference: 0 when bit for bit equal. */
static long differences(const cfg *c, const outcome *ref, const outcome *got) {
    long n = 0;
    int i, g, j, G = cfg_stages(c);
    for (i = 0; i < 2; i++)
        for (g = 0; g < G; g++)
            for (j = 0; j < pcount(g); j++) n += memcmp(&ref->w[i][g][j], &got->w[i][g][j], sizeof(float)) != 0;
    for (g = 0; g < G; g++)
        for (j = 0; j < pcount(g); j++) n += memcmp(&ref->z[g][j], &got->z[g][j], sizeof(float)) != 0;
    return n;
}

#if AVGPIPE_TEST_SKIP_WAIT == 0

static outcome ref_out, dev_out;

static void check_same(const cfg *c, const char *name) {
    avgpipe_device dev;
    int g;
    train(c, NULL, &ref_out);
    cr_assert_eq(ref_out.res, AVGPIPE_OK, "%s, CPU device: %s: %s", name, avgpipe_result_string(ref_out.res), ref_out.msg);
    for (g = 0; g < cfg_stages(c); g++) cr_assert(!T.err[g][0], "%s, CPU device, stage %d: %s", name, g, T.err[g]);
    cr_assert(memcmp(ref_out.w[0][0], ref_out.w[1][0], sizeof ref_out.w[0][0]) != 0, "%s: the two models are identical", name);
    dev = open_device();
    train(c, &dev, &dev_out);
    cr_assert_eq(dev_out.res, AVGPIPE_OK, "%s, async device: %s: %s", name, avgpipe_result_string(dev_out.res), dev_out.msg);
    for (g = 0; g < cfg_stages(c); g++) cr_assert(!T.err[g][0], "%s, async device, stage %d: %s", name, g, T.err[g]);
    cr_assert_eq(dev_out.task_error, 0, "%s: a task failed (%d)", name, dev_out.task_error);
    cr_assert_eq(differences(c, &ref_out, &dev_out), 0, "%s: %ld parameters differ from the CPU device's run", name,
                 differences(c, &ref_out, &dev_out));
    if (c->ordered == 1) cr_assert(dev_out.posted > 0, "%s: no transfer went through isend_on / irecv_on", name);
    cr_assert(ADEV.allocs > 0 && ADEV.allocs == ADEV.frees, "%s: %ld device allocations, %ld frees", name, ADEV.allocs, ADEV.frees);
    cr_assert(ADEV.nstreams == 1, "%s: %d streams left (the default one only expected)", name, ADEV.nstreams);
    adev_close();
}

Test(streams, async_step_1f1b) {
    cfg c = {AVGPIPE_SCHED_1F1B, 4, 0, 8, 0, 0, 0, 0, 0, 0};
    check_same(&c, "1f1b, step_async");
}
Test(streams, host_step_1f1b) {
    cfg c = {AVGPIPE_SCHED_1F1B, 4, 0, 8, 0, 0, 1, 0, 0, 0};
    check_same(&c, "1f1b, host step");
}
Test(streams, zbh1_split_backward) {
    cfg c = {AVGPIPE_SCHED_ZBH1, 3, 0, 6, 1, 0, 0, 0, 0, 0};
    check_same(&c, "zbh1 I/W, step_async");
}
Test(streams, two_rounds_per_iteration) {
    cfg c = {AVGPIPE_SCHED_ADVANCE, 3, 0, 4, 0, 0, 0, 0, 2, 0};
    check_same(&c, "advance, 2 rounds per iteration");
}
Test(streams, interleaved) {
    cfg c = {AVGPIPE_SCHED_INTERLEAVED, 2, 2, 4, 0, 0, 0, 0, 0, 0};
    check_same(&c, "interleaved V=2");
}
Test(streams, ordered_transfers_1f1b) {
    cfg c = {AVGPIPE_SCHED_1F1B, 4, 0, 8, 0, 0, 0, 1, 0, 0};
    check_same(&c, "1f1b, isend_on/irecv_on");
}
Test(streams, ordered_transfers_zbv) {
    cfg c = {AVGPIPE_SCHED_ZBV, 2, 2, 4, 1, 0, 0, 1, 0, 0};
    check_same(&c, "zbv I/W, isend_on/irecv_on");
}
Test(streams, ordered_transfers_dualpipev_overlap_host_step) {
    cfg c = {AVGPIPE_SCHED_DUALPIPEV, 2, 2, 4, 0, 1, 1, 1, 0, 0};
    check_same(&c, "dualpipev overlap, isend_on/irecv_on, host step");
}

Test(streams, device_local_comm_1f1b) {
    cfg c = {AVGPIPE_SCHED_1F1B, 4, 0, 8, 0, 0, 0, 2, 0, 0};
    check_same(&c, "1f1b, the runtime's device-aware in-process comm");
}
Test(streams, device_local_comm_zbv_split) {
    cfg c = {AVGPIPE_SCHED_ZBV, 2, 2, 4, 1, 0, 0, 2, 0, 0};
    check_same(&c, "zbv I/W, the runtime's device-aware in-process comm");
}
Test(streams, device_local_comm_dualpipev_overlap_two_rounds) {
    cfg c = {AVGPIPE_SCHED_DUALPIPEV, 2, 2, 4, 0, 1, 0, 2, 2, 0};
    check_same(&c, "dualpipev overlap, 2 rounds, the runtime's device-aware in-process comm");
}
/* desc.variable_bytes over device-ordered transfers: each size as its own host message after the
   payload, waited for before the consumer is enqueued (ordered_comm.h as NCCL, and the runtime's own). */
Test(streams, variable_sizes_over_ordered_transfers) {
    cfg c = {AVGPIPE_SCHED_1F1B, 4, 0, 4, 0, 0, 0, 1, 0, 0};
    c.varb = 1;
    check_same(&c, "1f1b, variable sizes, isend_on/irecv_on");
}
Test(streams, variable_sizes_over_the_device_local_comm_zbv_overlap) {
    cfg c = {AVGPIPE_SCHED_DUALPIPEV, 2, 2, 4, 0, 1, 0, 2, 0, 0};
    c.varb = 1;
    check_same(&c, "dualpipev overlap, variable sizes, the runtime's device-aware in-process comm");
    c.kind = AVGPIPE_SCHED_ZBV, c.overlap = 0, c.split = 1;
    check_same(&c, "zbv I/W, variable sizes, the runtime's device-aware in-process comm");
}

/* ---- the non-finite guard on the device: no host wait per AVG, the same refusal ------------------ */

static double step_end_s, forward_call_s; /* host clock: the slow STEP's end (on its stream), the call of the forward after it */

static void slow_step_task(void *p) {
    step_task *t = (step_task *)p;
    adev_nap(150000); /* a slow optimizer step */
    failed_step(cb_step(t->rank, t->pipe, t->stage, t->round, t->params, NULL));
    {
        double t = adev_now();
        __atomic_store(&step_end_s, &t, __ATOMIC_SEQ_CST);
    }
}
static int slow_first_step(int rank, int pipe, int stage, int round, float *params, avgpipe_device_stream stream, void *user) {
    step_task t = {rank, pipe, stage, round, params};
    (void)user;
    if (pipe == 0 && stage == 0 && round == 0) return adev_enqueue(stream, slow_step_task, &t, sizeof t) ? 1 : 0;
    return async_step(rank, pipe, stage, round, params, stream, NULL);
}
static int timed_forward(avgpipe_op_ctx *op) {
    if (op->pipe == 0 && op->stage == 0 && op->round == 1 && op->micro == 0) {
        double t = adev_now();
        __atomic_store(&forward_call_s, &t, __ATOMIC_SEQ_CST); /* once: one forward has these numbers */
    }
    return async_forward(op);
}

/* Pipeline 0's forward of round 1 waits for its averaging of round 0, which waits for its STEP. The
   host must not wait for that STEP before it enqueues the forward (the guard's verdict is read at the
   end of the iteration): the forward's call comes before the slow STEP ends on the device. */
Test(streams, averaging_guard_does_not_block_the_host) {
    avgpipe_context ctx;
    avgpipe_device dev = open_device();
    avgpipe_run *run = NULL;
    setup s;
    avgpipe_result res;
    avgpipe_context_init(&ctx, NULL);
    reset_state(2, 2, 2);
    setup_init(&s, 2, 2);
    s.d.sched.kind = AVGPIPE_SCHED_1F1B, s.d.sched.stages = 2, s.d.sched.micro = 2, s.d.sched.pipes = 2, s.d.sched.rounds = 2;
    s.d.averaging.alpha = 0.3f, s.d.deterministic = 1, s.d.timeout_s = 10, s.d.device = &dev;
    s.d.cb.forward = timed_forward, s.d.cb.backward = async_backward, s.d.cb.step = NULL, s.d.cb.step_async = slow_first_step;
    step_end_s = forward_call_s = 0;
    async_failed = 0;
    res = avgpipe_run_create(&ctx, &s.d, &run);
    cr_assert_eq(res, AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    T.nslots[0] = avgpipe_run_slots(run, 0), T.nslots[1] = avgpipe_run_slots(run, 1);
    res = avgpipe_run_iteration(run, NULL);
    cr_assert_eq(res, AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    cr_assert_eq(async_failed, 0, "a task failed (%d)", async_failed);
    cr_assert(step_end_s > 0 && forward_call_s > 0, "the slow step or the timed forward did not run");
    cr_assert(forward_call_s < step_end_s, "the forward after the averaging was called %.1f ms after the slow STEP ended: the host waited for it",
              1e3 * (forward_call_s - step_end_s));
    avgpipe_run_destroy(run);
    adev_close();
}

static void nan_step_task(void *p) {
    step_task *t = (step_task *)p;
    failed_step(cb_step(t->rank, t->pipe, t->stage, t->round, t->params, NULL));
    t->params[3] = NAN;
}
static int nan_step(int rank, int pipe, int stage, int round, float *params, avgpipe_device_stream stream, void *user) {
    step_task t = {rank, pipe, stage, round, params};
    (void)user;
    if (pipe == 1 && stage == 1 && round == 1) return adev_enqueue(stream, nan_step_task, &t, sizeof t) ? 1 : 0;
    return async_step(rank, pipe, stage, round, params, stream, NULL);
}

/* A model that goes non-finite on the device is refused there: the iteration fails with
   AVGPIPE_NON_FINITE naming pipeline, stage and round; the reference never saw the NaN. */
Test(streams, non_finite_model_is_refused_on_the_device) {
    avgpipe_context ctx;
    avgpipe_device dev = open_device();
    avgpipe_run *run = NULL;
    setup s;
    avgpipe_result res;
    const char *msg;
    size_t count = 0, j;
    const float *z;
    avgpipe_context_init(&ctx, NULL);
    reset_state(3, 4, 2);
    setup_init(&s, 3, 2);
    s.d.sched.kind = AVGPIPE_SCHED_1F1B, s.d.sched.stages = 3, s.d.sched.micro = 4, s.d.sched.pipes = 2;
    s.d.averaging.alpha = 0.25f, s.d.timeout_s = 10, s.d.device = &dev;
    s.d.cb.forward = async_forward, s.d.cb.backward = async_backward, s.d.cb.step = NULL, s.d.cb.step_async = nan_step;
    async_failed = 0;
    cr_assert_eq(avgpipe_run_create(&ctx, &s.d, &run), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    for (j = 0; j < 3; j++) T.nslots[j] = avgpipe_run_slots(run, (int)j);
    cr_assert_eq(avgpipe_run_iteration(run, NULL), AVGPIPE_OK, "round 0: %s", avgpipe_last_error(&ctx));
    res = avgpipe_run_iteration(run, NULL);
    msg = avgpipe_last_error(&ctx);
    cr_assert_eq(res, AVGPIPE_NON_FINITE, "got %s: %s", avgpipe_result_string(res), msg);
    cr_assert(strstr(msg, "pipeline 1") != NULL && strstr(msg, "stage 1") != NULL && strstr(msg, "round 1") != NULL,
              "the message does not name pipeline 1, stage 1, round 1: %s", msg);
    z = avgpipe_run_reference(run, 1, &count);
    cr_assert(z != NULL && count > 0);
    for (j = 0; j < count; j++) cr_assert(isfinite(z[j]), "the reference of stage 1 holds %g at %zu", (double)z[j], j);
    cr_assert_eq(avgpipe_run_iteration(run, NULL), AVGPIPE_STATE_ERROR);
    avgpipe_run_destroy(run);
    adev_close();
}

/* Checkpoints and the gathered reference go through the device's copies: two iterations on the
   async device, saved; a new run on the async device loads them and runs the third: the CPU device's
   three iterations, to the bit. The gathered references are the run's. */
Test(streams, checkpoint_and_gather_through_the_device) {
    static outcome first;
    cfg c = {AVGPIPE_SCHED_1F1B, 3, 0, 4, 0, 0, 0, 0, 0, 0};
    char dir[] = "/tmp/avgpipe-streams-XXXXXX";
    avgpipe_device dev;
    int g;
    cr_assert(mkdtemp(dir) != NULL);
    train(&c, NULL, &ref_out);
    cr_assert_eq(ref_out.res, AVGPIPE_OK, "CPU device: %s", ref_out.msg);
    dev = open_device();
    train_ex(&c, &dev, &first, ITERS - 1, NULL, dir);
    cr_assert_eq(first.res, AVGPIPE_OK, "async device, saving: %s: %s", avgpipe_result_string(first.res), first.msg);
    for (g = 0; g < cfg_stages(&c); g++)
        cr_assert(memcmp(first.zg[g], first.z[g], (size_t)pcount(g) * sizeof(float)) == 0, "stage %d: the gathered reference differs", g);
    train_ex(&c, &dev, &dev_out, 1, dir, NULL);
    cr_assert_eq(dev_out.res, AVGPIPE_OK, "async device, resuming: %s: %s", avgpipe_result_string(dev_out.res), dev_out.msg);
    cr_assert_eq(differences(&c, &ref_out, &dev_out), 0, "resumed on the async device: %ld parameters differ from the CPU device's run",
                 differences(&c, &ref_out, &dev_out));
    cr_assert(ADEV.allocs == ADEV.frees, "%ld device allocations, %ld frees", ADEV.allocs, ADEV.frees);
    adev_close();
    {
        char cmd[128];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        cr_assert_eq(system(cmd), 0);
    }
}

/* The ops' profile times are the device's: a forward whose task sleeps 3 ms lasts >= 3 ms in the
   events although its host call returns at once. */
Test(streams, profile_is_timed_on_the_device) {
    const int G = 2, M = 4;
    avgpipe_device dev = open_device();
    avgpipe_context ctx;
    avgpipe_run *run = NULL;
    avgpipe_run_stats st;
    const avgpipe_event *ev;
    size_t n = 0, k;
    long forwards = 0;
    setup s;
    avgpipe_result res;
    avgpipe_context_init(&ctx, NULL);
    reset_state(G, M, 1);
    setup_init(&s, G, 1);
    s.d.sched.kind = AVGPIPE_SCHED_1F1B;
    s.d.sched.stages = G;
    s.d.sched.micro = M;
    s.d.profile = 1;
    s.d.device = &dev;
    s.d.cb.forward = async_forward;
    s.d.cb.backward = async_backward;
    s.d.cb.step = NULL;
    s.d.cb.step_async = async_step;
    T.op_sleep_us = 3000;
    res = avgpipe_run_create(&ctx, &s.d, &run);
    cr_assert_eq(res, AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    T.nslots[0] = avgpipe_run_slots(run, 0), T.nslots[1] = avgpipe_run_slots(run, 1);
    res = avgpipe_run_iteration(run, &st);
    cr_assert_eq(res, AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    ev = avgpipe_run_events(run, &n);
    cr_assert(ev && n > 0, "no events");
    for (k = 0; k < n; k++) {
        if (ev[k].op.kind != AVGPIPE_OP_F || ev[k].track != 0) continue; /* track 0: the op; 2: its receive */
        forwards++;
        cr_assert(ev[k].end - ev[k].start >= 2.9e-3, "forward %d of stage %d lasted %.3g ms in the profile (its task sleeps 3 ms)",
                  ev[k].op.micro, ev[k].op.stage, (ev[k].end - ev[k].start) * 1e3);
        cr_assert(ev[k].end - ev[k].start < 1.0, "forward lasted %.3g s", ev[k].end - ev[k].start);
    }
    cr_assert_eq(forwards, (long)G * M);
    avgpipe_run_destroy(run);
    adev_close();
}

/* A callback's enqueued work that fails is the trainer's to report; a device call that fails stops
   the run with the device's error: here, stream_create fails on the second call. */
static int creates;
static avgpipe_result failing_stream_create(void *u, avgpipe_device_stream *out) {
    if (++creates == 2) return AVGPIPE_BACKEND_ERROR;
    return adev_stream_create(u, out);
}
static const char *failing_error_string(void *u) {
    (void)u;
    return "test device: out of streams";
}
Test(streams, device_failure_is_reported) {
    avgpipe_device dev = open_device();
    avgpipe_context ctx;
    avgpipe_run *run = NULL;
    setup s;
    avgpipe_result res;
    avgpipe_context_init(&ctx, NULL);
    reset_state(2, 2, 1);
    setup_init(&s, 2, 1);
    s.d.sched.kind = AVGPIPE_SCHED_1F1B;
    s.d.sched.stages = 2;
    s.d.sched.micro = 2;
    dev.stream_create = failing_stream_create;
    dev.error_string = failing_error_string;
    s.d.device = &dev;
    s.d.cb.forward = async_forward;
    s.d.cb.backward = async_backward;
    creates = 0;
    res = avgpipe_run_create(&ctx, &s.d, &run);
    cr_assert_eq(res, AVGPIPE_BACKEND_ERROR, "got %s", avgpipe_result_string(res));
    cr_assert(run == NULL);
    cr_assert(strstr(avgpipe_last_error(&ctx), "out of streams"), "message: %s", avgpipe_last_error(&ctx));
    cr_assert(ADEV.allocs == ADEV.frees, "%ld allocations, %ld frees after a failed create", ADEV.allocs, ADEV.frees);
    cr_assert(ADEV.nstreams == 1, "%d streams left", ADEV.nstreams);
    adev_close();
}

#else /* one wait left out */

/* The configuration that depends on the wait left out. */
static cfg skip_cfg(void) {
    cfg c = {AVGPIPE_SCHED_1F1B, 4, 0, 8, 0, 0, 0, 0, 0, 0};
    if (AVGPIPE_TEST_SKIP_WAIT == 5) c.ordered = 1;   /* consumer after a device-ordered receive */
    if (AVGPIPE_TEST_SKIP_WAIT == 6) c.host_step = 1; /* host step after the backward work */
    if (AVGPIPE_TEST_SKIP_WAIT == 2) c.rounds = 2;    /* a forward after the averaging within an iteration */
    return c;
}

Test(streams, leaving_out_the_wait_breaks_the_run) {
    static outcome ref, got;
    cfg c = skip_cfg();
    avgpipe_device dev;
    int attempt, broken = 0;
    train(&c, NULL, &ref);
    cr_assert_eq(ref.res, AVGPIPE_OK, "CPU device: %s", ref.msg);
    for (attempt = 0; attempt < 5 && !broken; attempt++) {
        long diff;
        dev = open_device();
        train(&c, &dev, &got);
        diff = differences(&c, &ref, &got);
        adev_close();
        broken = got.res != AVGPIPE_OK || got.task_error || diff > 0;
        cr_log_info("wait %d left out, attempt %d: %s%s%s, task error %d, %ld parameters differ", AVGPIPE_TEST_SKIP_WAIT, attempt + 1,
                    avgpipe_result_string(got.res), got.res ? ": " : "", got.msg, got.task_error, diff);
    }
    cr_assert(broken, "wait %d was left out and the run still gave the reference's bits five times", AVGPIPE_TEST_SKIP_WAIT);
}

#endif
