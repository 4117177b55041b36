// Emulator runtime: runs every thread of a threadgroup as a fiber (ucontext) on
// one OS thread, switching at barriers and SIMD operations, and keeps the
// shadow state used to check threadgroup memory (written-before-read, races).
//
// Compiled once (cached) and linked into every translated kernel library.
#include "mtl_abi.h"

#include <setjmp.h>
#include <stdint.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>

// No C++ standard library: the runtime is linked into freestanding kernel libraries
// (-nostdlib++), so it keeps its arrays in `Buf` (malloc'd, POD) below.

namespace {

// A growable array of trivially copyable T (zero-initialised state is an empty array).
template <class T>
struct Buf {
  T* data;
  size_t n, cap;
  size_t size() const { return n; }
  bool empty() const { return n == 0; }
  void clear() { n = 0; }
  T& operator[](size_t i) { return data[i]; }
  const T& operator[](size_t i) const { return data[i]; }
  T* begin() { return data; }
  T* end() { return data + n; }
  void reserve(size_t c) {
    if (c <= cap) return;
    size_t nc = cap ? cap : 16;
    while (nc < c) nc *= 2;
    T* d = (T*)realloc(data, nc * sizeof(T));
    if (!d) abort();
    data = d;
    cap = nc;
  }
  void resize(size_t m) {
    reserve(m);
    n = m;
  }
  void push_back(const T& v) {
    reserve(n + 1);
    data[n++] = v;
  }
};

constexpr int kMaxThreads = 1024;
constexpr int64_t kTgLimit = 32768;               // Apple GPUs: 32 KiB threadgroup memory
constexpr int64_t kArenaBytes = kTgLimit + 4096;  // slack for alignment
constexpr size_t kStackBytes = 256 * 1024;
constexpr int kLogCopy = 32;

enum State { READY, AT_BARRIER, AT_SIMD, DONE };

struct LogEntry {
  char* addr;
  int size;
  int out_id;  // -1: threadgroup memory; else the kernel buffer (an output) in device memory
  int store;   // the kernel text assigns to it (`out[i] = v`): a store even if the value is unchanged
  unsigned char pre[kLogCopy];
};

struct Fiber {
  ucontext_t ctx;
  char* stack;
  State state;
  unsigned line, col;
  int bflags;  // mem_flags of the threadgroup_barrier the fiber waits at
  const char* op;
  mtl_thread_info info;
  Buf<LogEntry> log;
};

struct Alloc {
  int id;
  const char* name;
  int64_t off, bytes;
};

struct SimdGroup {
  unsigned char live[MTL_SIMD_WIDTH][MTL_SIMD_SLOT];
  int64_t live_arg[MTL_SIMD_WIDTH];
  mtl_simd_snapshot snap;
  uint32_t sync;  // collective operations completed (orders accesses within the group)
};

// shadow state per byte of threadgroup memory
struct Shadow {
  int32_t w_tid, w_ep, w_ss;
  int32_t r_tid, r_ep, r_ss;
  uint8_t init;
};

// shadow state per element of an output buffer (device memory): the last writer and reader
struct DevAccess {
  int32_t tg;   // threadgroup (linear index + 1; 0: none)
  int32_t tid;  // thread_index_in_threadgroup
  int32_t ep;   // device-memory barrier epoch
  int32_t ss;   // SIMD sync count of its simdgroup
  uint32_t gid; // thread_position_in_grid, linear
};
struct DevShadow {
  DevAccess w, r;
};
struct DevOut {
  char* lo;
  char* hi;
  int elem;
  DevShadow* sh;
};

Fiber* g_fibers = nullptr;
char* g_stacks = nullptr;
int g_n = 0;
Fiber* g_cur = nullptr;
ucontext_t g_sched;
char g_err[8192];
bool g_failed = false;
const char* g_kname = "?";
int g_check_races = 1;
int g_strict_simd = 0;
void* const* g_bufs;
void* const* g_lo;
void* const* g_hi;

alignas(64) char g_arena[kArenaBytes];
Shadow* g_shadow = nullptr;
int64_t g_arena_used = 0, g_arena_high = 0;
Buf<Alloc> g_allocs;
int32_t g_epoch = 0;  // threadgroup barriers (with mem_threadgroup) passed in this threadgroup
unsigned g_weak_line = 0;  // a barrier without mem_threadgroup passed in the current epoch (its line)
constexpr int kMemDevice = 1;       // mem_flags::mem_device
constexpr int kMemThreadgroup = 2;  // mem_flags::mem_threadgroup
// device memory: outputs' shadows (by kernel buffer index), the current threadgroup, the epoch of
// device-memory barriers (threadgroup_barrier with mem_device), the grid
Buf<DevOut> g_outs;
int32_t g_tg_index = 0;
int32_t g_dev_epoch = 0;
uint32_t g_grid[3];
SimdGroup g_sg[kMaxThreads / MTL_SIMD_WIDTH];

sigjmp_buf g_jmp;
volatile sig_atomic_t g_in_launch = 0;
char* g_altstack = nullptr;

const unsigned char kPoison[4] = {0xA5, 0xA5, 0xC1, 0x7F};  // float: NaN; int: 0x7FC1A5A5

void fmt_pos(char* buf, size_t n, const Fiber* f) {
  const uint32_t* p = f->info.thread_position_in_grid;
  snprintf(buf, n, "(%u, %u, %u)", p[0], p[1], p[2]);
}

void set_error(const Fiber* f, const char* fmt, ...) {
  if (g_failed) return;
  g_failed = true;
  char pos[64] = "(scheduler)";
  char tg[64] = "";
  if (f) {
    fmt_pos(pos, sizeof pos, f);
    const uint32_t* t = f->info.threadgroup_position_in_grid;
    snprintf(tg, sizeof tg, ", threadgroup (%u, %u, %u), simdgroup %u lane %u", t[0], t[1],
             t[2], f->info.simdgroup_index_in_threadgroup, f->info.thread_index_in_simdgroup);
  }
  int k = snprintf(g_err, sizeof g_err, "kernel '%s', thread_position_in_grid=%s%s: ", g_kname,
                   pos, tg);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_err + k, sizeof g_err - k, fmt, ap);
  va_end(ap);
}

