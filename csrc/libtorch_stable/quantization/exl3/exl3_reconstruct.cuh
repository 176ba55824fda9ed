// SPDX-License-Identifier: Apache-2.0
// Trellis -> dense weight.
//  * rotated: Ŵ fp16 [k][n], the raw decode (tests, debugging; bit-identical to
//  the reference).
//  * original: W = diag(suh[s]) Ĥ Ŵ Ĥ diag(svh) in the caller's dtype, so the
//  large-m path is a
//    single cuBLAS GEMM on the untransformed input with no input or output
//    transform pass.
#pragma once

#include "exl3_common.cuh"
#include "exl3_kernels.h"
#include "exl3_trellis.cuh"

namespace vllm_exl3 {

constexpr int kReconThreads = 256;
constexpr int kReconWarps = kReconThreads / kWarpSize;
// Rotated decode: a block writes a 16 x 128 strip (8 tiles, one per warp)
// through shared memory so the global stores are whole 16-byte row segments; +8
// halves of padding per row keeps rows 16-byte aligned.
constexpr int kStripStride = kHadamard + 8;
// Original-basis reconstruct: Ĥ Ŵ staged per 128 x 128 block as fp16 in shared
// memory; +8 halves of row padding keep rows 16-byte aligned for ldmatrix and
// put the 8 rows of one fragment store (and of one ldmatrix phase) on distinct
// banks.
constexpr int kStageStride = kHadamard + 8;
constexpr int kStageBytes = kHadamard * kStageStride * 2;
// The block's trellis (8 x 8 tiles) is copied to shared memory behind the
// staging area in one burst of cp.async, so its global latency is paid once per
// block instead of once per tile.
template <int K2>
constexpr int recon_original_smem() {
  return kStageBytes +
         (kHadamard / kTile) * (kHadamard / kTile) * Rate<K2>::kTileBytes;
}
// Resident blocks per SM the register cap aims for: three on sm_90 (80
// registers hold a pass's 64 fp32 accumulators per thread without spilling).
// sm_12x's 100 KB of shared memory holds at most two blocks of
// recon_original_smem, and ptxas spilled there at the three-block cap.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
constexpr int kReconOriginalMinBlocks = 2;
#else
constexpr int kReconOriginalMinBlocks = 3;
#endif
// A 128 x 128 block is 8 x 8 tiles of 16 x 16.
constexpr int kBlockTilesPerSide = kHadamard / kTile;

template <int K2, int CB>
__global__ void __launch_bounds__(kReconThreads)
    exl3_reconstruct_rotated_kernel(ReconParams p) {
  using R = Rate<K2>;
  __shared__ __align__(16) __half strip[kTile][kStripStride];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kb = blockIdx.y;
  const int nb = blockIdx.x * kReconWarps + warp;
  LaneWindow<K2> lw;
  lw.init(lane);
  const uint8_t* tile =
      static_cast<const uint8_t*>(p.trellis) +
      (static_cast<size_t>(kb) * (p.n / kTile) + nb) * R::kTileBytes;
  uint32_t b[4];
  decode_fragments<K2, CB>(tile, lw, halves_xor_register(), b);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const __half2 h = *reinterpret_cast<const __half2*>(&b[q]);
    strip[position_row(lane, 2 * q)][warp * kTile + position_col(lane, 2 * q)] =
        h.x;
    strip[position_row(lane, 2 * q + 1)]
         [warp * kTile + position_col(lane, 2 * q + 1)] = h.y;
  }
  __syncthreads();
  const int r = threadIdx.x / (kHadamard / 8),
            c = (threadIdx.x % (kHadamard / 8)) * 8;
  __half* dst = static_cast<__half*>(p.w) +
                static_cast<size_t>(kb * kTile + r) * p.n +
                blockIdx.x * kHadamard + c;
  *reinterpret_cast<uint4*>(dst) =
      *reinterpret_cast<const uint4*>(&strip[r][c]);
}

