// metal_stdlib.hpp: a stand-in for the Metal Shading Language standard library and for the names of
// MLX's kernel prelude, so that the text MLX generates for mx.fast.metal_kernel compiles as C++ with
// clang: once with MTL_CHECK defined (the check pass: Metal's address spaces and overload sets,
// -fsyntax-only) and once without (the run build: checked pointers, linked with the runtime).
//
// Only clang works: vector types are clang ext_vector_type (with swizzles), `half` is _Float16 and
// `bfloat` is __bf16. No system or C++ library header is included.
#pragma once

#include "mtl_types.h"  // scalar and vector types, complex64_t, address-space keywords
#include "mtl_core.h"   // internals: vector constructors, casts, checked pointers, SIMD glue
#include "mtl_math.h"   // metal:: math, common, integer, relational and geometric functions
#include "mtl_sync.h"   // barriers, SIMD-group functions, atomics, simdgroup_matrix
#include "mtl_mlx.h"    // MLX's prelude (utils.h, bf16.h, defines.h) and `using namespace metal`
