/* Tests of the validator (DESIGN §3): every generator over a grid of shapes validates (static
   invariants, memory model, and the lockstep replay under asynchronous and blocking sends), bad
   shapes are refused with a message naming the field, hand-broken schedules are rejected with the
   right message and position, and PyTorch's golden schedule validates, lowers and simulates.

   Build and run from the repository root:
     gcc -std=c11 -O2 -Wall -Wextra -pedantic -Werror -I. tests/test_validate.c -o /tmp/test_validate \
         -lcriterion -lm && /tmp/test_validate
   AVGPIPE_GOLDEN_DIR overrides the golden directory (default tests/data). */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"

#include <criterion/criterion.h>
#include "tests/sched_helpers.h"
#include "tests/ref_validator.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- helpers --------------------------------------------------------------------------------- */

static void import_text(const char *text, avgpipe_schedule *s) {
    avgpipe_result r = avgpipe_sched_import(NULL, text, strlen(text), s);
    cr_assert_eq(r, AVGPIPE_OK, "import: %s (%s)\n%s", avgpipe_result_string(r), avgpipe_last_error(NULL), text);
}

/* A copy of s whose rank r holds ops[0..n) instead of its own list. */
static void with_rank(const avgpipe_schedule *s, int r, const avgpipe_op *ops, int n, avgpipe_schedule *out) {
    int q, i;
    cr_assert_eq(avgpipe_sched_init(NULL, out, s->nranks, &s->shape), AVGPIPE_OK);
    for (q = 0; q < s->nranks; q++) {
        const avgpipe_op *src = q == r ? ops : s->ops[q];
        int len = q == r ? n : s->len[q];
        for (i = 0; i < len; i++) cr_assert_eq(avgpipe_sched_push(NULL, out, q, src[i]), AVGPIPE_OK);
    }
    out->nstages = s->nstages;
    out->has_comm = s->has_comm;
}

/* Position of the op (kind, stage, micro) of pipeline 0 on rank r, or fail. */
static int find_op(const avgpipe_schedule *s, int r, int kind, int stage, int micro) {
    int i;
    for (i = 0; i < s->len[r]; i++)
        if (s->ops[r][i].kind == kind && s->ops[r][i].stage == stage && s->ops[r][i].micro == micro && s->ops[r][i].pipe == 0) return i;
    cr_assert_fail("op %s stage %d micro %d not found on rank %d", avgpipe_op_kind_name((avgpipe_op_kind)kind), stage, micro, r);
    return -1;
}

static void swap_ops(avgpipe_op *o, int a, int b) {
    avgpipe_op t = o[a];
    o[a] = o[b];
    o[b] = t;
}

/* Copy rank r's list into buf (which must hold it). */
static int copy_rank(const avgpipe_schedule *s, int r, avgpipe_op *buf, int cap) {
    cr_assert_leq(s->len[r], cap);
    memcpy(buf, s->ops[r], (size_t)s->len[r] * sizeof *buf);
    return s->len[r];
}

/* The reference validator (tests/ref_validator.h, the one that lowered the schedule for its replay)
   gives the same verdict and points at the same op; tests/test_validate_ref.c compares the two at
   length. */
static void expect_same_as_reference(const avgpipe_schedule *s, const avgpipe_validate_report *rep) {
    avgpipe_validate_report ref;
    avgpipe_result r = ref_validate(NULL, s, NULL, &ref);
    cr_assert_eq(r, rep->result, "reference: %s (%s), fast: %s", avgpipe_result_string(r), ref.message, rep->message);
    cr_assert_eq(ref.rank, rep->rank, "reference rank %d, fast %d (%s)", ref.rank, rep->rank, rep->message);
    cr_assert_eq(ref.pos, rep->pos, "reference position %d, fast %d (%s)", ref.pos, rep->pos, rep->message);
    if (r != AVGPIPE_DEADLOCK) cr_assert_str_eq(ref.message, rep->message);
}

/* The schedule must fail validation with `res`, a message containing `needle`, and (when rank >= 0)
   the report pointing at (rank, pos), whose op the grid marks as ">op<". */
static void expect_broken(const avgpipe_schedule *s, avgpipe_result res, const char *needle, int rank, int pos) {
    avgpipe_validate_report rep;
    avgpipe_result got;
    got = avgpipe_sched_validate(NULL, s, NULL, &rep);
    expect_same_as_reference(s, &rep);
    got = avgpipe_sched_validate(NULL, s, NULL, &rep); /* again: the reference changed the last error */
    cr_assert_eq(got, res, "validate returned %s (expected %s): %s", avgpipe_result_string(got), avgpipe_result_string(res),
                 rep.message);
    cr_assert_eq(rep.result, res, "report.result %d", rep.result);
    cr_assert_not_null(strstr(rep.message, needle), "message '%s' lacks '%s'", rep.message, needle);
    cr_assert_not_null(strstr(avgpipe_last_error(NULL), needle), "last error '%s' lacks '%s'", avgpipe_last_error(NULL), needle);
    cr_assert_eq(avgpipe_last_result(NULL), res, "last result %d", avgpipe_last_result(NULL));
    if (rank == -2) return; /* position checked by the caller */
    cr_assert_eq(rep.rank, rank, "report.rank %d, expected %d (%s)", rep.rank, rank, rep.message);
    cr_assert_eq(rep.pos, pos, "report.pos %d, expected %d (%s)", rep.pos, pos, rep.message);
    if (pos >= 0) {
        char want[80];
        avgpipe_buf grid = {NULL, 0, 0};
        avgpipe_op_format(&s->ops[rank][pos], 0, want + 1, sizeof want - 2);
        cr_assert_str_eq(rep.op_text, want + 1, "report.op_text '%s', expected '%s'", rep.op_text, want + 1);
        want[0] = '>';
        strcat(want, "<");
        cr_assert_eq(avgpipe_sched_render_grid(NULL, s, rep.rank, rep.pos, &grid), AVGPIPE_OK);
        cr_assert_not_null(strstr(grid.data, want), "grid does not mark %s:\n%s", want, grid.data);
        cr_assert_null(strchr(strstr(grid.data, want) + 1, '>'), "grid marks more than one op:\n%s", grid.data);
        avgpipe_buf_free(NULL, &grid);
    }
}

