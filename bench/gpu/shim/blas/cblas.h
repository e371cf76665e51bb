/* bench/gpu/shim/blas/cblas.h: the part of CBLAS (and of OpenBLAS's extensions) that examples/mlp.h,
   examples/blas_kernel.h and examples/fashion_mnist.c use, for a machine without OpenBLAS's headers
   (bench/gpu/run.sh puts this directory first on the include path then, and links shim_blas.c).

   shim_blas.c gives these functions one of two ways, chosen when first called:
     - AVGPIPE_BLAS_SHIM_LIB=/path/to/libopenblas.so set: that library, loaded with dlopen, its sgemm and
       its OpenBLAS functions called through pointers. OpenBLAS's plain names are tried, and those of
       NumPy's bundled build (libscipy_openblas64_*.so: "scipy_" before the name, "64_" after it, 64-bit
       integers): OPENBLAS_CORETYPE then picks that library's kernel as it does OpenBLAS's.
     - unset: plain loops in float, in one of two summation orders (AVGPIPE_NAIVE_BLAS=dot, the default:
       each element's products summed in k order then scaled, beta C added last; =axpy: C scaled by beta
       first, then alpha a(i,k) b(k,j) added to it in k order), which openblas_get_corename reports as
       "naive-dot" or "naive-axpy". Two correct kernels that round differently, as two OpenBLAS kernels do. */
#ifndef AVGPIPE_SHIM_CBLAS_H
#define AVGPIPE_SHIM_CBLAS_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum CBLAS_ORDER { CblasRowMajor = 101, CblasColMajor = 102 } CBLAS_ORDER;
typedef enum CBLAS_TRANSPOSE { CblasNoTrans = 111, CblasTrans = 112, CblasConjTrans = 113 } CBLAS_TRANSPOSE;

void cblas_sgemm(const enum CBLAS_ORDER order, const enum CBLAS_TRANSPOSE transa, const enum CBLAS_TRANSPOSE transb, const int m,
                 const int n, const int k, const float alpha, const float *a, const int lda, const float *b, const int ldb,
                 const float beta, float *c, const int ldc);
char *openblas_get_corename(void);
char *openblas_get_config(void);
void openblas_set_num_threads(int num_threads);

#ifdef __cplusplus
}
#endif
#endif
