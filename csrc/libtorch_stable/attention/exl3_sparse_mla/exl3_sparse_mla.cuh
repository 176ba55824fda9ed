// SPDX-License-Identifier: Apache-2.0
// Sparse MLA decode: for each query token, softmax(scale * q . K^T) . V over
// the top-k KV rows its indexer selected, all heads sharing the rows (MQA).
//
// One CTA serves (token, 16 or 32 heads, one split of the top-k list). It
// gathers 32 selected rows per stage with cp.async into a ring of stages
// (two within sm_12x's 99 KB; more on Hopper for the two-tile variant, whose
// one CTA per SM leaves the shared memory for it), so each row is read from
// HBM once per head group; the head groups of a token are adjacent in the
// grid and run together, so with more heads than one CTA holds the repeated
// reads are served by L2. Tensor cores through mma.sync
// m16n8k16 bf16 (fp32 accumulation): the one MMA that exists on sm_90, sm_120
// and sm_121. A CTA has four warps per 16-head MMA tile (kMTiles of them).
//   S = Q K^T: warp (mt, wn, wd) multiplies the D-half wd of rows
//     [16 wn, 16 wn + 16) for head tile mt, its Q fragments held in registers
//     for the whole split; the two D-halves meet in shared memory.
//   softmax: 8 threads per head, online in fp32 with log2(e) folded into the
//     scale; P goes to shared memory as bf16.
//   O += P V: warp w owns output dims [512 w / warps, 512 (w + 1) / warps) of
//     every head (64 fp32 accumulators per thread); each V fragment serves
//     all head tiles.
// Hopper (sm_90a) with 64 heads or more takes the warpgroup-MMA path instead:
// one CTA per (token, 64 heads, split), two warpgroups, 64 KV rows per stage
// gathered by cp.async straight into the 128-byte-swizzled layout wgmma's
// shared-memory descriptors read (fp8_ds_mla: raw rows, dequantized by the
// CTA into that layout).
//   S = Q K^T (64 heads x 64 rows, K = 576 or 512): warpgroup 0 alone, wgmma
//     m64n64k16 from the Q and K descriptors; online softmax in its
//     registers, P (bf16) and the rescale factors to shared memory.
//   O += P V: warpgroup g owns output dims [256 g, 256 g + 256) of every head
//     (128 fp32 accumulators a thread), wgmma m64n256k16 with P K-major and V
//     MN-major from the same gathered rows.
// Split-k: with fewer CTAs than SMs, the top-k list is cut into splits whose
// normalized partials (and log2 sum-exp) go to the workspace and a combine
// kernel merges them; the split count depends only on (T, H, topk, SMs).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../../exl3_mma.cuh"

