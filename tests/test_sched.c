/* Tests of the schedule generators against closed forms (DESIGN §2, §3): bubble fractions, peak
   stashed activations, AvgPipe's advance forward, the paper's Figure 7 situation, rounds (synchronous
   and continuous), STEP/AVG placement, and the greedy list scheduler.

   Every expected number here is computed independently of the library (a formula written out in
   this file, or a number measured once and explained in a comment), never read back from it.

   Build and run from the repository root:
     gcc -std=c11 -O2 -Wall -Wextra -pedantic -Werror -I. tests/test_sched.c -o /tmp/test_sched \
         -lcriterion -lm && /tmp/test_sched */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"

#include <criterion/criterion.h>
#include "tests/sched_helpers.h"
#include <math.h>
#include <stdio.h>
#include <string.h>

/* ---- helpers --------------------------------------------------------------------------------- */

/* Simulator costs; a zero means the library default, so every cost used here is set explicitly. */
static avgpipe_sim_desc costs(double f, double b, double i, double w, double latency) {
    avgpipe_sim_desc sd;
    memset(&sd, 0, sizeof sd);
    sd.cost[AVGPIPE_OP_F] = f;
    sd.cost[AVGPIPE_OP_B] = b;
    sd.cost[AVGPIPE_OP_I] = i;
    sd.cost[AVGPIPE_OP_W] = w;
    sd.latency = latency;
    return sd;
}

static void simulate(const avgpipe_schedule *s, const avgpipe_sim_desc *sd, avgpipe_sim_result *r) {
    avgpipe_result res = avgpipe_sim_run(NULL, s, sd, r);
    cr_assert_eq(res, AVGPIPE_OK, "simulate: %s (%s)", avgpipe_result_string(res), avgpipe_last_error(NULL));
}

/* Generate, simulate, return the makespan (and the rank-0 peak stash if asked). */
static double makespan_of(const avgpipe_sched_desc *d, const avgpipe_sim_desc *sd, int *stash0) {
    avgpipe_schedule s;
    avgpipe_sim_result r;
    double m;
    gen(d, &s);
    simulate(&s, sd, &r);
    m = r.makespan;
    if (stash0) *stash0 = r.rank[0].peak_stash;
    avgpipe_sim_result_free(NULL, &r);
    avgpipe_sched_free(NULL, &s);
    return m;
}

static int imin(int a, int b) { return a < b ? a : b; }

static int is_compute(int k) { return k == AVGPIPE_OP_F || k == AVGPIPE_OP_B || k == AVGPIPE_OP_I || k == AVGPIPE_OP_W; }

/* The compute ops of rank r, in order (STEP, AVG and comm ops dropped). Returns the count. */
static int compute_ops(const avgpipe_schedule *s, int r, avgpipe_op *out, int cap) {
    int i, n = 0;
    for (i = 0; i < s->len[r]; i++)
        if (is_compute(s->ops[r][i].kind)) {
            cr_assert_lt(n, cap, "compute_ops: more than %d ops on rank %d", cap, r);
            out[n++] = s->ops[r][i];
        }
    return n;
}

static int same_op(const avgpipe_op *a, const avgpipe_op *b) {
    return a->kind == b->kind && a->stage == b->stage && a->micro == b->micro && a->pipe == b->pipe && a->flags == b->flags;
}

/* Op-for-op equality of two schedules' lists (shapes may differ). */
static void assert_same_ops(const avgpipe_schedule *a, const avgpipe_schedule *b, const char *what) {
    int r, i;
    cr_assert_eq(a->nranks, b->nranks, "%s: nranks %d vs %d", what, a->nranks, b->nranks);
    for (r = 0; r < a->nranks; r++) {
        cr_assert_eq(a->len[r], b->len[r], "%s: rank %d has %d vs %d ops", what, r, a->len[r], b->len[r]);
        for (i = 0; i < a->len[r]; i++) {
            char ta[64], tb[64];
            avgpipe_op_format(&a->ops[r][i], 1, ta, sizeof ta);
            avgpipe_op_format(&b->ops[r][i], 1, tb, sizeof tb);
            cr_assert(same_op(&a->ops[r][i], &b->ops[r][i]), "%s: rank %d position %d: %s vs %s", what, r, i, ta, tb);
        }
    }
}

/* AvgPipe's warm-up (DESIGN §2), computed here in double arithmetic, independently of the library:
   min(T, (S-s-1) + floor(K(S-s-1)/(S-1) + 1/2)) for s < S-1, 0 on the last stage. */
static int advance_warmup(int S, int s, int T, int K) {
    double dist = S - s - 1, w;
    if (s == S - 1) return 0;
    w = dist + floor((double)K * dist / (double)(S - 1) + 0.5);
    return w < T ? (int)w : T;
}

/* ---- closed forms with unit costs and free communication ------------------------------------- */

/* GPipe (AFAB) and 1F1B with F = B = 1 and free transfers: every rank computes 2M, the pipeline
   fills in S-1 forward slots and drains in S-1 backward slots, so the makespan is 2(M+S-1) and the
   bubble (S-1)/(M+S-1) on every rank. */
Test(closed_form, afab_and_1f1b_bubble) {
    static const avgpipe_sched_kind kinds[2] = {AVGPIPE_SCHED_AFAB, AVGPIPE_SCHED_1F1B};
    avgpipe_sim_desc sd = costs(1, 1, 1, 1, 0);
    int k, S, M, r;
    for (k = 0; k < 2; k++)
        for (S = 1; S <= 8; S++)
            for (M = 1; M <= 32; M++) {
                avgpipe_sched_desc d = desc_of(kinds[k], S, M, 1, 1, 1, 0, 0);
                avgpipe_schedule s;
                avgpipe_sim_result res;
                double expect = (double)(S - 1) / (double)(M + S - 1);
                gen(&d, &s);
                simulate(&s, &sd, &res);
                cr_assert(fabs(res.bubble - expect) < 1e-12, "%s: bubble %.15f, expected (S-1)/(M+S-1) = %.15f", shape_str(&d),
                          res.bubble, expect);
                cr_assert_eq(res.makespan, 2.0 * (M + S - 1), "%s: makespan %g, expected %d", shape_str(&d), res.makespan,
                             2 * (M + S - 1));
                for (r = 0; r < S; r++) {
                    cr_assert_eq(res.rank[r].busy, 2.0 * M, "%s rank %d: busy %g", shape_str(&d), r, res.rank[r].busy);
                    cr_assert_eq(res.rank[r].idle, 2.0 * (S - 1), "%s rank %d: idle %g", shape_str(&d), r, res.rank[r].idle);
                }
                avgpipe_sim_result_free(NULL, &res);
                avgpipe_sched_free(NULL, &s);
            }
}

/* Per-stage costs (stage_cost) against the flow-shop closed form: M identical jobs through stages
   of times p_s finish at sum p_s + (M-1) max p_s. GPipe (AFAB) with free transfers is two such
   shops, the forwards and then the backwards (every stage has finished its forwards before the
   last stage has), so the makespan is sum f + (M-1) max f + sum b + (M-1) max b. The same costs as
   a cost_fn (the simulator's per-op path) give the same timeline, and a negative cost_fn value
   counts as zero, as the description says. */
static double stage_cost_fn(const avgpipe_op *op, void *user) {
    const double *tab = (const double *)user;
    if (op->kind == AVGPIPE_OP_STEP) return -7.0; /* clamped to zero */
    return tab[(size_t)op->stage * AVGPIPE_OP_KIND_COUNT + op->kind];
}

Test(closed_form, stage_costs_flow_shop) {
    static const double f[4] = {1, 3, 2, 0.5}, b[4] = {2, 5, 1, 4};
    double tab[4 * AVGPIPE_OP_KIND_COUNT];
    int S, M, s, r;
    for (S = 1; S <= 4; S++)
        for (M = 1; M <= 9; M++) {
            avgpipe_sched_desc d = desc_of(AVGPIPE_SCHED_AFAB, S, M, 1, 1, 1, 0, 0);
            avgpipe_sim_desc sd = costs(1, 1, 1, 1, 0), fd = costs(1, 1, 1, 1, 0);
            avgpipe_schedule sc;
            avgpipe_sim_result a, c;
            double sf = 0, sb = 0, mf = 0, mb = 0, expect;
            memset(tab, 0, sizeof tab);
            for (s = 0; s < S; s++) {
                tab[s * AVGPIPE_OP_KIND_COUNT + AVGPIPE_OP_F] = f[s];
                tab[s * AVGPIPE_OP_KIND_COUNT + AVGPIPE_OP_B] = b[s];
                sf += f[s], sb += b[s];
                if (f[s] > mf) mf = f[s];
                if (b[s] > mb) mb = b[s];
            }
            expect = sf + (M - 1) * mf + sb + (M - 1) * mb;
            sd.stage_cost = tab;
            fd.cost_fn = stage_cost_fn;
            fd.cost_user = tab;
            gen(&d, &sc);
            simulate(&sc, &sd, &a);
            simulate(&sc, &fd, &c);
            cr_assert_eq(a.makespan, expect, "%s: makespan %g with stage costs, expected %g", shape_str(&d), a.makespan, expect);
            cr_assert_eq(c.makespan, expect, "%s: makespan %g with a cost_fn, expected %g", shape_str(&d), c.makespan, expect);
            for (r = 0; r < S; r++) {
                cr_assert_eq(a.rank[r].busy, M * (f[r] + b[r]), "%s rank %d: busy %g, expected %g", shape_str(&d), r, a.rank[r].busy,
                             M * (f[r] + b[r]));
                cr_assert_eq(c.rank[r].busy, a.rank[r].busy, "%s rank %d: busy %g with a cost_fn, %g with stage costs", shape_str(&d), r,
                             c.rank[r].busy, a.rank[r].busy);
            }
            avgpipe_sim_result_free(NULL, &a);
            avgpipe_sim_result_free(NULL, &c);
            avgpipe_sched_free(NULL, &sc);
        }
}

/* Peak stashed activations, three ways: the simulator, the validator's report and the memory
   model, against DESIGN §3: 1F1B min(T, S-s), AFAB T, with T = N·M micro-batches per round. */
