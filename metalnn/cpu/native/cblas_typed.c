/*
 * Typed wrappers of metalnn's cblas shim (see cblas_shim.c for the whole picture).
 *
 * libmlx.so calls the LP64 interface: every integer argument (sizes, leading dimensions,
 * LAPACK's pivot and workspace arrays) is a 32-bit C int. NumPy's wheels bundle an ILP64
 * OpenBLAS, whose integers are 64 bits wide and whose names carry a `64_` suffix
 * (`scipy_cblas_sgemm64_`, `scipy_sgesdd_64_`). Forwarding MLX to it lets one OpenBLAS,
 * with one thread pool, serve NumPy and MLX in the same process. Each ILP64 wrapper here
 * widens the integers (scalars by value, integer arrays through a temporary 64-bit copy),
 * calls the ILP64 function through metalnn_target[] and narrows what comes back (`info`,
 * pivots, the optimal `liwork` of a workspace query). LAPACK's hidden Fortran string
 * lengths are passed as 1 (every character argument is one character).
 *
 * For an LP64 target (scipy-openblas32) the matrix products also go through a wrapper here,
 * with no conversion, so that they tick the thread governor; the other names jump straight
 * to OpenBLAS through the shim's trampolines.
 *
 * Array arguments are passed through untouched, so they are `void *` whatever the element
 * type.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "cblas_shim.h"

typedef int64_t i64;

#define TARGET(name, type) ((type)metalnn_target[METALNN_SYM_##name])

/* ------------------------------------------------------------------ integer arrays */

static i64 *metalnn_i64_array(i64 n) {
    i64 *p = (i64 *)malloc((size_t)(n > 1 ? n : 1) * sizeof(i64));
    if (p == NULL) {
        fprintf(stderr, "metalnn cblas shim: out of memory for a LAPACK integer array of %lld entries\n",
                (long long)n);
        abort();
    }
    return p;
}

static void metalnn_narrow(int *dst, const i64 *src, i64 n) {
    for (i64 i = 0; i < n; ++i) dst[i] = (int)src[i];
}

static void metalnn_widen(i64 *dst, const int *src, i64 n) {
    for (i64 i = 0; i < n; ++i) dst[i] = src[i];
}

static i64 metalnn_min(i64 a, i64 b) { return a < b ? a : b; }

/* ------------------------------------------------------------------ CBLAS
 * Each generator takes the C int type of the target (int: LP64, i64: ILP64) and the
 * wrapper's name prefix. Enums (order, transpose, side, ...) stay C ints in both. */

#define GEMM_REAL(p, T, INT, W)                                                                       \
    static void W##cblas_##p##gemm(int order, int ta, int tb, int m, int n, int k, T alpha,           \
                                   const void *a, int lda, const void *b, int ldb, T beta, void *c,   \
                                   int ldc) {                                                         \
        metalnn_governor_tick();                                                                      \
        TARGET(cblas_##p##gemm, void (*)(int, int, int, INT, INT, INT, T, const void *, INT,           \
                                         const void *, INT, T, void *, INT))                          \
        (order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);                                \
    }

#define GEMM_CPLX(p, INT, W)                                                                          \
    static void W##cblas_##p##gemm(int order, int ta, int tb, int m, int n, int k,                    \
                                   const void *alpha, const void *a, int lda, const void *b, int ldb, \
                                   const void *beta, void *c, int ldc) {                              \
        metalnn_governor_tick();                                                                      \
        TARGET(cblas_##p##gemm, void (*)(int, int, int, INT, INT, INT, const void *, const void *,     \
                                         INT, const void *, INT, const void *, void *, INT))          \
        (order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);                                \
    }

#define GEMV(p, T, INT, W)                                                                            \
    static void W##cblas_##p##gemv(int order, int trans, int m, int n, T alpha, const void *a,        \
                                   int lda, const void *x, int incx, T beta, void *y, int incy) {     \
        metalnn_governor_tick();                                                                      \
        TARGET(cblas_##p##gemv, void (*)(int, int, INT, INT, T, const void *, INT, const void *, INT,  \
                                         T, void *, INT))                                             \
        (order, trans, m, n, alpha, a, lda, x, incx, beta, y, incy);                                  \
    }

