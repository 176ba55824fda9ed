// SPDX-License-Identifier: Apache-2.0
// Host-side launch resources of the EXL3 ops: the device's shared-memory
// limits and the wgmma engine's tensor map of the activations.
#include <cudaTypedefs.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "exl3_kernels.h"

namespace vllm_exl3 {

namespace {

constexpr int kMaxDevices = 64;

// The driver's tensor-map encoder, fetched through the runtime so nothing links
// libcuda directly.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    const cudaError_t e = cudaGetDriverEntryPointByVersion(
        "cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q);
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || p == nullptr)
      throw std::runtime_error(
          "exl3: the CUDA driver has no cuTensorMapEncodeTiled (the wgmma "
          "engine needs a CUDA 12 driver)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// One stage's A tile: kTmaBoxK fp16 = one 128-byte row per token, the 128-byte
// swizzle period.
constexpr cuuint32_t kTmaBoxK = 64;

struct SmemLimits {
  int sms = 0, per_sm = 0, reserved_per_block = 0, optin_per_block = 0;
};
SmemLimits smem_limits() {
  static SmemLimits cached[kMaxDevices];
  int dev = 0;
  cudaGetDevice(&dev);
  SmemLimits& l = cached[dev >= 0 && dev < kMaxDevices ? dev : 0];
  if (l.per_sm == 0) {
    cudaDeviceGetAttribute(&l.sms, cudaDevAttrMultiProcessorCount, dev);
    cudaDeviceGetAttribute(&l.per_sm,
                           cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev);
    cudaDeviceGetAttribute(&l.reserved_per_block,
                           cudaDevAttrReservedSharedMemoryPerBlock, dev);
    cudaDeviceGetAttribute(&l.optin_per_block,
                           cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  }
  return l;
}
// Shared memory is allocated to blocks in these units.
constexpr int kSmemGranule = 128;
}  // namespace

int smem_dynamic_ceiling(int static_bytes) {
  return smem_limits().optin_per_block - static_bytes;
}

int smem_to_spread(int64_t grid_blocks, int need, int static_bytes) {
  const SmemLimits l = smem_limits();
  const int blocks = static_cast<int>((grid_blocks + l.sms - 1) / l.sms);
  // blocks + 1 blocks, each with its dynamic, static and reserved parts, must
  // not fit on one SM.
  int bytes = l.per_sm / (blocks + 1) - l.reserved_per_block - static_bytes +
              kSmemGranule;
  bytes = (bytes + kSmemGranule - 1) / kSmemGranule * kSmemGranule;
  if (bytes < need) bytes = need;
  return std::min(bytes, smem_dynamic_ceiling(static_bytes));
}

void encode_xh_map(CUtensorMap* map, const void* xh, int shards, int m, int k,
                   int bm) {
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(k),
                              static_cast<cuuint64_t>(m),
                              static_cast<cuuint64_t>(shards)};
  // Byte strides of dims 1 and 2 (dim 0 is contiguous).
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(k) * 2,
                                 static_cast<cuuint64_t>(m) * k * 2};
  const cuuint32_t box[3] = {kTmaBoxK, static_cast<cuuint32_t>(bm), 1};
  const cuuint32_t unit[3] = {1, 1, 1};
  const CUresult r = tensor_map_encoder()(
      map, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3, const_cast<void*>(xh), dims,
      strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw std::runtime_error(
        "exl3: encoding the activations' tensor map failed (CUresult " +
        std::to_string(static_cast<int>(r)) + ", m = " + std::to_string(m) +
        ", k = " + std::to_string(k) + ", BM = " + std::to_string(bm) + ")");
}

}  // namespace vllm_exl3