void switch_to_scheduler() { swapcontext(&g_cur->ctx, &g_sched); }

__attribute__((noreturn)) void abort_fiber() {
  // never resumed: the scheduler sees g_failed and gives up on the launch
  swapcontext(&g_cur->ctx, &g_sched);
  __builtin_trap();
}

const Alloc* find_alloc(const char* p) {
  for (const Alloc& a : g_allocs)
    if (p >= g_arena + a.off && p < g_arena + a.off + a.bytes) return &a;
  return nullptr;
}

void describe_addr(char* buf, size_t n, const char* p, int size) {
  const Alloc* a = find_alloc(p);
  if (a)
    snprintf(buf, n, "threadgroup array '%s' byte offset %lld (%d-byte element %lld)", a->name,
             (long long)(p - g_arena - a->off), size,
             (long long)((p - g_arena - a->off) / (size > 0 ? size : 1)));
  else
    snprintf(buf, n, "threadgroup memory byte %lld", (long long)(p - g_arena));
}

inline int sg_of(int tid) { return tid / MTL_SIMD_WIDTH; }

// Are an earlier access by thread `tid` (epoch ep, simd sync ss) and an access
// by thread `me` now unordered (no barrier between them)?
inline bool concurrent(int tid, int32_t ep, int32_t ss, int me) {
  if (tid < 0 || tid == me || ep != g_epoch) return false;
  if (sg_of(tid) != sg_of(me)) return true;
  return (uint32_t)ss == g_sg[sg_of(me)].sync;
}

// why two accesses are unordered, for the race messages
const char* race_hint(char* buf, size_t n) {
  if (g_weak_line)
    snprintf(buf, n, "; the threadgroup_barrier on line %u orders no threadgroup memory: its mem_flags "
             "lack mem_flags::mem_threadgroup", g_weak_line);
  else
    snprintf(buf, n, " (missing threadgroup_barrier?)");
  return buf;
}

