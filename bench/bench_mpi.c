/* bench_mpi: what one rank per MPI process costs against one rank per thread (S = 2).

   Empty stage callbacks, 1F1B, N = 1, M = 32, activations of `bytes` (default 256), alpha 0: the
   runtime's own cost per op. One process with two stage threads (in-process comm) and two MPI
   processes (avgpipe_mpi.h, one rank each) run the same description; the figure is the iteration time
   over the ops of one rank (compute + send/recv + STEP + AVG): microseconds per op on a rank's own
   thread, waits for the neighbour included.

   Modes: bench_mpi threads [reps [bytes]]        one process, two threads
          mpirun -np 2 bench_mpi mpi [reps [bytes]]  two processes
   Each prints one line "<mode> us/op median <m> (min <a>, max <b>) over <reps> batches of 50 iterations".
   bench/bench_mpi.sh runs both, interleaved, and the Fashion-MNIST comparison; read that. */
#define _POSIX_C_SOURCE 200809L
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"
#include "avgpipe_mpi.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define REPS_MAX 64
#define BATCH 50
#define M 32

static int empty_op(avgpipe_op_ctx *op) {
    (void)op;
    return 0;
}
static int empty_step(int rank, int pipe, int stage, int round, float *params, void *user) {
    (void)rank, (void)pipe, (void)stage, (void)round, (void)params, (void)user;
    return 0;
}
static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    static float w[2][64];
    float *params[2] = {w[0], w[1]};
    size_t act[2], pc[2] = {64, 64};
    double t[REPS_MAX], one[BATCH];
    avgpipe_context ctx;
    avgpipe_comm comm;
    avgpipe_run_desc d;
    avgpipe_run *run;
    avgpipe_run_stats st;
    int mpi = argc > 1 && !strcmp(argv[1], "mpi"), reps = argc > 2 ? atoi(argv[2]) : 7, me = 0, i, r, ops;
    size_t bytes = argc > 3 ? (size_t)atol(argv[3]) : 256;
    if (argc < 2 || (!mpi && strcmp(argv[1], "threads")) || reps < 1 || reps > REPS_MAX) {
        fprintf(stderr, "usage: bench_mpi threads|mpi [reps (1..%d) [activation bytes]]\n", REPS_MAX);
        return 2;
    }
    avgpipe_context_init(&ctx, NULL);
    memset(&d, 0, sizeof d);
    act[0] = act[1] = bytes;
    d.sched.kind = AVGPIPE_SCHED_1F1B;
    d.sched.stages = 2;
    d.sched.micro = M;
    d.cb.forward = empty_op, d.cb.backward = empty_op, d.cb.step = empty_step;
    d.act_bytes = act, d.params = params, d.param_count = pc;
    d.averaging.alpha = AVGPIPE_ZERO;
    if (mpi) {
        if (avgpipe_mpi_init(&ctx, &argc, &argv) || avgpipe_mpi_create(&ctx, NULL, &comm)) {
            fprintf(stderr, "bench_mpi: %s\n", avgpipe_last_error(&ctx));
            return 1;
        }
        me = avgpipe_mpi_rank(&comm);
        d.comm = &comm, d.local_ranks = &me, d.local_count = 1;
    }
    if (avgpipe_run_create(&ctx, &d, &run)) {
        fprintf(stderr, "bench_mpi: %s\n", avgpipe_last_error(&ctx));
        return 1;
    }
    ops = avgpipe_run_schedule(run)->len[0]; /* rank 0's ops per iteration (rank 1 has as many) */
    for (i = 0; i < 10; i++) avgpipe_run_iteration(run, &st);
    for (r = 0; r < reps; r++) {
        for (i = 0; i < BATCH; i++) {
            if (avgpipe_run_iteration(run, &st)) {
                fprintf(stderr, "bench_mpi: %s\n", avgpipe_last_error(&ctx));
                return 1;
            }
            one[i] = st.seconds;
        }
        qsort(one, BATCH, sizeof *one, cmp_double);
        t[r] = 1e6 * one[BATCH / 2] / ops;
    }
    qsort(t, (size_t)reps, sizeof *t, cmp_double);
    if (me == 0)
        printf("%s us/op median %.3f (min %.3f, max %.3f) over %d batches of %d iterations; %d ops per rank, %zu-byte activations\n",
               mpi ? "mpi" : "threads", t[reps / 2], t[0], t[reps - 1], reps, BATCH, ops, bytes);
    avgpipe_run_destroy(run);
    if (mpi) {
        avgpipe_comm_destroy(&comm);
        MPI_Finalize();
    }
    return 0;
}