/* ---- every generator over a grid ------------------------------------------------------------- */

static const int grid_M[] = {1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32};
#define GRID_NM ((int)(sizeof grid_M / sizeof grid_M[0]))

/* Generate, validate (static + memory model + blocking/async replay), lower, validate the lowered
   schedule too. Counts what was checked. */
static void validate_shape(const avgpipe_sched_desc *d, int lower, long *count) {
    avgpipe_schedule s, low;
    avgpipe_validate_report rep;
    gen(d, &s);
    cr_assert_eq(avgpipe_sched_validate(NULL, &s, NULL, &rep), AVGPIPE_OK, "%s: %s", shape_str(d), rep.message);
    cr_assert_eq(rep.rank, -1);
    if (lower) {
        cr_assert_eq(avgpipe_sched_lower(NULL, &s, &low), AVGPIPE_OK, "%s: lower: %s", shape_str(d), avgpipe_last_error(NULL));
        cr_assert_eq(low.has_comm, d->stages > 1, "%s lowered: has_comm %d", shape_str(d), low.has_comm); /* one rank sends nothing */
        cr_assert_eq(avgpipe_sched_validate(NULL, &low, NULL, &rep), AVGPIPE_OK, "%s lowered: %s", shape_str(d), rep.message);
        avgpipe_sched_free(NULL, &low);
    }
    avgpipe_sched_free(NULL, &s);
    (*count)++;
}

/* kind over S 1..8, M sampled up to 32, N 1..4, V 1..3, R 1..2, both round modes (K 0..M for
   advance). V > 1 only for interleaved (with M % S == 0); other kinds must refuse it. */
static void validate_grid(avgpipe_sched_kind kind, int kmin, int kmax_is_m, int lower_every) {
    long count = 0, refused = 0;
    int S, mi, N, V, R, cont, K;
    for (S = 1; S <= 8; S++)
        for (mi = 0; mi < GRID_NM; mi++)
            for (N = 1; N <= 4; N++)
                for (V = 1; V <= 3; V++)
                    for (R = 1; R <= 2; R++)
                        for (cont = 0; cont < 2; cont++)
                            for (K = kmin; K <= (kmax_is_m ? grid_M[mi] : kmin); K++) {
                                int M = grid_M[mi];
                                avgpipe_sched_desc d = desc_of(kind, S, M, N, V, R, K, cont);
                                if (V > 1 && (kind != AVGPIPE_SCHED_INTERLEAVED || M % S != 0)) {
                                    avgpipe_schedule s;
                                    const char *field = kind != AVGPIPE_SCHED_INTERLEAVED ? "chunks" : "micro";
                                    cr_assert_eq(avgpipe_sched_generate(NULL, &d, &s), AVGPIPE_INVALID_ARG, "%s accepted", shape_str(&d));
                                    cr_assert_not_null(strstr(avgpipe_last_error(NULL), field), "%s: message '%s' lacks '%s'",
                                                       shape_str(&d), avgpipe_last_error(NULL), field);
                                    refused++;
                                    continue;
                                }
                                validate_shape(&d, lower_every > 0 && (count % lower_every) == 0, &count);
                            }
    cr_assert_gt(count, 100, "only %ld shapes", count);
    if (kind != AVGPIPE_SCHED_INTERLEAVED) cr_assert_gt(refused, 0);
}

Test(grid, afab) { validate_grid(AVGPIPE_SCHED_AFAB, 0, 0, 1); }
Test(grid, one_f_one_b) { validate_grid(AVGPIPE_SCHED_1F1B, 0, 0, 1); }
Test(grid, advance) { validate_grid(AVGPIPE_SCHED_ADVANCE, 0, 1, 3); }
Test(grid, interleaved) { validate_grid(AVGPIPE_SCHED_INTERLEAVED, 0, 0, 1); }
Test(grid, zbh1) { validate_grid(AVGPIPE_SCHED_ZBH1, 0, 0, 1); }

Test(grid, greedy) {
    static const avgpipe_op_kind prios[3][3] = {{0, 0, 0}, {AVGPIPE_OP_F, AVGPIPE_OP_B, 0}, {AVGPIPE_OP_I, AVGPIPE_OP_W, AVGPIPE_OP_F}};
    int S, M, N, R, cont, split, p;
    for (S = 1; S <= 6; S++)
        for (M = 1; M <= 8; M++)
            for (N = 1; N <= 3; N++)
                for (R = 1; R <= 2; R++)
                    for (cont = 0; cont < 2; cont++)
                        for (split = 0; split < 2; split++)
                            for (p = 0; p < 3; p++) {
                                avgpipe_greedy_desc g;
                                avgpipe_schedule s;
                                avgpipe_validate_report rep;
                                memset(&g, 0, sizeof g);
                                g.shape.stages = S, g.shape.micro = M, g.shape.pipes = N, g.shape.rounds = R, g.shape.continuous = cont, g.split_backward = split;
                                memcpy(g.priority, prios[p], sizeof g.priority);
                                cr_assert_eq(avgpipe_sched_greedy(NULL, &g, &s), AVGPIPE_OK, "greedy: %s", avgpipe_last_error(NULL));
                                cr_assert_eq(avgpipe_sched_validate(NULL, &s, NULL, &rep), AVGPIPE_OK,
                                             "greedy S=%d M=%d N=%d R=%d cont=%d split=%d prio %d: %s", S, M, N, R, cont, split, p,
                                             rep.message);
                                avgpipe_sched_free(NULL, &s);
                            }
}

