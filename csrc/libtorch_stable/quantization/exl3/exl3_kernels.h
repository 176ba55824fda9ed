// SPDX-License-Identifier: Apache-2.0
// Host-side view of the EXL3 kernels: launch parameters, the per-bitrate
// launcher table, and the plans (how one exl3_linear call runs, below). The
// kernels of one bitrate (all codebooks and BM tiers) live in one translation
// unit (exl3_rate_k<K2>.cu, written by generate_kernels.py), so the
// instantiations compile in parallel.
#pragma once

#include <cuda.h>  // CUtensorMap (the descriptor type only; encoded through the runtime)
#include <cuda_runtime.h>
#include <cstdint>
#include <functional>
#include <vector>

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

// The plans.
//
// How one exl3_linear call runs: the fused trellis GEMM with a BM tier and a
// split-k factor, or reconstruct + cuBLAS. The caller passes a plan table
// (built in Python at load time, from the checked-in per-device tables or the
// opt-in tuner); the op picks the entry of its own m bucket at run time, so one
// CUDA graph or compiled graph serves every m with that m's plan. A bucket
// without an entry goes to the cost model (exl3_plan.cpp): deterministic, no
// timing, no environment.
enum class Path {
  kFused = 0,  // input transform + trellis GEMM with fused epilogue (+ split-k
               // finish)
  kReconOriginal = 1,  // W = diag(suh) Ĥ Ŵ Ĥ diag(svh) in x's dtype, one cuBLAS
                       // GEMM on raw x
  kReconRotated = 2,   // input transform, Ŵ (fp16), cuBLAS into fp32,
                       // output-side finish kernel
};

constexpr int kRowsPerTier = 16;  // BM = 16 * mt

// The plan table's layout (ops.py documents it; the Python side mirrors these
// numbers).
constexpr int64_t kPlanVersion = 1;
constexpr int kPlanHeaderLen = 10;
constexpr int kPlanFields = 8;
constexpr int64_t kFlagDeterministic = 1;
constexpr int64_t kFlagBatchInvariant = 2;
constexpr int64_t kKnownFlags = kFlagDeterministic | kFlagBatchInvariant;
enum PlanSource : int64_t { kSourceTable = 0, kSourceCostModel = 1 };

struct Plan {
  Path path = Path::kFused;
  int mt = 1;          // fused: m16 tiles per block (BM = 16 * mt)
  int splits = 1;      // fused: k-splits (1 = full k, epilogue in the GEMM)
  bool wgmma = false;  // fused: Hopper's wgmma engine (mt one of kWgmmaTiers)
  // fused, wgmma only: > 0 = the stream-k grid over this many resident blocks
  // (splits unused; partial sums through the split-k workspace and finish
  // kernel, as with splits > 1)
  int stream_blocks = 0;
  // fused: the input transform releases the GEMM at its start, so the GEMM's
  // blocks prefetch their trellis while it runs. They are then placed beside
  // the transform's resident blocks, which can stack one SM with a block more
  // than the grid's even share (costly where the transform has many blocks, a
  // gain where it has a few). false: released as the transform's blocks exit.
  bool early_release = true;
  // fused: cap the GEMM's resident blocks per SM at its grid's even share
  // (through the dynamic shared memory it asks for), so that blocks cannot
  // stack three on one SM where the even share is two.
  bool spread = false;
  bool uses_workspace() const {
    return path == Path::kFused && (splits > 1 || stream_blocks > 0);
  }
};

// The header of a plan table: the mode flags and VLLM_EXL3_PLAN's pins for the
// cost model.
struct Policy {
  bool deterministic =
      false;  // no split-k / stream-k (their sums run in varying order)
  bool batch_invariant =
      false;       // one reduction order for every m (vLLM's batch invariance)
  int basis = -1;  // -1 free, else the pinned reconstruct Path
  int mt = 0;      // 0 = free
  int splits = 0;  // 0 = free
  int wgmma = -1;  // -1 = free, 0 = never, 1 = the fused path always uses it
  int stream_k = -1;
  int spread = -1;
  int64_t reconstruct_m =
      -1;  // -1 = the model's threshold, 0 = never, r > 0 = buckets >= r
  double traffic = 0.25;  // split-k traffic cap relative to the weight bytes
};

struct PlanTable {
  Policy policy;
  std::vector<int64_t> m_max;  // ascending
  std::vector<Plan> entries;
};

struct Problem {
  int device;
  int m, k, n;  // m: the bucket's rows when planning
  int k2;       // 2 * bits
  int cb;       // codebook id
  int shards;
  bool bf16;  // activation / output dtype
};

// The token-count bucket of m rows: m rounded up to a power of two.
int m_bucket(int m);

// Parses and checks a plan table's structure (header, flags, entry order);
// throws a std::runtime_error naming the rule broken.
PlanTable parse_plan_table(const std::vector<int64_t>& plans, const char* op);

// The plan for `pr` (pr.m = the call's rows), validated against the device and
// the problem: the entry of m's bucket, else the cost model at the bucket. A
// plan whose partial sums need more than `workspace_floats` runs with split 1
// and no stream-k. `source` gets the PlanSource.
Plan resolve_plan(const Problem& pr, const PlanTable& table,
                  int64_t workspace_floats, const char* op,
                  PlanSource* source = nullptr);

// The entry ints of `plan` for bucket m_max (the layout of one table entry).
std::vector<int64_t> plan_entry(int64_t m_max, const Plan& plan);

// Every candidate worth timing for pr (pr.m = the bucket) under the table's
// policy.
std::vector<Plan> plan_candidates(const Problem& pr, const Policy& policy);

// Runs `plan` once on the call's real buffers (enqueue only).
using PlanRunner = std::function<void(const Plan&)>;

// Mean time of `plan` in ns on `stream` (which must not be capturing): warm-up,
// then repeated runs queued behind a device sleep.
int64_t time_plan(const Plan& plan, cudaStream_t stream, const PlanRunner& run);

}  // namespace vllm_exl3
