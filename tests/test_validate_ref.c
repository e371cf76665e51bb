/* The fast validator against the reference (tests/ref_validator.h: the validator as it was before its
   deadlock replay stopped lowering the schedule). Both must give the same result code, the same
   report (rank, position, op, peak stash) and, except for deadlocks, the same message. A deadlock's
   message differs on purpose: the reference names positions in the lowered schedule it built, the
   fast one names positions in the schedule's own lists (the report's rank and position were and are
   in the schedule's own list, and must agree); both say which send semantics deadlocked.
   One documented difference: a compute-only schedule (has_comm = 0) holding SEND/RECV ops is
   refused at its first such op ("... in a compute-only schedule"), where the reference lowered it
   into a second set of sends and receives.

   Cases: every generator over a grid of S, M, N, rounds, round modes (K for advance and ZB-V, V for
   interleaved; ZB-V and DualPipeV on their V placement), each as generated, lowered, with its ranks
   permuted (a custom placement) and that lowered; random mutations (swaps, moves, deletions,
   duplicates, changed fields, overlap flags toggled, idle slots, ranks exchanged) of generated,
   lowered, imported (tests/data) and custom-placed schedules; hand-made custom
   placements. The suite counts the rejections of each kind and asserts that the mutations reach
   every kind of verdict (a test that can fail).

   Build and run from the repository root:
     gcc -std=c11 -O2 -Wall -Wextra -pedantic -Werror -I. tests/test_validate_ref.c -o /tmp/test_validate_ref \
         -lcriterion -lm -lpthread && /tmp/test_validate_ref
   AVGPIPE_GOLDEN_DIR overrides the golden directory (default tests/data). */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"

#include <criterion/criterion.h>
#include "tests/sched_helpers.h"
#include "tests/ref_validator.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- agreement --------------------------------------------------------------------------------- */

typedef struct tally {
    long cases, ok, invalid, deadlock_blocking, deadlock_async, compute_only_comm;
} tally;

static int has_comm_ops(const avgpipe_schedule *s) {
    int r, i;
    for (r = 0; r < s->nranks; r++)
        for (i = 0; i < s->len[r]; i++)
            if (s->ops[r][i].kind >= AVGPIPE_OP_SEND_F && s->ops[r][i].kind <= AVGPIPE_OP_RECV_B) return 1;
    return 0;
}

/* Validate s with both validators under desc (may be NULL) and compare everything. */
static void agree_desc(const avgpipe_schedule *s, const avgpipe_validate_desc *desc, const char *what, tally *t) {
    avgpipe_validate_report a, b;
    avgpipe_result ra, rb;
    int r;
    memset(&a, 0x5a, sizeof a);
    memset(&b, 0x5a, sizeof b);
    rb = ref_validate(NULL, s, desc, &b);
    ra = avgpipe_sched_validate(NULL, s, desc, &a);
    cr_assert_eq(ra, a.result, "%s: return %d, report %d", what, ra, a.result);
    if (ra) cr_assert_str_eq(avgpipe_last_error(NULL), a.message, "%s: the last error differs from the report", what);
    t->cases++;
    if (!s->has_comm && has_comm_ops(s)) { /* the documented difference */
        cr_assert_eq(ra, AVGPIPE_INVALID_SCHEDULE, "%s: a compute-only schedule with SEND/RECV ops validated (%s)", what, a.message);
        if (rb != AVGPIPE_INVALID_SCHEDULE || b.rank != a.rank || b.pos != a.pos)
            cr_assert_not_null(strstr(a.message, "in a compute-only schedule"), "%s: %s (reference: %s)", what, a.message, b.message);
        t->compute_only_comm++;
        return;
    }
    cr_assert_eq(ra, rb, "%s: fast %s, reference %s\n  fast: %s\n  ref:  %s", what, avgpipe_result_string(ra), avgpipe_result_string(rb),
                 a.message, b.message);
    cr_assert_eq(a.rank, b.rank, "%s: rank %d, reference %d\n  fast: %s\n  ref:  %s", what, a.rank, b.rank, a.message, b.message);
    cr_assert_eq(a.pos, b.pos, "%s: position %d, reference %d\n  fast: %s\n  ref:  %s", what, a.pos, b.pos, a.message, b.message);
    cr_assert_str_eq(a.op_text, b.op_text, "%s", what);
    for (r = 0; r < s->nranks && r < 256; r++)
        cr_assert_eq(a.peak_stash[r], b.peak_stash[r], "%s: rank %d peak %d, reference %d", what, r, a.peak_stash[r], b.peak_stash[r]);
    if (ra == AVGPIPE_DEADLOCK) {
        int blocking = strstr(b.message, "deadlock (blocking sends)") != NULL;
        cr_assert(blocking || strstr(b.message, "deadlock (async sends)"), "%s: reference message %s", what, b.message);
        cr_assert_not_null(strstr(a.message, blocking ? "deadlock (blocking sends)" : "deadlock (async sends)"),
                           "%s: fast '%s', reference '%s'", what, a.message, b.message);
        if (blocking) t->deadlock_blocking++;
        else t->deadlock_async++;
    } else {
        cr_assert_str_eq(a.message, b.message, "%s", what);
        if (ra == AVGPIPE_OK) t->ok++;
        else t->invalid++;
    }
}

