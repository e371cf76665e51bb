/* blas_kernel_probe — a minimal program around examples/blas_kernel.h for tests/test_blas_kernel.c: it calls
   blas_kernel_ensure on two dense-layer shapes (a restart re-runs this very program) and prints
   "restarted=R user_set=U kernel=K fallback=F" and the status line, then the exit code of ensure. */
#define _POSIX_C_SOURCE 200809L
#define BLAS_KERNEL_IMPLEMENTATION
#include "examples/blas_kernel.h"

#include <stdio.h>

int main(int argc, char **argv) {
    blas_kernel_shape shapes[2] = {{32, 512, 784}, {32, 10, 128}};
    blas_kernel_status st;
    int rc;
    (void)argc;
    rc = blas_kernel_ensure(argv, shapes, 2, "blas_kernel_probe", &st);
    printf("restarted=%d user_set=%d kernel=%s fallback=%s rc=%d\n%s\n", st.restarted, st.user_set, st.kernel, st.fallback, rc, st.line);
    return 0;
}
