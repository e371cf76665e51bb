/* The reference validator: avgpipe_sched_validate as it was before the fast deadlock replay (commit
   a18940c, avgpipe.h section 5), kept for the tests to compare the fast one with. Same static checks
   (the code is the old one, renamed), same memory model check, and the old replay: lower the
   compute-only lists with avgpipe_sched_lower (the whole lowered schedule, SEND/RECV ops and all),
   simulate it with blocking sends, then with asynchronous ones after a deadlock, and map the stuck
   op back to the schedule's own list. Only the public API is used (placements through
   avgpipe_stage_rank; the stuck op read from the simulator's deadlock message), so the reference
   does not move when the library's internals do.

   Include after avgpipe.h (with its implementation) in a test. */
#ifndef AVGPIPE_TESTS_REF_VALIDATOR_H
#define AVGPIPE_TESTS_REF_VALIDATOR_H

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The placement tables, built the way the library builds them: channel ids in order of first use,
   walking the boundaries g|g+1 upwards, the forward channel before the backward one. */
typedef struct ref_place {
    int G, S, nchan;
    int *rank, *up, *down, *src, *dst;
} ref_place;

static int ref_place_chan(ref_place *pl, int a, int b) {
    int c;
    for (c = 0; c < pl->nchan; c++)
        if (pl->src[c] == a && pl->dst[c] == b) return c;
    pl->src[pl->nchan] = a;
    pl->dst[pl->nchan] = b;
    return pl->nchan++;
}

static int ref_place_build(const avgpipe_schedule *s, ref_place *pl) {
    int g, G = s->nstages;
    memset(pl, 0, sizeof *pl);
    pl->G = G;
    pl->S = s->nranks;
    pl->rank = (int *)calloc((size_t)G * 7 + 2, sizeof(int));
    if (!pl->rank) return 0;
    pl->up = pl->rank + G;
    pl->down = pl->up + G;
    pl->src = pl->down + G;
    pl->dst = pl->src + 2 * (size_t)G + 1;
    for (g = 0; g < G; g++) {
        pl->rank[g] = avgpipe_stage_rank(s, g);
        pl->up[g] = pl->down[g] = -1;
    }
    for (g = 0; g + 1 < G; g++) {
        int a = pl->rank[g], b = pl->rank[g + 1];
        if (a == b || a < 0 || b < 0) continue;
        pl->up[g] = ref_place_chan(pl, a, b);
        pl->down[g + 1] = ref_place_chan(pl, b, a);
    }
    return 1;
}

typedef struct ref_msg {
    uint8_t kind;
    int16_t pipe;
    int32_t stage, micro;
    int32_t rank, pos;
} ref_msg;

typedef struct ref_msgs {
    ref_msg *v;
    int n, cap;
} ref_msgs;

static int ref_msgs_push(ref_msgs *q, ref_msg x) {
    if (q->n == q->cap) {
        int cap = q->cap ? 2 * q->cap : 64;
        ref_msg *p = (ref_msg *)realloc(q->v, (size_t)cap * sizeof x);
        if (!p) return 0;
        q->v = p;
        q->cap = cap;
    }
    q->v[q->n++] = x;
    return 1;
}

typedef struct ref_vstate {
    avgpipe_context *ctx;
    const avgpipe_schedule *s;
    avgpipe_validate_report *rep;
    int S, G, N, M, R;
    uint8_t *st;
    uint8_t *step;
    ref_place pl;
    ref_msgs *sendq, *recvq;
    int any_step;
} ref_vstate;

enum { REF_VF = 1, REF_VB = 2, REF_VI = 4, REF_VW = 8, REF_VRF = 16, REF_VRB = 32 };

static int ref_is_backward(int k) { return k == AVGPIPE_OP_B || k == AVGPIPE_OP_I; }

static avgpipe_result ref_vfail(ref_vstate *v, avgpipe_result res, int rank, int pos, const char *fmt, ...) {
    va_list ap;
    avgpipe_validate_report *rep = v->rep;
    char body[400];
    va_start(ap, fmt);
    vsnprintf(body, sizeof body, fmt, ap);
    va_end(ap);
    rep->result = res;
    rep->rank = rank;
    rep->pos = pos;
    rep->op_text[0] = 0;
    if (rank >= 0 && pos >= 0 && rank < v->s->nranks && pos < v->s->len[rank])
        avgpipe_op_format(&v->s->ops[rank][pos], 0, rep->op_text, sizeof rep->op_text);
    if (pos >= 0)
        snprintf(rep->message, sizeof rep->message, "rank %d, position %d, op %s: %s", rank, pos, rep->op_text, body);
    else
        snprintf(rep->message, sizeof rep->message, "%s", body);
    return avgpipe_set_error(v->ctx, res, "%s", rep->message);
}

