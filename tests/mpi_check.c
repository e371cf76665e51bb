/* mpi_check.c — the runtime over MPI, one rank per process, checked; run by tests/test_mpi.c under
   mpirun (and by hand: `mpirun -np 4 build/mpi_check equal 1f1b 2 0.3`).

   Modes (argv[1]); every process prints one line "mpi_check rank R: ..." and the exit status says:
     equal KIND N ALPHA [D [H]]   every schedule kind's run over MPI (S = size / D processes per replica
                                  group, deterministic mode, 3 iterations of 2 rounds) must give, bit for
                                  bit, the parameters of every model and the references that the same
                                  description gives in one process on threads (rank 0 runs that too and
                                  compares; with D > 1 also against float64 two-level averaging, 1e-6).
                                  Exit 0 when equal, 1 when not.
     kill VICTIM TIMEOUT          rank VICTIM SIGKILLs itself in the middle of its second iteration; every
                                  other process must return an error within about TIMEOUT seconds,
                                  naming the dead rank or the op that waited for it, and exit 3.
     disagree                     rank 1 describes micro = 8, the others micro = 4: every process must be
                                  refused at create (AVGPIPE_MISMATCH naming sched.micro): exit 3.
     drop | dup                   rank 0's 4th message to rank 1 is lost / sent twice: the run must
                                  fail with AVGPIPE_MISMATCH at the receive, naming both ops: exit 3.
   Exit 2: a usage or setup error. Run with --mca orte_abort_on_non_zero_status 0 for `kill` (else
   mpirun kills the survivors before they can report). */
#define _POSIX_C_SOURCE 200809L
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"
#include "avgpipe_mpi.h"

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include "tests/faultcomm.h"
#include "tests/toy_model.h"

#define ITERS 3
#define ROUNDS 2
#define MICRO 4

static int me = -1, nproc = 0;
static int kill_victim = -1;

static void say(const char *fmt, ...) {
    va_list ap;
    char line[2048];
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    printf("mpi_check rank %d: %s\n", me, line);
    fflush(stdout);
}

/* The forward callback of the `kill` mode: the victim dies in the middle of its second iteration. */
static int cb_forward_or_die(avgpipe_op_ctx *op) {
    if (op->rank == kill_victim && op->round == ROUNDS + 1 && op->micro == 1) raise(SIGKILL);
    return cb_forward(op);
}

static avgpipe_placement place = AVGPIPE_PLACE_LOOP; /* of the schedule described (which rank runs each stage) */

/* The description of the checks: S ranks per group, N pipelines, D groups, every H rounds. */
static void describe(setup *s, avgpipe_sched_kind kind, int S, int N, int D, int H, float alpha) {
    int vk = kind == AVGPIPE_SCHED_ZBV || kind == AVGPIPE_SCHED_DUALPIPEV, V = kind == AVGPIPE_SCHED_INTERLEAVED || vk ? 2 : 1, G = S * V;
    reset_state_d(G, MICRO, N, D);
    setup_init_d(s, G, N, D, S);
    if (kind == AVGPIPE_SCHED_ZBH1 || kind == AVGPIPE_SCHED_ZBV) use_split(s, 0);
    if (kind == AVGPIPE_SCHED_DUALPIPEV) s->d.cb.overlap = cb_overlap;
    place = vk ? AVGPIPE_PLACE_V : AVGPIPE_PLACE_LOOP;
    s->d.sched.kind = kind, s->d.sched.stages = S, s->d.sched.chunks = V, s->d.sched.micro = MICRO, s->d.sched.pipes = N;
    s->d.sched.rounds = ROUNDS, s->d.sched.advance = kind == AVGPIPE_SCHED_ADVANCE ? 2 : 0;
    s->d.replicas = D, s->d.average_every = H;
    s->d.averaging.alpha = alpha == 0 ? AVGPIPE_ZERO : alpha;
    s->d.deterministic = 1;
    s->d.timeout_s = 30;
}

