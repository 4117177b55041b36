// mtl_core.h: the emulator's internals: element-wise helpers, Metal's vector constructors, casts,
// the checked pointer classes of the run build and the glue to the runtime's SIMD exchange.
#pragma once
#pragma clang system_header  // warnings are the kernel's, not the prelude's

#include "mtl_traits.h"
#include "mtl_types.h"

namespace mtl {
using mtl_std::enable_if_t;

template <class T>
struct vinfo {
  using elem = T;
  static constexpr int n = 1;
  static constexpr bool is_vec = false;
};
template <class T, int N>
struct vinfo<T __attribute__((ext_vector_type(N)))> {
  using elem = T;
  static constexpr int n = N;
  static constexpr bool is_vec = true;
};
template <class T>
using elem_t = typename vinfo<mtl_std::remove_cv_t<mtl_std::remove_reference_t<T>>>::elem;
template <class T>
constexpr bool is_vec = vinfo<mtl_std::remove_cv_t<mtl_std::remove_reference_t<T>>>::is_vec;
template <class E>
constexpr bool is_fp = mtl_std::is_same_v<E, float> || mtl_std::is_same_v<E, half> ||
                       mtl_std::is_same_v<E, bfloat> || mtl_std::is_same_v<E, double>;
template <class E>
constexpr bool is_int = mtl_std::is_integral_v<E>;
template <class T>
constexpr bool is_arith = is_fp<elem_t<T>> || is_int<elem_t<T>>;

template <class V>
inline auto at(const V& v, int i) {
  if constexpr (is_vec<V>)
    return v[i];
  else
    return v;
}

// convert x to R (splat scalars, convert vectors element-wise)
template <class R, class X>
inline R to(const X& x) {
  if constexpr (is_vec<R>) {
    if constexpr (is_vec<X>)
      return __builtin_convertvector(x, R);
    else
      return (R)((elem_t<R>)x);
  } else {
    return (R)x;
  }
}

template <class A, class B>
struct common {
  using type = mtl_std::conditional_t<
      is_vec<A>, A,
      mtl_std::conditional_t<is_vec<B>, B,
                         mtl_std::conditional_t<mtl_std::is_same_v<A, B>, A,
                                            decltype(mtl_std::declval<A>() + mtl_std::declval<B>())>>>;
};
template <class A, class B>
using common_t = typename common<mtl_std::decay_t<A>, mtl_std::decay_t<B>>::type;

template <class R, class F, class... X>
inline R mapn(F f, const X&... xs) {
  if constexpr (is_vec<R>) {
    R r;
    for (int i = 0; i < vinfo<R>::n; ++i) r[i] = f(at(to<R>(xs), i)...);
    return r;
  } else {
    return f(to<R>(xs)...);
  }
}

template <class T>
inline T poison() {
  T v;
  if constexpr (is_fp<elem_t<T>>) {
    v = to<T>(__builtin_nanf(""));
  } else {
    __builtin_memset(&v, 0xBE, sizeof(T));
  }
  return v;
}

// vector "constructors": float4(a, b), float4(x), vec<T, N>(...)
template <class E, int N, class V>
inline void put(E* out, int& k, const V& v) {
  if constexpr (is_vec<V>) {
    for (int i = 0; i < vinfo<V>::n; ++i) out[k++] = (E)v[i];
  } else {
    out[k++] = (E)v;
  }
}
template <class E, int N, class... A>
inline metal::vec<E, N> mk(const A&... a) {
  using R = metal::vec<E, N>;
  if constexpr (sizeof...(A) == 0) {
    return R{};
  } else if constexpr (sizeof...(A) == 1 && !(is_vec<A> || ...)) {
    return to<R>(a...);
  } else {
    static_assert((vinfo<mtl_std::decay_t<A>>::n + ... + 0) == N,
                  "vector constructor: wrong number of components");
    E tmp[N];
    int k = 0;
    (put<E, N>(tmp, k, a), ...);
    R r;
    for (int i = 0; i < N; ++i) r[i] = tmp[i];
    return r;
  }
}

#ifndef MTL_CHECK
template <class T>
struct is_atomic_t : mtl_std::false_type {};

// ---------------------------------------------------- checked device pointers
// `out` is the kernel buffer index of an output (its accesses are logged for the device-memory
// race checker), -1 for an input.
template <class T>
struct DevPtr {
  T* p = nullptr;
  char* lo = nullptr;
  char* hi = nullptr;
  const char* name = "?";
  int out = -1;
  DevPtr() = default;
  DevPtr(decltype(nullptr)) {}
  DevPtr(T* p_, void* lo_, void* hi_, const char* n, int out_ = -1)
      : p(p_), lo((char*)lo_), hi((char*)hi_), name(n), out(out_) {}
  template <class U, enable_if_t<mtl_std::is_convertible_v<U*, T*>, int> = 0>
  DevPtr(const DevPtr<U>& o) : p(o.p), lo(o.lo), hi(o.hi), name(o.name), out(o.out) {}
  template <class U, enable_if_t<!mtl_std::is_convertible_v<U*, T*>, int> = 0>
  explicit DevPtr(const DevPtr<U>& o) : p((T*)o.p), lo(o.lo), hi(o.hi), name(o.name), out(o.out) {}
  T& at(int64_t i, int store = 0) const {
    T* q = p + i;
    if ((char*)q < lo || (char*)(q + 1) > hi || !p)
      mtl_rt_oob("device buffer", name, q, lo, hi, (int)sizeof(T));
    if constexpr (!is_atomic_t<mtl_std::remove_cv_t<T>>::value)
      if (out >= 0) mtl_rt_dev_log(out, (void*)q, (int)sizeof(T), store);
    return *q;
  }
  // `name[i] = v` in the kernel text (see _translate.py): a store, even of the value already there
  template <class I, enable_if_t<mtl_std::is_integral_v<I> || mtl_std::is_enum_v<I>, int> = 0>
  T& store_at(I i) const { return at((int64_t)i, 1); }
  template <class I, enable_if_t<mtl_std::is_integral_v<I> || mtl_std::is_enum_v<I>, int> = 0>
  T& operator[](I i) const { return at((int64_t)i); }
  T& operator*() const { return at(0); }
  T* operator->() const { return &at(0); }
  template <class I, enable_if_t<mtl_std::is_integral_v<I>, int> = 0>
  DevPtr operator+(I i) const { DevPtr r = *this; r.p += (int64_t)i; return r; }
  template <class I, enable_if_t<mtl_std::is_integral_v<I>, int> = 0>
  friend DevPtr operator+(I i, const DevPtr& d) { return d + i; }
  template <class I, enable_if_t<mtl_std::is_integral_v<I>, int> = 0>
  DevPtr operator-(I i) const { DevPtr r = *this; r.p -= (int64_t)i; return r; }
  int64_t operator-(const DevPtr& o) const { return p - o.p; }
  template <class I> DevPtr& operator+=(I i) { p += (int64_t)i; return *this; }
  template <class I> DevPtr& operator-=(I i) { p -= (int64_t)i; return *this; }
  DevPtr& operator++() { ++p; return *this; }
  DevPtr operator++(int) { DevPtr r = *this; ++p; return r; }
  DevPtr& operator--() { --p; return *this; }
  DevPtr operator--(int) { DevPtr r = *this; --p; return r; }
  bool operator==(const DevPtr& o) const { return p == o.p; }
  bool operator!=(const DevPtr& o) const { return p != o.p; }
  bool operator<(const DevPtr& o) const { return p < o.p; }
  bool operator<=(const DevPtr& o) const { return p <= o.p; }
  bool operator>(const DevPtr& o) const { return p > o.p; }
  bool operator>=(const DevPtr& o) const { return p >= o.p; }
  explicit operator bool() const { return p != nullptr; }
};


// ------------------------------------------------ checked threadgroup pointers
template <class E>
struct TgPtr {
  E* p = nullptr;
  char* lo = nullptr;
  char* hi = nullptr;
  const char* name = "?";
  TgPtr() = default;
  TgPtr(decltype(nullptr)) {}
  TgPtr(E* raw) : p(raw) {
    if (raw) mtl_rt_tg_bounds(raw, &lo, &hi, &name);
  }
  TgPtr(E* p_, char* lo_, char* hi_, const char* n) : p(p_), lo(lo_), hi(hi_), name(n) {}
  template <class U, enable_if_t<mtl_std::is_convertible_v<U*, E*>, int> = 0>
  TgPtr(const TgPtr<U>& o) : p(o.p), lo(o.lo), hi(o.hi), name(o.name) {}
  template <class U, enable_if_t<!mtl_std::is_convertible_v<U*, E*>, int> = 0>
  explicit TgPtr(const TgPtr<U>& o) : p((E*)o.p), lo(o.lo), hi(o.hi), name(o.name) {}
  E* check(int64_t i) const {
    E* q = p + i;
    if ((char*)q < lo || (char*)(q + 1) > hi || !p)
      mtl_rt_oob("threadgroup array", name, q, lo, hi, (int)sizeof(E));
    return q;
  }
  decltype(auto) at(int64_t i) const {
    E* q = check(i);
    if constexpr (mtl_std::is_array_v<E>) {
      using R = mtl_std::remove_extent_t<E>;
      return TgPtr<R>((R*)q, lo, hi, name);
    } else {
      if constexpr (!is_atomic_t<mtl_std::remove_cv_t<E>>::value) mtl_rt_tg_log((void*)q, (int)sizeof(E));
      return *q;
    }
  }
  template <class I, enable_if_t<mtl_std::is_integral_v<I> || mtl_std::is_enum_v<I>, int> = 0>
  decltype(auto) operator[](I i) const { return at((int64_t)i); }
  decltype(auto) operator*() const { return at(0); }
  E* operator->() const { return check(0); }
  template <class I, enable_if_t<mtl_std::is_integral_v<I>, int> = 0>
  TgPtr operator+(I i) const { TgPtr r = *this; r.p += (int64_t)i; return r; }
  template <class I, enable_if_t<mtl_std::is_integral_v<I>, int> = 0>
  friend TgPtr operator+(I i, const TgPtr& d) { return d + i; }
  template <class I, enable_if_t<mtl_std::is_integral_v<I>, int> = 0>
  TgPtr operator-(I i) const { TgPtr r = *this; r.p -= (int64_t)i; return r; }
  int64_t operator-(const TgPtr& o) const { return p - o.p; }
  template <class I> TgPtr& operator+=(I i) { p += (int64_t)i; return *this; }
  template <class I> TgPtr& operator-=(I i) { p -= (int64_t)i; return *this; }
  TgPtr& operator++() { ++p; return *this; }
  TgPtr operator++(int) { TgPtr r = *this; ++p; return r; }
  TgPtr& operator--() { --p; return *this; }
  TgPtr operator--(int) { TgPtr r = *this; --p; return r; }
  bool operator==(const TgPtr& o) const { return p == o.p; }
  bool operator!=(const TgPtr& o) const { return p != o.p; }
  bool operator<(const TgPtr& o) const { return p < o.p; }
  bool operator>(const TgPtr& o) const { return p > o.p; }
  explicit operator bool() const { return p != nullptr; }
};

template <class T, long... D>
struct arr_of;
template <class T>
struct arr_of<T> {
  using type = T;
};
template <class T, long D0, long... Ds>
struct arr_of<T, D0, Ds...> {
  using type = typename arr_of<T, Ds...>::type[D0];
};
// `threadgroup T name[D0][D1]...;` inside a kernel becomes
// `auto name = ::mtl::tg_array<T, D0, D1...>(id, "name");`
template <class T, long D0, long... Ds>
inline TgPtr<typename arr_of<T, Ds...>::type> tg_array(int id, const char* name) {
  using E = typename arr_of<T, Ds...>::type;
  int64_t bytes = (int64_t)sizeof(E) * D0;
  E* p = (E*)mtl_rt_tg_alloc(id, name, bytes, alignof(E));
  return TgPtr<E>(p, (char*)p, (char*)p + bytes, name);
}

template <class P>
struct is_checked_ptr : mtl_std::false_type {};
template <class T>
struct is_checked_ptr<DevPtr<T>> : mtl_std::true_type {};
template <class T>
struct is_checked_ptr<TgPtr<T>> : mtl_std::true_type {};

template <class T, class X>
inline T rcast(X&& x) {
  if constexpr (is_checked_ptr<T>::value)
    return T(x);
  else
    return reinterpret_cast<T>(x);
}

#else
// The check pass keeps Metal's pointers. A C-style cast to a pointer type `(T*)x` becomes
// `::mtl::ccast<T*>(x)`: it may change constness and the pointee type as in C++, but not the
// address space (Metal: "C-style cast ... converts between mismatching address spaces"), which a
// reinterpret_cast refuses.
template <class To, class From>
inline To ccast(From* p) {
  return reinterpret_cast<To>(const_cast<mtl_std::remove_cv_t<From>*>(p));
}
template <class To>
inline To ccast(decltype(nullptr)) {
  return nullptr;
}
template <class To, class I, enable_if_t<mtl_std::is_integral_v<I>, int> = 0>
inline To ccast(I v) {
  return (To)v;
}
#endif

// static_cast<T>(x): vector conversions go element-wise (a C++ cast between
// clang vectors would reinterpret the bits).
template <class T, class X>
inline T scast(X&& x) {
  using XD = mtl_std::decay_t<X>;
  if constexpr (is_vec<T> && is_vec<XD>)
    return __builtin_convertvector(x, T);
  else if constexpr (is_vec<T> && !is_vec<XD>)
    return (T)((elem_t<T>)x);
  else
    return static_cast<T>(mtl_std::forward<X>(x));
}
inline const mtl_thread_info* ti() { return mtl_rt_thread(); }
inline uint3 u3(const uint32_t* v) { return uint3{v[0], v[1], v[2]}; }
inline int my_lane() { return (int)mtl_rt_thread()->thread_index_in_simdgroup; }

template <class T>
inline const mtl_simd_snapshot* xchg(const T& v, int64_t arg, const char* op, unsigned l,
                                     unsigned c) {
  static_assert(sizeof(T) <= MTL_SIMD_SLOT, "SIMD operation on a value larger than 64 bytes");
  return mtl_rt_simd(&v, (int)sizeof(T), arg, op, l, c);
}
template <class T>
inline T lane_val(const mtl_simd_snapshot* s, int lane) {
  T v;
  __builtin_memcpy(&v, s->data[lane], sizeof(T));
  return v;
}
inline bool has(const mtl_simd_snapshot* s, int lane) {
  return lane >= 0 && lane < 32 && (s->mask >> lane & 1);
}
template <class T>
inline T lane_or_poison(const mtl_simd_snapshot* s, int lane) {
  return has(s, lane) ? lane_val<T>(s, lane) : poison<T>();
}
}  // namespace mtl