static size_t ref_vix(const ref_vstate *v, int p, int g, int u) {
    return ((size_t)p * (size_t)v->G + (size_t)g) * (size_t)(v->M * v->R) + (size_t)u;
}

static avgpipe_result ref_check_op(ref_vstate *v, int r, int i) {
    const avgpipe_op *op = &v->s->ops[r][i];
    int k = op->kind, g = op->stage, p = op->pipe, u = op->micro, G = v->G, MR = v->M * v->R;
    uint8_t *x;
    ref_msg msg;
    if (k == AVGPIPE_OP_IDLE || k == AVGPIPE_OP_UNSHARD || k == AVGPIPE_OP_RESHARD || k == AVGPIPE_OP_REDUCE_GRAD) return AVGPIPE_OK;
    if (k >= AVGPIPE_OP_KIND_COUNT) return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "unknown op kind %d", k);
    if (g < 0 || g >= G) return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "stage %d out of range 0..%d", g, G - 1);
    if (v->pl.rank[g] != r)
        return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "stage %d lives on rank %d, not %d (%s placement)", g, v->pl.rank[g], r,
                         avgpipe_placement_name(v->s->shape.placement));
    if (p < 0 || p >= v->N) return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "pipeline %d out of range 0..%d", p, v->N - 1);
    if (k == AVGPIPE_OP_STEP || k == AVGPIPE_OP_AVG) {
        uint8_t *sx;
        int j;
        if (u < 0 || u >= v->R) return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "round %d out of range 0..%d", u, v->R - 1);
        sx = &v->step[((size_t)p * G + g) * v->R + u];
        v->any_step = 1;
        if (k == AVGPIPE_OP_AVG) {
            if (!(*sx & 1)) return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "AVG before its STEP");
            if (*sx & 2) return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "duplicate AVG");
            *sx |= 2;
            return AVGPIPE_OK;
        }
        if (*sx & 1) return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "duplicate STEP");
        for (j = u * v->M; j < (u + 1) * v->M; j++) {
            uint8_t b = v->st[ref_vix(v, p, g, j)];
            if (!(b & REF_VB) && !(b & REF_VW))
                return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "STEP before the backward work of micro-batch %d", j);
        }
        *sx |= 1;
        return AVGPIPE_OK;
    }
    if (u < 0 || u >= MR)
        return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "micro-batch %d out of range 0..%d (micro x rounds)", u, MR - 1);
    x = &v->st[ref_vix(v, p, g, u)];
    msg.pipe = (int16_t)p;
    msg.micro = u;
    msg.rank = r;
    msg.pos = i;
    switch (k) {
    case AVGPIPE_OP_F:
        if (*x & REF_VF) return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "duplicate forward");
        if (g > 0 && v->pl.rank[g - 1] == r && !(v->st[ref_vix(v, p, g - 1, u)] & REF_VF))
            return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "forward before the forward of stage %d it needs", g - 1);
        if (v->s->has_comm && g > 0 && v->pl.rank[g - 1] != r && !(*x & REF_VRF))
            return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "forward without a RECV_F posted before it");
        if (v->any_step && u >= v->M && !(v->step[((size_t)p * G + g) * v->R + u / v->M - 1] & 1))
            return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "forward of round %d before STEP of round %d", u / v->M, u / v->M - 1);
        *x |= REF_VF;
        break;
    case AVGPIPE_OP_B:
    case AVGPIPE_OP_I:
        if (!(*x & REF_VF)) return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "backward before its forward");
        if (*x & (REF_VB | REF_VI)) return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "duplicate backward");
        if (g < G - 1 && v->pl.rank[g + 1] == r && !(v->st[ref_vix(v, p, g + 1, u)] & (REF_VB | REF_VI)))
            return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "backward before the backward of stage %d it needs", g + 1);
        if (v->s->has_comm && g < G - 1 && v->pl.rank[g + 1] != r && !(*x & REF_VRB))
            return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "backward without a RECV_B posted before it");
        *x |= k == AVGPIPE_OP_B ? REF_VB : REF_VI;
        break;
    case AVGPIPE_OP_W:
        if (!(*x & REF_VI)) return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "W before its I");
        if (*x & REF_VW) return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "duplicate W");
        *x |= REF_VW;
        break;
    case AVGPIPE_OP_SEND_F:
    case AVGPIPE_OP_SEND_B: {
        int fwd = k == AVGPIPE_OP_SEND_F, g2 = g + (fwd ? 1 : -1);
        if (fwd ? !(*x & REF_VF) : !(*x & (REF_VB | REF_VI)))
            return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "send before the op that produces its data");
        if (g2 < 0 || g2 >= G || v->pl.rank[g2] == r)
            return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "send with no consumer on another rank");
        msg.kind = (uint8_t)(fwd ? AVGPIPE_OP_F : AVGPIPE_OP_B);
        msg.stage = g2;
        if (!ref_msgs_push(&v->sendq[fwd ? v->pl.up[g] : v->pl.down[g]], msg))
            return ref_vfail(v, AVGPIPE_OUT_OF_MEMORY, -1, -1, "validator: out of memory");
        break;
    }
    case AVGPIPE_OP_RECV_F:
    case AVGPIPE_OP_RECV_B: {
        int fwd = k == AVGPIPE_OP_RECV_F, g2 = g + (fwd ? -1 : 1);
        if (g2 < 0 || g2 >= G || v->pl.rank[g2] == r)
            return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "receive with no producer on another rank");
        if (*x & (fwd ? REF_VRF : REF_VRB)) return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, r, i, "duplicate receive");
        *x |= fwd ? REF_VRF : REF_VRB;
        msg.kind = (uint8_t)(fwd ? AVGPIPE_OP_F : AVGPIPE_OP_B);
        msg.stage = g;
        if (!ref_msgs_push(&v->recvq[fwd ? v->pl.up[g2] : v->pl.down[g2]], msg))
            return ref_vfail(v, AVGPIPE_OUT_OF_MEMORY, -1, -1, "validator: out of memory");
        break;
    }
    default: break;
    }
    return AVGPIPE_OK;
}