/* Create, iterate, and set T.nslots. On failure: the message in err. */
static avgpipe_result train(avgpipe_context *ctx, const avgpipe_run_desc *d, int iters, avgpipe_run **out) {
    avgpipe_result res = avgpipe_run_create(ctx, d, out);
    int g, it;
    for (g = 0; !res && g < T.G; g++) T.nslots[g] = avgpipe_run_slots(*out, g);
    for (it = 0; !res && it < iters; it++) res = avgpipe_run_iteration(*out, NULL);
    return res;
}

/* Bring every model's partitions to rank 0 (each process sends the stages it runs). */
/* Every parallel model of every group, on rank 0 (got[d * N + p][g]), through avgpipe_run_gather_params. */
static int gather_models(avgpipe_run *run, avgpipe_context *ctx, int N, int D, float (*got)[MAXG][PMAX]) {
    int d, p, g;
    for (d = 0; d < D; d++)
        for (p = 0; p < N; p++) {
            float *dst[MAXG];
            avgpipe_result res;
            for (g = 0; g < T.G; g++) dst[g] = got[d * N + p][g];
            if ((res = avgpipe_run_gather_params(run, d, p, me == 0 ? dst : NULL)) != AVGPIPE_OK)
                return say("avgpipe_run_gather_params(%d, %d): %s: %s", d, p, avgpipe_result_string(res), avgpipe_last_error(ctx)), 1;
        }
    return 0;
}

