/* Tests of the runtime (sections 13-17): the small real model of tests/toy_model.h trained by the runtime
   on stage threads, checked against a non-pipelined single-thread run (N = 1, alpha = 0: bit for bit)
   and against an independent float64 computation of the elastic-averaging math (N = 2, deterministic
   mode; replica groups); ranks split over several runs sharing one comm backend, as processes do
   (bitwise the single run's parameters); the agreement check; failure propagation (callback errors, a
   peer that never sends, lost and duplicated messages), bad descriptions, profiling and the adaptive
   advance controller.

   Tests run with the repository root as working directory; the PyTorch golden schedule is read from
   tests/data/ (override the directory with AVGPIPE_GOLDEN_DIR). */
#define _POSIX_C_SOURCE 200809L
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"

#include <criterion/criterion.h>
#include "tests/delaycomm.h"
#include "tests/faultcomm.h"
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tests/toy_model.h"

static avgpipe_run *create_run(avgpipe_context *ctx, const setup *s) {
    avgpipe_run *run = NULL;
    avgpipe_result res;
    int g;
    res = avgpipe_run_create(ctx, &s->d, &run);
    cr_assert_eq(res, AVGPIPE_OK, "avgpipe_run_create: %s: %s", avgpipe_result_string(res), avgpipe_last_error(ctx));
    cr_assert(run != NULL);
    for (g = 0; g < T.G; g++) {
        T.nslots[g] = avgpipe_run_slots(run, g);
        cr_assert(T.nslots[g] >= 1 && T.nslots[g] <= MAXSLOT, "stage %d: %d slots", g, T.nslots[g]);
    }
    return run;
}

static void first_callback_error(void) {
    int g;
    for (g = 0; g < T.G; g++) cr_assert(!T.err[g][0], "stage %d callback: %s", g, T.err[g]);
}

static void iterate(avgpipe_context *ctx, avgpipe_run *run, avgpipe_run_stats *st) {
    avgpipe_result res = avgpipe_run_iteration(run, st);
    first_callback_error();
    cr_assert_eq(res, AVGPIPE_OK, "avgpipe_run_iteration: %s: %s", avgpipe_result_string(res), avgpipe_last_error(ctx));
}

/* N = 1, alpha = 0: ITERS iterations of one round each must give the reference's parameters bit for
   bit, the reference's loss, and M forwards, backwards and weight updates per stage and round. */
#define ITERS 3
static avgpipe_schedule *free_after_create; /* a test's own schedule, freed (and its struct poisoned) once the run exists */
static void check_equivalence(setup *s, const char *name) {
    static float ref[MAXG][PMAX];
    avgpipe_context ctx;
    avgpipe_run *run;
    avgpipe_run_stats st;
    int it, g, j, G = T.G, M = T.M;
    double refloss;
    avgpipe_context_init(&ctx, NULL);
    s->d.averaging.alpha = AVGPIPE_ZERO;
    for (g = 0; g < G; g++) init_params(g, ref[g]);
    run = create_run(&ctx, s);
    if (free_after_create) { /* desc.schedule is copied at create: the run must not need the caller's any more */
        avgpipe_sched_free(&ctx, free_after_create);
        memset(free_after_create, 0xa5, sizeof *free_after_create);
        free_after_create = NULL;
    }
    for (it = 0; it < ITERS; it++) {
        iterate(&ctx, run, &st);
        refloss = reference_train(ref, G, M, 0, it);
        cr_assert_eq(st.micro_batches, M, "%s: %lld last-stage forwards, want %d", name, st.micro_batches, M);
        cr_assert(fabs(st.loss - refloss) <= 1e-12 * fabs(refloss), "%s, iteration %d: loss %.17g, reference %.17g", name, it,
                  st.loss, refloss);
        for (g = 0; g < G; g++) {
            cr_assert_eq(T.nf[0][g], (long)M * (it + 1), "%s: stage %d ran %ld forwards", name, g, T.nf[0][g]);
            cr_assert_eq(T.nbi[0][g], (long)M * (it + 1), "%s: stage %d ran %ld backwards", name, g, T.nbi[0][g]);
            cr_assert_eq(T.nw[0][g], (long)M * (it + 1), "%s: stage %d ran %ld weight gradients", name, g, T.nw[0][g]);
            cr_assert_eq(T.nstep[0][g], it + 1, "%s: stage %d ran %ld steps", name, g, T.nstep[0][g]);
            for (j = 0; j < pcount(g); j++)
                cr_assert(memcmp(&T.w[0][g][j], &ref[g][j], sizeof(float)) == 0,
                          "%s, iteration %d, stage %d, param %d: pipelined %.9g, reference %.9g (not bitwise equal)", name, it, g,
                          j, (double)T.w[0][g][j], (double)ref[g][j]);
        }
    }
    /* the run really trained: the parameters moved */
    {
        float p0[PMAX];
        init_params(0, p0);
        cr_assert(memcmp(p0, T.w[0][0], (size_t)pcount(0) * sizeof(float)) != 0, "%s: stage 0's parameters never changed", name);
    }
    avgpipe_run_destroy(run);
}

static void equivalence(avgpipe_sched_kind kind, int S, int M, int V, int K, int split, int keep_full, const char *name) {
    setup s;
    int G = S * (V > 0 ? V : 1);
    reset_state(G, M, 1);
    setup_init(&s, G, 1);
    s.d.sched.kind = kind;
    s.d.sched.stages = S;
    s.d.sched.micro = M;
    s.d.sched.chunks = V;
    s.d.sched.advance = K;
    if (split) use_split(&s, keep_full);
    check_equivalence(&s, name);
}

TestSuite(runtime, .timeout = 60);

Test(runtime, equivalence_afab) { equivalence(AVGPIPE_SCHED_AFAB, 4, 8, 0, 0, 0, 0, "afab"); }
Test(runtime, equivalence_1f1b) { equivalence(AVGPIPE_SCHED_1F1B, 4, 8, 0, 0, 0, 0, "1f1b"); }
Test(runtime, equivalence_1f1b_two_stages_many_micro) { equivalence(AVGPIPE_SCHED_1F1B, 2, 7, 0, 0, 0, 0, "1f1b S=2 M=7"); }
Test(runtime, equivalence_advance_k1) { equivalence(AVGPIPE_SCHED_ADVANCE, 4, 8, 0, 1, 0, 0, "advance K=1"); }
Test(runtime, equivalence_advance_k3) { equivalence(AVGPIPE_SCHED_ADVANCE, 4, 8, 0, 3, 0, 0, "advance K=3"); }
Test(runtime, equivalence_interleaved_v2) { equivalence(AVGPIPE_SCHED_INTERLEAVED, 4, 8, 2, 0, 0, 0, "interleaved V=2"); }
Test(runtime, equivalence_zbh1_split) { equivalence(AVGPIPE_SCHED_ZBH1, 4, 8, 0, 0, 1, 0, "zbh1 I/W"); }
Test(runtime, equivalence_zbh1_full_backward_only) { equivalence(AVGPIPE_SCHED_ZBH1, 4, 8, 0, 0, 0, 0, "zbh1 B only"); }
/* "without backward(), B runs I then W" */
Test(runtime, equivalence_1f1b_split_callbacks_only) { equivalence(AVGPIPE_SCHED_1F1B, 4, 8, 0, 0, 1, 0, "1f1b I/W only"); }
/* With all three given, B runs backward() and I/W run the split pair. */
Test(runtime, equivalence_zbh1_all_three_callbacks) { equivalence(AVGPIPE_SCHED_ZBH1, 4, 8, 0, 0, 1, 1, "zbh1 B+I+W"); }

static void golden_path(char *out, size_t cap) {
    const char *dir = getenv("AVGPIPE_GOLDEN_DIR");
    snprintf(out, cap, "%s/torch_zb1p_2rank_2stagep_compute.csv", dir && dir[0] ? dir : "tests/data");
}

Test(runtime, equivalence_golden_torch_zb1p) {
    avgpipe_schedule golden;
    avgpipe_context ctx;
    avgpipe_result res;
    char path[1024];
    setup s;
    avgpipe_context_init(&ctx, NULL);
    golden_path(path, sizeof path);
    memset(&golden, 0, sizeof golden);
    res = avgpipe_sched_load(&ctx, path, &golden);
    cr_assert_eq(res, AVGPIPE_OK, "loading %s: %s", path, avgpipe_last_error(&ctx));
    cr_assert_eq(golden.nranks, 2);
    cr_assert_eq(golden.nstages, 4);
    cr_assert_eq(golden.shape.micro, 8);
    reset_state(4, 8, 1);
    setup_init(&s, 4, 1);
    s.d.schedule = &golden;
    use_split(&s, 0);
    check_equivalence(&s, "torch zb1p golden");
    avgpipe_sched_free(&ctx, &golden);
}