void shadow_access(Fiber* f, char* addr, int size, bool write) {
  int me = (int)f->info.thread_index_in_threadgroup;
  int64_t base = addr - g_arena;
  if (base < 0 || base + size > g_arena_high) return;
  int32_t ss = (int32_t)g_sg[sg_of(me)].sync;
  for (int b = 0; b < size; ++b) {
    Shadow& s = g_shadow[base + b];
    if (!write) {
      if (!s.init) {
        char d[256];
        describe_addr(d, sizeof d, addr, size);
        set_error(f, "read of uninitialised threadgroup memory: %s was never written", d);
        return;
      }
      if (g_check_races && concurrent(s.w_tid, s.w_ep, s.w_ss, me)) {
        char d[256], other[64], hint[200];
        describe_addr(d, sizeof d, addr, size);
        fmt_pos(other, sizeof other, &g_fibers[s.w_tid]);
        set_error(f,
                  "threadgroup memory race: reads %s, written by thread %s in the same barrier "
                  "interval%s",
                  d, other, race_hint(hint, sizeof hint));
        return;
      }
      // keep an unordered read by another thread: a later write by this thread must still see it
      if (!concurrent(s.r_tid, s.r_ep, s.r_ss, me)) {
        s.r_tid = me;
        s.r_ep = g_epoch;
        s.r_ss = ss;
      }
    } else {
      if (g_check_races) {
        int other_tid = -1;
        const char* kind = nullptr;
        if (concurrent(s.w_tid, s.w_ep, s.w_ss, me)) {
          other_tid = s.w_tid;
          kind = "written";
        } else if (concurrent(s.r_tid, s.r_ep, s.r_ss, me)) {
          other_tid = s.r_tid;
          kind = "read";
        }
        if (kind) {
          char d[256], other[64], hint[200];
          describe_addr(d, sizeof d, addr, size);
          fmt_pos(other, sizeof other, &g_fibers[other_tid]);
          set_error(f,
                    "threadgroup memory race: writes %s, %s by thread %s in the same barrier "
                    "interval%s",
                    d, kind, other, race_hint(hint, sizeof hint));
          return;
        }
      }
      s.init = 1;
      s.w_tid = me;
      s.w_ep = g_epoch;
      s.w_ss = ss;
    }
  }
}

void fmt_gid(char* buf, size_t n, uint32_t gid) {
  snprintf(buf, n, "(%u, %u, %u)", gid % g_grid[0], (gid / g_grid[0]) % g_grid[1], gid / (g_grid[0] * g_grid[1]));
}

// Are an earlier device-memory access `a` and one by thread `me` of this threadgroup unordered?
// Threadgroups of one dispatch are never ordered; in a threadgroup, a threadgroup_barrier with
// mem_device orders them, and in a simdgroup any SIMD collective.
inline bool dev_concurrent(const DevAccess& a, int me) {
  if (a.tg == 0) return false;
  if (a.tg != g_tg_index) return true;
  if (a.tid == me || a.ep != g_dev_epoch) return false;
  if (sg_of(a.tid) != sg_of(me)) return true;
  return (uint32_t)a.ss == g_sg[sg_of(me)].sync;
}

// A write (the bytes changed) is checked against the element's earlier writer and reader, a read
// against its earlier writer. A store of the value already there (`out[i] = v` written in the
// kernel text, bytes unchanged) is checked against nothing: threads that all store one value to one
// place are not reported.
void dev_access(Fiber* f, int oid, char* addr, int size, bool write, bool store) {
  if (oid < 0 || (size_t)oid >= g_outs.size()) return;
  DevOut& o = g_outs[oid];
  if (!o.sh || addr < o.lo || addr + size > o.hi) return;
  int me = (int)f->info.thread_index_in_threadgroup;
  const uint32_t* p = f->info.thread_position_in_grid;
  DevAccess now{g_tg_index, me, g_dev_epoch, (int32_t)g_sg[sg_of(me)].sync,
                p[0] + g_grid[0] * (p[1] + g_grid[1] * p[2])};
  int64_t e0 = (addr - o.lo) / o.elem, e1 = (addr + size - 1 - o.lo) / o.elem;
  for (int64_t e = e0; e <= e1; ++e) {
    DevShadow& s = o.sh[e];
    if (g_check_races && (write || !store)) {
      const DevAccess* other = nullptr;
      const char* kind = nullptr;
      if (dev_concurrent(s.w, me)) other = &s.w, kind = "written";
      else if (write && dev_concurrent(s.r, me)) other = &s.r, kind = "read";
      if (other) {
        char pos[64];
        fmt_gid(pos, sizeof pos, other->gid);
        const char* what = write ? "writes" : "reads";
        if (other->tg != g_tg_index)
          set_error(f,
                    "device memory race: %s element %lld (%d-byte elements) of output buffer %d, %s by "
                    "thread %s of another threadgroup; threadgroups of one dispatch are never ordered "
                    "(accumulate with atomics, or split the work into separate kernels)",
                    what, (long long)e, o.elem, oid, kind, pos);
        else
          set_error(f,
                    "device memory race: %s element %lld (%d-byte elements) of output buffer %d, %s by "
                    "thread %s of this threadgroup with no threadgroup_barrier(mem_flags::mem_device) "
                    "between them",
                    what, (long long)e, o.elem, oid, kind, pos);
        return;
      }
    }
    if (write || store)
      s.w = now;
    else if (!dev_concurrent(s.r, me))  // keep an unordered read by another thread (see shadow_access)
      s.r = now;
  }
}

