// mtl_mlx.h: the names MLX's kernel prelude (mlx/backend/metal/kernels/utils.h and the headers it
// includes: bf16.h, bf16_math.h, complex.h, defines.h) gives every mx.fast.metal_kernel, written
// here from their documented behaviour, with the same signatures (shape and stride pointers in the
// constant address space, as MLX passes `*_shape` / `*_strides`).
#pragma once
#pragma clang system_header  // warnings are the kernel's, not the prelude's

#include "mtl_sync.h"

// constants of Metal's <metal_math> and <metal_types>
#define M_PI_F 3.14159265358979323846f
#define M_PI_2_F 1.57079632679489661923f
#define M_PI_4_F 0.78539816339744830962f
#define M_1_PI_F 0.31830988618379067154f
#define M_2_PI_F 0.63661977236758134308f
#define M_E_F 2.71828182845904523536f
#define M_LN2_F 0.69314718055994530942f
#define M_LN10_F 2.30258509299404568402f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LOG10E_F 0.43429448190325182765f
#define M_SQRT2_F 1.41421356237309504880f
#define M_SQRT1_2_F 0.70710678118654752440f
#define MAXFLOAT 3.40282346638528859812e+38f
#define FLT_MAX 3.40282346638528859812e+38f
#define FLT_MIN 1.17549435082228750797e-38f
#define FLT_EPSILON 1.1920928955078125e-07f
#define HALF_MAX ((half)65504.0f)
#define HALF_MIN ((half)6.103515625e-05f)
#define HALF_EPSILON ((half)0.0009765625f)
#define INFINITY __builtin_huge_valf()
#define NAN __builtin_nanf("")

using namespace metal;

// ---------------------------------------------------------------- defines.h
#define MTL_CONST constant
static constant constexpr int MAX_REDUCE_SPECIALIZED_DIMS = 4;
static constant constexpr int REDUCE_N_READS = 4;
static constant constexpr int REDUCE_N_WRITES = 4;
static constant constexpr int SOFTMAX_N_READS = 4;
static constant constexpr int RMS_N_READS = 4;
static constant constexpr int RMS_LOOPED_LIMIT = 4096;
#define STEEL_CONST static constant constexpr const
#define STEEL_PRAGMA_UNROLL _Pragma("clang loop unroll(full)")
#define MLX_MTL_PRAGMA_UNROLL _Pragma("clang loop unroll(full)")

// ---------------------------------------------------------------- bf16.h
inline uint16_t bfloat16_to_uint16(const bfloat16_t x) { return as_type<uint16_t>(x); }
inline bfloat16_t uint16_to_bfloat16(const uint16_t x) { return as_type<bfloat16_t>(x); }

// ---------------------------------------------------------------- utils.h
typedef half float16_t;

// elements of U one thread handles in MLX's own elementwise kernels
template <typename U>
struct WorkPerThread {
  static_assert(sizeof(U) <= 8, "Type too large");
  static constexpr constant int n = 8 / sizeof(U);
};

template <typename U>
struct Limits {
  static constexpr constant U max = metal::numeric_limits<U>::max();
  static constexpr constant U min = metal::numeric_limits<U>::min();
  static constexpr constant U finite_max = metal::numeric_limits<U>::max();
  static constexpr constant U finite_min = metal::numeric_limits<U>::min();
};
#define MTL_FP_LIMITS(T)                                                        \
  template <>                                                                   \
  struct Limits<T> {                                                            \
    static constexpr constant T max = metal::numeric_limits<T>::infinity();     \
    static constexpr constant T min = -metal::numeric_limits<T>::infinity();    \
    static constexpr constant T finite_max = metal::numeric_limits<T>::max();   \
    static constexpr constant T finite_min = -metal::numeric_limits<T>::max();  \
  };
MTL_FP_LIMITS(float)
MTL_FP_LIMITS(half)
MTL_FP_LIMITS(bfloat)
#undef MTL_FP_LIMITS
template <>
struct Limits<bool> {
  static constexpr constant bool max = true;
  static constexpr constant bool min = false;
};

// In the check pass the shape and stride pointers are MLX's `constant const int*` and
// `constant const int64_t*`; the run build passes its checked pointers.
#ifdef MTL_CHECK
#define MTL_SHAPE_PTR constant const int*
#define MTL_STRIDE_PTR constant const int64_t*
#else
#define MTL_SHAPE_PTR ::mtl::DevPtr<int>
#define MTL_STRIDE_PTR ::mtl::DevPtr<int64_t>
#endif

