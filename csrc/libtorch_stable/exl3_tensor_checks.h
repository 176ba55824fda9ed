// SPDX-License-Identifier: Apache-2.0
// Input checks shared by the EXL3 ops: every message names the op, the tensor
// and the rule it breaks.
#pragma once

#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <cstdint>
#include <string>

namespace vllm_exl3 {

inline std::string shape_str(const torch::stable::Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d)
    s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

inline const char* dtype_str(torch::headeronly::ScalarType t) {
  using torch::headeronly::ScalarType;
  switch (t) {
    case ScalarType::Half:
      return "float16";
    case ScalarType::BFloat16:
      return "bfloat16";
    case ScalarType::Float:
      return "float32";
    case ScalarType::Short:
      return "int16";
    case ScalarType::Int:
      return "int32";
    case ScalarType::Long:
      return "int64";
    default:
      return "another dtype";
  }
}

// A CUDA tensor on `device`, contiguous, `align`-byte aligned, with `dim`
// dimensions (any number when dim < 0).
inline void check_tensor(const char* op, const char* name,
                         const torch::stable::Tensor& t, int64_t dim,
                         int32_t device, uintptr_t align) {
  STD_TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor");
  STD_TORCH_CHECK(t.get_device_index() == device, op, ": ", name,
                  " is on cuda:", t.get_device_index(),
                  " but x is on cuda:", device);
  STD_TORCH_CHECK(dim < 0 || t.dim() == dim, op, ": ", name, " must have ", dim,
                  " dimensions, got ", shape_str(t));
  STD_TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
  STD_TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % align == 0, op,
                  ": ", name, " must be ", align,
                  "-byte aligned (a sliced view with an odd offset?)");
}

inline void check_dtype(const char* op, const char* name,
                        const torch::stable::Tensor& t,
                        torch::headeronly::ScalarType want) {
  STD_TORCH_CHECK(t.scalar_type() == want, op, ": ", name, " must be ",
                  dtype_str(want), ", got ", dtype_str(t.scalar_type()));
}

}  // namespace vllm_exl3