// The 1/sqrt(128) of each normalised Hadamard side, 1/128 in all, rides on the
// H16 entries as two exact powers of two: +-1/16 in pass 1 (its fp16 staging
// keeps the values near the decoded ones' range) and +-1/8 in pass 2. Scaling
// by a power of two never rounds, so this is the unnormalised product's value,
// and no pass spends a multiply on the scale.
constexpr uint32_t kH16Pass1 = 0x2C00u;  // fp16 1/16
constexpr uint32_t kH16Pass2 = 0x3000u;  // fp16 1/8
static_assert(kHadamard == 128, "1/16 x 1/8 is 1/128 = (1/sqrt(128))^2");

// Sylvester H16 entries (-1)^popcount(i & j) times the fp16 power of two `mag`,
// for (i0, j0) and (i1, j1), packed as an fp16 pair (first in the low half, the
// order of an mma fragment).
__device__ __forceinline__ uint32_t h16_pair(int i0, int j0, int i1, int j1,
                                             uint32_t mag) {
  constexpr uint32_t kSign = 0x8000u;
  const uint32_t lo = mag | ((__popc(i0 & j0) & 1) ? kSign : 0u);
  const uint32_t hi = mag | ((__popc(i1 & j1) & 1) ? kSign : 0u);
  return lo | (hi << 16);
}

// H16 (times mag) as an A fragment; H is symmetric, so its registers {0, 2} and
// {1, 3} are also the B fragments of H16's column halves 0 and 1.
__device__ __forceinline__ void h16_fragment(int g, int t, uint32_t mag,
                                             uint32_t (&h)[4]) {
  h[0] = h16_pair(g, 2 * t, g, 2 * t + 1, mag);
  h[1] = h16_pair(g + 8, 2 * t, g + 8, 2 * t + 1, mag);
  h[2] = h16_pair(g, 2 * t + 8, g, 2 * t + 9, mag);
  h[3] = h16_pair(g + 8, 2 * t + 8, g + 8, 2 * t + 9, mag);
}

// (x_q) -> H8 (x_q) over the 8 tiles' fragments a warp holds, in fp16 pairs
// before the H16 mma (H8 x H16 applied as H16 (H8 x)): one HADD2 per two values
// per butterfly step instead of one FADD per value after it. Each step rounds
// to fp16 (2^-11 relative, three steps), below the bf16 output's own rounding
// and within the fp16 output's verification bound.
__device__ __forceinline__ void butterfly8_half2(
    uint32_t (&x)[kBlockTilesPerSide][4]) {
#pragma unroll
  for (int bit = 1; bit < kBlockTilesPerSide; bit <<= 1)
#pragma unroll
    for (int q = 0; q < kBlockTilesPerSide; ++q)
      if (!(q & bit))
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const __half2 a = *reinterpret_cast<const __half2*>(&x[q][e]);
          const __half2 b = *reinterpret_cast<const __half2*>(&x[q | bit][e]);
          const __half2 s = __hadd2(a, b), d = __hsub2(a, b);
          x[q][e] = *reinterpret_cast<const uint32_t*>(&s);
          x[q | bit][e] = *reinterpret_cast<const uint32_t*>(&d);
        }
}

// One side of H128 = H8 x H16 over the 8 tiles' fragments a warp holds: the
// butterfly across the tiles, then one H16 mma per tile into fp32. kLeft: H16 x
// tile, the tiles' B fragments (pass 1); else tile x H16, their A fragments
// (pass 2).
template <bool kLeft>
__device__ __forceinline__ void hadamard128_side(
    uint32_t (&x)[kBlockTilesPerSide][4], const uint32_t (&h16)[4],
    float (&v)[kBlockTilesPerSide][2][4]) {
  butterfly8_half2(x);
#pragma unroll
  for (int q = 0; q < kBlockTilesPerSide; ++q)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int e = 0; e < 4; ++e) v[q][h][e] = 0.0f;
      if constexpr (kLeft)
        mma_16816(v[q][h], h16, x[q][2 * h], x[q][2 * h + 1]);
      else
        mma_16816(v[q][h], x[q], h16[h], h16[h + 2]);
    }
}

