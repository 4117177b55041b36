/*
 * The thread governor of metalnn's cblas shim: OpenBLAS's thread count from the cores that
 * other processes leave free.
 *
 * OpenBLAS splits a product over a fixed number of threads that wait for each other by
 * spinning. With more of them than free cores (other busy processes on the machine), a
 * thread that lost its core holds up the ones spinning on it, and a product can take tens
 * of times longer than on one thread. So before a BLAS/LAPACK call, at most every
 * METALNN_GOVERNOR_INTERVAL_NS, the shim measures how many cores other processes kept busy
 * since its last look and sets the thread count with metalnn_blas_threads_policy():
 *
 *   threads = clamp(cores - round(busy elsewhere), 1, cap)
 *
 * "cores" are the CPUs this process may run on (its affinity mask); "busy elsewhere" is the
 * busy time of those CPUs (/proc/stat) less this process's own CPU time (/proc/self/stat),
 * in cores, over the window; a core's worth of work counts from half a core up; "cap" is the
 * most threads allowed (metalnn.cpu.blas sets it: OpenBLAS's own count, which honours
 * OPENBLAS_NUM_THREADS, or METALNN_BLAS_THREADS=<k>). Other processes that get less CPU
 * because this one runs count for what they got, which with two threads per core still
 * rounds up to a core for each busy process.
 *
 * A window shorter than the interval is not used; one longer than METALNN_GOVERNOR_STALE_NS
 * (this process made no BLAS call for a while) only starts a new window. When something
 * else changed the count (threadpoolctl, openblas_set_num_threads), that count becomes the
 * cap. Only one thread measures at a time; the others go on with the current count.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cblas_shim.h"

#define METALNN_GOVERNOR_INTERVAL_NS 100000000ULL /* 100 ms */
#define METALNN_GOVERNOR_STALE_NS 10000000000ULL  /* 10 s */

static void (*gov_set)(int);
static int (*gov_get)(void);
static atomic_int gov_enabled;       /* 0: leave OpenBLAS's count alone */
static atomic_int gov_cap = 1;       /* most threads */
static atomic_int gov_last_set;      /* what the governor last set (0: nothing yet) */
static atomic_ullong gov_next_ns;    /* earliest time of the next look */
static atomic_int gov_free;          /* cores - round(busy elsewhere) of the last window (0: none yet) */
static pthread_mutex_t gov_lock = PTHREAD_MUTEX_INITIALIZER;

/* The last window (read under gov_lock by metalnn_blas_governor_state). */
static unsigned long long win_ns, win_busy, win_total, win_self;
static int have_sample, last_cpus, last_threads = 0;
static double last_busy_elsewhere = -1.0;

METALNN_EXPORT int metalnn_blas_threads_policy(int cpus, double busy_elsewhere, int cap) {
    if (cap < 1) cap = 1;
    if (cpus < 1) cpus = 1;
    if (!(busy_elsewhere > 0.0)) busy_elsewhere = 0.0; /* also NaN */
    if (busy_elsewhere > cpus) busy_elsewhere = cpus;
    int taken = (int)floor(busy_elsewhere + 0.5);
    int n = cpus - taken;
    if (n > cap) n = cap;
    return n < 1 ? 1 : n;
}

static unsigned long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec;
}

/* Busy and total clock ticks of the CPUs in this process's affinity mask (from /proc/stat)
 * and how many those are. Returns 0 on failure. */
static int read_cpu_ticks(unsigned long long *busy, unsigned long long *total, int *cpus) {
    cpu_set_t mask;
    int have_mask = sched_getaffinity(0, sizeof mask, &mask) == 0;
    FILE *f = fopen("/proc/stat", "r");
    if (f == NULL) return 0;
    char line[512];
    unsigned long long b = 0, t = 0;
    int n = 0;
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "cpu", 3) != 0) break; /* the per-CPU lines come first */
        if (line[3] < '0' || line[3] > '9') continue; /* the "cpu" summary line */
        char *end;
        long id = strtol(line + 3, &end, 10);
        if (have_mask && (id < 0 || id >= CPU_SETSIZE || !CPU_ISSET((int)id, &mask))) continue;
        /* user nice system idle iowait irq softirq steal (guest time is inside user) */
        unsigned long long v[8] = {0};
        char *p = end;
        for (int i = 0; i < 8; ++i) v[i] = strtoull(p, &p, 10);
        unsigned long long sum = 0;
        for (int i = 0; i < 8; ++i) sum += v[i];
        t += sum;
        b += sum - v[3] - v[4];
        ++n;
    }
    fclose(f);
    if (n == 0) return 0;
    *busy = b;
    *total = t;
    *cpus = n;
    return 1;
}

/* This process's user + system clock ticks (from /proc/self/stat). Returns 0 on failure. */
static int read_self_ticks(unsigned long long *ticks) {
    FILE *f = fopen("/proc/self/stat", "r");
    if (f == NULL) return 0;
    char buf[1024];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    char *p = strrchr(buf, ')'); /* the command name may hold spaces and parentheses */
    if (p == NULL) return 0;
    ++p;
    /* fields after the name: state(3) ppid pgrp session tty_nr tpgid flags minflt cminflt
     * majflt cmajflt utime(14) stime(15) */
    for (int field = 3; field <= 13; ++field) {
        while (*p == ' ') ++p;
        while (*p && *p != ' ') ++p;
    }
    char *q;
    unsigned long long utime = strtoull(p, &q, 10);
    unsigned long long stime = strtoull(q, &q, 10);
    if (q == p) return 0;
    *ticks = utime + stime;
    return 1;
}

