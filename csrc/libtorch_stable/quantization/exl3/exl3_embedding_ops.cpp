// SPDX-License-Identifier: Apache-2.0
// torch.ops._C.exl3_embedding: the quantized token embedding's row gather
// (docs/design/exl3_format.md §8): input validation and the launch. Stable ABI
// only, so the same file builds into vLLM's _C_stable_libtorch and into the
// standalone _exl3_C.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <cuda_runtime.h>

#include <cstdint>

#include "exl3_embedding.h"
#include "../../exl3_tensor_checks.h"

namespace vllm_exl3 {

namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

constexpr const char* kOp = "exl3_embedding";
// Format constants (exl3_embedding.cuh holds the device side's copy).
constexpr int64_t kGroup = 256;
constexpr int64_t kScaleWords = 1;
constexpr int64_t kStreamWordsPerBit = kGroup / 16;
constexpr int64_t kMinBits = 1, kMaxBits = 8;
// The grid has one warp per (token, group), four warps per block, and at most
// 2^31 - 1 blocks; hidden sizes index the output in 32-bit arithmetic.
constexpr int64_t kMaxItems = (int64_t{1} << 31) * 4 - 4;
constexpr int64_t kMaxInt32 = (int64_t{1} << 31) - 1;

// A CUDA tensor on `device` (the trellis'), contiguous, with `dim` dimensions.
void check_input(const char* name, const Tensor& t, int64_t dim,
                 int32_t device) {
  STD_TORCH_CHECK(t.is_cuda(), kOp, ": ", name, " must be a CUDA tensor");
  STD_TORCH_CHECK(t.get_device_index() == device, kOp, ": ", name,
                  " is on cuda:", t.get_device_index(),
                  " but trellis is on cuda:", device);
  STD_TORCH_CHECK(t.dim() == dim, kOp, ": ", name, " must have ", dim,
                  " dimensions, got ", shape_str(t));
  STD_TORCH_CHECK(t.is_contiguous(), kOp, ": ", name, " must be contiguous");
}

cudaStream_t current_stream(int32_t device) {
  void* s = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(device, &s));
  return static_cast<cudaStream_t>(s);
}

EmbeddingOut out_type(ScalarType dtype) {
  switch (dtype) {
    case ScalarType::Float:
      return EmbeddingOut::kFloat;
    case ScalarType::Half:
      return EmbeddingOut::kHalf;
    case ScalarType::BFloat16:
      return EmbeddingOut::kBFloat16;
    default:
      STD_TORCH_CHECK(false, kOp, ": dtype must be float32, float16 or ",
                      "bfloat16, got ", dtype_str(dtype));
  }
  return EmbeddingOut::kFloat;
}

}  // namespace

// out [n, hidden] (dtype) = rows ids [n] of the table (trellis int16
// [rows, groups * (1 + 16 * bits)], signs fp16 [groups, 256]), decoded.
Tensor exl3_embedding(Tensor ids, Tensor trellis, Tensor signs, int64_t hidden,
                      ScalarType dtype) {
  STD_TORCH_CHECK(trellis.is_cuda(), kOp, ": trellis must be a CUDA tensor");
  const int32_t dev = trellis.get_device_index();
  check_input("trellis", trellis, 2, dev);
  check_dtype(kOp, "trellis", trellis, ScalarType::Short);
  check_input("signs", signs, 2, dev);
  check_dtype(kOp, "signs", signs, ScalarType::Half);
  check_input("ids", ids, 1, dev);
  const ScalarType id_type = ids.scalar_type();
  STD_TORCH_CHECK(id_type == ScalarType::Long || id_type == ScalarType::Int,
                  kOp, ": ids must be int64 or int32, got ",
                  dtype_str(id_type));
  const EmbeddingOut out_kind = out_type(dtype);

  const int64_t groups = signs.size(0);
  STD_TORCH_CHECK(groups >= 1 && signs.size(1) == kGroup, kOp, ": signs ",
                  shape_str(signs), " must be [groups, 256] with groups >= 1");
  const int64_t rows = trellis.size(0), width = trellis.size(1);
  const int64_t per_group = width / groups;
  const int64_t bits = (per_group - kScaleWords) / kStreamWordsPerBit;
  STD_TORCH_CHECK(rows >= 1 && width == groups * per_group &&
                      per_group == kScaleWords + kStreamWordsPerBit * bits &&
                      bits >= kMinBits && bits <= kMaxBits,
                  kOp, ": trellis ", shape_str(trellis), " is not [rows >= 1, ",
                  groups,
                  " groups (from signs) * (1 + 16 * bits)] for bits in ",
                  kMinBits, "..", kMaxBits);
  STD_TORCH_CHECK(
      hidden > (groups - 1) * kGroup && hidden <= groups * kGroup, kOp,
      ": hidden = ", hidden, " does not fill ", groups,
      " groups of 256 (the table stores ceil(hidden / 256) groups)");
  const int64_t tokens = ids.size(0);
  STD_TORCH_CHECK(tokens * groups <= kMaxItems, kOp, ": ", tokens, " ids x ",
                  groups, " groups exceed one launch");
  STD_TORCH_CHECK(hidden <= kMaxInt32, kOp, ": hidden = ", hidden,
                  " is too large");

  torch::stable::accelerator::DeviceGuard guard(dev);
  Tensor out = torch::stable::new_empty(trellis, {tokens, hidden}, dtype);
  if (tokens == 0) return out;
  EmbeddingParams p{};
  p.ids = ids.data_ptr();
  p.ids_int64 = id_type == ScalarType::Long;
  p.table = static_cast<const int16_t*>(trellis.data_ptr());
  p.signs = static_cast<const uint16_t*>(signs.data_ptr());
  p.out = out.data_ptr();
  p.out_type = out_kind;
  p.tokens = tokens;
  p.rows = rows;
  p.groups = static_cast<int>(groups);
  p.bits = static_cast<int>(bits);
  p.hidden = static_cast<int>(hidden);
  launch_embedding(p, current_stream(dev));
  const cudaError_t e = cudaGetLastError();
  STD_TORCH_CHECK(e == cudaSuccess, kOp,
                  ": kernel launch failed: ", cudaGetErrorString(e));
  return out;
}

}  // namespace vllm_exl3

STABLE_TORCH_LIBRARY_FRAGMENT(_C, m) {
  m.def(
      "exl3_embedding(Tensor ids, Tensor trellis, Tensor signs, int hidden, "
      "ScalarType dtype) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(_C, CUDA, m) {
  m.impl("exl3_embedding", TORCH_BOX(&vllm_exl3::exl3_embedding));
}
