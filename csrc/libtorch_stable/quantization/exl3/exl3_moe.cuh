// SPDX-License-Identifier: Apache-2.0
// The grouped trellis GEMM of an MoE layer: the dense GEMM's block
// (exl3_gemm.cuh: decode, pipeline, mma.sync) run once per (row block, 128
// columns) of vLLM's expert alignment, on the trellis, svh and bitrate of that
// block's expert, with an epilogue that writes routed rows.
//
// Each row block of BM slots belongs to one expert (exl3_moe.h), so a block is
// one dense tile: its A rows are the block's slots of the routed-order
// activations, its weights one expert's. Blocks past the live slot count, of
// experts not on this rank, or of another bitrate than the launch's K2 return
// before touching memory.
#pragma once

#include "exl3_moe.h"
#include "exl3_rate_instance.cuh"

namespace vllm_exl3 {

// The stored rows of one block's tile, as store_tile does it for dense layers:
// warp w takes rows w, w + kGemmWarps, ... in groups of Shape::kEpiRows, lane l
// columns 4l..4l+3 of the block. Row transform: Ĥ, then * scale * svh (* the
// row's factor), then the stage's own store.
template <typename Shape, typename Row>
__device__ __forceinline__ void moe_store_rows(const float* s_c, int rows,
                                               const __half* svh, Row&& row) {
  constexpr int G = Shape::kEpiRows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float sv[4];
  load4_f32(svh + 4 * lane, sv);
#pragma unroll
  for (int j = 0; j < 4; ++j) sv[j] *= kHadamardScale;
  for (int r0 = warp; r0 < rows; r0 += G * kGemmWarps) {
    float v[G][4];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float4 c4 = *reinterpret_cast<const float4*>(
          s_c + (r0 + g * kGemmWarps) * Shape::kCStride + 4 * lane);
      v[g][0] = c4.x;
      v[g][1] = c4.y;
      v[g][2] = c4.z;
      v[g][3] = c4.w;
    }
    hadamard128(v, lane);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const int r = r0 + g * kGemmWarps;
#pragma unroll
      for (int j = 0; j < 4; ++j) v[g][j] *= sv[j];
      if (r < rows) row(r, v[g], lane);
    }
  }
}

// Four values rounded to the output dtype (decided per launch; one k loop
// serves both).
__device__ __forceinline__ uint2 pack4_out(const float (&v)[4], bool bf16) {
  return bf16 ? pack4<__nv_bfloat16>(v) : pack4<__half>(v);
}

// Where a block of the grid works: its row block's first slot and expert, and
// its 128 columns as (role, first column within the role). Recomputed by the
// epilogues from the kernel parameters rather than carried in registers through
// the k loop.
struct MoeBlock {
  int row0, expert, role, n0;
};
template <int BM>
__device__ __forceinline__ MoeBlock moe_block(const MoeGemmParams& mp) {
  MoeBlock b;
  b.row0 = blockIdx.x * BM;
  b.expert = mp.expert_ids[blockIdx.x];
  const int col = blockIdx.y * kBlockN;
  b.role = col / mp.n;
  b.n0 = col - b.role * mp.n;
  return b;
}
__device__ __forceinline__ const __half* moe_svh(const MoeGemmParams& mp,
                                                 const MoeBlock& b) {
  return static_cast<const __half*>(mp.svh) +
         (static_cast<size_t>(b.expert) * mp.roles + b.role) * mp.n + b.n0;
}

// A split's partial row of `pair` (exl3_moe.h: partial[z][role][pair][n]), at
// the lane's four columns.
__device__ __forceinline__ void moe_store_partial(const MoeGemmParams& mp,
                                                  int role, int pair, int col,
                                                  const float (&v)[4]) {
  float* dst =
      mp.partial +
      ((static_cast<size_t>(blockIdx.z) * mp.roles + role) * mp.pairs + pair) *
          mp.n +
      col;
  *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
}