Test(closed_form, peak_stash_1f1b_and_afab) {
    avgpipe_sim_desc sd = costs(1, 1, 1, 1, 0);
    int S, M, N, cont, r, afab;
    for (afab = 0; afab < 2; afab++)
        for (S = 1; S <= 8; S++)
            for (M = 1; M <= 16; M++)
                for (N = 1; N <= 2; N++)
                    for (cont = 0; cont < 2; cont++) {
                        avgpipe_sched_desc d =
                            desc_of(afab ? AVGPIPE_SCHED_AFAB : AVGPIPE_SCHED_1F1B, S, M, N, 1, 1 + cont, 0, cont);
                        avgpipe_schedule s;
                        avgpipe_sim_result res;
                        avgpipe_validate_report rep;
                        avgpipe_result v;
                        int T = N * M;
                        gen(&d, &s);
                        simulate(&s, &sd, &res);
                        v = avgpipe_sched_validate(NULL, &s, NULL, &rep);
                        cr_assert_eq(v, AVGPIPE_OK, "%s: validate: %s", shape_str(&d), rep.message);
                        for (r = 0; r < S; r++) {
                            int expect = afab ? T : imin(T, S - r);
                            cr_assert_eq(res.rank[r].peak_stash, expect, "%s rank %d: simulator peak %d, expected %d", shape_str(&d),
                                         r, res.rank[r].peak_stash, expect);
                            cr_assert_eq(rep.peak_stash[r], expect, "%s rank %d: report peak %d, expected %d", shape_str(&d), r,
                                         rep.peak_stash[r], expect);
                            cr_assert_eq(avgpipe_sched_peak_stash(&d, r), expect, "%s rank %d: memory model %d, expected %d",
                                         shape_str(&d), r, avgpipe_sched_peak_stash(&d, r), expect);
                        }
                        avgpipe_sim_result_free(NULL, &res);
                        avgpipe_sched_free(NULL, &s);
                    }
}

/* Advance forward: peak stash on stage s = warm-up(s) + 1 (capped at T), computed independently;
   stage 0 stashes min(T, S + K); the last stage always stashes 1. */
Test(advance, warmup_and_peak_stash) {
    avgpipe_sim_desc sd = costs(1, 1, 1, 1, 0);
    int S, M, N, K, r;
    for (S = 1; S <= 8; S++)
        for (M = 1; M <= 12; M++)
            for (N = 1; N <= 2; N++)
                for (K = 0; K <= M + 2; K++) {
                    avgpipe_sched_desc d = desc_of(AVGPIPE_SCHED_ADVANCE, S, M, N, 1, 1, K, 0);
                    avgpipe_schedule s;
                    avgpipe_sim_result res;
                    avgpipe_validate_report rep;
                    int T = N * M;
                    gen(&d, &s);
                    simulate(&s, &sd, &res);
                    cr_assert_eq(avgpipe_sched_validate(NULL, &s, NULL, &rep), AVGPIPE_OK, "%s: %s", shape_str(&d), rep.message);
                    for (r = 0; r < S; r++) {
                        int w = advance_warmup(S, r, T, K), expect = imin(T, w + 1);
                        cr_assert_eq(avgpipe_sched_warmup(&d, r), w, "%s rank %d: warm-up %d, expected %d", shape_str(&d), r,
                                     avgpipe_sched_warmup(&d, r), w);
                        cr_assert_eq(res.rank[r].peak_stash, expect, "%s rank %d: simulator peak %d, expected %d", shape_str(&d), r,
                                     res.rank[r].peak_stash, expect);
                        cr_assert_eq(rep.peak_stash[r], expect, "%s rank %d: report peak %d, expected %d", shape_str(&d), r,
                                     rep.peak_stash[r], expect);
                        cr_assert_eq(avgpipe_sched_peak_stash(&d, r), expect, "%s rank %d: memory model %d", shape_str(&d), r,
                                     avgpipe_sched_peak_stash(&d, r));
                    }
                    if (S >= 2)
                        cr_assert_eq(res.rank[0].peak_stash, imin(T, S + K), "%s: stage 0 stashes %d, expected min(T, S+K) = %d",
                                     shape_str(&d), res.rank[0].peak_stash, imin(T, S + K));
                    cr_assert_eq(res.rank[S - 1].peak_stash, 1, "%s: last stage stashes %d", shape_str(&d),
                                 res.rank[S - 1].peak_stash);
                    avgpipe_sim_result_free(NULL, &res);
                    avgpipe_sched_free(NULL, &s);
                }
}

/* The last stage always alternates F(m), B(m), whatever K. */
Test(advance, last_stage_alternates) {
    static avgpipe_op ops[4096];
    int S, M, K, j, n;
    for (S = 1; S <= 8; S++)
        for (M = 1; M <= 16; M++)
            for (K = 0; K <= (S - 1) * M + 1; K += (K < M + 1 ? 1 : M)) {
                avgpipe_sched_desc d = desc_of(AVGPIPE_SCHED_ADVANCE, S, M, 1, 1, 1, K, 0);
                avgpipe_schedule s;
                gen(&d, &s);
                n = compute_ops(&s, S - 1, ops, 4096);
                cr_assert_eq(n, 2 * M, "%s: last stage has %d compute ops", shape_str(&d), n);
                for (j = 0; j < M; j++) {
                    cr_assert(ops[2 * j].kind == AVGPIPE_OP_F && ops[2 * j].micro == j, "%s: last stage op %d is not F%d",
                              shape_str(&d), 2 * j, j);
                    cr_assert(ops[2 * j + 1].kind == AVGPIPE_OP_B && ops[2 * j + 1].micro == j, "%s: last stage op %d is not B%d",
                              shape_str(&d), 2 * j + 1, j);
                }
                avgpipe_sched_free(NULL, &s);
            }
}

/* K = 0 is 1F1B op for op, for every shape the generators take (pipelines, rounds, both modes). */
Test(advance, k0_is_1f1b) {
    int S, M, N, R, cont;
    for (S = 1; S <= 8; S++)
        for (M = 1; M <= 16; M++)
            for (N = 1; N <= 3; N++)
                for (R = 1; R <= 2; R++)
                    for (cont = 0; cont < 2; cont++) {
                        avgpipe_sched_desc da = desc_of(AVGPIPE_SCHED_ADVANCE, S, M, N, 1, R, 0, cont);
                        avgpipe_sched_desc d1 = desc_of(AVGPIPE_SCHED_1F1B, S, M, N, 1, R, 0, cont);
                        avgpipe_schedule a, b;
                        gen(&da, &a);
                        gen(&d1, &b);
                        assert_same_ops(&a, &b, shape_str(&da));
                        avgpipe_sched_free(NULL, &a);
                        avgpipe_sched_free(NULL, &b);
                    }
}

/* K >= (S-1)·M: warm-up(s) = min(M, dist + round(K·dist/(S-1))) = M for every s < S-1 (K·dist/(S-1)
   >= M·dist >= M), so those stages run all their forwards first: their lists equal AFAB's. */
Test(advance, large_k_is_all_forwards_first) {
    static avgpipe_op ops[4096];
    int S, M, extra, r, j, n;
    for (S = 2; S <= 8; S++)
        for (M = 1; M <= 12; M++)
            for (extra = 0; extra <= 5; extra += 5) {
                avgpipe_sched_desc d = desc_of(AVGPIPE_SCHED_ADVANCE, S, M, 1, 1, 1, (S - 1) * M + extra, 0);
                avgpipe_sched_desc da = desc_of(AVGPIPE_SCHED_AFAB, S, M, 1, 1, 1, 0, 0);
                avgpipe_schedule s, a;
                gen(&d, &s);
                gen(&da, &a);
                for (r = 0; r < S - 1; r++) {
                    n = compute_ops(&s, r, ops, 4096);
                    cr_assert_eq(n, 2 * M, "%s rank %d: %d compute ops", shape_str(&d), r, n);
                    for (j = 0; j < M; j++) {
                        cr_assert(ops[j].kind == AVGPIPE_OP_F && ops[j].micro == j, "%s rank %d: op %d is not F%d", shape_str(&d), r,
                                  j, j);
                        cr_assert(ops[M + j].kind == AVGPIPE_OP_B && ops[M + j].micro == j, "%s rank %d: op %d is not B%d",
                                  shape_str(&d), r, M + j, j);
                    }
                    cr_assert_eq(s.len[r], a.len[r], "%s rank %d: length differs from AFAB's", shape_str(&d), r);
                    for (j = 0; j < s.len[r]; j++)
                        cr_assert(same_op(&s.ops[r][j], &a.ops[r][j]), "%s rank %d position %d differs from AFAB", shape_str(&d), r,
                                  j);
                    cr_assert_eq(avgpipe_sched_peak_stash(&d, r), M, "%s rank %d: memory model", shape_str(&d), r);
                }
                avgpipe_sched_free(NULL, &s);
                avgpipe_sched_free(NULL, &a);
            }
}

/* ---- interleaved and ZB-H1 against 1F1B ------------------------------------------------------- */

/* Interleaved 1F1B, V chunks per rank. For the same work per micro-batch and rank, a chunk op costs
   1 (F = B = 1) while a 1F1B op (a whole rank's partition) costs V. Measured makespans:
       interleaved 2VM + 2(S-1)        1F1B V·2(M + S-1)
   i.e. the idle time per rank (the bubble) is 2(S-1) against 2V(S-1): exactly 1/V, as in
   Megatron-LM (its fill and drain go through chunks 1/V as long). As a fraction of the makespan
   that is (S-1)/(VM+S-1) against (S-1)/(M+S-1): a ratio (M+S-1)/(VM+S-1) that tends to 1/V as M
   grows: 0.56 at S=2 M=4 V=2, 0.54 at S=4 M=16 V=2 (0.0857 vs 0.1579), 0.29 at S=8 M=32 V=4
   (0.0519 vs 0.1795; 1/V = 0.25). */