/* ---- bad shapes ----------------------------------------------------------------------------------- */

typedef struct bad_shape {
    int S, M, N, V, R, K;
    const char *field;
} bad_shape;

Test(shapes, invalid_are_refused_naming_the_field) {
    static const bad_shape bad[] = {
        {0, 4, 1, 1, 1, 0, "stages"},  {-2, 4, 1, 1, 1, 0, "stages"}, {4, 0, 1, 1, 1, 0, "micro"},  {4, -1, 1, 1, 1, 0, "micro"},
        {4, 4, -1, 1, 1, 0, "pipes"},  {4, 4, 1, -1, 1, 0, "chunks"}, {4, 4, 1, 1, -1, 0, "rounds"}, {4, 4, 1, 1, 1, -1, "advance"},
        {4, 4, -5, 1, 1, 0, "pipes"},  {4, 4, 1, 1, -3, 0, "rounds"}, {4, 4, 1, 1, 1, -7, "advance"},
    };
    int kind;
    size_t i;
    for (kind = AVGPIPE_SCHED_AFAB; kind < AVGPIPE_SCHED_KIND_COUNT; kind++)
        for (i = 0; i < sizeof bad / sizeof bad[0]; i++) {
            avgpipe_sched_desc d = desc_of((avgpipe_sched_kind)kind, bad[i].S, bad[i].M, bad[i].N, bad[i].V, bad[i].R, bad[i].K, 0);
            avgpipe_sched_desc out;
            avgpipe_schedule s;
            avgpipe_result r;
            avgpipe_clear_error(NULL);
            r = avgpipe_sched_generate(NULL, &d, &s);
            cr_assert_eq(r, AVGPIPE_INVALID_ARG, "%s: %s", shape_str(&d), avgpipe_result_string(r));
            cr_assert_not_null(strstr(avgpipe_last_error(NULL), bad[i].field), "%s: message '%s' lacks '%s'", shape_str(&d),
                               avgpipe_last_error(NULL), bad[i].field);
            cr_assert_eq(avgpipe_last_result(NULL), AVGPIPE_INVALID_ARG);
            avgpipe_sched_free(NULL, &s); /* harmless on a refused schedule */
            cr_assert_eq(avgpipe_sched_resolve(NULL, &d, &out), AVGPIPE_INVALID_ARG, "%s: resolve accepted", shape_str(&d));
            cr_assert_eq(avgpipe_sched_warmup(&d, 0), -1);
            cr_assert_eq(avgpipe_sched_peak_stash(&d, 0), -1);
        }
}

Test(shapes, interleaved_needs_micro_multiple_of_stages) {
    int S, M, V;
    for (S = 2; S <= 8; S++)
        for (M = 1; M <= 3 * S; M++)
            for (V = 2; V <= 3; V++) {
                avgpipe_sched_desc d = desc_of(AVGPIPE_SCHED_INTERLEAVED, S, M, 1, V, 1, 0, 0);
                avgpipe_schedule s;
                avgpipe_result r = avgpipe_sched_generate(NULL, &d, &s);
                if (M % S == 0) {
                    cr_assert_eq(r, AVGPIPE_OK, "%s: %s", shape_str(&d), avgpipe_last_error(NULL));
                    avgpipe_sched_free(NULL, &s);
                } else {
                    cr_assert_eq(r, AVGPIPE_INVALID_ARG, "%s accepted", shape_str(&d));
                    cr_assert_not_null(strstr(avgpipe_last_error(NULL), "micro"), "message '%s'", avgpipe_last_error(NULL));
                }
            }
}

/* Chunks: any V for interleaved, exactly two for the V-placed kinds, one for the others. */
Test(shapes, chunks_only_for_interleaved) {
    int kind;
    for (kind = AVGPIPE_SCHED_AFAB; kind < AVGPIPE_SCHED_KIND_COUNT; kind++) {
        int vkind = kind == AVGPIPE_SCHED_ZBV || kind == AVGPIPE_SCHED_DUALPIPEV;
        avgpipe_sched_desc d = desc_of((avgpipe_sched_kind)kind, 4, 8, 1, vkind ? 3 : 2, 1, 1, 0);
        avgpipe_schedule s;
        avgpipe_result r = avgpipe_sched_generate(NULL, &d, &s);
        if (kind == AVGPIPE_SCHED_INTERLEAVED) {
            cr_assert_eq(r, AVGPIPE_OK);
            cr_assert_eq(s.nstages, 8);
            avgpipe_sched_free(NULL, &s);
        } else {
            cr_assert_eq(r, AVGPIPE_INVALID_ARG, "%s accepted V=%d", avgpipe_sched_kind_name((avgpipe_sched_kind)kind), d.chunks);
            cr_assert_not_null(strstr(avgpipe_last_error(NULL), "chunks"), "message '%s'", avgpipe_last_error(NULL));
        }
    }
}