// Classify the logged threadgroup accesses of the current fiber since its
// last switch. Only this fiber ran meanwhile, so an access changed memory
// (a write) exactly when the bytes after it differ from the bytes before it.
void process_log(Fiber* f) {
  Buf<LogEntry>& log = f->log;
  if (log.empty()) return;
  size_t n = log.size();
  static Buf<char> is_write;
  is_write.resize(n);
  // open-addressing map (addr, size) -> index of the next access to the same bytes
  static Buf<uintptr_t> keys;
  static Buf<size_t> vals;
  size_t slots = 16;
  while (slots < 2 * n) slots *= 2;
  keys.resize(slots);
  vals.resize(slots);
  memset(keys.data, 0, slots * sizeof(uintptr_t));
  for (size_t k = n; k-- > 0;) {
    LogEntry& e = log[k];
    if (e.size > kLogCopy) {
      is_write[k] = 1;
      continue;
    }
    uintptr_t key = (((uintptr_t)e.addr << 7) ^ (uintptr_t)e.size) | 1;  // never 0 (= empty)
    size_t h = (size_t)((key * 0x9E3779B97F4A7C15ull) >> 17) & (slots - 1);
    while (keys[h] && keys[h] != key) h = (h + 1) & (slots - 1);
    const unsigned char* after = keys[h] ? log[vals[h]].pre : (const unsigned char*)e.addr;
    is_write[k] = memcmp(e.pre, after, e.size) != 0;
    keys[h] = key;
    vals[h] = k;
  }
  for (size_t k = 0; k < n && !g_failed; ++k) {
    LogEntry& e = log[k];
    if (e.out_id >= 0)
      dev_access(f, e.out_id, e.addr, e.size, is_write[k], e.store);
    else
      shadow_access(f, e.addr, e.size > kLogCopy ? kLogCopy : e.size, is_write[k]);
  }
  log.clear();
}

void fiber_main() {
  mtl_kernel_entry(g_bufs, g_lo, g_hi);
  process_log(g_cur);
  g_cur->state = DONE;
  swapcontext(&g_cur->ctx, &g_sched);
  __builtin_trap();
}

void on_signal(int sig, siginfo_t* si, void*) {
  if (!g_in_launch) {
    signal(sig, SIG_DFL);
    raise(sig);
    return;
  }
  const char* what = sig == SIGSEGV ? "segmentation fault"
                     : sig == SIGBUS ? "bus error"
                     : sig == SIGFPE ? "arithmetic exception (integer division by zero?)"
                                     : "illegal instruction / trap";
  g_failed = false;  // the signal wins over nothing
  set_error(g_cur, "%s at address %p (an unchecked raw pointer, a stack overflow in the fiber, "
            "or a bug in the emulator)", what, si ? si->si_addr : nullptr);
  siglongjmp(g_jmp, 1);
}