Test(bubble, interleaved_vs_1f1b) {
    static const int shapes[][3] = {{2, 4, 2}, {4, 8, 2}, {4, 8, 3}, {4, 16, 2}, {3, 6, 3}, {8, 16, 2}, {8, 32, 4}};
    /* measured bubble fractions (interleaved, 1F1B), = (S-1)/(VM+S-1) and (S-1)/(M+S-1) */
    static const double measured[][2] = {{1.0 / 9, 1.0 / 5}, {3.0 / 19, 3.0 / 11}, {3.0 / 27, 3.0 / 11}, {3.0 / 35, 3.0 / 19},
                                         {2.0 / 20, 2.0 / 8},  {7.0 / 39, 7.0 / 23}, {7.0 / 135, 7.0 / 39}};
    size_t i;
    for (i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        int S = shapes[i][0], M = shapes[i][1], V = shapes[i][2];
        avgpipe_sched_desc di = desc_of(AVGPIPE_SCHED_INTERLEAVED, S, M, 1, V, 1, 0, 0);
        avgpipe_sched_desc d1 = desc_of(AVGPIPE_SCHED_1F1B, S, M, 1, 1, 1, 0, 0);
        avgpipe_sim_desc ci = costs(1, 1, 1, 1, 0), c1 = costs(V, V, 1, 1, 0);
        avgpipe_schedule s;
        avgpipe_sim_result ri, r1;
        double idle_i, idle_1;
        gen(&di, &s);
        simulate(&s, &ci, &ri);
        avgpipe_sched_free(NULL, &s);
        gen(&d1, &s);
        simulate(&s, &c1, &r1);
        avgpipe_sched_free(NULL, &s);
        cr_assert_eq(ri.makespan, 2.0 * V * M + 2.0 * (S - 1), "%s: interleaved makespan %g", shape_str(&di), ri.makespan);
        cr_assert_eq(r1.makespan, 2.0 * V * (M + S - 1), "%s: 1F1B makespan %g", shape_str(&d1), r1.makespan);
        idle_i = ri.makespan - ri.rank[0].busy;
        idle_1 = r1.makespan - r1.rank[0].busy;
        cr_assert(fabs(idle_i * V - idle_1) < 1e-12, "S=%d M=%d V=%d: idle %g vs 1F1B %g, not 1/V", S, M, V, idle_i, idle_1);
        cr_assert(fabs(ri.bubble - measured[i][0]) < 1e-12, "%s: bubble %.15f, expected %.15f", shape_str(&di), ri.bubble,
                  measured[i][0]);
        cr_assert(fabs(r1.bubble - measured[i][1]) < 1e-12, "%s: 1F1B bubble %.15f, expected %.15f", shape_str(&d1), r1.bubble,
                  measured[i][1]);
        cr_assert_lt(ri.bubble, r1.bubble, "S=%d M=%d V=%d: interleaved not better", S, M, V);
        avgpipe_sim_result_free(NULL, &ri);
        avgpipe_sim_result_free(NULL, &r1);
    }
}

/* "INTERLEAVED ... treats chunks == 1 as 1F1B": op for op, any M (no M % S condition then). */
Test(bubble, interleaved_one_chunk_is_1f1b) {
    int S, M, N, cont;
    for (S = 1; S <= 6; S++)
        for (M = 1; M <= 9; M++)
            for (N = 1; N <= 2; N++)
                for (cont = 0; cont < 2; cont++) {
                    avgpipe_sched_desc di = desc_of(AVGPIPE_SCHED_INTERLEAVED, S, M, N, 1, 1 + cont, 0, cont);
                    avgpipe_sched_desc d1 = desc_of(AVGPIPE_SCHED_1F1B, S, M, N, 1, 1 + cont, 0, cont);
                    avgpipe_schedule a, b;
                    gen(&di, &a);
                    gen(&d1, &b);
                    assert_same_ops(&a, &b, shape_str(&di));
                    cr_assert_eq(a.nstages, S);
                    avgpipe_sched_free(NULL, &a);
                    avgpipe_sched_free(NULL, &b);
                }
}

/* The interleaved memory model, against Megatron-LM's warm-up 2(S-r-1) + (V-1)S chunk forwards. */
Test(bubble, interleaved_peak_stash) {
    avgpipe_sim_desc sd = costs(1, 1, 1, 1, 0);
    int S, M, V, r;
    for (S = 1; S <= 6; S++)
        for (M = S; M <= 4 * S; M += S)
            for (V = 2; V <= 3; V++) {
                avgpipe_sched_desc d = desc_of(AVGPIPE_SCHED_INTERLEAVED, S, M, 1, V, 1, 0, 0);
                avgpipe_schedule s;
                avgpipe_sim_result res;
                gen(&d, &s);
                simulate(&s, &sd, &res);
                for (r = 0; r < S; r++) {
                    int expect = imin(V * M, 2 * (S - r - 1) + (V - 1) * S + 1);
                    cr_assert_eq(res.rank[r].peak_stash, expect, "%s rank %d: peak %d, expected %d", shape_str(&d), r,
                                 res.rank[r].peak_stash, expect);
                }
                avgpipe_sim_result_free(NULL, &res);
                avgpipe_sched_free(NULL, &s);
            }
}

/* ZB-H1 with F = I = W = 1 against 1F1B with F = 1, B = 2 (the same work per micro-batch). 1F1B
   idles 3(S-1) per rank: (S-1) forward slots to fill, (S-1) backward slots of 2 to drain. ZB-H1
   (Qi et al.) fills the drain with the held-back W ops, leaving (S-1)(F + I - W) = S-1: exactly 1/3
   of 1F1B's idle time once M >= S. Measured makespans (zb, 1f1b), = 3M + (S-1) and 3M + 3(S-1): */
Test(bubble, zbh1_vs_1f1b) {
    static const int shapes[][4] = {{2, 4, 13, 15},  {2, 8, 25, 27},  {3, 6, 20, 24},  {3, 12, 38, 42}, {4, 4, 15, 21},
                                    {4, 8, 27, 33},  {4, 16, 51, 57}, {8, 8, 31, 45},  {8, 16, 55, 69}, {8, 32, 103, 117}};
    size_t i;
    for (i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        int S = shapes[i][0], M = shapes[i][1];
        avgpipe_sched_desc dz = desc_of(AVGPIPE_SCHED_ZBH1, S, M, 1, 1, 1, 0, 0);
        avgpipe_sched_desc d1 = desc_of(AVGPIPE_SCHED_1F1B, S, M, 1, 1, 1, 0, 0);
        avgpipe_sim_desc cz = costs(1, 2, 1, 1, 0);
        double mz = makespan_of(&dz, &cz, NULL), m1 = makespan_of(&d1, &cz, NULL);
        double bz = 1.0 - 3.0 * M / mz, b1 = 1.0 - 3.0 * M / m1;
        cr_assert_eq(mz, (double)shapes[i][2], "%s: makespan %g, expected %d", shape_str(&dz), mz, shapes[i][2]);
        cr_assert_eq(m1, (double)shapes[i][3], "%s: makespan %g, expected %d", shape_str(&d1), m1, shapes[i][3]);
        cr_assert(fabs(3.0 * (mz - 3.0 * M) - (m1 - 3.0 * M)) < 1e-12, "S=%d M=%d: idle %g vs 1F1B %g is not 1/3", S, M, mz - 3.0 * M,
                  m1 - 3.0 * M);
        /* the bubble fractions: (S-1)/(3M+S-1) and (S-1)/(M+S-1); their ratio (M+S-1)/(3M+S-1)
           tends to 1/3 (0.3786 at S=8 M=32, 0.4839 at S=M=8) */
        cr_assert(fabs(bz - (double)(S - 1) / (3.0 * M + S - 1)) < 1e-12, "S=%d M=%d: ZB-H1 bubble %.15f", S, M, bz);
        cr_assert(fabs(b1 - (double)(S - 1) / (M + S - 1.0)) < 1e-12, "S=%d M=%d: 1F1B bubble %.15f", S, M, b1);
    }
}

/* ZB-H1 over a grid: idle S-1 per rank whenever M >= S, and its memory model min(S, T), exactly
   what the simulator measures (I keeps the activation, W frees it). */
Test(bubble, zbh1_grid) {
    avgpipe_sim_desc cz = costs(1, 2, 1, 1, 0);
    int S, M, r;
    for (S = 1; S <= 8; S++)
        for (M = 1; M <= 3 * S + 1; M++) {
            avgpipe_sched_desc d = desc_of(AVGPIPE_SCHED_ZBH1, S, M, 1, 1, 1, 0, 0);
            avgpipe_schedule s;
            avgpipe_sim_result res;
            gen(&d, &s);
            simulate(&s, &cz, &res);
            if (M >= S) cr_assert_eq(res.makespan, 3.0 * M + S - 1, "%s: makespan %g, expected %d", shape_str(&d), res.makespan, 3 * M + S - 1);
            for (r = 0; r < S; r++)
                cr_assert_eq(res.rank[r].peak_stash, imin(S, M), "%s rank %d: peak %d, expected min(S, M) = %d", shape_str(&d), r,
                             res.rank[r].peak_stash, imin(S, M));
            avgpipe_sim_result_free(NULL, &res);
            avgpipe_sched_free(NULL, &s);
        }
}

/* ---- the paper's Figure 7 situation ------------------------------------------------------------ */

/* F = 1, B = 2, every transfer costs 1 (latency), asynchronous sends (DESIGN §2's hand simulation).
   Advance with K = S-1 reaches AFAB's makespan while stage 0 stashes 2S-1 of M; 1F1B is strictly
   slower; the makespan never rises with K. */
Test(advance, figure7) {
    static const int sc[][5] = {/* S, M, AFAB, 1F1B, K reaching AFAB */ {2, 8, 29, 35, 1}, {4, 16, 63, 85, 3}, {8, 32, 131, 185, 7}};
    avgpipe_sim_desc sd = costs(1, 2, 1, 1, 1);
    size_t i;
    for (i = 0; i < sizeof sc / sizeof sc[0]; i++) {
        int S = sc[i][0], M = sc[i][1], K = sc[i][4], st, K2;
        avgpipe_sched_desc da = desc_of(AVGPIPE_SCHED_AFAB, S, M, 1, 1, 1, 0, 0);
        avgpipe_sched_desc d1 = desc_of(AVGPIPE_SCHED_1F1B, S, M, 1, 1, 1, 0, 0);
        avgpipe_sched_desc dk = desc_of(AVGPIPE_SCHED_ADVANCE, S, M, 1, 1, 1, K, 0);
        double ma = makespan_of(&da, &sd, &st), m1, mk, prev;
        cr_assert_eq(ma, (double)sc[i][2], "%s: makespan %g, expected %d", shape_str(&da), ma, sc[i][2]);
        cr_assert_eq(st, M, "%s: stage 0 stashes %d, expected %d", shape_str(&da), st, M);
        m1 = makespan_of(&d1, &sd, NULL);
        cr_assert_eq(m1, (double)sc[i][3], "%s: makespan %g, expected %d", shape_str(&d1), m1, sc[i][3]);
        cr_assert_gt(m1, ma, "S=%d: 1F1B not strictly slower than AFAB", S);
        mk = makespan_of(&dk, &sd, &st);
        cr_assert_eq(mk, ma, "%s: makespan %g, expected AFAB's %g", shape_str(&dk), mk, ma);
        cr_assert_eq(st, 2 * S - 1, "%s: stage 0 stashes %d, expected %d of %d", shape_str(&dk), st, 2 * S - 1, M);
        prev = HUGE_VAL;
        for (K2 = 0; K2 <= M; K2++) {
            avgpipe_sched_desc d = desc_of(AVGPIPE_SCHED_ADVANCE, S, M, 1, 1, 1, K2, 0);
            double m = makespan_of(&d, &sd, NULL);
            cr_assert_leq(m, prev, "%s: makespan %g rose from %g at K-1", shape_str(&d), m, prev);
            cr_assert_geq(m, ma, "%s: makespan %g below AFAB's %g", shape_str(&d), m, ma);
            prev = m;
        }
        dk.advance = 0;
        cr_assert_eq(makespan_of(&dk, &sd, NULL), m1, "S=%d: advance K=0 differs from 1F1B", S);
    }
}