// Gate/up: the block's rows go to y13[role][slot], in the activation dtype, or
// (split-k) the live pairs' rows to the split's fp32 partial sums.
template <int BM>
struct MoeGateUpEpilogue {
  const MoeGemmParams& mp;
  template <typename Shape>
  __device__ __forceinline__ void store(const float* s_c, int rows) const {
    const MoeBlock b = moe_block<BM>(mp);
    if (BM <= kMoeSplitMaxTier * kTile && mp.partial != nullptr) {
      const int32_t* ids = mp.sorted_ids + b.row0;
      const int live = min(rows, mp.sorted_len - b.row0);
      moe_store_rows<Shape>(
          s_c, live, moe_svh(mp, b), [&](int r, float (&v)[4], int lane) {
            const int pair = ids[r];
            if (pair >= 0 && pair < mp.pairs)
              moe_store_partial(mp, b.role, pair, b.n0 + 4 * lane, v);
          });
      return;
    }
    uint16_t* y = static_cast<uint16_t*>(mp.out) +
                  (static_cast<size_t>(b.role) * mp.slots + b.row0) * mp.n +
                  b.n0;
    moe_store_rows<Shape>(
        s_c, rows, moe_svh(mp, b), [&](int r, float (&v)[4], int lane) {
          *reinterpret_cast<uint2*>(y + static_cast<size_t>(r) * mp.n +
                                    4 * lane) = pack4_out(v, mp.out_bf16);
        });
  }
};

// Down: row r is slot row0 + r, i.e. pair sorted_ids[slot] (padding: nothing),
// scaled by its routing weight, then either written as the pair's row
// (deterministic combine afterwards), or as the split's fp32 partial row
// (split-k: the combine sums the splits), or added into its token's fp32 sum.
template <int BM>
struct MoeDownEpilogue {
  const MoeGemmParams& mp;
  template <typename Shape>
  __device__ __forceinline__ void store(const float* s_c, int rows) const {
    const MoeGemmParams& p = mp;
    const MoeBlock b = moe_block<BM>(mp);
    const int32_t* ids = p.sorted_ids + b.row0;
    const int live = min(rows, p.sorted_len - b.row0);
    moe_store_rows<Shape>(
        s_c, live, moe_svh(mp, b), [&](int r, float (&v)[4], int lane) {
          const int pair = ids[r];
          if (pair < 0 || pair >= p.pairs) return;
          if (p.topk_weights != nullptr) {
            const float w = p.topk_weights[pair];
#pragma unroll
            for (int j = 0; j < 4; ++j) v[j] *= w;
          }
          const int col = b.n0 + 4 * lane;
          if (BM <= kMoeSplitMaxTier * kTile && p.partial != nullptr) {
            moe_store_partial(p, 0, pair, col, v);
          } else if (p.accumulate) {
            float* dst = static_cast<float*>(p.out) +
                         static_cast<size_t>(pair / p.topk) * p.n + col;
            red_add_f32x4(dst, v[0], v[1], v[2], v[3]);
          } else {
            *reinterpret_cast<uint2*>(static_cast<uint16_t*>(p.out) +
                                      static_cast<size_t>(pair) * p.n + col) =
                pack4_out(v, p.out_bf16);
          }
        });
  }
};

// Resident blocks the register cap aims for: the dense tiers'
// (GemmShape::kMinBlocks), except that from 64 rows the routed epilogue's extra
// state did not fit the dense 64-row tier's 80 registers (ptxas spilled up to
// 64 bytes at 3.5 bits), so those tiers get 128. The wgmma engine keeps the
// dense engine's caps: its accumulators are dead (staged) by the epilogue.
template <int K2, int MT, bool WG>
constexpr int kMoeMinBlocks = WG        ? GemmShape<K2, MT, true>::kMinBlocks
                              : MT >= 4 ? 2
                                        : GemmShape<K2, MT, false>::kMinBlocks;

