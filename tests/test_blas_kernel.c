/* Tests of examples/blas_kernel.h, the generic-OpenBLAS-kernel detection and restart the examples use:
     - the decision is a pure function of the kernel's name and the CPU's flags (fed made-up ones here);
     - the sgemm check passes on this machine's kernel, and its measure means what it says (a product with
       one wrong element fails it);
     - end to end through tests/blas_kernel_probe (AVGPIPE_BLAS_PROBE): a generic kernel forced with
       OPENBLAS_CORETYPE=Prescott (and BLAS_KERNEL_ASSUME_AUTO=1, so that it counts as OpenBLAS's own pick)
       is replaced by a restart with SkylakeX or Haswell, whichever this CPU runs; an OPENBLAS_CORETYPE the
       user set is left alone; a kernel whose check crashes or computes wrong results is not taken. */
#define _POSIX_C_SOURCE 200809L
#define BLAS_KERNEL_IMPLEMENTATION
#include "examples/blas_kernel.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

Test(decide, generic_names_are_recognised_in_any_case) {
    static const char *const generic[] = {"Prescott", "PRESCOTT", "prescott", "Core2", "Katmai", "Nehalem", "Sandybridge", "generic",
                                          "Barcelona", "Atom"};
    static const char *const modern[] = {"Haswell", "SkylakeX", "Cooperlake", "SapphireRapids", "Zen", "Excavator", "", "Prescot",
                                         "Prescott2"};
    size_t i;
    for (i = 0; i < sizeof generic / sizeof generic[0]; i++) cr_expect(blas_kernel_is_generic(generic[i]), "%s", generic[i]);
    for (i = 0; i < sizeof modern / sizeof modern[0]; i++) cr_expect(!blas_kernel_is_generic(modern[i]), "%s", modern[i]);
    cr_expect(!blas_kernel_is_generic(NULL));
}

Test(decide, better_kernel_follows_the_cpu_flags) {
    cr_expect_str_eq(blas_kernel_better("Prescott", BLAS_KERNEL_AVX2 | BLAS_KERNEL_AVX512), "SkylakeX");
    cr_expect_str_eq(blas_kernel_better("Prescott", BLAS_KERNEL_AVX512), "SkylakeX");
    cr_expect_str_eq(blas_kernel_better("core2", BLAS_KERNEL_AVX2), "Haswell");
    cr_expect_str_eq(blas_kernel_better("Katmai", BLAS_KERNEL_AVX2), "Haswell");
    cr_expect_null(blas_kernel_better("Prescott", 0), "a CPU without AVX2 keeps what OpenBLAS picked");
    cr_expect_null(blas_kernel_better("Haswell", BLAS_KERNEL_AVX2 | BLAS_KERNEL_AVX512), "a modern kernel is left alone");
    cr_expect_null(blas_kernel_better("Cooperlake", BLAS_KERNEL_AVX2 | BLAS_KERNEL_AVX512));
    cr_expect_null(blas_kernel_better("SomeFutureCore", BLAS_KERNEL_AVX2), "an unknown name is taken as newer, not generic");
}

Test(check, this_machines_kernel_passes_with_room) {
    blas_kernel_shape s[] = {{32, 512, 784}, {128, 10, 128}, {1, 1, 1}, {64, 256, 512}, {5, 3, 1000}};
    size_t i;
    for (i = 0; i < sizeof s / sizeof s[0]; i++) {
        double e = blas_kernel_check_shape(s[i]);
        cr_expect(e >= 0 && e < 0.5, "shape %d x %d x %d: %g of the error bound", s[i].m, s[i].n, s[i].k, e);
    }
}

Test(check, one_wrong_element_fails_the_measure) {
    /* blas_kernel__err on a correct 2 x 2 product, then on the same product with one element off by 1e-3 */
    float a[4] = {1, 2, 3, 4}, b[4] = {0.5f, -1, 2, 0.25f}, c[4];
    int i, j, p;
    for (i = 0; i < 2; i++)
        for (j = 0; j < 2; j++) {
            double t = 0;
            for (p = 0; p < 2; p++) t += (double)a[i * 2 + p] * b[p * 2 + j];
            c[i * 2 + j] = (float)t;
        }
    cr_expect_lt(blas_kernel__err(c, a, 2, 1, b, 2, 1, 2, 2, 2), 1.0);
    c[3] += 1e-3f;
    cr_expect_gt(blas_kernel__err(c, a, 2, 1, b, 2, 1, 2, 2, 2), 1.0);
}

