// mtl_sync.h: barriers, SIMD-group functions (MSL 3.1 §6.9 Synchronization and SIMD-Group
// Functions), atomics (§6.15 Atomic Functions) and SIMD-group matrices (§6.7 SIMD-Group Matrix
// Functions). Collective operations go through the runtime's SIMD exchange (mtl_rt_simd), which
// checks that every active lane of the simdgroup reaches the same call.
#pragma once
#pragma clang system_header  // warnings are the kernel's, not the prelude's

#include "mtl_math.h"

namespace mtl {
// element types the SIMD functions take (MSL: scalars and vectors of 8-, 16- and 32-bit types;
// MLX's prelude adds 64-bit and bool overloads of the shuffles, in mtl_mlx.h)
template <class T>
constexpr bool simd_ok = (is_fp<elem_t<T>> || is_int<elem_t<T>>) && sizeof(elem_t<T>) <= 4 &&
                         !mtl_std::is_same_v<elem_t<T>, double>;
}  // namespace mtl

namespace metal {
// ------------------------------------------------------------ synchronisation
enum class mem_flags : int {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
inline mem_flags operator|(mem_flags a, mem_flags b) { return (mem_flags)((int)a | (int)b); }
inline mem_flags operator&(mem_flags a, mem_flags b) { return (mem_flags)((int)a & (int)b); }

// MSL §6.9.1: every thread of the threadgroup (simdgroup) waits; the flags say which memory the
// barrier orders. The runtime's race checker follows them: only mem_threadgroup orders
// threadgroup memory (mem_none orders nothing, mem_device only device memory).
inline void threadgroup_barrier(mem_flags flags, MTL_SITE) {
  mtl_rt_barrier((int)flags, mtl_line_, mtl_col_);
}
inline void simdgroup_barrier(mem_flags flags, MTL_SITE) {
  int z = 0;
  mtl::xchg(z, (int64_t)flags, "simdgroup_barrier", mtl_line_, mtl_col_);
}

// ------------------------------------------------------------ SIMD functions
template <class T, enable_if_t<mtl::simd_ok<T>, int> = 0>
inline T simd_sum(T x, MTL_SITE) {
  auto* s = mtl::xchg(x, 0, "simd_sum", mtl_line_, mtl_col_);
  T acc = mtl::to<T>(0);
  for (int l = 0; l < 32; ++l)
    if (mtl::has(s, l)) acc = acc + mtl::lane_val<T>(s, l);
  return acc;
}
template <class T, enable_if_t<mtl::simd_ok<T>, int> = 0>
inline T simd_product(T x, MTL_SITE) {
  auto* s = mtl::xchg(x, 0, "simd_product", mtl_line_, mtl_col_);
  T acc = mtl::to<T>(1);
  for (int l = 0; l < 32; ++l)
    if (mtl::has(s, l)) acc = acc * mtl::lane_val<T>(s, l);
  return acc;
}
#define MTL_SIMD_FOLD(NAME, OP)                                            \
  template <class T, enable_if_t<mtl::simd_ok<T>, int> = 0>                \
  inline T NAME(T x, MTL_SITE) {                                           \
    auto* s = mtl::xchg(x, 0, #NAME, mtl_line_, mtl_col_);                 \
    bool first = true;                                                     \
    T acc = x;                                                             \
    for (int l = 0; l < 32; ++l)                                           \
      if (mtl::has(s, l)) {                                                \
        T v = mtl::lane_val<T>(s, l);                                      \
        acc = first ? v : OP;                                              \
        first = false;                                                     \
      }                                                                    \
    return acc;                                                            \
  }
MTL_SIMD_FOLD(simd_max, metal::max(acc, v))
MTL_SIMD_FOLD(simd_min, metal::min(acc, v))
MTL_SIMD_FOLD(simd_and, acc & v)
MTL_SIMD_FOLD(simd_or, acc | v)
MTL_SIMD_FOLD(simd_xor, acc ^ v)
#undef MTL_SIMD_FOLD

template <class T, enable_if_t<mtl::simd_ok<T>, int> = 0>
inline T simd_prefix_inclusive_sum(T x, MTL_SITE) {
  auto* s = mtl::xchg(x, 0, "simd_prefix_inclusive_sum", mtl_line_, mtl_col_);
  int me = mtl::my_lane();
  T acc = mtl::to<T>(0);
  for (int l = 0; l <= me; ++l)
    if (mtl::has(s, l)) acc = acc + mtl::lane_val<T>(s, l);
  return acc;
}
template <class T, enable_if_t<mtl::simd_ok<T>, int> = 0>
inline T simd_prefix_exclusive_sum(T x, MTL_SITE) {
  auto* s = mtl::xchg(x, 0, "simd_prefix_exclusive_sum", mtl_line_, mtl_col_);
  int me = mtl::my_lane();
  T acc = mtl::to<T>(0);
  for (int l = 0; l < me; ++l)
    if (mtl::has(s, l)) acc = acc + mtl::lane_val<T>(s, l);
  return acc;
}
template <class T, enable_if_t<mtl::simd_ok<T>, int> = 0>
inline T simd_prefix_inclusive_product(T x, MTL_SITE) {
  auto* s = mtl::xchg(x, 0, "simd_prefix_inclusive_product", mtl_line_, mtl_col_);
  int me = mtl::my_lane();
  T acc = mtl::to<T>(1);
  for (int l = 0; l <= me; ++l)
    if (mtl::has(s, l)) acc = acc * mtl::lane_val<T>(s, l);
  return acc;
}
template <class T, enable_if_t<mtl::simd_ok<T>, int> = 0>
inline T simd_prefix_exclusive_product(T x, MTL_SITE) {
  auto* s = mtl::xchg(x, 0, "simd_prefix_exclusive_product", mtl_line_, mtl_col_);
  int me = mtl::my_lane();
  T acc = mtl::to<T>(1);
  for (int l = 0; l < me; ++l)
    if (mtl::has(s, l)) acc = acc * mtl::lane_val<T>(s, l);
  return acc;
}
// shuffles: a source lane that is not active gives a poison value (NaN / 0xBE..)
template <class T, enable_if_t<mtl::simd_ok<T>, int> = 0>
inline T simd_shuffle(T x, ushort lane, MTL_SITE) {
  auto* s = mtl::xchg(x, (int64_t)lane, "simd_shuffle", mtl_line_, mtl_col_);
  return mtl::lane_or_poison<T>(s, (int)s->arg[mtl::my_lane()]);
}
template <class T, enable_if_t<mtl::simd_ok<T>, int> = 0>
inline T simd_broadcast(T x, ushort lane, MTL_SITE) {
  auto* s = mtl::xchg(x, (int64_t)lane, "simd_broadcast", mtl_line_, mtl_col_);
  return mtl::lane_or_poison<T>(s, (int)s->arg[mtl::my_lane()]);
}
template <class T, enable_if_t<mtl::simd_ok<T>, int> = 0>
inline T simd_broadcast_first(T x, MTL_SITE) {
  auto* s = mtl::xchg(x, 0, "simd_broadcast_first", mtl_line_, mtl_col_);
  return mtl::lane_val<T>(s, __builtin_ctz(s->mask));
}
template <class T, enable_if_t<mtl::simd_ok<T>, int> = 0>
inline T simd_shuffle_down(T x, ushort delta, MTL_SITE) {
  auto* s = mtl::xchg(x, (int64_t)delta, "simd_shuffle_down", mtl_line_, mtl_col_);
  int me = mtl::my_lane(), src = me + (int)s->arg[me];
  return src >= 32 ? x : mtl::lane_or_poison<T>(s, src);  // no wrap-around
}
template <class T, enable_if_t<mtl::simd_ok<T>, int> = 0>
inline T simd_shuffle_up(T x, ushort delta, MTL_SITE) {
  auto* s = mtl::xchg(x, (int64_t)delta, "simd_shuffle_up", mtl_line_, mtl_col_);
  int me = mtl::my_lane(), src = me - (int)s->arg[me];
  return src < 0 ? x : mtl::lane_or_poison<T>(s, src);
}
template <class T, enable_if_t<mtl::simd_ok<T>, int> = 0>
inline T simd_shuffle_rotate_down(T x, ushort delta, MTL_SITE) {
  auto* s = mtl::xchg(x, (int64_t)delta, "simd_shuffle_rotate_down", mtl_line_, mtl_col_);
  int me = mtl::my_lane();
  return mtl::lane_or_poison<T>(s, (me + (int)s->arg[me]) & 31);
}
template <class T, enable_if_t<mtl::simd_ok<T>, int> = 0>
inline T simd_shuffle_rotate_up(T x, ushort delta, MTL_SITE) {
  auto* s = mtl::xchg(x, (int64_t)delta, "simd_shuffle_rotate_up", mtl_line_, mtl_col_);
  int me = mtl::my_lane();
  return mtl::lane_or_poison<T>(s, (me - (int)s->arg[me]) & 31);
}
template <class T, enable_if_t<mtl::simd_ok<T>, int> = 0>
inline T simd_shuffle_xor(T x, ushort mask, MTL_SITE) {
  auto* s = mtl::xchg(x, (int64_t)mask, "simd_shuffle_xor", mtl_line_, mtl_col_);
  int me = mtl::my_lane();
  return mtl::lane_or_poison<T>(s, (me ^ (int)s->arg[me]) & 31);
}
// simd_shuffle_and_fill_down/up(data, filling, delta[, modulo]): lanes are grouped in segments of
// `modulo` (32 by default); a lane reads `data` of the lane `delta` after (before) it in its
// segment, or, past the segment's end (start), `filling` of the lane as far into the segment.
}  // namespace metal
namespace mtl {
template <class T>
struct fill_pair {
  T data, fill;
};
template <class T>
inline T shuffle_fill(T data, T filling, int delta, int modulo, bool down, const char* op, unsigned l,
                      unsigned c) {
  fill_pair<T> mine{data, filling};
  auto* s = xchg(mine, (int64_t)delta | ((int64_t)modulo << 16), op, l, c);
  int me = my_lane();
  int d = (int)(s->arg[me] & 0xFFFF), m = (int)(s->arg[me] >> 16);
  if (m <= 0 || m > 32) m = 32;
  int base = me - me % m, idx = me % m + (down ? d : -d);
  bool from_data = down ? idx < m : idx >= 0;
  int src = base + (from_data ? idx : (down ? idx - m : idx + m));
  if (!has(s, src)) return poison<T>();
  fill_pair<T> v = lane_val<fill_pair<T>>(s, src);
  return from_data ? v.data : v.fill;
}
}  // namespace mtl
namespace metal {
template <class T, enable_if_t<mtl::simd_ok<T>, int> = 0>
inline T simd_shuffle_and_fill_down(T data, T filling, ushort delta, MTL_SITE) {
  return mtl::shuffle_fill(data, filling, delta, 32, true, "simd_shuffle_and_fill_down", mtl_line_, mtl_col_);
}
template <class T, enable_if_t<mtl::simd_ok<T>, int> = 0>
inline T simd_shuffle_and_fill_down(T data, T filling, ushort delta, ushort modulo, MTL_SITE) {
  return mtl::shuffle_fill(data, filling, delta, modulo, true, "simd_shuffle_and_fill_down", mtl_line_, mtl_col_);
}
template <class T, enable_if_t<mtl::simd_ok<T>, int> = 0>
inline T simd_shuffle_and_fill_up(T data, T filling, ushort delta, MTL_SITE) {
  return mtl::shuffle_fill(data, filling, delta, 32, false, "simd_shuffle_and_fill_up", mtl_line_, mtl_col_);
}
template <class T, enable_if_t<mtl::simd_ok<T>, int> = 0>
inline T simd_shuffle_and_fill_up(T data, T filling, ushort delta, ushort modulo, MTL_SITE) {
  return mtl::shuffle_fill(data, filling, delta, modulo, false, "simd_shuffle_and_fill_up", mtl_line_, mtl_col_);
}
inline bool simd_all(bool x, MTL_SITE) {
  auto* s = mtl::xchg(x, 0, "simd_all", mtl_line_, mtl_col_);
  for (int l = 0; l < 32; ++l)
    if (mtl::has(s, l) && !mtl::lane_val<bool>(s, l)) return false;
  return true;
}
inline bool simd_any(bool x, MTL_SITE) {
  auto* s = mtl::xchg(x, 0, "simd_any", mtl_line_, mtl_col_);
  for (int l = 0; l < 32; ++l)
    if (mtl::has(s, l) && mtl::lane_val<bool>(s, l)) return true;
  return false;
}
struct simd_vote {
  uint64_t v;
  explicit operator uint64_t() const { return v; }
  bool all() const { return v == 0xFFFFFFFFull; }
  bool any() const { return v != 0; }
};
inline simd_vote simd_ballot(bool x, MTL_SITE) {
  auto* s = mtl::xchg(x, 0, "simd_ballot", mtl_line_, mtl_col_);
  uint64_t r = 0;
  for (int l = 0; l < 32; ++l)
    if (mtl::has(s, l) && mtl::lane_val<bool>(s, l)) r |= 1ull << l;
  return simd_vote{r};
}
inline simd_vote simd_active_threads_mask(MTL_SITE) {
  int z = 0;
  auto* s = mtl::xchg(z, 0, "simd_active_threads_mask", mtl_line_, mtl_col_);
  return simd_vote{s->mask};
}
inline bool simd_is_first(MTL_SITE) {
  int z = 0;
  auto* s = mtl::xchg(z, 0, "simd_is_first", mtl_line_, mtl_col_);
  return mtl::my_lane() == __builtin_ctz(s->mask);
}
// quad-group (4 lanes) variants, computed from the same exchange
template <class T, enable_if_t<mtl::simd_ok<T>, int> = 0>
inline T quad_sum(T x, MTL_SITE) {
  auto* s = mtl::xchg(x, 0, "quad_sum", mtl_line_, mtl_col_);
  int b = mtl::my_lane() & ~3;
  T acc = mtl::to<T>(0);
  for (int l = b; l < b + 4; ++l)
    if (mtl::has(s, l)) acc = acc + mtl::lane_val<T>(s, l);
  return acc;
}
template <class T, enable_if_t<mtl::simd_ok<T>, int> = 0>
inline T quad_shuffle(T x, ushort lane, MTL_SITE) {
  auto* s = mtl::xchg(x, (int64_t)lane, "quad_shuffle", mtl_line_, mtl_col_);
  int me = mtl::my_lane();
  return mtl::lane_or_poison<T>(s, (me & ~3) + ((int)s->arg[me] & 3));
}
template <class T, enable_if_t<mtl::simd_ok<T>, int> = 0>
inline T quad_broadcast(T x, ushort lane, MTL_SITE) {
  auto* s = mtl::xchg(x, (int64_t)lane, "quad_broadcast", mtl_line_, mtl_col_);
  int me = mtl::my_lane();
  return mtl::lane_or_poison<T>(s, (me & ~3) + ((int)s->arg[me] & 3));
}
template <class T, enable_if_t<mtl::simd_ok<T>, int> = 0>
inline T quad_shuffle_xor(T x, ushort mask, MTL_SITE) {
  auto* s = mtl::xchg(x, (int64_t)mask, "quad_shuffle_xor", mtl_line_, mtl_col_);
  int me = mtl::my_lane();
  return mtl::lane_or_poison<T>(s, (me & ~3) + (((me & 3) ^ (int)s->arg[me]) & 3));
}
template <class T, enable_if_t<mtl::simd_ok<T>, int> = 0>
inline T quad_shuffle_down(T x, ushort delta, MTL_SITE) {
  auto* s = mtl::xchg(x, (int64_t)delta, "quad_shuffle_down", mtl_line_, mtl_col_);
  int me = mtl::my_lane(), q = (me & 3) + (int)s->arg[me];
  return q >= 4 ? x : mtl::lane_or_poison<T>(s, (me & ~3) + q);
}
template <class T, enable_if_t<mtl::simd_ok<T>, int> = 0>
inline T quad_shuffle_up(T x, ushort delta, MTL_SITE) {
  auto* s = mtl::xchg(x, (int64_t)delta, "quad_shuffle_up", mtl_line_, mtl_col_);
  int me = mtl::my_lane(), q = (me & 3) - (int)s->arg[me];
  return q < 0 ? x : mtl::lane_or_poison<T>(s, (me & ~3) + q);
}

// ------------------------------------------------------------ atomics (MSL §6.15 Atomic Functions)
enum memory_order {
  memory_order_relaxed,
  memory_order_acquire,
  memory_order_release,
  memory_order_acq_rel,
  memory_order_seq_cst
};
enum thread_scope { thread_scope_thread, thread_scope_simdgroup, thread_scope_threadgroup, thread_scope_device };
// MSL 3.2 §6.14: a fence orders this thread's memory accesses; fibers switch only at barriers and
// SIMD operations, so there is nothing to do (it synchronises no threads: no race checker effect).
inline void atomic_thread_fence(mem_flags, memory_order, thread_scope = thread_scope_device) {}

#ifdef MTL_CHECK
// Metal's atomic types: atomic_int, atomic_uint, atomic_bool, atomic_float (device and threadgroup
// memory) and atomic<ulong> (min/max on device memory). Any other atomic<T> (e.g. atomic<half>
// from atomic_outputs with a float16 output) is an incomplete type, unusable as on Metal.
template <class T>
struct atomic;
template <> struct atomic<int> { int mtl_value; };
template <> struct atomic<uint> { uint mtl_value; };
template <> struct atomic<bool> { bool mtl_value; };
template <> struct atomic<float> { float mtl_value; };
template <> struct atomic<ulong> { ulong mtl_value; };
#else
template <class T>
struct atomic {
  T mtl_value;
};
#endif
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<bool> atomic_bool;
typedef atomic<float> atomic_float;

#ifdef MTL_CHECK
// The exact overloads (declarations suffice for the check pass): A is the atomic type, C its value
// type; every function takes an explicit memory_order.
#define MTL_ATOMIC_BASIC(AS, C)                                                                      \
  void atomic_store_explicit(volatile AS atomic<C>* object, C desired, memory_order order);         \
  C atomic_load_explicit(const volatile AS atomic<C>* object, memory_order order);                  \
  C atomic_exchange_explicit(volatile AS atomic<C>* object, C desired, memory_order order);          \
  bool atomic_compare_exchange_weak_explicit(volatile AS atomic<C>* object, thread C* expected,      \
                                             C desired, memory_order succ, memory_order fail);
#define MTL_ATOMIC_ADD(AS, C)                                                                        \
  C atomic_fetch_add_explicit(volatile AS atomic<C>* object, C operand, memory_order order);        \
  C atomic_fetch_sub_explicit(volatile AS atomic<C>* object, C operand, memory_order order);
#define MTL_ATOMIC_BITS(AS, C)                                                                       \
  C atomic_fetch_and_explicit(volatile AS atomic<C>* object, C operand, memory_order order);        \
  C atomic_fetch_or_explicit(volatile AS atomic<C>* object, C operand, memory_order order);         \
  C atomic_fetch_xor_explicit(volatile AS atomic<C>* object, C operand, memory_order order);
#define MTL_ATOMIC_MINMAX(AS, C)                                                                     \
  C atomic_fetch_max_explicit(volatile AS atomic<C>* object, C operand, memory_order order);        \
  C atomic_fetch_min_explicit(volatile AS atomic<C>* object, C operand, memory_order order);
#define MTL_ATOMIC_SPACE(AS)                                                                         \
  MTL_ATOMIC_BASIC(AS, int) MTL_ATOMIC_BASIC(AS, uint) MTL_ATOMIC_BASIC(AS, bool)                   \
  MTL_ATOMIC_BASIC(AS, float) MTL_ATOMIC_ADD(AS, int) MTL_ATOMIC_ADD(AS, uint)                      \
  MTL_ATOMIC_ADD(AS, float) MTL_ATOMIC_BITS(AS, int) MTL_ATOMIC_BITS(AS, uint)                      \
  MTL_ATOMIC_MINMAX(AS, int) MTL_ATOMIC_MINMAX(AS, uint)
MTL_ATOMIC_SPACE(device)
MTL_ATOMIC_SPACE(threadgroup)
MTL_ATOMIC_MINMAX(device, ulong)
#undef MTL_ATOMIC_SPACE
#undef MTL_ATOMIC_MINMAX
#undef MTL_ATOMIC_BITS
#undef MTL_ATOMIC_ADD
#undef MTL_ATOMIC_BASIC
#else
}  // namespace metal

namespace mtl {
template <class T>
struct is_atomic_t<metal::atomic<T>> : mtl_std::true_type {};
// Fibers switch only at barriers and SIMD operations, so plain loads and
// stores are atomic here; what matters is checking the target.
template <class T>
inline T* atomic_raw(metal::atomic<T>* p, int r, int w) {
  mtl_rt_tg_atomic((void*)p, (int)sizeof(T), r, w);
  return &p->mtl_value;
}
template <class T>
inline T* atomic_raw(volatile metal::atomic<T>* p, int r, int w) {
  return atomic_raw((metal::atomic<T>*)p, r, w);
}
template <class T>
inline T* atomic_raw(const DevPtr<metal::atomic<T>>& p, int, int) {
  return &p.at(0).mtl_value;
}
template <class T>
inline T* atomic_raw(const TgPtr<metal::atomic<T>>& p, int r, int w) {
  return atomic_raw(p.check(0), r, w);
}
}  // namespace mtl

namespace metal {
template <class P, class U>
inline void atomic_store_explicit(P obj, U v, memory_order = memory_order_relaxed) {
  auto* x = mtl::atomic_raw(obj, 0, 1);
  *x = (mtl_std::remove_pointer_t<decltype(x)>)v;
}
template <class P>
inline auto atomic_load_explicit(P obj, memory_order = memory_order_relaxed) {
  return *mtl::atomic_raw(obj, 1, 0);
}
template <class P, class U>
inline auto atomic_exchange_explicit(P obj, U v, memory_order = memory_order_relaxed) {
  auto* x = mtl::atomic_raw(obj, 0, 1);
  auto old = *x;
  *x = (decltype(old))v;
  return old;
}
#define MTL_ATOMIC_RMW(NAME, EXPR)                                               \
  template <class P, class U>                                                    \
  inline auto NAME(P obj, U v_, memory_order = memory_order_relaxed) {           \
    auto* x = mtl::atomic_raw(obj, 1, 1);                                        \
    auto old = *x;                                                               \
    decltype(old) v = (decltype(old))v_;                                         \
    *x = (decltype(old))(EXPR);                                                  \
    return old;                                                                  \
  }
MTL_ATOMIC_RMW(atomic_fetch_add_explicit, old + v)
MTL_ATOMIC_RMW(atomic_fetch_sub_explicit, old - v)
MTL_ATOMIC_RMW(atomic_fetch_max_explicit, old > v ? old : v)
MTL_ATOMIC_RMW(atomic_fetch_min_explicit, old < v ? old : v)
MTL_ATOMIC_RMW(atomic_fetch_and_explicit, old & v)
MTL_ATOMIC_RMW(atomic_fetch_or_explicit, old | v)
MTL_ATOMIC_RMW(atomic_fetch_xor_explicit, old ^ v)
#undef MTL_ATOMIC_RMW
template <class P, class T, class U>
inline bool atomic_compare_exchange_weak_explicit(P obj, T* expected, U desired,
                                                  memory_order = memory_order_relaxed,
                                                  memory_order = memory_order_relaxed) {
  auto* x = mtl::atomic_raw(obj, 1, 1);
  if (*x == *expected) {
    *x = (mtl_std::remove_pointer_t<decltype(x)>)desired;
    return true;
  }
  *expected = *x;
  return false;
}
template <class P, class T, class U>
inline bool atomic_compare_exchange_strong_explicit(P obj, T* expected, U desired,
                                                    memory_order a = memory_order_relaxed,
                                                    memory_order b = memory_order_relaxed) {
  return atomic_compare_exchange_weak_explicit(obj, expected, desired, a, b);
}
#endif  // MTL_CHECK

// ------------------------------------------------------------ simdgroup_matrix
// Every lane keeps the whole 8x8 matrix; loads, stores and multiplies are
// collective (all active lanes must call them) and a store is done once.
template <class T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(mtl_std::is_same_v<T, float> || mtl_std::is_same_v<T, half> || mtl_std::is_same_v<T, bfloat>,
                "simdgroup_matrix: the element type must be float, half or bfloat");
  static_assert(Cols == 8 && Rows == 8, "simdgroup_matrix: only 8x8 matrices exist");
  T m[Rows][Cols];
  simdgroup_matrix() {
    for (int r = 0; r < Rows; ++r)
      for (int c = 0; c < Cols; ++c) m[r][c] = mtl::poison<T>();
  }
  simdgroup_matrix(T diag) {
    for (int r = 0; r < Rows; ++r)
      for (int c = 0; c < Cols; ++c) m[r][c] = r == c ? diag : (T)0;
  }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <class T, int Cols, int Rows>
inline simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T v) {
  simdgroup_matrix<T, Cols, Rows> r;
  for (int i = 0; i < Rows; ++i)
    for (int j = 0; j < Cols; ++j) r.m[i][j] = v;
  return r;
}
#ifdef MTL_CHECK
// MSL §6.7: the source or destination is device or threadgroup memory of the matrix's element type
template <class T, int Cols, int Rows>
void simdgroup_load(thread simdgroup_matrix<T, Cols, Rows>& d, const device T* src,
                    ulong elements_per_row = Cols, ulong2 matrix_origin = ulong2(0),
                    bool transpose_matrix = false);
template <class T, int Cols, int Rows>
void simdgroup_load(thread simdgroup_matrix<T, Cols, Rows>& d, const threadgroup T* src,
                    ulong elements_per_row = Cols, ulong2 matrix_origin = ulong2(0),
                    bool transpose_matrix = false);
template <class T, int Cols, int Rows>
void simdgroup_store(thread simdgroup_matrix<T, Cols, Rows> a, device T* dst, ulong elements_per_row = Cols,
                     ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false);
template <class T, int Cols, int Rows>
void simdgroup_store(thread simdgroup_matrix<T, Cols, Rows> a, threadgroup T* dst,
                     ulong elements_per_row = Cols, ulong2 matrix_origin = ulong2(0),
                     bool transpose_matrix = false);
#else
}  // namespace metal
namespace mtl {
// A simdgroup_matrix load/store is collective: every active lane calls it with the same arguments.
template <class T>
inline const void* address_of(const DevPtr<T>& p) { return p.p; }
template <class T>
inline const void* address_of(const TgPtr<T>& p) { return p.p; }
template <class T>
inline const void* address_of(T* p) { return p; }
template <class P>
inline const mtl_simd_snapshot* uniform_args(const char* op, const P& p, size_t epr, ulong2 origin, bool tr,
                                             unsigned l, unsigned c) {
  const void* addr = address_of(p);
  uint64_t h = (uint64_t)(uintptr_t)addr * 0x9E3779B97F4A7C15ull;
  h ^= ((uint64_t)epr + 0x51ED27ull) * 0xC2B2AE3D27D4EB4Full;
  h ^= ((uint64_t)origin.x << 32 ^ (uint64_t)origin.y ^ (uint64_t)tr << 63) * 0x165667B19E3779F9ull;
  int z = 0;
  const mtl_simd_snapshot* s = xchg(z, (int64_t)(h >> 1), op, l, c);
  for (int lane = 0; lane < 32; ++lane)
    if (has(s, lane) && s->arg[lane] != s->arg[my_lane()])
      mtl_rt_fail("simdgroup matrix load/store: the lanes of the simdgroup pass different pointers, "
                  "strides or origins (its arguments must be the same in every lane)");
  return s;
}
}  // namespace mtl
namespace metal {
template <class T, int Cols, int Rows, class P>
inline void simdgroup_load(simdgroup_matrix<T, Cols, Rows>& d, P src, size_t elements_per_row = Cols,
                           ulong2 origin = ulong2(0), bool transpose = false, MTL_SITE) {
  mtl::uniform_args("simdgroup_load", src, elements_per_row, origin, transpose, mtl_line_, mtl_col_);
  int64_t epr = (int64_t)elements_per_row, ox = (int64_t)origin.x, oy = (int64_t)origin.y;
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Cols; ++c)
      d.m[r][c] = (T)(transpose ? src[(oy + c) * epr + ox + r] : src[(oy + r) * epr + ox + c]);
}
template <class T, int Cols, int Rows, class P>
inline void simdgroup_store(const simdgroup_matrix<T, Cols, Rows>& d, P dst,
                            size_t elements_per_row = Cols, ulong2 origin = ulong2(0),
                            bool transpose = false, MTL_SITE) {
  auto* s = mtl::uniform_args("simdgroup_store", dst, elements_per_row, origin, transpose, mtl_line_, mtl_col_);
  if (mtl::my_lane() != __builtin_ctz(s->mask)) return;  // one lane writes
  int64_t epr = (int64_t)elements_per_row, ox = (int64_t)origin.x, oy = (int64_t)origin.y;
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Cols; ++c) {
      auto& out = transpose ? dst[(oy + c) * epr + ox + r] : dst[(oy + r) * epr + ox + c];
      out = (mtl_std::remove_reference_t<decltype(out)>)d.m[r][c];
    }
}
#endif
template <class TD, class TA, class TB, class TC, int K, int M, int N>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<TD, N, M>& d,
                                          const simdgroup_matrix<TA, K, M>& a,
                                          const simdgroup_matrix<TB, N, K>& b,
                                          const simdgroup_matrix<TC, N, M>& c, MTL_SITE) {
  int z = 0;
  mtl::xchg(z, 0, "simdgroup_multiply_accumulate", mtl_line_, mtl_col_);
  simdgroup_matrix<TD, N, M> r;
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float acc = (float)c.m[i][j];
      for (int k = 0; k < K; ++k) acc += (float)a.m[i][k] * (float)b.m[k][j];
      r.m[i][j] = (TD)acc;
    }
  d = r;
}
template <class TD, class TA, class TB, int K, int M, int N>
inline void simdgroup_multiply(simdgroup_matrix<TD, N, M>& d, const simdgroup_matrix<TA, K, M>& a,
                               const simdgroup_matrix<TB, N, K>& b, MTL_SITE) {
  simdgroup_matrix<TD, N, M> zero((TD)0);
  for (int i = 0; i < M; ++i) zero.m[i][i] = (TD)0;
  simdgroup_multiply_accumulate(d, a, b, zero, mtl_line_, mtl_col_);
}
}  // namespace metal

