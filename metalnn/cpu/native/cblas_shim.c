/*
 * metalnn cblas shim: exports the standard, unprefixed BLAS/LAPACK symbols that MLX's
 * libmlx.so imports (cblas_sgemm, sgesdd_, ...) and forwards each one to an OpenBLAS whose
 * symbols carry a prefix, so that MLX runs on it instead of the slow reference BLAS/LAPACK
 * that the Linux `mlx[cpu]` wheel bundles (loaded with RTLD_GLOBAL before libmlx.so, these
 * definitions win).
 *
 * Two kinds of target:
 *   - ILP64, NumPy's own OpenBLAS (`libscipy_openblas64_*.so` in numpy.libs; names such as
 *     `scipy_cblas_sgemm64_`, 64-bit integers): NumPy and MLX then share one library and one
 *     thread pool. Every name goes through a typed wrapper (cblas_typed.c) that widens the
 *     integer arguments;
 *   - LP64, the OpenBLAS of the `scipy-openblas32` wheel (`scipy_cblas_sgemm`, 32-bit
 *     integers), used where NumPy's library cannot be. Each exported symbol is then a
 *     one-instruction tail jump through a pointer, so the forwarding is signature-agnostic
 *     (LAPACK's hidden Fortran string-length arguments pass through untouched) and costs
 *     nothing measurable; only the matrix products go through a typed wrapper.
 * Either way the products tick the thread governor (blas_threads.c), which fits OpenBLAS's
 * thread count to the cores other processes leave free.
 *
 * The shim does not link against OpenBLAS. The pointers are filled in
 *   - by a constructor at load time, from the global scope (dlsym(RTLD_DEFAULT)), which
 *     works when the OpenBLAS library was loaded RTLD_GLOBAL (or LD_PRELOADed) before this
 *     library: LP64 names first, else ILP64 ones, and
 *   - explicitly by metalnn_shim_init / metalnn_shim_init_ilp64(handle, prefix), called from
 *     metalnn/cpu/blas.py via ctypes.
 * A symbol that could not be resolved points to a stub that reports and aborts instead of
 * jumping to NULL.
 *
 * Built two ways: as the setuptools Extension `metalnn._cblas_shim` (METALNN_SHIM_PYMODULE
 * defined: adds a trivial PyInit so it is a valid extension module) or standalone with
 * `cc -O2 -shared -fPIC cblas_shim.c cblas_typed.c blas_threads.c -ldl -lpthread -lm`.
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

#include "cblas_shim.h"

#define METALNN_SHIM_VERSION 2
#define METALNN_SHIM_PREFIX "scipy_"
#define METALNN_ILP64_SUFFIX "64_"

static void metalnn_shim_unresolved(void) {
    fprintf(stderr,
            "metalnn cblas shim: a BLAS/LAPACK function was called before its OpenBLAS "
            "target was resolved. Load the OpenBLAS library (RTLD_GLOBAL or LD_PRELOAD) "
            "before the shim, or set METALNN_BLAS=off.\n");
    abort();
}

/* One forwarding pointer per symbol (what the exported name jumps to: OpenBLAS itself or a
 * typed wrapper); referenced by name from the asm below. */
#define METALNN_DEFINE_PTR(name) \
    METALNN_HIDDEN __attribute__((used)) void *metalnn_ptr_##name = (void *)&metalnn_shim_unresolved;
METALNN_SHIM_SYMBOLS(METALNN_DEFINE_PTR)

/* The OpenBLAS function behind each symbol (the typed wrappers call it). */
void *metalnn_target[METALNN_NSYM];

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

static unsigned char metalnn_resolved[METALNN_NSYM];
static int metalnn_interface; /* 0: nothing resolved yet, 32: LP64 target, 64: ILP64 target */

/* Resolve every target from `handle` (NULL: the global scope), with the names
 * prefix + name (LP64) or prefix + name + "64_" (ILP64). All or nothing: returns the number
 * of symbols that could not be resolved, and changes nothing unless that is 0. -1 if this
 * architecture has no trampolines. */
static int metalnn_resolve(void *handle, const char *prefix, int ilp64) {
    char buf[160];
    void *found[METALNN_NSYM];
    int missing = 0;
    if (!METALNN_HAVE_TRAMPOLINES) return -1;
    if (prefix == NULL) prefix = "";
    for (int i = 0; i < METALNN_NSYM; ++i) {
        snprintf(buf, sizeof buf, "%s%s%s", prefix, metalnn_table[i].name, ilp64 ? METALNN_ILP64_SUFFIX : "");
        found[i] = dlsym(handle ? handle : RTLD_DEFAULT, buf);
        if (!found[i]) ++missing;
    }
    if (missing) return missing;
    snprintf(buf, sizeof buf, "%sopenblas_set_num_threads%s", prefix, ilp64 ? METALNN_ILP64_SUFFIX : "");
    void *set_threads = dlsym(handle ? handle : RTLD_DEFAULT, buf);
    snprintf(buf, sizeof buf, "%sopenblas_get_num_threads%s", prefix, ilp64 ? METALNN_ILP64_SUFFIX : "");
    void *get_threads = dlsym(handle ? handle : RTLD_DEFAULT, buf);
    metalnn_governor_bind((void (*)(int))set_threads, (int (*)(void))get_threads);
    for (int i = 0; i < METALNN_NSYM; ++i) {
        metalnn_target[i] = found[i];
        void *wrapper = ilp64 ? metalnn_ilp64_wrapper(i) : metalnn_lp64_wrapper(i);
        *metalnn_table[i].slot = wrapper ? wrapper : found[i];
        metalnn_resolved[i] = 1;
    }
    metalnn_interface = ilp64 ? 64 : 32;
    return 0;
}