/* Full validation and static checks alone; with skip_memory too when asked (mutations change the
   peak stash, which would hide the replay behind the memory model). */
static void agree(const avgpipe_schedule *s, const char *what, int all_descs, tally *t) {
    avgpipe_validate_desc d;
    agree_desc(s, NULL, what, t);
    if (!all_descs) return;
    memset(&d, 0, sizeof d);
    d.skip_memory = 1;
    agree_desc(s, &d, what, t);
    d.skip_replay = 1;
    agree_desc(s, &d, what, t);
}

/* ---- schedules --------------------------------------------------------------------------------- */

/* A deterministic generator (tests must not depend on the run). */
static unsigned long long lcg_state;
static unsigned rnd(unsigned n) {
    lcg_state = lcg_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return n ? (unsigned)((lcg_state >> 33) % n) : 0;
}

/* s with rank r moved to perm[r] (a custom placement unless the map happens to be a named one); the
   memory model of the generator does not follow the ranks, so the shape becomes custom. */
static void permute(const avgpipe_schedule *s, const int *perm, avgpipe_schedule *out) {
    int g, r, i, *map = (int *)malloc(((size_t)s->nstages + 1) * sizeof(int));
    avgpipe_placement pl;
    cr_assert_not_null(map);
    for (g = 0; g < s->nstages; g++) map[g] = perm[avgpipe_stage_rank(s, g)];
    cr_assert_eq(avgpipe_sched_init(NULL, out, s->nranks, NULL), AVGPIPE_OK);
    cr_assert_eq(avgpipe_sched_set_place(NULL, out, map, s->nstages), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
    pl = out->shape.placement;
    out->shape = s->shape;
    out->shape.kind = AVGPIPE_SCHED_CUSTOM;
    out->shape.placement = pl;
    for (r = 0; r < s->nranks; r++)
        for (i = 0; i < s->len[r]; i++) cr_assert_eq(avgpipe_sched_push(NULL, out, perm[r], s->ops[r][i]), AVGPIPE_OK);
    out->has_comm = s->has_comm;
    free(map);
}

/* A permutation of S ranks that moves every rank when S > 1. */
static void some_perm(int S, int *perm) {
    int r;
    for (r = 0; r < S; r++) perm[r] = (S - 1 - r + (S % 2 ? 1 : 0)) % S;
}

/* s, s lowered, s permuted, s permuted and lowered: each agreed on. */
static void agree_family(const avgpipe_schedule *s, const char *what, tally *t) {
    avgpipe_schedule low, p, pl;
    int perm[64];
    char w[256];
    agree(s, what, 0, t);
    if (s->has_comm) return;
    cr_assert_eq(avgpipe_sched_lower(NULL, s, &low), AVGPIPE_OK, "%s: %s", what, avgpipe_last_error(NULL));
    snprintf(w, sizeof w, "%s lowered", what);
    agree(&low, w, 0, t);
    avgpipe_sched_free(NULL, &low);
    if (s->nranks < 2 || s->nranks > 64) return;
    some_perm(s->nranks, perm);
    permute(s, perm, &p);
    snprintf(w, sizeof w, "%s permuted (%s placement)", what, avgpipe_placement_name(p.shape.placement));
    agree(&p, w, 0, t);
    cr_assert_eq(avgpipe_sched_lower(NULL, &p, &pl), AVGPIPE_OK, "%s: %s", w, avgpipe_last_error(NULL));
    snprintf(w, sizeof w, "%s permuted and lowered", what);
    agree(&pl, w, 0, t);
    avgpipe_sched_free(NULL, &pl);
    avgpipe_sched_free(NULL, &p);
}

/* ---- (a) every generator over a grid ------------------------------------------------------------- */

static const int grid_M[] = {1, 2, 3, 4, 5, 6, 8, 12};
#define GRID_NM ((int)(sizeof grid_M / sizeof grid_M[0]))

static void grid(avgpipe_sched_kind kind) {
    static const int Ks[] = {0, 1, 2, 5};
    tally t;
    int S, mi, N, R, cont, ki, V;
    memset(&t, 0, sizeof t);
    for (S = 1; S <= 6; S++)
        for (mi = 0; mi < GRID_NM; mi++)
            for (N = 1; N <= 3; N++)
                for (R = 1; R <= 2; R++)
                    for (cont = 0; cont < 2; cont++)
                        for (V = kind == AVGPIPE_SCHED_INTERLEAVED ? 2 : 1; V <= (kind == AVGPIPE_SCHED_INTERLEAVED ? 3 : 1); V++)
                            for (ki = 0; ki < (kind == AVGPIPE_SCHED_ADVANCE || kind == AVGPIPE_SCHED_ZBV ? 4 : 1); ki++) {
                                avgpipe_sched_desc d = desc_of(kind, S, grid_M[mi], N, V, R, Ks[ki], cont);
                                avgpipe_schedule s;
                                char what[200];
                                if (gen_skips(&d) || (kind == AVGPIPE_SCHED_INTERLEAVED && grid_M[mi] % S)) continue;
                                gen(&d, &s);
                                snprintf(what, sizeof what, "%s", shape_str(&d));
                                agree_family(&s, what, &t);
                                cr_assert_eq(t.deadlock_blocking + t.deadlock_async + t.invalid, 0, "%s: a generated schedule fails", what);
                                avgpipe_sched_free(NULL, &s);
                            }
    cr_assert_gt(t.cases, 400, "only %ld cases", t.cases);
}

Test(grid, afab) { grid(AVGPIPE_SCHED_AFAB); }
Test(grid, one_f_one_b) { grid(AVGPIPE_SCHED_1F1B); }
Test(grid, advance) { grid(AVGPIPE_SCHED_ADVANCE); }
Test(grid, interleaved) { grid(AVGPIPE_SCHED_INTERLEAVED); }
Test(grid, zbh1) { grid(AVGPIPE_SCHED_ZBH1); }
Test(grid, zbv) { grid(AVGPIPE_SCHED_ZBV); }
Test(grid, dualpipev) { grid(AVGPIPE_SCHED_DUALPIPEV); }

Test(grid, greedy) {
    tally t;
    int S, M, N, R, cont, split;
    memset(&t, 0, sizeof t);
    for (S = 1; S <= 5; S++)
        for (M = 1; M <= 6; M++)
            for (N = 1; N <= 2; N++)
                for (R = 1; R <= 2; R++)
                    for (cont = 0; cont < 2; cont++)
                        for (split = 0; split < 2; split++) {
                            avgpipe_greedy_desc g;
                            avgpipe_schedule s;
                            char what[160];
                            memset(&g, 0, sizeof g);
                            g.shape.stages = S, g.shape.micro = M, g.shape.pipes = N, g.shape.rounds = R, g.shape.continuous = cont, g.split_backward = split;
                            cr_assert_eq(avgpipe_sched_greedy(NULL, &g, &s), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
                            snprintf(what, sizeof what, "greedy S=%d M=%d N=%d R=%d cont=%d split=%d", S, M, N, R, cont, split);
                            agree_family(&s, what, &t);
                            avgpipe_sched_free(NULL, &s);
                        }
    cr_assert_eq(t.deadlock_blocking + t.deadlock_async + t.invalid, 0);
}

/* ---- (b) mutations ------------------------------------------------------------------------------- */

/* A copy of s whose rank r holds ops[0..n). */
static void with_list(const avgpipe_schedule *s, int r, const avgpipe_op *ops, int n, avgpipe_schedule *out) {
    int i;
    cr_assert_eq(avgpipe_sched_copy(NULL, s, out), AVGPIPE_OK);
    avgpipe_free(NULL, out->ops[r]);
    out->ops[r] = NULL;
    out->len[r] = 0;
    for (i = 0; i < n; i++) cr_assert_eq(avgpipe_sched_push(NULL, out, r, ops[i]), AVGPIPE_OK);
}

/* One random change to s (into out). */
static void mutate_once(const avgpipe_schedule *s, avgpipe_schedule *out) {
    int r = (int)rnd((unsigned)s->nranks), n = s->len[r], i, j;
    avgpipe_op *o = (avgpipe_op *)malloc(((size_t)n + 2) * sizeof *o), x;
    unsigned what = rnd(19);
    cr_assert_not_null(o);
    memcpy(o, s->ops[r], (size_t)n * sizeof *o);
    if (n == 0) what = 9;
    i = n ? (int)rnd((unsigned)n) : 0;
    j = n ? (int)rnd((unsigned)n) : 0;
    switch (what) {
    case 0: case 1: /* swap neighbours: valid orders, memory changes, deadlocks */
        if (i + 1 < n) x = o[i], o[i] = o[i + 1], o[i + 1] = x;
        break;
    case 2: /* swap any two */
        x = o[i], o[i] = o[j], o[j] = x;
        break;
    case 3: case 4: /* move one op a few places (later or earlier) */
        j = i + (int)rnd(7) - 3;
        if (j < 0) j = 0;
        if (j >= n) j = n - 1;
        x = o[i];
        if (j > i) memmove(o + i, o + i + 1, (size_t)(j - i) * sizeof *o);
        else memmove(o + j + 1, o + j, (size_t)(i - j) * sizeof *o);
        o[j] = x;
        break;
    case 5: /* delete */
        memmove(o + i, o + i + 1, (size_t)(n - i - 1) * sizeof *o);
        n--;
        break;
    case 6: /* duplicate */
        memmove(o + i + 1, o + i, (size_t)(n - i) * sizeof *o);
        n++;
        break;
    case 7: o[i].micro += rnd(2) ? 1 : -1; break;
    case 8: o[i].stage += rnd(2) ? 1 : -1; break;
    case 9: /* an idle slot (with or without an overlap flag) */
        memmove(o + i + 1, o + i, (size_t)(n - i) * sizeof *o);
        memset(&o[i], 0, sizeof o[i]);
        o[i].flags = (uint8_t)(rnd(3) == 0 ? AVGPIPE_OPF_OVERLAP_NEXT : 0);
        n++;
        break;
    case 10: /* overlap groups: join or split */
        o[i].flags ^= AVGPIPE_OPF_OVERLAP_NEXT;
        break;
    case 11: { /* another kind */
        static const uint8_t to[] = {AVGPIPE_OP_F, AVGPIPE_OP_B, AVGPIPE_OP_I, AVGPIPE_OP_W, AVGPIPE_OP_STEP, AVGPIPE_OP_AVG,
                                     AVGPIPE_OP_SEND_F, AVGPIPE_OP_RECV_B, AVGPIPE_OP_UNSHARD};
        o[i].kind = to[rnd(sizeof to)];
        break;
    }
    case 12: o[i].pipe = (int16_t)(o[i].pipe + 1); break;
    case 14: case 15: /* swap two ops of one kind a few places apart (two forwards: the classic deadlock) */
        for (j = i + 1; j < n && j < i + 8; j++)
            if (o[j].kind == o[i].kind && rnd(2)) break;
        if (j < n && o[j].kind == o[i].kind) x = o[i], o[i] = o[j], o[j] = x;
        break;
    case 16: /* postpone a receive, up to its consumer (blocking sends may now wait for it) */
        for (j = 0; j < n && !(o[(i + j) % n].kind == AVGPIPE_OP_RECV_F || o[(i + j) % n].kind == AVGPIPE_OP_RECV_B); j++) continue;
        if (j < n) {
            int a = (i + j) % n, b = a + 1, k = o[a].kind == AVGPIPE_OP_RECV_F ? AVGPIPE_OP_F : -1;
            while (b < n && !(o[b].stage == o[a].stage && o[b].micro == o[a].micro && o[b].pipe == o[a].pipe &&
                              (k == AVGPIPE_OP_F ? o[b].kind == k : (o[b].kind == AVGPIPE_OP_B || o[b].kind == AVGPIPE_OP_I))))
                b++;
            b = a + (b - a > 1 ? 1 + (int)rnd((unsigned)(b - a - 1)) : 0); /* a new place before the consumer */
            if (b > a && b <= n) {
                x = o[a];
                memmove(o + a, o + a + 1, (size_t)(b - 1 - a) * sizeof *o);
                o[b - 1] = x;
            }
        }
        break;
    case 17: case 18: { /* every receive of the rank posted just before its consumer, as a naive trainer would */
        avgpipe_op *lazy = (avgpipe_op *)malloc(((size_t)n + 2) * sizeof *lazy);
        int *used = (int *)calloc((size_t)n + 2, sizeof(int)), a, b;
        cr_assert(lazy && used);
        for (a = 0, b = 0; a < n; a++) {
            int k = o[a].kind, q;
            if (k == AVGPIPE_OP_RECV_F || k == AVGPIPE_OP_RECV_B) continue;
            for (q = 0; q < a && (k == AVGPIPE_OP_F || k == AVGPIPE_OP_B || k == AVGPIPE_OP_I); q++) /* its receive, if any */
                if (!used[q] && o[q].stage == o[a].stage && o[q].micro == o[a].micro && o[q].pipe == o[a].pipe &&
                    o[q].kind == (k == AVGPIPE_OP_F ? AVGPIPE_OP_RECV_F : AVGPIPE_OP_RECV_B)) {
                    used[q] = 1;
                    lazy[b++] = o[q];
                }
            lazy[b++] = o[a];
        }
        for (a = 0; a < n; a++) /* receives with no consumer after them stay at the end */
            if ((o[a].kind == AVGPIPE_OP_RECV_F || o[a].kind == AVGPIPE_OP_RECV_B) && !used[a]) lazy[b++] = o[a];
        memcpy(o, lazy, (size_t)n * sizeof *o);
        free(lazy);
        free(used);
        break;
    }
    default: { /* exchange two ranks' lists */
        avgpipe_schedule c;
        int r2 = (int)rnd((unsigned)s->nranks);
        cr_assert_eq(avgpipe_sched_copy(NULL, s, &c), AVGPIPE_OK);
        with_list(&c, r, s->ops[r2], s->len[r2], out);
        avgpipe_sched_free(NULL, &c);
        memcpy(&c, out, sizeof c);
        with_list(&c, r2, s->ops[r], s->len[r], out);
        avgpipe_sched_free(NULL, &c);
        free(o);
        return;
    }
    }
    with_list(s, r, o, n, out);
    free(o);
}

/* count mutated copies of base (one to three changes each), each agreed on. */
static void mutations(const avgpipe_schedule *base, const char *what, int count, tally *t) {
    int k, m;
    for (k = 0; k < count; k++) {
        avgpipe_schedule cur, next;
        int changes = 1 + (int)rnd(3);
        char w[256];
        cr_assert_eq(avgpipe_sched_copy(NULL, base, &cur), AVGPIPE_OK);
        for (m = 0; m < changes; m++) {
            mutate_once(&cur, &next);
            avgpipe_sched_free(NULL, &cur);
            cur = next;
        }
        snprintf(w, sizeof w, "%s, mutation #%d (%d changes)", what, k, changes);
        agree(&cur, w, 1, t);
        avgpipe_sched_free(NULL, &cur);
    }
}

/* Every verdict must be reached, or the mutations test nothing. Blocking-only deadlocks come from
   lowered lists (the lowering posts receives early enough that compute-only lists rarely have one). */
static void expect_every_verdict(const tally *t, int need_blocking) {
    cr_assert_gt(t->ok, 0, "no mutation stayed valid");
    cr_assert_gt(t->invalid, 50, "only %ld rejections by the static checks", t->invalid);
    cr_assert_gt(t->deadlock_async + t->deadlock_blocking, 0, "no mutation deadlocks");
    if (need_blocking) cr_assert_gt(t->deadlock_blocking, 0, "no mutation deadlocks only with blocking sends");
}

static void mutate_generated(avgpipe_sched_kind kind, int lowered, int permuted) {
    tally t;
    int S, M, N, R, cont, perm[8];
    memset(&t, 0, sizeof t);
    lcg_state = 12345u + (unsigned)kind * 977u + (unsigned)lowered * 31u + (unsigned)permuted * 7u;
    for (S = 2; S <= 4; S++)
        for (M = 2; M <= 5; M += 3)
            for (N = 1; N <= 2; N++)
                for (R = 1; R <= 2; R++)
                    for (cont = 0; cont < 2; cont++) {
                        avgpipe_sched_desc d = desc_of(kind, S, kind == AVGPIPE_SCHED_INTERLEAVED ? S : M, N, kind == AVGPIPE_SCHED_INTERLEAVED ? 2 : 1, R,
                                                       kind == AVGPIPE_SCHED_ADVANCE || kind == AVGPIPE_SCHED_ZBV ? 1 : 0, cont);
                        avgpipe_schedule s, x, y;
                        char what[200];
                        if (gen_skips(&d)) continue;
                        gen(&d, &s);
                        snprintf(what, sizeof what, "%s%s%s", shape_str(&d), lowered ? " lowered" : "", permuted ? " permuted" : "");
                        if (permuted) {
                            some_perm(S, perm);
                            permute(&s, perm, &x);
                        } else {
                            cr_assert_eq(avgpipe_sched_copy(NULL, &s, &x), AVGPIPE_OK);
                        }
                        if (lowered) {
                            cr_assert_eq(avgpipe_sched_lower(NULL, &x, &y), AVGPIPE_OK);
                            avgpipe_sched_free(NULL, &x);
                            x = y;
                        }
                        mutations(&x, what, 40, &t);
                        avgpipe_sched_free(NULL, &x);
                        avgpipe_sched_free(NULL, &s);
                    }
    cr_log_info("%s%s%s: %ld cases, %ld valid, %ld invalid, %ld blocking-only deadlocks, %ld async deadlocks, %ld compute-only with comm ops",
                avgpipe_sched_kind_name(kind), lowered ? " lowered" : "", permuted ? " permuted" : "", t.cases, t.ok, t.invalid,
                t.deadlock_blocking, t.deadlock_async, t.compute_only_comm);
    expect_every_verdict(&t, lowered && kind != AVGPIPE_SCHED_AFAB); /* AFAB sends back nothing until all forwards are done */
}

#define MUTATION_TESTS(name, kind)                                                  \
    Test(mutations, name) { mutate_generated(kind, 0, 0); }                         \
    Test(mutations, name##_lowered) { mutate_generated(kind, 1, 0); }               \
    Test(mutations, name##_permuted) { mutate_generated(kind, 0, 1); }              \
    Test(mutations, name##_permuted_lowered) { mutate_generated(kind, 1, 1); }

MUTATION_TESTS(afab, AVGPIPE_SCHED_AFAB)
MUTATION_TESTS(one_f_one_b, AVGPIPE_SCHED_1F1B)
MUTATION_TESTS(advance, AVGPIPE_SCHED_ADVANCE)
MUTATION_TESTS(interleaved, AVGPIPE_SCHED_INTERLEAVED)
MUTATION_TESTS(zbh1, AVGPIPE_SCHED_ZBH1)
MUTATION_TESTS(zbv, AVGPIPE_SCHED_ZBV)
MUTATION_TESTS(dualpipev, AVGPIPE_SCHED_DUALPIPEV)

/* The validator runs its static pass first on the guess that a schedule is valid and has no TIE or
   AGREE ops, and every check in its order otherwise (avgpipe__validate_core, guess 0, as it ran
   before): the same report either way, on schedules with ties and agreement (which the reference
   validator does not know) and their mutations, with and without the replay and the memory model;
   and on a sparse numbering padded with idle slots, whose size check comes before every other. */
static void guess_agrees(const avgpipe_schedule *s, const char *what, tally *t) {
    static const avgpipe_validate_desc descs[3] = {{0, 0}, {0, 1}, {1, 1}};
    int k, r;
    for (k = 0; k < 3; k++) {
        avgpipe_validate_report a, b;
        avgpipe_result ra, rb;
        memset(&a, 0x5a, sizeof a);
        memset(&b, 0x5a, sizeof b);
        rb = avgpipe__validate_core(NULL, s, &descs[k], &b, 0);
        ra = avgpipe__validate_core(NULL, s, &descs[k], &a, 1);
        cr_assert_eq(ra, rb, "%s desc %d: %s guessed, %s in order\n  %s\n  %s", what, k, avgpipe_result_string(ra), avgpipe_result_string(rb),
                     a.message, b.message);
        cr_assert_str_eq(a.message, b.message, "%s desc %d", what, k);
        if (ra) cr_assert_str_eq(avgpipe_last_error(NULL), a.message, "%s desc %d", what, k);
        cr_assert(a.rank == b.rank && a.pos == b.pos, "%s desc %d: %s", what, k, a.message);
        cr_assert_str_eq(a.op_text, b.op_text, "%s desc %d", what, k);
        for (r = 0; r < s->nranks && r < 256; r++) cr_assert_eq(a.peak_stash[r], b.peak_stash[r], "%s desc %d: rank %d's peak", what, k, r);
        t->cases++;
        if (ra == AVGPIPE_OK) t->ok++;
        else if (ra == AVGPIPE_DEADLOCK) t->deadlock_async++;
        else t->invalid++;
    }
}

Test(mutations, guessed_static_pass_is_the_ordered_one) {
    static const avgpipe_sched_kind kinds[] = {AVGPIPE_SCHED_AFAB,        AVGPIPE_SCHED_1F1B, AVGPIPE_SCHED_ADVANCE,
                                               AVGPIPE_SCHED_INTERLEAVED, AVGPIPE_SCHED_ZBH1, AVGPIPE_SCHED_ZBV,
                                               AVGPIPE_SCHED_DUALPIPEV};
    tally t;
    int ki, S, R, mode, pad;
    memset(&t, 0, sizeof t);
    lcg_state = 4242u;
    for (ki = 0; ki < (int)(sizeof kinds / sizeof kinds[0]); ki++)
        for (S = 2; S <= 4; S++)
            for (R = 1; R <= 2; R++)
                for (mode = 0; mode < 3; mode++) {
                    avgpipe_sched_kind kind = kinds[ki];
                    avgpipe_sched_desc d = desc_of(kind, S, kind == AVGPIPE_SCHED_INTERLEAVED ? S : 2 * S, 2, kind == AVGPIPE_SCHED_INTERLEAVED ? 2 : 1, R,
                                                   0, 0);
                    avgpipe_schedule s;
                    int k;
                    char what[200], w[256];
                    if (gen_skips(&d)) continue;
                    cr_assert(gen_with_sync(&d, mode, &s), "generate %s: %s", shape_str(&d), avgpipe_last_error(NULL));
                    snprintf(what, sizeof what, "%s mode %d", shape_str(&d), mode);
                    guess_agrees(&s, what, &t);
                    for (k = 0; k < 30; k++) {
                        avgpipe_schedule cur, next;
                        int m, changes = 1 + (int)rnd(3);
                        cr_assert_eq(avgpipe_sched_copy(NULL, &s, &cur), AVGPIPE_OK);
                        for (m = 0; m < changes; m++) {
                            mutate_once(&cur, &next);
                            avgpipe_sched_free(NULL, &cur);
                            cur = next;
                        }
                        snprintf(w, sizeof w, "%s, mutation #%d (%d changes)", what, k, changes);
                        guess_agrees(&cur, w, &t);
                        avgpipe_sched_free(NULL, &cur);
                    }
                    avgpipe_sched_free(NULL, &s);
                }
    for (pad = 0; pad <= 2; pad++) { /* a forward of stage 1 before stage 0's, of 3000 micro-batches, idle slots to spare */
        avgpipe_sched_desc sh = desc_of(AVGPIPE_SCHED_CUSTOM, 1, 3000, 1, 1, 1, 0, 0);
        avgpipe_schedule s;
        avgpipe_op idle, f = {1, 0, 0, AVGPIPE_OP_F, 0, 0};
        int i;
        char what[64];
        memset(&idle, 0, sizeof idle);
        cr_assert_eq(avgpipe_sched_init(NULL, &s, 1, &sh), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
        cr_assert_eq(avgpipe_sched_push(NULL, &s, 0, f), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
        for (i = 0; i < pad * 400; i++) cr_assert_eq(avgpipe_sched_push(NULL, &s, 0, idle), AVGPIPE_OK);
        snprintf(what, sizeof what, "sparse, %d idle slots", pad * 400);
        guess_agrees(&s, what, &t);
        cr_assert_not_null(strstr(avgpipe_last_error(NULL), "missing forwards"), "%s: %s", what, avgpipe_last_error(NULL));
        avgpipe_sched_free(NULL, &s);
    }
    cr_log_info("%ld reports compared: %ld valid, %ld invalid, %ld deadlocks", t.cases, t.ok, t.invalid, t.deadlock_async);
    cr_assert_gt(t.ok, 100, "only %ld valid", t.ok);
    cr_assert_gt(t.invalid, 1000, "only %ld refused", t.invalid);
    cr_assert_gt(t.deadlock_async, 10, "only %ld deadlocks", t.deadlock_async);
}

/* ---- imported schedules ------------------------------------------------------------------------ */

static void load(const char *path, avgpipe_schedule *s) {
    cr_assert_eq(avgpipe_sched_load(NULL, path, s), AVGPIPE_OK, "%s: %s", path, avgpipe_last_error(NULL));
}

Test(imported, files_and_their_mutations) {
    static const char *files[] = {"tests/data/torch_zbv_2rank_4stage_6micro.csv", "tests/data/torch_zbv_4rank_8stage_4micro.csv",
                                  "tests/data/torch_dualpipev_2rank_4stage_4micro.csv", "tests/data/torch_dualpipev_4rank_8stage_10micro.csv",
                                  NULL};
    char golden[1024];
    const char *dir = getenv("AVGPIPE_GOLDEN_DIR");
    tally t;
    size_t f;
    memset(&t, 0, sizeof t);
    lcg_state = 777;
    snprintf(golden, sizeof golden, "%s/torch_zb1p_2rank_2stagep_compute.csv", dir && *dir ? dir : "tests/data");
    for (f = 0; f < 5; f++) {
        const char *path = files[f] ? files[f] : golden;
        avgpipe_schedule s, low;
        char what[1100];
        tally fam;
        memset(&fam, 0, sizeof fam);
        load(path, &s);
        agree_family(&s, path, &fam);
        cr_assert_eq(fam.invalid + fam.deadlock_async + fam.deadlock_blocking, 0, "%s fails", path);
        mutations(&s, path, 150, &t);
        cr_assert_eq(avgpipe_sched_lower(NULL, &s, &low), AVGPIPE_OK);
        snprintf(what, sizeof what, "%s lowered", path);
        mutations(&low, what, 150, &t);
        avgpipe_sched_free(NULL, &low);
        avgpipe_sched_free(NULL, &s);
    }
    expect_every_verdict(&t, 1);
}

/* ---- hand-made schedules and custom placements ---------------------------------------------------- */

static void import_text(const char *text, avgpipe_schedule *s) {
    avgpipe_result r = avgpipe_sched_import(NULL, text, strlen(text), s);
    cr_assert_eq(r, AVGPIPE_OK, "import: %s (%s)\n%s", avgpipe_result_string(r), avgpipe_last_error(NULL), text);
}

/* The hand-made schedules of the validator's tests (tests/test_validate.c), and a few more. */
Test(handmade, texts) {
    static const char *texts[] = {
        "0F0,0F1,0B0,0B1\n1F0,1B0\n",
        "0F0,0RECV_B0,0B0,0SEND_F0\n1RECV_F0,1F0,1B0,1SEND_B0\n",
        "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1\n",
        "0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n",
        "0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1\n",
        "0F0,0F1,0B1,0B0\n1F0,1F1,1B0,1B1\n",
        "0F0,(0F1;0B0)OVERLAP_F_B,0B1\n1F0,1B0,1F1,1B1\n",
        "0F0,0F1,0B0,0B1\n(1F0;1B0)OVERLAP_F_B,(1F1;1B1)OVERLAP_F_B\n",
        "0F0,0F1,0F2,0B0,0B1,0B2\n1F0,1B0,1F1,1B1,1F2,1B2\n",
        "0F0,0F1,0F2,0B0,0B1,0B2\n1F1,1F0,1B0,1F2,1B1,1B2\n",
        "0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n",
        "0F0,0SEND_F0,0B0,0RECV_B0\n1RECV_F0,1F0,1B0,1SEND_B0\n",
        "0F0,0F1,0SEND_F0,0SEND_F1,0RECV_B1,0RECV_B0,0B0,0B1\n1RECV_F0,1RECV_F1,1F0,1F1,1B0,1SEND_B0,1B1,1SEND_B1\n",
        "0F0,0F3,0I3,0I0,0W0,0W3\n1F1,1F2,1I2,1I1,1W1,1W2\n",
        "0F0,0F3,0I3,0W3,0I0,0W0\n1F1,1F2,1I2,1W2,1I1,1W1\n",
    };
    tally t;
    size_t i;
    memset(&t, 0, sizeof t);
    for (i = 0; i < sizeof texts / sizeof texts[0]; i++) {
        avgpipe_schedule s;
        char what[64];
        snprintf(what, sizeof what, "text %zu", i);
        import_text(texts[i], &s);
        agree(&s, what, 1, &t);
        if (!s.has_comm) agree_family(&s, what, &t);
        avgpipe_sched_free(NULL, &s);
    }
    cr_assert_gt(t.deadlock_async, 0);
    cr_assert_gt(t.deadlock_blocking, 0);
    cr_assert_gt(t.ok, 0);
}

/* Custom maps: stages spread over ranks in no named order, several stages per rank, a stage alone,
   non-neighbour channels; a 1F1B-like list per rank built from the map, then mutated. */
static void custom_schedule(const int *map, int G, int S, int M, avgpipe_schedule *s) {
    int r, g, u;
    cr_assert_eq(avgpipe_sched_init(NULL, s, S, NULL), AVGPIPE_OK);
    cr_assert_eq(avgpipe_sched_set_place(NULL, s, map, G), AVGPIPE_OK, "%s", avgpipe_last_error(NULL));
    s->shape.micro = M;
    /* every rank: all forwards of its stages in stage order per micro-batch, then the backwards in
       reverse (an AFAB order that is always valid) */
    for (r = 0; r < S; r++) {
        for (u = 0; u < M; u++)
            for (g = 0; g < G; g++)
                if (map[g] == r) cr_assert_eq(avgpipe_sched_push(NULL, s, r, (avgpipe_op){g, u, 0, AVGPIPE_OP_F, 0, 0}), AVGPIPE_OK);
        for (u = 0; u < M; u++)
            for (g = G - 1; g >= 0; g--)
                if (map[g] == r) cr_assert_eq(avgpipe_sched_push(NULL, s, r, (avgpipe_op){g, u, 0, AVGPIPE_OP_B, 0, 0}), AVGPIPE_OK);
    }
}

Test(handmade, custom_placements) {
    static const int m1[3] = {1, 0, 1}, m2[6] = {0, 2, 1, 1, 2, 0}, m3[5] = {2, 2, 0, 1, 0}, m4[8] = {3, 1, 0, 2, 2, 0, 1, 3};
    static const int *maps[] = {m1, m2, m3, m4};
    static const int G[] = {3, 6, 5, 8}, S[] = {2, 3, 3, 4};
    tally t;
    size_t i;
    int M;
    memset(&t, 0, sizeof t);
    lcg_state = 4242;
    for (i = 0; i < 4; i++)
        for (M = 1; M <= 4; M++) {
            avgpipe_schedule s;
            char what[64];
            custom_schedule(maps[i], G[i], S[i], M, &s);
            cr_assert_eq(s.shape.placement, AVGPIPE_PLACE_CUSTOM);
            snprintf(what, sizeof what, "custom map %zu M=%d", i, M);
            agree_family(&s, what, &t);
            cr_assert_eq(t.invalid + t.deadlock_async + t.deadlock_blocking, 0, "%s fails", what);
            avgpipe_sched_free(NULL, &s);
        }
    for (i = 0; i < 4; i++) {
        avgpipe_schedule s, low;
        char what[64];
        custom_schedule(maps[i], G[i], S[i], 3, &s);
        snprintf(what, sizeof what, "custom map %zu", i);
        mutations(&s, what, 200, &t);
        cr_assert_eq(avgpipe_sched_lower(NULL, &s, &low), AVGPIPE_OK);
        snprintf(what, sizeof what, "custom map %zu lowered", i);
        mutations(&low, what, 200, &t);
        avgpipe_sched_free(NULL, &low);
        avgpipe_sched_free(NULL, &s);
    }
    expect_every_verdict(&t, 0); /* AFAB orders: no blocking-only deadlock */
}