/* Every group's reference of every stage, on rank 0 (zgot[d][g]). */
static void collect_references(avgpipe_run *run, int S, int D, float (*zgot)[MAXG][PMAX]) {
    int r, g, G = T.G;
    for (r = 0; r < nproc; r++) {
        int d = r / S, sr = r % S;
        for (g = 0; g < G; g++) {
            if (avgpipe_place_rank(place, S, g) != sr) continue;
            if (me == r && r == 0) memcpy(zgot[d][g], avgpipe_run_replica_reference(run, d, g, NULL), (size_t)pcount(g) * sizeof(float));
            else if (me == r) MPI_Send(avgpipe_run_replica_reference(run, d, g, NULL), pcount(g), MPI_FLOAT, 0, 7000 + d * MAXG + g, MPI_COMM_WORLD);
            else if (me == 0) MPI_Recv(zgot[d][g], pcount(g), MPI_FLOAT, r, 7000 + d * MAXG + g, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        }
    }
    (void)D;
}

static int mode_equal(int argc, char **argv, avgpipe_comm *comm) {
    static float mpi_w[MAXN][MAXG][PMAX], zgot[MAXD][MAXG][PMAX];
    static double w64[MAXN][MAXG][PMAX], z64[MAXD][MAXG][PMAX], loss[64];
    avgpipe_sched_kind kind;
    avgpipe_context ctx;
    avgpipe_run *run = NULL;
    avgpipe_result res;
    setup s;
    int N, D, H, S, i, g, d, bad = 0, verdict;
    float alpha;
    if (argc < 5 || avgpipe_sched_kind_parse(argv[2], &kind)) return say("usage: equal KIND N ALPHA [D [H]]"), 2;
    N = atoi(argv[3]), alpha = (float)atof(argv[4]);
    D = argc > 5 ? atoi(argv[5]) : 1, H = argc > 6 ? atoi(argv[6]) : 1;
    S = nproc / (D > 0 ? D : 1);
    if (N < 1 || D < 1 || H < 1 || S * D != nproc || N * D > MAXN || S * 2 > MAXG) return say("bad shape: %d processes, N %d, D %d", nproc, N, D), 2;
    avgpipe_context_init(&ctx, NULL);
    describe(&s, kind, S, N, D, H, alpha);
    s.d.comm = comm, s.d.local_ranks = &me, s.d.local_count = 1;
    res = train(&ctx, &s.d, ITERS, &run);
    if (res) {
        say("error %s: %s", avgpipe_result_string(res), avgpipe_last_error(&ctx));
        avgpipe_run_destroy(run);
        return 1;
    }
    bad = gather_models(run, &ctx, N, D, mpi_w);
    collect_references(run, S, D, zgot);
    avgpipe_run_destroy(run);
    if (me == 0 && !bad) {
        describe(&s, kind, S, N, D, H, alpha); /* again, every rank on this process's threads */
        run = NULL;
        res = train(&ctx, &s.d, ITERS, &run);
        if (res) say("in-process run: %s: %s", avgpipe_result_string(res), avgpipe_last_error(&ctx)), bad = 1;
        for (i = 0; i < N * D && !bad; i++)
            for (g = 0; g < T.G && !bad; g++)
                if (memcmp(mpi_w[i][g], T.w[i][g], (size_t)pcount(g) * sizeof(float)))
                    say("%s: model %d, stage %d: the MPI run differs from the threaded run", argv[2], i, g), bad = 1;
        for (d = 0; d < D && !bad; d++)
            for (g = 0; g < T.G && !bad; g++)
                if (memcmp(zgot[d][g], avgpipe_run_replica_reference(run, d, g, NULL), (size_t)pcount(g) * sizeof(float)))
                    say("%s: reference of group %d, stage %d differs from the threaded run", argv[2], d, g), bad = 1;
        avgpipe_run_destroy(run);
        if (!bad && kind == AVGPIPE_SCHED_1F1B && D > 1) { /* the two-level averaging in float64 */
            averaging_f64_d(T.G, MICRO, N, D, H, ITERS * ROUNDS, alpha, w64, z64, loss);
            for (i = 0; i < N * D && !bad; i++)
                for (g = 0; g < T.G; g++) {
                    int j;
                    double rms = 0, worst = 0;
                    for (j = 0; j < pcount(g); j++) rms += w64[i][g][j] * w64[i][g][j];
                    rms = sqrt(rms / pcount(g));
                    for (j = 0; j < pcount(g); j++) {
                        double e = fabs(mpi_w[i][g][j] - w64[i][g][j]) / (fabs(w64[i][g][j]) > rms ? fabs(w64[i][g][j]) : rms);
                        if (e > worst) worst = e;
                    }
                    if (worst > 1e-6) say("model %d, stage %d: relative error %.3g against float64 (> 1e-6)", i, g, worst), bad = 1;
                }
            if (!bad) say("float64 two-level averaging: every model within 1e-6");
        }
        if (!bad)
            say("%s, %d ranks (D = %d x S = %d), N = %d, alpha %g: every model and reference bitwise equal to the threaded run", argv[2],
                nproc, D, S, N, (double)alpha);
    }
    verdict = bad;
    MPI_Bcast(&verdict, 1, MPI_INT, 0, MPI_COMM_WORLD);
    if (me != 0 && !verdict) say("ok");
    return verdict ? 1 : 0;
}

/* A failing mode: create and iterate; an error is the expected outcome (exit 3), success exit 1. */
static int expect_failure(avgpipe_run_desc *d, int iters, const char *must_contain) {
    avgpipe_context ctx;
    avgpipe_run *run = NULL;
    avgpipe_result res;
    double t0 = MPI_Wtime();
    avgpipe_context_init(&ctx, NULL);
    res = train(&ctx, d, iters, &run);
    if (!res) {
        say("unexpected success");
        avgpipe_run_destroy(run);
        return 1;
    }
    say("failed as expected after %.2f s: %s: %s", MPI_Wtime() - t0, avgpipe_result_string(res), avgpipe_last_error(&ctx));
    if (must_contain && !strstr(avgpipe_last_error(&ctx), must_contain)) {
        say("the message does not contain '%s'", must_contain);
        avgpipe_run_destroy(run);
        return 1;
    }
    avgpipe_run_destroy(run);
    return 3;
}

int main(int argc, char **argv) {
    avgpipe_context ctx;
    avgpipe_comm comm;
    setup s;
    int rc = 2;
    const char *mode = argc > 1 ? argv[1] : "";
    avgpipe_context_init(&ctx, NULL);
    if (avgpipe_mpi_init(&ctx, &argc, &argv) || avgpipe_mpi_create(&ctx, NULL, &comm)) {
        fprintf(stderr, "mpi_check: %s\n", avgpipe_last_error(&ctx));
        return 2;
    }
    me = avgpipe_mpi_rank(&comm), nproc = comm.size;
    if (!strcmp(mode, "defaults")) { /* what the zero fields of avgpipe_mpi_desc become */
        avgpipe_mpi_desc q = avgpipe_mpi_query_defaults(NULL), in;
        int cmp = MPI_UNEQUAL;
        memset(&in, 0, sizeof in);
        in.spin_us = 7;
        MPI_Comm_compare(q.comm, MPI_COMM_WORLD, &cmp);
        rc = cmp == MPI_IDENT && q.spin_us == 50 && q.max_sleep_us == 200 && q.fast_allreduce == 0 && q.no_abort_notices == 0 &&
                     avgpipe_mpi_query_defaults(&in).spin_us == 7 && avgpipe_mpi_query_defaults(&in).max_sleep_us == 200
                 ? 0
                 : 1;
        printf("rank %d: mpi defaults: comm %s, spin_us %g, max_sleep_us %g: %s\n", me, cmp == MPI_IDENT ? "MPI_COMM_WORLD" : "another",
               q.spin_us, q.max_sleep_us, rc ? "WRONG" : "ok");
    } else if (!strcmp(mode, "equal")) {
        rc = mode_equal(argc, argv, &comm);
    } else if (!strcmp(mode, "kill") && argc == 4) {
        kill_victim = atoi(argv[2]);
        describe(&s, AVGPIPE_SCHED_1F1B, nproc, 1, 1, 1, 0);
        s.d.cb.forward = cb_forward_or_die;
        s.d.timeout_s = atof(argv[3]);
        s.d.deterministic = 0;
        s.d.comm = &comm, s.d.local_ranks = &me, s.d.local_count = 1;
        rc = expect_failure(&s.d, 5, NULL);
    } else if (!strcmp(mode, "disagree")) {
        describe(&s, AVGPIPE_SCHED_1F1B, nproc, 1, 1, 1, 0);
        if (me == 1) s.d.sched.micro = 8;
        s.d.timeout_s = 20;
        s.d.comm = &comm, s.d.local_ranks = &me, s.d.local_count = 1;
        rc = expect_failure(&s.d, 1, "sched.micro");
        { /* every process alive: wait (10 s at most) until all have said so before exiting non-zero, or mpirun
             kills the job at the first exit status and a slower process's line is lost (seen in CI) */
            MPI_Request rq;
            int done = 0;
            double t0 = MPI_Wtime();
            fflush(stdout);
            MPI_Ibarrier(MPI_COMM_WORLD, &rq);
            while (!done && MPI_Wtime() - t0 < 10) MPI_Test(&rq, &done, MPI_STATUS_IGNORE);
        }
    } else if (!strcmp(mode, "drop") || !strcmp(mode, "dup")) {
        faultcomm fc;
        avgpipe_comm table;
        faultcomm_init(&fc, &table, &comm, 0, 1, 3, !strcmp(mode, "dup"));
        describe(&s, AVGPIPE_SCHED_1F1B, nproc, 1, 1, 1, 0);
        s.d.timeout_s = 20;
        s.d.comm = &table, s.d.local_ranks = &me, s.d.local_count = 1;
        rc = expect_failure(&s.d, 1, NULL);
        memset(&comm, 0, sizeof comm); /* faultcomm_free destroys it */
        faultcomm_free(&fc);
    } else {
        fprintf(stderr, "usage: mpi_check equal KIND N ALPHA [D [H]] | kill VICTIM TIMEOUT | disagree | drop | dup\n");
    }
    if (rc == 3 || rc == 1) { /* after a failure MPI_Finalize may wait for a dead process: leave now */
        fflush(stdout);
        _exit(rc);
    }
    avgpipe_comm_destroy(&comm);
    MPI_Finalize();
    return rc;
}