// One block of the grouped GEMM on the math engine WG (exl3_gemm.cuh).
template <int K2, int CB, int MT, MoeStage STAGE, bool WG>
__device__ __forceinline__ void moe_gemm_block(const MoeGemmParams& mp) {
  constexpr int BM = MT * kTile;
  // The pairs layout's arrays are the input transform's output: wait for it.
  if (mp.wait_for_routing) grid_dependency_wait();
  const MoeBlock b = moe_block<BM>(mp);
  // Otherwise written by moe_align_block_size, which completed before the input
  // transform started; this grid overlaps only the transform (programmatic
  // launch), so these reads need no wait. A programmatically launched grid
  // whose blocks all return at once (a bitrate no routed expert has) could end
  // before its predecessor, and the kernels after it rely on stream order
  // through it: the grid's first block waits for the predecessor whatever it
  // has to do (a working block waits in the k loop's prologue). Every other
  // block with nothing to do returns at once: waiting, it would hold a block
  // slot and its shared memory that working blocks could use to start their
  // prologue.
  const bool idle = b.row0 >= min(*mp.num_post_pad, mp.sorted_len) ||
                    b.expert < 0 || b.expert >= mp.experts;
  const int64_t* meta =
      mp.meta +
      2 * (static_cast<int64_t>(idle ? 0 : b.expert) * mp.roles + b.role);
  if (idle || meta[1] != K2) {
    if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0)
      grid_dependency_wait();
    return;
  }
  const int64_t offset = meta[0];
  const int64_t size = static_cast<int64_t>(mp.k / kTile) * (mp.n / kTile) *
                       Rate<K2>::kTileBytes / 2;
  // The host checked the table when the layer was set up; a table changed since
  // would read another expert's or stray memory: stop loudly instead.
  if (offset < 0 || offset % 8 != 0 || offset + size > mp.trellis_numel)
    __trap();
  if constexpr (WG) init_a_barriers<GemmShape<K2, MT, true>>();

  // The tile's A rows: the role's slots row0 onwards, row role * slots + row0
  // of xh viewed as one [roles * slots][k] matrix. mma.sync copies them from
  // the block's own BM-row slab; wgmma's TMA reads them through mp.xh_map, a
  // map of that whole matrix.
  GemmParams p{};
  p.xh = static_cast<const __half*>(mp.xh) +
         (WG ? 0 : (static_cast<size_t>(b.role) * mp.slots + b.row0) * mp.k);
  p.trellis = static_cast<const int16_t*>(mp.trellis) + offset;
  p.m = WG ? mp.roles * mp.slots : BM;
  p.k = mp.k;
  p.n = mp.n;
  p.splits = 1;
  p.shards.count = 1;
  p.shards.end[0] = mp.n;
  const int m0 = WG ? b.role * mp.slots + b.row0 : 0;
  uint32_t a_phase = 0;
  // This block's k-split: 64-deep stages [c_begin, c_end), the dense classic
  // grid's share-out (splits never exceed the stages: the host checks it).
  const int chunks = mp.k / kStageK;
  constexpr bool kSplit = MT <= kMoeSplitMaxTier;
  const int z = kSplit ? static_cast<int>(blockIdx.z) : 0;
  const int c_begin = kSplit ? z * chunks / mp.splits : 0;
  const int c_end = kSplit ? (z + 1) * chunks / mp.splits : chunks;
  if constexpr (STAGE == MoeStage::kGateUp)
    gemm_segment<K2, CB, MT, WG>(p, m0, b.n0, c_begin, c_end, false, a_phase,
                                 MoeGateUpEpilogue<BM>{mp}, &mp.xh_map);
  else
    gemm_segment<K2, CB, MT, WG>(p, m0, b.n0, c_begin, c_end, false, a_phase,
                                 MoeDownEpilogue<BM>{mp}, &mp.xh_map);
}

// grid (row blocks, roles * n / 128, k-splits). Launched once per distinct
// bitrate of the layer.
template <int K2, int CB, int MT, MoeStage STAGE>
__global__ void __launch_bounds__(kGemmThreads, kMoeMinBlocks<K2, MT, false>)
    exl3_moe_gemm_kernel(const __grid_constant__ MoeGemmParams mp) {
  moe_gemm_block<K2, CB, MT, STAGE, false>(mp);
}

// The same grid on Hopper's wgmma (unsplit tiers of kMoeWgmmaTiers): a kernel
// of its own name, so that profiles tell the engines apart.
template <int K2, int CB, int MT, MoeStage STAGE>
__global__ void __launch_bounds__(kGemmThreads, kMoeMinBlocks<K2, MT, true>)
    exl3_moe_wgmma_kernel(const __grid_constant__ MoeGemmParams mp) {
#if EXL3_WGMMA
  moe_gemm_block<K2, CB, MT, STAGE, true>(mp);
#else
  __trap();  // never launched: the host selects this engine only where it was
             // compiled
#endif
}

template <int K2, int CB, int MT, MoeStage STAGE, bool WG>
void moe_gemm_launch_tier(const MoeGemmParams& p, cudaStream_t stream) {
  using Shape = GemmShape<K2, MT, WG>;
  void (*kernel)(MoeGemmParams) = nullptr;
  if constexpr (WG)
    kernel = exl3_moe_wgmma_kernel<K2, CB, MT, STAGE>;
  else
    kernel = exl3_moe_gemm_kernel<K2, CB, MT, STAGE>;
  static unsigned smem_done = 0;
  allow_smem(kernel, Shape::kSmemBytes, smem_done);
  const dim3 grid(p.slots / Shape::kBM, p.roles * p.n / kBlockN, p.splits);
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute attr[1];
  programmatic_launch(cfg, attr, grid, dim3(kGemmThreads), Shape::kSmemBytes,
                      stream);
  cudaLaunchKernelEx(&cfg, kernel, p);
}

