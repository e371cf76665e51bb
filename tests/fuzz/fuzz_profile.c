/* libFuzzer harness: runtime profiles and the tuner (sections 20-22).

   The input is (data, size) with no NUL after it, as avgpipe_profile_parse allows. A profile that
   parses is fitted (avgpipe_tune_fit); a small one (few stages) is then searched over a small grid
   (batch 1..6, up to 3 pipelines, K up to 2, shared cores or not: picked by the input's size) under a
   memory limit, and every candidate must be consistent: finite non-negative predictions, fits ==
   (peak_bytes <= limit), fitting ones first.

   Build (tests/fuzz/meson.build does this when clang has libFuzzer):
     clang -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -I. \
         tests/fuzz/fuzz_profile.c -o fuzz_profile -lm -pthread
   Run: ./fuzz_profile -max_total_time=60 CORPUS_DIR tests/fuzz/corpus/profile tests/fuzz/regress/profile */
#define AVGPIPE_IMPLEMENTATION
#include "avgpipe.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Stages and ops above which a profile is fitted but not searched: a run stays in milliseconds. */
#define FUZZ_MAX_SEARCH_STAGES 4
#define FUZZ_MAX_SEARCH_OPS 2000

static void check_candidates(const avgpipe_tune_desc *td, const avgpipe_tune_candidate *c, int n) {
    int i;
    for (i = 0; i < n; i++) {
        const avgpipe_tune_candidate *x = &c[i];
        const char *bad = NULL;
        if (!(x->seconds >= 0) || !isfinite(x->seconds)) bad = "seconds not finite and >= 0";
        else if (!(x->peak_bytes >= 0) || !isfinite(x->peak_bytes)) bad = "peak_bytes not finite and >= 0";
        else if (x->fits != (td->mem_limit <= 0 || x->peak_bytes <= td->mem_limit)) bad = "fits disagrees with peak_bytes";
        else if (i > 0 && x->fits && !c[i - 1].fits) bad = "a fitting candidate after one that does not fit";
        if (bad) {
            fprintf(stderr, "fuzz_profile: candidate %d (%s M=%d N=%d K=%d): %s (seconds %g, peak %g)\n", i,
                    avgpipe_sched_kind_name(x->sched.kind), x->sched.micro, x->sched.pipes, x->sched.advance, bad, x->seconds,
                    x->peak_bytes);
            abort();
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    avgpipe_context ctx;
    avgpipe_profile p;
    avgpipe_cost_model m;
    avgpipe_tune_desc td;
    avgpipe_tune_candidate *c = NULL;
    int n = 0;
    avgpipe_context_init(&ctx, NULL);
    if (avgpipe_profile_parse(&ctx, (const char *)data, size, &p) != AVGPIPE_OK) return 0;
    if (avgpipe_tune_fit(&ctx, &p, &m) == AVGPIPE_OK) {
        if (m.nstages <= FUZZ_MAX_SEARCH_STAGES && p.nops <= FUZZ_MAX_SEARCH_OPS) {
            memset(&td, 0, sizeof td);
            td.batch = 1 + (int)(size % 6);
            td.max_pipes = 1 + (int)(size / 6 % 3);
            td.max_advance = 2;
            td.no_continuous = (int)(size / 18 % 2);
            m.cores = (double)(size / 36 % 2); /* 0: a core per rank; 1: the ranks share one */
            td.mem_limit = 1 << 20;
            td.opt_bytes_per_param = 8;
            if (avgpipe_tune_search(&ctx, &m, &td, &c, &n) == AVGPIPE_OK) {
                check_candidates(&td, c, n);
                avgpipe_free(&ctx, c);
            }
        }
        avgpipe_tune_cost_model_free(&ctx, &m);
    }
    avgpipe_profile_free(&ctx, &p);
    return 0;
}
