/*
 * metalnn cblas shim: exports the standard, unprefixed BLAS/LAPACK symbols that
 * MLX's libmlx.so imports (cblas_sgemm, sgesdd_, ...) and forwards each one to the
 * `scipy_`-prefixed symbol of the OpenBLAS shipped in the `scipy-openblas32` wheel.
 *
 * Loaded with RTLD_GLOBAL before libmlx.so, these definitions win over the slow
 * reference BLAS/LAPACK that the Linux `mlx[cpu]` wheel bundles.
 *
 * Each exported symbol is a one-instruction tail jump through a pointer, so the
 * forwarding is signature-agnostic (LAPACK's hidden Fortran string-length
 * arguments pass through untouched) and costs nothing measurable.
 *
 * The shim does not link against OpenBLAS. The pointers are filled in
 *   - by a constructor at load time, from the global scope (dlsym(RTLD_DEFAULT)),
 *     which works when libscipy_openblas.so was loaded RTLD_GLOBAL (or LD_PRELOADed)
 *     before this library, and
 *   - explicitly by metalnn_shim_init(handle), called from metalnn/cpu/blas.py via ctypes.
 * A symbol that could not be resolved points to a stub that reports and aborts
 * instead of jumping to NULL.
 *
 * Built two ways: as the setuptools Extension `metalnn._cblas_shim`
 * (METALNN_SHIM_PYMODULE defined: adds a trivial PyInit so it is a valid extension
 * module) or standalone with `cc -O2 -shared -fPIC cblas_shim.c -ldl`.
 */
#ifdef METALNN_SHIM_PYMODULE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#endif

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define METALNN_SHIM_VERSION 1
#define METALNN_SHIM_PREFIX "scipy_"

/* Every symbol here must exist (with the prefix) in scipy-openblas32.
 * First the ones libmlx.so 0.32 imports (checked with `nm -D --undefined-only`),
 * then a few common ones other MLX versions may use. */
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

#define METALNN_EXPORT __attribute__((visibility("default")))
#define METALNN_HIDDEN __attribute__((visibility("hidden"), used))

static void metalnn_shim_unresolved(void) {
    fprintf(stderr,
            "metalnn cblas shim: a BLAS/LAPACK function was called before its "
            "scipy-openblas32 target was resolved. Load libscipy_openblas.so "
            "(RTLD_GLOBAL or LD_PRELOAD) before the shim, or set METALNN_BLAS=off.\n");
    abort();
}

/* One forwarding pointer per symbol; referenced by name from the asm below. */
#define METALNN_DEFINE_PTR(name) \
    METALNN_HIDDEN void *metalnn_ptr_##name = (void *)&metalnn_shim_unresolved;
METALNN_SHIM_SYMBOLS(METALNN_DEFINE_PTR)

#if defined(__x86_64__)
#if defined(__CET__)
#define METALNN_ENDBR "endbr64\n"
#else
#define METALNN_ENDBR ""
#endif
#define METALNN_TRAMPOLINE(name)                       \
    __asm__(".text\n"                                  \
            ".globl " #name "\n"                       \
            ".type " #name ", @function\n"             \
            ".p2align 4\n" #name ":\n" METALNN_ENDBR   \
            "jmp *metalnn_ptr_" #name "(%rip)\n"       \
            ".size " #name ", .-" #name "\n");
#define METALNN_HAVE_TRAMPOLINES 1
#elif defined(__aarch64__)
#if defined(__ARM_FEATURE_BTI_DEFAULT)
#define METALNN_BTI "bti c\n"
#else
#define METALNN_BTI ""
#endif
#define METALNN_TRAMPOLINE(name)                                      \
    __asm__(".text\n"                                                 \
            ".globl " #name "\n"                                      \
            ".type " #name ", %function\n"                            \
            ".p2align 4\n" #name ":\n" METALNN_BTI                    \
            "adrp x16, metalnn_ptr_" #name "\n"                       \
            "ldr x16, [x16, #:lo12:metalnn_ptr_" #name "]\n"          \
            "br x16\n"                                                \
            ".size " #name ", .-" #name "\n");
#define METALNN_HAVE_TRAMPOLINES 1
#else
#define METALNN_HAVE_TRAMPOLINES 0
#endif

#if METALNN_HAVE_TRAMPOLINES
METALNN_SHIM_SYMBOLS(METALNN_TRAMPOLINE)
#endif

struct metalnn_shim_entry {
    const char *name;
    void **slot;
};

#define METALNN_TABLE_ENTRY(name) {#name, &metalnn_ptr_##name},
static const struct metalnn_shim_entry metalnn_table[] = {
    METALNN_SHIM_SYMBOLS(METALNN_TABLE_ENTRY)};
#define METALNN_NSYM ((int)(sizeof(metalnn_table) / sizeof(metalnn_table[0])))

static unsigned char metalnn_resolved[sizeof(metalnn_table) / sizeof(metalnn_table[0])];

/* Resolve every target from `handle` (NULL: the global scope). Returns the
 * number of symbols that could not be resolved; those keep their previous
 * target. -1 if this architecture has no trampolines. */
METALNN_EXPORT int metalnn_shim_init(void *handle) {
    char buf[128];
    int missing = 0;
    if (!METALNN_HAVE_TRAMPOLINES) return -1;
    for (int i = 0; i < METALNN_NSYM; ++i) {
        snprintf(buf, sizeof buf, "%s%s", METALNN_SHIM_PREFIX, metalnn_table[i].name);
        void *p = dlsym(handle ? handle : RTLD_DEFAULT, buf);
        if (p) {
            *metalnn_table[i].slot = p;
            metalnn_resolved[i] = 1;
        } else if (!metalnn_resolved[i]) {
            ++missing;
        }
    }
    return missing;
}

METALNN_EXPORT int metalnn_shim_version(void) { return METALNN_SHIM_VERSION; }
METALNN_EXPORT int metalnn_shim_count(void) { return METALNN_NSYM; }

METALNN_EXPORT const char *metalnn_shim_symbol(int i) {
    return (i >= 0 && i < METALNN_NSYM) ? metalnn_table[i].name : NULL;
}

METALNN_EXPORT int metalnn_shim_is_resolved(int i) {
    return (i >= 0 && i < METALNN_NSYM) ? metalnn_resolved[i] : 0;
}

/* Path of the library that provides `name` in the global scope (what a library
 * loaded later, such as libmlx.so, binds to first), or NULL. */
METALNN_EXPORT const char *metalnn_shim_provider(const char *name) {
    Dl_info info;
    void *p = dlsym(RTLD_DEFAULT, name);
    if (!p || !dladdr(p, &info)) return NULL;
    return info.dli_fname;
}

/* Also works under LD_PRELOAD=libscipy_openblas.so:<this library>. */
__attribute__((constructor)) static void metalnn_shim_ctor(void) {
    (void)metalnn_shim_init(NULL);
}

#ifdef METALNN_SHIM_PYMODULE
/* Trivial module so setuptools can build this as an extension; metalnn loads the
 * file through ctypes, never through `import`. */
static struct PyModuleDef metalnn_shim_module = {
    PyModuleDef_HEAD_INIT, "_cblas_shim",
    "Forwarding cblas_* -> scipy_cblas_* shim (loaded by metalnn.cpu.blas via ctypes).",
    -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cblas_shim(void) { return PyModule_Create(&metalnn_shim_module); }
#endif
