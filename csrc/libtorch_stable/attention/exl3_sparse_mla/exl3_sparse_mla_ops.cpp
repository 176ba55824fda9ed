// SPDX-License-Identifier: Apache-2.0
// torch.ops._C.exl3_sparse_mla_decode: input validation, the split-k choice
// and the launches. Stable ABI only, so the same file builds into vLLM's
// _C_stable_libtorch and into the standalone _exl3_C.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "../../exl3_tensor_checks.h"
#include "exl3_sparse_mla.cuh"

namespace vllm_exl3 {

namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;
namespace mla = sparse_mla;

constexpr const char* kOp = "exl3_sparse_mla_decode";
// The query's head count of one model shard: DeepSeek-V3.2 / GLM-5 have 128
// heads, split by tensor parallelism.
constexpr int64_t kMaxHeads = 128;
// cp.async moves 16-byte chunks of q and of the cache rows.
constexpr int64_t kChunk = 16;
constexpr int64_t kBf16Bytes = 2;

// Index arithmetic in the kernel is 32-bit where it counts tokens, top-k
// positions and CTAs.
constexpr int64_t kMaxInt32 = (int64_t{1} << 31) - 1;

int sm_count(int32_t device) {
  // Cached per device: the split rule reads it on every call.
  constexpr int kMaxDevices = 64;
  static int cache[kMaxDevices] = {};
  STD_TORCH_CHECK(device >= 0 && device < kMaxDevices, kOp, ": device index ",
                  device, " out of range");
  if (cache[device] == 0) {
    int sms = 0;
    const cudaError_t e =
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    STD_TORCH_CHECK(e == cudaSuccess && sms > 0, kOp,
                    ": cannot read the SM count of cuda:", device, ": ",
                    cudaGetErrorString(e));
    cache[device] = sms;
  }
  return cache[device];
}

void check_device(const char* name, const Tensor& t, int32_t dev) {
  STD_TORCH_CHECK(t.is_cuda(), kOp, ": ", name, " must be a CUDA tensor");
  STD_TORCH_CHECK(t.get_device_index() == dev, kOp, ": ", name,
                  " is on cuda:", t.get_device_index(),
                  " but q is on cuda:", dev);
}

// The warpgroup-MMA path: from kTwoTileMinHeads heads on, on a device whose
// loaded image has the sm_90a code (wgmma_supported) and whose blocks take its
// shared memory; cached per device.
bool use_wgmma(int32_t device, int64_t heads) {
  if (mla::head_tiles(heads) != 2) return false;
  constexpr int kMaxDevices = 64;
  static int cache[kMaxDevices] = {};  // 0 unknown, 1 yes, 2 no
  if (device < 0 || device >= kMaxDevices) return false;
  if (cache[device] == 0) {
    int optin = 0;
    if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                               device) != cudaSuccess)
      optin = 0;
    const bool ok =
        wgmma_supported(device) && optin >= mla::WgLayout<576, false>::kBytes;
    cache[device] = ok ? 1 : 2;
  }
  return cache[device] == 1;
}

bool aligned(const Tensor& t, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % bytes == 0;
}