Test(shapes, bad_kind_and_context_error_buffer) {
    avgpipe_sched_desc d = desc_of(AVGPIPE_SCHED_CUSTOM, 4, 8, 1, 1, 1, 0, 0);
    avgpipe_context ctx;
    avgpipe_schedule s;
    cr_assert_eq(avgpipe_context_init(&ctx, NULL), AVGPIPE_OK);
    avgpipe_clear_error(NULL);
    cr_assert_eq(avgpipe_sched_generate(&ctx, &d, &s), AVGPIPE_INVALID_ARG);
    cr_assert_not_null(strstr(avgpipe_last_error(&ctx), "kind"), "message '%s'", avgpipe_last_error(&ctx));
    cr_assert_str_eq(avgpipe_last_error(NULL), "", "an error on ctx leaked into the thread's buffer: '%s'", avgpipe_last_error(NULL));
    d.kind = (avgpipe_sched_kind)42;
    cr_assert_eq(avgpipe_sched_generate(&ctx, &d, &s), AVGPIPE_INVALID_ARG);
    d.kind = AVGPIPE_SCHED_1F1B;
    d.continuous = 2;
    cr_assert_eq(avgpipe_sched_generate(&ctx, &d, &s), AVGPIPE_INVALID_ARG);
    cr_assert_not_null(strstr(avgpipe_last_error(&ctx), "continuous"), "message '%s'", avgpipe_last_error(&ctx));
    avgpipe_clear_error(&ctx);
    cr_assert_str_eq(avgpipe_last_error(&ctx), "");
    cr_assert_eq(avgpipe_last_result(&ctx), AVGPIPE_OK);
}

/* Zero fields resolve to the documented defaults. */
Test(shapes, resolve_defaults) {
    avgpipe_sched_desc d = desc_of(AVGPIPE_SCHED_INTERLEAVED, 4, 8, 0, 0, 0, 3, 0), out;
    cr_assert_eq(avgpipe_sched_resolve(NULL, &d, &out), AVGPIPE_OK);
    cr_assert_eq(out.pipes, 1);
    cr_assert_eq(out.chunks, 2, "interleaved chunks 0 -> 2, got %d", out.chunks);
    cr_assert_eq(out.rounds, 1);
    cr_assert_eq(out.advance, 0, "advance is only for the advance kind, got %d", out.advance);
    d.kind = AVGPIPE_SCHED_ADVANCE;
    cr_assert_eq(avgpipe_sched_resolve(NULL, &d, &out), AVGPIPE_OK);
    cr_assert_eq(out.chunks, 1);
    cr_assert_eq(out.advance, 3);
}

/* ---- hand-broken schedules -------------------------------------------------------------------- */

static avgpipe_op buf[256];

Test(broken, missing_forward) {
    avgpipe_schedule s;
    /* stage 1 never runs micro-batch 1 (no STEP ops, so completeness is what catches it) */
    import_text("0F0,0F1,0B0,0B1\n1F0,1B0\n", &s);
    expect_broken(&s, AVGPIPE_INVALID_SCHEDULE, "missing forward", 1, -1);
    cr_assert_not_null(strstr(avgpipe_last_error(NULL), "micro-batch 1"), "%s", avgpipe_last_error(NULL));
    avgpipe_sched_free(NULL, &s);
}

Test(broken, backward_before_forward) {
    avgpipe_sched_desc d = desc_of(AVGPIPE_SCHED_1F1B, 2, 2, 1, 1, 1, 0, 0);
    avgpipe_schedule s, b;
    int n, f, bw;
    gen(&d, &s);
    n = copy_rank(&s, 1, buf, 256);
    f = find_op(&s, 1, AVGPIPE_OP_F, 1, 0);
    bw = find_op(&s, 1, AVGPIPE_OP_B, 1, 0);
    swap_ops(buf, f, bw);
    with_rank(&s, 1, buf, n, &b);
    expect_broken(&b, AVGPIPE_INVALID_SCHEDULE, "backward before its forward", 1, f);
    avgpipe_sched_free(NULL, &b);
    avgpipe_sched_free(NULL, &s);
}

Test(broken, duplicate_forward) {
    avgpipe_sched_desc d = desc_of(AVGPIPE_SCHED_1F1B, 2, 2, 1, 1, 1, 0, 0);
    avgpipe_schedule s, b;
    int n, f;
    gen(&d, &s);
    n = copy_rank(&s, 0, buf, 255);
    f = find_op(&s, 0, AVGPIPE_OP_F, 0, 0);
    memmove(buf + f + 1, buf + f, (size_t)(n - f) * sizeof *buf); /* F0 twice */
    with_rank(&s, 0, buf, n + 1, &b);
    expect_broken(&b, AVGPIPE_INVALID_SCHEDULE, "duplicate forward", 0, f + 1);
    avgpipe_sched_free(NULL, &b);
    avgpipe_sched_free(NULL, &s);
}

Test(broken, w_before_i) {
    avgpipe_sched_desc d = desc_of(AVGPIPE_SCHED_ZBH1, 2, 2, 1, 1, 1, 0, 0);
    avgpipe_schedule s, b;
    int n, i, w;
    gen(&d, &s);
    n = copy_rank(&s, 0, buf, 256);
    i = find_op(&s, 0, AVGPIPE_OP_I, 0, 0);
    w = find_op(&s, 0, AVGPIPE_OP_W, 0, 0);
    cr_assert_lt(i, w);
    swap_ops(buf, i, w);
    with_rank(&s, 0, buf, n, &b);
    expect_broken(&b, AVGPIPE_INVALID_SCHEDULE, "W before its I", 0, i);
    avgpipe_sched_free(NULL, &b);
    avgpipe_sched_free(NULL, &s);
}

Test(broken, step_before_backward) {
    avgpipe_sched_desc d = desc_of(AVGPIPE_SCHED_1F1B, 2, 2, 1, 1, 1, 0, 0);
    avgpipe_schedule s, b;
    int n, st, last;
    gen(&d, &s);
    n = copy_rank(&s, 0, buf, 256);
    st = find_op(&s, 0, AVGPIPE_OP_STEP, 0, 0);
    last = find_op(&s, 0, AVGPIPE_OP_B, 0, 1);
    cr_assert_eq(last, st - 1, "STEP is not right after the last backward");
    swap_ops(buf, last, st);
    with_rank(&s, 0, buf, n, &b);
    expect_broken(&b, AVGPIPE_INVALID_SCHEDULE, "STEP before the backward", 0, last);
    avgpipe_sched_free(NULL, &b);
    avgpipe_sched_free(NULL, &s);
}

