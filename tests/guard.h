/* Input that ends at an unreadable page, for the parsers' (text, length) contract: a parser that reads
   one byte past the length it was given crashes here (SIGSEGV, which Criterion reports as a failed
   test) instead of reading whatever the heap holds next, so the test fails without a sanitizer too.
   Needs POSIX (mprotect, sysconf): define _POSIX_C_SOURCE before the first system header. */
#ifndef AVGPIPE_TESTS_GUARD_H
#define AVGPIPE_TESTS_GUARD_H

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef struct guarded {
    char *base;   /* the pages: data, then one PROT_NONE page */
    size_t span;  /* bytes before the guard page */
    char *text;   /* the copy: its last byte is the guard page's neighbour */
} guarded;

/* A copy of n bytes of text (no NUL after it) whose last byte is the last readable one. */
static inline guarded guarded_copy(const char *text, size_t n) {
    guarded g;
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    void *p = NULL;
    g.span = (n / page + 1) * page;
    if (posix_memalign(&p, page, g.span + page) != 0) abort();
    g.base = (char *)p;
    if (mprotect(g.base + g.span, page, PROT_NONE) != 0) abort();
    g.text = g.base + g.span - n;
    memcpy(g.text, text, n);
    return g;
}

static inline void guarded_free(guarded *g) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    mprotect(g->base + g->span, page, PROT_READ | PROT_WRITE); /* hand the page back to malloc usable */
    free(g->base);
    g->base = g->text = NULL;
}

#endif
