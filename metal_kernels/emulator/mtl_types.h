// mtl_types.h: Metal's scalar and vector types (MSL 3.1 §2.1 Scalar Data Types, §2.2 Vector Data
// Types), MLX's complex64_t, and the address-space keywords of the check pass.
#pragma once
#pragma clang system_header  // warnings are the kernel's, not the prelude's

#include "mtl_abi.h"

// ---------------------------------------------------------------- address spaces
// The check pass (MTL_CHECK) gives Metal's address spaces (MSL §4) to clang as address spaces, so
// every conversion Metal forbids (constant -> device, device -> thread, ...) is a compile error
// with clang's wording, which is the Metal compiler's. `thread` is clang's default address space.
// The run build erases them: its translator turns pointers into checked pointer classes.
#ifdef MTL_CHECK
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#else
#define device
#define constant
#define threadgroup
#endif
#define thread
#define ray_data
#define object_data

// ---------------------------------------------------------------- scalar types
// Metal's `char` is signed and is `int8_t` (one type, as in Metal's headers).
typedef char int8_t;
typedef __INT16_TYPE__ int16_t;
typedef __INT32_TYPE__ int32_t;
typedef __UINT8_TYPE__ uint8_t;
typedef __UINT16_TYPE__ uint16_t;
typedef __INTPTR_TYPE__ intptr_t;
typedef __UINTPTR_TYPE__ uintptr_t;
typedef __PTRDIFF_TYPE__ ptrdiff_t;
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef uint64_t ulong;
typedef _Float16 half;
typedef __bf16 bfloat;
typedef half float16_t;
typedef bfloat bfloat16_t;

// float -> bfloat conversion, round to nearest even, NaN kept NaN (quiet, 0x7FC0 as MLX
// writes it). clang lowers `(__bf16)x` to a call of this compiler-runtime helper, which some
// clang distributions (ziglang's) do not ship: defining it here makes every clang work, and
// pins the rounding to MLX's CPU conversion (mlx/types/bf16.h) bit for bit. bfloat -> float
// is a 16-bit shift that clang emits inline. Weak and hidden: one per kernel library.
extern "C" __attribute__((weak, visibility("hidden"))) bfloat __truncsfbf2(float f) {
  uint32_t u = __builtin_bit_cast(uint32_t, f);
  uint16_t r = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0u
                                               : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  // opaque to the optimizer, which would otherwise turn the bit cast back into a float->bfloat
  // conversion, that is, a call of this very function
  __asm__("" : "+r"(r));
  return __builtin_bit_cast(bfloat, r);
}
// double -> bfloat (only constant expressions reach it: Metal has no double). Round to odd
// into float first, so that the second rounding is exact.
extern "C" __attribute__((weak, visibility("hidden"))) bfloat __truncdfbf2(double d) {
  float f = (float)d;
  if ((double)f != d && f == f) {
    uint32_t u = __builtin_bit_cast(uint32_t, f);
    bool away = __builtin_fabs((double)f) > __builtin_fabs(d);
    if (away) u -= 1;  // toward zero (same sign, smaller magnitude)
    u |= 1u;           // sticky: inexact
    f = __builtin_bit_cast(float, u);
  }
  return __truncsfbf2(f);
}

// ---------------------------------------------------------------- vector types
#define MTL_VEC(T, NAME)                                       \
  typedef T NAME##2 __attribute__((ext_vector_type(2)));       \
  typedef T NAME##3 __attribute__((ext_vector_type(3)));       \
  typedef T NAME##4 __attribute__((ext_vector_type(4)));
MTL_VEC(float, float)
MTL_VEC(half, half)
MTL_VEC(bfloat, bfloat)
MTL_VEC(int, int)
MTL_VEC(uint, uint)
MTL_VEC(short, short)
MTL_VEC(ushort, ushort)
MTL_VEC(char, char)
MTL_VEC(uchar, uchar)
MTL_VEC(int64_t, long)
MTL_VEC(uint64_t, ulong)
MTL_VEC(bool, bool)
#undef MTL_VEC

namespace metal {
template <class T, int N>
using vec = T __attribute__((ext_vector_type(N)));
}

// ---------------------------------------------------------------- complex64_t (MLX's prelude)
// Two floats, real part first (numpy's complex64 layout).
struct complex64_t {
  float real;
  float imag;
  constexpr complex64_t() : real(0), imag(0) {}
  constexpr complex64_t(float r, float i) : real(r), imag(i) {}
  constexpr complex64_t(float r) : real(r), imag(0) {}
  constexpr complex64_t(half r) : real((float)r), imag(0) {}
  constexpr complex64_t(bfloat r) : real((float)r), imag(0) {}
  constexpr complex64_t(int r) : real((float)r), imag(0) {}
  constexpr complex64_t(uint r) : real((float)r), imag(0) {}
  constexpr complex64_t(int64_t r) : real((float)r), imag(0) {}
  constexpr complex64_t(bool r) : real(r ? 1.0f : 0.0f), imag(0) {}
  complex64_t& operator+=(complex64_t o) { real += o.real; imag += o.imag; return *this; }
  complex64_t& operator-=(complex64_t o) { real -= o.real; imag -= o.imag; return *this; }
  complex64_t& operator*=(complex64_t o) { return *this = complex64_t(real * o.real - imag * o.imag, real * o.imag + imag * o.real); }
};
inline complex64_t operator+(complex64_t a, complex64_t b) { return {a.real + b.real, a.imag + b.imag}; }
inline complex64_t operator-(complex64_t a, complex64_t b) { return {a.real - b.real, a.imag - b.imag}; }
inline complex64_t operator-(complex64_t a) { return {-a.real, -a.imag}; }
inline complex64_t operator*(complex64_t a, complex64_t b) {
  return {a.real * b.real - a.imag * b.imag, a.real * b.imag + a.imag * b.real};
}
inline complex64_t operator/(complex64_t a, complex64_t b) {
  float d = b.real * b.real + b.imag * b.imag;
  return {(a.real * b.real + a.imag * b.imag) / d, (a.imag * b.real - a.real * b.imag) / d};
}
inline bool operator==(complex64_t a, complex64_t b) { return a.real == b.real && a.imag == b.imag; }
inline bool operator!=(complex64_t a, complex64_t b) { return !(a == b); }
// MLX orders complex numbers lexicographically (real part first)
inline bool operator<(complex64_t a, complex64_t b) {
  return a.real < b.real || (a.real == b.real && a.imag < b.imag);
}
inline bool operator>(complex64_t a, complex64_t b) { return b < a; }
inline bool operator<=(complex64_t a, complex64_t b) { return !(b < a); }
inline bool operator>=(complex64_t a, complex64_t b) { return !(a < b); }

#define METAL_FUNC inline __attribute__((always_inline))
#define MTL_SITE unsigned mtl_line_ = __builtin_LINE(), unsigned mtl_col_ = __builtin_COLUMN()