Test(broken, avg_before_step) {
    avgpipe_sched_desc d = desc_of(AVGPIPE_SCHED_AFAB, 3, 2, 1, 1, 1, 0, 0);
    avgpipe_schedule s, b;
    int n, st, av;
    gen(&d, &s);
    n = copy_rank(&s, 1, buf, 256);
    st = find_op(&s, 1, AVGPIPE_OP_STEP, 1, 0);
    av = find_op(&s, 1, AVGPIPE_OP_AVG, 1, 0);
    swap_ops(buf, st, av);
    with_rank(&s, 1, buf, n, &b);
    expect_broken(&b, AVGPIPE_INVALID_SCHEDULE, "AVG before its STEP", 1, st);
    avgpipe_sched_free(NULL, &b);
    avgpipe_sched_free(NULL, &s);
}

/* Lower a valid AFAB schedule; bring rank 0's two SEND_F next to each other (still valid: each
   channel keeps its order), then swap them: the channel 0 -> 1 now carries micro-batch 1 first
   while rank 1 receives micro-batch 0 first. */
Test(broken, mismatched_send_receive_order) {
    avgpipe_sched_desc d = desc_of(AVGPIPE_SCHED_AFAB, 2, 2, 1, 1, 1, 0, 0);
    avgpipe_schedule s, low, moved, bad;
    avgpipe_validate_report rep;
    int n, s0, s1, f1, r0;
    gen(&d, &s);
    cr_assert_eq(avgpipe_sched_lower(NULL, &s, &low), AVGPIPE_OK);
    n = copy_rank(&low, 0, buf, 256);
    s0 = find_op(&low, 0, AVGPIPE_OP_SEND_F, 0, 0);
    s1 = find_op(&low, 0, AVGPIPE_OP_SEND_F, 0, 1);
    f1 = find_op(&low, 0, AVGPIPE_OP_F, 0, 1);
    cr_assert(s0 < f1 && f1 < s1, "unexpected lowering: SEND_F0 %d, F1 %d, SEND_F1 %d", s0, f1, s1);
    {
        avgpipe_op x = buf[s0];
        memmove(buf + s0, buf + s0 + 1, (size_t)(s1 - 1 - s0) * sizeof *buf);
        buf[s1 - 1] = x; /* ... F1 ... SEND_F0, SEND_F1 */
    }
    with_rank(&low, 0, buf, n, &moved);
    cr_assert_eq(avgpipe_sched_validate(NULL, &moved, NULL, &rep), AVGPIPE_OK, "moving SEND_F0 next to SEND_F1: %s", rep.message);
    swap_ops(buf, s1 - 1, s1);
    with_rank(&low, 0, buf, n, &bad);
    expect_broken(&bad, AVGPIPE_INVALID_SCHEDULE, "mismatched send/receive order", -2, -2);
    cr_assert_eq(avgpipe_sched_validate(NULL, &bad, NULL, &rep), AVGPIPE_INVALID_SCHEDULE);
    /* the report names one end of the first mismatched message: rank 1's first receive, or the
       send now first on the channel */
    r0 = find_op(&bad, 1, AVGPIPE_OP_RECV_F, 1, 0);
    cr_assert((rep.rank == 1 && rep.pos == r0) || (rep.rank == 0 && rep.pos == s1 - 1),
              "report points at rank %d position %d (%s); expected rank 1 position %d or rank 0 position %d", rep.rank, rep.pos,
              rep.op_text, r0, s1 - 1);
    avgpipe_sched_free(NULL, &bad);
    avgpipe_sched_free(NULL, &moved);
    avgpipe_sched_free(NULL, &low);
    avgpipe_sched_free(NULL, &s);
}

/* Each rank waits first for data the other produces later: rank 0 runs B0 (needs rank 1's gradient)
   before it sends F0's activation (which rank 1 needs for F0, hence B0). Every static invariant
   holds; only the replay can see it. */
static const char circular_async[] = "0F0,0RECV_B0,0B0,0SEND_F0\n1RECV_F0,1F0,1B0,1SEND_B0\n";
/* Fine with asynchronous sends, stuck with blocking ones: rank 0 blocks sending F1 while rank 1
   blocks sending its gradient B0, each before posting the receive the other needs. */
static const char circular_blocking[] =
    "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1\n";
/* Compute-only: rank 1 wants F1 first, which rank 0 runs after B0, which needs rank 1's B0. */
static const char circular_compute[] = "0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n";

Test(broken, deadlock_circular_wait) {
    avgpipe_schedule s;
    avgpipe_validate_desc skip;
    avgpipe_validate_report rep;
    avgpipe_sim_desc sd;
    avgpipe_sim_result res;
    import_text(circular_async, &s);
    expect_broken(&s, AVGPIPE_DEADLOCK, "deadlock", -2, -2);
    cr_assert_not_null(strstr(avgpipe_last_error(NULL), "async"), "%s", avgpipe_last_error(NULL));
    memset(&skip, 0, sizeof skip);
    skip.skip_replay = 1;
    cr_assert_eq(avgpipe_sched_validate(NULL, &s, &skip, &rep), AVGPIPE_OK, "the static checks alone pass: %s", rep.message);
    memset(&sd, 0, sizeof sd);
    cr_assert_eq(avgpipe_sim_run(NULL, &s, &sd, &res), AVGPIPE_DEADLOCK);
    cr_assert_not_null(strstr(avgpipe_last_error(NULL), "rank 0 waits at position 2 (0B0)"), "%s", avgpipe_last_error(NULL));
    cr_assert_not_null(strstr(avgpipe_last_error(NULL), "rank 1 waits at position 1 (1F0)"), "%s", avgpipe_last_error(NULL));
    avgpipe_sched_free(NULL, &s);

    import_text(circular_compute, &s);
    expect_broken(&s, AVGPIPE_DEADLOCK, "deadlock", -2, -2);
    avgpipe_sched_free(NULL, &s);
}