static avgpipe_result ref_check_complete(ref_vstate *v) {
    int p, g, u, t;
    for (p = 0; p < v->N; p++)
        for (g = 0; g < v->G; g++) {
            for (u = 0; u < v->M * v->R; u++) {
                uint8_t b = v->st[ref_vix(v, p, g, u)];
                if (!(b & REF_VF))
                    return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, v->pl.rank[g], -1,
                                     "rank %d: pipeline %d stage %d micro-batch %d has no forward (missing forward)", v->pl.rank[g], p, g,
                                     u);
                if (!(b & (REF_VB | REF_VI)))
                    return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, v->pl.rank[g], -1,
                                     "rank %d: pipeline %d stage %d micro-batch %d has no backward", v->pl.rank[g], p, g, u);
                if ((b & REF_VI) && !(b & REF_VW))
                    return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, v->pl.rank[g], -1,
                                     "rank %d: pipeline %d stage %d micro-batch %d has I but no W", v->pl.rank[g], p, g, u);
            }
            if (v->any_step)
                for (t = 0; t < v->R; t++)
                    if (!(v->step[((size_t)p * v->G + g) * v->R + t] & 1))
                        return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, v->pl.rank[g], -1, "rank %d: pipeline %d stage %d has no STEP for round %d",
                                         v->pl.rank[g], p, g, t);
        }
    return AVGPIPE_OK;
}

static avgpipe_result ref_check_channels(ref_vstate *v) {
    int c, j;
    for (c = 0; c < v->pl.nchan; c++) {
        ref_msgs *a = &v->sendq[c], *b = &v->recvq[c];
        int n = a->n < b->n ? a->n : b->n, src = v->pl.src[c], dst = v->pl.dst[c];
        for (j = 0; j < n; j++) {
            ref_msg *x = &a->v[j], *y = &b->v[j];
            if (x->kind != y->kind || x->pipe != y->pipe || x->stage != y->stage || x->micro != y->micro) {
                char tx[64], ty[64];
                avgpipe_op_format(&v->s->ops[x->rank][x->pos], 0, tx, sizeof tx);
                avgpipe_op_format(&v->s->ops[y->rank][y->pos], 0, ty, sizeof ty);
                return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, y->rank, y->pos,
                                 "mismatched send/receive order on channel rank %d -> rank %d, message #%d: sent %s (rank %d "
                                 "position %d), received as %s",
                                 src, dst, j, tx, x->rank, x->pos, ty);
            }
        }
        if (a->n != b->n) {
            ref_msg *x = a->n > b->n ? &a->v[n] : &b->v[n];
            return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, x->rank, x->pos, "channel rank %d -> rank %d has %d sends but %d receives", src,
                             dst, a->n, b->n);
        }
    }
    return AVGPIPE_OK;
}

