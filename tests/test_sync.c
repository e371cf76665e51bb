/* Tests of ties and step agreement in the schedule IR (avgpipe_sched_add_sync, TIE and AGREE ops):
   every generated kind takes them and the result validates (compute-only and lowered, both replays)
   and simulates (asynchronous and blocking sends); the text format carries them; the validator
   refuses misplaced ones with the op's position; the simulator charges a tie's bytes only when it
   crosses ranks. (tests/test_tie_run.c runs them.)

   Build and run from the repository root:
     gcc -std=c11 -O2 -Wall -Wextra -pedantic -Werror -I. tests/test_sync.c -o /tmp/test_sync \
         -lcriterion -lm -pthread && /tmp/test_sync */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

static const avgpipe_sched_kind kinds[] = {AVGPIPE_SCHED_AFAB, AVGPIPE_SCHED_1F1B, AVGPIPE_SCHED_ADVANCE, AVGPIPE_SCHED_INTERLEAVED,
                                           AVGPIPE_SCHED_ZBH1, AVGPIPE_SCHED_ZBV, AVGPIPE_SCHED_DUALPIPEV};

static int generate(avgpipe_sched_kind kind, int S, int M, int N, int R, int cont, avgpipe_schedule *s) {
    avgpipe_sched_desc d = {0};
    d.kind = kind;
    d.stages = S;
    d.micro = M;
    d.pipes = N;
    d.rounds = R;
    d.continuous = cont;
    if (kind == AVGPIPE_SCHED_ADVANCE || kind == AVGPIPE_SCHED_ZBV) d.advance = 1;
    if (kind == AVGPIPE_SCHED_INTERLEAVED) d.chunks = 2;
    return avgpipe_sched_generate(NULL, &d, s) == AVGPIPE_OK;
}

static int count_kind(const avgpipe_schedule *s, int kind) {
    int r, i, n = 0;
    for (r = 0; r < s->nranks; r++)
        for (i = 0; i < s->len[r]; i++) n += s->ops[r][i].kind == kind;
    return n;
}

static void validate_ok(const avgpipe_schedule *s, const char *what) {
    avgpipe_validate_report rep;
    avgpipe_validate_desc vd = {0};
    vd.skip_memory = 1; /* the sync ops hold STEPs back, not activations: the stash is checked below */
    cr_assert_eq(avgpipe_sched_validate(NULL, s, &vd, &rep), AVGPIPE_OK, "%s: %s", what, rep.message);
}