// W = diag(suh[s]) Ĥ Ŵ Ĥ diag(svh) for one 128 x 128 block, the Hadamards on
// tensor cores. Sylvester H128[i][j] = H8[i >> 4][j >> 4] * H16[i & 15][j & 15]
// (the popcount splits over the index bits), so each side is a butterfly across
// the 8 tiles one warp holds in registers (H8) and a 16 x 16 mma product per
// tile (H16).
//  pass 1, warp w = tile column w: decode the 8 tiles down the column,
//  butterfly down the
//          column, H16 x tile, stage Ĥ Ŵ as fp16 (a further rounding, 2^-11
//          relative, below the output's own) in shared memory;
//  pass 2, warp w = tile row w: read the row's 8 tiles back as A fragments,
//  butterfly along the
//          row, tile x H16, scale by suh and svh, store.
//
// One 128 x 128 block (k0, n0) of a k x n weight: `trellis` is the whole
// weight's, `suh` its k input scales (the block's shard), `svh` its n output
// scales. kTransposed stores W^T ([n][k], the [out][in] layout of vLLM's fused
// MoE weights) instead of W ([k][n]).
template <int K2, int CB, typename T, bool kTransposed>
__device__ __forceinline__ void reconstruct_original_block(
    const void* trellis, const __half* suh_k, const __half* svh_n, void* w,
    int k, int n, int k0, int n0, __half* staged) {
  using R = Rate<K2>;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2,
            t = lane & 3;  // mma fragment row group and column pair

  float v[kBlockTilesPerSide][2][4];

  // The block's trellis: 8 tile rows of 8 consecutive tiles each, to shared
  // memory.
  constexpr int kRowBytes = kBlockTilesPerSide * R::kTileBytes;
  uint8_t* s_trellis = reinterpret_cast<uint8_t*>(staged) + kStageBytes;
  {
    const uint8_t* src =
        static_cast<const uint8_t*>(trellis) +
        (static_cast<size_t>(k0 / kTile) * (n / kTile) + n0 / kTile) *
            R::kTileBytes;
    const size_t src_row_bytes = static_cast<size_t>(n / kTile) * R::kTileBytes;
    constexpr int kChunksPerRow = kRowBytes / 16;
    for (int c = threadIdx.x; c < kBlockTilesPerSide * kChunksPerRow;
         c += kReconThreads) {
      const int row = c / kChunksPerRow, off = (c % kChunksPerRow) * 16;
      cp_async16(smem_addr(s_trellis + row * kRowBytes + off),
                 src + row * src_row_bytes + off, 16);
    }
    cp_async_commit();
  }
  // H16 constants and lane state are set up while the copy is in flight.
  LaneWindow<K2> lw;
  lw.init(lane);
  const uint32_t halves_xor = halves_xor_register();
  cp_async_wait<0>();
  __syncthreads();

  // Pass 1.
  {
    uint32_t h16[4];
    h16_fragment(g, t, kH16Pass1, h16);
    uint32_t b[kBlockTilesPerSide][4];
#pragma unroll
    for (int q = 0; q < kBlockTilesPerSide; ++q)
      decode_fragments<K2, CB>(s_trellis + q * kRowBytes + warp * R::kTileBytes,
                               lw, halves_xor, b[q]);
    hadamard128_side<true>(b, h16, v);
  }
  // Accumulator (q, h, e) sits at row 16 q + g + 8 (e >> 1), column 16 warp + 8
  // h + 2 t + (e & 1).
#pragma unroll
  for (int q = 0; q < kBlockTilesPerSide; ++q)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const __half2 pair =
            __floats2half2_rn(v[q][h][2 * r], v[q][h][2 * r + 1]);
        *reinterpret_cast<__half2*>(
            &staged[(q * kTile + g + 8 * r) * kStageStride + warp * kTile +
                    8 * h + 2 * t]) = pair;
      }
  __syncthreads();

  // Pass 2.
  {
    uint32_t h16[4];
    h16_fragment(g, t, kH16Pass2, h16);
    const uint32_t s_row =
        smem_addr(staged) +
        ((warp * kTile + (lane & 15)) * kStageStride + (lane >> 4) * 8) * 2;
    uint32_t a[kBlockTilesPerSide][4];
#pragma unroll
    for (int q = 0; q < kBlockTilesPerSide; ++q)
      ldmatrix_x4(a[q], s_row + q * kTile * 2);
    // W^T is staged across every warp's rows (below): all reads first.
    if constexpr (kTransposed) __syncthreads();
    hadamard128_side<false>(a, h16, v);
  }
  // Accumulator (q, h, e) sits at row 16 warp + g + 8 (e >> 1), column 16 q + 8
  // h + 2 t + (e & 1).
  const __half* suh = suh_k + k0;
  const __half* svh = svh_n + n0;
  float rs[2];