static avgpipe_result ref_check_static(ref_vstate *v) {
    avgpipe_result res = AVGPIPE_OK;
    int r, i;
    for (r = 0; r < v->S && !res; r++)
        for (i = 0; i < v->s->len[r] && !res; i++) res = ref_check_op(v, r, i);
    if (!res) res = ref_check_complete(v);
    if (!res && v->s->has_comm) res = ref_check_channels(v);
    return res;
}

static void ref_static_peaks(const avgpipe_schedule *s, int *peak, int nmax) {
    int r, i;
    for (r = 0; r < s->nranks && r < nmax; r++) {
        int cur = 0, best = 0;
        for (i = 0; i < s->len[r]; i++) {
            int k = s->ops[r][i].kind;
            if (k == AVGPIPE_OP_F && ++cur > best) best = cur;
            if (k == AVGPIPE_OP_B || k == AVGPIPE_OP_W) cur--;
        }
        peak[r] = best;
    }
}

static avgpipe_result ref_check_memory(ref_vstate *v) {
    const avgpipe_sched_desc *sh = &v->s->shape;
    int r;
    if (sh->kind == AVGPIPE_SCHED_CUSTOM) return AVGPIPE_OK;
    for (r = 0; r < v->S && r < 256; r++) {
        int model = avgpipe_sched_peak_stash(sh, r), got = v->rep->peak_stash[r], bound;
        if (model < 0) continue;
        bound = sh->kind == AVGPIPE_SCHED_ZBV && sh->continuous;
        if (bound ? got > model : got != model)
            return ref_vfail(v, AVGPIPE_INVALID_SCHEDULE, r, -1, "rank %d stashes %d activations at its peak but the memory model of %s says %s%d",
                             r, got, avgpipe_sched_kind_name(sh->kind), bound ? "at most " : "", model);
    }
    return AVGPIPE_OK;
}

static int ref_find_origin(const avgpipe_schedule *s, int r, const avgpipe_op *lo) {
    int i, k = lo->kind;
    for (i = 0; i < s->len[r]; i++) {
        const avgpipe_op *op = &s->ops[r][i];
        int match = op->kind == k;
        if (k == AVGPIPE_OP_SEND_F || k == AVGPIPE_OP_RECV_F) match = op->kind == AVGPIPE_OP_F;
        if (k == AVGPIPE_OP_SEND_B || k == AVGPIPE_OP_RECV_B) match = ref_is_backward(op->kind);
        if (match && op->pipe == lo->pipe && op->stage == lo->stage && op->micro == lo->micro) return i;
    }
    return -1;
}

/* The simulator through the public API; after a deadlock, stuck[] gets the first stuck rank and
   its position, read from the message ("... rank R waits at position P (...)"). */
static avgpipe_result ref_sim(avgpipe_context *ctx, const avgpipe_schedule *s, const avgpipe_sim_desc *d, int *stuck) {
    avgpipe_sim_result sr;
    avgpipe_result res = avgpipe_sim_run(ctx, s, d, &sr);
    if (!res) avgpipe_sim_result_free(ctx, &sr);
    if (res == AVGPIPE_DEADLOCK) {
        const char *m = strstr(avgpipe_last_error(ctx), "): rank ");
        if (!m || sscanf(m, "): rank %d waits at position %d", &stuck[0], &stuck[1]) != 2) stuck[0] = stuck[1] = -1;
    }
    return res;
}

static avgpipe_result ref_replay(ref_vstate *v) {
    avgpipe_schedule low;
    const avgpipe_schedule *x = v->s;
    avgpipe_sim_desc d;
    avgpipe_result res = AVGPIPE_OK;
    int blocking, brank = -1, bpos = -1;
    char detail[360];
    memset(&low, 0, sizeof low);
    if (!x->has_comm) {
        res = avgpipe_sched_lower(v->ctx, x, &low);
        if (res) return ref_vfail(v, res, -1, -1, "%s", avgpipe_last_error(v->ctx));
        x = &low;
    }
    for (blocking = 1; blocking >= 0; blocking--) {
        int stuck[2] = {-1, -1}, rank = -1, pos = -1;
        memset(&d, 0, sizeof d);
        d.blocking_send = blocking;
        res = ref_sim(v->ctx, x, &d, stuck);
        if (!res) {
            if (blocking) break;
            res = ref_vfail(v, AVGPIPE_DEADLOCK, brank, bpos, "%s%s", detail, x == &low ? " (in the lowered schedule)" : "");
            continue;
        }
        snprintf(detail, sizeof detail, "%.359s", avgpipe_last_error(v->ctx));
        if (stuck[0] >= 0) {
            rank = stuck[0];
            pos = x == &low ? ref_find_origin(v->s, rank, &low.ops[rank][stuck[1]]) : stuck[1];
            if (pos < 0) rank = -1;
        }
        if (blocking) {
            brank = rank;
            bpos = pos;
        }
        res = ref_vfail(v, res, rank, pos, "%s%s", detail, x == &low ? " (in the lowered schedule)" : "");
        if (res != AVGPIPE_DEADLOCK) break;
    }
    avgpipe_sched_free(v->ctx, &low);
    return res;
}