Test(sync, every_kind_places_ties_and_agreement_that_validate_and_simulate) {
    int ki, S, M, N, cont, mode, cases = 0;
    avgpipe_sim_desc blocking = {.blocking_send = 1, .latency = 0.25};
    for (ki = 0; ki < (int)(sizeof kinds / sizeof kinds[0]); ki++)
        for (S = 2; S <= 4; S++)
            for (M = 1; M <= 4; M *= 2)
                for (N = 1; N <= 2; N++)
                    for (cont = 0; cont <= 1; cont++)
                        for (mode = 0; mode < 4; mode++) {
                            avgpipe_schedule s, t, l;
                            avgpipe_sim_result r0, r1;
                            avgpipe_tie ties[3];
                            avgpipe_sync_desc sy = {.ties = ties};
                            char what[128];
                            int G, nt, steps;
                            if (!generate(kinds[ki], S, M, N, 2, cont, &s)) continue;
                            G = s.nstages;
                            memset(ties, 0, sizeof ties);
                            /* 0: GPT's tie (first and last stage); 1: with agreement; 2: agreement only;
                               3: two ties, one between middle stages, and agreement */
                            ties[0].stage_a = 0, ties[0].stage_b = G - 1, ties[0].count = 8;
                            ties[1].stage_a = 1, ties[1].stage_b = G - 2 > 1 ? G - 2 : 0, ties[1].count = 8;
                            sy.nties = mode == 2 ? 0 : mode == 3 ? 2 : 1;
                            sy.agree = mode >= 1;
                            snprintf(what, sizeof what, "%s S%d M%d N%d cont %d mode %d", avgpipe_sched_kind_name(kinds[ki]), S, M, N, cont, mode);
                            cr_assert_eq(avgpipe_sched_add_sync(NULL, &s, &sy, &t), AVGPIPE_OK, "%s: %s", what, avgpipe_last_error(NULL));
                            steps = count_kind(&s, AVGPIPE_OP_STEP);
                            /* TIE ops per round and pipeline: two per distinct pair */
                            nt = 2 * (sy.nties >= 1) +
                                 2 * (sy.nties >= 2 && !(ties[1].stage_a == 0 && ties[1].stage_b == G - 1) &&
                                      !(ties[1].stage_b == 0 && ties[1].stage_a == G - 1));
                            cr_assert_eq(count_kind(&t, AVGPIPE_OP_TIE), nt * steps / G, "%s: TIE ops", what);
                            cr_assert_eq(count_kind(&t, AVGPIPE_OP_AGREE), sy.agree ? steps : 0, "%s: AGREE ops", what);
                            cr_assert_eq(count_kind(&t, AVGPIPE_OP_STEP), steps, "%s", what);
                            validate_ok(&t, what);
                            cr_assert_eq(avgpipe_sched_lower(NULL, &t, &l), AVGPIPE_OK, "%s: lower: %s", what, avgpipe_last_error(NULL));
                            validate_ok(&l, what);
                            cr_assert_eq(avgpipe_sim_run(NULL, &s, NULL, &r0), AVGPIPE_OK);
                            cr_assert_eq(avgpipe_sim_run(NULL, &t, NULL, &r1), AVGPIPE_OK, "%s: sim: %s", what, avgpipe_last_error(NULL));
                            cr_assert_geq(r1.makespan, r0.makespan, "%s: the sync only adds waits", what);
                            avgpipe_sim_result_free(NULL, &r0);
                            avgpipe_sim_result_free(NULL, &r1);
                            /* blocking sends: a rank blocked in a send still reaches the sync ops after it */
                            cr_assert_eq(avgpipe_sim_run(NULL, &t, &blocking, &r1), AVGPIPE_OK, "%s: blocking sim: %s", what,
                                         avgpipe_last_error(NULL));
                            avgpipe_sim_result_free(NULL, &r1);
                            avgpipe_sched_free(NULL, &s);
                            avgpipe_sched_free(NULL, &t);
                            avgpipe_sched_free(NULL, &l);
                            cases++;
                        }
    cr_assert_gt(cases, 500, "only %d cases ran", cases);
}

/* The buffer plan's slots of the lowered schedule with its TIE and AGREE ops.
   The ops name a round where others name a micro-batch, and they use no boundary buffer, so the
   plan must be that of the schedule without them (until 0.10.1 each held the slot of the
   micro-batch numbered like its round until its round's end: 10 slots instead of 4 on 1F1B's
   first stage with S = M = 4, N = 2, 4 rounds). */
static void plan_slots_of(const avgpipe_schedule *s, int *slots, const char *what) {
    avgpipe_schedule low;
    avgpipe_buffer_plan plan;
    size_t act[16];
    int g;
    for (g = 0; g < 16; g++) act[g] = 64;
    cr_assert_eq(avgpipe_sched_lower(NULL, s, &low), AVGPIPE_OK, "%s: lower: %s", what, avgpipe_last_error(NULL));
    cr_assert_eq(avgpipe_buffer_plan_build(NULL, &low, act, &plan), AVGPIPE_OK, "%s: plan: %s", what, avgpipe_last_error(NULL));
    for (g = 0; g < s->nstages; g++) slots[g] = plan.slots[g];
    avgpipe_buffer_plan_free(NULL, &plan);
    avgpipe_sched_free(NULL, &low);
}

