// SPDX-License-Identifier: Apache-2.0
// Trellis -> dense weight.
//  * rotated: Ŵ fp16 [k][n], the raw decode (tests, debugging; bit-identical to the reference).
//  * original: W = diag(suh[s]) Ĥ Ŵ Ĥ diag(svh) in the caller's dtype, so the large-m path is a
//    single cuBLAS GEMM on the untransformed input with no input or output transform pass.
#pragma once

#include "exl3_hadamard.cuh"
#include "exl3_kernels.h"
#include "exl3_trellis.cuh"

namespace vllm_exl3 {

constexpr int kReconThreads = 256;
constexpr int kReconWarps = kReconThreads / kWarpSize;
// Rotated decode: a block writes a 16 x 128 strip (8 tiles, one per warp) through shared memory
// so the global stores are whole 16-byte row segments; +8 halves of padding per row keeps rows
// 16-byte aligned.
constexpr int kStripStride = kHadamard + 8;
// Original-basis reconstruct: one 128 x 128 block in fp32; a row stride of 129 floats puts both
// row walks (e = lane + 32 j along a row) and column walks (down a column) on distinct banks.
constexpr int kBlockStride = kHadamard + 1;
constexpr int kReconOriginalSmem = kHadamard * kBlockStride * 4;

template <int K2, int CB>
__global__ void __launch_bounds__(kReconThreads) exl3_reconstruct_rotated_kernel(ReconParams p) {
  using R = Rate<K2>;
  __shared__ __align__(16) __half strip[kTile][kStripStride];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kb = blockIdx.y;
  const int nb = blockIdx.x * kReconWarps + warp;
  LaneWindow<K2> lw;
  lw.init(lane);
  const uint8_t* tile = static_cast<const uint8_t*>(p.trellis) +
                        (static_cast<size_t>(kb) * (p.n / kTile) + nb) * R::kTileBytes;
  uint32_t b[4];
  decode_fragments<K2, CB>(tile, lw, halves_xor_register(), b);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const __half2 h = *reinterpret_cast<const __half2*>(&b[q]);
    strip[position_row(lane, 2 * q)][warp * kTile + position_col(lane, 2 * q)] = h.x;
    strip[position_row(lane, 2 * q + 1)][warp * kTile + position_col(lane, 2 * q + 1)] = h.y;
  }
  __syncthreads();
  const int r = threadIdx.x / (kHadamard / 8), c = (threadIdx.x % (kHadamard / 8)) * 8;
  __half* dst = static_cast<__half*>(p.w) + static_cast<size_t>(kb * kTile + r) * p.n +
                blockIdx.x * kHadamard + c;
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(&strip[r][c]);
}

template <int K2, int CB, typename T>
__global__ void __launch_bounds__(kReconThreads) exl3_reconstruct_original_kernel(ReconParams p) {
  using R = Rate<K2>;
  extern __shared__ float blk[];  // [128][kBlockStride]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int k0 = blockIdx.y * kHadamard, n0 = blockIdx.x * kHadamard;
  const int shard = shard_of_column(p.shards, n0);

  // Decode the 8 x 8 tiles: warp w owns tile column w.
  LaneWindow<K2> lw;
  lw.init(lane);
  const uint8_t* trellis = static_cast<const uint8_t*>(p.trellis);
  const uint32_t halves_xor = halves_xor_register();
  constexpr int kTilesPerBlock = kHadamard / kTile;
#pragma unroll 2
  for (int kt = 0; kt < kTilesPerBlock; ++kt) {
    const uint8_t* tile =
        trellis + (static_cast<size_t>(k0 / kTile + kt) * (p.n / kTile) + n0 / kTile + warp) *
                      R::kTileBytes;
    uint32_t b[4];
    decode_fragments<K2, CB>(tile, lw, halves_xor, b);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const __half2 h = *reinterpret_cast<const __half2*>(&b[q]);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = 2 * q + e;
        blk[(kt * kTile + position_row(lane, j)) * kBlockStride + warp * kTile +
            position_col(lane, j)] = __half2float(e ? h.y : h.x);
      }
    }
  }
  __syncthreads();
  // Ŵ Ĥ: transform every row (along n).
  for (int r = warp; r < kHadamard; r += kReconWarps) {
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = blk[r * kBlockStride + lane + kWarpSize * j];
    hadamard128(v, lane);
#pragma unroll
    for (int j = 0; j < 4; ++j) blk[r * kBlockStride + lane + kWarpSize * j] = v[j];
  }
  __syncthreads();
  // Ĥ (Ŵ Ĥ): transform every column (along k).
  for (int c = warp; c < kHadamard; c += kReconWarps) {
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = blk[(lane + kWarpSize * j) * kBlockStride + c];
    hadamard128(v, lane);
#pragma unroll
    for (int j = 0; j < 4; ++j) blk[(lane + kWarpSize * j) * kBlockStride + c] = v[j];
  }
  __syncthreads();
  // Scale by suh (rows) and svh (columns) and both 1/sqrt(128), round once, 16-byte stores.
  const __half* suh = static_cast<const __half*>(p.suh) + static_cast<size_t>(shard) * p.k + k0;
  const __half* svh = static_cast<const __half*>(p.svh) + n0;
  constexpr float kBoth = kHadamardScale * kHadamardScale;
  constexpr int kVec = 8;
  for (int idx = threadIdx.x; idx < kHadamard * kHadamard / kVec; idx += kReconThreads) {
    const int r = idx / (kHadamard / kVec), c = (idx % (kHadamard / kVec)) * kVec;
    const float rs = __half2float(suh[r]) * kBoth;
    float lo[4], hi[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      lo[e] = blk[r * kBlockStride + c + e] * rs * __half2float(svh[c + e]);
      hi[e] = blk[r * kBlockStride + c + 4 + e] * rs * __half2float(svh[c + 4 + e]);
    }
    const uint2 a = Fp16Like<T>::pack4(lo), b = Fp16Like<T>::pack4(hi);
    T* dst = static_cast<T*>(p.w) + static_cast<size_t>(k0 + r) * p.n + n0 + c;
    *reinterpret_cast<uint4*>(dst) = make_uint4(a.x, a.y, b.x, b.y);
  }
}

}  // namespace vllm_exl3