namespace vllm_exl3::sparse_mla {

// One mma.sync m16 tile of heads.
constexpr int kHeadsPerMma = 16;
// From this many heads on a CTA takes two head tiles: a KV row then travels
// from L2 to shared memory once per 32 heads instead of 16 (the L2 traffic of
// 64 and 128 heads), at one CTA per SM (registers) instead of two. Below it,
// two CTAs per SM keep twice the bytes in flight for the memory-bound case.
constexpr int kTwoTileMinHeads = 64;
// KV rows per pipeline stage: two warps x 16 rows in S = Q K^T.
constexpr int kRowsPerTile = 32;
// Pipeline depth: two stages (one tile in flight while one is consumed) fit
// every arch's block limit. The two-tile variant runs one CTA per SM (its
// registers), so on Hopper the rest of the SM's shared memory is idle; there
// it keeps kDeepStages* - 1 tiles in flight instead of one, which hides the
// latency of a random gather behind the compute of several tiles. fp8 rows
// are 656 bytes instead of 1152, so more of them fit the same budget. (Where
// the wgmma path runs, Hopper launches the two-tile variant no more: the deep
// ring serves an image without sm_90a code.)
constexpr int kPortableStages = 2;
constexpr int kDeepStagesBf16 = 4;
constexpr int kDeepStagesFp8 = 7;
// The latent (= V) width and the rope width of a 576-wide row.
constexpr int kLatent = 512;
constexpr int kRope = 64;
// fp8_ds_mla row: 512 e4m3, 4 fp32 scales (one per 128 values), 64 bf16 rope.
constexpr int kFp8ScaleGroup = 128;
constexpr int kFp8ScaleOffset = kLatent;
constexpr int kFp8RopeOffset = kFp8ScaleOffset + 4 * (kLatent / kFp8ScaleGroup);
constexpr int kFp8RowBytes = kFp8RopeOffset + 2 * kRope;
static_assert(kFp8RowBytes == 656, "vLLM's fp8_ds_mla row is 656 bytes");
// Split-k: fill the CTA slots of the SMs once (the CTAs of one head-tile
// variant resident on a Hopper SM: one tile, ~210 registers x 128 threads and
// 80 KB, fits twice; two tiles, 256 threads, once), never more: a second,
// partial wave would cost a whole split's time. Never cut a split shorter
// than kMinTilesPerSplit stages (the combine must stay cheap), and bound the
// workspace with kMaxSplits.
constexpr int kSplitCtasPerSmOneTile = 2;
constexpr int kSplitCtasPerSmTwoTiles = 1;
constexpr int kMinTilesPerSplit = 2;
constexpr int kMaxSplits = 64;

// The wgmma path: wgmma's M is 64, so one CTA serves 64 heads; a stage holds
// 64 KV rows (S's N, and four k16 steps of O += P V); two warpgroups split
// the 512 output dims so that each holds 128 accumulators a thread.
constexpr int kWgHeads = 64;
constexpr int kWgRows = 64;
constexpr int kWgGroups = 2;
constexpr int kWgThreads = kWgGroups * kWarpgroupThreads;
constexpr int kWgDims = kLatent / kWgGroups;
// bf16 rows land in the stage wgmma reads: one stage gathered while one is
// consumed (two 72 KB stages and the 72 KB Q fill Hopper's 227 KB). fp8 rows
// land raw in one ring slot and are dequantized into a single bf16 stage at
// the top of their tile, freeing the slot for the next gather.
constexpr int kWgStagesBf16 = 2;
// One 128-byte swizzled row holds 64 bf16; eight rows make the atom the
// swizzle repeats with (kSwizzleAtomBytes).
constexpr int kSwizzleCols = 64;

// Head tiles per CTA for a head count (1 or 2).
inline int head_tiles(int64_t heads) {
  return heads >= kTwoTileMinHeads ? 2 : 1;
}
// CTAs per token and split of the mma.sync path.
inline int64_t head_groups(int64_t heads) {
  const int64_t per = kHeadsPerMma * head_tiles(heads);
  return (heads + per - 1) / per;
}
// CTAs per token and split of the wgmma path.
inline int64_t wg_head_groups(int64_t heads) {
  return (heads + kWgHeads - 1) / kWgHeads;
}
// The split rule's unit of work per token: a one-tile CTA (two per SM), or
// from kTwoTileMinHeads heads on, 64 heads at one per SM: one CTA of the wgmma
// path; two of the two-tile mma.sync path (sm_12x), which then runs two waves
// of splits half as long. One rule for both keeps the split count a function
// of the shape and the SM count only.
inline int64_t split_units(int64_t heads) {
  return head_tiles(heads) == 2 ? wg_head_groups(heads) : head_groups(heads);
}

// Split count of a problem: a pure function of its shape and the SM count, so
// a captured CUDA graph replays the same launch. The Python wrapper mirrors it.
inline int num_splits(int64_t tokens, int64_t heads, int64_t topk,
                      int64_t sms) {
  const int64_t tiles = (topk + kRowsPerTile - 1) / kRowsPerTile;
  const int64_t base = tokens * split_units(heads);
  const int64_t slots = sms * (head_tiles(heads) == 2 ? kSplitCtasPerSmTwoTiles
                                                      : kSplitCtasPerSmOneTile);
  if (base <= 0) return 1;
  int64_t s = slots / base;
  const int64_t by_len = tiles / kMinTilesPerSplit;
  s = s < by_len ? s : by_len;
  s = s < kMaxSplits ? s : kMaxSplits;
  if (s <= 1) return 1;
  const int64_t per = (tiles + s - 1) / s;
  return static_cast<int>((tiles + per - 1) / per);
}

inline int tiles_per_split(int64_t topk, int splits) {
  const int64_t tiles = (topk + kRowsPerTile - 1) / kRowsPerTile;
  return static_cast<int>((tiles + splits - 1) / splits);
}

// Workspace: fp32 partial outputs [splits, T, H, 512] then log2 sum-exps
// [splits, T, H]; nothing without split-k.
inline int64_t workspace_bytes(int64_t tokens, int64_t heads, int64_t topk,
                               int64_t sms) {
  const int s = num_splits(tokens, heads, topk, sms);
  if (s <= 1) return 0;
  return int64_t{4} * s * tokens * heads * (kLatent + 1);
}

struct Params {
  const void* q;                          // bf16 [T, H, D], last dim contiguous
  int64_t q_token_stride, q_head_stride;  // elements
  const uint8_t* kv;                      // cache base
  int64_t block_stride, row_stride;       // bytes
  int64_t num_slots;                      // num_blocks * block_size
  int block_size;
  const int32_t* indices;  // [T, topk], last dim contiguous
  int64_t indices_stride;
  int topk;
  float scale_log2;  // softmax scale * log2(e)
  void* out;         // bf16 [T, H, 512], contiguous
  float* lse;        // fp32 [T, H], contiguous
  float* part_out;   // workspace (split-k only)
  float* part_lse;
  int num_tokens, num_heads, head_groups, num_splits, tiles_per_split;
};

// Shared-memory layout of one CTA; every region is 16-byte aligned. The row
// masks and stages 0 .. kStages - 2 (the prologue fills them) come first; Q
// shares its bytes with what follows (the last stage, the dequantized tile,
// scores, P), all first written after every warp has moved its Q fragments
// to registers (the loop's first barrier).
template <int kD, bool kFp8, int kMTiles, int kStages>
struct SmemLayout {
  static_assert(kStages >= 2, "a stage in flight while one is consumed");
  // 16 bytes of padding per row: a row stride of 16 mod 128 bytes makes the
  // eight row addresses of an ldmatrix hit distinct banks.
  static constexpr int kPad = 8;
  static constexpr int kHeads = kHeadsPerMma * kMTiles;
  static constexpr int kQStride = kD + kPad;  // elements
  // bf16 rows of the K/V tile (fp8: the dequantized latent only; the rope is
  // bf16 already and read from the raw rows, whose 656-byte stride is also
  // 16 mod 128).
  static constexpr int kKvStride = (kFp8 ? kLatent : kD) + kPad;
  static constexpr int kPStride = kRowsPerTile + kPad;
  static constexpr int kQBytes = kHeads * kQStride * 2;
  static constexpr int kTileBytes = kRowsPerTile * kKvStride * 2;
  // One stage of gathered rows: bf16 rows, or raw fp8_ds_mla rows.
  static constexpr int kStageBytes =
      kFp8 ? kRowsPerTile * kFp8RowBytes : kTileBytes;
  static constexpr int kValid = 0;  // int [stages][32]
  static constexpr int kStage0 = kValid + kStages * kRowsPerTile * 4;
  static constexpr int kQ = kStage0 + (kStages - 1) * kStageBytes;
  static constexpr int kDeq = kStage0 + kStages * kStageBytes;  // fp8 only
  static constexpr int kS = kDeq + (kFp8 ? kTileBytes : 0);  // fp32 [2][H][32]
  static constexpr int kP = kS + 2 * kHeads * kRowsPerTile * 4;
  static constexpr int kAlpha = kP + kHeads * kPStride * 2;
  static constexpr int kM = kAlpha + kHeads * 4;
  static constexpr int kL = kM + kHeads * 4;
  static constexpr int kEnd = kL + kHeads * 4;
  static constexpr int kBytes = kQ + kQBytes > kEnd ? kQ + kQBytes : kEnd;
  static_assert(kStageBytes % 16 == 0 && kStage0 % 16 == 0, "16-byte copies");
};

// sm_120 / sm_121 give a block at most 99 KB of shared memory: the portable
// depth serves every arch. Hopper gives 227 KB: the deep layouts are launched
// only where the device's opt-in limit holds them.
constexpr int kSmemLimitSm12x = 99 * 1024;
constexpr int kSmemLimitSm90 = 227 * 1024;
static_assert(SmemLayout<576, false, 2, kPortableStages>::kBytes <=
                  kSmemLimitSm12x,
              "bf16");
static_assert(SmemLayout<576, true, 2, kPortableStages>::kBytes <=
                  kSmemLimitSm12x,
              "fp8");
static_assert(SmemLayout<576, false, 2, kDeepStagesBf16>::kBytes <=
                  kSmemLimitSm90,
              "deep bf16");
static_assert(SmemLayout<576, true, 2, kDeepStagesFp8>::kBytes <=
                  kSmemLimitSm90,
              "deep fp8");

// Shared memory of the wgmma path. Every operand region is a whole number of
// 1024-byte swizzle atoms from a 1024-byte aligned base (the swizzle is
// decoded from absolute address bits): a 64-row operand of kD columns is kD /
// 64 blocks of 64 rows x 128 bytes, block c holding columns [64 c, 64 c + 64).
template <int kD, bool kFp8>
struct WgLayout {
  static constexpr int kBlockBytes = kWgRows * 128;  // 64 rows x 64 bf16
  static_assert(kWgHeads == kWgRows, "Q, K and P blocks share one shape");
  static constexpr int kColBlocks = kD / kSwizzleCols;
  static constexpr int kTileBytes = kColBlocks * kBlockBytes;
  static constexpr int kStages = kFp8 ? 1 : kWgStagesBf16;  // bf16 stages
  static constexpr int kRawBytes = kFp8 ? kWgRows * kFp8RowBytes : 0;
  static constexpr int kQ = 0;
  static constexpr int kKv = kQ + kTileBytes;
  static constexpr int kP = kKv + kStages * kTileBytes;
  static constexpr int kRaw = kP + kBlockBytes;    // fp8 only, 16-byte aligned
  static constexpr int kValid = kRaw + kRawBytes;  // int [2][64]
  static constexpr int kAlpha = kValid + 2 * kWgRows * 4;
  static constexpr int kM = kAlpha + kWgHeads * 4;
  static constexpr int kL = kM + kWgHeads * 4;
  static constexpr int kEnd = kL + kWgHeads * 4;
  // The dynamic shared memory base is only 16-byte aligned: room to align it.
  static constexpr int kBytes = kEnd + kSwizzleAtomBytes;
  static_assert(kTileBytes % kSwizzleAtomBytes == 0, "whole atoms");
};
static_assert(WgLayout<576, false>::kBytes <= kSmemLimitSm90, "wgmma bf16");
static_assert(WgLayout<576, true>::kBytes <= kSmemLimitSm90, "wgmma fp8");

// Launchers: bf16 rows of width d (576 or 512) and the split-k combine in
// exl3_sparse_mla_bf16.cu, fp8_ds_mla rows (576) in exl3_sparse_mla_fp8.cu.
// `wgmma`: the host chose the warpgroup-MMA path (use_wgmma).
void launch_decode_bf16(const Params& p, int d, bool wgmma,
                        cudaStream_t stream);
void launch_decode_fp8(const Params& p, bool wgmma, cudaStream_t stream);
void launch_combine(const Params& p, cudaStream_t stream);

}  // namespace vllm_exl3::sparse_mla