bool ensure_memory() {
  if (!g_fibers) {
    g_fibers = (Fiber*)calloc(kMaxThreads, sizeof(Fiber));
    g_shadow = (Shadow*)calloc(kArenaBytes, sizeof(Shadow));
    g_altstack = (char*)malloc(1 << 16);
    if (!g_fibers || !g_shadow || !g_altstack) return false;
  }
  if (g_stacks) return true;
  // Fiber stacks live only for one launch (see release_stacks): every kernel library has its own
  // copy of this runtime, and the guard pages split the mapping into one piece per stack, so
  // keeping them would exhaust the process's mapping limit once a few dozen kernels are loaded.
  void* m = mmap(nullptr, kStackBytes * kMaxThreads, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return false;
  g_stacks = (char*)m;
  // guard page at the bottom of every stack
  for (int i = 0; i < kMaxThreads; ++i) mprotect(g_stacks + i * kStackBytes, 4096, PROT_NONE);
  return true;
}

void release_stacks() {
  if (g_stacks) munmap(g_stacks, kStackBytes * kMaxThreads);
  g_stacks = nullptr;
}

uint64_t g_rng = 1;
uint64_t rng_next() {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return g_rng;
}

void shuffle(Buf<int>& v) {
  for (size_t i = v.size(); i > 1; --i) {
    size_t j = rng_next() % i;
    int t = v[i - 1];
    v[i - 1] = v[j];
    v[j] = t;
  }
}

const char* state_name(const Fiber& f, char* buf, size_t n) {
  switch (f.state) {
    case DONE: return "exited";
    case AT_BARRIER: snprintf(buf, n, "at threadgroup_barrier (line %u)", f.line); return buf;
    case AT_SIMD: snprintf(buf, n, "at %s (line %u)", f.op, f.line); return buf;
    default: return "running";
  }
}

void lanes_str(char* buf, size_t n, uint32_t mask) {
  size_t k = 0;
  buf[0] = 0;
  for (int l = 0; l < 32 && k + 8 < n; ++l)
    if (mask >> l & 1) k += snprintf(buf + k, n - k, k ? ",%d" : "%d", l);
}

// Run one threadgroup to completion. Returns false on error.
bool run_threadgroup(int nthreads, int order) {
  g_n = nthreads;
  g_allocs.clear();
  g_arena_used = 0;
  g_epoch = 0;
  g_weak_line = 0;
  for (int64_t i = 0; i < kArenaBytes; ++i) g_arena[i] = kPoison[i & 3];
  if (g_arena_high > 0) memset(g_shadow, 0, sizeof(Shadow) * g_arena_high);
  for (int64_t i = 0; i < g_arena_high; ++i) g_shadow[i].w_tid = g_shadow[i].r_tid = -1;
  g_arena_high = 0;
  int nsg = (nthreads + MTL_SIMD_WIDTH - 1) / MTL_SIMD_WIDTH;
  for (int s = 0; s < nsg; ++s) g_sg[s].sync = 0;
  for (int i = 0; i < nthreads; ++i) {
    Fiber& f = g_fibers[i];
    f.state = READY;
    f.log.clear();
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = g_stacks + i * kStackBytes + 4096;
    f.ctx.uc_stack.ss_size = kStackBytes - 4096;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
  }
  static Buf<int> sched;
  sched.resize(nthreads);
  for (int i = 0; i < nthreads; ++i) sched[i] = order == 1 ? nthreads - 1 - i : i;
  for (;;) {
    if (order == 2) shuffle(sched);
    for (int idx : sched) {
      Fiber& f = g_fibers[idx];
      if (f.state != READY) continue;
      g_cur = &f;
      swapcontext(&g_sched, &f.ctx);
      g_cur = nullptr;
      if (g_failed) return false;
    }
    // nothing runnable: resolve SIMD operations first, then barriers
    bool released = false, all_done = true;
    for (int s = 0; s < nsg; ++s) {
      uint32_t alive = 0, at_simd = 0, launched = 0;
      int lo = s * MTL_SIMD_WIDTH, hi = lo + MTL_SIMD_WIDTH < nthreads ? lo + MTL_SIMD_WIDTH : nthreads;
      int first = -1;
      bool same_site = true;
      for (int t = lo; t < hi; ++t) {
        Fiber& f = g_fibers[t];
        launched |= 1u << (t - lo);
        if (f.state != DONE) alive |= 1u << (t - lo), all_done = false;
        if (f.state == AT_SIMD) {
          at_simd |= 1u << (t - lo);
          if (first < 0) first = t;
          else if (f.line != g_fibers[first].line || f.col != g_fibers[first].col ||
                   strcmp(f.op, g_fibers[first].op) != 0)
            same_site = false;
        }
      }
      if (!at_simd) continue;
      if (at_simd != alive || !same_site || (g_strict_simd && at_simd != launched)) {
        Fiber& f0 = g_fibers[first];
        char lanes[160], others[512] = "", st[96];
        uint32_t here_mask = 0;
        size_t k = 0;
        int listed = 0, more = 0;
        for (int t = lo; t < hi; ++t) {
          Fiber& f = g_fibers[t];
          bool here = f.state == AT_SIMD && f.line == f0.line && f.col == f0.col &&
                      strcmp(f.op, f0.op) == 0;
          if (here) here_mask |= 1u << (t - lo);
          else if (f.state != DONE || g_strict_simd) {
            if (listed < 4)
              k += snprintf(others + k, sizeof others - k, " lane %d %s;", t - lo,
                            state_name(f, st, sizeof st)), listed++;
            else
              more++;
          }
        }
        if (more) snprintf(others + k, sizeof others - k, " and %d more lanes;", more);
        lanes_str(lanes, sizeof lanes, here_mask);
        set_error(&f0,
                  "SIMD operation %s (line %u) reached by lanes {%s} of simdgroup %d, but the "
                  "other active lanes are elsewhere:%s SIMD operations must be called by every "
                  "active lane of the simdgroup (divergent control flow around a SIMD op?)",
                  f0.op, f0.line, lanes, s, others);
        return false;
      }
      SimdGroup& g = g_sg[s];
      g.snap.mask = alive;
      memcpy(g.snap.data, g.live, sizeof g.live);
      memcpy(g.snap.arg, g.live_arg, sizeof g.live_arg);
      // SIMD collectives order the simdgroup's threadgroup-memory accesses (its lanes run in
      // lockstep), except a simdgroup_barrier whose mem_flags lack mem_threadgroup
      Fiber& f1 = g_fibers[first];
      if (strcmp(f1.op, "simdgroup_barrier") != 0 ||
          (g.live_arg[first - lo] & kMemThreadgroup))
        g.sync++;
      for (int t = lo; t < hi; ++t)
        if (g_fibers[t].state == AT_SIMD) g_fibers[t].state = READY;
      released = true;
    }
    if (released) continue;
    if (all_done) return true;
    // every live thread waits at a threadgroup barrier
    int first = -1, exited = -1;
    for (int t = 0; t < nthreads; ++t) {
      Fiber& f = g_fibers[t];
      if (f.state == AT_BARRIER) {
        if (first < 0) first = t;
        else if (f.line != g_fibers[first].line || f.col != g_fibers[first].col) {
          char a[64], b[64];
          fmt_pos(a, sizeof a, &g_fibers[first]);
          fmt_pos(b, sizeof b, &f);
          set_error(&f,
                    "divergent threadgroup_barrier: this thread waits at the barrier on line %u "
                    "while thread %s waits at the one on line %u",
                    f.line, a, g_fibers[first].line);
          return false;
        }
      } else if (f.state == DONE && exited < 0) {
        exited = t;
      }
    }
    if (first < 0) {
      set_error(nullptr, "internal scheduler error (no runnable thread)");
      return false;
    }
    if (exited >= 0) {
      char a[64];
      fmt_pos(a, sizeof a, &g_fibers[exited]);
      set_error(&g_fibers[first],
                "threadgroup_barrier (line %u) is not reached by every thread of the "
                "threadgroup: thread %s exited without reaching it (early return before a "
                "barrier?)",
                g_fibers[first].line, a);
      return false;
    }
    // the barrier orders threadgroup memory only if its flags say so (Metal: mem_none orders
    // nothing, mem_device only device memory)
    int flags = ~0;
    for (int t = 0; t < nthreads; ++t)
      if (g_fibers[t].state == AT_BARRIER) flags &= g_fibers[t].bflags;
    if (flags & kMemThreadgroup) {
      g_epoch++;
      g_weak_line = 0;
    } else {
      g_weak_line = g_fibers[first].line;
    }
    if (flags & kMemDevice) g_dev_epoch++;
    for (int t = 0; t < nthreads; ++t) g_fibers[t].state = READY;
  }
}

}  // namespace