#define TRSM(p, T, INT, W)                                                                            \
    static void W##cblas_##p##trsm(int order, int side, int uplo, int trans, int diag, int m, int n,  \
                                   T alpha, const void *a, int lda, void *b, int ldb) {               \
        metalnn_governor_tick();                                                                      \
        TARGET(cblas_##p##trsm, void (*)(int, int, int, int, int, INT, INT, T, const void *, INT,      \
                                         void *, INT))                                                \
        (order, side, uplo, trans, diag, m, n, alpha, a, lda, b, ldb);                                \
    }

#define AXPY(p, T)                                                                                    \
    static void w64_cblas_##p##axpy(int n, T alpha, const void *x, int incx, void *y, int incy) {     \
        TARGET(cblas_##p##axpy, void (*)(i64, T, const void *, i64, void *, i64))                     \
        (n, alpha, x, incx, y, incy);                                                                 \
    }

#define DOT(p, T)                                                                                     \
    static T w64_cblas_##p##dot(int n, const void *x, int incx, const void *y, int incy) {            \
        return TARGET(cblas_##p##dot, T (*)(i64, const void *, i64, const void *, i64))               \
            (n, x, incx, y, incy);                                                                    \
    }

#define SCAL(p, T)                                                                                    \
    static void w64_cblas_##p##scal(int n, T alpha, void *x, int incx) {                              \
        TARGET(cblas_##p##scal, void (*)(i64, T, void *, i64))(n, alpha, x, incx);                    \
    }

/* LP64: the products that tick the governor. */
GEMM_REAL(s, float, int, w32_)
GEMM_REAL(d, double, int, w32_)
GEMM_CPLX(c, int, w32_)
GEMM_CPLX(z, int, w32_)
GEMV(s, float, int, w32_)
GEMV(d, double, int, w32_)
TRSM(s, float, int, w32_)
TRSM(d, double, int, w32_)

/* ILP64: everything. */
GEMM_REAL(s, float, i64, w64_)
GEMM_REAL(d, double, i64, w64_)
GEMM_CPLX(c, i64, w64_)
GEMM_CPLX(z, i64, w64_)
GEMV(s, float, i64, w64_)
GEMV(d, double, i64, w64_)
TRSM(s, float, i64, w64_)
TRSM(d, double, i64, w64_)
AXPY(s, float)
AXPY(d, double)
DOT(s, float)
DOT(d, double)
SCAL(s, float)
SCAL(d, double)

/* ------------------------------------------------------------------ LAPACK (ILP64)
 * Reference LAPACK's interface: every argument by pointer, then one hidden length per
 * character argument (ignored here: MLX passes one-character strings). */

typedef const char *chr;
typedef const int *cint;

#define GEEV_REAL(p)                                                                                  \
    static void w64_##p##geev_(chr jobvl, chr jobvr, cint n, void *a, cint lda, void *wr, void *wi,   \
                               void *vl, cint ldvl, void *vr, cint ldvr, void *work, cint lwork,      \
                               int *info) {                                                           \
        metalnn_governor_tick();                                                                      \
        i64 n_ = *n, lda_ = *lda, ldvl_ = *ldvl, ldvr_ = *ldvr, lwork_ = *lwork, info_ = 0;           \
        TARGET(p##geev_, void (*)(chr, chr, const i64 *, void *, const i64 *, void *, void *, void *,  \
                                  const i64 *, void *, const i64 *, void *, const i64 *, i64 *,       \
                                  size_t, size_t))                                                    \
        (jobvl, jobvr, &n_, a, &lda_, wr, wi, vl, &ldvl_, vr, &ldvr_, work, &lwork_, &info_, 1, 1);   \
        *info = (int)info_;                                                                           \
    }