#ifdef __CUDACC__
  #include <cuda_bf16.h>
  #include <cuda_fp8.h>

  #include <cmath>

namespace vllm_exl3::sparse_mla {

constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Two e4m3 bytes times their group scale, as two bf16.
__device__ __forceinline__ uint32_t dequant_e4m3x2(uint16_t bits, float s) {
  const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(bits), __NV_E4M3);
  const float2 f = __half22float2(__half2(raw));
  return pack_bf16(f.x * s, f.y * s);
}

// The cache row of a valid physical slot through the paged layout (slots are
// int32: 32-bit division).
__device__ __forceinline__ const uint8_t* kv_row(const Params& p, int slot) {
  const int blk = slot / p.block_size;
  return p.kv + blk * p.block_stride +
         static_cast<int64_t>(slot - blk * p.block_size) * p.row_stride;
}

// One CTA's share of the grid: its token, split and head group, and the span
// [begin, end) of the top-k list its split covers. Head groups vary fastest:
// the CTAs of one token and split run together and share their KV rows through
// L2.
struct CtaWork {
  int t, split, group, begin, end;
};

__device__ __forceinline__ CtaWork cta_work(const Params& p) {
  int bid = blockIdx.x;
  CtaWork w;
  w.group = bid % p.head_groups;
  bid /= p.head_groups;
  w.split = bid % p.num_splits;
  w.t = bid / p.num_splits;
  w.begin = w.split * p.tiles_per_split * kRowsPerTile;
  w.end = min(p.topk, w.begin + p.tiles_per_split * kRowsPerTile);
  return w;
}

// The epilogue both MMA paths share. 1 / l for one head's row sum: l = 0 is a
// head with no selected row (zeros), a NaN l a NaN score (kept).
__device__ __forceinline__ float inv_row_sum(float l) {
  return l > 0.f ? 1.f / l : (l == 0.f ? 0.f : NAN);
}

// Two adjacent output dims of token-head th: bf16 into out when the list was
// not split, else fp32 into this split's partial output for the combine.
__device__ __forceinline__ void store_out_pair(const Params& p, bool direct,
                                               int split, int64_t th, int dim,
                                               float v0, float v1) {
  if (direct) {
    *reinterpret_cast<uint32_t*>(static_cast<__nv_bfloat16*>(p.out) +
                                 th * kLatent + dim) = pack_bf16(v0, v1);
  } else {
    const int64_t pt =
        static_cast<int64_t>(split) * p.num_tokens * p.num_heads + th;
    *reinterpret_cast<float2*>(p.part_out + pt * kLatent + dim) =
        make_float2(v0, v1);
  }
}

// Token-head th's log-sum-exp from its running max m (log2 units) and sum l:
// natural log into lse, or log2 into this split's partial for the combine.
__device__ __forceinline__ void store_lse(const Params& p, bool direct,
                                          int split, int64_t th, float m,
                                          float l) {
  const float lse2 = l > 0.f ? m + log2f(l) : (l == 0.f ? -INFINITY : NAN);
  if (direct)
    p.lse[th] = lse2 * kLn2;
  else
    p.part_lse[static_cast<int64_t>(split) * p.num_tokens * p.num_heads + th] =
        lse2;
}