Test(broken, deadlock_blocking_only) {
    avgpipe_schedule s;
    avgpipe_sim_desc sd;
    avgpipe_sim_result res;
    import_text(circular_blocking, &s);
    memset(&sd, 0, sizeof sd);
    cr_assert_eq(avgpipe_sim_run(NULL, &s, &sd, &res), AVGPIPE_OK, "async: %s", avgpipe_last_error(NULL));
    avgpipe_sim_result_free(NULL, &res);
    sd.blocking_send = 1;
    cr_assert_eq(avgpipe_sim_run(NULL, &s, &sd, &res), AVGPIPE_DEADLOCK, "blocking sends should deadlock");
    expect_broken(&s, AVGPIPE_DEADLOCK, "deadlock", -2, -2);
    cr_assert_not_null(strstr(avgpipe_last_error(NULL), "blocking"), "%s", avgpipe_last_error(NULL));
    avgpipe_sched_free(NULL, &s);
}

/* The issue asks that report.rank / report.pos point at the offending op for every broken schedule;
   for a deadlock that is an op a stuck rank waits at (positions in the schedule's own list). */
static void expect_deadlock_points_at(const char *text, const int (*stuck)[2], int nstuck) {
    avgpipe_schedule s;
    avgpipe_validate_report rep;
    int i, ok = 0;
    import_text(text, &s);
    cr_assert_eq(avgpipe_sched_validate(NULL, &s, NULL, &rep), AVGPIPE_DEADLOCK, "%s", rep.message);
    expect_same_as_reference(&s, &rep);
    for (i = 0; i < nstuck; i++) ok |= rep.rank == stuck[i][0] && rep.pos == stuck[i][1];
    cr_assert(ok, "deadlock report points at rank %d position %d ('%s'), not at a stuck op (e.g. rank %d position %d); message: %s",
              rep.rank, rep.pos, rep.op_text, stuck[0][0], stuck[0][1], rep.message);
    {
        char want[80];
        avgpipe_buf grid = {NULL, 0, 0};
        snprintf(want, sizeof want, ">%s<", rep.op_text);
        cr_assert_eq(avgpipe_sched_render_grid(NULL, &s, rep.rank, rep.pos, &grid), AVGPIPE_OK);
        cr_assert_not_null(strstr(grid.data, want), "grid does not mark %s", want);
        avgpipe_buf_free(NULL, &grid);
    }
    avgpipe_sched_free(NULL, &s);
}

Test(broken, deadlock_report_points_at_stuck_op) {
    static const int async_stuck[2][2] = {{0, 2}, {1, 1}};    /* 0B0, 1F0 */
    static const int block_stuck[2][2] = {{0, 3}, {1, 3}};    /* 0SEND_F1, 1SEND_B0 */
    static const int compute_stuck[2][2] = {{0, 1}, {1, 0}}; /* 0B0, 1F1 */
    expect_deadlock_points_at(circular_async, async_stuck, 2);
    expect_deadlock_points_at(circular_blocking, block_stuck, 2);
    expect_deadlock_points_at(circular_compute, compute_stuck, 2);
}

/* ---- the golden PyTorch schedule --------------------------------------------------------------- */

static void golden_path(char *out, size_t cap) {
    const char *dir = getenv("AVGPIPE_GOLDEN_DIR");
    snprintf(out, cap, "%s/torch_zb1p_2rank_2stagep_compute.csv", dir && *dir ? dir : "tests/data");
}

