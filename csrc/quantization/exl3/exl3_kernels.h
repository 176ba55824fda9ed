// SPDX-License-Identifier: Apache-2.0
// Host-side view of the EXL3 kernels: launch parameters and the per-bitrate
// launcher table. The kernels of one bitrate (all codebooks and BM tiers) live
// in one translation unit (exl3_rate_k<K2>.cu, written by generate_kernels.py),
// so the instantiations compile in parallel.
#pragma once

#include <cuda.h>  // CUtensorMap (the descriptor type only; encoded through the runtime)
#include <cuda_runtime.h>
#include <cstdint>

namespace vllm_exl3 {

// Every bitrate is identified by K2 = 2 * bits: 2..16 for 1..8 bits, 3/5/7
// for 1.5/2.5/3.5.
constexpr int kMaxK2 = 16;
// BM tiers of the GEMM: rows per block = 16 * m-tiles. Larger tiers decode each
// trellis tile once for more rows; smaller ones waste fewer padded rows and
// give more blocks at small m.
constexpr int kGemmTiers[] = {1, 2, 4, 8};
constexpr int kNumGemmTiers = 4;
// Tiers of the Hopper wgmma engine (sm_90a): tokens per block = 16 * mt = the
// wgmma's N.
constexpr int kWgmmaTiers[] = {4, 8, 16};
// The wgmma tiers from this one on are also built with the stream-k grid (BM
// 128, 256; at BM 64 its segment loop takes the kernel past the 80 registers of
// 3 blocks per SM, and a 64-token tile is small enough for the classic grid's
// k-splits to even out the waves).
constexpr int kStreamKMinTiles = 8;
constexpr int kMaxShardsHost = 8;

// Column-to-shard table of a fused layer: shard s owns columns [end[s-1],
// end[s]).
struct ShardTable {
  int count;
  int end[kMaxShardsHost];
};

// The shard owning column `col` (ends are increasing). Unrolled over the fixed
// table size so the kernel parameters are never indexed dynamically (which
// would copy them to local memory).
__host__ __device__ inline int shard_of_column(const ShardTable& t, int col) {
  int shard = 0;
#ifdef __CUDA_ARCH__
  #pragma unroll
#endif
  for (int s = 0; s + 1 < kMaxShardsHost; ++s)
    if (s + 1 < t.count && col >= t.end[s]) shard = s + 1;
  return shard;
}

struct GemmParams {
  // wgmma engine: xh as an fp16 [S][m][k] tensor for the tensor memory
  // accelerator, one box = one stage's A tile (64 k x BM rows, 128-byte
  // swizzle; rows past m read as zeros). Encoded per call by encode_xh_map;
  // unused by the mma.sync engine. First, for its 64-byte alignment.
  CUtensorMap xh_map;
  const void* xh;       // fp16 [S][m][k]: the transformed input of every shard
  const void* trellis;  // int16 [k/16][n/16][16K]
  const void* svh;      // fp16 [n]
  const void* bias;     // [n] in the output dtype, or null
  void* y;              // [m][n] in the output dtype (written when splits == 1)
  float* ws;  // fp32 [m][n] split-k accumulator, zero on entry (splits > 1)
  int m, k, n;
  int splits;
  int stream_blocks;  // > 0: the stream-k grid over this many blocks (partials
                      // into ws)
  bool out_bf16;
  ShardTable shards;
  // Launch only (the kernel ignores it): cap the resident blocks per SM at the
  // grid's even share through the dynamic shared memory the launch asks for
  // (Plan::spread).
  bool spread;
};

// Host-side launch resources (exl3_ops.cpp).
//
// The most dynamic shared memory one block of a kernel with `static_bytes` of
// static shared memory may ask for on the current device.
int smem_dynamic_ceiling(int static_bytes);
// Dynamic shared memory that lets at most a grid of `grid_blocks` blocks' even
// share of them (rounded up) reside on one SM of the current device: at least
// `need`, at most the ceiling.
int smem_to_spread(int64_t grid_blocks, int need, int static_bytes);
// `map` = the wgmma engine's view of xh (fp16 [shards][m][k],
// GemmParams::xh_map) with boxes of 64 k x `bm` rows. Throws if the driver
// cannot encode it.
void encode_xh_map(CUtensorMap* map, const void* xh, int shards, int m, int k,
                   int bm);

struct ReconParams {
  const void* trellis;  // int16 [k/16][n/16][16K]
  const void* suh;      // fp16 [S][k] (original-basis reconstruct only)
  const void* svh;      // fp16 [n]    (original-basis reconstruct only)
  void* w;  // [k][n]: fp16 Ŵ (rotated) or W in the output dtype (original)
  int k, n;
  bool out_bf16;
  ShardTable shards;
};

struct RateKernels {
  // mt = m16 tiles per block (one of kGemmTiers); grid and shared memory are
  // chosen inside.
  void (*gemm)(int cb, int mt, const GemmParams& p, cudaStream_t stream);
  // Resident blocks per SM of a GEMM instantiation on the current device
  // (cached).
  int (*gemm_blocks_per_sm)(int cb, int mt);
  // The same GEMM on Hopper's wgmma (mt one of kWgmmaTiers); only where
  // wgmma_supported().
  void (*gemm_wgmma)(int cb, int mt, const GemmParams& p, cudaStream_t stream);
  int (*gemm_wgmma_blocks_per_sm)(int cb, int mt);
  // Ŵ, fp16, bit-identical to the reference decode.
  void (*reconstruct_rotated)(int cb, const ReconParams& p,
                              cudaStream_t stream);
  // W = diag(suh) Ĥ Ŵ Ĥ diag(svh) in the output dtype, for the cuBLAS large-m
  // path.
  void (*reconstruct_original)(int cb, const ReconParams& p,
                               cudaStream_t stream);
};

// The launcher table of one bitrate; K2 must be a valid rate (2..16 even, or 3,
// 5, 7).
const RateKernels& rate_kernels(int k2);

// Rate-independent kernels (exl3_transforms.cu).
// xh[s] = fp16(Ĥ(x * suh[s])) per 128-block of k, all shards in one pass over
// x. `release_early`: a kernel launched after it with programmatic
// serialization (the GEMM) may be scheduled as soon as this grid starts, not
// only as its blocks exit.
void launch_input_transform(const void* x, bool x_bf16, const void* suh,
                            void* xh, int m, int k, int shards,
                            bool release_early, cudaStream_t stream);
// y = Ĥ(acc) * svh + bias per 128-block of n from an fp32 [m][n] buffer; `zero`
// re-zeroes it (the split-k workspace).
void launch_splitk_finish(float* acc, const void* svh, const void* bias,
                          void* y, bool out_bf16, int m, int n, bool zero,
                          cudaStream_t stream);

// Launch configuration with programmatic stream serialization (programmatic
// dependent launch): the grid may start before its predecessor in the stream
// finishes, and synchronises itself with griddepcontrol.wait before touching
// the predecessor's output.
inline void programmatic_launch(cudaLaunchConfig_t& cfg,
                                cudaLaunchAttribute (&attr)[1], dim3 grid,
                                dim3 block, size_t smem, cudaStream_t stream) {
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
}
// y[r][c] = bias[c]: the C operand of the cuBLAS path (beta = 1 folds the bias
// in).
void launch_bias_broadcast(const void* bias, void* y, bool bf16, int m, int n,
                           cudaStream_t stream);
// Sleep on the device so the plan timer's launches queue up behind it (no
// launch gaps).
void launch_device_sleep(int microseconds, cudaStream_t stream);
// Whether this build carries the wgmma engine for `device` (an sm_90a image on
// a 9.0 device), asked of the image the device loaded. `device` must be the
// current device. No launch and no allocation, so it may be asked during
// CUDA-graph capture.
bool wgmma_supported(int device);

}  // namespace vllm_exl3