static void measure_and_set(unsigned long long now) {
    unsigned long long busy, total, self;
    int cpus;
    if (!read_cpu_ticks(&busy, &total, &cpus) || !read_self_ticks(&self)) return;
    int fresh = have_sample && now - win_ns >= METALNN_GOVERNOR_INTERVAL_NS / 2 &&
                now - win_ns <= METALNN_GOVERNOR_STALE_NS && total > win_total;
    if (fresh) {
        double d_total = (double)(total - win_total);
        double d_busy = (double)(busy - win_busy);
        double d_self = self >= win_self ? (double)(self - win_self) : 0.0;
        double elsewhere = (d_busy - d_self) / d_total * cpus;
        last_busy_elsewhere = elsewhere < 0.0 ? 0.0 : elsewhere;
        last_cpus = cpus;
        int cap = atomic_load(&gov_cap);
        int current = gov_get ? gov_get() : 0;
        int last = atomic_load(&gov_last_set);
        if (last != 0 && current >= 1 && current != last) {
            cap = current; /* set by someone else since: that is the new most */
            atomic_store(&gov_cap, cap);
        }
        atomic_store(&gov_free, metalnn_blas_threads_policy(cpus, last_busy_elsewhere, cpus));
        int n = metalnn_blas_threads_policy(cpus, last_busy_elsewhere, cap);
        if (n != current && gov_set) gov_set(n);
        atomic_store(&gov_last_set, n);
        last_threads = n;
    }
    win_ns = now;
    win_busy = busy;
    win_total = total;
    win_self = self;
    have_sample = 1;
}

void metalnn_governor_tick(void) {
    if (!atomic_load_explicit(&gov_enabled, memory_order_relaxed)) return;
    unsigned long long now = now_ns();
    if (now < atomic_load_explicit(&gov_next_ns, memory_order_relaxed)) return;
    if (pthread_mutex_trylock(&gov_lock) != 0) return; /* another thread is looking */
    if (now >= atomic_load(&gov_next_ns) && atomic_load(&gov_enabled)) {
        measure_and_set(now);
        atomic_store(&gov_next_ns, now + METALNN_GOVERNOR_INTERVAL_NS);
    }
    pthread_mutex_unlock(&gov_lock);
}

void metalnn_governor_bind(void (*set_threads)(int), int (*get_threads)(void)) {
    pthread_mutex_lock(&gov_lock);
    gov_set = set_threads;
    gov_get = get_threads;
    pthread_mutex_unlock(&gov_lock);
}

/* Turn the governor on (cap >= 1: at most cap threads) or off (cap <= 0). Returns 0, or -1
 * when no OpenBLAS is bound yet. Turning it off leaves the count where it is. */
METALNN_EXPORT int metalnn_blas_governor_configure(int cap) {
    pthread_mutex_lock(&gov_lock);
    int ok = gov_set != NULL && gov_get != NULL;
    if (ok && cap >= 1) {
        atomic_store(&gov_cap, cap);
        int current = gov_get();
        if (current > cap) {
            gov_set(cap);
            current = cap;
        }
        atomic_store(&gov_last_set, current);
        last_threads = current;
        have_sample = 0;
        atomic_store(&gov_next_ns, 0);
        atomic_store(&gov_enabled, 1);
    } else {
        atomic_store(&gov_enabled, 0);
    }
    pthread_mutex_unlock(&gov_lock);
    return ok ? 0 : -1;
}

/* The threads metalnn's own native thread pool may use, at most cap: the cores other processes
 * left free in the governor's last window (ticking the governor, as a BLAS call does); cap while
 * the governor is off or has no complete window yet. The pool looks it up by name (dlsym), so it
 * follows the same measurements as OpenBLAS without a second copy of them. */
METALNN_EXPORT int metalnn_free_threads(int cap) {
    if (cap < 1) cap = 1;
    if (!atomic_load_explicit(&gov_enabled, memory_order_relaxed)) return cap;
    metalnn_governor_tick();
    int n = atomic_load_explicit(&gov_free, memory_order_relaxed);
    if (n < 1) return cap;
    return n < cap ? n : cap;
}

/* The governor's state: whether it is on, its cap, the CPUs and the busy cores elsewhere of
 * its last complete window (-1 before the first), and the count it last chose. */
METALNN_EXPORT void metalnn_blas_governor_state(int *enabled, int *cap, int *cpus, double *busy_elsewhere,
                                                int *threads) {
    pthread_mutex_lock(&gov_lock);
    *enabled = atomic_load(&gov_enabled);
    *cap = atomic_load(&gov_cap);
    *cpus = last_cpus;
    *busy_elsewhere = last_busy_elsewhere;
    *threads = last_threads;
    pthread_mutex_unlock(&gov_lock);
}