/* PyTorch's ZB schedule: 2 ranks, 4 stages in a loop, 8 micro-batches, I/W split. */
Test(golden, imports_validates_lowers_and_simulates) {
    char path[1024];
    avgpipe_schedule s, low;
    avgpipe_validate_report rep;
    avgpipe_sim_desc sd;
    avgpipe_sim_result ra, rb, rl;
    int r;
    golden_path(path, sizeof path);
    cr_assert_eq(avgpipe_sched_load(NULL, path, &s), AVGPIPE_OK, "load %s: %s", path, avgpipe_last_error(NULL));
    cr_assert_eq(s.nranks, 2);
    cr_assert_eq(s.nstages, 4);
    cr_assert_eq(s.shape.kind, AVGPIPE_SCHED_CUSTOM);
    cr_assert_eq(s.shape.chunks, 2);
    cr_assert_eq(s.shape.micro, 8);
    cr_assert_eq(s.shape.pipes, 1);
    cr_assert_eq(s.shape.rounds, 1);
    cr_assert_eq(s.has_comm, 0);
    cr_assert_eq(s.len[0], 49, "rank 0 has %d slots (48 actions and one idle slot)", s.len[0]);
    cr_assert_eq(s.len[1], 49);
    cr_assert_eq(s.ops[1][0].kind, AVGPIPE_OP_IDLE, "rank 1 starts with an idle slot");
    cr_assert_eq(avgpipe_sched_validate(NULL, &s, NULL, &rep), AVGPIPE_OK, "golden: %s", rep.message);
    /* rank 0 runs 0F0 0F1 2F0 2F1 before its first W; rank 1 reaches 4 as well (1F0 1F1 3F0 ... ) */
    cr_assert_eq(rep.peak_stash[0], 4, "rank 0 peak %d", rep.peak_stash[0]);
    cr_assert_eq(rep.peak_stash[1], 4, "rank 1 peak %d", rep.peak_stash[1]);

    cr_assert_eq(avgpipe_sched_lower(NULL, &s, &low), AVGPIPE_OK, "lower: %s", avgpipe_last_error(NULL));
    cr_assert_eq(low.has_comm, 1);
    for (r = 0; r < 2; r++) { /* 48 compute ops per rank, 16 sends and 16 receives (8 per kind and boundary) */
        int i, nc = 0, ns = 0, nr = 0;
        for (i = 0; i < low.len[r]; i++) {
            int k = low.ops[r][i].kind;
            nc += k == AVGPIPE_OP_F || k == AVGPIPE_OP_I || k == AVGPIPE_OP_W;
            ns += k == AVGPIPE_OP_SEND_F || k == AVGPIPE_OP_SEND_B;
            nr += k == AVGPIPE_OP_RECV_F || k == AVGPIPE_OP_RECV_B;
            cr_assert_neq(k, AVGPIPE_OP_IDLE, "lowering keeps an idle slot");
        }
        cr_assert_eq(nc, 48, "rank %d: %d compute ops", r, nc);
        /* rank 0: 0F->1 (8), 2F->3 (8), 2I->1 (8); rank 1: 1F->2 (8), 1I->0 (8), 3I->2 (8) */
        cr_assert_eq(ns, 24, "rank %d: %d sends", r, ns);
        cr_assert_eq(nr, 24, "rank %d: %d receives", r, nr);
    }
    cr_assert_eq(avgpipe_sched_validate(NULL, &low, NULL, &rep), AVGPIPE_OK, "lowered golden: %s", rep.message);

    memset(&sd, 0, sizeof sd);
    sd.latency = 1;
    cr_assert_eq(avgpipe_sim_run(NULL, &s, &sd, &ra), AVGPIPE_OK, "async: %s", avgpipe_last_error(NULL));
    cr_assert_eq(avgpipe_sim_run(NULL, &low, &sd, &rl), AVGPIPE_OK, "lowered async: %s", avgpipe_last_error(NULL));
    sd.blocking_send = 1;
    cr_assert_eq(avgpipe_sim_run(NULL, &s, &sd, &rb), AVGPIPE_OK, "blocking: %s", avgpipe_last_error(NULL));
    cr_assert_eq(ra.ops, 96 + 2, "async ran %lld ops", ra.ops); /* 96 compute ops + the 2 idle slots */
    cr_assert_eq(ra.transfers, 48, "async made %lld transfers", ra.transfers);
    cr_assert_eq(rl.transfers, 48, "lowered async made %lld transfers", rl.transfers);
    cr_assert_eq(rb.transfers, 48, "blocking made %lld transfers", rb.transfers);
    /* the lowered schedule's sends sit right after their producers: asynchronous timing is the same */
    cr_assert_eq(rl.makespan, ra.makespan, "lowered %g vs compute-only %g", rl.makespan, ra.makespan);
    cr_assert_geq(rb.makespan, ra.makespan, "blocking sends cannot be faster");
    for (r = 0; r < 2; r++) {
        cr_assert_eq(ra.rank[r].busy, 8 * (1 + 1 + 1) * 2.0, "rank %d busy %g", r, ra.rank[r].busy);
        cr_assert_eq(ra.rank[r].peak_stash, 4, "rank %d simulated peak %d", r, ra.rank[r].peak_stash);
    }
    avgpipe_sim_result_free(NULL, &ra);
    avgpipe_sim_result_free(NULL, &rb);
    avgpipe_sim_result_free(NULL, &rl);
    avgpipe_sched_free(NULL, &low);
    avgpipe_sched_free(NULL, &s);
}

Test(golden, missing_file_is_an_io_error) {
    avgpipe_schedule s;
    cr_assert_eq(avgpipe_sched_load(NULL, "/nonexistent/dir/none.csv", &s), AVGPIPE_IO_ERROR);
    cr_assert_not_null(strstr(avgpipe_last_error(NULL), "/nonexistent/dir/none.csv"), "%s", avgpipe_last_error(NULL));
}

/* ---- the simulator on schedules without any transfer ------------------------------------------- */

/* One rank (or all stages on one rank): nothing to send, so blocking and asynchronous sends give the
   same run: S = 1 with F = 1, B = 2 takes 3M; lowering it adds no op. */
/* An allocator that refuses any block over 16 MiB. */
static void *capped_alloc(size_t n, void *user) {
    (void)user;
    return n > ((size_t)16 << 20) ? NULL : malloc(n);
}
static void capped_free(void *p, void *user) {
    (void)user;
    free(p);
}

/* The simulator's, the lowering's and the validator's tables are sized by the schedule's numbers
   (pipelines x stages x micro-batches): one op of pipeline 5999 on stage 32766 (within the limits)
   made the simulator allocate 6 GB. The tables may not outgrow the ops a schedule holds: a schedule
   numbered that sparsely is refused (AVGPIPE_INVALID_SCHEDULE, naming the counts), not allocated for;
   so are TIE and AGREE rounds numbered more sparsely than those ops. */
