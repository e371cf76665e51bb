/* Tests of the runtime across processes: tests/mpi_check.c and the main job run under mpirun, one
   rank per process, over avgpipe_mpi.h. Every mpirun is bounded by `timeout`, so a hang fails the test
   instead of eating CI's time.

   Environment (meson test sets it): AVGPIPE_MPIRUN (mpirun), AVGPIPE_MPI_CHECK (build/mpi_check),
   AVGPIPE_FMNIST (build/fashion_mnist, or empty), AVGPIPE_FMNIST_DATA (the data set's directory),
   OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM) (CI runs as root). */
#define _POSIX_C_SOURCE 200809L
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static const char *env(const char *name) {
    const char *v = getenv(name);
    return v ? v : "";
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct outcome {
    int status;     /* the shell's exit status: 124 means `timeout` stopped a hang */
    double seconds;
    char out[65536];
} outcome;

/* Run a shell command line (stderr merged into stdout), at most `limit` seconds. */
static void run(outcome *o, int limit, const char *fmt, ...) {
    char cmd[8192], inner[7800];
    va_list ap;
    FILE *p;
    size_t n = 0, k;
    double t0 = now_s();
    va_start(ap, fmt);
    vsnprintf(inner, sizeof inner, fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof cmd, "timeout -k 5 %d %s 2>&1", limit, inner);
    p = popen(cmd, "r");
    cr_assert(p != NULL, "popen: %s", cmd);
    while (n + 1 < sizeof o->out && (k = fread(o->out + n, 1, sizeof o->out - 1 - n, p)) > 0) n += k;
    o->out[n] = 0;
    o->status = pclose(p);
    o->status = WIFEXITED(o->status) ? WEXITSTATUS(o->status) : 128 + WTERMSIG(o->status);
    o->seconds = now_s() - t0;
    cr_log_info("%s\n(exit %d after %.1f s)\n%s", inner, o->status, o->seconds, o->out);
}

#define MPIRUN "%s --oversubscribe --bind-to none"

static int count(const char *text, const char *what) {
    int n = 0;
    for (; (text = strstr(text, what)) != NULL; text++) n++;
    return n;
}

TestSuite(mpi, .timeout = 300);

/* avgpipe_mpi_query_defaults: what each zero field of avgpipe_mpi_desc becomes. */
Test(mpi, query_defaults) {
    outcome o;
    run(&o, 60, MPIRUN " -np 1 %s defaults", env("AVGPIPE_MPIRUN"), env("AVGPIPE_MPI_CHECK"));
    cr_assert_eq(o.status, 0, "exit %d:\n%s", o.status, o.out);
    cr_assert(strstr(o.out, "mpi defaults: comm MPI_COMM_WORLD, spin_us 50, max_sleep_us 200: ok") != NULL, "%s", o.out);
}

/* mpi_check equal: the run over MPI gives the threaded run's parameters, bit for bit. */
static void equal(int np, const char *kind, int N, const char *alpha, int D, int H) {
    outcome o;
    run(&o, 120, MPIRUN " -np %d %s equal %s %d %s %d %d", env("AVGPIPE_MPIRUN"), np, env("AVGPIPE_MPI_CHECK"), kind, N, alpha, D, H);
    cr_assert_eq(o.status, 0, "exit %d:\n%s", o.status, o.out);
    cr_assert(strstr(o.out, "bitwise equal to the threaded run") != NULL, "no verdict:\n%s", o.out);
    cr_assert_eq(count(o.out, ": ok\n"), np - 1, "not every rank finished:\n%s", o.out);
}

Test(mpi, afab_s2_n1) { equal(2, "afab", 1, "0", 1, 1); }
Test(mpi, onef1b_s2_n1) { equal(2, "1f1b", 1, "0", 1, 1); }
Test(mpi, advance_s2_n1) { equal(2, "advance", 1, "0", 1, 1); }
Test(mpi, interleaved_s2_n1) { equal(2, "interleaved", 1, "0", 1, 1); }
Test(mpi, zbh1_s2_n1) { equal(2, "zbh1", 1, "0", 1, 1); }
Test(mpi, afab_s2_n2) { equal(2, "afab", 2, "0.3", 1, 1); }
Test(mpi, onef1b_s2_n2) { equal(2, "1f1b", 2, "0.3", 1, 1); }
Test(mpi, advance_s2_n2) { equal(2, "advance", 2, "0.3", 1, 1); }
Test(mpi, interleaved_s2_n2) { equal(2, "interleaved", 2, "0.3", 1, 1); }
Test(mpi, zbh1_s2_n2) { equal(2, "zbh1", 2, "0.3", 1, 1); }
Test(mpi, afab_s4_n1) { equal(4, "afab", 1, "0", 1, 1); }
Test(mpi, onef1b_s4_n1) { equal(4, "1f1b", 1, "0", 1, 1); }
Test(mpi, advance_s4_n1) { equal(4, "advance", 1, "0", 1, 1); }
Test(mpi, interleaved_s4_n1) { equal(4, "interleaved", 1, "0", 1, 1); }
Test(mpi, zbh1_s4_n1) { equal(4, "zbh1", 1, "0", 1, 1); }
Test(mpi, afab_s4_n2) { equal(4, "afab", 2, "0.3", 1, 1); }
Test(mpi, onef1b_s4_n2) { equal(4, "1f1b", 2, "0.3", 1, 1); }
Test(mpi, advance_s4_n2) { equal(4, "advance", 2, "0.3", 1, 1); }
Test(mpi, interleaved_s4_n2) { equal(4, "interleaved", 2, "0.3", 1, 1); }
Test(mpi, zbh1_s4_n2) { equal(4, "zbh1", 2, "0.3", 1, 1); }
/* V placement: rank r holds stages r and 2S-1-r; DualPipeV through the overlap callback */
Test(mpi, zbv_s2_n1) { equal(2, "zbv", 1, "0", 1, 1); }
Test(mpi, zbv_s4_n2) { equal(4, "zbv", 2, "0.3", 1, 1); }
Test(mpi, dualpipev_s2_n1) { equal(2, "dualpipev", 1, "0", 1, 1); }
Test(mpi, dualpipev_s4_n2) { equal(4, "dualpipev", 2, "0.3", 1, 1); }

/* Two replica groups of two ranks: equal to the same run in threads, and to float64 to 1e-6. */
static void replicas(int H, const char *alpha) {
    outcome o;
    run(&o, 120, MPIRUN " -np 4 %s equal 1f1b 2 %s 2 %d", env("AVGPIPE_MPIRUN"), env("AVGPIPE_MPI_CHECK"), alpha, H);
    cr_assert_eq(o.status, 0, "exit %d:\n%s", o.status, o.out);
    cr_assert(strstr(o.out, "float64 two-level averaging: every model within 1e-6") != NULL, "no float64 check:\n%s", o.out);
    cr_assert(strstr(o.out, "(D = 2 x S = 2)") && strstr(o.out, "bitwise equal to the threaded run"), "no verdict:\n%s", o.out);
}
Test(mpi, replicas_every_round) { replicas(1, "0.3"); }
Test(mpi, replicas_every_second_round) { replicas(2, "0.5"); }

/* Processes started with different flags: every one is refused at create, naming the field. */
Test(mpi, different_flags_refused_at_create) {
    outcome o;
    run(&o, 60, MPIRUN " -np 3 %s disagree", env("AVGPIPE_MPIRUN"), env("AVGPIPE_MPI_CHECK"));
    cr_assert_neq(o.status, 124, "hung:\n%s", o.out);
    cr_assert_neq(o.status, 0, "exit 0 although the processes disagree:\n%s", o.out);
    cr_assert_eq(count(o.out, "failed as expected"), 3, "not every process was refused:\n%s", o.out);
    cr_assert_eq(count(o.out, "rank 1 has sched.micro = 8, rank 0 has 4"), 3, "the message does not name the field:\n%s", o.out);
}

/* A message lost or duplicated on the way: reported at the receive where it happened, naming both ops. */
static void faulty(const char *mode, const char *want, const char *got) {
    outcome o;
    run(&o, 60, MPIRUN " -np 2 %s %s", env("AVGPIPE_MPIRUN"), env("AVGPIPE_MPI_CHECK"), mode);
    cr_assert_neq(o.status, 124, "hung:\n%s", o.out);
    cr_assert_eq(count(o.out, "failed as expected"), 2, "not both processes failed:\n%s", o.out);
    cr_assert(strstr(o.out, "mpi_check rank 1: failed as expected") && strstr(o.out, "message mismatch: rank 1, op 0:1F"),
              "rank 1 does not report the mismatch at its receive:\n%s", o.out);
    cr_assert(strstr(o.out, want) && strstr(o.out, got), "the message does not name both ops (%s, %s):\n%s", want, got, o.out);
    cr_assert(o.seconds < 30, "took %.1f s: reported at a timeout, not at the receive", o.seconds);
}
Test(mpi, lost_message_reported_at_its_receive) { faulty("drop", "expected the message of 0:0SEND_F2", "received that of 0:0SEND_F3"); }
Test(mpi, duplicated_message_reported_at_its_receive) { faulty("dup", "expected the message of 0:0SEND_F3", "received that of 0:0SEND_F2"); }

/* One process SIGKILLed in its second iteration: every other one returns an error naming the dead
   rank (or the op that waited for it) within about the timeout (3 s), and exits non-zero.
   Open MPI 4.1's mpirun kills the whole job as soon as one process ends without MPI_Finalize (also
   with orte_abort_on_non_zero_status 0), which would hide what the survivors say. So each rank runs
   under a shell that reports its exit status and then lingers 8 s before it ends: mpirun's clean-up
   comes after every survivor has spoken. */
Test(mpi, killed_process_stops_the_others) {
    outcome o;
    int r;
    char line[128];
    run(&o, 90, MPIRUN " -q --mca orte_abort_on_non_zero_status 0 -np 4 sh -c "
        "'%s kill 2 3; s=$?; echo \"exit status $s of rank $OMPI_COMM_WORLD_RANK\"; sleep 8; exit $s'",
        env("AVGPIPE_MPIRUN"), env("AVGPIPE_MPI_CHECK"));
    cr_assert_neq(o.status, 124, "hung (stopped by timeout after %.0f s):\n%s", o.seconds, o.out);
    cr_assert(strstr(o.out, "exit status 137 of rank 2") != NULL, "rank 2 was not killed:\n%s", o.out);
    for (r = 0; r < 4; r++) {
        if (r == 2) continue;
        snprintf(line, sizeof line, "exit status 3 of rank %d", r);
        cr_assert(strstr(o.out, line) != NULL, "rank %d did not exit with the expected error:\n%s", r, o.out);
        snprintf(line, sizeof line, "mpi_check rank %d: failed as expected after", r);
        cr_assert(strstr(o.out, line) != NULL, "rank %d did not report:\n%s", r, o.out);
    }
    /* the ranks that wait for rank 2 itself name it; each survivor names the op it stopped at */
    cr_assert(strstr(o.out, "rank 1, op 0:1B4: receiving the gradient from rank 2") != NULL, "rank 1 does not name rank 2:\n%s", o.out);
    cr_assert(strstr(o.out, "rank 3, op 0:3F5: receiving the activation from rank 2") != NULL, "rank 3 does not name rank 2:\n%s", o.out);
    cr_assert(strstr(o.out, "rank 0, op 0:0B4: receiving the gradient from rank 1") != NULL, "rank 0 does not name its op:\n%s", o.out);
    cr_assert(o.seconds < 45, "the survivors took %.1f s (timeout 3 s)", o.seconds);
}

/* ---- the main job over MPI -------------------------------------------------------------------- */

static int have_main_job(void) {
    char path[4096];
    struct stat st;
    snprintf(path, sizeof path, "%s/train-images-idx3-ubyte.gz", env("AVGPIPE_FMNIST_DATA"));
    return env("AVGPIPE_FMNIST")[0] && stat(path, &st) == 0;
}

static void same_file(const char *a, const char *b) {
    outcome o;
    run(&o, 30, "cmp %s %s", a, b);
    cr_assert_eq(o.status, 0, "%s and %s differ:\n%s", a, b, o.out);
}

/* The main job over `np` processes and in threads, both with `flags` and --deterministic: the saved
   reference models are cmp-identical. `expect` must be in the MPI run's output. */
static void main_job_equal(int np, const char *flags, const char *expect) {
    outcome o;
    char a[256], b[256];
    if (!have_main_job()) cr_skip_test("no Fashion-MNIST build or data");
    snprintf(a, sizeof a, "/tmp/avgpipe_fm_mpi_%d_%ld.bin", np, (long)getpid());
    snprintf(b, sizeof b, "/tmp/avgpipe_fm_threads_%d_%ld.bin", np, (long)getpid());
    run(&o, 500, MPIRUN " -np %d %s --backend mpi %s --deterministic --save %s", env("AVGPIPE_MPIRUN"), np, env("AVGPIPE_FMNIST"), flags, a);
    cr_assert_eq(o.status, 0, "exit %d:\n%s", o.status, o.out);
    cr_assert(strstr(o.out, expect) != NULL, "no '%s' in the output:\n%s", expect, o.out);
    cr_assert_eq(count(o.out, "reference model test accuracy"), 1, "only rank 0 prints the result:\n%s", o.out);
    cr_assert_eq(count(o.out, "epoch 1/1 ["), 1, "one progress line per epoch when the output is a pipe:\n%s", o.out);
    run(&o, 300, "%s %s --deterministic --save %s", env("AVGPIPE_FMNIST"), flags, b);
    cr_assert_eq(o.status, 0, "exit %d:\n%s", o.status, o.out);
    same_file(a, b);
    remove(a);
    remove(b);
}

/* mpirun -np 4 fashion_mnist --backend mpi --epochs 1 --micro 4 --pipes 2 --deterministic --save A and
   the threaded run --save B (one epoch of the whole training set). */
Test(mpi, main_job_four_processes_equals_threads, .timeout = 600) {
    main_job_equal(4, "--epochs 1 --micro 4 --pipes 2", "one rank per MPI process");
}
/* Two replica groups of 4 processes each (a subset, one epoch). */
Test(mpi, main_job_two_replica_groups_equals_threads, .timeout = 600) {
    main_job_equal(8, "--replicas 2 --epochs 1 --limit-train 16384 --micro 4 --pipes 2", "2 replica groups");
}

/* The wrong number of processes for the flags: every process says what -np the flags need. */
Test(mpi, main_job_wrong_process_count) {
    outcome o;
    if (!have_main_job()) cr_skip_test("no Fashion-MNIST build");
    run(&o, 60, MPIRUN " -np 3 %s --backend mpi --micro 4 --pipes 2", env("AVGPIPE_MPIRUN"), env("AVGPIPE_FMNIST"));
    cr_assert_neq(o.status, 0);
    cr_assert_neq(o.status, 124, "hung:\n%s", o.out);
    cr_assert(strstr(o.out, "mpirun -np 4") != NULL, "no hint at -np 4:\n%s", o.out);
}
