// What every kernel file shares: the C interface's conventions and the storage-type dispatch.
//
// The library is called through ctypes (pagedllm/layers/cpu_ops.py): plain pointers, sizes and
// strides in elements, a dtype code, the thread count torch uses. A function returns 0, or a
// negative code with a message in pl_last_error() (the Python side raises it), and never throws
// across the C boundary.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstring>
#include "simd.h"

namespace pl {

enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

void set_error(const char* fmt, ...);

// Calls fn(T{}) with T the storage type of `dtype`; -1 for an unknown code.
template <typename Fn>
inline int with_dtype(int dtype, const Fn& fn) {
  switch (dtype) {
    case kF32: return fn(float{});
    case kBF16: return fn(bf16{});
    case kF16: return fn(f16{});
    default: set_error("unknown dtype code %d", dtype); return -1;
  }
}

}  // namespace pl

#define PL_EXPORT extern "C" __attribute__((visibility("default")))