template <int K2, int CB, int MT, bool WG>
void moe_gemm_launch_stage(MoeStage stage, const MoeGemmParams& p,
                           cudaStream_t stream) {
  if (stage == MoeStage::kGateUp)
    moe_gemm_launch_tier<K2, CB, MT, MoeStage::kGateUp, WG>(p, stream);
  else
    moe_gemm_launch_tier<K2, CB, MT, MoeStage::kDown, WG>(p, stream);
}

template <int K2>
void moe_gemm_launch(MoeStage stage, int cb, int mt, bool wgmma,
                     const MoeGemmParams& p, cudaStream_t stream) {
  with_codebook<K2>(cb, [&](auto c) {
    constexpr int CB = decltype(c)::value;
    if (wgmma) {
      // The host allows only kMoeWgmmaTiers here.
      static_assert(kMoeWgmmaTiers[0] == 4 && kMoeWgmmaTiers[1] == 8,
                    "the wgmma dispatch below lists kMoeWgmmaTiers");
      if (mt == 4)
        moe_gemm_launch_stage<K2, CB, 4, true>(stage, p, stream);
      else
        moe_gemm_launch_stage<K2, CB, 8, true>(stage, p, stream);
      return;
    }
    with_tier<false>(mt, [&](auto t) {
      moe_gemm_launch_stage<K2, CB, decltype(t)::value, false>(stage, p,
                                                               stream);
    });
  });
}

// One 128 x 128 block of one (expert, role) weight per CUDA block; grid z =
// expert * roles + role. Blocks of another bitrate return at once.
template <int K2, int CB, typename T>
__global__ void __launch_bounds__(kReconThreads, kReconOriginalMinBlocks)
    exl3_moe_reconstruct_kernel(MoeReconParams p) {
  extern __shared__ __align__(16) __half staged[];  // [128][kStageStride]
  const int z = blockIdx.z;
  const int64_t* meta = p.meta + 2 * static_cast<int64_t>(z);
  if (meta[1] != K2) return;
  const int64_t offset = meta[0];
  const int64_t size = static_cast<int64_t>(p.k / kTile) * (p.n / kTile) *
                       Rate<K2>::kTileBytes / 2;
  // As in the GEMM: a table changed since the host checked it stops loudly.
  if (offset < 0 || offset % 8 != 0 || offset + size > p.trellis_numel)
    __trap();
  reconstruct_original_block<K2, CB, T, true>(
      static_cast<const int16_t*>(p.trellis) + offset,
      static_cast<const __half*>(p.suh) + static_cast<size_t>(z) * p.k,
      static_cast<const __half*>(p.svh) + static_cast<size_t>(z) * p.n,
      static_cast<T*>(p.w) + static_cast<size_t>(z) * p.n * p.k, p.k, p.n,
      blockIdx.y * kHadamard, blockIdx.x * kHadamard, staged);
}

template <int K2>
void moe_reconstruct_launch(int cb, const MoeReconParams& p,
                            cudaStream_t stream) {
  with_codebook<K2>(cb, [&](auto c) {
    constexpr int CB = decltype(c)::value;
    const dim3 grid(p.n / kHadamard, p.k / kHadamard, p.experts * p.roles);
    constexpr int kSmem = recon_original_smem<K2>();
    auto go = [&](auto kernel, unsigned& done) {
      allow_smem(kernel, kSmem, done);
      kernel<<<grid, kReconThreads, kSmem, stream>>>(p);
    };
    static unsigned done_bf16 = 0, done_fp16 = 0;
    if (p.out_bf16)
      go(exl3_moe_reconstruct_kernel<K2, CB, __nv_bfloat16>, done_bf16);
    else
      go(exl3_moe_reconstruct_kernel<K2, CB, __half>, done_fp16);
  });
}

template <int K2>
const MoeRateKernels& make_moe_rate_kernels() {
  static const MoeRateKernels k{&moe_gemm_launch<K2>,
                                &moe_reconstruct_launch<K2>};
  return k;
}

}  // namespace vllm_exl3

#define EXL3_DEFINE_MOE_RATE(K2)                   \
  namespace vllm_exl3 {                            \
  const MoeRateKernels& moe_rate_kernels_k##K2() { \
    return make_moe_rate_kernels<K2>();            \
  }                                                \
  }
