// SPDX-License-Identifier: Apache-2.0
// Host-side view of the EXL3 mixture-of-experts kernels: launch parameters and
// the per-bitrate launcher table. The grouped GEMMs of one bitrate (every
// codebook, BM tier and stage) live in the translation unit of that bitrate
// (exl3_rate_k<K2>.cu), beside its dense kernels.
//
// Rows are "slots" of vLLM's moe_align_block_size: sorted_ids[slot] is the
// (token, k) pair token * topk + k, or the padding sentinel pairs = M * topk;
// block b = slots [b * BM, (b + 1) * BM) belongs to expert expert_ids[b] (local
// id; -1 or out of range: not here), and only the first num_post_pad[0] slots
// are live. The pairs layout (few tokens, MoePairsLayout) is the same contract
// with block b serving routed pair b alone, written by the input transform.
#pragma once

#include <cuda.h>  // CUtensorMap (the descriptor type only)
#include <cuda_runtime.h>
#include <cstdint>

namespace vllm_exl3 {

// BM tiers of the grouped GEMM (rows per block = moe_align_block_size's block
// size = 16 * mt), the dense GEMM's tiers: a block decodes its expert's trellis
// columns once for all its rows, so the caller picks the smallest tier that
// holds an expert's typical row count (16 for decode: the fewest padded rows).
constexpr int kMoeTiers[] = {1, 2, 4, 8};
constexpr int kNumMoeTiers = 4;
// The tiers built with split-k (m16 tiles, up to 32 rows): the few-token path,
// where few blocks would run. The larger tiers serve batches whose blocks fill
// the device already, and the partial-sum epilogue pushed the 128-row 8-bit
// tier past its register budget (ptxas spilled).
constexpr int kMoeSplitMaxTier = 2;
// The tiers also built on Hopper's wgmma (exl3_wgmma.cuh; sm_90a only),
// unsplit: 64 and 128 rows, the dense wgmma engine's narrow tiers. The decode
// tiers stay on mma.sync: they carry the split-k epilogue, and the wgmma
// wrappers are generated for N = 64 tokens and up (generate_kernels.py
// WGMMA_WIDTHS).
constexpr int kMoeWgmmaTiers[] = {4, 8};

// The two grouped GEMMs of an MoE layer.
enum class MoeStage : int {
  // xh13 [2][P][h] -> y13 [2][P][i]: gate (role 0) and up (role 1) as two
  // column ranges of one
  // grid, each role's block with its own trellis and svh.
  kGateUp = 0,
  // xh2 [P][i] -> the routed rows, scaled by svh and the routing weight, either
  // written per
  // (token, k) pair (deterministic combine afterwards) or added into an fp32
  // [M][h] sum.
  kDown = 1,
};

struct MoeGemmParams {
  // wgmma engine: xh as one fp16 [roles * P][k] matrix for the tensor memory
  // accelerator (encode_xh_map, boxes of 64 k x BM rows). A row block's slots
  // are contiguous rows there, so one map serves every block: block b of role
  // r reads rows r * P + b * BM. Unused by mma.sync. First, for its 64-byte
  // alignment.
  CUtensorMap xh_map;
  const void* xh;  // fp16 [roles][P][k], the transformed routed rows
  const void*
      trellis;  // int16, every expert's (and role's) trellis back to back
  const int64_t* meta;          // [E][roles][2]: (offset in int16 elements, k2)
  const void* svh;              // fp16 [E][roles * n]
  const int32_t* sorted_ids;    // [P]
  const int32_t* expert_ids;    // [P / BM]
  const int32_t* num_post_pad;  // [1]
  const float* topk_weights;  // [pairs]; null: no routing weight at the output
  void* out;  // kGateUp: T [roles][P][n]; kDown: T [pairs][n], or fp32 [M][n]
              // if accumulate
  // Split-k (splits > 1): grid z = the k-split; each split writes its fp32
  // partial rows, already through the stage's epilogue (Ĥ, svh, routing weight:
  // all linear), to partial[z][role][pair][n] instead of out, for the live
  // routed pairs only (padding rows are never read). The consumer sums the
  // splits in order: the SwiGLU transform (gate/up) or the combine (down).
  float* partial;
  int64_t trellis_numel;  // int16 elements: offsets past it trap instead of
                          // reading stray memory
  int k, n;               // of one role
  int roles;
  int slots;       // rows of the routed-order buffers: row blocks * BM
  int sorted_len;  // entries of sorted_ids (<= slots); live slots never reach
                   // past it
  int pairs;       // M * topk, also the padding sentinel
  int topk;
  int experts;  // local experts E
  int splits;   // k-splits (grid z), 1 = unsplit
  bool out_bf16;
  bool accumulate;
  // The routing arrays (sorted_ids, expert_ids, num_post_pad) are written by
  // the grid this one overlaps, the pairs layout's input transform: every block
  // waits for it before reading them, instead of prefetching its first trellis
  // stages while the transform runs.
  bool wait_for_routing;
};

// The pairs layout: block b (BM slots) serves routed pair b = token * topk + k
// alone, in slot b * BM; its other slots are padding (the sentinel pairs), and
// its expert is topk_ids.flat[b] through expert_map (when given), -1 where that
// expert is not on this rank. Every slot is live (num_post_pad = pairs * BM).
// The arrays are a function of topk_ids only, so the input transform, which
// runs first, derives each slot's pair and expert itself and writes them for
// the kernels after it: no alignment launches.
struct MoePairsLayout {
  const void* topk_ids;  // [pairs], int32 or int64
  bool ids64;
  const int32_t* expert_map;  // [global_experts] -> local id or -1; null: none
  int global_experts;
  int32_t* sorted_ids;    // [pairs * BM], written
  int32_t* expert_ids;    // [pairs], written
  int32_t* num_post_pad;  // [1], written
};

// Every (expert, role) weight of a layer in the original basis, transposed:
// w[e][r] = (diag(suh) Ĥ Ŵ Ĥ diag(svh))^T, [n][k], so w viewed as [E][roles *
// n][k] is the [experts][out][in] layout of vLLM's bf16 fused MoE (w13: gate
// rows, then up rows; w2: roles 1).
struct MoeReconParams {
  const void* trellis;    // int16, every (expert, role) block back to back
  const int64_t* meta;    // [E][roles][2]: (offset in int16 elements, k2)
  const void* suh;        // fp16 [E][roles][k]
  const void* svh;        // fp16 [E][roles * n]
  void* w;                // [E][roles][n][k] in the output dtype
  int64_t trellis_numel;  // int16 elements: offsets past it trap
  int k, n;               // of one role
  int roles;
  int experts;
  bool out_bf16;
};

struct MoeRateKernels {
  // Blocks whose (expert, role) has another bitrate exit at once: one launch
  // per distinct k2 of the layer serves mixed-bitrate experts without a kernel
  // per rate combination.
  // wgmma: the Hopper engine (mt one of kMoeWgmmaTiers, unsplit; only where
  // wgmma_supported()), else mma.sync.
  void (*gemm)(MoeStage stage, int cb, int mt, bool wgmma,
               const MoeGemmParams& p, cudaStream_t stream);
  // The same rule for the reconstruct: one launch per distinct k2.
  void (*reconstruct)(int cb, const MoeReconParams& p, cudaStream_t stream);
};

// The launcher table of one bitrate (the generated exl3_rate_table.cpp, over
// the rates generate_kernels.py builds); throws for any other K2.
const MoeRateKernels& moe_rate_kernels(int k2);

// Rate-independent kernels (exl3_moe_transforms.cu), all reading the live slot
// count on the device. xh13[r][slot] = fp16(Ĥ(x[token] * suh13[e][r] (* w[pair]
// if weight_on_input))) for both roles; padding slots are zeroed, slots of
// blocks not on this rank are left alone. It also traps on a routed expert
// whose bitrate (meta13 / meta2) is not in the launched set (bit k2 of the
// masks): the GEMMs would skip it and leave its rows unwritten. With `layout`
// (the pairs layout; sorted_ids, expert_ids and num_post_pad then unused, and
// sorted_len = slots = pairs * block) it derives every slot's pair and expert
// from the routing and writes the layout's arrays; null: it reads
// moe_align_block_size's.
void launch_moe_input_transform(
    const void* x, bool bf16, const float* topk_weights, const void* suh13,
    const int64_t* meta13, const int64_t* meta2, uint32_t rates13,
    uint32_t rates2, const int32_t* sorted_ids, const int32_t* expert_ids,
    const int32_t* num_post_pad, const MoePairsLayout* layout, void* xh13,
    int h, int slots, int sorted_len, int block, int pairs, int topk,
    int experts, cudaStream_t stream);
// xh2[slot] = fp16(Ĥ(SiLU(g) * u * suh2[e])), g and u the slot's gate and up
// rows: y13[0][slot] and y13[1][slot], or, when partial13 is given (split-k),
// the sums over s = 0, 1, ... of partial13[s][0 / 1][pair] (fp32 [splits][2]
// [pairs][i]), in that order.
void launch_moe_act_transform(const void* y13, const float* partial13,
                              int splits13, bool bf16, const void* suh2,
                              const int32_t* sorted_ids,
                              const int32_t* expert_ids,
                              const int32_t* num_post_pad, void* xh2, int i,
                              int slots, int sorted_len, int block, int pairs,
                              int experts, cudaStream_t stream);
// y[t] = sum over k in order of row(t * topk + k) (fp32), for the pairs whose
// expert is local: 0 <= topk_ids < global_experts and expert_map (if any) >= 0
// there. row(pair) = rows[pair] (the activation dtype), or, when partial2 is
// given (split-k), the sum over s = 0, 1, ... of partial2[s][pair] (fp32
// [splits][pairs][h]), in that order. ids: int32 or int64.
void launch_moe_combine(const void* rows, const float* partial2, int splits2,
                        const void* topk_ids, bool ids64,
                        const int32_t* expert_map, int global_experts,
                        int experts, void* y, bool bf16, int m, int h, int topk,
                        cudaStream_t stream);
// y = the fp32 sum rounded to the output dtype.
void launch_moe_finish_sum(const float* acc, void* y, bool bf16, int64_t count,
                           cudaStream_t stream);

}  // namespace vllm_exl3