template <int kD, bool kFp8, int kMTiles, int kStages>
__global__ void __launch_bounds__(128 * kMTiles)
    sparse_mla_decode_kernel(const __grid_constant__ Params p) {
  static_assert(kD == 576 || kD == 512, "head size 576 or 512");
  static_assert(!kFp8 || kD == 576, "fp8_ds_mla rows are 576 wide");
  static_assert(kMTiles == 1 || kMTiles == 2, "16 or 32 heads a CTA");
  using L = SmemLayout<kD, kFp8, kMTiles, kStages>;
  constexpr int kWarps = 4 * kMTiles;
  constexpr int kThreads = 32 * kWarps;
  constexpr int kHeads = L::kHeads;
  constexpr int kThreadsPerRow = kThreads / kRowsPerTile;  // gathers
  constexpr int kDimsPerWarp = kLatent / kWarps;           // O = P V
  constexpr int kNTiles = kDimsPerWarp / 8;
  static_assert(kThreads == 8 * kHeads, "softmax: 8 threads per head");
  extern __shared__ __align__(16) uint8_t smem[];
  __nv_bfloat16* s_q = reinterpret_cast<__nv_bfloat16*>(smem + L::kQ);
  __nv_bfloat16* s_deq = reinterpret_cast<__nv_bfloat16*>(smem + L::kDeq);
  float* s_s = reinterpret_cast<float*>(smem + L::kS);
  __nv_bfloat16* s_p = reinterpret_cast<__nv_bfloat16*>(smem + L::kP);
  float* s_alpha = reinterpret_cast<float*>(smem + L::kAlpha);
  float* s_m = reinterpret_cast<float*>(smem + L::kM);
  float* s_l = reinterpret_cast<float*>(smem + L::kL);
  int* s_valid = reinterpret_cast<int*>(smem + L::kValid);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tq = lane & 3;
  const CtaWork w = cta_work(p);
  const int t = w.t, split = w.split, begin = w.begin, end = w.end;
  const int h0 = w.group * kHeads;
  const int ntiles =
      end > begin ? (end - begin + kRowsPerTile - 1) / kRowsPerTile : 0;

  // Q: kHeads x D; heads past H are zero rows (their results are dropped).
  {
    const int row = tid >> 3;
    const int h = h0 + row;
    const bool ok = h < p.num_heads;
    const uint8_t* src =
        ok ? static_cast<const uint8_t*>(p.q) +
                 2 * (t * p.q_token_stride + h * p.q_head_stride)
           : static_cast<const uint8_t*>(p.q);
    uint8_t* dst = reinterpret_cast<uint8_t*>(s_q + row * L::kQStride);
    for (int c = tid & 7; c < kD / 8; c += 8)
      cp_async16(dst + 16 * c, ok ? src + 16 * c : src, ok ? 16 : 0);
  }

  // The slot of this thread's row of tile `tile` (-1 past the split). Loaded
  // one tile ahead of its gather, so the index load's latency is not paid
  // before every gather.
  auto slot_of = [&](int tile) -> int {
    const int pos = begin + tile * kRowsPerTile + tid / kThreadsPerRow;
    return pos < end ? __ldg(p.indices + t * p.indices_stride + pos) : -1;
  };
  // Gathers stage `dst_stage` with the 32 rows whose slots slot_of gave,
  // kThreadsPerRow threads a row. Rows past the split, -1 and out-of-range
  // slots are zero-filled (never read) and masked.
  auto issue = [&](int dst_stage, int slot) {
    const int row = tid / kThreadsPerRow;
    const bool ok = slot >= 0 && slot < p.num_slots;
    // A masked row still needs a valid source for its zero-filling copy.
    const uint8_t* src = ok ? kv_row(p, slot) : p.kv;
    if (tid % kThreadsPerRow == 0) s_valid[dst_stage * kRowsPerTile + row] = ok;
    constexpr int kRowBytes = kFp8 ? kFp8RowBytes : 2 * L::kKvStride;
    constexpr int kChunks = kFp8 ? kFp8RowBytes / 16 : kD / 8;
    uint8_t* dst =
        smem + L::kStage0 + dst_stage * L::kStageBytes + row * kRowBytes;
    for (int c = tid % kThreadsPerRow; c < kChunks; c += kThreadsPerRow)
      cp_async16(dst + 16 * c, ok ? src + 16 * c : src, ok ? 16 : 0);
  };

  // Prologue: Q with tile 0, then tiles 1 .. kStages - 2, one commit group
  // each (empty past the split), so that at tile i the group of tile i has
  // exactly kStages - 2 newer groups.
  if (ntiles > 0) issue(0, slot_of(0));
  cp_async_commit();
  #pragma unroll
  for (int s = 1; s < kStages - 1; ++s) {
    if (s < ntiles) issue(s, slot_of(s));
    cp_async_commit();
  }
  int next_slot = slot_of(kStages - 1);

  // Warp (mt, wn, wd) of S = Q K^T: head tile mt, rows [16 wn, 16 wn + 16) of
  // a stage, D-half wd. Its Q fragments stay in registers for the whole split.
  const int wd = warp & 1, wn = (warp >> 1) & 1, mt = warp >> 2;
  constexpr int kHalfSteps = kD / 16 / 2;
  uint32_t q_frag[kHalfSteps][4];
  cp_async_wait<kStages - 2>();  // Q and tile 0
  __syncthreads();
  #pragma unroll
  for (int i = 0; i < kHalfSteps; ++i)
    ldmatrix_x4(q_frag[i], s_q +
                               (mt * kHeadsPerMma + (lane & 15)) * L::kQStride +
                               (wd * kHalfSteps + i) * 16 + (lane >> 4) * 8);

  float acc[kMTiles][kNTiles][4];
  #pragma unroll
  for (int m = 0; m < kMTiles; ++m)
  #pragma unroll
    for (int i = 0; i < kNTiles; ++i)
      acc[m][i][0] = acc[m][i][1] = acc[m][i][2] = acc[m][i][3] = 0.f;
  // Softmax state of head tid / 8, kept identical by its 8 threads.
  float m_run = -INFINITY, l_run = 0.f;

  // stage = tile mod kStages; refill = the stage of tile + kStages - 1.
  int stage = 0, refill = kStages - 1;
  for (int tile = 0; tile < ntiles; ++tile) {
    cp_async_wait<kStages - 2>();
    // The stage is complete for every thread; every warp is done with the
    // refilled stage (read in the previous iteration) and, the first time,
    // with Q, whose bytes the last stage reuses, before it is refilled.
    __syncthreads();
    if (tile + kStages - 1 < ntiles) {
      issue(refill, next_slot);
      next_slot = slot_of(tile + kStages);
    }
    cp_async_commit();  // possibly empty: keeps the group count per tile
    const uint8_t* raw = smem + L::kStage0 + stage * L::kStageBytes;
    const __nv_bfloat16* kv =
        kFp8 ? s_deq : reinterpret_cast<const __nv_bfloat16*>(raw);

    if constexpr (kFp8) {
      // e4m3 x scale -> bf16 latent tile, 8 values per step.
      const int row = tid / kThreadsPerRow;
      const uint8_t* r = raw + row * kFp8RowBytes;
      const float* scales = reinterpret_cast<const float*>(r + kFp8ScaleOffset);
  #pragma unroll
      for (int i = 0; i < kLatent / 8 / kThreadsPerRow; ++i) {
        const int c = tid % kThreadsPerRow + kThreadsPerRow * i;  // 8 values
        const uint2 v = *reinterpret_cast<const uint2*>(r + 8 * c);
        const float s = scales[(8 * c) / kFp8ScaleGroup];
        uint4 o;
        o.x = dequant_e4m3x2(static_cast<uint16_t>(v.x & 0xffff), s);
        o.y = dequant_e4m3x2(static_cast<uint16_t>(v.x >> 16), s);
        o.z = dequant_e4m3x2(static_cast<uint16_t>(v.y & 0xffff), s);
        o.w = dequant_e4m3x2(static_cast<uint16_t>(v.y >> 16), s);
        *reinterpret_cast<uint4*>(s_deq + row * L::kKvStride + 8 * c) = o;
      }
      __syncthreads();
    }

    // S = Q K^T for warp (mt, wn, wd).
    {
      // [k-step parity][n-tile]: four independent accumulator chains, so
      // the MMA latency of one chain hides behind the others.
      float s_acc[2][2][4] = {};
      // ldmatrix lanes: B matrices lane / 8 = (row block, column block) =
      // (mi / 2, mi % 2).
      const int mi = lane >> 3;
      const int b_row = wn * 16 + (mi >> 1) * 8 + (lane & 7);
      const int b_col = (mi & 1) * 8;
  #pragma unroll
      for (int i = 0; i < kHalfSteps; ++i) {
        const int d0 = (wd * kHalfSteps + i) * 16;
        uint32_t b[4];
        if (!kFp8 || d0 < kLatent)
          ldmatrix_x4(b, kv + b_row * L::kKvStride + d0 + b_col);
        else
          ldmatrix_x4(b, raw + b_row * kFp8RowBytes + kFp8RopeOffset +
                             2 * (d0 - kLatent + b_col));
        mma_16816_bf16(s_acc[i & 1][0], q_frag[i], b[0], b[1]);
        mma_16816_bf16(s_acc[i & 1][1], q_frag[i], b[2], b[3]);
      }
      float* ss = s_s + (wd * kHeads + mt * kHeadsPerMma) * kRowsPerTile;
  #pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int col = wn * 16 + nt * 8 + 2 * tq;
        const float* a0 = s_acc[0][nt];
        const float* a1 = s_acc[1][nt];
        *reinterpret_cast<float2*>(ss + g * kRowsPerTile + col) =
            make_float2(a0[0] + a1[0], a0[1] + a1[1]);
        *reinterpret_cast<float2*>(ss + (g + 8) * kRowsPerTile + col) =
            make_float2(a0[2] + a1[2], a0[3] + a1[3]);
      }
    }
    __syncthreads();

    // Online softmax: head tid / 8, columns 4 (tid % 8) .. + 3.
    {
      const int h = tid >> 3, c = (tid & 7) * 4;
      const float4 x =
          *reinterpret_cast<const float4*>(s_s + h * kRowsPerTile + c);
      const float4 y = *reinterpret_cast<const float4*>(
          s_s + (kHeads + h) * kRowsPerTile + c);
      const int* valid = s_valid + stage * kRowsPerTile + c;
      float s[4] = {x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w};
      float tile_max = -INFINITY;
      int nan_seen = 0;
  #pragma unroll
      for (int i = 0; i < 4; ++i) {
        s[i] = valid[i] ? s[i] * p.scale_log2 : -INFINITY;
        nan_seen |= s[i] != s[i];
        tile_max = fmaxf(tile_max, s[i]);
      }
  #pragma unroll
      for (int o = 1; o < 8; o <<= 1) {
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, o));
        nan_seen |= __shfl_xor_sync(0xffffffffu, nan_seen, o);
      }
      // fmaxf drops NaN: a NaN score (NaN in q or a selected row) must poison
      // the head's output and lse, not vanish from the maximum.
      const float m_new = nan_seen ? NAN : fmaxf(m_run, tile_max);
      float alpha = 1.f, e[4] = {0.f, 0.f, 0.f, 0.f};
      if (m_new != -INFINITY) {
        alpha = exp2f(m_run - m_new);
  #pragma unroll
        for (int i = 0; i < 4; ++i) e[i] = exp2f(s[i] - m_new);
      }
      // The sum uses the bf16 probabilities the MMA multiplies.
      const uint32_t p01 = pack_bf16(e[0], e[1]), p23 = pack_bf16(e[2], e[3]);
      const float2 f01 =
          __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&p01));
      const float2 f23 =
          __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&p23));
      float sum = (f01.x + f01.y) + (f23.x + f23.y);
  #pragma unroll
      for (int o = 1; o < 8; o <<= 1)
        sum += __shfl_xor_sync(0xffffffffu, sum, o);
      l_run = l_run * alpha + sum;
      m_run = m_new;
      *reinterpret_cast<uint2*>(s_p + h * L::kPStride + c) =
          make_uint2(p01, p23);
      if ((tid & 7) == 0) s_alpha[h] = alpha;
    }
    __syncthreads();

    // O = alpha O + P V: warp w owns kDimsPerWarp output dims of every head.
    {
  #pragma unroll
      for (int m = 0; m < kMTiles; ++m) {
        const float a_lo = s_alpha[m * kHeadsPerMma + g];
        const float a_hi = s_alpha[m * kHeadsPerMma + g + 8];
  #pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          acc[m][nt][0] *= a_lo;
          acc[m][nt][1] *= a_lo;
          acc[m][nt][2] *= a_hi;
          acc[m][nt][3] *= a_hi;
        }
      }
      const int mi = lane >> 3;
      // ldmatrix.trans lanes: matrix mi = (column block mi / 2, row block
      // mi % 2), so b[0], b[1] serve n-tile 2 np and b[2], b[3] n-tile 2 np+1.
      const int v_row = (mi & 1) * 8 + (lane & 7);
      const int v_col = warp * kDimsPerWarp + (mi >> 1) * 8;
  #pragma unroll
      for (int k0 = 0; k0 < kRowsPerTile; k0 += 16) {
        uint32_t a[kMTiles][4];
  #pragma unroll
        for (int m = 0; m < kMTiles; ++m)
          ldmatrix_x4(a[m], s_p +
                                (m * kHeadsPerMma + (lane & 15)) * L::kPStride +
                                k0 + (lane >> 4) * 8);
  #pragma unroll
        for (int np = 0; np < kNTiles / 2; ++np) {
          uint32_t b[4];
          ldmatrix_x4_trans(b,
                            kv + (k0 + v_row) * L::kKvStride + v_col + np * 16);
  #pragma unroll
          for (int m = 0; m < kMTiles; ++m) {
            mma_16816_bf16(acc[m][2 * np], a[m], b[0], b[1]);
            mma_16816_bf16(acc[m][2 * np + 1], a[m], b[2], b[3]);
          }
        }
      }
    }
    stage = stage + 1 == kStages ? 0 : stage + 1;
    refill = refill + 1 == kStages ? 0 : refill + 1;
  }

  cp_async_wait<0>();  // Q's copy when the split had no rows
  // Every warp is past its last read of Q and of the stages: s_m / s_l share
  // Q's bytes.
  __syncthreads();
  if ((tid & 7) == 0) {
    s_m[tid >> 3] = m_run;
    s_l[tid >> 3] = l_run;
  }
  __syncthreads();

  const bool direct = p.num_splits == 1;
  #pragma unroll
  for (int m = 0; m < kMTiles; ++m) {
  #pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = m * kHeadsPerMma + g + 8 * half;
      const int h = h0 + row;
      if (h >= p.num_heads) continue;
      const float inv = inv_row_sum(s_l[row]);
      const int64_t th = static_cast<int64_t>(t) * p.num_heads + h;
  #pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        const int dim = warp * kDimsPerWarp + nt * 8 + 2 * tq;
        store_out_pair(p, direct, split, th, dim, acc[m][nt][2 * half] * inv,
                       acc[m][nt][2 * half + 1] * inv);
      }
    }
  }
  if (tid < kHeads && h0 + tid < p.num_heads)
    store_lse(p, direct, split,
              static_cast<int64_t>(t) * p.num_heads + h0 + tid, s_m[tid],
              s_l[tid]);
}