#pragma unroll
  for (int r = 0; r < 2; ++r)
    rs[r] = __half2float(suh[warp * kTile + g + 8 * r]);
  // The result is staged in the output's own layout, then the block stores
  // whole 16-byte row segments. W: the warp's own 16 rows of the staging area
  // (no other warp reads them after the ldmatrix above). W^T: staged row c is
  // column c of W, so the pair of values along n goes to two rows as 16-bit
  // halves, which keeps the global stores coalesced (a 16-byte segment gathered
  // down a column of W instead would put each lane of a store on its own row of
  // W^T). In one 16-bit store, lanes t = 0..3 are two staged rows (136 words,
  // 8 banks) apart and lanes g = 0..7 share 4 consecutive words: conflict-free.
  if constexpr (!kTransposed) __syncwarp();
#pragma unroll
  for (int q = 0; q < kBlockTilesPerSide; ++q)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = q * kTile + 8 * h + 2 * t;
      const float2 cs =
          __half22float2(*reinterpret_cast<const __half2*>(svh + c));
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint32_t pair = Fp16Like<T>::pack2(
            v[q][h][2 * r] * rs[r] * cs.x, v[q][h][2 * r + 1] * rs[r] * cs.y);
        if constexpr (kTransposed) {
          uint16_t* s = reinterpret_cast<uint16_t*>(staged) + c * kStageStride +
                        warp * kTile + g + 8 * r;
          s[0] = static_cast<uint16_t>(pair);
          s[kStageStride] = static_cast<uint16_t>(pair >> 16);
        } else {
          *reinterpret_cast<uint32_t*>(
              &staged[(warp * kTile + g + 8 * r) * kStageStride + c]) = pair;
        }
      }
    }
  __syncthreads();
  // Whole 16-byte segments of output rows: 8 values along n (W) or along k
  // (W^T), a warp covering two whole 256-byte rows of the block.
  constexpr int kChunksPerRow = kHadamard * 2 / 16;
  for (int c = threadIdx.x; c < kHadamard * kChunksPerRow; c += kReconThreads) {
    const int row = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
    T* dst = static_cast<T*>(w) +
             (kTransposed ? static_cast<size_t>(n0 + row) * k + k0 + col
                          : static_cast<size_t>(k0 + row) * n + n0 + col);
    *reinterpret_cast<uint4*>(dst) =
        *reinterpret_cast<const uint4*>(&staged[row * kStageStride + col]);
  }
}

template <int K2, int CB, typename T>
__global__ void __launch_bounds__(kReconThreads, kReconOriginalMinBlocks)
    exl3_reconstruct_original_kernel(ReconParams p) {
  extern __shared__ __align__(16) __half staged[];  // [128][kStageStride]
  const int k0 = blockIdx.y * kHadamard, n0 = blockIdx.x * kHadamard;
  const int shard = shard_of_column(p.shards, n0);
  reconstruct_original_block<K2, CB, T, false>(
      p.trellis,
      static_cast<const __half*>(p.suh) + static_cast<size_t>(shard) * p.k,
      static_cast<const __half*>(p.svh), p.w, p.k, p.n, k0, n0, staged);
}

}  // namespace vllm_exl3