/* Run the probe with `env` (a shell prefix) and keep its two lines and stderr. */
static void probe(const char *env, char *line1, char *line2, char *err, size_t cap) {
    const char *exe = getenv("AVGPIPE_BLAS_PROBE");
    char cmd[1024];
    FILE *f, *e;
    if (!exe || !*exe) cr_skip_test("AVGPIPE_BLAS_PROBE is not set (run through meson test)");
    snprintf(cmd, sizeof cmd, "env -u OPENBLAS_CORETYPE -u BLAS_KERNEL_ASSUME_AUTO -u BLAS_KERNEL_FAULT %s '%s' 2>/tmp/blas_kernel_probe.%d.err",
             env, exe, (int)getpid());
    f = popen(cmd, "r");
    cr_assert_not_null(f);
    line1[0] = line2[0] = err[0] = '\0';
    cr_assert_not_null(fgets(line1, (int)cap, f), "no output from %s", cmd);
    cr_assert_not_null(fgets(line2, (int)cap, f), "one line only from %s", cmd);
    cr_assert_eq(pclose(f), 0, "%s failed", cmd);
    snprintf(cmd, sizeof cmd, "/tmp/blas_kernel_probe.%d.err", (int)getpid());
    e = fopen(cmd, "r");
    if (e) {
        size_t n = fread(err, 1, cap - 1, e);
        err[n] = '\0';
        fclose(e);
    }
    remove(cmd);
}

#define CAP 1024

Test(restart, generic_kernel_is_replaced_after_its_check) {
    char l1[CAP], l2[CAP], err[CAP], want[64];
    const char *better = blas_kernel_better("Prescott", blas_kernel_cpu_flags());
    if (!better) cr_skip_test("this CPU has no AVX2: nothing better than a generic kernel to restart with");
    probe("OPENBLAS_CORETYPE=Prescott BLAS_KERNEL_ASSUME_AUTO=1", l1, l2, err, CAP);
    snprintf(want, sizeof want, "restarted=1 user_set=0 kernel=%s fallback=Prescott rc=0", better);
    cr_expect(strncmp(l1, want, strlen(want)) == 0, "got '%s', want '%s'", l1, want);
    cr_expect(strstr(l2, "OpenBLAS picked Prescott") != NULL, "%s", l2);
    cr_expect_str_empty(err, "a successful restart prints nothing on stderr: %s", err);
}

Test(restart, user_choice_is_left_alone) {
    char l1[CAP], l2[CAP], err[CAP];
    probe("OPENBLAS_CORETYPE=Prescott", l1, l2, err, CAP);
    cr_expect(strncmp(l1, "restarted=0 user_set=1 kernel=Prescott fallback= rc=0", strlen("restarted=0 user_set=1 kernel=Prescott fallback= rc=0")) == 0, "%s", l1);
    cr_expect(strstr(l2, "OPENBLAS_CORETYPE=Prescott, left as set") != NULL, "%s", l2);
}

Test(restart, crashing_kernel_falls_back_with_a_message) {
    char l1[CAP], l2[CAP], err[CAP];
    if (!blas_kernel_better("Prescott", blas_kernel_cpu_flags())) cr_skip_test("this CPU has no AVX2");
    probe("OPENBLAS_CORETYPE=Prescott BLAS_KERNEL_ASSUME_AUTO=1 BLAS_KERNEL_FAULT=crash", l1, l2, err, CAP);
    cr_expect(strncmp(l1, "restarted=0 user_set=0 kernel=Prescott fallback= rc=1", strlen("restarted=0 user_set=0 kernel=Prescott fallback= rc=1")) == 0, "%s", l1);
    cr_expect(strstr(err, "killed by signal") != NULL && strstr(err, "staying with Prescott") != NULL, "%s", err);
}

Test(restart, wrong_results_fall_back_with_a_message) {
    char l1[CAP], l2[CAP], err[CAP];
    if (!blas_kernel_better("Prescott", blas_kernel_cpu_flags())) cr_skip_test("this CPU has no AVX2");
    probe("OPENBLAS_CORETYPE=Prescott BLAS_KERNEL_ASSUME_AUTO=1 BLAS_KERNEL_FAULT=wrong", l1, l2, err, CAP);
    cr_expect(strncmp(l1, "restarted=0 user_set=0 kernel=Prescott fallback= rc=1", strlen("restarted=0 user_set=0 kernel=Prescott fallback= rc=1")) == 0, "%s", l1);
    cr_expect(strstr(err, "disagrees with a plain loop") != NULL, "%s", err);
    cr_expect(strstr(l2, "generic: ") != NULL, "%s", l2);
}