template <int kD, bool kFp8, int kMTiles, int kStages>
void launch_decode_kernel(const Params& p, cudaStream_t stream) {
  constexpr int bytes = SmemLayout<kD, kFp8, kMTiles, kStages>::kBytes;
  auto* kernel = &sparse_mla_decode_kernel<kD, kFp8, kMTiles, kStages>;
  // A function attribute, not a stream operation: allowed while capturing.
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                       bytes);
  const int64_t ctas =
      static_cast<int64_t>(p.num_tokens) * p.num_splits * p.head_groups;
  kernel<<<static_cast<unsigned>(ctas), 128 * kMTiles, bytes, stream>>>(p);
}

// The device's opt-in shared memory per block (a device attribute, not a
// stream operation: allowed while capturing).
inline int smem_optin_bytes() {
  int dev = 0, bytes = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  return bytes;
}

// Byte offset of 16-byte chunk `chunk` (columns [8 chunk, 8 chunk + 8)) of row
// `row` in a 64-row operand of WgLayout (128-byte swizzle: the chunk's index
// within its 128-byte row is XORed with row mod 8).
__device__ __forceinline__ int wg_chunk_offset(int row, int chunk) {
  constexpr int kChunksPerRow = kSwizzleCols / 8;
  return (chunk / kChunksPerRow) * (kWgRows * 128) + row * 128 +
         (((chunk % kChunksPerRow) ^ (row & 7)) << 4);
}

