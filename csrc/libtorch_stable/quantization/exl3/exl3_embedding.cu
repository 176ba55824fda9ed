// SPDX-License-Identifier: Apache-2.0
// Row gather of a quantized token embedding: each looked-up row is decoded on
// the fly from its rings (exl3_embedding.cuh), one warp per (token, group); no
// dense copy of the table exists at any time.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstdio>

#include "exl3_embedding.cuh"
#include "exl3_embedding.h"

namespace vllm_exl3 {
namespace embedding {
namespace {

// Four warps per block: few enough that a short prompt still spreads over the
// SMs, and each warp's ring (at most 129 words) stays in its own shared slot.
constexpr int kWarpsPerBlock = 4;
constexpr int kThreads = kWarpsPerBlock * kWarpSize;

template <typename Out>
__device__ __forceinline__ Out from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// A lane's 8 elements at column `col` of an output row: one or two 16-byte
// stores when the row's width is a multiple of 8 (then every lane's chunk is
// whole and 16-byte aligned in a fresh allocation), else element by element
// up to `hidden`.
template <typename Out>
__device__ __forceinline__ void store_lane(Out* row, int col, int hidden,
                                           const float (&x)[kPerLane]) {
  if (hidden % kPerLane == 0) {
    if (col >= hidden) return;
    alignas(16) Out v[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) v[j] = from_float<Out>(x[j]);
    constexpr int kVectors = sizeof(v) / sizeof(uint4);
#pragma unroll
    for (int u = 0; u < kVectors; ++u)
      reinterpret_cast<uint4*>(row + col)[u] = reinterpret_cast<uint4*>(v)[u];
    return;
  }
#pragma unroll
  for (int j = 0; j < kPerLane; ++j)
    if (col + j < hidden) row[col + j] = from_float<Out>(x[j]);
}

template <typename Id, typename Out>
__global__ void __launch_bounds__(kThreads)
    embedding_kernel(const EmbeddingParams p) {
  __shared__ uint16_t rings[kWarpsPerBlock][kMaxGroupWords];
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (item >= p.tokens * p.groups) return;  // whole warps only
  const int64_t token = item / p.groups;
  const int group = static_cast<int>(item % p.groups);
  const int64_t id = static_cast<int64_t>(static_cast<const Id*>(p.ids)[token]);
  if (id < 0 || id >= p.rows) {
    if (lane == 0 && group == 0)
      printf(
          "exl3_embedding: ids[%lld] = %lld is outside [0, %lld), the rows of "
          "trellis\n",
          static_cast<long long>(token), static_cast<long long>(id),
          static_cast<long long>(p.rows));
    __trap();
  }

  const int words = group_words(p.bits);
  const int16_t* src =
      p.table + id * static_cast<int64_t>(p.groups) * words + group * words;
  uint16_t* ring = rings[warp];
  for (int w = lane; w < words; w += kWarpSize)
    ring[w] = static_cast<uint16_t>(src[w]);
  __syncwarp();

  float x[kPerLane];
  lane_values(ring, p.bits, lane, x);
  // Strides 8, 16, ..., 128: the partner element sits in lane ^ mask.
#pragma unroll
  for (int mask = 1; mask <= kLastLaneMask; mask *= 2) {
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const float partner = __shfl_xor_sync(kFullMask, x[j], mask);
      x[j] = butterfly(x[j], partner, lane & mask);
    }
  }
  lane_finish(p.signs + group * kGroup, lane, x);

  Out* row = static_cast<Out*>(p.out) + token * p.hidden;
  store_lane(row, group * kGroup + lane * kPerLane, p.hidden, x);
}

template <typename Id>
void launch_for_ids(const EmbeddingParams& p, dim3 grid, cudaStream_t stream) {
  switch (p.out_type) {
    case EmbeddingOut::kFloat:
      embedding_kernel<Id, float><<<grid, kThreads, 0, stream>>>(p);
      return;
    case EmbeddingOut::kHalf:
      embedding_kernel<Id, __half><<<grid, kThreads, 0, stream>>>(p);
      return;
    case EmbeddingOut::kBFloat16:
      embedding_kernel<Id, __nv_bfloat16><<<grid, kThreads, 0, stream>>>(p);
      return;
  }
}

}  // namespace
}  // namespace embedding

void launch_embedding(const EmbeddingParams& p, cudaStream_t stream) {
  using embedding::kWarpsPerBlock;
  const int64_t items = p.tokens * p.groups;
  if (items == 0) return;
  const dim3 grid(
      static_cast<unsigned>((items + kWarpsPerBlock - 1) / kWarpsPerBlock));
  if (p.ids_int64)
    embedding::launch_for_ids<int64_t>(p, grid, stream);
  else
    embedding::launch_for_ids<int32_t>(p, grid, stream);
}

}  // namespace vllm_exl3