Test(sync, ties_and_agreement_take_no_buffer_slots) {
    int ki, S, M, N, cont, mode, g, cases = 0;
    for (ki = 0; ki < (int)(sizeof kinds / sizeof kinds[0]); ki++)
        for (S = 2; S <= 4; S++)
            for (M = 1; M <= 4; M *= 2)
                for (N = 1; N <= 2; N++)
                    for (cont = 0; cont <= 1; cont++)
                        for (mode = 0; mode < 2; mode++) {
                            avgpipe_schedule s, t;
                            avgpipe_tie tie;
                            avgpipe_sync_desc sy = {.ties = &tie, .nties = 1};
                            int a[16], b[16];
                            char what[128];
                            if (!generate(kinds[ki], S, M, N, 4, cont, &s)) continue;
                            memset(&tie, 0, sizeof tie);
                            tie.stage_a = 0, tie.stage_b = s.nstages - 1, tie.count = 8;
                            sy.agree = mode;
                            snprintf(what, sizeof what, "%s S%d M%d N%d cont %d agree %d", avgpipe_sched_kind_name(kinds[ki]), S, M, N, cont, mode);
                            cr_assert_eq(avgpipe_sched_add_sync(NULL, &s, &sy, &t), AVGPIPE_OK, "%s: %s", what, avgpipe_last_error(NULL));
                            plan_slots_of(&s, a, what);
                            plan_slots_of(&t, b, what);
                            for (g = 0; g < s.nstages; g++)
                                cr_assert_eq(b[g], a[g], "%s: stage %d has %d slots with the sync ops, %d without", what, g, b[g], a[g]);
                            avgpipe_sched_free(NULL, &s);
                            avgpipe_sched_free(NULL, &t);
                            cases++;
                        }
    cr_assert_gt(cases, 150, "only %d cases ran", cases);
}

