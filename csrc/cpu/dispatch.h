// dtype dispatch from at::ScalarType to the torch-free storage types of vec.h.
#pragma once

#include <ATen/core/Tensor.h>

#include "vec.h"

// TOPG_DISPATCH_FLOAT(dtype, op, T, body): runs `body` with `T` bound to float,
// topg::bf16 or topg::fp16; any other dtype is a clear error naming the op.
#define TOPG_DISPATCH_FLOAT(dtype, op, T, ...)                          \
  [&] {                                                                 \
    switch (dtype) {                                                    \
      case at::kFloat: {                                                \
        using T = float;                                                \
        return __VA_ARGS__();                                           \
      }                                                                 \
      case at::kBFloat16: {                                             \
        using T = ::topg::bf16;                                         \
        return __VA_ARGS__();                                           \
      }                                                                 \
      case at::kHalf: {                                                 \
        using T = ::topg::fp16;                                         \
        return __VA_ARGS__();                                           \
      }                                                                 \
      default:                                                          \
        TORCH_CHECK(false, "topg::", op, ": unsupported dtype ", dtype, \
                    " (expected float32, bfloat16 or float16)");        \
    }                                                                   \
  }()

namespace topg {
template <typename T>
inline T* ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}
template <typename T>
inline const T* cptr(const at::Tensor& t) {
  return reinterpret_cast<const T*>(t.const_data_ptr());
}
}  // namespace topg
