// Interface between the emulator runtime (runtime.cpp, compiled once) and a
// translated kernel (metal_stdlib.hpp + kernel text, compiled per variant).
#pragma once

// The fixed-width types this interface needs, from the compiler's predefined macros: a translated
// kernel includes no system header (these are <stdint.h>'s definitions, so the runtime, which
// includes it, sees the same types twice, which C++ allows).
typedef __UINT32_TYPE__ uint32_t;
typedef __INT64_TYPE__ int64_t;
typedef __UINT64_TYPE__ uint64_t;
typedef __SIZE_TYPE__ size_t;

#define MTL_SIMD_WIDTH 32
#define MTL_SIMD_SLOT 64  // bytes a lane can contribute to one SIMD operation

struct mtl_thread_info {
  // Field names match the Metal attribute names so the launcher glue can be
  // written by plain string substitution.
  uint32_t thread_position_in_grid[3];
  uint32_t thread_position_in_threadgroup[3];
  uint32_t threadgroup_position_in_grid[3];
  uint32_t threads_per_threadgroup[3];           // actual size of this threadgroup
  uint32_t dispatch_threads_per_threadgroup[3];  // requested size
  uint32_t threadgroups_per_grid[3];
  uint32_t threads_per_grid[3];
  uint32_t grid_size[3];
  uint32_t grid_origin[3];
  uint32_t thread_index_in_threadgroup;
  uint32_t thread_index_in_simdgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t simdgroups_per_threadgroup;
  uint32_t dispatch_simdgroups_per_threadgroup;
  uint32_t thread_index_in_quadgroup;
  uint32_t quadgroup_index_in_threadgroup;
  uint32_t quadgroups_per_threadgroup;
  uint32_t dispatch_quadgroups_per_threadgroup;
  uint32_t threads_per_simdgroup;
  uint32_t thread_execution_width;
};

struct mtl_simd_snapshot {
  uint32_t mask;  // lanes that took part
  int64_t arg[MTL_SIMD_WIDTH];
  unsigned char data[MTL_SIMD_WIDTH][MTL_SIMD_SLOT];
};

#ifdef __cplusplus
extern "C" {
#endif
// provided by runtime.cpp
__attribute__((noreturn)) void mtl_rt_fail(const char* msg);
const struct mtl_thread_info* mtl_rt_thread(void);
void mtl_rt_barrier(int flags, unsigned line, unsigned col);
const struct mtl_simd_snapshot* mtl_rt_simd(const void* mine, int size, int64_t arg,
                                            const char* op, unsigned line, unsigned col);
void* mtl_rt_tg_alloc(int id, const char* name, int64_t bytes, int64_t align);
void mtl_rt_tg_bounds(const void* p, char** lo, char** hi, const char** name);
void mtl_rt_tg_log(void* addr, int size);
void mtl_rt_dev_log(int out_id, void* addr, int size, int store);
void mtl_rt_tg_atomic(void* addr, int size, int is_read, int is_write);
void mtl_rt_oob(const char* what, const char* name, const void* p, const void* lo,
                const void* hi, int elem_size);
// provided by the translated kernel
void mtl_kernel_entry(void* const* bufs, void* const* lo, void* const* hi);
#ifdef __cplusplus
}
#endif