// location of element `elem` (row-major index) of an array with these shape and strides
template <typename IdxT = int64_t>
METAL_FUNC IdxT elem_to_loc(IdxT elem, MTL_SHAPE_PTR shape, MTL_STRIDE_PTR strides, int ndim) {
  IdxT loc = 0;
  for (int i = ndim - 1; i >= 0 && elem > 0; --i) {
    loc += (elem % shape[i]) * IdxT(strides[i]);
    elem /= shape[i];
  }
  return loc;
}
// grid position (x: last axis, y: the one before, z: all others)
template <typename IdxT = int64_t>
METAL_FUNC IdxT elem_to_loc(uint3 elem, MTL_SHAPE_PTR shape, MTL_STRIDE_PTR strides, int ndim) {
  IdxT loc = elem.x * IdxT(strides[ndim - 1]) + elem.y * IdxT(strides[ndim - 2]);
  for (int d = ndim - 3; d >= 0; --d) {
    loc += (elem.z % shape[d]) * IdxT(strides[d]);
    elem.z /= shape[d];
  }
  return loc;
}
template <typename IdxT = int64_t>
METAL_FUNC IdxT elem_to_loc_1(uint elem, constant const int64_t& stride) {
  return elem * IdxT(stride);
}
template <typename IdxT = int64_t>
METAL_FUNC IdxT elem_to_loc_2(uint2 elem, MTL_STRIDE_PTR strides) {
  return elem.x * IdxT(strides[1]) + elem.y * IdxT(strides[0]);
}
template <typename IdxT = int64_t>
METAL_FUNC IdxT elem_to_loc_3(uint3 elem, MTL_STRIDE_PTR strides) {
  return elem.x * IdxT(strides[2]) + elem.y * IdxT(strides[1]) + elem.z * IdxT(strides[0]);
}
// the locations of one grid position in two (three) arrays of one shape
template <typename IdxT = int64_t>
METAL_FUNC vec<IdxT, 2> elem_to_loc_2_nd(uint3 elem, MTL_SHAPE_PTR shape, MTL_STRIDE_PTR a_strides,
                                         MTL_STRIDE_PTR b_strides, int ndim) {
  vec<IdxT, 2> loc = {IdxT(elem.x * IdxT(a_strides[ndim - 1]) + IdxT(elem.y) * IdxT(a_strides[ndim - 2])),
                      IdxT(elem.x * IdxT(b_strides[ndim - 1]) + elem.y * IdxT(b_strides[ndim - 2]))};
  for (int d = ndim - 3; d >= 0; --d) {
    uint l = elem.z % shape[d];
    loc.x += l * IdxT(a_strides[d]);
    loc.y += l * IdxT(b_strides[d]);
    elem.z /= shape[d];
  }
  return loc;
}
template <typename IdxT = int64_t>
METAL_FUNC vec<IdxT, 3> elem_to_loc_3_nd(uint3 elem, MTL_SHAPE_PTR shape, MTL_STRIDE_PTR a_strides,
                                         MTL_STRIDE_PTR b_strides, MTL_STRIDE_PTR c_strides, int ndim) {
  vec<IdxT, 3> loc = {IdxT(elem.x * IdxT(a_strides[ndim - 1])) + IdxT(elem.y * IdxT(a_strides[ndim - 2])),
                      IdxT(elem.x * IdxT(b_strides[ndim - 1])) + IdxT(elem.y * IdxT(b_strides[ndim - 2])),
                      IdxT(elem.x * IdxT(c_strides[ndim - 1])) + IdxT(elem.y * IdxT(c_strides[ndim - 2]))};
  for (int d = ndim - 3; d >= 0; --d) {
    uint l = elem.z % shape[d];
    loc.x += l * IdxT(a_strides[d]);
    loc.y += l * IdxT(b_strides[d]);
    loc.z += l * IdxT(c_strides[d]);
    elem.z /= shape[d];
  }
  return loc;
}

// Walks the locations of consecutive elements: `next()` advances one element (or n), `location()`
// is the current offset. DIM axes are walked by nested loopers; General=false is a 1-D array.
template <int DIM, typename OffsetT = size_t, bool General = true>
struct LoopedElemToLoc {
  int dim;
  LoopedElemToLoc<DIM - 1, OffsetT, General> inner_looper;
  OffsetT offset{0};
  int index{0};

  LoopedElemToLoc(int dim) thread : dim(dim), inner_looper(dim - 1) {}

  void next(MTL_SHAPE_PTR shape, MTL_STRIDE_PTR strides) thread {
    if (dim == 0) return;
    index++;
    offset += OffsetT(strides[dim - 1]);
    if (index >= shape[dim - 1]) {
      index = 0;
      inner_looper.next(shape, strides);
      offset = inner_looper.offset;
    }
  }
  void next(int n, MTL_SHAPE_PTR shape, MTL_STRIDE_PTR strides) thread {
    if (dim == 0) return;
    index += n;
    offset += n * OffsetT(strides[dim - 1]);
    if (index >= shape[dim - 1]) {
      int extra = index - shape[dim - 1];
      if (extra >= shape[dim - 1]) {
        inner_looper.next(1 + extra / shape[dim - 1], shape, strides);
        extra = extra % shape[dim - 1];
      } else {
        inner_looper.next(shape, strides);
      }
      index = 0;
      offset = inner_looper.offset;
      if (extra > 0) next(extra, shape, strides);
    }
  }
  OffsetT location() thread { return offset; }
};
template <typename OffsetT>
struct LoopedElemToLoc<1, OffsetT, true> {
  int dim;
  OffsetT offset{0};
  uint index{0};