template <int kD, bool kFp8>
__global__ void __launch_bounds__(kWgThreads, 1)
    sparse_mla_decode_wgmma_kernel(const __grid_constant__ Params p) {
  #if !EXL3_WGMMA
  __trap();  // never launched: the host selects this path only on sm_90a
  return;
  #endif
  static_assert(kD == 576 || kD == 512, "head size 576 or 512");
  static_assert(!kFp8 || kD == 576, "fp8_ds_mla rows are 576 wide");
  using L = WgLayout<kD, kFp8>;
  constexpr int kThreadsPerRow = kWgThreads / kWgRows;  // gathers
  constexpr int kChunks = kD / 8;                       // per bf16 row
  constexpr int kSteps = kD / 16;                       // S's k16 steps
  constexpr int kNBlocks = kWgRows / 8;                 // S's n8 blocks
  constexpr int kONBlocks = kWgDims / 8;                // O's n8 blocks
  extern __shared__ __align__(16) uint8_t smem_raw[];
  const uint32_t raw_addr = smem_addr(smem_raw);
  uint8_t* smem = smem_raw + (((raw_addr + kSwizzleAtomBytes - 1) &
                               ~uint32_t{kSwizzleAtomBytes - 1}) -
                              raw_addr);
  const uint32_t base = smem_addr(smem);
  int* s_valid = reinterpret_cast<int*>(smem + L::kValid);
  float* s_alpha = reinterpret_cast<float*>(smem + L::kAlpha);
  float* s_m = reinterpret_cast<float*>(smem + L::kM);
  float* s_l = reinterpret_cast<float*>(smem + L::kL);

  const int tid = threadIdx.x, lane = tid & 31;
  const int wg = tid / kWarpgroupThreads;
  // Rows g and g + 8 of the warp's 16 in wgmma's accumulator layout.
  const int row0 = ((tid % kWarpgroupThreads) / 32) * 16 + (lane >> 2);
  const int tq = lane & 3;
  const CtaWork w = cta_work(p);
  const int t = w.t, split = w.split, begin = w.begin, end = w.end;
  const int h0 = w.group * kWgHeads;
  const int ntiles = end > begin ? (end - begin + kWgRows - 1) / kWgRows : 0;

  // Q: 64 heads x D; heads past H are zero rows (their results are dropped).
  for (int i = tid; i < kWgHeads * kChunks; i += kWgThreads) {
    const int row = i / kChunks, c = i % kChunks;
    const int h = h0 + row;
    const bool ok = h < p.num_heads;
    const uint8_t* src =
        static_cast<const uint8_t*>(p.q) +
        (ok ? 2 * (t * p.q_token_stride + h * p.q_head_stride) + 16 * c : 0);
    cp_async16(smem + L::kQ + wg_chunk_offset(row, c), src, ok ? 16 : 0);
  }

  // Gathers the rows of tile `tile` into its slot (bf16: stage tile % 2, fp8:
  // the raw slot), kThreadsPerRow threads a row. Rows past the split, -1 and
  // out-of-range slots are zero-filled (never read) and masked.
  auto issue = [&](int tile) {
    const int row = tid / kThreadsPerRow;
    const int pos = begin + tile * kWgRows + row;
    const int slot =
        pos < end ? __ldg(p.indices + t * p.indices_stride + pos) : -1;
    const bool ok = slot >= 0 && slot < p.num_slots;
    // A masked row still needs a valid source for its zero-filling copy.
    const uint8_t* src = ok ? kv_row(p, slot) : p.kv;
    if (tid % kThreadsPerRow == 0) s_valid[(tile & 1) * kWgRows + row] = ok;
    if constexpr (kFp8) {
      uint8_t* dst = smem + L::kRaw + row * kFp8RowBytes;
      for (int c = tid % kThreadsPerRow; c < kFp8RowBytes / 16;
           c += kThreadsPerRow)
        cp_async16(dst + 16 * c, ok ? src + 16 * c : src, ok ? 16 : 0);
    } else {
      uint8_t* dst = smem + L::kKv + (tile & 1) * L::kTileBytes;
      for (int c = tid % kThreadsPerRow; c < kChunks; c += kThreadsPerRow)
        cp_async16(dst + wg_chunk_offset(row, c), ok ? src + 16 * c : src,
                   ok ? 16 : 0);
    }
  };

  if (ntiles > 0) issue(0);
  cp_async_commit();

  float o[kONBlocks * 4];
  #pragma unroll
  for (int i = 0; i < kONBlocks * 4; ++i) o[i] = 0.f;
  // Softmax state of rows row0 and row0 + 8 (warpgroup 0; identical in the
  // four threads of a row); l: this thread's columns only, summed at the end.
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};

  for (int tile = 0; tile < ntiles; ++tile) {
    if constexpr (!kFp8) {
      // Every warpgroup is done with the previous tile (its wgmmas completed):
      // its stage takes the next gather now, before this tile's rows are
      // waited for, so a late tile has the next one in flight behind it.
      __syncthreads();
      if (tile + 1 < ntiles) issue(tile + 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    // The tile's rows (and, the first time, Q) have landed for every thread
    // and are ordered before wgmma's reads; fp8: every warpgroup is done with
    // the previous tile, so the bf16 stage may be rewritten.
    fence_proxy_async_shared();
    __syncthreads();
    const uint8_t* kv = smem + L::kKv + (kFp8 ? 0 : (tile & 1) * L::kTileBytes);
    if constexpr (kFp8) {
      // Thread j of a row: latent values [128 j, 128 j + 128) (one scale
      // group) and rope chunks j, j + 4 (16 bytes each, bf16 already).
      static_assert(kThreadsPerRow * kFp8ScaleGroup == kLatent, "one group");
      const int row = tid / kThreadsPerRow, j = tid % kThreadsPerRow;
      const uint8_t* r = smem + L::kRaw + row * kFp8RowBytes;
      const float sc = reinterpret_cast<const float*>(r + kFp8ScaleOffset)[j];
      uint8_t* dst = smem + L::kKv;
  #pragma unroll 4
      for (int i = 0; i < kFp8ScaleGroup / 8; ++i) {
        const int c = j * (kFp8ScaleGroup / 8) + i;  // 8 values
        const uint2 v = *reinterpret_cast<const uint2*>(r + 8 * c);
        uint4 q;
        q.x = dequant_e4m3x2(static_cast<uint16_t>(v.x & 0xffff), sc);
        q.y = dequant_e4m3x2(static_cast<uint16_t>(v.x >> 16), sc);
        q.z = dequant_e4m3x2(static_cast<uint16_t>(v.y & 0xffff), sc);
        q.w = dequant_e4m3x2(static_cast<uint16_t>(v.y >> 16), sc);
        *reinterpret_cast<uint4*>(dst + wg_chunk_offset(row, c)) = q;
      }
      constexpr int kRopeChunks = 2 * kRope / 16;
  #pragma unroll
      for (int i = 0; i < kRopeChunks / kThreadsPerRow; ++i) {
        const int c = j + kThreadsPerRow * i;
        *reinterpret_cast<uint4*>(dst + wg_chunk_offset(row, kLatent / 8 + c)) =
            *reinterpret_cast<const uint4*>(r + kFp8RopeOffset + 16 * c);
      }
      fence_proxy_async_shared();
      __syncthreads();  // the bf16 tile is complete; the raw slot is free
      if (tile + 1 < ntiles) issue(tile + 1);
      cp_async_commit();
    }

    const int* valid = s_valid + (tile & 1) * kWgRows;
    const uint32_t kv_addr = base + static_cast<uint32_t>(kv - smem);
    if (wg == 0) {
      float s[kNBlocks * 4];
  #pragma unroll
      for (int i = 0; i < kNBlocks * 4; ++i) s[i] = 0.f;
      wgmma_fence();
  #pragma unroll
      for (int k = 0; k < kSteps; ++k) {
        const uint32_t off = (k / 4) * L::kBlockBytes + (k % 4) * 32;
  #if EXL3_WGMMA
        wgmma_ss_bf16<kWgRows, false>(
            s, wgmma_desc_k_major_sw128(base + L::kQ + off),
            wgmma_desc_k_major_sw128(kv_addr + off), k > 0);
  #endif
      }
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_operands(s);

      // Online softmax of rows row0 (values s[4 n], s[4 n + 1]) and row0 + 8
      // (s[4 n + 2], s[4 n + 3]), columns 8 n + 2 tq, + 1.
      float tile_max[2] = {-INFINITY, -INFINITY};
      int nan_seen[2] = {0, 0};
  #pragma unroll
      for (int n = 0; n < kNBlocks; ++n)
  #pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = 8 * n + 2 * tq + (e & 1);
          float& x = s[4 * n + e];
          x = valid[col] ? x * p.scale_log2 : -INFINITY;
          nan_seen[e >> 1] |= x != x;
          tile_max[e >> 1] = fmaxf(tile_max[e >> 1], x);
        }
      float alpha[2], m_new[2];
  #pragma unroll
      for (int r = 0; r < 2; ++r) {
  #pragma unroll
        for (int o2 = 1; o2 < 4; o2 <<= 1) {
          tile_max[r] =
              fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], o2));
          nan_seen[r] |= __shfl_xor_sync(0xffffffffu, nan_seen[r], o2);
        }
        // fmaxf drops NaN: a NaN score (NaN in q or a selected row) must
        // poison the head's output and lse, not vanish from the maximum.
        m_new[r] = nan_seen[r] ? NAN : fmaxf(m_run[r], tile_max[r]);
        alpha[r] = m_new[r] == -INFINITY ? 1.f : exp2f(m_run[r] - m_new[r]);
        l_run[r] *= alpha[r];
        m_run[r] = m_new[r];
      }
      uint8_t* s_p = smem + L::kP;
  #pragma unroll
      for (int n = 0; n < kNBlocks; ++n)
  #pragma unroll
        for (int r = 0; r < 2; ++r) {
          float e0 = 0.f, e1 = 0.f;
          if (m_new[r] != -INFINITY) {
            e0 = exp2f(s[4 * n + 2 * r] - m_new[r]);
            e1 = exp2f(s[4 * n + 2 * r + 1] - m_new[r]);
          }
          // The sum uses the bf16 probabilities the MMA multiplies.
          const uint32_t pe = pack_bf16(e0, e1);
          const float2 f =
              __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&pe));
          l_run[r] += f.x + f.y;
          const int row = row0 + 8 * r;
          *reinterpret_cast<uint32_t*>(s_p + wg_chunk_offset(row, n) + 4 * tq) =
              pe;
        }
      if (tq == 0) {
        s_alpha[row0] = alpha[0];
        s_alpha[row0 + 8] = alpha[1];
      }
      fence_proxy_async_shared();  // P is read by both warpgroups' wgmma
    }
    __syncthreads();  // P and the rescale factors are complete

    // O = alpha O + P V over this warpgroup's kWgDims output dims.
    {
      const float a_lo = s_alpha[row0], a_hi = s_alpha[row0 + 8];
  #pragma unroll
      for (int n = 0; n < kONBlocks; ++n) {
        o[4 * n] *= a_lo;
        o[4 * n + 1] *= a_lo;
        o[4 * n + 2] *= a_hi;
        o[4 * n + 3] *= a_hi;
      }
      wgmma_fence();
      const uint32_t v_addr =
          kv_addr + wg * (kWgDims / kSwizzleCols) * L::kBlockBytes;
  #pragma unroll
      for (int k = 0; k < kWgRows / 16; ++k) {
  #if EXL3_WGMMA
        wgmma_ss_bf16<kWgDims, true>(
            o, wgmma_desc_k_major_sw128(base + L::kP + 32 * k),
            wgmma_desc_mn_major_sw128(v_addr + 16 * 128 * k, L::kBlockBytes),
            true);
  #endif
      }
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_operands(o);
    }
  }

  cp_async_wait<0>();  // Q's copy when the split had no rows
  if (wg == 0) {
  #pragma unroll
    for (int r = 0; r < 2; ++r) {
      l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
      l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
      if (tq == 0) {
        s_m[row0 + 8 * r] = m_run[r];
        s_l[row0 + 8 * r] = l_run[r];
      }
    }
  }
  __syncthreads();

  const bool direct = p.num_splits == 1;
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + 8 * r;
    const int h = h0 + row;
    if (h >= p.num_heads) continue;
    const float inv = inv_row_sum(s_l[row]);
    const int64_t th = static_cast<int64_t>(t) * p.num_heads + h;
  #pragma unroll
    for (int n = 0; n < kONBlocks; ++n) {
      const int dim = wg * kWgDims + 8 * n + 2 * tq;
      store_out_pair(p, direct, split, th, dim, o[4 * n + 2 * r] * inv,
                     o[4 * n + 2 * r + 1] * inv);
    }
  }
  if (tid < kWgHeads && h0 + tid < p.num_heads)
    store_lse(p, direct, split,
              static_cast<int64_t>(t) * p.num_heads + h0 + tid, s_m[tid],
              s_l[tid]);
}