extern "C" {

__attribute__((noreturn)) void mtl_rt_fail(const char* msg) {
  set_error(g_cur, "%s", msg);
  abort_fiber();
}

const mtl_thread_info* mtl_rt_thread(void) { return &g_cur->info; }

void mtl_rt_barrier(int flags, unsigned line, unsigned col) {
  process_log(g_cur);
  if (g_failed) abort_fiber();
  g_cur->state = AT_BARRIER;
  g_cur->bflags = flags;
  g_cur->line = line;
  g_cur->col = col;
  switch_to_scheduler();
}

const mtl_simd_snapshot* mtl_rt_simd(const void* mine, int size, int64_t arg, const char* op,
                                     unsigned line, unsigned col) {
  process_log(g_cur);
  if (g_failed) abort_fiber();
  int lane = (int)g_cur->info.thread_index_in_simdgroup;
  SimdGroup& g = g_sg[g_cur->info.simdgroup_index_in_threadgroup];
  if (size > MTL_SIMD_SLOT) mtl_rt_fail("SIMD operation on a value larger than 64 bytes");
  memcpy(g.live[lane], mine, size);
  g.live_arg[lane] = arg;
  g_cur->state = AT_SIMD;
  g_cur->line = line;
  g_cur->col = col;
  g_cur->op = op;
  switch_to_scheduler();
  return &g.snap;
}

void* mtl_rt_tg_alloc(int id, const char* name, int64_t bytes, int64_t align) {
  for (const Alloc& a : g_allocs)
    if (a.id == id) return g_arena + a.off;
  if (align < 16) align = 16;
  int64_t off = (g_arena_used + align - 1) / align * align;
  if (off + bytes > kTgLimit) {
    char buf[256];
    snprintf(buf, sizeof buf,
             "threadgroup memory exceeds 32 KiB: array '%s' needs %lld bytes at offset %lld",
             name, (long long)bytes, (long long)off);
    mtl_rt_fail(buf);
  }
  g_allocs.push_back({id, name, off, bytes});
  g_arena_used = off + bytes;
  if (g_arena_used > g_arena_high) {
    for (int64_t i = g_arena_high; i < g_arena_used; ++i) {
      g_shadow[i] = Shadow{-1, 0, 0, -1, 0, 0, 0};
    }
    g_arena_high = g_arena_used;
  }
  return g_arena + off;
}

void mtl_rt_tg_bounds(const void* p, char** lo, char** hi, const char** name) {
  const Alloc* a = find_alloc((const char*)p);
  if (!a) {
    if ((const char*)p >= g_arena && (const char*)p < g_arena + kArenaBytes)
      mtl_rt_fail("pointer into threadgroup memory outside every threadgroup array");
    mtl_rt_fail("a pointer that is not threadgroup memory was converted to a threadgroup pointer");
  }
  *lo = g_arena + a->off;
  *hi = g_arena + a->off + a->bytes;
  *name = a->name;
}

void mtl_rt_dev_log(int out_id, void* addr, int size, int store) {
  LogEntry e;
  e.addr = (char*)addr;
  e.size = size;
  e.out_id = out_id;
  e.store = store;
  memcpy(e.pre, addr, size < kLogCopy ? size : kLogCopy);
  g_cur->log.push_back(e);
}

void mtl_rt_tg_log(void* addr, int size) {
  LogEntry e;
  e.addr = (char*)addr;
  e.size = size;
  e.out_id = -1;
  e.store = 0;
  memcpy(e.pre, addr, size < kLogCopy ? size : kLogCopy);
  g_cur->log.push_back(e);
}

void mtl_rt_tg_atomic(void* addr, int size, int is_read, int is_write) {
  char* p = (char*)addr;
  if (p < g_arena || p >= g_arena + kArenaBytes) return;
  int64_t base = p - g_arena;
  if (base + size > g_arena_high) return;
  if (is_read) {
    for (int b = 0; b < size; ++b)
      if (!g_shadow[base + b].init) {
        char d[256];
        describe_addr(d, sizeof d, p, size);
        char msg[400];
        snprintf(msg, sizeof msg,
                 "atomic read-modify-write of uninitialised threadgroup memory: %s was never "
                 "stored (initialise threadgroup atomics with atomic_store_explicit and a "
                 "barrier)",
                 d);
        mtl_rt_fail(msg);
      }
  }
  if (is_write)
    for (int b = 0; b < size; ++b) g_shadow[base + b].init = 1;
}

void mtl_rt_oob(const char* what, const char* name, const void* p, const void* lo,
                const void* hi, int elem_size) {
  char msg[512];
  long long off = (const char*)p - (const char*)lo;
  long long nbytes = (const char*)hi - (const char*)lo;
  snprintf(msg, sizeof msg,
           "out-of-bounds access to %s '%s': element index %lld (%d-byte elements, byte offset "
           "%lld) is outside the %lld-byte buffer (%lld elements)",
           what, name, off >= 0 ? off / elem_size : -((-off + elem_size - 1) / elem_size),
           elem_size, off, nbytes, nbytes / elem_size);
  mtl_rt_fail(msg);
}

// Entry point called from Python. Returns NULL on success, else an error text.
const char* mtl_launch(void* const* bufs, void* const* lo, void* const* hi, const int* out_elem, int nbufs,
                       const uint32_t* grid,
                       const uint32_t* tgs, int order, uint64_t seed, int check_races,
                       const char* kname) {
  g_failed = false;
  g_err[0] = 0;
  g_kname = kname;
  g_check_races = check_races & 1;
  g_strict_simd = (check_races >> 1) & 1;
  g_bufs = bufs;
  for (int d = 0; d < 3; ++d) g_grid[d] = grid[d] ? grid[d] : 1;
  g_dev_epoch = 0;
  g_outs.clear();
  for (int k = 0; k < nbufs; ++k) {
    DevOut o{(char*)lo[k], (char*)hi[k], out_elem[k], nullptr};
    if (o.elem > 0 && g_check_races && o.hi > o.lo) {
      o.sh = (DevShadow*)calloc((size_t)((o.hi - o.lo) / o.elem + 1), sizeof(DevShadow));
      if (!o.sh) return "emulator: out of memory (device-memory race shadow)";
    }
    g_outs.push_back(o);
  }
  g_lo = lo;
  g_hi = hi;
  g_rng = seed * 0x9E3779B97F4A7C15ull + 0x1234567ull;
  if (!g_rng) g_rng = 1;
  if (!ensure_memory()) return "emulator: out of memory";
  uint32_t tg[3], ntg[3];
  for (int d = 0; d < 3; ++d) {
    tg[d] = tgs[d] < grid[d] ? tgs[d] : grid[d];
    if (tg[d] == 0) tg[d] = 1;
    ntg[d] = grid[d] == 0 ? 0 : (grid[d] + tg[d] - 1) / tg[d];
  }
  if ((uint64_t)tg[0] * tg[1] * tg[2] > kMaxThreads) return "threadgroup larger than 1024 threads";
  uint64_t total = (uint64_t)ntg[0] * ntg[1] * ntg[2];
  static Buf<int> groups;
  groups.resize((size_t)total);
  for (uint64_t i = 0; i < total; ++i) groups[i] = (int)(order == 1 ? total - 1 - i : i);
  if (order == 2) shuffle(groups);

  struct sigaction sa, old_segv, old_bus, old_fpe, old_ill, old_trap;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_signal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  stack_t ss, old_ss;
  ss.ss_sp = g_altstack;
  ss.ss_size = 1 << 16;
  ss.ss_flags = 0;
  sigaltstack(&ss, &old_ss);
  sigaction(SIGSEGV, &sa, &old_segv);
  sigaction(SIGBUS, &sa, &old_bus);
  sigaction(SIGFPE, &sa, &old_fpe);
  sigaction(SIGILL, &sa, &old_ill);
  sigaction(SIGTRAP, &sa, &old_trap);
  bool ok = true;
  if (sigsetjmp(g_jmp, 1) == 0) {
    g_in_launch = 1;
    for (int gi_ : groups) {
      uint32_t gi = (uint32_t)gi_;
      uint32_t gpos[3] = {gi % ntg[0], (gi / ntg[0]) % ntg[1], gi / (ntg[0] * ntg[1])};
      uint32_t act[3];
      for (int d = 0; d < 3; ++d) {
        uint32_t start = gpos[d] * tg[d];
        act[d] = grid[d] - start < tg[d] ? grid[d] - start : tg[d];
      }
      int n = (int)(act[0] * act[1] * act[2]);
      for (int t = 0; t < n; ++t) {
        mtl_thread_info& I = g_fibers[t].info;
        uint32_t lp[3] = {t % act[0], (t / act[0]) % act[1], t / (act[0] * act[1])};
        for (int d = 0; d < 3; ++d) {
          I.thread_position_in_threadgroup[d] = lp[d];
          I.thread_position_in_grid[d] = gpos[d] * tg[d] + lp[d];
          I.threadgroup_position_in_grid[d] = gpos[d];
          I.threads_per_threadgroup[d] = act[d];
          I.dispatch_threads_per_threadgroup[d] = tg[d];
          I.threadgroups_per_grid[d] = ntg[d];
          I.threads_per_grid[d] = grid[d];
          I.grid_size[d] = grid[d];
          I.grid_origin[d] = 0;
        }
        uint32_t dn = tg[0] * tg[1] * tg[2];
        I.thread_index_in_threadgroup = t;
        I.thread_index_in_simdgroup = t % MTL_SIMD_WIDTH;
        I.simdgroup_index_in_threadgroup = t / MTL_SIMD_WIDTH;
        I.simdgroups_per_threadgroup = (n + MTL_SIMD_WIDTH - 1) / MTL_SIMD_WIDTH;
        I.dispatch_simdgroups_per_threadgroup = (dn + MTL_SIMD_WIDTH - 1) / MTL_SIMD_WIDTH;
        I.thread_index_in_quadgroup = t % 4;
        I.quadgroup_index_in_threadgroup = t / 4;
        I.quadgroups_per_threadgroup = (n + 3) / 4;
        I.dispatch_quadgroups_per_threadgroup = (dn + 3) / 4;
        I.threads_per_simdgroup = MTL_SIMD_WIDTH;
        I.thread_execution_width = MTL_SIMD_WIDTH;
      }
      g_tg_index = (int32_t)gi + 1;
      if (!run_threadgroup(n, order)) {
        ok = false;
        break;
      }
    }
  } else {
    ok = false;
  }
  g_in_launch = 0;
  sigaction(SIGSEGV, &old_segv, nullptr);
  sigaction(SIGBUS, &old_bus, nullptr);
  sigaction(SIGFPE, &old_fpe, nullptr);
  sigaction(SIGILL, &old_ill, nullptr);
  sigaction(SIGTRAP, &old_trap, nullptr);
  sigaltstack(&old_ss, nullptr);
  g_cur = nullptr;
  release_stacks();
  for (DevOut& o : g_outs) free(o.sh);
  g_outs.clear();
  if (!ok && !g_err[0]) snprintf(g_err, sizeof g_err, "kernel '%s': unknown failure", kname);
  return ok ? nullptr : g_err;
}

}  // extern "C"
