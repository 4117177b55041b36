/*
 * Shared by the three sources of metalnn's cblas shim (one shared library):
 *
 *   cblas_shim.c     the exported cblas_* and LAPACK names, the forwarding table and its set-up;
 *   cblas_typed.c    typed wrappers: LP64 calls converted for an ILP64 OpenBLAS (NumPy's),
 *                    and the matrix products of an LP64 OpenBLAS that tick the thread governor;
 *   blas_threads.c   the thread governor: OpenBLAS's thread count from the cores other
 *                    processes leave free.
 *
 * Nothing here is exported from the library (hidden visibility).
 */
#ifndef METALNN_CBLAS_SHIM_H
#define METALNN_CBLAS_SHIM_H

/* Every name libmlx.so may import. First the ones libmlx.so 0.32 imports (checked with
 * `nm -D --undefined-only`), then a few common ones other MLX versions may use. Each must
 * exist in scipy-openblas32 (with the `scipy_` prefix) and in NumPy's ILP64 OpenBLAS (with
 * the `scipy_` prefix and the `64_` suffix). */
#define METALNN_SHIM_SYMBOLS(X) \
    X(cblas_sgemm)              \
    X(cblas_dgemm)              \
    X(cblas_cgemm)              \
    X(cblas_zgemm)              \
    X(cblas_sgemv)              \
    X(cblas_dgemv)              \
    X(cblas_saxpy)              \
    X(cblas_daxpy)              \
    X(cblas_sdot)               \
    X(cblas_ddot)               \
    X(cblas_sscal)              \
    X(cblas_dscal)              \
    X(cblas_strsm)              \
    X(cblas_dtrsm)              \
    X(cgeev_)                   \
    X(cgesdd_)                  \
    X(cheevd_)                  \
    X(dgeev_)                   \
    X(dgeqrf_)                  \
    X(dgesdd_)                  \
    X(dgetrf_)                  \
    X(dgetri_)                  \
    X(dorgqr_)                  \
    X(dpotrf_)                  \
    X(dsyevd_)                  \
    X(dtrtri_)                  \
    X(sgeev_)                   \
    X(sgeqrf_)                  \
    X(sgesdd_)                  \
    X(sgetrf_)                  \
    X(sgetri_)                  \
    X(sorgqr_)                  \
    X(spotrf_)                  \
    X(ssyevd_)                  \
    X(strtri_)                  \
    X(zgeev_)                   \
    X(zgesdd_)                  \
    X(zheevd_)

#define METALNN_SYM_ENUM(name) METALNN_SYM_##name,
enum { METALNN_SHIM_SYMBOLS(METALNN_SYM_ENUM) METALNN_NSYM };

#define METALNN_HIDDEN __attribute__((visibility("hidden")))
#define METALNN_EXPORT __attribute__((visibility("default")))

/* The OpenBLAS function each name is forwarded to, by METALNN_SYM_* index (cblas_typed.c's
 * wrappers call through these; NULL until resolved). */
METALNN_HIDDEN extern void *metalnn_target[METALNN_NSYM];

/* The typed wrapper of symbol i: for an ILP64 target (every symbol), or for an LP64 target
 * (only the products that tick the governor; NULL for the others, which jump straight to
 * OpenBLAS). */
METALNN_HIDDEN void *metalnn_ilp64_wrapper(int i);
METALNN_HIDDEN void *metalnn_lp64_wrapper(int i);

/* Called before a BLAS/LAPACK call: now and then re-reads the free cores and sets
 * OpenBLAS's thread count (blas_threads.c). Cheap when there is nothing to do. */
METALNN_HIDDEN void metalnn_governor_tick(void);

/* OpenBLAS's openblas_set_num_threads / openblas_get_num_threads of the library the shim
 * forwards to (both take and return a C int in LP64 and ILP64 builds alike). */
METALNN_HIDDEN void metalnn_governor_bind(void (*set_threads)(int), int (*get_threads)(void));

#endif