  LoopedElemToLoc(int dim) thread : dim(dim) {}

  void next(MTL_SHAPE_PTR shape, MTL_STRIDE_PTR strides) thread {
    index++;
    if (dim > 1)
      offset = elem_to_loc<OffsetT>(index, shape, strides, dim);
    else
      offset += OffsetT(strides[0]);
  }
  void next(int n, MTL_SHAPE_PTR shape, MTL_STRIDE_PTR strides) thread {
    index += n;
    if (dim > 1)
      offset = elem_to_loc<OffsetT>(index, shape, strides, dim);
    else
      offset = index * OffsetT(strides[0]);
  }
  OffsetT location() thread { return offset; }
};
template <typename OffsetT>
struct LoopedElemToLoc<1, OffsetT, false> {
  OffsetT offset{0};

  LoopedElemToLoc(int) thread {}

  void next(MTL_SHAPE_PTR, MTL_STRIDE_PTR strides) thread { offset += OffsetT(strides[0]); }
  void next(int n, MTL_SHAPE_PTR, MTL_STRIDE_PTR strides) thread { offset += n * OffsetT(strides[0]); }
  OffsetT location() thread { return offset; }
};

/** ceil(N / M) for integers */
template <typename T, typename U>
inline T ceildiv(T N, U M) {
  return (N + M - 1) / M;
}

// log1p (Metal has none); MLX defines it for float, bfloat16_t and complex64_t
inline float log1p(float x) { return __builtin_log1pf(x); }
inline bfloat16_t log1p(bfloat16_t x) { return (bfloat16_t)__builtin_log1pf((float)x); }
inline complex64_t log1p(complex64_t z) {
  float re = z.real + 1.0f, im = z.imag;
  return complex64_t(0.5f * __builtin_logf(re * re + im * im), __builtin_atan2f(im, re));
}

// 64-bit, bool and complex shuffles (Metal's own take 8-, 16- and 32-bit types)
#define MTL_WIDE_SHUFFLE(NAME)                                                                  \
  inline uint64_t NAME(uint64_t data, uint16_t d) {                                            \
    return as_type<uint64_t>(metal::NAME(as_type<uint2>(data), d));                            \
  }                                                                                             \
  inline int64_t NAME(int64_t data, uint16_t d) {                                              \
    return as_type<int64_t>(metal::NAME(as_type<uint2>(data), d));                             \
  }                                                                                             \
  inline bool NAME(bool data, uint16_t d) { return metal::NAME(static_cast<uint32_t>(data), d); } \
  inline complex64_t NAME(complex64_t data, uint16_t d) {                                      \
    return complex64_t(metal::NAME(data.real, d), metal::NAME(data.imag, d));                  \
  }
MTL_WIDE_SHUFFLE(simd_shuffle_down)
MTL_WIDE_SHUFFLE(simd_shuffle_up)
MTL_WIDE_SHUFFLE(simd_shuffle)
#undef MTL_WIDE_SHUFFLE
inline uint64_t simd_shuffle_and_fill_up(uint64_t data, uint64_t filling, uint16_t delta) {
  return as_type<uint64_t>(metal::simd_shuffle_and_fill_up(as_type<uint2>(data), as_type<uint2>(filling), delta));
}
inline int64_t simd_shuffle_and_fill_up(int64_t data, int64_t filling, uint16_t delta) {
  return as_type<int64_t>(metal::simd_shuffle_and_fill_up(as_type<uint2>(data), as_type<uint2>(filling), delta));
}
inline bool simd_shuffle_and_fill_up(bool data, bool filling, uint16_t delta) {
  return metal::simd_shuffle_and_fill_up(static_cast<uint32_t>(data), static_cast<uint32_t>(filling), delta);
}
inline complex64_t simd_shuffle_and_fill_up(complex64_t data, complex64_t filling, uint16_t delta) {
  return complex64_t(metal::simd_shuffle_and_fill_up(data.real, filling.real, delta),
                     metal::simd_shuffle_and_fill_up(data.imag, filling.imag, delta));
}

// std::conditional (Metal has no standard library)
template <bool condition, typename T, typename U>
struct ConditionalType {
  using type = U;
};
template <typename T, typename U>
struct ConditionalType<true, T, U> {
  using type = T;
};

template <typename U, typename T>
inline U cast_to(T val) {
  return static_cast<U>(val);
}
template <>
inline bool cast_to<bool, float>(float val) {
  return (as_type<uint32_t>(val) & 0x7FFFFFFF) != 0;
}
template <>
inline bool cast_to<bool, bfloat16_t>(bfloat16_t val) {
  return (as_type<uint16_t>(val) & 0x7FFF) != 0;
}
template <>
inline bool cast_to<bool, complex64_t>(complex64_t val) {
  return cast_to<bool, float>(val.real) || cast_to<bool, float>(val.imag);
}