Test(sim, tables_follow_the_ops) {
    static const char *texts[] = {
        "", /* built below: one op of pipeline 5999 on stage 32766 (import refuses the shape it implies) */
        "0F0,0F9999999\n",
        "99:0F0,0F99999\n",
        "# avgpipe version=1 kind=custom stages=1 chunks=1 micro=100000000 pipes=1 rounds=1 advance=0 continuous=0\n0F0,0B0\n",
        /* the simulator's tables per (pipeline, round) of TIE and AGREE ops (fuzz_sched found the first: 320 MB) */
        "5:1AGREE6666621\n",
        "0TIE999999@1\n1TIE999999@0\n",
    };
    /* the simulator refuses texts 0-2 and 4-5; the lowering 0-2 (it keeps no per-round table) */
    static const int sim_refuses[] = {1, 1, 1, 0, 1, 1}, lower_refuses[] = {1, 1, 1, 0, 0, 0};
    avgpipe_context ctx;
    avgpipe_context_desc cd;
    size_t i;
    memset(&cd, 0, sizeof cd);
    cd.allocator.alloc = capped_alloc;
    cd.allocator.free = capped_free;
    cr_assert_eq(avgpipe_context_init(&ctx, &cd), AVGPIPE_OK);
    for (i = 0; i < sizeof texts / sizeof texts[0]; i++) {
        avgpipe_schedule s, low;
        avgpipe_sim_result r;
        avgpipe_validate_report rep;
        avgpipe_result res;
        if (i == 0) {
            avgpipe_sched_desc sh = {AVGPIPE_SCHED_CUSTOM, 1, 1, 6000, 32767, 1, 0, 0, AVGPIPE_PLACE_AUTO};
            avgpipe_op op = {32766, 0, 5999, AVGPIPE_OP_F, 0, 0};
            cr_assert_eq(avgpipe_sched_init(&ctx, &s, 1, &sh), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
            cr_assert_eq(avgpipe_sched_push(&ctx, &s, 0, op), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
            cr_assert_eq(s.nstages, 32767);
        } else {
            cr_assert_eq(avgpipe_sched_import(&ctx, texts[i], strlen(texts[i]), &s), AVGPIPE_OK, "text %zu: %s", i, avgpipe_last_error(&ctx));
        }
        res = avgpipe_sim_run(&ctx, &s, NULL, &r);
        cr_expect_eq(res, sim_refuses[i] ? AVGPIPE_INVALID_SCHEDULE : AVGPIPE_OK, "text %zu: simulate: %s (%s)", i, avgpipe_result_string(res),
                     avgpipe_last_error(&ctx));
        if (res == AVGPIPE_OK) avgpipe_sim_result_free(&ctx, &r);
        else cr_expect(strstr(avgpipe_last_error(&ctx), "ops") != NULL, "text %zu: %s", i, avgpipe_last_error(&ctx));
        res = avgpipe_sched_lower(&ctx, &s, &low);
        cr_expect_eq(res, lower_refuses[i] ? AVGPIPE_INVALID_SCHEDULE : AVGPIPE_OK, "text %zu: lower: %s (%s)", i, avgpipe_result_string(res),
                     avgpipe_last_error(&ctx));
        if (res == AVGPIPE_OK) avgpipe_sched_free(&ctx, &low);
        res = avgpipe_sched_validate(&ctx, &s, NULL, &rep);
        cr_expect_eq(res, AVGPIPE_INVALID_SCHEDULE, "text %zu: validate: %s (%s)", i, avgpipe_result_string(res), rep.message);
        avgpipe_sched_free(&ctx, &s);
    }
    {   /* a generated schedule of 2^20 cells simulates and validates within the same allocator */
        avgpipe_sched_desc d = desc_of(AVGPIPE_SCHED_1F1B, 4, 1024, 16, 1, 16, 0, 0);
        avgpipe_schedule s;
        avgpipe_sim_result r;
        cr_assert_eq(avgpipe_sched_generate(&ctx, &d, &s), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
        cr_expect_eq(avgpipe_sim_run(&ctx, &s, NULL, &r), AVGPIPE_OK, "%s", avgpipe_last_error(&ctx));
        avgpipe_sim_result_free(&ctx, &r);
        avgpipe_sched_free(&ctx, &s);
    }
}

Test(sim, single_rank_blocking_and_async) {
    int M, blocking, kind;
    for (kind = AVGPIPE_SCHED_AFAB; kind <= AVGPIPE_SCHED_ADVANCE; kind++)
        for (M = 1; M <= 6; M++)
            for (blocking = 0; blocking < 2; blocking++) {
                avgpipe_sched_desc d = desc_of((avgpipe_sched_kind)kind, 1, M, 1, 1, 1, 1, 0);
                avgpipe_schedule s, low;
                avgpipe_sim_desc sd;
                avgpipe_sim_result r;
                avgpipe_result res;
                gen(&d, &s);
                memset(&sd, 0, sizeof sd);
                sd.blocking_send = blocking;
                res = avgpipe_sim_run(NULL, &s, &sd, &r);
                cr_assert_eq(res, AVGPIPE_OK, "%s blocking=%d: %s", shape_str(&d), blocking, avgpipe_last_error(NULL));
                cr_assert_eq(r.makespan, 3.0 * M, "%s blocking=%d: makespan %g", shape_str(&d), blocking, r.makespan);
                cr_assert_eq(r.transfers, 0);
                avgpipe_sim_result_free(NULL, &r);
                cr_assert_eq(avgpipe_sched_lower(NULL, &s, &low), AVGPIPE_OK);
                cr_assert_eq(low.len[0], s.len[0], "lowering one rank added ops");
                res = avgpipe_sim_run(NULL, &low, &sd, &r);
                cr_assert_eq(res, AVGPIPE_OK, "%s lowered blocking=%d: %s", shape_str(&d), blocking, avgpipe_last_error(NULL));
                cr_assert_eq(r.makespan, 3.0 * M);
                avgpipe_sim_result_free(NULL, &r);
                avgpipe_sched_free(NULL, &low);
                avgpipe_sched_free(NULL, &s);
            }
}