/* ---- rounds -------------------------------------------------------------------------------------- */

/* Continuous rounds, F = B = 1, free transfers. Per stage, batch (i, t+1) waits for STEP(i, t); in
   1F1B order stage s runs the last backward of batch (i, t) right after the forward S-s-1 stream
   positions later, and the first forward of (i, t+1) comes (N-1)·M + 1 positions after the last
   forward of (i, t). So no stage ever waits on a STEP when (N-1)·M >= S-1 (the condition of stage
   0; DESIGN §2 states the stricter (N-1)·M >= S-s), the stream never drains, and the whole run is
   one 1F1B over R·N·M micro-batches:
       makespan = 2·R·N·M + 2(S-1),   idle per rank 2(S-1),
       bubble   = 2(S-1) / (2RNM + 2(S-1)) = (S-1)/(RNM + S-1)  -> 0 as R grows.
   Synchronous rounds drain every round: makespan = R·2(NM + S-1), bubble (S-1)/(NM+S-1) for
   every R. Both verified here against the simulator, for 1F1B and for advance (the same order
   for the stream when the warm-up is capped at one round). */
Test(rounds, continuous_closed_form) {
    avgpipe_sim_desc sd = costs(1, 1, 1, 1, 0);
    int S, M, N, R, r;
    for (S = 1; S <= 6; S++)
        for (M = 1; M <= 6; M++)
            for (N = 2; N <= 4; N++) {
                double prev = 2;
                if ((N - 1) * M < S - 1) continue;
                for (R = 1; R <= 5; R++) {
                    avgpipe_sched_desc d = desc_of(AVGPIPE_SCHED_1F1B, S, M, N, 1, R, 0, 1);
                    avgpipe_schedule s;
                    avgpipe_sim_result res;
                    double expect = (double)(S - 1) / (double)(R * N * M + S - 1);
                    gen(&d, &s);
                    simulate(&s, &sd, &res);
                    cr_assert_eq(res.makespan, 2.0 * R * N * M + 2.0 * (S - 1), "%s: makespan %g, expected %d", shape_str(&d),
                                 res.makespan, 2 * R * N * M + 2 * (S - 1));
                    cr_assert(fabs(res.bubble - expect) < 1e-12, "%s: bubble %.15f, expected %.15f", shape_str(&d), res.bubble,
                              expect);
                    for (r = 0; r < S; r++)
                        cr_assert_eq(res.rank[r].idle, 2.0 * (S - 1), "%s rank %d: idle %g", shape_str(&d), r, res.rank[r].idle);
                    if (S > 1) cr_assert_lt(res.bubble, prev, "%s: bubble did not fall with R", shape_str(&d));
                    prev = res.bubble;
                    avgpipe_sim_result_free(NULL, &res);
                    avgpipe_sched_free(NULL, &s);
                }
            }
}

/* The same argument with advance forward: stage s looks warm-up(s) stream positions ahead, the
   largest on stage 0, so the stream never drains when (N-1)·M >= warm-up(0) = min(NM, S-1+K), and
   the makespan is again 2RNM + 2(S-1), whatever K. */
Test(rounds, continuous_advance_closed_form) {
    avgpipe_sim_desc sd = costs(1, 1, 1, 1, 0);
    int S, M, N, R, K, checked = 0;
    for (S = 1; S <= 7; S++)
        for (M = 1; M <= 8; M++)
            for (N = 2; N <= 4; N++)
                for (K = 0; K <= M + 1; K++) {
                    if ((N - 1) * M < advance_warmup(S, 0, N * M, K)) continue;
                    for (R = 1; R <= 3; R++) {
                        avgpipe_sched_desc d = desc_of(AVGPIPE_SCHED_ADVANCE, S, M, N, 1, R, K, 1);
                        double m = makespan_of(&d, &sd, NULL);
                        cr_assert_eq(m, 2.0 * R * N * M + 2.0 * (S - 1), "%s: makespan %g, expected %d", shape_str(&d), m,
                                     2 * R * N * M + 2 * (S - 1));
                        checked++;
                    }
                }
    cr_assert_gt(checked, 1000, "only %d shapes", checked);
}

Test(rounds, synchronous_closed_form) {
    avgpipe_sim_desc sd = costs(1, 1, 1, 1, 0);
    int S, M, N, R;
    for (S = 1; S <= 6; S++)
        for (M = 1; M <= 6; M++)
            for (N = 1; N <= 4; N++)
                for (R = 1; R <= 4; R++) {
                    avgpipe_sched_desc d = desc_of(AVGPIPE_SCHED_1F1B, S, M, N, 1, R, 0, 0);
                    avgpipe_schedule s;
                    avgpipe_sim_result res;
                    double expect = (double)(S - 1) / (double)(N * M + S - 1);
                    gen(&d, &s);
                    simulate(&s, &sd, &res);
                    cr_assert_eq(res.makespan, 2.0 * R * (N * M + S - 1), "%s: makespan %g, expected %d", shape_str(&d), res.makespan,
                                 2 * R * (N * M + S - 1));
                    cr_assert(fabs(res.bubble - expect) < 1e-12, "%s: bubble %.15f, expected %.15f", shape_str(&d), res.bubble,
                              expect);
                    avgpipe_sim_result_free(NULL, &res);
                    avgpipe_sched_free(NULL, &s);
                }
}

/* STEP(i, s, t) sits right after the last backward work (B, or W) of batch (i, t) on stage s, after
   all of it and before any forward of (i, t+1) on s; AVG(i, s, t) right after the STEP; one of each
   per (pipeline, stage, round). Walks the op lists of every model. */
static void check_step_avg(const avgpipe_schedule *s, int M, int R, const char *what) {
    int r, i, j;
    for (r = 0; r < s->nranks; r++) {
        const avgpipe_op *o = s->ops[r];
        int n = s->len[r], steps = 0, avgs = 0;
        for (i = 0; i < n; i++) {
            int p, g, t, done = 0;
            if (o[i].kind == AVGPIPE_OP_AVG) {
                avgs++;
                cr_assert(i > 0 && o[i - 1].kind == AVGPIPE_OP_STEP && o[i - 1].pipe == o[i].pipe && o[i - 1].stage == o[i].stage &&
                              o[i - 1].micro == o[i].micro,
                          "%s: rank %d position %d: AVG not right after its STEP", what, r, i);
            }
            if (o[i].kind != AVGPIPE_OP_STEP) continue;
            steps++;
            p = o[i].pipe, g = o[i].stage, t = o[i].micro;
            cr_assert(t >= 0 && t < R, "%s: rank %d position %d: STEP of round %d", what, r, i, t);
            cr_assert(i + 1 < n && o[i + 1].kind == AVGPIPE_OP_AVG, "%s: rank %d position %d: STEP not followed by AVG", what, r, i);
            cr_assert(i > 0 && (o[i - 1].kind == AVGPIPE_OP_B || o[i - 1].kind == AVGPIPE_OP_W) && o[i - 1].pipe == p &&
                          o[i - 1].stage == g && o[i - 1].micro / M == t,
                      "%s: rank %d position %d: STEP not right after a backward of its batch", what, r, i);
            for (j = 0; j < n; j++) {
                const avgpipe_op *x = &o[j];
                if (x->pipe != p || x->stage != g) continue;
                if ((x->kind == AVGPIPE_OP_B || x->kind == AVGPIPE_OP_W) && x->micro / M == t) {
                    cr_assert_lt(j, i, "%s: rank %d: backward work at %d of round %d after its STEP at %d", what, r, j, t, i);
                    done++;
                }
                if (x->kind == AVGPIPE_OP_F && x->micro / M == t + 1)
                    cr_assert_gt(j, i, "%s: rank %d: forward at %d of round %d before STEP of round %d at %d", what, r, j, t + 1, t, i);
            }
            cr_assert_eq(done, M, "%s: rank %d: STEP at %d after %d of %d backward works", what, r, i, done, M);
        }
        cr_assert_eq(steps, s->shape.pipes * s->shape.chunks * R, "%s: rank %d has %d STEPs", what, r, steps);
        cr_assert_eq(avgs, steps, "%s: rank %d has %d AVGs for %d STEPs", what, r, avgs, steps);
    }
}

Test(rounds, step_avg_order_every_model) {
    static const int Ms[] = {1, 2, 3, 4, 6, 8};
    int kind, S, mi, N, R, cont, variant;
    for (kind = AVGPIPE_SCHED_AFAB; kind <= AVGPIPE_SCHED_KIND_COUNT; kind++) /* KIND_COUNT: the greedy scheduler */
        for (S = 1; S <= 5; S++)
            for (mi = 0; mi < 6; mi++)
                for (N = 1; N <= 3; N++)
                    for (R = 1; R <= 3; R++)
                        for (cont = 0; cont < 2; cont++)
                            for (variant = 0; variant < 2; variant++) {
                                int M = Ms[mi];
                                avgpipe_schedule s;
                                char what[200];
                                if (kind == AVGPIPE_SCHED_KIND_COUNT) {
                                    avgpipe_greedy_desc g;
                                    memset(&g, 0, sizeof g);
                                    g.shape.stages = S, g.shape.micro = M, g.shape.pipes = N, g.shape.rounds = R, g.shape.continuous = cont;
                                    g.split_backward = variant;
                                    cr_assert_eq(avgpipe_sched_greedy(NULL, &g, &s), AVGPIPE_OK, "greedy: %s", avgpipe_last_error(NULL));
                                    snprintf(what, sizeof what, "greedy S=%d M=%d N=%d R=%d cont=%d split=%d", S, M, N, R, cont, variant);
                                } else {
                                    avgpipe_sched_desc d = desc_of((avgpipe_sched_kind)kind, S, M, N, 1, R, 0, cont);
                                    if (kind == AVGPIPE_SCHED_INTERLEAVED) {
                                        if (M % S) continue;
                                        d.chunks = 2 + variant;
                                    } else if (kind == AVGPIPE_SCHED_ADVANCE || kind == AVGPIPE_SCHED_ZBV) {
                                        d.advance = variant ? M : 1;
                                    } else if (variant) {
                                        continue;
                                    }
                                    if (gen_skips(&d)) continue;
                                    gen(&d, &s);
                                    snprintf(what, sizeof what, "%s", shape_str(&d));
                                }
                                check_step_avg(&s, M, R, what);
                                avgpipe_sched_free(NULL, &s);
                            }
}