/* The caller frees its schedule right after create: the run keeps its own copy (the same bits). */
Test(runtime, given_schedule_is_copied_at_create) {
    avgpipe_schedule mine;
    avgpipe_sched_desc d;
    setup s;
    memset(&d, 0, sizeof d);
    d.kind = AVGPIPE_SCHED_1F1B, d.stages = 3, d.micro = 5;
    cr_assert_eq(avgpipe_sched_generate(NULL, &d, &mine), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
    reset_state(3, 5, 1);
    setup_init(&s, 3, 1);
    s.d.schedule = &mine;
    free_after_create = &mine;
    check_equivalence(&s, "1f1b S=3 M=5, the caller's schedule freed after create");
    cr_assert(free_after_create == NULL, "the schedule was not freed");
}

/* ---- what a callback wrote is visible to the callback that consumes its output ---------------- */

/* Plain (non-atomic, unlocked) memory written by the producing callback before it returns and read by
   the consuming one on the next (forward) or previous (backward) rank's thread: the runtime's send and
   receive must order them (ThreadSanitizer reports the race otherwise; this suite runs under it). Each
   stage keeps its own error count, read by the driving thread after the iteration. */
static long side_f[MAXG][MAXM], side_b[MAXG][MAXM];
static int side_err[MAXG];
static long side_stamp(const avgpipe_op_ctx *op) { return 1000L * (op->round + 1) + op->micro; }
static int cb_forward_side(avgpipe_op_ctx *op) {
    if (op->stage > 0 && side_f[op->stage - 1][op->micro] != side_stamp(op)) side_err[op->stage]++;
    side_f[op->stage][op->micro] = side_stamp(op);
    return cb_forward(op);
}
static int cb_backward_side(avgpipe_op_ctx *op) {
    if (op->stage < op->stages - 1 && side_b[op->stage + 1][op->micro] != side_stamp(op)) side_err[op->stage]++;
    side_b[op->stage][op->micro] = side_stamp(op);
    return cb_backward(op);
}

Test(runtime, callback_writes_are_visible_to_the_consuming_callback) {
    static const avgpipe_sched_kind kinds[] = {AVGPIPE_SCHED_1F1B, AVGPIPE_SCHED_AFAB, AVGPIPE_SCHED_ADVANCE};
    int k, it, g;
    for (k = 0; k < 3; k++) {
        avgpipe_context ctx;
        avgpipe_run *run;
        avgpipe_run_stats st;
        setup s;
        avgpipe_context_init(&ctx, NULL);
        memset(side_f, 0, sizeof side_f), memset(side_b, 0, sizeof side_b), memset(side_err, 0, sizeof side_err);
        reset_state(4, 8, 1);
        setup_init(&s, 4, 1);
        s.d.sched.kind = kinds[k], s.d.sched.stages = 4, s.d.sched.micro = 8, s.d.sched.advance = 2;
        s.d.averaging.alpha = AVGPIPE_ZERO;
        s.d.cb.forward = cb_forward_side, s.d.cb.backward = cb_backward_side;
        run = create_run(&ctx, &s);
        for (it = 0; it < 3; it++) iterate(&ctx, run, &st);
        avgpipe_run_destroy(run);
        for (g = 0; g < 4; g++) {
            cr_assert_eq(side_err[g], 0, "%s: stage %d's callbacks saw %d stale values from their neighbour's", avgpipe_sched_kind_name(kinds[k]), g,
                         side_err[g]);
            cr_assert_eq(side_f[g][7], 1000L * 3 + 7, "%s: stage %d's last forward did not run", avgpipe_sched_kind_name(kinds[k]), g);
        }
    }
}

/* ---- V placement, custom placement, overlapped pairs ------------------------------------------ */

/* DualPipeV's overlapped pairs per iteration, from its step structure (tests/test_place.c checks the
   same count on the schedule itself). */
static long dualpipev_pairs(int S, int M) {
    long n = 0;
    int r;
    for (r = 0; r < S; r++) n += 2L * (M - 2 * S + r + 1) - (r == S - 1) + (S - r - 1);
    return n;
}

static long overlap_calls(void) {
    long n = 0;
    int g;
    for (g = 0; g < MAXG; g++) n += T.noverlap[g];
    return n;
}

/* N = 1, alpha = 0: a V-placed schedule (two stages per rank, the first and the last on rank 0) gives
   the reference's bits, like the loop-placed ones above; with the overlap callback every pair goes
   through it, with the same bits. */
static void equivalence_v(avgpipe_sched_kind kind, int S, int M, int split, int overlap, const char *name) {
    setup s;
    reset_state(2 * S, M, 1);
    setup_init(&s, 2 * S, 1);
    s.d.sched.kind = kind;
    s.d.sched.stages = S;
    s.d.sched.micro = M;
    if (split) use_split(&s, 0);
    if (overlap) s.d.cb.overlap = cb_overlap;
    check_equivalence(&s, name);
    if (overlap && kind == AVGPIPE_SCHED_DUALPIPEV)
        cr_assert_eq(overlap_calls(), ITERS * dualpipev_pairs(S, M), "%s: %ld overlapped calls, want %ld", name, overlap_calls(),
                     ITERS * dualpipev_pairs(S, M));
    else
        cr_assert_eq(overlap_calls(), 0, "%s: %ld overlapped calls", name, overlap_calls());
}

Test(runtime, equivalence_zbv) { equivalence_v(AVGPIPE_SCHED_ZBV, 4, 8, 0, 0, "zbv"); }
Test(runtime, equivalence_zbv_split) { equivalence_v(AVGPIPE_SCHED_ZBV, 4, 8, 1, 0, "zbv I/W"); }
Test(runtime, equivalence_zbv_few_micro) { equivalence_v(AVGPIPE_SCHED_ZBV, 3, 2, 1, 0, "zbv S=3 M=2"); }
Test(runtime, equivalence_dualpipev) { equivalence_v(AVGPIPE_SCHED_DUALPIPEV, 4, 8, 0, 0, "dualpipev"); }
Test(runtime, equivalence_dualpipev_split) { equivalence_v(AVGPIPE_SCHED_DUALPIPEV, 4, 8, 1, 0, "dualpipev I/W"); }
Test(runtime, equivalence_dualpipev_overlap) { equivalence_v(AVGPIPE_SCHED_DUALPIPEV, 4, 8, 0, 1, "dualpipev overlap"); }
Test(runtime, equivalence_dualpipev_split_overlap) { equivalence_v(AVGPIPE_SCHED_DUALPIPEV, 4, 9, 1, 1, "dualpipev I/W overlap"); }
Test(runtime, equivalence_dualpipev_two_ranks_overlap) { equivalence_v(AVGPIPE_SCHED_DUALPIPEV, 2, 5, 0, 1, "dualpipev S=2 overlap"); }

/* PyTorch's DualPipeV layout (tests/data, 4 ranks, 8 stages, 10 micro-batches), imported: the same bits
   with plain and split backward callbacks, with and without the overlap callback. */
Test(runtime, equivalence_imported_dualpipev) {
    static const char *path = "tests/data/torch_dualpipev_4rank_8stage_10micro.csv";
    avgpipe_schedule file;
    avgpipe_context ctx;
    int variant;
    avgpipe_context_init(&ctx, NULL);
    cr_assert_eq(avgpipe_sched_load(&ctx, path, &file), AVGPIPE_OK, "%s: %s", path, avgpipe_last_error(&ctx));
    cr_assert_eq(file.nranks, 4);
    cr_assert_eq(file.nstages, 8);
    cr_assert_eq(file.shape.micro, 10);
    cr_assert_eq(file.shape.placement, AVGPIPE_PLACE_V);
    for (variant = 0; variant < 4; variant++) {
        setup s;
        char name[96];
        int split = variant & 1, overlap = variant >> 1;
        reset_state(8, 10, 1);
        setup_init(&s, 8, 1);
        s.d.schedule = &file;
        if (split) use_split(&s, 0);
        if (overlap) s.d.cb.overlap = cb_overlap;
        snprintf(name, sizeof name, "imported dualpipev%s%s", split ? " I/W" : "", overlap ? " overlap" : "");
        check_equivalence(&s, name);
        cr_assert_eq(overlap_calls(), overlap ? ITERS * dualpipev_pairs(4, 10) : 0, "%s: %ld overlapped calls", name, overlap_calls());
    }
    avgpipe_sched_free(&ctx, &file);
}

/* A custom placement: 1F1B's lists moved to other ranks (stage g on rank perm[g], so neighbours are
   not adjacent ranks and rank 0 runs no stage 0); the same bits. */
Test(runtime, equivalence_custom_placement) {
    static const int perm[4] = {2, 0, 3, 1};
    avgpipe_sched_desc d;
    avgpipe_schedule plain, moved;
    setup s;
    int r, i;
    memset(&d, 0, sizeof d);
    d.kind = AVGPIPE_SCHED_1F1B, d.stages = 4, d.micro = 8;
    cr_assert_eq(avgpipe_sched_generate(NULL, &d, &plain), AVGPIPE_OK);
    cr_assert_eq(avgpipe_sched_init(NULL, &moved, 4, &plain.shape), AVGPIPE_OK);
    moved.shape.kind = AVGPIPE_SCHED_CUSTOM;
    cr_assert_eq(avgpipe_sched_set_place(NULL, &moved, perm, 4), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
    cr_assert_eq(moved.shape.placement, AVGPIPE_PLACE_CUSTOM);
    for (r = 0; r < 4; r++)
        for (i = 0; i < plain.len[r]; i++) cr_assert_eq(avgpipe_sched_push(NULL, &moved, perm[r], plain.ops[r][i]), AVGPIPE_OK);
    reset_state(4, 8, 1);
    setup_init(&s, 4, 1);
    s.d.schedule = &moved;
    check_equivalence(&s, "1f1b on permuted ranks");
    avgpipe_sched_free(NULL, &moved);
    avgpipe_sched_free(NULL, &plain);
}

/* ---- N = 2, deterministic: the elastic-averaging math in float64 ------------------------------- */

/* |got - want| <= tol * max(|want|, rms(want)) elementwise. */
static void expect_close(const char *what, const float *got, const double *want, int n, double tol) {
    double rms = 0;
    int j;
    for (j = 0; j < n; j++) rms += want[j] * want[j];
    rms = sqrt(rms / n);
    for (j = 0; j < n; j++) {
        double s = fabs(want[j]) > rms ? fabs(want[j]) : rms, err = fabs((double)got[j] - want[j]);
        cr_assert(err <= tol * s, "%s, element %d: got %.9g, float64 %.17g (relative error %.3g > %.1g)", what, j, (double)got[j],
                  want[j], err / s, tol);
    }
}

typedef struct avg_case {
    avgpipe_sched_kind kind;
    int S, V, M, continuous, rounds_per_iter, iters, split;
} avg_case;

/* N = 2, alpha = 0.5, MEAN, deterministic: run c and return the last iteration's mean loss, the
   models' parameters and the reference. */
static double averaging_run(const avg_case *c, float out[MAXN][MAXG][PMAX], float zout[MAXG][PMAX]) {
    const int N = 2, G = c->S * (c->V > 0 ? c->V : 1);
    avgpipe_context ctx;
    avgpipe_run *run;
    avgpipe_run_stats st;
    setup s;
    int it, g, i;
    avgpipe_context_init(&ctx, NULL);
    reset_state(G, c->M, N);
    setup_init(&s, G, N);
    s.d.sched.kind = c->kind;
    s.d.sched.stages = c->S;
    s.d.sched.chunks = c->V;
    s.d.sched.micro = c->M;
    s.d.sched.pipes = N;
    s.d.sched.rounds = c->rounds_per_iter;
    s.d.sched.continuous = c->continuous;
    s.d.deterministic = 1;
    s.d.averaging.alpha = 0.5f;
    s.d.averaging.mode = AVGPIPE_EA_MEAN;
    if (c->split) use_split(&s, 0);
    run = create_run(&ctx, &s);
    for (it = 0; it < c->iters; it++) {
        iterate(&ctx, run, &st);
        cr_assert_eq(st.micro_batches, (long long)N * c->M * c->rounds_per_iter);
    }
    for (i = 0; i < N; i++)
        for (g = 0; g < G; g++) {
            cr_assert_eq(T.nstep[i][g], (long)c->iters * c->rounds_per_iter);
            memcpy(out[i][g], T.w[i][g], sizeof out[i][g]);
        }
    for (g = 0; g < G; g++) {
        size_t count = 0;
        const float *z = avgpipe_run_reference(run, g, &count);
        cr_assert(z != NULL, "avgpipe_run_reference(%d) is NULL", g);
        cr_assert_eq(count, (size_t)pcount(g));
        memset(zout[g], 0, sizeof zout[g]);
        memcpy(zout[g], z, count * sizeof(float));
    }
    avgpipe_run_destroy(run);
    return st.loss;
}

static void check_averaging(const avg_case *c) {
    static double w[MAXN][MAXG][PMAX], z[MAXG][PMAX], loss[64];
    static float got[MAXN][MAXG][PMAX], zgot[MAXG][PMAX], got2[MAXN][MAXG][PMAX], zgot2[MAXG][PMAX];
    double got_loss, want_loss = 0;
    char what[128];
    int i, g, G = c->S * (c->V > 0 ? c->V : 1), R = c->rounds_per_iter;
    got_loss = averaging_run(c, got, zgot);
    averaging_f64(G, c->M, 2, R * c->iters, 0.5, w, z, loss);
    for (i = 0; i < R; i++) want_loss += loss[R * (c->iters - 1) + i] / R;
    cr_assert(fabs(got_loss - want_loss) <= 1e-5 * want_loss, "last iteration's loss %.9g, float64 %.9g", got_loss, want_loss);
    for (i = 0; i < 2; i++)
        for (g = 0; g < G; g++) {
            snprintf(what, sizeof what, "pipeline %d, stage %d", i, g);
            expect_close(what, got[i][g], w[i][g], pcount(g), 1e-5);
        }
    for (g = 0; g < G; g++) {
        snprintf(what, sizeof what, "reference, stage %d", g);
        expect_close(what, zgot[g], z[g], pcount(g), 1e-5);
    }
    /* the two models saw different data: they differ */
    cr_assert(memcmp(got[0][1], got[1][1], sizeof got[0][1]) != 0, "the parallel models are identical");
    /* deterministic mode is reproducible to the bit */
    averaging_run(c, got2, zgot2);
    cr_assert(memcmp(got, got2, sizeof got) == 0, "deterministic mode: two runs differ (models)");
    cr_assert(memcmp(zgot, zgot2, sizeof zgot) == 0, "deterministic mode: two runs differ (reference)");
}

Test(runtime, averaging_n2_deterministic_matches_f64) {
    avg_case c = {AVGPIPE_SCHED_1F1B, 3, 0, 4, 0, 1, 4, 0};
    check_averaging(&c);
}
Test(runtime, averaging_n2_deterministic_two_rounds_per_iteration) {
    avg_case c = {AVGPIPE_SCHED_1F1B, 3, 0, 4, 0, 2, 2, 0};
    check_averaging(&c);
}
Test(runtime, averaging_n2_deterministic_continuous_rounds) {
    avg_case c = {AVGPIPE_SCHED_1F1B, 3, 0, 4, 1, 2, 2, 0};
    check_averaging(&c);
}
Test(runtime, averaging_n2_deterministic_advance_continuous) {
    avg_case c = {AVGPIPE_SCHED_ADVANCE, 4, 0, 4, 1, 3, 1, 0};
    check_averaging(&c);
}
Test(runtime, averaging_n2_deterministic_interleaved) {
    avg_case c = {AVGPIPE_SCHED_INTERLEAVED, 2, 2, 4, 0, 2, 2, 0};
    check_averaging(&c);
}
Test(runtime, averaging_n2_deterministic_zbh1_split) {
    avg_case c = {AVGPIPE_SCHED_ZBH1, 3, 0, 4, 1, 2, 2, 1};
    check_averaging(&c);
}

/* alpha = 0 with N = 2, not deterministic: no pull, so each model trains alone (bit for bit as the
   single-thread reference on its own data) and the reference is the fp32 mean (w0 + w1) * 0.5. */
Test(runtime, zero_alpha_n2_models_train_independently) {
    static float ref[MAXN][MAXG][PMAX];
    const int S = 3, M = 4, N = 2, G = 3, R = 2, ITER = 2;
    avgpipe_context ctx;
    avgpipe_run *run;
    setup s;
    int it, r, i, g, j;
    avgpipe_context_init(&ctx, NULL);
    reset_state(G, M, N);
    setup_init(&s, G, N);
    s.d.sched.kind = AVGPIPE_SCHED_1F1B;
    s.d.sched.stages = S;
    s.d.sched.micro = M;
    s.d.sched.pipes = N;
    s.d.sched.rounds = R;
    s.d.sched.continuous = 1;
    s.d.averaging.alpha = AVGPIPE_ZERO;
    run = create_run(&ctx, &s);
    for (i = 0; i < N; i++)
        for (g = 0; g < G; g++) init_params(g, ref[i][g]);
    for (it = 0; it < ITER; it++) {
        iterate(&ctx, run, NULL);
        for (r = 0; r < R; r++)
            for (i = 0; i < N; i++) reference_train(ref[i], G, M, i, it * R + r);
    }
    for (i = 0; i < N; i++)
        for (g = 0; g < G; g++)
            cr_assert(memcmp(T.w[i][g], ref[i][g], (size_t)pcount(g) * sizeof(float)) == 0,
                      "pipeline %d, stage %d: not the single-thread reference's bits", i, g);
    for (g = 0; g < G; g++) {
        const float *z = avgpipe_run_reference(run, g, NULL);
        cr_assert(z != NULL);
        for (j = 0; j < pcount(g); j++) {
            float want = (T.w[0][g][j] + T.w[1][g][j]) * 0.5f;
            cr_assert(memcmp(&z[j], &want, sizeof want) == 0, "reference, stage %d, element %d: %.9g, want %.9g", g, j, (double)z[j],
                      (double)want);
        }
    }
    avgpipe_run_destroy(run);
}

/* ---- failures --------------------------------------------------------------------------------- */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

Test(runtime, callback_error_stops_every_rank) {
    avgpipe_context ctx;
    avgpipe_run *run;
    avgpipe_run_stats st;
    avgpipe_result res;
    setup s;
    double t0, dt;
    const char *msg;
    avgpipe_context_init(&ctx, NULL);
    reset_state(4, 8, 1);
    setup_init(&s, 4, 1);
    s.d.sched.kind = AVGPIPE_SCHED_1F1B;
    s.d.sched.stages = 4;
    s.d.sched.micro = 8;
    s.d.averaging.alpha = AVGPIPE_ZERO;
    s.d.timeout_s = 10;
    run = create_run(&ctx, &s);
    iterate(&ctx, run, &st); /* a good iteration first */
    T.fail_stage = 2, T.fail_micro = 3, T.fail_round = 1;
    t0 = now_s();
    res = avgpipe_run_iteration(run, &st);
    dt = now_s() - t0;
    msg = avgpipe_last_error(&ctx);
    cr_assert_eq(res, AVGPIPE_CALLBACK_ERROR, "got %s: %s", avgpipe_result_string(res), msg);
    cr_assert(strstr(msg, "rank 2") != NULL, "the message does not name rank 2: %s", msg);
    cr_assert(strstr(msg, "2F3") != NULL, "the message does not name the op 2F3: %s", msg);
    cr_assert(strstr(msg, "7") != NULL, "the message does not give the callback's value: %s", msg);
    cr_assert(dt < 5.0, "the failing iteration took %.3f s (timeout 10 s): the other ranks were not woken", dt);
    res = avgpipe_run_iteration(run, &st);
    cr_assert_eq(res, AVGPIPE_STATE_ERROR, "an iteration after a failure returned %s", avgpipe_result_string(res));
    avgpipe_run_destroy(run);
}

static int cb_step_fails(int rank, int pipe, int stage, int round, float *params, void *user) {
    (void)params, (void)user, (void)pipe;
    return rank == 1 && stage == 1 && round == 0 ? -3 : 0;
}

Test(runtime, step_error_is_a_callback_error) {
    avgpipe_context ctx;
    avgpipe_run *run;
    avgpipe_result res;
    setup s;
    double t0;
    avgpipe_context_init(&ctx, NULL);
    reset_state(2, 4, 1);
    setup_init(&s, 2, 1);
    s.d.sched.kind = AVGPIPE_SCHED_1F1B;
    s.d.sched.stages = 2;
    s.d.sched.micro = 4;
    s.d.averaging.alpha = AVGPIPE_ZERO;
    s.d.cb.step = cb_step_fails;
    s.d.timeout_s = 10;
    run = create_run(&ctx, &s);
    t0 = now_s();
    res = avgpipe_run_iteration(run, NULL);
    cr_assert_eq(res, AVGPIPE_CALLBACK_ERROR, "got %s: %s", avgpipe_result_string(res), avgpipe_last_error(&ctx));
    cr_assert(strstr(avgpipe_last_error(&ctx), "rank 1") != NULL, "%s", avgpipe_last_error(&ctx));
    cr_assert(strstr(avgpipe_last_error(&ctx), "STEP") != NULL, "%s", avgpipe_last_error(&ctx));
    cr_assert(now_s() - t0 < 5.0, "took %.2f s (timeout 10 s)", now_s() - t0);
    avgpipe_run_destroy(run);
}

static int cb_step_nan(int rank, int pipe, int stage, int round, float *params, void *user) {
    int rc = cb_step(rank, pipe, stage, round, params, user);
    if (pipe == 1 && stage == 1 && round == 1) params[3] = NAN;
    return rc;
}

/* A model that goes non-finite is refused by the averaging (AVGPIPE_NON_FINITE): the iteration
   fails with that result, names pipeline, stage and round, and every rank stops. */
Test(runtime, non_finite_model_fails_the_iteration) {
    avgpipe_context ctx;
    avgpipe_run *run;
    avgpipe_result res;
    setup s;
    double t0, dt;
    const char *msg;
    avgpipe_context_init(&ctx, NULL);
    reset_state(3, 4, 2);
    setup_init(&s, 3, 2);
    s.d.sched.kind = AVGPIPE_SCHED_1F1B;
    s.d.sched.stages = 3;
    s.d.sched.micro = 4;
    s.d.sched.pipes = 2;
    s.d.averaging.alpha = 0.25f;
    s.d.cb.step = cb_step_nan;
    s.d.timeout_s = 10;
    run = create_run(&ctx, &s);
    iterate(&ctx, run, NULL); /* round 0 is fine */
    t0 = now_s();
    res = avgpipe_run_iteration(run, NULL);
    dt = now_s() - t0;
    msg = avgpipe_last_error(&ctx);
    cr_assert_eq(res, AVGPIPE_NON_FINITE, "got %s: %s", avgpipe_result_string(res), msg);
    cr_assert(strstr(msg, "pipeline 1") != NULL && strstr(msg, "stage 1") != NULL && strstr(msg, "round 1") != NULL,
              "the message does not name pipeline 1, stage 1, round 1: %s", msg);
    cr_assert(dt < 5.0, "the failing iteration took %.3f s (timeout 10 s)", dt);
    cr_assert_eq(avgpipe_run_iteration(run, NULL), AVGPIPE_STATE_ERROR);
    avgpipe_run_destroy(run);
}

static const avgpipe_comm *local_comm(int ranks) {
    static avgpipe_comm c;
    cr_assert_eq(avgpipe_comm_local_create(NULL, ranks, &c), AVGPIPE_OK);
    return &c;
}

/* 1F1B, S = 2, M = 8 over a faulty comm; returns the failing iteration's result and the message. */
static avgpipe_result run_faulty(faultcomm *fc, avgpipe_comm *table, double timeout_s, double *seconds, char *msg, size_t cap) {
    avgpipe_context ctx;
    avgpipe_run *run;
    avgpipe_result res;
    setup s;
    double t0;
    avgpipe_context_init(&ctx, NULL);
    (void)fc;
    setup_init(&s, 2, 1);
    s.d.sched.kind = AVGPIPE_SCHED_1F1B;
    s.d.sched.stages = 2;
    s.d.sched.micro = 8;
    s.d.averaging.alpha = AVGPIPE_ZERO;
    s.d.timeout_s = timeout_s;
    s.d.comm = table;
    run = create_run(&ctx, &s);
    t0 = now_s();
    res = avgpipe_run_iteration(run, NULL);
    *seconds = now_s() - t0;
    snprintf(msg, cap, "%s", avgpipe_last_error(&ctx));
    cr_assert_eq(avgpipe_run_iteration(run, NULL), AVGPIPE_STATE_ERROR);
    avgpipe_run_destroy(run);
    return res;
}

Test(runtime, peer_that_never_sends_times_out) {
    avgpipe_comm table;
    faultcomm fc;
    avgpipe_result res;
    char msg[AVGPIPE_ERROR_MAX];
    double dt;
    /* 1F1B, S = 2, M = 8: rank 0's 8th send to rank 1 (the activation of micro-batch 7) is lost.
       Rank 1 waits for it from right after its B6; rank 0 then runs a slow B6 (150 ms) before it waits
       for the gradient of micro-batch 7, so rank 1's wait is the first to time out. */
    faultcomm_init(&fc, &table, local_comm(2), 0, 1, 7, 0);
    reset_state(2, 8, 1);
    T.sleep_stage = 0, T.sleep_micro = 6, T.sleep_ms = 150;
    res = run_faulty(&fc, &table, 0.5, &dt, msg, sizeof msg);
    cr_assert_eq(res, AVGPIPE_TIMEOUT, "got %s: %s", avgpipe_result_string(res), msg);
    cr_assert(strstr(msg, "rank 1") != NULL, "the message does not name the waiting rank 1: %s", msg);
    cr_assert(strstr(msg, "1F7") != NULL, "the message does not name the op 1F7: %s", msg);
    cr_assert(strstr(msg, "from rank 0") != NULL, "the message does not name the peer rank 0: %s", msg);
    cr_assert(dt >= 0.45 && dt < 3.0, "the iteration returned after %.3f s (timeout 0.5 s)", dt);
    faultcomm_free(&fc);
}

/* The fault-th message from src to dst lost (or duplicated, dup): the run stops with AVGPIPE_MISMATCH
   at once (not at the timeout), at the receive where it happened, naming the op that waited and the op
   whose message came. */
static void expect_mismatch(int src, int dst, int fault, int dup, const char *at, const char *want, const char *got) {
    avgpipe_comm table;
    faultcomm fc;
    avgpipe_result res;
    char msg[AVGPIPE_ERROR_MAX];
    double dt;
    faultcomm_init(&fc, &table, local_comm(2), src, dst, fault, dup);
    reset_state(2, 8, 1);
    res = run_faulty(&fc, &table, 10, &dt, msg, sizeof msg);
    cr_assert_eq(res, AVGPIPE_MISMATCH, "got %s: %s", avgpipe_result_string(res), msg);
    cr_assert(strstr(msg, at) != NULL, "the message does not name the receiving op (%s): %s", at, msg);
    cr_assert(strstr(msg, want) != NULL && strstr(msg, got) != NULL, "the message does not name both ops: %s", msg);
    cr_assert(dt < 5.0, "reported after %.3f s: at the timeout, not at the receive", dt);
    faultcomm_free(&fc);
}

/* In the middle of a stream: the activation of micro-batch 3 is lost. */
Test(runtime, lost_message_is_reported_at_its_receive) {
    expect_mismatch(0, 1, 3, 0, "rank 1, op 0:1F3", "expected the message of 0:0SEND_F3", "received that of 0:0SEND_F4");
}
/* Rank 1 sends the gradient of micro-batch 2 twice. */
Test(runtime, duplicated_message_is_reported_at_its_receive) {
    expect_mismatch(1, 0, 2, 1, "rank 0, op 0:0B3", "expected the message of 0:1SEND_B3", "received that of 0:1SEND_B2");
}

/* ---- bad descriptions ------------------------------------------------------------------------- */

static void expect_invalid(const setup *s, const char *field) {
    avgpipe_context ctx;
    avgpipe_run *run = (avgpipe_run *)(void *)&ctx; /* must be overwritten with NULL */
    avgpipe_result res;
    avgpipe_context_init(&ctx, NULL);
    res = avgpipe_run_create(&ctx, &s->d, &run);
    cr_assert_eq(res, AVGPIPE_INVALID_ARG, "%s: got %s (%s)", field, avgpipe_result_string(res), avgpipe_last_error(&ctx));
    cr_assert(run == NULL, "%s: *out was not set to NULL", field);
    cr_assert(strstr(avgpipe_last_error(&ctx), field) != NULL, "the message does not name '%s': %s", field, avgpipe_last_error(&ctx));
}

static void bad_base(setup *s) {
    reset_state(4, 4, 1);
    setup_init(s, 4, 1);
    s->d.sched.kind = AVGPIPE_SCHED_1F1B;
    s->d.sched.stages = 4;
    s->d.sched.micro = 4;
    s->d.averaging.alpha = AVGPIPE_ZERO;
}

Test(runtime, bad_desc_no_forward) {
    setup s;
    bad_base(&s);
    s.d.cb.forward = NULL;
    expect_invalid(&s, "cb.forward");
}
Test(runtime, bad_desc_no_backward) {
    setup s;
    bad_base(&s);
    s.d.cb.backward = NULL;
    expect_invalid(&s, "cb.backward");
}
Test(runtime, bad_desc_half_split) {
    setup s;
    bad_base(&s);
    s.d.cb.backward_input = cb_backward_input;
    expect_invalid(&s, "backward_weight");
}
Test(runtime, bad_desc_null_params) {
    setup s;
    bad_base(&s);
    s.d.params = NULL;
    expect_invalid(&s, "params");
}
Test(runtime, bad_desc_null_param_entry) {
    setup s;
    bad_base(&s);
    s.params[2] = NULL;
    expect_invalid(&s, "params[2]");
}
Test(runtime, bad_desc_zero_param_count) {
    setup s;
    bad_base(&s);
    s.pc[1] = 0;
    expect_invalid(&s, "param_count[1]");
}
Test(runtime, bad_desc_act_bytes_null_with_4_stages) {
    setup s;
    bad_base(&s);
    s.d.act_bytes = NULL;
    expect_invalid(&s, "act_bytes");
}
Test(runtime, bad_desc_adaptive_needs_advance) {
    setup s;
    bad_base(&s);
    s.d.adaptive = 1;
    expect_invalid(&s, "adaptive");
}
Test(runtime, bad_desc_negative_timeout) {
    setup s;
    bad_base(&s);
    s.d.timeout_s = -1;
    expect_invalid(&s, "timeout_s");
}
Test(runtime, bad_desc_averaging_fields_the_run_sets) {
    setup s;
    float z[4] = {0};
    bad_base(&s);
    s.d.averaging.count = 7;
    expect_invalid(&s, "averaging.count");
    bad_base(&s);
    s.d.averaging.initial = z;
    expect_invalid(&s, "averaging.initial");
    bad_base(&s);
    s.d.averaging.hold_every = 2;
    expect_invalid(&s, "averaging.hold_every");
    bad_base(&s);
    s.d.averaging.no_finite_check = 1;
    expect_invalid(&s, "averaging.no_finite_check");
}
Test(runtime, bad_desc_bad_shape) {
    setup s;
    bad_base(&s);
    s.d.sched.micro = 0;
    expect_invalid(&s, "micro");
}
Test(runtime, bad_desc_comm_size) {
    avgpipe_context ctx;
    avgpipe_comm c;
    setup s;
    avgpipe_context_init(&ctx, NULL);
    bad_base(&s);
    cr_assert_eq(avgpipe_comm_local_create(&ctx, 3, &c), AVGPIPE_OK);
    s.d.comm = &c;
    expect_invalid(&s, "comm");
    avgpipe_comm_destroy(&c);
}

/* ---- the watchdog: callbacks that stall ------------------------------------------------------- */

static pthread_mutex_t stall_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t stall_cv = PTHREAD_COND_INITIALIZER;
static int stall_release, stall_inside, stall_sleep_ms;

/* Rank 1's forward of micro-batch 2 (round 0) sleeps stall_sleep_ms, or (0) waits until released. */
static int cb_forward_stalls(avgpipe_op_ctx *op) {
    if (op->stage == 1 && op->micro == 2 && op->round == 0) {
        pthread_mutex_lock(&stall_mu);
        stall_inside = 1;
        if (stall_sleep_ms) {
            pthread_mutex_unlock(&stall_mu);
            nap_us(1000L * stall_sleep_ms);
            pthread_mutex_lock(&stall_mu);
        } else {
            while (!stall_release) pthread_cond_wait(&stall_cv, &stall_mu);
        }
        stall_inside = 0;
        pthread_mutex_unlock(&stall_mu);
        return 0; /* the run is over by now: leave T alone (the next test owns it) */
    }
    return cb_forward(op);
}

/* cb.abandoned_return: how often, whether the callback had left by then, and what was still allocated. */
static int stall_returned = -1, stall_inside_at_return = -1;
static long stall_live_at_return = -1;
static long stall_live;
static void stall_abandoned_return(int rank, void *user) {
    (void)user;
    pthread_mutex_lock(&stall_mu);
    stall_returned = stall_returned < 0 ? rank : 1000 + rank; /* twice: 1000 + */
    stall_inside_at_return = stall_inside;
    stall_live_at_return = __atomic_load_n(&stall_live, __ATOMIC_SEQ_CST);
    pthread_cond_broadcast(&stall_cv);
    pthread_mutex_unlock(&stall_mu);
}

/* An allocator that counts what is still allocated: the orphaned thread must give everything back. */
static void *stall_alloc(size_t n, void *user) {
    (void)user;
    __atomic_add_fetch(&stall_live, 1, __ATOMIC_SEQ_CST);
    return malloc(n);
}
static void stall_free(void *p, void *user) {
    (void)user;
    if (p) __atomic_sub_fetch(&stall_live, 1, __ATOMIC_SEQ_CST);
    free(p);
}

/* A forward that stalls past the timeout: the iteration fails with AVGPIPE_TIMEOUT at about the timeout,
   naming the rank and the op; destroy returns at once, also while the callback is still inside. */
static void stalled_callback(int sleep_ms) {
    avgpipe_context_desc cd;
    avgpipe_context ctx;
    avgpipe_run *run;
    avgpipe_result res;
    setup s;
    double t0, dt;
    const char *msg;
    memset(&cd, 0, sizeof cd);
    cd.allocator.alloc = stall_alloc, cd.allocator.free = stall_free;
    avgpipe_context_init(&ctx, &cd);
    stall_release = stall_inside = 0, stall_sleep_ms = sleep_ms;
    stall_returned = stall_inside_at_return = -1, stall_live_at_return = -1;
    reset_state(3, 4, 1);
    setup_init(&s, 3, 1);
    s.d.sched.kind = AVGPIPE_SCHED_1F1B, s.d.sched.stages = 3, s.d.sched.micro = 4;
    s.d.averaging.alpha = AVGPIPE_ZERO;
    s.d.cb.forward = cb_forward_stalls;
    s.d.cb.abandoned_return = stall_abandoned_return;
    s.d.timeout_s = 1;
    run = create_run(&ctx, &s);
    t0 = now_s();
    res = avgpipe_run_iteration(run, NULL);
    dt = now_s() - t0;
    msg = avgpipe_last_error(&ctx);
    cr_assert_eq(res, AVGPIPE_TIMEOUT, "got %s: %s", avgpipe_result_string(res), msg);
    cr_assert(strstr(msg, "rank 1, op 0:1F2: the F callback has been running for") != NULL, "the message does not name rank and op: %s", msg);
    cr_assert(dt >= 0.9 && dt < 2.5, "the iteration returned after %.2f s (timeout 1 s, callback %d ms)", dt, sleep_ms);
    cr_assert_eq(avgpipe_run_iteration(run, NULL), AVGPIPE_STATE_ERROR);
    cr_assert_eq(avgpipe_run_abandoned(run), 1, "one thread is left inside a callback, avgpipe_run_abandoned says %d",
                 avgpipe_run_abandoned(run));
    t0 = now_s();
    avgpipe_run_destroy(run);
    cr_assert(now_s() - t0 < 1.5, "destroy waited %.2f s for a stuck callback (it sleeps 2 s more, or until released)", now_s() - t0);
    pthread_mutex_lock(&stall_mu); /* let the stuck thread go; it must end on its own without harm */
    stall_release = 1;
    pthread_cond_broadcast(&stall_cv);
    pthread_mutex_unlock(&stall_mu);
    { /* the documented way to know it is over: cb.abandoned_return, once the callback has returned (at most 10 s) */
        struct timespec dl;
        clock_gettime(CLOCK_REALTIME, &dl);
        dl.tv_sec += 10;
        pthread_mutex_lock(&stall_mu);
        while (stall_returned < 0 && pthread_cond_timedwait(&stall_cv, &stall_mu, &dl) == 0) {
        }
        pthread_mutex_unlock(&stall_mu);
    }
    cr_assert_eq(stall_returned, 1, "cb.abandoned_return: %d (want rank 1, once; -1: never called)", stall_returned);
    cr_assert_eq(stall_inside_at_return, 0, "cb.abandoned_return was called while the callback was still inside");
    cr_assert_eq(stall_live_at_return, 0, "%ld allocations of the run were not freed when cb.abandoned_return came", stall_live_at_return);
    nap_us(20000); /* let the orphan's thread end */
}
Test(runtime, callback_stalling_past_the_timeout) { stalled_callback(3000); }
Test(runtime, callback_that_never_returns) { stalled_callback(0); }

/* ---- ranks in several processes: runs on threads that share one comm backend ------------------ */

/* One "process": a run of some of the ranks, on its own thread, over the shared backend. */
typedef struct proc {
    avgpipe_run_desc d;
    int ranks[8], iters, gather;
    avgpipe_context ctx;
    avgpipe_result res;
    char msg[AVGPIPE_ERROR_MAX];
    float gathered[MAXG][PMAX]; /* the reference gathered on the process of rank 0 */
    double sum[2];              /* what avgpipe_run_allreduce returned */
} proc;

static void *proc_main(void *arg) {
    proc *p = (proc *)arg;
    avgpipe_run *run = NULL;
    float *dst[MAXG];
    int it, g;
    avgpipe_context_init(&p->ctx, NULL);
    p->res = avgpipe_run_create(&p->ctx, &p->d, &run);
    for (it = 0; it < p->iters && !p->res; it++) p->res = avgpipe_run_iteration(run, NULL);
    if (!p->res && p->gather) {
        for (g = 0; g < MAXG; g++) dst[g] = p->gathered[g];
        p->res = avgpipe_run_gather_reference(run, avgpipe_run_is_local(run, 0) ? dst : NULL);
        p->sum[0] = p->ranks[0] + 1, p->sum[1] = 0.5;
        if (!p->res) p->res = avgpipe_run_allreduce(run, p->sum, 2);
    }
    if (p->res) snprintf(p->msg, sizeof p->msg, "%s", avgpipe_last_error(&p->ctx));
    avgpipe_run_destroy(run);
    return NULL;
}

/* Run s's ranks as `nproc` processes (process k runs ranks k*per .. k*per+per-1), `iters` iterations,
   over one in-process backend of all the ranks; they share T (each writes only its stages). */
static void run_processes(const setup *s, int nranks, int nproc, int iters, int gather, proc *p) {
    pthread_t th[8];
    avgpipe_comm comm;
    int k, j, per = nranks / nproc;
    cr_assert(nproc <= 8 && per * nproc == nranks);
    cr_assert_eq(avgpipe_comm_local_create(NULL, nranks, &comm), AVGPIPE_OK);
    for (k = 0; k < nproc; k++) {
        memset(&p[k], 0, sizeof p[k]);
        p[k].d = s->d;
        for (j = 0; j < per; j++) p[k].ranks[j] = k * per + j;
        p[k].d.local_ranks = p[k].ranks;
        p[k].d.local_count = per;
        p[k].d.comm = &comm;
        p[k].iters = iters;
        p[k].gather = gather;
        cr_assert_eq(pthread_create(&th[k], NULL, proc_main, &p[k]), 0);
    }
    for (k = 0; k < nproc; k++) pthread_join(th[k], NULL);
    avgpipe_comm_destroy(&comm);
}

/* The same description run (a) by one process with every rank on its threads and (b) split over
   processes of `per` ranks each: (b)'s parameters and references must be (a)'s, bit for bit. */
static void processes_equal_threads(avgpipe_sched_kind kind, int S, int V, int N, int D, float alpha, int split, const char *name) {
    static float want[MAXN][MAXG][PMAX], zwant[MAXD][MAXG][PMAX];
    int G = S * (V > 0 ? V : 1), M = 4, iters = 2, nslots[MAXG], k, i, g;
    avgpipe_context ctx;
    avgpipe_run *run;
    proc p[8];
    setup s;
    avgpipe_context_init(&ctx, NULL);
    reset_state_d(G, M, N, D);
    setup_init_d(&s, G, N, D, S);
    s.d.sched.kind = kind, s.d.sched.stages = S, s.d.sched.chunks = V, s.d.sched.micro = M, s.d.sched.pipes = N;
    s.d.sched.rounds = 2, s.d.sched.advance = kind == AVGPIPE_SCHED_ADVANCE ? 2 : 0;
    s.d.averaging.alpha = alpha == 0 ? AVGPIPE_ZERO : alpha;
    s.d.deterministic = 1;
    s.d.timeout_s = 20;
    if (split) use_split(&s, 0);
    if (kind == AVGPIPE_SCHED_DUALPIPEV) s.d.cb.overlap = cb_overlap;
    run = create_run(&ctx, &s);
    for (k = 0; k < iters; k++) iterate(&ctx, run, NULL);
    memcpy(want, T.w, sizeof want);
    for (k = 0; k < D; k++)
        for (g = 0; g < G; g++) memcpy(zwant[k][g], avgpipe_run_replica_reference(run, k, g, NULL), (size_t)pcount(g) * sizeof(float));
    avgpipe_run_destroy(run);
    memcpy(nslots, T.nslots, sizeof nslots);
    reset_state_d(G, M, N, D);
    memcpy(T.nslots, nslots, sizeof nslots);
    T.S = S;
    run_processes(&s, D * S, D * S, iters, 1, p);
    first_callback_error();
    for (k = 0; k < D * S; k++) cr_assert_eq(p[k].res, AVGPIPE_OK, "%s: process of rank %d: %s: %s", name, k, avgpipe_result_string(p[k].res), p[k].msg);
    for (i = 0; i < N * D; i++)
        for (g = 0; g < G; g++)
            cr_assert(memcmp(T.w[i][g], want[i][g], (size_t)pcount(g) * sizeof(float)) == 0,
                      "%s: model %d, stage %d: one process per rank differs from one process of threads", name, i, g);
    for (g = 0; g < G; g++) /* rank 0 gathered group 0's reference */
        cr_assert(memcmp(p[0].gathered[g], zwant[0][g], (size_t)pcount(g) * sizeof(float)) == 0, "%s: gathered reference of stage %d", name, g);
    for (k = 0; k < D * S; k++) /* every process counted once, in the same bits */
        cr_assert(p[k].sum[0] == D * S * (D * S + 1) / 2.0 && p[k].sum[1] == 0.5 * D * S, "%s: allreduce on rank %d: %g %g", name, k,
                  p[k].sum[0], p[k].sum[1]);
    {
        float z0[PMAX];
        init_params(0, z0);
        cr_assert(memcmp(T.w[0][0], z0, (size_t)pcount(0) * sizeof(float)) != 0, "%s: nothing trained", name);
    }
}

Test(runtime, processes_equal_threads_afab) { processes_equal_threads(AVGPIPE_SCHED_AFAB, 2, 0, 1, 1, 0, 0, "afab N=1"); }
Test(runtime, processes_equal_threads_1f1b_n2) { processes_equal_threads(AVGPIPE_SCHED_1F1B, 4, 0, 2, 1, 0.3f, 0, "1f1b N=2"); }
Test(runtime, processes_equal_threads_advance_n2) { processes_equal_threads(AVGPIPE_SCHED_ADVANCE, 4, 0, 2, 1, 0.3f, 0, "advance N=2"); }
Test(runtime, processes_equal_threads_interleaved) { processes_equal_threads(AVGPIPE_SCHED_INTERLEAVED, 2, 2, 2, 1, 0.3f, 0, "interleaved"); }
Test(runtime, processes_equal_threads_zbh1_split) { processes_equal_threads(AVGPIPE_SCHED_ZBH1, 4, 0, 1, 1, 0, 1, "zbh1 I/W"); }
Test(runtime, processes_equal_threads_replicas) { processes_equal_threads(AVGPIPE_SCHED_1F1B, 2, 0, 2, 2, 0.3f, 0, "1f1b D=2"); }
Test(runtime, processes_equal_threads_zbv_split) { processes_equal_threads(AVGPIPE_SCHED_ZBV, 2, 2, 2, 1, 0.3f, 1, "zbv N=2 I/W"); }
Test(runtime, processes_equal_threads_dualpipev_replicas) {
    processes_equal_threads(AVGPIPE_SCHED_DUALPIPEV, 2, 2, 2, 2, 0.3f, 0, "dualpipev N=2 D=2 overlap");
}

/* Processes that describe different runs are refused at create, every one of them, naming the field. */
static void disagree(void (*spoil)(avgpipe_run_desc *), const char *field) {
    static size_t other_act[MAXG];
    proc p[2];
    pthread_t th[2];
    avgpipe_comm comm;
    setup s;
    int k;
    reset_state(2, 4, 1);
    setup_init(&s, 2, 1);
    s.d.sched.kind = AVGPIPE_SCHED_1F1B, s.d.sched.stages = 2, s.d.sched.micro = 4;
    s.d.timeout_s = 5;
    cr_assert_eq(avgpipe_comm_local_create(NULL, 2, &comm), AVGPIPE_OK);
    for (k = 0; k < 2; k++) {
        memset(&p[k], 0, sizeof p[k]);
        p[k].d = s.d;
        p[k].ranks[0] = k;
        p[k].d.local_ranks = p[k].ranks, p[k].d.local_count = 1, p[k].d.comm = &comm;
        p[k].iters = 1;
    }
    memcpy(other_act, s.act, sizeof other_act);
    p[1].d.act_bytes = other_act;
    spoil(&p[1].d);
    for (k = 0; k < 2; k++) cr_assert_eq(pthread_create(&th[k], NULL, proc_main, &p[k]), 0);
    for (k = 0; k < 2; k++) pthread_join(th[k], NULL);
    avgpipe_comm_destroy(&comm);
    for (k = 0; k < 2; k++) {
        cr_assert_eq(p[k].res, AVGPIPE_MISMATCH, "process %d: %s (%s)", k, avgpipe_result_string(p[k].res), p[k].msg);
        cr_assert(strstr(p[k].msg, field) != NULL, "process %d: the message does not name %s: %s", k, field, p[k].msg);
        cr_assert(strstr(p[k].msg, "rank 1") != NULL, "process %d: the message does not name rank 1: %s", k, p[k].msg);
    }
}
static void spoil_micro(avgpipe_run_desc *d) { d->sched.micro = 8; }
static void spoil_alpha(avgpipe_run_desc *d) { d->averaging.alpha = 0.5f; }
static void spoil_act(avgpipe_run_desc *d) { ((size_t *)(void *)d->act_bytes)[0] += 4; }
static void spoil_kind(avgpipe_run_desc *d) { d->sched.kind = AVGPIPE_SCHED_AFAB; }
Test(runtime, processes_disagree_on_micro) { disagree(spoil_micro, "sched.micro = 8, rank 0 has 4"); }
Test(runtime, processes_disagree_on_alpha) { disagree(spoil_alpha, "alpha"); }
Test(runtime, processes_disagree_on_act_bytes) { disagree(spoil_act, "act_bytes"); }
Test(runtime, processes_disagree_on_schedule) { disagree(spoil_kind, "sched.kind"); }

/* A process whose peers never come: create fails at the timeout, naming the silent rank. */
Test(runtime, process_alone_times_out_at_create) {
    avgpipe_comm comm;
    avgpipe_context ctx;
    avgpipe_run *run = NULL;
    avgpipe_result res;
    setup s;
    int me = 1;
    double t0;
    avgpipe_context_init(&ctx, NULL);
    reset_state(2, 4, 1);
    setup_init(&s, 2, 1);
    s.d.sched.kind = AVGPIPE_SCHED_1F1B, s.d.sched.stages = 2, s.d.sched.micro = 4;
    s.d.timeout_s = 0.3;
    cr_assert_eq(avgpipe_comm_local_create(NULL, 2, &comm), AVGPIPE_OK);
    s.d.comm = &comm, s.d.local_ranks = &me, s.d.local_count = 1;
    t0 = now_s();
    res = avgpipe_run_create(&ctx, &s.d, &run);
    cr_assert_eq(res, AVGPIPE_TIMEOUT, "%s: %s", avgpipe_result_string(res), avgpipe_last_error(&ctx));
    cr_assert(run == NULL && now_s() - t0 < 3);
    cr_assert(strstr(avgpipe_last_error(&ctx), "rank 0") != NULL, "%s", avgpipe_last_error(&ctx));
    avgpipe_comm_destroy(&comm);
}

Test(runtime, bad_desc_local_ranks) {
    setup s;
    int twice[2] = {1, 1}, out_of_range = 9;
    bad_base(&s);
    s.d.local_ranks = twice, s.d.local_count = 2;
    expect_invalid(&s, "listed twice");
    s.d.local_ranks = &out_of_range, s.d.local_count = 1;
    expect_invalid(&s, "local_ranks[0]");
    s.d.local_ranks = NULL, s.d.local_count = 1;
    expect_invalid(&s, "local_count");
    s.d.local_ranks = twice, s.d.local_count = 1; /* rank 1 alone, no comm to reach the others */
    expect_invalid(&s, "comm");
}

/* ---- replica groups: two-level averaging against float64 ------------------------------------- */

/* D = 2 groups of N = 2 pipelines, S = 2, MEAN, alpha 0.5, deterministic, every H rounds. */
static void replicas_match_f64(int H, int continuous) {
    static double w[MAXN][MAXG][PMAX], z[MAXD][MAXG][PMAX], loss[64];
    const int S = 2, G = 2, M = 4, N = 2, D = 2, R = 2, ITER = 3;
    avgpipe_context ctx;
    avgpipe_run *run;
    avgpipe_run_stats st;
    setup s;
    char what[96];
    int it, i, g, d;
    avgpipe_context_init(&ctx, NULL);
    reset_state_d(G, M, N, D);
    setup_init_d(&s, G, N, D, S);
    s.d.sched.kind = AVGPIPE_SCHED_1F1B, s.d.sched.stages = S, s.d.sched.micro = M, s.d.sched.pipes = N;
    s.d.sched.rounds = R, s.d.sched.continuous = continuous;
    s.d.average_every = H;
    s.d.averaging.alpha = 0.5f;
    s.d.deterministic = 1;
    run = create_run(&ctx, &s);
    for (it = 0; it < ITER; it++) {
        iterate(&ctx, run, &st);
        cr_assert_eq(st.micro_batches, (long long)D * N * M * R);
    }
    averaging_f64_d(G, M, N, D, H, R * ITER, 0.5, w, z, loss);
    for (i = 0; i < N * D; i++)
        for (g = 0; g < G; g++) {
            snprintf(what, sizeof what, "H = %d: model %d, stage %d", H, i, g);
            expect_close(what, T.w[i][g], w[i][g], pcount(g), 1e-6);
        }
    for (d = 0; d < D; d++)
        for (g = 0; g < G; g++) {
            snprintf(what, sizeof what, "H = %d: reference of group %d, stage %d", H, d, g);
            expect_close(what, avgpipe_run_replica_reference(run, d, g, NULL), z[d][g], pcount(g), 1e-6);
        }
    if ((R * ITER) % H == 0) /* the last round was a replica round: the groups' references are one */
        for (g = 0; g < G; g++)
            cr_assert(memcmp(avgpipe_run_replica_reference(run, 0, g, NULL), avgpipe_run_replica_reference(run, 1, g, NULL),
                             (size_t)pcount(g) * sizeof(float)) == 0, "H = %d: stage %d: the groups' references differ after a replica round", H, g);
    else
        cr_assert(memcmp(avgpipe_run_replica_reference(run, 0, 0, NULL), avgpipe_run_replica_reference(run, 1, 0, NULL),
                         (size_t)pcount(0) * sizeof(float)) != 0, "H = %d: the groups' references agree without a replica round", H);
    avgpipe_run_destroy(run);
}
Test(runtime, replicas_every_round_match_f64) { replicas_match_f64(1, 0); }
Test(runtime, replicas_every_second_round_match_f64) { replicas_match_f64(2, 1); }
Test(runtime, replicas_every_fourth_round_match_f64) { replicas_match_f64(4, 0); }

/* ---- requests left behind by a failure --------------------------------------------------------- */

/* A backend that counts requests: posted, finished (wait or test said so), cancelled. */
typedef struct countcomm {
    avgpipe_comm inner;
    pthread_mutex_t mu;
    long posted, finished, cancelled;
} countcomm;
static void cnt_add(countcomm *c, long *what) {
    pthread_mutex_lock(&c->mu);
    ++*what;
    pthread_mutex_unlock(&c->mu);
}
static avgpipe_result cnt_isend(void *u, int self, int peer, const void *buf, size_t bytes, uint32_t tag, avgpipe_comm_request *req) {
    countcomm *c = (countcomm *)u;
    avgpipe_result r = c->inner.isend(c->inner.user, self, peer, buf, bytes, tag, req);
    if (!r) cnt_add(c, &c->posted);
    return r;
}
static avgpipe_result cnt_irecv(void *u, int self, int peer, void *buf, size_t bytes, uint32_t tag, avgpipe_comm_request *req) {
    countcomm *c = (countcomm *)u;
    avgpipe_result r = c->inner.irecv(c->inner.user, self, peer, buf, bytes, tag, req);
    if (!r) cnt_add(c, &c->posted);
    return r;
}
static avgpipe_result cnt_wait(void *u, int self, avgpipe_comm_request req, double t, avgpipe_comm_status *st) {
    countcomm *c = (countcomm *)u;
    avgpipe_result r = c->inner.wait(c->inner.user, self, req, t, st);
    if (r != AVGPIPE_TIMEOUT && r != AVGPIPE_ABORTED) cnt_add(c, &c->finished);
    return r;
}
static avgpipe_result cnt_test(void *u, int self, avgpipe_comm_request req, int *done, avgpipe_comm_status *st) {
    countcomm *c = (countcomm *)u;
    avgpipe_result r = c->inner.test(c->inner.user, self, req, done, st);
    if (*done) cnt_add(c, &c->finished);
    return r;
}
static void cnt_cancel(void *u, int self, avgpipe_comm_request req) {
    countcomm *c = (countcomm *)u;
    c->inner.cancel(c->inner.user, self, req);
    cnt_add(c, &c->cancelled);
}
static avgpipe_result cnt_barrier(void *u, int self, double t) { return ((countcomm *)u)->inner.barrier(((countcomm *)u)->inner.user, self, t); }
static void cnt_abort(void *u, avgpipe_result why, const char *m) { ((countcomm *)u)->inner.abort(((countcomm *)u)->inner.user, why, m); }

/* A callback fails mid-iteration, leaving receives posted and sends unmatched: after the run is
   destroyed every request it posted was either finished or cancelled (none is left to the backend). */
Test(runtime, failed_run_releases_every_request) {
    avgpipe_context ctx;
    avgpipe_run *run;
    countcomm cc;
    avgpipe_comm table;
    setup s;
    avgpipe_context_init(&ctx, NULL);
    memset(&cc, 0, sizeof cc);
    pthread_mutex_init(&cc.mu, NULL);
    cr_assert_eq(avgpipe_comm_local_create(NULL, 4, &cc.inner), AVGPIPE_OK);
    memset(&table, 0, sizeof table);
    table.name = "counting", table.size = 4, table.user = &cc;
    table.isend = cnt_isend, table.irecv = cnt_irecv, table.wait = cnt_wait, table.test = cnt_test, table.cancel = cnt_cancel;
    table.barrier = cnt_barrier, table.abort = cnt_abort;
    reset_state(4, 8, 1);
    setup_init(&s, 4, 1);
    s.d.sched.kind = AVGPIPE_SCHED_ADVANCE, s.d.sched.stages = 4, s.d.sched.micro = 8, s.d.sched.advance = 3;
    s.d.averaging.alpha = AVGPIPE_ZERO;
    s.d.comm = &table;
    run = create_run(&ctx, &s);
    iterate(&ctx, run, NULL);
    T.fail_stage = 2, T.fail_micro = 5, T.fail_round = 1;
    cr_assert_eq(avgpipe_run_iteration(run, NULL), AVGPIPE_CALLBACK_ERROR, "%s", avgpipe_last_error(&ctx));
    avgpipe_run_destroy(run);
    cr_assert(cc.posted > 0 && cc.cancelled > 0, "posted %ld, cancelled %ld: nothing was left pending?", cc.posted, cc.cancelled);
    cr_assert_eq(cc.posted, cc.finished + cc.cancelled, "posted %ld requests, %ld finished and %ld cancelled: %ld left behind", cc.posted,
                 cc.finished, cc.cancelled, cc.posted - cc.finished - cc.cancelled);
    avgpipe_comm_destroy(&cc.inner);
    pthread_mutex_destroy(&cc.mu);
}

/* ---- profiling -------------------------------------------------------------------------------- */

/* A small recursive-descent JSON checker: returns the position after one value, or NULL. */
static const char *json_ws(const char *p) {
    while (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t') p++;
    return p;
}
static const char *json_value(const char *p, int depth);
static const char *json_string(const char *p) {
    if (*p != '"') return NULL;
    for (p++; *p && *p != '"'; p++) {
        if ((unsigned char)*p < 0x20) return NULL;
        if (*p == '\\') {
            p++;
            if (!*p || !strchr("\"\\/bfnrtu", *p)) return NULL;
        }
    }
    return *p == '"' ? p + 1 : NULL;
}
static const char *json_number(const char *p) {
    const char *q = p;
    if (*q == '-') q++;
    if (!(*q >= '0' && *q <= '9')) return NULL;
    while ((*q >= '0' && *q <= '9') || *q == '.' || *q == 'e' || *q == 'E' || *q == '+' || *q == '-') q++;
    return q;
}
static const char *json_value(const char *p, int depth) {
    p = json_ws(p);
    if (depth > 64) return NULL;
    if (*p == '{' || *p == '[') {
        char close = *p == '{' ? '}' : ']';
        int obj = *p == '{';
        p = json_ws(p + 1);
        if (*p == close) return p + 1;
        for (;;) {
            if (obj) {
                p = json_string(json_ws(p));
                if (!p) return NULL;
                p = json_ws(p);
                if (*p++ != ':') return NULL;
            }
            p = json_value(p, depth + 1);
            if (!p) return NULL;
            p = json_ws(p);
            if (*p == ',') {
                p++;
                continue;
            }
            return *p == close ? p + 1 : NULL;
        }
    }
    if (*p == '"') return json_string(p);
    if (!strncmp(p, "true", 4)) return p + 4;
    if (!strncmp(p, "false", 5)) return p + 5;
    if (!strncmp(p, "null", 4)) return p + 4;
    return json_number(p);
}

static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    long n;
    char *buf;
    cr_assert(f != NULL, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    buf = (char *)malloc((size_t)n + 1);
    cr_assert(buf != NULL);
    cr_assert_eq(fread(buf, 1, (size_t)n, f), (size_t)n);
    buf[n] = 0;
    fclose(f);
    return buf;
}

Test(runtime, profile_events_and_files) {
    avgpipe_context ctx;
    avgpipe_run *run;
    avgpipe_run_stats st;
    const avgpipe_schedule *low;
    const avgpipe_event *ev;
    size_t n, i;
    int r, k, ncompute = 0, nops_lines = 0;
    setup s;
    char prof[256], trace[256], *text, *line;
    const char *end;
    avgpipe_context_init(&ctx, NULL);
    reset_state(3, 4, 1);
    setup_init(&s, 3, 1);
    s.d.sched.kind = AVGPIPE_SCHED_ZBH1;
    s.d.sched.stages = 3;
    s.d.sched.micro = 4;
    s.d.averaging.alpha = AVGPIPE_ZERO;
    s.d.profile = 1;
    use_split(&s, 0);
    run = create_run(&ctx, &s);
    iterate(&ctx, run, &st);
    iterate(&ctx, run, &st); /* events are those of the last iteration */
    ev = avgpipe_run_events(run, &n);
    cr_assert(ev != NULL && n > 0, "no events");
    low = avgpipe_run_schedule(run);
    cr_assert(low != NULL);
    for (i = 0; i < n; i++) {
        cr_assert(ev[i].start <= ev[i].end, "event %zu: start %.9f > end %.9f", i, ev[i].start, ev[i].end);
        cr_assert(ev[i].start >= -1e-6 && ev[i].end <= st.seconds + 1e-3, "event %zu outside the iteration: [%.9f, %.9f] of %.6f s", i,
                  ev[i].start, ev[i].end, st.seconds);
        cr_assert(ev[i].rank >= 0 && ev[i].rank < 3);
    }
    /* every compute op of the schedule has its compute event on its rank */
    for (r = 0; r < low->nranks; r++)
        for (k = 0; k < low->len[r]; k++) {
            const avgpipe_op *op = &low->ops[r][k];
            int found = 0;
            if (op->kind != AVGPIPE_OP_F && op->kind != AVGPIPE_OP_B && op->kind != AVGPIPE_OP_I && op->kind != AVGPIPE_OP_W) continue;
            ncompute++;
            for (i = 0; i < n && !found; i++)
                found = ev[i].track == 0 && ev[i].rank == r && ev[i].op.kind == op->kind && ev[i].op.stage == op->stage &&
                        ev[i].op.micro == op->micro && ev[i].op.pipe == op->pipe;
            cr_assert(found, "no event for rank %d's op %d (kind %s stage %d micro %d)", r, k,
                      avgpipe_op_kind_name((avgpipe_op_kind)op->kind), op->stage, op->micro);
        }
    cr_assert_eq(ncompute, 3 * 4 * 3, "the ZB-H1 schedule has %d compute ops", ncompute);
    /* files */
    snprintf(prof, sizeof prof, "/tmp/avgpipe_test_profile_%ld.txt", (long)getpid());
    snprintf(trace, sizeof trace, "/tmp/avgpipe_test_trace_%ld.json", (long)getpid());
    cr_assert_eq(avgpipe_run_write_profile(run, prof), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    cr_assert_eq(avgpipe_run_write_trace(run, trace), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
    text = slurp(prof);
    cr_assert(!strncmp(text, "# avgpipe profile v1\n", 21), "profile header: %.40s", text);
    cr_assert(strstr(text, "\nshape kind=zbh1 stages=3 ") != NULL, "no shape line");
    {
        char want[64];
        snprintf(want, sizeof want, "\nstage 2 param_floats=%d act_bytes=0 ", pcount(2));
        cr_assert(strstr(text, want) != NULL, "no line '%s' in the profile", want + 1);
        snprintf(want, sizeof want, "\nstage 0 param_floats=%d act_bytes=%zu ", pcount(0), act_bytes_of(0));
        cr_assert(strstr(text, want) != NULL, "no line '%s' in the profile", want + 1);
    }
    for (line = text; (line = strstr(line, "\nop ")) != NULL; line++) nops_lines++;
    cr_assert_eq((size_t)nops_lines, n, "the profile has %d op lines for %zu events", nops_lines, n);
    free(text);
    text = slurp(trace);
    end = json_value(text, 0);
    cr_assert(end != NULL, "the trace is not valid JSON");
    cr_assert(*json_ws(end) == 0, "trailing bytes after the trace's JSON value");
    cr_assert(strstr(text, "\"traceEvents\"") != NULL, "no traceEvents in the trace");
    free(text);
    remove(prof);
    remove(trace);
    avgpipe_run_destroy(run);
}

Test(runtime, no_profile_no_events) {
    avgpipe_context ctx;
    avgpipe_run *run;
    setup s;
    size_t n = 99;
    avgpipe_context_init(&ctx, NULL);
    reset_state(2, 2, 1);
    setup_init(&s, 2, 1);
    s.d.sched.kind = AVGPIPE_SCHED_1F1B;
    s.d.sched.stages = 2;
    s.d.sched.micro = 2;
    s.d.averaging.alpha = AVGPIPE_ZERO;
    run = create_run(&ctx, &s);
    iterate(&ctx, run, NULL);
    cr_assert(avgpipe_run_events(run, &n) == NULL);
    cr_assert_eq(n, 0u);
    cr_assert_eq(avgpipe_run_write_trace(run, "/tmp/avgpipe_never_written.json"), AVGPIPE_STATE_ERROR);
    avgpipe_run_destroy(run);
}

/* ---- adaptive advance ------------------------------------------------------------------------- */

/* Stashed activation bytes of rank r with advance K, by the memory model: peak stashed micro-batches
   (avgpipe_sched_peak_stash) times the bytes one of them holds there, its input and output
   activations. For S = 4, M = 8 the peaks are, by K = 0..3: rank 0 4+K; rank 1 4, 4, 4, 5;
   rank 2 2, 2, 3, 3; rank 3 1. */
static double stash_bytes(int S, int M, int K, int r) {
    avgpipe_sched_desc d;
    memset(&d, 0, sizeof d);
    d.kind = AVGPIPE_SCHED_ADVANCE, d.stages = S, d.micro = M, d.advance = K;
    return (double)avgpipe_sched_peak_stash(&d, r) * (double)((r > 0 ? act_bytes_of(r - 1) : 0) + (r < S - 1 ? act_bytes_of(r) : 0));
}
static double stash_bytes_max(int S, int M, int K) {
    double m = 0;
    int r;
    for (r = 0; r < S; r++) m = stash_bytes(S, M, K, r) > m ? stash_bytes(S, M, K, r) : m;
    return m;
}

/* S = 4, M = 8, every op sleeps 200 us, transfers take 1 ms (advance forward pays off). mem_limit
   is the most bytes K = 2 needs on a rank, so K = 3 does not fit: K must climb from 0 and stop at 2
   or below, and then hold. */
Test(runtime, adaptive_advance_respects_memory_and_settles) {
    avgpipe_context ctx;
    avgpipe_run *run;
    avgpipe_run_stats st;
    avgpipe_comm table;
    delaycomm dc;
    setup s;
    const int S = 4, M = 8, ITER = 14;
    int it, ks[32], maxk = 0, j;
    double limit = stash_bytes_max(S, M, 2);
    avgpipe_context_init(&ctx, NULL);
    cr_assert_eq(delaycomm_init(&dc, S, 1e-3, &table), AVGPIPE_OK);
    reset_state(S, M, 1);
    T.op_sleep_us = 200;
    setup_init(&s, S, 1);
    s.d.sched.kind = AVGPIPE_SCHED_ADVANCE;
    s.d.sched.stages = S;
    s.d.sched.micro = M;
    s.d.averaging.alpha = AVGPIPE_ZERO;
    s.d.adaptive = 1;
    s.d.window = 2;
    cr_assert(stash_bytes_max(S, M, 3) > limit, "the memory model does not separate K = 2 from K = 3");
    s.d.mem_limit = limit;
    s.d.comm = &table;
    run = create_run(&ctx, &s);
    for (it = 0; it < ITER; it++) {
        const avgpipe_schedule *sc = avgpipe_run_schedule(run);
        int kin = sc->shape.advance;
        iterate(&ctx, run, &st);
        ks[it] = st.advance;
        cr_assert_eq(st.advance, kin, "iteration %d reported K = %d but ran a schedule with K = %d", it, st.advance, kin);
        cr_assert(st.advance >= 0 && st.advance <= 2, "iteration %d ran K = %d: over the memory limit (K <= 2 fits)", it, st.advance);
        if (st.advance > maxk) maxk = st.advance;
        if (it > 0)
            cr_assert(ks[it] <= ks[it - 1] + 1, "K jumped from %d to %d", ks[it - 1], ks[it]);
        for (j = 0; j < S; j++) { /* K may have changed: the slots with it */
            T.nslots[j] = avgpipe_run_slots(run, j);
            cr_assert(T.nslots[j] >= 1 && T.nslots[j] <= MAXSLOT);
        }
    }
    cr_assert_eq(ks[0], 0, "the controller must start at K = 0 (1F1B), started at %d", ks[0]);
    for (it = ITER - 4; it < ITER; it++) cr_assert_eq(ks[it], ks[ITER - 1], "K still changing at iteration %d", it);
    cr_log_info("adaptive K by iteration: %d %d %d %d %d %d %d %d %d %d %d %d %d %d (max %d)", ks[0], ks[1], ks[2], ks[3], ks[4],
                ks[5], ks[6], ks[7], ks[8], ks[9], ks[10], ks[11], ks[12], ks[13], maxk);
    avgpipe_run_destroy(run);
    delaycomm_free(&dc);
}