/* The bound the library put on the validator's tables: at most 8 cells per op, plus a floor. */
static int ref_cells_ok(double cells, long long nops) { return cells <= 8.0 * (double)nops + 4096; }

static avgpipe_result ref_validate(avgpipe_context *ctx, const avgpipe_schedule *s, const avgpipe_validate_desc *desc,
                                   avgpipe_validate_report *report) {
    avgpipe_validate_report local;
    ref_vstate v;
    avgpipe_result res = AVGPIPE_OK;
    size_t cells;
    long long nops = 0;
    int c, i;
    if (!report) report = &local;
    memset(report, 0, sizeof *report);
    report->rank = report->pos = -1;
    if (!s || !s->len || s->nranks < 1) {
        report->result = AVGPIPE_INVALID_ARG;
        snprintf(report->message, sizeof report->message, "avgpipe_sched_validate: empty schedule");
        return avgpipe_set_error(ctx, AVGPIPE_INVALID_ARG, "%s", report->message);
    }
    memset(&v, 0, sizeof v);
    v.ctx = ctx;
    v.s = s;
    v.rep = report;
    v.S = s->nranks;
    v.G = s->nstages;
    v.N = s->shape.pipes > 0 ? s->shape.pipes : 1;
    v.M = s->shape.micro > 0 ? s->shape.micro : 1;
    v.R = s->shape.rounds > 0 ? s->shape.rounds : 1;
    cells = (size_t)v.N * v.G * v.M * v.R;
    if ((double)v.N * v.G * v.M * v.R > 4e8) return ref_vfail(&v, AVGPIPE_INVALID_ARG, -1, -1, "avgpipe_sched_validate: schedule too large");
    for (c = 0; c < v.S; c++)
        for (i = 0; i < s->len[c]; i++) nops += s->ops[c][i].kind != AVGPIPE_OP_IDLE;
    if (!ref_cells_ok((double)v.N * v.G * v.M * v.R, nops))
        return ref_vfail(&v, AVGPIPE_INVALID_SCHEDULE, -1, -1,
                         "the shape's %d pipelines x %d stages x %d micro-batches x %d rounds need %.4g forwards, the schedule has %lld "
                         "ops (missing forwards)",
                         v.N, v.G, v.M, v.R, (double)v.N * v.G * v.M * v.R, nops);
    v.st = (uint8_t *)calloc(cells + 1, 1);
    v.step = (uint8_t *)calloc((size_t)v.N * v.G * v.R + 1, 1);
    if (v.st && v.step && ref_place_build(s, &v.pl)) {
        v.sendq = (ref_msgs *)calloc((size_t)v.pl.nchan + 1, sizeof(ref_msgs));
        v.recvq = (ref_msgs *)calloc((size_t)v.pl.nchan + 1, sizeof(ref_msgs));
    }
    if (!v.st || !v.step || !v.sendq || !v.recvq) res = ref_vfail(&v, AVGPIPE_OUT_OF_MEMORY, -1, -1, "validator: out of memory");
    for (c = 0; c < v.G && !res; c++)
        if (v.pl.rank[c] < 0)
            res = ref_vfail(&v, AVGPIPE_INVALID_SCHEDULE, -1, -1, "stage %d is not placed on any rank (custom placement of %d stages)", c,
                            s->nplace);
    if (!res) res = ref_check_static(&v);
    ref_static_peaks(s, report->peak_stash, 256);
    if (!res && !(desc && desc->skip_memory)) res = ref_check_memory(&v);
    if (!res && !(desc && desc->skip_replay)) res = ref_replay(&v);
    if (v.sendq)
        for (c = 0; c < v.pl.nchan; c++) free(v.sendq[c].v);
    if (v.recvq)
        for (c = 0; c < v.pl.nchan; c++) free(v.recvq[c].v);
    free(v.sendq);
    free(v.recvq);
    free(v.pl.rank);
    free(v.st);
    free(v.step);
    report->result = res;
    return res;
}

#endif