/* ---- greedy list scheduler ---------------------------------------------------------------------- */

/* Default settings (priority B then F, cap S - s, F 1 B 2) on V = 1 reproduce 1F1B op for op:
   synchronous rounds always, continuous rounds whenever 1F1B's stream does not stall,
   (N-1)·M >= S-1 (see rounds.continuous_closed_form). */
Test(greedy, default_is_1f1b) {
    int S, M, N, R, cont;
    for (S = 1; S <= 8; S++)
        for (M = 1; M <= 12; M++)
            for (N = 1; N <= 3; N++)
                for (R = 1; R <= 2; R++)
                    for (cont = 0; cont < 2; cont++) {
                        avgpipe_greedy_desc g;
                        avgpipe_sched_desc d = desc_of(AVGPIPE_SCHED_1F1B, S, M, N, 1, R, 0, cont);
                        avgpipe_schedule a, b;
                        if (cont && (N - 1) * M < S - 1) continue;
                        memset(&g, 0, sizeof g);
                        g.shape.stages = S, g.shape.micro = M, g.shape.pipes = N, g.shape.rounds = R, g.shape.continuous = cont;
                        cr_assert_eq(avgpipe_sched_greedy(NULL, &g, &a), AVGPIPE_OK, "greedy: %s", avgpipe_last_error(NULL));
                        cr_assert_eq(a.shape.kind, AVGPIPE_SCHED_CUSTOM, "greedy output kind %d", a.shape.kind);
                        gen(&d, &b);
                        assert_same_ops(&a, &b, shape_str(&d));
                        avgpipe_sched_free(NULL, &a);
                        avgpipe_sched_free(NULL, &b);
                    }
}

/* A per-stage in-flight cap is never exceeded (simulator and validator agree), the result validates,
   and stage 0, whose forwards are always ready, fills its cap: min(cap, T) when cap <= S (before
   its first gradient can arrive). */
Test(greedy, inflight_cap_respected) {
    static const int Ms[] = {1, 3, 8, 16};
    avgpipe_sim_desc sd = costs(1, 2, 1, 1, 0);
    int S, mi, N, split, variant, r;
    for (S = 1; S <= 6; S++)
        for (mi = 0; mi < 4; mi++)
            for (N = 1; N <= 2; N++)
                for (split = 0; split < 2; split++)
                    for (variant = 0; variant < 4; variant++) {
                        int M = Ms[mi], caps[8], T = N * M;
                        avgpipe_greedy_desc g;
                        avgpipe_schedule s;
                        avgpipe_sim_result res;
                        avgpipe_validate_report rep;
                        for (r = 0; r < S; r++)
                            caps[r] = variant == 0 ? 1 : variant == 1 ? 2 : variant == 2 ? 1 + (r * 7 + 3) % S : S - r + 2;
                        memset(&g, 0, sizeof g);
                        g.shape.stages = S, g.shape.micro = M, g.shape.pipes = N, g.split_backward = split;
                        if (variant == 1) g.inflight_cap_all = 2;
                        else g.inflight_cap = caps;
                        cr_assert_eq(avgpipe_sched_greedy(NULL, &g, &s), AVGPIPE_OK, "greedy S=%d M=%d: %s", S, M, avgpipe_last_error(NULL));
                        simulate(&s, &sd, &res);
                        cr_assert_eq(avgpipe_sched_validate(NULL, &s, NULL, &rep), AVGPIPE_OK, "greedy S=%d M=%d variant %d: %s", S, M,
                                     variant, rep.message);
                        for (r = 0; r < S; r++) {
                            cr_assert_leq(res.rank[r].peak_stash, caps[r], "greedy S=%d M=%d N=%d split=%d variant %d rank %d: peak %d > cap %d", S,
                                          M, N, split, variant, r, res.rank[r].peak_stash, caps[r]);
                            cr_assert_eq(rep.peak_stash[r], res.rank[r].peak_stash, "rank %d: report %d vs simulator %d", r,
                                         rep.peak_stash[r], res.rank[r].peak_stash);
                        }
                        if (caps[0] <= S)
                            cr_assert_eq(res.rank[0].peak_stash, imin(caps[0], T), "greedy S=%d M=%d N=%d variant %d: stage 0 peak %d",
                                         S, M, N, variant, res.rank[0].peak_stash);
                        avgpipe_sim_result_free(NULL, &res);
                        avgpipe_sched_free(NULL, &s);
                    }
}

Test(greedy, rejects_bad_cap) {
    int caps[3] = {2, 0, 1};
    avgpipe_greedy_desc g;
    avgpipe_schedule s;
    memset(&g, 0, sizeof g);
    g.shape.stages = 3, g.shape.micro = 4, g.inflight_cap = caps;
    cr_assert_eq(avgpipe_sched_greedy(NULL, &g, &s), AVGPIPE_INVALID_ARG);
    cr_assert_not_null(strstr(avgpipe_last_error(NULL), "inflight_cap"), "message: %s", avgpipe_last_error(NULL));
}

/* AVGPIPE_SIM_EVENTS_TIMED keeps only the events that take time: the ASCII timeline is the same as with
   every event, the statistics too, and with free transfers only the compute events are left. */
Test(render, timed_events_draw_the_same_timeline) {
    static const avgpipe_sched_kind kinds[] = {AVGPIPE_SCHED_1F1B, AVGPIPE_SCHED_ADVANCE, AVGPIPE_SCHED_INTERLEAVED,
                                               AVGPIPE_SCHED_ZBH1, AVGPIPE_SCHED_ZBV, AVGPIPE_SCHED_DUALPIPEV};
    int k, lat, blocking, cases = 0;
    for (k = 0; k < (int)(sizeof kinds / sizeof kinds[0]); k++)
        for (lat = 0; lat < 2; lat++)
            for (blocking = 0; blocking < 2; blocking++) {
                avgpipe_sched_desc d;
                avgpipe_schedule s;
                avgpipe_sim_desc sd = costs(1, 2, 1, 1, lat ? 0.5 : 0);
                avgpipe_sim_result all, timed;
                avgpipe_buf a = {0}, b = {0};
                size_t i, positive = 0;
                memset(&d, 0, sizeof d);
                d.kind = kinds[k], d.stages = 4, d.micro = 8, d.pipes = 2;
                d.chunks = d.kind == AVGPIPE_SCHED_INTERLEAVED ? 2 : 0;
                d.advance = d.kind == AVGPIPE_SCHED_ADVANCE ? 2 : 0;
                gen(&d, &s);
                sd.blocking_send = blocking;
                sd.record_events = AVGPIPE_SIM_EVENTS_ALL;
                simulate(&s, &sd, &all);
                sd.record_events = AVGPIPE_SIM_EVENTS_TIMED;
                simulate(&s, &sd, &timed);
                cr_assert_eq(all.makespan, timed.makespan);
                cr_assert_eq(all.transfers, timed.transfers);
                for (i = 0; i < all.nevents; i++) positive += all.events[i].end > all.events[i].start;
                cr_assert_eq(timed.nevents, positive, "%s latency %d blocking %d: %zu timed events, %zu of all take time",
                             avgpipe_sched_kind_name(d.kind), lat, blocking, timed.nevents, positive);
                for (i = 0; i < timed.nevents; i++) {
                    cr_assert_gt(timed.events[i].end, timed.events[i].start);
                    if (!lat) cr_assert_eq(timed.events[i].track, 0, "a free transfer was recorded");
                }
                if (!lat) cr_assert_lt(timed.nevents, all.nevents, "free transfers: fewer events");
                cr_assert_eq(avgpipe_render_ascii(NULL, all.events, all.nevents, all.nranks, NULL, &a), AVGPIPE_OK);
                cr_assert_eq(avgpipe_render_ascii(NULL, timed.events, timed.nevents, timed.nranks, NULL, &b), AVGPIPE_OK);
                cr_assert(a.len == b.len && memcmp(a.data, b.data, a.len) == 0, "%s latency %d blocking %d: the timelines differ:\n%.*s\n%.*s",
                          avgpipe_sched_kind_name(d.kind), lat, blocking, (int)a.len, a.data, (int)b.len, b.data);
                cases++;
                avgpipe_buf_free(NULL, &a);
                avgpipe_buf_free(NULL, &b);
                avgpipe_sim_result_free(NULL, &all);
                avgpipe_sim_result_free(NULL, &timed);
                avgpipe_sched_free(NULL, &s);
            }
    cr_assert_eq(cases, 24);
}

Test(render, record_events_out_of_range_is_refused) {
    avgpipe_sched_desc d;
    avgpipe_schedule s;
    avgpipe_sim_desc sd = costs(1, 2, 1, 1, 0);
    avgpipe_sim_result r;
    memset(&d, 0, sizeof d);
    d.kind = AVGPIPE_SCHED_1F1B, d.stages = 2, d.micro = 2;
    gen(&d, &s);
    sd.record_events = 3;
    cr_assert_eq(avgpipe_sim_run(NULL, &s, &sd, &r), AVGPIPE_INVALID_ARG);
    cr_assert_not_null(strstr(avgpipe_last_error(NULL), "record_events"), "%s", avgpipe_last_error(NULL));
    avgpipe_sched_free(NULL, &s);
}

/* A schedule the simulator cannot size its tables from: each case spoils one op of a valid 1F1B
   schedule (rank 1, position 3, after IDLE slots on both ranks), and the simulator, the lowering,
   avgpipe_sched_add_sync and avgpipe_buffer_plan_build (on the lowered schedule, spoilt the same way:
   its scan looks the stages' ranks up itself) refuse it naming the rank, the position and the defect.
   The unspoilt schedules go through all four, so the refusals are the op's and not the schedule's. */
