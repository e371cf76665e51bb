/* Built by tests/install_test.sh outside the source tree, against the installed headers, with nothing but
   `pkg-config --cflags --libs avgpipe`: a schedule generated, validated and simulated, and a 2-stage run
   of the runtime with 2 parallel pipelines (threads). Exit status 0 when the results are what they must be. */
#define AVGPIPE_IMPLEMENTATION
#include <avgpipe.h>

#include <stdio.h>
#include <string.h>

static int fwd(avgpipe_op_ctx *op) {
    if (op->output) memcpy(op->output, op->params, sizeof(float));
    else op->loss = op->params[0];
    return 0;
}
static int bwd(avgpipe_op_ctx *op) {
    if (op->grad_input) memset(op->grad_input, 0, sizeof(float));
    return 0;
}
static int step(int rank, int pipe, int stage, int round, float *params, void *user) {
    (void)rank, (void)stage, (void)round, (void)user;
    params[0] += (float)(pipe + 1); /* pipeline 0 adds 1, pipeline 1 adds 2 */
    return 0;
}

int main(void) {
    avgpipe_sched_desc d = {0};
    avgpipe_schedule s;
    avgpipe_validate_report rep;
    avgpipe_sim_desc sd = {0};
    avgpipe_sim_result r;
    float p[4] = {0, 0, 0, 0};
    float *params[4] = {&p[0], &p[1], &p[2], &p[3]};
    size_t count[2] = {1, 1}, act[1] = {sizeof(float)};
    avgpipe_run_desc rd = {0};
    avgpipe_run *run;
    const float *z;
    printf("avgpipe %s (header %s)\n", avgpipe_version(), AVGPIPE_VERSION_STRING);
    if (strcmp(avgpipe_version(), AVGPIPE_VERSION_STRING) != 0) return 1;
    d.kind = AVGPIPE_SCHED_1F1B, d.stages = 4, d.micro = 8, d.pipes = 2;
    if (avgpipe_sched_generate(NULL, &d, &s) || avgpipe_sched_validate(NULL, &s, NULL, &rep) || avgpipe_sim_run(NULL, &s, &sd, &r)) {
        fprintf(stderr, "%s\n", avgpipe_last_error(NULL));
        return 1;
    }
    printf("1f1b S=4 M=8 N=2: makespan %.1f bubble %.3f\n", r.makespan, r.bubble);
    avgpipe_sim_result_free(NULL, &r);
    avgpipe_sched_free(NULL, &s);
    rd.sched.kind = AVGPIPE_SCHED_1F1B, rd.sched.stages = 2, rd.sched.micro = 2, rd.sched.pipes = 2;
    rd.cb.forward = fwd, rd.cb.backward = bwd, rd.cb.step = step;
    rd.params = params, rd.param_count = count, rd.act_bytes = act;
    rd.averaging.alpha = AVGPIPE_ZERO, rd.deterministic = 1, rd.timeout_s = 30;
    if (avgpipe_run_create(NULL, &rd, &run) || avgpipe_run_iteration(run, NULL)) {
        fprintf(stderr, "run: %s\n", avgpipe_last_error(NULL));
        return 1;
    }
    z = avgpipe_run_reference(run, 0, NULL); /* the mean of 1 and 2 */
    printf("reference after one iteration: %g (want 1.5)\n", (double)z[0]);
    avgpipe_run_destroy(run);
    return z[0] == 1.5f ? 0 : 1;
}
