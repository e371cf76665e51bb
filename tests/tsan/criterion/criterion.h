/* A stand-in for Criterion's <criterion/criterion.h>, for the suites that run under ThreadSanitizer:
   Criterion's own runtime (its shared-memory arena, fork per test) aborts under TSan. It provides what
   tests/test_runtime.c, test_comm.c and test_ea.c use: Test, TestSuite, cr_assert, cr_assert_eq,
   cr_log_info. The tests run one after the other in this process (no fork); a failed assertion prints
   its message and ends that test (longjmp to the runner); the exit status is the number of failures.
   meson builds these suites against this header when -Db_sanitize=thread (see meson.build). */
#ifndef AVGPIPE_TSAN_CRITERION_H
#define AVGPIPE_TSAN_CRITERION_H

#include <setjmp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct tshim_test {
    const char *suite, *name;
    void (*fn)(void);
} tshim_test;

static tshim_test tshim_tests[512];
static int tshim_ntests;
static jmp_buf tshim_jump;

static void tshim_register(const char *suite, const char *name, void (*fn)(void)) {
    if (tshim_ntests < 512) tshim_tests[tshim_ntests].suite = suite, tshim_tests[tshim_ntests].name = name, tshim_tests[tshim_ntests++].fn = fn;
}

__attribute__((format(printf, 4, 5))) static void tshim_fail(const char *file, int line, const char *expr, const char *fmt, ...) {
    va_list ap;
    fprintf(stderr, "[----] %s:%d: Assertion Failed: %s\n[----]   ", file, line, expr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    longjmp(tshim_jump, 1);
}

#define Test(suite, name, ...)                                                                           \
    static void suite##_##name(void);                                                                    \
    __attribute__((constructor)) static void tshim_reg_##suite##_##name(void) { tshim_register(#suite, #name, suite##_##name); } \
    static void suite##_##name(void)
#define TestSuite(suite, ...) static const int tshim_suite_##suite __attribute__((unused)) = 0
#define cr_assert(cond, ...)                                                                             \
    do {                                                                                                 \
        if (!(cond)) tshim_fail(__FILE__, __LINE__, #cond, "" __VA_ARGS__);                             \
    } while (0)
#define cr_assert_eq(a, b, ...) cr_assert((a) == (b), __VA_ARGS__)
#define cr_log_info(...) ((void)0)

int main(int argc, char **argv) {
    int i, failed = 0;
    const char *only = argc > 1 ? argv[1] : NULL; /* a substring of suite::name */
    alarm(1500); /* a hang ends the runner instead of the CI job */
    for (i = 0; i < tshim_ntests; i++) {
        char full[256];
        snprintf(full, sizeof full, "%s::%s", tshim_tests[i].suite, tshim_tests[i].name);
        if (only && !strstr(full, only)) continue;
        if (setjmp(tshim_jump) == 0) {
            tshim_tests[i].fn();
            fprintf(stderr, "[PASS] %s\n", full);
        } else {
            fprintf(stderr, "[FAIL] %s\n", full);
            failed++;
        }
    }
    fprintf(stderr, "[====] %d tests, %d failed (ThreadSanitizer runner)\n", tshim_ntests, failed);
    return failed ? 1 : 0;
}

#endif