#define GEEV_CPLX(p)                                                                                  \
    static void w64_##p##geev_(chr jobvl, chr jobvr, cint n, void *a, cint lda, void *w, void *vl,    \
                               cint ldvl, void *vr, cint ldvr, void *work, cint lwork, void *rwork,   \
                               int *info) {                                                           \
        metalnn_governor_tick();                                                                      \
        i64 n_ = *n, lda_ = *lda, ldvl_ = *ldvl, ldvr_ = *ldvr, lwork_ = *lwork, info_ = 0;           \
        TARGET(p##geev_, void (*)(chr, chr, const i64 *, void *, const i64 *, void *, void *,          \
                                  const i64 *, void *, const i64 *, void *, const i64 *, void *,      \
                                  i64 *, size_t, size_t))                                             \
        (jobvl, jobvr, &n_, a, &lda_, w, vl, &ldvl_, vr, &ldvr_, work, &lwork_, rwork, &info_, 1, 1); \
        *info = (int)info_;                                                                           \
    }

/* IWORK: workspace of 8 * min(M, N) integers, nothing to copy either way. */
#define GESDD_REAL(p)                                                                                 \
    static void w64_##p##gesdd_(chr jobz, cint m, cint n, void *a, cint lda, void *s, void *u,        \
                                cint ldu, void *vt, cint ldvt, void *work, cint lwork, int *iwork,    \
                                int *info) {                                                          \
        (void)iwork;                                                                                  \
        metalnn_governor_tick();                                                                      \
        i64 m_ = *m, n_ = *n, lda_ = *lda, ldu_ = *ldu, ldvt_ = *ldvt, lwork_ = *lwork, info_ = 0;    \
        i64 *iw = metalnn_i64_array(8 * metalnn_min(m_, n_));                                         \
        TARGET(p##gesdd_, void (*)(chr, const i64 *, const i64 *, void *, const i64 *, void *, void *, \
                                   const i64 *, void *, const i64 *, void *, const i64 *, i64 *,      \
                                   i64 *, size_t))                                                    \
        (jobz, &m_, &n_, a, &lda_, s, u, &ldu_, vt, &ldvt_, work, &lwork_, iw, &info_, 1);            \
        free(iw);                                                                                     \
        *info = (int)info_;                                                                           \
    }

#define GESDD_CPLX(p)                                                                                 \
    static void w64_##p##gesdd_(chr jobz, cint m, cint n, void *a, cint lda, void *s, void *u,        \
                                cint ldu, void *vt, cint ldvt, void *work, cint lwork, void *rwork,   \
                                int *iwork, int *info) {                                              \
        (void)iwork;                                                                                  \
        metalnn_governor_tick();                                                                      \
        i64 m_ = *m, n_ = *n, lda_ = *lda, ldu_ = *ldu, ldvt_ = *ldvt, lwork_ = *lwork, info_ = 0;    \
        i64 *iw = metalnn_i64_array(8 * metalnn_min(m_, n_));                                         \
        TARGET(p##gesdd_, void (*)(chr, const i64 *, const i64 *, void *, const i64 *, void *, void *, \
                                   const i64 *, void *, const i64 *, void *, const i64 *, void *,     \
                                   i64 *, i64 *, size_t))                                             \
        (jobz, &m_, &n_, a, &lda_, s, u, &ldu_, vt, &ldvt_, work, &lwork_, rwork, iw, &info_, 1);     \
        free(iw);                                                                                     \
        *info = (int)info_;                                                                           \
    }

/* IWORK: max(1, LIWORK) integers; on exit IWORK(1) holds the optimal LIWORK (what a
 * workspace query with LIWORK = -1 asks for), so that one entry is copied back. */