Test(sync, text_format_carries_tie_peers_and_agreement) {
    avgpipe_schedule s, t, u;
    avgpipe_tie tie = {0, 3, 0, 0, 4};
    avgpipe_sync_desc sy = {.ties = &tie, .nties = 1, .agree = 1};
    avgpipe_buf b = {0};
    int r;
    cr_assert(generate(AVGPIPE_SCHED_1F1B, 4, 4, 2, 2, 1, &s));
    cr_assert_eq(avgpipe_sched_add_sync(NULL, &s, &sy, &t), AVGPIPE_OK);
    cr_assert_eq(avgpipe_sched_export(NULL, &t, 0, &b), AVGPIPE_OK);
    cr_assert(strstr((const char *)b.data, "3TIE0@0") && strstr((const char *)b.data, "1:0TIE1@3") && strstr((const char *)b.data, "2AGREE1"),
              "%.*s", (int)b.len, (const char *)b.data);
    cr_assert_eq(avgpipe_sched_import(NULL, (const char *)b.data, b.len, &u), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
    for (r = 0; r < t.nranks; r++) {
        cr_assert_eq(u.len[r], t.len[r]);
        cr_assert_eq(memcmp(u.ops[r], t.ops[r], (size_t)t.len[r] * sizeof(avgpipe_op)), 0, "rank %d differs after export -> import", r);
    }
    {
        const char *bad = "0F0,0B0,0TIE0,0STEP0\n";
        avgpipe_schedule x;
        cr_assert_eq(avgpipe_sched_import(NULL, bad, strlen(bad), &x), AVGPIPE_PARSE_ERROR);
        cr_assert(strstr(avgpipe_last_error(NULL), "'@'"), "%s", avgpipe_last_error(NULL));
    }
    avgpipe_buf_free(NULL, &b);
    avgpipe_sched_free(NULL, &s);
    avgpipe_sched_free(NULL, &t);
    avgpipe_sched_free(NULL, &u);
}

static void expect_invalid(const char *text, avgpipe_result want, const char *needle, int rank, int pos) {
    avgpipe_schedule s;
    avgpipe_validate_report rep;
    cr_assert_eq(avgpipe_sched_import(NULL, text, strlen(text), &s), AVGPIPE_OK, "%s\n%s", avgpipe_last_error(NULL), text);
    cr_assert_eq(avgpipe_sched_validate(NULL, &s, NULL, &rep), want, "want %s, got: %s\n%s", avgpipe_result_string(want), rep.message, text);
    cr_assert(strstr(rep.message, needle), "message '%s' lacks '%s'", rep.message, needle);
    if (rank >= 0) cr_assert(rep.rank == rank && rep.pos == pos, "at rank %d pos %d, not %d %d: %s", rep.rank, rep.pos, rank, pos, rep.message);
    avgpipe_sched_free(NULL, &s);
}

Test(sync, validator_refuses_misplaced_sync_ops) {
    /* S = 2, M = 1: the good one first */
    const char *good = "0F0,0B0,0TIE0@1,0AGREE0,0STEP0,0AVG0\n1F0,1B0,1TIE0@0,1AGREE0,1STEP0,1AVG0\n";
    avgpipe_schedule s;
    cr_assert_eq(avgpipe_sched_import(NULL, good, strlen(good), &s), AVGPIPE_OK);
    cr_assert_eq(avgpipe_sched_validate(NULL, &s, NULL, NULL), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
    avgpipe_sched_free(NULL, &s);
    expect_invalid("0F0,0B0,0AGREE0,0STEP0,0AVG0\n1F0,1B0,1TIE0@0,1AGREE0,1STEP0,1AVG0\n", AVGPIPE_INVALID_SCHEDULE, "AGREE before its TIEs", 0, 2);
    expect_invalid("0F0,0TIE0@1,0B0,0AGREE0,0STEP0,0AVG0\n1F0,1B0,1TIE0@0,1AGREE0,1STEP0,1AVG0\n", AVGPIPE_INVALID_SCHEDULE,
                   "TIE before the backward work of micro-batch 0", 0, 1);
    expect_invalid("0F0,0B0,0TIE0@1,0STEP0,0AVG0\n1F0,1B0,1TIE0@0,1AGREE0,1STEP0,1AVG0\n", AVGPIPE_INVALID_SCHEDULE, "STEP before its AGREE", 0, 3);
    expect_invalid("0F0,0B0,0TIE0@0,0AGREE0,0STEP0,0AVG0\n1F0,1B0,1AGREE0,1STEP0,1AVG0\n", AVGPIPE_INVALID_SCHEDULE, "with itself", 0, 2);
    expect_invalid("0F0,0B0,0TIE0@1,0TIE0@1,0AGREE0,0STEP0,0AVG0\n1F0,1B0,1TIE0@0,1AGREE0,1STEP0,1AVG0\n", AVGPIPE_INVALID_SCHEDULE, "duplicate TIE", 0, 3);
    expect_invalid("0F0,0B0,0STEP0,0TIE0@1,0AVG0\n1F0,1B0,1TIE0@0,1STEP0,1AVG0\n", AVGPIPE_INVALID_SCHEDULE, "STEP before its TIEs", 0, 2);
    /* two pipelines: the AGREE groups in different orders on the two ranks */
    expect_invalid("0F0,1:0F0,0B0,1:0B0,1:0AGREE0,0AGREE0,0STEP0,1:0STEP0,0AVG0,1:0AVG0\n"
                   "1F0,1B0,1:1F0,1:1B0,1AGREE0,1:1AGREE0,1STEP0,1:1STEP0,1AVG0,1:1AVG0\n",
                   AVGPIPE_INVALID_SCHEDULE, "AGREE group #0 of rank 1 differs from rank 0's", -1, -1);
    /* a TIE the other side can never meet: rank 0 holds pipeline 0's TIE until after pipeline 1's
       backward, which needs rank 1's, which waits in its TIE */
    expect_invalid("0F0,1:0F0,0B0,0TIE0@1,0STEP0,0AVG0,1:0B0,1:0TIE0@1,1:0STEP0,1:0AVG0\n"
                   "1F0,1B0,1TIE0@0,1STEP0,1AVG0,1:1F0,1:1B0,1:1TIE0@0,1:1STEP0,1:1AVG0\n",
                   AVGPIPE_OK, "", -1, -1);
    expect_invalid("0F0,1:0F0,0B0,1:0B0,0TIE0@1,0STEP0,0AVG0,1:0TIE0@1,1:0STEP0,1:0AVG0\n"
                   "1F0,1B0,1TIE0@0,1STEP0,1AVG0,1:1F0,1:1B0,1:1TIE0@0,1:1STEP0,1:1AVG0\n",
                   AVGPIPE_DEADLOCK, "rank 1 waits at position 2 (1TIE0@0, for rank 0's TIE)", 0, 3);
}

Test(sync, add_sync_refuses_bad_ties_naming_them) {
    avgpipe_schedule s, t;
    avgpipe_tie tie = {0, 9, 0, 0, 4};
    avgpipe_sync_desc sy = {.ties = &tie, .nties = 1, .agree = 0};
    cr_assert(generate(AVGPIPE_SCHED_1F1B, 4, 4, 1, 1, 0, &s));
    cr_assert_eq(avgpipe_sched_add_sync(NULL, &s, &sy, &t), AVGPIPE_INVALID_ARG);
    cr_assert(strstr(avgpipe_last_error(NULL), "ties[0] names stage 9"), "%s", avgpipe_last_error(NULL));
    tie.stage_b = 0;
    cr_assert_eq(avgpipe_sched_add_sync(NULL, &s, &sy, &t), AVGPIPE_INVALID_ARG);
    cr_assert(strstr(avgpipe_last_error(NULL), "ties stage 0 to itself"), "%s", avgpipe_last_error(NULL));
    tie.stage_b = 3;
    {
        avgpipe_schedule l;
        cr_assert_eq(avgpipe_sched_lower(NULL, &s, &l), AVGPIPE_OK);
        cr_assert_eq(avgpipe_sched_add_sync(NULL, &l, &sy, &t), AVGPIPE_INVALID_SCHEDULE);
        cr_assert(strstr(avgpipe_last_error(NULL), "compute-only"), "%s", avgpipe_last_error(NULL));
        avgpipe_sched_free(NULL, &l);
    }
    { /* an op that can never run: named by its rank and position (until 0.10.1 the position was read
         from freed memory) */
        int i = 0;
        avgpipe_op x;
        while (s.ops[0][i].kind != AVGPIPE_OP_B) i++;
        x = s.ops[0][0], s.ops[0][0] = s.ops[0][i], s.ops[0][i] = x; /* rank 0 starts with a backward */
        cr_assert_eq(avgpipe_sched_add_sync(NULL, &s, &sy, &t), AVGPIPE_INVALID_SCHEDULE);
        cr_assert(strstr(avgpipe_last_error(NULL), "rank 0 position 0 (") && strstr(avgpipe_last_error(NULL), "never becomes ready"), "%s",
                  avgpipe_last_error(NULL));
    }
    avgpipe_sched_free(NULL, &s);
}

/* How much longer the kind's schedule (S, M = S, one pipeline and round) takes in the simulator with a tie
   between its first and last stage, 100 bytes at 10 bytes per unit with latency 1. */
static double tie_delay(avgpipe_sched_kind kind, int S) {
    avgpipe_schedule s, t;
    avgpipe_tie tie = {0, 0, 0, 0, 4};
    avgpipe_sync_desc sy = {.ties = &tie, .nties = 1, .agree = 0};
    avgpipe_sim_desc sd = {0};
    avgpipe_sim_result r0, r1;
    double d;
    cr_assert(generate(kind, S, S == 2 && kind == AVGPIPE_SCHED_AFAB ? 1 : S, 1, 1, 0, &s));
    tie.stage_b = s.nstages - 1;
    cr_assert_eq(avgpipe_sched_add_sync(NULL, &s, &sy, &t), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
    sd.tie_bytes = 100;
    sd.bandwidth = 10;
    sd.latency = 1;
    cr_assert_eq(avgpipe_sim_run(NULL, &s, &sd, &r0), AVGPIPE_OK);
    cr_assert_eq(avgpipe_sim_run(NULL, &t, &sd, &r1), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
    d = r1.makespan - r0.makespan;
    avgpipe_sim_result_free(NULL, &r0);
    avgpipe_sim_result_free(NULL, &r1);
    avgpipe_sched_free(NULL, &s);
    avgpipe_sched_free(NULL, &t);
    return d;
}

Test(sync, a_tie_costs_its_transfer_only_across_ranks) {
    /* AFAB, S = 2, M = 1: the TIE of both ranks starts when rank 0's backward ends and takes the
       transfer, 100 / 10 + 1 = 11 units, and nothing follows it */
    cr_assert_float_eq(tie_delay(AVGPIPE_SCHED_AFAB, 2), 11, 1e-9);
    /* ZB-V: stages 0 and 2S-1 share rank 0, so their tie moves nothing */
    cr_assert_float_eq(tie_delay(AVGPIPE_SCHED_ZBV, 2), 0, 1e-9);
}