template <int kD, bool kFp8>
void launch_decode_wgmma(const Params& p, cudaStream_t stream) {
  constexpr int bytes = WgLayout<kD, kFp8>::kBytes;
  auto* kernel = &sparse_mla_decode_wgmma_kernel<kD, kFp8>;
  // A function attribute, not a stream operation: allowed while capturing.
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                       bytes);
  const int64_t ctas =
      static_cast<int64_t>(p.num_tokens) * p.num_splits * p.head_groups;
  kernel<<<static_cast<unsigned>(ctas), kWgThreads, bytes, stream>>>(p);
}

// The path the host chose (wgmma: p.head_groups counts 64-head groups), else
// the head-tile count of p's head count; the two-tile variant runs the deep
// pipeline where the device holds it. The depth changes neither the split
// count nor the arithmetic order.
template <int kD, bool kFp8>
void launch_decode(const Params& p, bool wgmma, cudaStream_t stream) {
  constexpr int kDeep = kFp8 ? kDeepStagesFp8 : kDeepStagesBf16;
  if (wgmma)
    launch_decode_wgmma<kD, kFp8>(p, stream);
  else if (head_tiles(p.num_heads) == 1)
    launch_decode_kernel<kD, kFp8, 1, kPortableStages>(p, stream);
  else if (smem_optin_bytes() >= SmemLayout<kD, kFp8, 2, kDeep>::kBytes)
    launch_decode_kernel<kD, kFp8, 2, kDeep>(p, stream);
  else
    launch_decode_kernel<kD, kFp8, 2, kPortableStages>(p, stream);
}

}  // namespace vllm_exl3::sparse_mla
#endif  // __CUDACC__