#define SYEVD(p)                                                                                      \
    static void w64_##p##syevd_(chr jobz, chr uplo, cint n, void *a, cint lda, void *w, void *work,   \
                                cint lwork, int *iwork, cint liwork, int *info) {                     \
        metalnn_governor_tick();                                                                      \
        i64 n_ = *n, lda_ = *lda, lwork_ = *lwork, liwork_ = *liwork, info_ = 0;                      \
        i64 *iw = metalnn_i64_array(liwork_);                                                         \
        iw[0] = 0;                                                                                    \
        TARGET(p##syevd_, void (*)(chr, chr, const i64 *, void *, const i64 *, void *, void *,         \
                                   const i64 *, i64 *, const i64 *, i64 *, size_t, size_t))           \
        (jobz, uplo, &n_, a, &lda_, w, work, &lwork_, iw, &liwork_, &info_, 1, 1);                    \
        iwork[0] = (int)iw[0];                                                                        \
        free(iw);                                                                                     \
        *info = (int)info_;                                                                           \
    }

#define HEEVD(p)                                                                                      \
    static void w64_##p##heevd_(chr jobz, chr uplo, cint n, void *a, cint lda, void *w, void *work,   \
                                cint lwork, void *rwork, cint lrwork, int *iwork, cint liwork,        \
                                int *info) {                                                          \
        metalnn_governor_tick();                                                                      \
        i64 n_ = *n, lda_ = *lda, lwork_ = *lwork, lrwork_ = *lrwork, liwork_ = *liwork, info_ = 0;   \
        i64 *iw = metalnn_i64_array(liwork_);                                                         \
        iw[0] = 0;                                                                                    \
        TARGET(p##heevd_, void (*)(chr, chr, const i64 *, void *, const i64 *, void *, void *,         \
                                   const i64 *, void *, const i64 *, i64 *, const i64 *, i64 *,       \
                                   size_t, size_t))                                                   \
        (jobz, uplo, &n_, a, &lda_, w, work, &lwork_, rwork, &lrwork_, iw, &liwork_, &info_, 1, 1);   \
        iwork[0] = (int)iw[0];                                                                        \
        free(iw);                                                                                     \
        *info = (int)info_;                                                                           \
    }

#define GEQRF(p)                                                                                      \
    static void w64_##p##geqrf_(cint m, cint n, void *a, cint lda, void *tau, void *work, cint lwork, \
                                int *info) {                                                          \
        metalnn_governor_tick();                                                                      \
        i64 m_ = *m, n_ = *n, lda_ = *lda, lwork_ = *lwork, info_ = 0;                                \
        TARGET(p##geqrf_, void (*)(const i64 *, const i64 *, void *, const i64 *, void *, void *,      \
                                   const i64 *, i64 *))                                               \
        (&m_, &n_, a, &lda_, tau, work, &lwork_, &info_);                                             \
        *info = (int)info_;                                                                           \
    }

#define ORGQR(p)                                                                                      \
    static void w64_##p##orgqr_(cint m, cint n, cint k, void *a, cint lda, void *tau, void *work,     \
                                cint lwork, int *info) {                                              \
        metalnn_governor_tick();                                                                      \
        i64 m_ = *m, n_ = *n, k_ = *k, lda_ = *lda, lwork_ = *lwork, info_ = 0;                       \
        TARGET(p##orgqr_, void (*)(const i64 *, const i64 *, const i64 *, void *, const i64 *, void *, \
                                   void *, const i64 *, i64 *))                                       \
        (&m_, &n_, &k_, a, &lda_, tau, work, &lwork_, &info_);                                        \
        *info = (int)info_;                                                                           \
    }

/* IPIV: min(M, N) pivots out. */
#define GETRF(p)                                                                                      \
    static void w64_##p##getrf_(cint m, cint n, void *a, cint lda, int *ipiv, int *info) {            \
        metalnn_governor_tick();                                                                      \
        i64 m_ = *m, n_ = *n, lda_ = *lda, info_ = 0;                                                 \
        i64 k = metalnn_min(m_, n_);                                                                  \
        i64 *piv = metalnn_i64_array(k);                                                              \
        TARGET(p##getrf_, void (*)(const i64 *, const i64 *, void *, const i64 *, i64 *, i64 *))       \
        (&m_, &n_, a, &lda_, piv, &info_);                                                            \
        if (info_ >= 0) metalnn_narrow(ipiv, piv, k);                                                 \
        free(piv);                                                                                    \
        *info = (int)info_;                                                                           \
    }