Test(render, malformed_op_is_named) {
    static const struct {
        int field, value; /* field: 0 kind, 1 stage, 2 pipe, 3 micro */
        const char *says;
    } cases[] = {
        {0, 200, "unknown op kind 200"}, {1, 0, "stage 0 lives on rank 0"}, {1, 9, "stage 9 is not placed"},
        {1, -1, "stage -1 is not placed"}, {2, -1, "negative pipeline"}, {3, -2, "negative micro-batch"},
    };
    avgpipe_sched_desc d;
    avgpipe_schedule s, out, low;
    avgpipe_buffer_plan plan;
    size_t act[2] = {64, 64};
    avgpipe_sim_desc sd = costs(1, 2, 1, 1, 0);
    avgpipe_sim_result r;
    avgpipe_sync_desc sy;
    avgpipe_op idle;
    size_t c;
    int rk, how;
    memset(&d, 0, sizeof d);
    memset(&idle, 0, sizeof idle);
    d.kind = AVGPIPE_SCHED_1F1B, d.stages = 2, d.micro = 4;
    gen(&d, &s);
    for (rk = 0; rk < 2; rk++) { /* an IDLE slot first: skipped, and counted in the positions */
        cr_assert_eq(avgpipe_sched_push(NULL, &s, rk, idle), AVGPIPE_OK);
        memmove(&s.ops[rk][1], &s.ops[rk][0], (size_t)(s.len[rk] - 1) * sizeof idle);
        s.ops[rk][0] = idle;
    }
    memset(&sy, 0, sizeof sy);
    sy.agree = 1;
    simulate(&s, &sd, &r);
    avgpipe_sim_result_free(NULL, &r);
    cr_assert_eq(avgpipe_sched_lower(NULL, &s, &low), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
    cr_assert_eq(avgpipe_buffer_plan_build(NULL, &low, act, &plan), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
    avgpipe_buffer_plan_free(NULL, &plan);
    cr_assert_eq(avgpipe_sched_add_sync(NULL, &s, &sy, &out), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
    avgpipe_sched_free(NULL, &out);
    for (c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        avgpipe_op keep = s.ops[1][3], *op = &s.ops[1][3];
        if (cases[c].field == 0) op->kind = (uint8_t)cases[c].value;
        else if (cases[c].field == 1) op->stage = cases[c].value;
        else if (cases[c].field == 2) op->pipe = (int16_t)cases[c].value;
        else op->micro = cases[c].value;
        cr_expect_eq(avgpipe_sim_run(NULL, &s, &sd, &r), AVGPIPE_INVALID_SCHEDULE, "case %zu (%s) simulated", c, cases[c].says);
        cr_expect(strstr(avgpipe_last_error(NULL), "rank 1 position 3") != NULL, "case %zu: %s", c, avgpipe_last_error(NULL));
        cr_expect(strstr(avgpipe_last_error(NULL), cases[c].says) != NULL, "case %zu: '%s' not in: %s", c, cases[c].says,
                  avgpipe_last_error(NULL));
        for (how = 0; how < 3; how++) {
            static const char *const who[3] = {"lower", "add_sync", "buffer_plan_build"};
            avgpipe_op lkeep = low.ops[1][3];
            avgpipe_result res;
            low.ops[1][3] = *op;
            low.ops[1][3].kind = cases[c].field == 0 ? op->kind : lkeep.kind; /* the lowered op's own kind, spoilt the same way */
            res = how == 0 ? avgpipe_sched_lower(NULL, &s, &out) : how == 1 ? avgpipe_sched_add_sync(NULL, &s, &sy, &out)
                                                                            : avgpipe_buffer_plan_build(NULL, &low, act, &plan);
            low.ops[1][3] = lkeep;
            cr_expect_eq(res, AVGPIPE_INVALID_SCHEDULE, "case %zu (%s): %s took it", c, cases[c].says, who[how]);
            if (res == AVGPIPE_OK && how < 2) avgpipe_sched_free(NULL, &out);
            if (res == AVGPIPE_OK && how == 2) avgpipe_buffer_plan_free(NULL, &plan);
            cr_expect(strstr(avgpipe_last_error(NULL), "rank 1 position 3") && strstr(avgpipe_last_error(NULL), cases[c].says),
                      "case %zu (%s): %s", c, who[how], avgpipe_last_error(NULL));
        }
        s.ops[1][3] = keep;
    }
    avgpipe_sched_free(NULL, &low);
    avgpipe_sched_free(NULL, &s);
}

/* ---- the kind table (avgpipe_sched_kind_query) ------------------------------------------------- */

/* Each row says what the generators and the resolver actually do: its name parses back to it, the
   chunks and placement it resolves to, whether K survives resolution, whether the schedule holds I/W
   ops and overlapped pairs, and the limits it names (one shape under each limit refused, the shape at
   it accepted). Checked against what avgpipe_sched_resolve and avgpipe_sched_generate produce. */
Test(kinds, table_agrees_with_the_resolver_and_the_generators) {
    int k;
    cr_assert(avgpipe_sched_kind_query((avgpipe_sched_kind)-1) == NULL);
    cr_assert(avgpipe_sched_kind_query(AVGPIPE_SCHED_KIND_COUNT) == NULL);
    cr_assert_str_eq(avgpipe_sched_kind_query(AVGPIPE_SCHED_CUSTOM)->name, "custom");
    cr_assert_eq(avgpipe_sched_kind_query(AVGPIPE_SCHED_CUSTOM)->generated, 0);
    for (k = AVGPIPE_SCHED_CUSTOM + 1; k < AVGPIPE_SCHED_KIND_COUNT; k++) {
        const avgpipe_sched_kind_info *info = avgpipe_sched_kind_query((avgpipe_sched_kind)k);
        avgpipe_sched_kind parsed;
        avgpipe_sched_desc d, r;
        avgpipe_schedule s;
        int rank, i, has_split = 0, has_pair = 0, per = info->micro_pipes_per_stage;
        cr_assert(info && (int)info->kind == k && info->generated, "kind %d: row %d", k, info ? (int)info->kind : -1);
        cr_assert_eq(avgpipe_sched_kind_parse(info->name, &parsed), AVGPIPE_OK, "%s does not parse", info->name);
        cr_assert_eq(parsed, k);
        cr_assert_str_eq(avgpipe_sched_kind_name((avgpipe_sched_kind)k), info->name);
        cr_assert(info->limits && info->limits[0]);
        memset(&d, 0, sizeof d);
        d.kind = (avgpipe_sched_kind)k, d.stages = 3, d.micro = 6, d.pipes = 2, d.advance = 2;
        cr_assert_eq(avgpipe_sched_resolve(NULL, &d, &r), AVGPIPE_OK, "%s: %s", info->name, avgpipe_last_error(NULL));
        cr_assert_eq(r.chunks, info->chunks ? info->chunks : 2, "%s resolves chunks 0 to %d", info->name, r.chunks);
        cr_assert_eq(r.placement, r.chunks > 1 ? info->placement : AVGPIPE_PLACE_LOOP, "%s: placement %d", info->name, (int)r.placement);
        cr_assert_eq(r.advance, info->advance ? 2 : 0, "%s keeps K = %d", info->name, r.advance);
        cr_assert_eq(avgpipe_sched_generate(NULL, &d, &s), AVGPIPE_OK, "%s: %s", info->name, avgpipe_last_error(NULL));
        for (rank = 0; rank < s.nranks; rank++)
            for (i = 0; i < s.len[rank]; i++) {
                has_split |= s.ops[rank][i].kind == AVGPIPE_OP_I || s.ops[rank][i].kind == AVGPIPE_OP_W;
                has_pair |= (s.ops[rank][i].flags & AVGPIPE_OPF_OVERLAP_NEXT) != 0;
            }
        cr_assert_eq(has_split, info->split, "%s: I/W ops %d, the table says %d", info->name, has_split, info->split);
        cr_assert_eq(has_pair, info->overlapped, "%s: overlapped pairs %d, the table says %d", info->name, has_pair, info->overlapped);
        cr_assert_eq(s.nstages, 3 * r.chunks, "%s: %d stages on 3 ranks", info->name, s.nstages);
        avgpipe_sched_free(NULL, &s);
        if (info->chunks == 1) { /* several chunks are refused */
            d.chunks = 2;
            cr_assert_eq(avgpipe_sched_resolve(NULL, &d, &r), AVGPIPE_INVALID_ARG, "%s took chunks 2", info->name);
            cr_assert(strstr(avgpipe_last_error(NULL), "chunks") != NULL, "%s", avgpipe_last_error(NULL));
            d.chunks = 0;
        }
        if (info->micro_multiple) { /* micro not a multiple of stages */
            d.micro = 4;
            cr_assert_eq(avgpipe_sched_resolve(NULL, &d, &r), AVGPIPE_INVALID_ARG, "%s took micro 4 on 3 stages", info->name);
            d.micro = 6;
        }
        if (per) { /* micro x pipes just under per x stages, then at it */
            d.pipes = 1, d.micro = per * 3 - 1;
            cr_assert_eq(avgpipe_sched_resolve(NULL, &d, &r), AVGPIPE_INVALID_ARG, "%s took micro x pipes %d < %d x 3", info->name, d.micro, per);
            cr_assert(strstr(avgpipe_last_error(NULL), "micro") != NULL, "%s", avgpipe_last_error(NULL));
            d.micro = per * 3;
            cr_assert_eq(avgpipe_sched_resolve(NULL, &d, &r), AVGPIPE_OK, "%s: %s", info->name, avgpipe_last_error(NULL));
        }
    }
}

/* ---- the buffer plan without lowering ---------------------------------------------------------- */

/* The tuner's memory model counts the slots of the lowered schedule without lowering it
   (avgpipe__plan_slots_unlowered, internal); its reference is the plan itself: lower, then
   avgpipe_buffer_plan_build. On the generated schedules, also with the extent the tuner takes from the
   shape instead of scanning (avgpipe__gen_extent), which must be the scan's, there and in the simulator. Every generated kind with and without ties and agreement, then the same
   lists shuffled on each rank, with idle slots and overlap flags strewn in (no longer valid schedules,
   but lowering and the plan take them, and they move receives, units and last touches about). */
static void expect_unlowered_slots(const avgpipe_schedule *s, int generated, avgpipe__slot_memo *memo, const char *what) {
    avgpipe_schedule low;
    avgpipe_buffer_plan plan;
    size_t act[64];
    int g, got[64];
    for (g = 0; g < 64; g++) act[g] = 32;
    cr_assert_leq(s->nstages, 64);
    cr_assert_eq(avgpipe_sched_lower(NULL, s, &low), AVGPIPE_OK, "%s: lower: %s", what, avgpipe_last_error(NULL));
    cr_assert_eq(avgpipe_buffer_plan_build(NULL, &low, act, &plan), AVGPIPE_OK, "%s: plan: %s", what, avgpipe_last_error(NULL));
    cr_assert_eq(avgpipe__plan_slots_unlowered(NULL, s, NULL, NULL, got), AVGPIPE_OK, "%s: %s", what, avgpipe_last_error(NULL));
    for (g = 0; g < s->nstages; g++)
        cr_assert_eq(got[g], plan.slots[g], "%s: stage %d: %d slots counted without lowering, %d planned", what, g, got[g], plan.slots[g]);
    for (g = 0; g < 2; g++) { /* with the tuner's cache of ranks (two of them: one small, which starts again often) */
        int k;
        cr_assert_eq(avgpipe__plan_slots_unlowered(NULL, s, NULL, &memo[g], got), AVGPIPE_OK, "%s: %s", what, avgpipe_last_error(NULL));
        for (k = 0; k < s->nstages; k++)
            cr_assert_eq(got[k], plan.slots[k], "%s: stage %d: %d slots counted with cache %d, %d planned", what, k, got[k], g, plan.slots[k]);
    }
    if (generated) { /* the tuner's way: the extent from the shape, no scan */
        avgpipe__extent e = avgpipe__gen_extent(s, 1);
        int N;
        long long U;
        cr_assert_eq(avgpipe__sched_scan(NULL, s, NULL, &N, &U), AVGPIPE_OK);
        cr_assert(N == e.N && U == e.U, "%s: the scan counts %d pipelines and %lld micro-batches, the shape %d and %lld", what, N, U, e.N, e.U);
        cr_assert_eq(avgpipe__plan_slots_unlowered(NULL, s, &e, NULL, got), AVGPIPE_OK, "%s: %s", what, avgpipe_last_error(NULL));
        for (g = 0; g < s->nstages; g++)
            cr_assert_eq(got[g], plan.slots[g], "%s: stage %d: %d slots counted with the shape's extent, %d planned", what, g, got[g], plan.slots[g]);
        { /* and the simulator with it */
            avgpipe_sim_desc sd = costs(1, 2, 1, 1, 0.5);
            avgpipe_sim_result a, b;
            int r;
            simulate(s, &sd, &a);
            cr_assert_eq(avgpipe__sim_core(NULL, s, &sd, &b, NULL, &e, 0), AVGPIPE_OK, "%s: %s", what, avgpipe_last_error(NULL));
            cr_assert_eq(b.makespan, a.makespan, "%s: makespan %g with the extent, %g scanned", what, b.makespan, a.makespan);
            for (r = 0; r < s->nranks; r++) cr_assert_eq(b.rank[r].busy, a.rank[r].busy, "%s: rank %d", what, r);
            avgpipe_sim_result_free(NULL, &b);
            e.N = 1 << 20, e.U = 1 << 20; /* past the tables' limit: not taken, the scan counts */
            cr_assert_eq(avgpipe__sim_core(NULL, s, &sd, &b, NULL, &e, 0), AVGPIPE_OK, "%s: %s", what, avgpipe_last_error(NULL));
            cr_assert_eq(b.makespan, a.makespan, "%s: makespan %g with an extent past the limit, %g scanned", what, b.makespan, a.makespan);
            avgpipe_sim_result_free(NULL, &a);
            avgpipe_sim_result_free(NULL, &b);
        }
    }
    avgpipe_buffer_plan_free(NULL, &plan);
    avgpipe_sched_free(NULL, &low);
}

static unsigned shuffle_rng(unsigned *x) {
    *x ^= *x << 13;
    *x ^= *x >> 17;
    *x ^= *x << 5;
    return *x;
}

/* s's lists shuffled (Fisher-Yates), each op then given OVERLAP_NEXT with chance 1/8 and an idle
   slot before it with chance 1/8, into out (its own lists, s's shape). */
static void shuffled(const avgpipe_schedule *s, unsigned seed, avgpipe_schedule *out) {
    int r, i;
    unsigned x = seed * 2654435761u + 1;
    avgpipe_schedule c;
    cr_assert_eq(avgpipe_sched_copy(NULL, s, &c), AVGPIPE_OK);
    cr_assert_eq(avgpipe_sched_init(NULL, out, s->nranks, &s->shape), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
    cr_assert_eq(out->nstages, s->nstages);
    for (r = 0; r < c.nranks; r++) {
        avgpipe_op *o = c.ops[r];
        for (i = c.len[r] - 1; i > 0; i--) {
            int j = (int)(shuffle_rng(&x) % (unsigned)(i + 1));
            avgpipe_op t = o[i];
            o[i] = o[j];
            o[j] = t;
        }
        for (i = 0; i < c.len[r]; i++) {
            avgpipe_op idle;
            memset(&idle, 0, sizeof idle);
            o[i].flags = shuffle_rng(&x) % 8 == 0 ? AVGPIPE_OPF_OVERLAP_NEXT : 0;
            if (shuffle_rng(&x) % 8 == 0) cr_assert_eq(avgpipe_sched_push(NULL, out, r, idle), AVGPIPE_OK);
            cr_assert_eq(avgpipe_sched_push(NULL, out, r, o[i]), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
        }
    }
    avgpipe_sched_free(NULL, &c);
}

/* avgpipe_sim_run sizes its tables from the shape and checks each op as it runs (no scan first):
   the same result as the scan's run (avgpipe__sim_core with guess 0), for schedule s as it is and
   with `fault` applied to one op (0: none). Returns bit 0: the shape allowed the guess; bit 1: the
   run was refused. */
static int expect_guess_is_scan(const avgpipe_schedule *s, int fault, unsigned seed, const char *what) {
    avgpipe_sim_desc sd = costs(1, 2, 1, 1, 0.5);
    avgpipe_sim_result a, b;
    avgpipe_schedule c;
    avgpipe_context qa, qb;
    avgpipe_result ra, rb;
    char ea[AVGPIPE_ERROR_MAX];
    avgpipe__extent ext;
    int r, stuck_a[2] = {-1, -1}, stuck_b[2] = {-1, -1}, guessed;
    cr_assert_eq(avgpipe_sched_copy(NULL, s, &c), AVGPIPE_OK);
    if (fault) { /* one op of a random rank, out of what the shape or the placement allows */
        unsigned x = seed * 2654435761u + 7;
        int rr = (int)(shuffle_rng(&x) % (unsigned)c.nranks), i;
        for (i = 0; i < c.nranks && c.len[rr] == 0; i++) rr = (rr + 1) % c.nranks;
        if (c.len[rr] > 0) {
            avgpipe_op *op = &c.ops[rr][shuffle_rng(&x) % (unsigned)c.len[rr]];
            switch (fault) {
            case 1: op->pipe = (int16_t)c.shape.pipes; break;                  /* a pipeline past the shape's */
            case 2: op->micro = c.shape.micro * c.shape.rounds + (int)(x % 3); break; /* a micro-batch (or round) past it */
            case 3: op->micro = -1; break;
            case 4: op->stage = (op->stage + 1) % (c.nstages + 1); break;      /* another rank's stage, or none */
            case 5: op->kind = AVGPIPE_OP_KIND_COUNT; break;
            case 6: op->pipe = -1; break;
            default: c.shape.micro = c.shape.micro > 1 ? c.shape.micro - 1 : 1; break; /* a shape that undercounts */
            }
        }
    }
    sd.record_events = seed % 2 ? AVGPIPE_SIM_EVENTS_ALL : 0;
    guessed = avgpipe__sim_guess(&c, &sd, &ext);
    avgpipe_context_init(&qa, NULL);
    avgpipe_context_init(&qb, NULL);
    ra = avgpipe__sim_core(&qa, &c, &sd, &a, stuck_a, NULL, 0);
    snprintf(ea, sizeof ea, "%s", avgpipe_last_error(&qa));
    rb = avgpipe__sim_core(&qb, &c, &sd, &b, stuck_b, NULL, 1);
    cr_assert_eq(rb, ra, "%s fault %d: %s guessed, %s scanned (%s)", what, fault, avgpipe_result_string(rb), avgpipe_result_string(ra), ea);
    if (ra) {
        cr_assert_str_eq(avgpipe_last_error(&qb), ea, "%s fault %d", what, fault);
        cr_assert(stuck_a[0] == stuck_b[0] && stuck_a[1] == stuck_b[1], "%s fault %d: stuck at %d/%d, scanned %d/%d", what, fault, stuck_b[0],
                  stuck_b[1], stuck_a[0], stuck_a[1]);
    } else {
        cr_assert_eq(b.makespan, a.makespan, "%s fault %d: makespan %g guessed, %g scanned", what, fault, b.makespan, a.makespan);
        cr_assert_eq(b.ops, a.ops, "%s fault %d", what, fault);
        cr_assert_eq(b.nevents, a.nevents, "%s fault %d", what, fault);
        cr_assert(a.nevents == 0 || memcmp(a.events, b.events, a.nevents * sizeof *a.events) == 0, "%s fault %d: events differ", what, fault);
        for (r = 0; r < c.nranks; r++)
            cr_assert(memcmp(&a.rank[r], &b.rank[r], sizeof a.rank[r]) == 0, "%s fault %d: rank %d's stats differ", what, fault, r);
        avgpipe_sim_result_free(NULL, &a);
        avgpipe_sim_result_free(NULL, &b);
    }
    avgpipe_sched_free(NULL, &c);
    return guessed | (ra != AVGPIPE_OK) << 1;
}

Test(plan, unlowered_slots_are_the_lowered_plans) {
    static const avgpipe_sched_kind kinds[] = {AVGPIPE_SCHED_AFAB,        AVGPIPE_SCHED_1F1B, AVGPIPE_SCHED_ADVANCE,
                                               AVGPIPE_SCHED_INTERLEAVED, AVGPIPE_SCHED_ZBH1, AVGPIPE_SCHED_ZBV,
                                               AVGPIPE_SCHED_DUALPIPEV};
    int ki, S, M, N, cont, K, mode, cases = 0;
    avgpipe__slot_memo memo[2];
    memset(memo, 0, sizeof memo);
    memo[1].limit = 700; /* words: a few ranks' keys */
    for (ki = 0; ki < (int)(sizeof kinds / sizeof kinds[0]); ki++)
        for (S = 1; S <= 5; S++)
            for (M = 1; M <= 6; M++)
                for (N = 1; N <= 2; N++)
                    for (cont = 0; cont <= 1; cont++)
                        for (K = 0; K <= (kinds[ki] == AVGPIPE_SCHED_ADVANCE || kinds[ki] == AVGPIPE_SCHED_ZBV ? 5 : 0); K++)
                            for (mode = 0; mode < 3; mode++) {
                                avgpipe_sched_desc d = desc_of(kinds[ki], S, M, N, kinds[ki] == AVGPIPE_SCHED_INTERLEAVED ? 2 + M % 2 : 1, 2, K, cont);
                                avgpipe_schedule s, u;
                                char what[256];
                                if (!gen_with_sync(&d, mode, &s)) continue; /* a shape the kind refuses */
                                snprintf(what, sizeof what, "%s mode %d", shape_str(&d), mode);
                                expect_unlowered_slots(&s, 1, memo, what);
                                shuffled(&s, (unsigned)cases, &u);
                                strncat(what, " shuffled", sizeof what - strlen(what) - 1);
                                expect_unlowered_slots(&u, 0, memo, what);
                                avgpipe_sched_free(NULL, &u);
                                avgpipe_sched_free(NULL, &s);
                                cases++;
                            }
    cr_assert_gt(cases, 1000, "only %d cases ran", cases);
    /* the cache was used: ranks repeat (advance forward's K moves a warm-up by one rank), and the small
       one started again */
    cr_assert(memo[0].hits > 1000 && memo[0].misses > 0 && memo[1].hits > 0 && memo[1].restarts > 10, "hits %lld/%lld, restarts %lld",
              memo[0].hits, memo[1].hits, memo[1].restarts);
    cr_log_info("%d schedules, each also shuffled; ranks from the cache: %lld of %lld (small cache: %lld, %lld restarts)", cases, memo[0].hits,
                memo[0].hits + memo[0].misses, memo[1].hits, memo[1].restarts);
    avgpipe__slot_memo_free(NULL, &memo[0]);
    avgpipe__slot_memo_free(NULL, &memo[1]);
}

/* The slots of schedules s and a variant v counted one after the other with one cache of ranks: each
   its own plan's. The variants move one thing a rank's slots depend on and leave the rest: */
static int variant_micro(avgpipe_schedule *v, int r) { /* two backwards of rank r swap micro-batches */
    int i, j;
    for (i = 0; i < v->len[r]; i++)
        for (j = i + 1; j < v->len[r] && avgpipe__is_backward(v->ops[r][i].kind); j++)
            if (v->ops[r][j].kind == v->ops[r][i].kind && v->ops[r][j].micro != v->ops[r][i].micro && v->ops[r][j].pipe == v->ops[r][i].pipe) {
                int u = v->ops[r][i].micro;
                v->ops[r][i].micro = v->ops[r][j].micro;
                v->ops[r][j].micro = u;
                return 1;
            }
    return 0;
}
static int variant_flag(avgpipe_schedule *v, int r) { /* rank r's first backward overlaps the op after it */
    int i;
    for (i = 0; i + 1 < v->len[r]; i++)
        if (avgpipe__is_backward(v->ops[r][i].kind)) {
            v->ops[r][i].flags ^= AVGPIPE_OPF_OVERLAP_NEXT;
            return 1;
        }
    return 0;
}
static int variant_order(avgpipe_schedule *v, int r) { /* rank r - 1's first and last forwards swap: rank r's messages come in another order */
    int i, first = -1, last = -1;
    if (r < 1) return 0;
    for (i = 0; i < v->len[r - 1]; i++)
        if (v->ops[r - 1][i].kind == AVGPIPE_OP_F) {
            if (first < 0) first = i;
            last = i;
        }
    if (first < 0 || last == first) return 0;
    {
        avgpipe_op o = v->ops[r - 1][first];
        v->ops[r - 1][first] = v->ops[r - 1][last];
        v->ops[r - 1][last] = o;
    }
    return 1;
}

Test(plan, slot_cache_tells_apart_what_moves_slots) {
    static const avgpipe_sched_kind kinds[] = {AVGPIPE_SCHED_1F1B, AVGPIPE_SCHED_ADVANCE, AVGPIPE_SCHED_ZBH1, AVGPIPE_SCHED_ZBV};
    int (*const vary[3])(avgpipe_schedule *, int) = {variant_micro, variant_flag, variant_order};
    int ki, S, M, N, w, r, cases = 0, changed = 0;
    avgpipe__slot_memo memo[2];
    memset(memo, 0, sizeof memo);
    memo[1].limit = 700;
    for (ki = 0; ki < (int)(sizeof kinds / sizeof kinds[0]); ki++)
        for (S = 2; S <= 4; S++)
            for (M = 2; M <= 5; M++)
                for (N = 1; N <= 2; N++)
                    for (w = 0; w < 3; w++)
                        for (r = 0; r < S; r++) {
                            avgpipe_sched_desc d = desc_of(kinds[ki], S, M, N, 1, 1, kinds[ki] == AVGPIPE_SCHED_ADVANCE ? 1 : 0, 0);
                            avgpipe_schedule s, v;
                            char what[256];
                            int a[64], b[64], g;
                            if (!gen_with_sync(&d, 0, &s)) continue;
                            cr_assert_eq(avgpipe_sched_copy(NULL, &s, &v), AVGPIPE_OK);
                            if (r < v.nranks && vary[w](&v, r)) {
                                snprintf(what, sizeof what, "%s variant %d of rank %d", shape_str(&d), w, r);
                                expect_unlowered_slots(&s, 0, memo, what);
                                expect_unlowered_slots(&v, 0, memo, what);
                                cr_assert_eq(avgpipe__plan_slots_unlowered(NULL, &s, NULL, NULL, a), AVGPIPE_OK);
                                cr_assert_eq(avgpipe__plan_slots_unlowered(NULL, &v, NULL, NULL, b), AVGPIPE_OK);
                                for (g = 0; g < s.nstages && a[g] == b[g]; g++) {}
                                changed += g < s.nstages; /* the variant moved the slots: a stale hit would have shown */
                                cases++;
                            }
                            avgpipe_sched_free(NULL, &v);
                            avgpipe_sched_free(NULL, &s);
                        }
    cr_assert(cases > 300 && changed > 30, "%d variants, %d with other slots", cases, changed);
    cr_log_info("%d variants, %d with other slots than their schedule's; ranks from the cache: %lld", cases, changed, memo[0].hits);
    avgpipe__slot_memo_free(NULL, &memo[0]);
    avgpipe__slot_memo_free(NULL, &memo[1]);
}

Test(closed_form, guessed_extent_simulates_as_the_scan) {
    static const avgpipe_sched_kind kinds[] = {AVGPIPE_SCHED_AFAB,        AVGPIPE_SCHED_1F1B, AVGPIPE_SCHED_ADVANCE,
                                               AVGPIPE_SCHED_INTERLEAVED, AVGPIPE_SCHED_ZBH1, AVGPIPE_SCHED_ZBV,
                                               AVGPIPE_SCHED_DUALPIPEV};
    int ki, S, M, N, cont, mode, fault, cases = 0, guessed = 0, failed = 0;
    for (ki = 0; ki < (int)(sizeof kinds / sizeof kinds[0]); ki++)
        for (S = 1; S <= 4; S++)
            for (M = 1; M <= 5; M++)
                for (N = 1; N <= 2; N++)
                    for (cont = 0; cont <= 1; cont++)
                        for (mode = 0; mode < 3; mode++) {
                            avgpipe_sched_desc d = desc_of(kinds[ki], S, M, N, kinds[ki] == AVGPIPE_SCHED_INTERLEAVED ? 2 : 1, 2,
                                                           kinds[ki] == AVGPIPE_SCHED_ADVANCE ? M % 3 : 0, cont);
                            avgpipe_schedule s, u;
                            char what[256];
                            if (!gen_with_sync(&d, mode, &s)) continue;
                            snprintf(what, sizeof what, "%s mode %d", shape_str(&d), mode);
                            for (fault = 0; fault <= 7; fault++, cases++) {
                                int got = expect_guess_is_scan(&s, fault, (unsigned)cases, what);
                                if (fault == 0) {
                                    cr_assert(got & 1, "%s: a generated schedule's shape allows the guess", what);
                                    cr_assert(!(got & 2), "%s: %s", what, avgpipe_last_error(NULL));
                                    guessed++;
                                }
                                failed += (got & 2) != 0;
                            }
                            shuffled(&s, (unsigned)cases, &u); /* mostly deadlocks: the ops after them unchecked */
                            strncat(what, " shuffled", sizeof what - strlen(what) - 1);
                            for (fault = 0; fault <= 7; fault++, cases++) failed += (expect_guess_is_scan(&u, fault, (unsigned)cases, what) & 2) != 0;
                            avgpipe_sched_free(NULL, &u);
                            avgpipe_sched_free(NULL, &s);
                        }
    cr_assert_gt(guessed, 500, "only %d generated schedules", guessed);
    cr_assert_gt(failed, cases / 2, "only %d of %d runs refused: the faults should make most fail", failed, cases);
    cr_log_info("%d simulations compared (%d generated schedules, faults, shuffles; %d refused)", cases, guessed, failed);
}

/* Idle slots count for the guess (it cannot tell them apart before the run) but not for the size
   check: a sparse numbering padded with idle ops is refused as the scan refuses it. */
Test(closed_form, guessed_extent_refuses_sparse_numbering) {
    int pad;
    for (pad = 0; pad <= 2 * AVGPIPE__CELLS_FLOOR; pad += AVGPIPE__CELLS_FLOOR) {
        avgpipe_sched_desc sh = desc_of(AVGPIPE_SCHED_CUSTOM, 1, AVGPIPE__CELLS_FLOOR + 100, 1, 1, 1, 0, 0);
        avgpipe_schedule s;
        avgpipe_op idle;
        int i, got;
        char what[64];
        memset(&idle, 0, sizeof idle);
        cr_assert_eq(avgpipe_sched_init(NULL, &s, 1, &sh), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
        cr_assert_eq(avgpipe_sched_push(NULL, &s, 0, avgpipe__op(AVGPIPE_OP_F, 0, 0, sh.micro - 1)), AVGPIPE_OK);
        cr_assert_eq(avgpipe_sched_push(NULL, &s, 0, avgpipe__op(AVGPIPE_OP_B, 0, 0, sh.micro - 1)), AVGPIPE_OK);
        for (i = 0; i < pad; i++) cr_assert_eq(avgpipe_sched_push(NULL, &s, 0, idle), AVGPIPE_OK);
        snprintf(what, sizeof what, "%d idle ops", pad);
        got = expect_guess_is_scan(&s, 0, 0, what);
        cr_assert_eq(got, (pad > 0) | 2, "%s: guessed %d, refused %d", what, got & 1, (got & 2) >> 1);
        avgpipe_sched_free(NULL, &s);
    }
}