/* Which names the library of the last failed init lacks (metalnn_shim_is_resolved). */
static unsigned char metalnn_last_missing[METALNN_NSYM];
static int metalnn_last_init_failed;

static int metalnn_record_missing(void *handle, const char *prefix, int ilp64) {
    char buf[160];
    int missing = 0;
    metalnn_last_init_failed = 1;
    for (int i = 0; i < METALNN_NSYM; ++i) {
        snprintf(buf, sizeof buf, "%s%s%s", prefix ? prefix : "", metalnn_table[i].name,
                 ilp64 ? METALNN_ILP64_SUFFIX : "");
        metalnn_last_missing[i] = dlsym(handle ? handle : RTLD_DEFAULT, buf) == NULL;
        missing += metalnn_last_missing[i];
    }
    return missing;
}

/* LP64 target with the `scipy_` prefix (scipy-openblas32). Returns the number of symbols
 * missing (then nothing changed; metalnn_shim_is_resolved tells which), or -1 if this
 * architecture has no trampolines. */
METALNN_EXPORT int metalnn_shim_init(void *handle) {
    int missing = metalnn_resolve(handle, METALNN_SHIM_PREFIX, 0);
    metalnn_last_init_failed = 0;
    if (missing > 0) metalnn_record_missing(handle, METALNN_SHIM_PREFIX, 0);
    return missing;
}

/* ILP64 target: names prefix + name + "64_" (NumPy's OpenBLAS: prefix "scipy_"; NumPy < 2:
 * prefix ""). Same return values as metalnn_shim_init. */
METALNN_EXPORT int metalnn_shim_init_ilp64(void *handle, const char *prefix) {
    int missing = metalnn_resolve(handle, prefix, 1);
    metalnn_last_init_failed = 0;
    if (missing > 0) metalnn_record_missing(handle, prefix, 1);
    return missing;
}

METALNN_EXPORT int metalnn_shim_version(void) { return METALNN_SHIM_VERSION; }
METALNN_EXPORT int metalnn_shim_count(void) { return METALNN_NSYM; }

/* 32 (LP64 OpenBLAS), 64 (ILP64 OpenBLAS) or 0 (nothing resolved). */
METALNN_EXPORT int metalnn_shim_interface(void) { return metalnn_interface; }

METALNN_EXPORT const char *metalnn_shim_symbol(int i) {
    return (i >= 0 && i < METALNN_NSYM) ? metalnn_table[i].name : NULL;
}

/* 1 when symbol i forwards to OpenBLAS; right after a failed init, 0 for the names the
 * library it was given lacks. */
METALNN_EXPORT int metalnn_shim_is_resolved(int i) {
    if (i < 0 || i >= METALNN_NSYM) return 0;
    return metalnn_last_init_failed ? !metalnn_last_missing[i] : metalnn_resolved[i];
}

/* Path of the library that provides `name` in the global scope (what a library
 * loaded later, such as libmlx.so, binds to first), or NULL. */
METALNN_EXPORT const char *metalnn_shim_provider(const char *name) {
    Dl_info info;
    void *p = dlsym(RTLD_DEFAULT, name);
    if (!p || !dladdr(p, &info)) return NULL;
    return info.dli_fname;
}

/* Path of the OpenBLAS library the shim forwards to, or NULL before it resolved. */
METALNN_EXPORT const char *metalnn_shim_library(void) {
    Dl_info info;
    void *p = metalnn_target[METALNN_SYM_cblas_sgemm];
    if (!metalnn_interface || !p || !dladdr(p, &info)) return NULL;
    return info.dli_fname;
}

/* Also works under LD_PRELOAD=<OpenBLAS library>:<this library>, for either interface. */
__attribute__((constructor)) static void metalnn_shim_ctor(void) {
    if (metalnn_resolve(NULL, METALNN_SHIM_PREFIX, 0) != 0) (void)metalnn_resolve(NULL, METALNN_SHIM_PREFIX, 1);
}

#ifdef METALNN_SHIM_PYMODULE
/* Trivial module so setuptools can build this as an extension; metalnn loads the
 * file through ctypes, never through `import`. */
static struct PyModuleDef metalnn_shim_module = {
    PyModuleDef_HEAD_INIT, "_cblas_shim",
    "Forwarding cblas_* -> OpenBLAS shim (loaded by metalnn.cpu.blas via ctypes).",
    -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cblas_shim(void) { return PyModule_Create(&metalnn_shim_module); }
#endif