/* IPIV: N pivots in (from getrf). */
#define GETRI(p)                                                                                      \
    static void w64_##p##getri_(cint n, void *a, cint lda, const int *ipiv, void *work, cint lwork,   \
                                int *info) {                                                          \
        metalnn_governor_tick();                                                                      \
        i64 n_ = *n, lda_ = *lda, lwork_ = *lwork, info_ = 0;                                         \
        i64 *piv = metalnn_i64_array(n_);                                                             \
        if (lwork_ != -1) metalnn_widen(piv, ipiv, n_);                                               \
        TARGET(p##getri_, void (*)(const i64 *, void *, const i64 *, const i64 *, void *, const i64 *, \
                                   i64 *))                                                            \
        (&n_, a, &lda_, piv, work, &lwork_, &info_);                                                  \
        free(piv);                                                                                    \
        *info = (int)info_;                                                                           \
    }

#define POTRF(p)                                                                                      \
    static void w64_##p##potrf_(chr uplo, cint n, void *a, cint lda, int *info) {                     \
        metalnn_governor_tick();                                                                      \
        i64 n_ = *n, lda_ = *lda, info_ = 0;                                                          \
        TARGET(p##potrf_, void (*)(chr, const i64 *, void *, const i64 *, i64 *, size_t))              \
        (uplo, &n_, a, &lda_, &info_, 1);                                                             \
        *info = (int)info_;                                                                           \
    }

#define TRTRI(p)                                                                                      \
    static void w64_##p##trtri_(chr uplo, chr diag, cint n, void *a, cint lda, int *info) {           \
        metalnn_governor_tick();                                                                      \
        i64 n_ = *n, lda_ = *lda, info_ = 0;                                                          \
        TARGET(p##trtri_, void (*)(chr, chr, const i64 *, void *, const i64 *, i64 *, size_t, size_t)) \
        (uplo, diag, &n_, a, &lda_, &info_, 1, 1);                                                    \
        *info = (int)info_;                                                                           \
    }

GEEV_REAL(s)
GEEV_REAL(d)
GEEV_CPLX(c)
GEEV_CPLX(z)
GESDD_REAL(s)
GESDD_REAL(d)
GESDD_CPLX(c)
GESDD_CPLX(z)
SYEVD(s)
SYEVD(d)
HEEVD(c)
HEEVD(z)
GEQRF(s)
GEQRF(d)
ORGQR(s)
ORGQR(d)
GETRF(s)
GETRF(d)
GETRI(s)
GETRI(d)
POTRF(s)
POTRF(d)
TRTRI(s)
TRTRI(d)

/* ------------------------------------------------------------------ lookup */

#define METALNN_W64_ENTRY(name) (void *)&w64_##name,
static void *const metalnn_w64[METALNN_NSYM] = {METALNN_SHIM_SYMBOLS(METALNN_W64_ENTRY)};

void *metalnn_ilp64_wrapper(int i) {
    return (i >= 0 && i < METALNN_NSYM) ? metalnn_w64[i] : NULL;
}

void *metalnn_lp64_wrapper(int i) {
    switch (i) {
        case METALNN_SYM_cblas_sgemm: return (void *)&w32_cblas_sgemm;
        case METALNN_SYM_cblas_dgemm: return (void *)&w32_cblas_dgemm;
        case METALNN_SYM_cblas_cgemm: return (void *)&w32_cblas_cgemm;
        case METALNN_SYM_cblas_zgemm: return (void *)&w32_cblas_zgemm;
        case METALNN_SYM_cblas_sgemv: return (void *)&w32_cblas_sgemv;
        case METALNN_SYM_cblas_dgemv: return (void *)&w32_cblas_dgemv;
        case METALNN_SYM_cblas_strsm: return (void *)&w32_cblas_strsm;
        case METALNN_SYM_cblas_dtrsm: return (void *)&w32_cblas_dtrsm;
        default: return NULL;
    }
}