void exl3_sparse_mla_decode(Tensor q, Tensor kv_cache, Tensor indices,
                            double scale, int64_t kv_format, Tensor out,
                            Tensor lse, Tensor workspace) {
  // q: bf16 [T, H, D], last dim contiguous, rows 16-byte aligned.
  STD_TORCH_CHECK(q.is_cuda(), kOp, ": q must be a CUDA tensor");
  const int32_t dev = q.get_device_index();
  check_dtype(kOp, "q", q, ScalarType::BFloat16);
  STD_TORCH_CHECK(q.dim() == 3, kOp,
                  ": q must be [tokens, heads, head_size], got ", shape_str(q));
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  STD_TORCH_CHECK(D == 576 || D == 512, kOp,
                  ": q's head size must be 576 (512 latent + 64 rope) or 512, "
                  "got ",
                  D);
  STD_TORCH_CHECK(H >= 1 && H <= kMaxHeads, kOp, ": q has ", H, " heads; 1..",
                  kMaxHeads, " are supported");
  STD_TORCH_CHECK(q.stride(2) == 1, kOp,
                  ": q's last dimension must be contiguous (stride 1), got ",
                  q.stride(2));
  STD_TORCH_CHECK(aligned(q, kChunk) &&
                      (q.stride(0) * kBf16Bytes) % kChunk == 0 &&
                      (q.stride(1) * kBf16Bytes) % kChunk == 0,
                  kOp,
                  ": q's data and its token and head strides must be "
                  "16-byte aligned (strides ",
                  q.stride(0), ", ", q.stride(1), " elements)");
  STD_TORCH_CHECK(T <= kMaxInt32 / kMaxHeads, kOp, ": ", T,
                  " tokens is too many");

  // kv_cache: vLLM's paged MLA cache, rows addressed through its strides.
  STD_TORCH_CHECK(kv_format == 0 || kv_format == 1, kOp,
                  ": kv_format must be 0 (bf16 rows) or 1 (fp8_ds_mla), got ",
                  kv_format);
  const bool fp8 = kv_format == 1;
  check_device("kv_cache", kv_cache, dev);
  STD_TORCH_CHECK(kv_cache.dim() == 3, kOp,
                  ": kv_cache must be [num_blocks, block_size, row], got ",
                  shape_str(kv_cache));
  int64_t elem_bytes = kBf16Bytes;
  if (fp8) {
    STD_TORCH_CHECK(kv_cache.scalar_type() == ScalarType::Byte, kOp,
                    ": an fp8_ds_mla kv_cache (kv_format 1) must be uint8, "
                    "got ",
                    dtype_str(kv_cache.scalar_type()));
    STD_TORCH_CHECK(kv_cache.size(2) == mla::kFp8RowBytes, kOp,
                    ": an fp8_ds_mla kv_cache row is ", mla::kFp8RowBytes,
                    " bytes, got ", shape_str(kv_cache));
    STD_TORCH_CHECK(D == 576, kOp,
                    ": the fp8_ds_mla cache holds 576-wide rows but q's head "
                    "size is ",
                    D);
    elem_bytes = 1;
  } else {
    check_dtype(kOp, "kv_cache", kv_cache, ScalarType::BFloat16);
    STD_TORCH_CHECK(kv_cache.size(2) == D, kOp, ": kv_cache ",
                    shape_str(kv_cache), " rows do not match q's head size ",
                    D);
  }
  STD_TORCH_CHECK(kv_cache.size(0) >= 1 && kv_cache.size(1) >= 1, kOp,
                  ": kv_cache ", shape_str(kv_cache), " is empty");
  STD_TORCH_CHECK(kv_cache.stride(2) == 1, kOp,
                  ": kv_cache rows must be contiguous (stride 1), got ",
                  kv_cache.stride(2));
  const int64_t block_stride = kv_cache.stride(0) * elem_bytes;
  const int64_t row_stride = kv_cache.stride(1) * elem_bytes;
  STD_TORCH_CHECK(aligned(kv_cache, kChunk) && block_stride % kChunk == 0 &&
                      row_stride % kChunk == 0,
                  kOp,
                  ": kv_cache's data, block stride and row stride must be "
                  "16-byte aligned (strides ",
                  kv_cache.stride(0), ", ", kv_cache.stride(1), ")");
  STD_TORCH_CHECK(kv_cache.size(1) <= kMaxInt32, kOp, ": block size ",
                  kv_cache.size(1), " is too large");

  // indices: int32 [T, topk] of global slots, -1 = none.
  check_device("indices", indices, dev);
  check_dtype(kOp, "indices", indices, ScalarType::Int);
  STD_TORCH_CHECK(indices.dim() == 2 && indices.size(0) == T, kOp,
                  ": indices must be [tokens = ", T, ", topk], got ",
                  shape_str(indices));
  const int64_t topk = indices.size(1);
  STD_TORCH_CHECK(topk >= 1 && topk <= kMaxInt32 / 2, kOp,
                  ": topk must be in 1..", kMaxInt32 / 2, ", got ", topk);
  STD_TORCH_CHECK(topk == 1 || indices.stride(1) == 1, kOp,
                  ": indices' last dimension must be contiguous (stride 1), "
                  "got ",
                  indices.stride(1));

  STD_TORCH_CHECK(std::isfinite(scale), kOp, ": scale must be finite, got ",
                  scale);

  // out / lse: written in full.
  check_tensor(kOp, "out", out, 3, dev, kChunk);
  check_dtype(kOp, "out", out, ScalarType::BFloat16);
  STD_TORCH_CHECK(
      out.size(0) == T && out.size(1) == H && out.size(2) == mla::kLatent, kOp,
      ": out must be [", T, ", ", H, ", ", mla::kLatent, "], got ",
      shape_str(out));
  check_tensor(kOp, "lse", lse, 2, dev, 4);
  check_dtype(kOp, "lse", lse, ScalarType::Float);
  STD_TORCH_CHECK(lse.size(0) == T && lse.size(1) == H, kOp, ": lse must be [",
                  T, ", ", H, "], got ", shape_str(lse));

  const int64_t sms = sm_count(dev);
  const int splits = mla::num_splits(T, H, topk, sms);
  const int64_t need = mla::workspace_bytes(T, H, topk, sms);
  check_device("workspace", workspace, dev);
  STD_TORCH_CHECK(workspace.scalar_type() == ScalarType::Byte, kOp,
                  ": workspace must be uint8, got ",
                  dtype_str(workspace.scalar_type()));
  STD_TORCH_CHECK(workspace.is_contiguous(), kOp,
                  ": workspace must be contiguous");
  STD_TORCH_CHECK(workspace.numel() >= need, kOp, ": workspace has ",
                  workspace.numel(), " bytes; this problem (", T, " tokens, ",
                  H, " heads, topk ", topk, ", ", sms, " SMs) needs ", need,
                  " (exl3_sparse_mla.workspace_bytes)");
  STD_TORCH_CHECK(need == 0 || aligned(workspace, kChunk), kOp,
                  ": workspace must be 16-byte aligned");

  // wgmma_supported asks the current device's loaded image.
  torch::stable::accelerator::DeviceGuard guard(dev);
  const bool wgmma = use_wgmma(dev, H);
  const int64_t groups = wgmma ? mla::wg_head_groups(H) : mla::head_groups(H);
  STD_TORCH_CHECK(T * groups * splits <= kMaxInt32, kOp, ": ", T,
                  " tokens is too many");
  if (T == 0) return;

  mla::Params p{};
  p.q = q.data_ptr();
  p.q_token_stride = q.stride(0);
  p.q_head_stride = q.stride(1);
  p.kv = static_cast<const uint8_t*>(kv_cache.data_ptr());
  p.block_stride = block_stride;
  p.row_stride = row_stride;
  p.num_slots = kv_cache.size(0) * kv_cache.size(1);
  p.block_size = static_cast<int>(kv_cache.size(1));
  p.indices = static_cast<const int32_t*>(indices.data_ptr());
  p.indices_stride = indices.stride(0);
  p.topk = static_cast<int>(topk);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  p.out = out.data_ptr();
  p.lse = static_cast<float*>(lse.data_ptr());
  if (splits > 1) {
    p.part_out = static_cast<float*>(workspace.data_ptr());
    p.part_lse = p.part_out + splits * T * H * mla::kLatent;
  }
  p.num_tokens = static_cast<int>(T);
  p.num_heads = static_cast<int>(H);
  p.head_groups = static_cast<int>(groups);
  p.num_splits = splits;
  p.tiles_per_split = mla::tiles_per_split(topk, splits);

  void* s = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(dev, &s));
  const cudaStream_t stream = static_cast<cudaStream_t>(s);
  if (fp8)
    mla::launch_decode_fp8(p, wgmma, stream);
  else
    mla::launch_decode_bf16(p, static_cast<int>(D), wgmma, stream);
  cudaError_t e = cudaGetLastError();
  STD_TORCH_CHECK(e == cudaSuccess, kOp,
                  ": kernel launch failed: ", cudaGetErrorString(e));
  if (splits > 1) {
    mla::launch_combine(p, stream);
    e = cudaGetLastError();
    STD_TORCH_CHECK(e == cudaSuccess, kOp,
                    ": combine launch failed: ", cudaGetErrorString(e));
  }
}

}  // namespace

}  // namespace vllm_exl3

STABLE_TORCH_LIBRARY_FRAGMENT(_C, m) {
  m.def(
      "exl3_sparse_mla_decode(Tensor q, Tensor kv_cache, Tensor indices, "
      "float scale, int kv_format, Tensor(a!) out, Tensor(b!) lse, "
      "Tensor workspace) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(_C, CUDA, m) {
  m.impl("exl3_sparse_mla_decode",
         TORCH_BOX(&vllm_exl3::exl3_sparse_mla_decode));
}
