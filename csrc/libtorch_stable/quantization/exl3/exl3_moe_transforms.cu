// SPDX-License-Identifier: Apache-2.0
// Rate-independent kernels of an MoE layer: the routed-row input transform, the
// SwiGLU transform feeding the down projection, the deterministic top-k combine
// and the fp32 sum's rounding. One warp per (slot or token, 128 columns), lane
// l holding columns 4l..4l+3, like the dense input transform
// (exl3_transforms.cu).
//
// The kernels after a grouped GEMM (SwiGLU transform, combine, sum rounding)
// are launched programmatically: their blocks are scheduled while the GEMM runs
// and wait for it before reading its output (the SwiGLU transform reads its
// routing and scales first), which hides a launch gap per stage. Every block
// waits, so each of them ends after the GEMM it follows, and what follows them
// in the stream sees the whole layer done.
#include <type_traits>
#include <utility>

#include "exl3_hadamard.cuh"
#include "exl3_kernels.h"
#include "exl3_moe.h"

namespace vllm_exl3 {

namespace {

constexpr int kMoeRowThreads = 256;
constexpr int kMoeRowWarps = kMoeRowThreads / kWarpSize;

unsigned grid_for(int64_t warps) {
  return static_cast<unsigned>((warps + kMoeRowWarps - 1) / kMoeRowWarps);
}

// A row kernel launched to overlap the grid before it (programmatic stream
// serialization); the kernel waits for that grid before anything else.
template <typename... Params, typename... Args>
void launch_after_gemm(void (*kernel)(Params...), unsigned grid,
                       cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute attr[1];
  programmatic_launch(cfg, attr, dim3(grid), dim3(kMoeRowThreads), 0, stream);
  cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

// The warp's (slot, 128-column block) item, or false when the slot is not live.
struct SlotItem {
  int slot, col, expert, pair;
};
__device__ __forceinline__ bool slot_item(int cols, int sorted_len, int block,
                                          const int32_t* num_post_pad,
                                          const int32_t* sorted_ids,
                                          const int32_t* expert_ids,
                                          int experts, SlotItem& it) {
  const int64_t item =
      static_cast<int64_t>(blockIdx.x) * kMoeRowWarps + (threadIdx.x >> 5);
  const int per_row = cols / kHadamard;
  const int live = min(*num_post_pad, sorted_len);
  if (item >= static_cast<int64_t>(live) * per_row) return false;
  it.slot = static_cast<int>(item / per_row);
  it.col =
      static_cast<int>(item % per_row) * kHadamard + 4 * (threadIdx.x & 31);
  it.expert = expert_ids[it.slot / block];
  it.pair = sorted_ids[it.slot];
  return it.expert >= 0 &&
         it.expert < experts;  // other ranks' blocks: the GEMM skips them
}

// The local expert of routed pair `pair` (topk_ids through expert_map), or -1
// where it is not on this rank: the combine's rule, so the two agree.
__device__ __forceinline__ int pair_local_expert(const MoePairsLayout& lay,
                                                 int pair, int experts) {
  const int64_t e = lay.ids64 ? static_cast<const int64_t*>(lay.topk_ids)[pair]
                              : static_cast<const int32_t*>(lay.topk_ids)[pair];
  if (e < 0 || e >= lay.global_experts) return -1;
  const int64_t local = lay.expert_map != nullptr ? lay.expert_map[e] : e;
  return local >= 0 && local < experts ? static_cast<int>(local) : -1;
}

// slot_item for the pairs layout (exl3_moe.h MoePairsLayout): the slot's pair
// and expert come from the routing, and the lane 0 of each slot's first
// 128-column warp writes the slot's entries of the layout's arrays (its block's
// expert at the block's first slot, the live count at slot 0) for the kernels
// after this one, which read them only once this grid has completed. Every slot
// is live; false past the grid or for a block whose expert is not here, whose
// rows are left alone as in the aligned layout.
__device__ __forceinline__ bool pair_slot_item(int cols, int block, int pairs,
                                               int experts,
                                               const MoePairsLayout& lay,
                                               SlotItem& it) {
  const int64_t item =
      static_cast<int64_t>(blockIdx.x) * kMoeRowWarps + (threadIdx.x >> 5);
  const int per_row = cols / kHadamard;
  const int slots = pairs * block;
  if (item >= static_cast<int64_t>(slots) * per_row) return false;
  it.slot = static_cast<int>(item / per_row);
  const int col_block = static_cast<int>(item % per_row);
  it.col = col_block * kHadamard + 4 * (threadIdx.x & 31);
  const int b = it.slot / block;
  const bool first = it.slot % block == 0;
  it.pair = first ? b : pairs;  // the others: padding
  it.expert = pair_local_expert(lay, b, experts);
  if (col_block == 0 && (threadIdx.x & 31) == 0) {
    lay.sorted_ids[it.slot] = it.pair;
    if (first) lay.expert_ids[b] = it.expert;
    if (it.slot == 0) *lay.num_post_pad = slots;
  }
  return it.expert >= 0;
}

__device__ __forceinline__ void store_transformed(float (&v)[4],
                                                  const float (&scale)[4],
                                                  __half* dst, int lane) {
#pragma unroll
  for (int j = 0; j < 4; ++j) v[j] *= scale[j];
  hadamard128(v, lane);
#pragma unroll
  for (int j = 0; j < 4; ++j) v[j] *= kHadamardScale;
  *reinterpret_cast<uint2*>(dst) = pack4<__half>(v);
}

template <typename T>
__global__ void __launch_bounds__(kMoeRowThreads)
    exl3_moe_input_transform_kernel(
        const T* __restrict__ x, const float* __restrict__ topk_w,
        const __half* __restrict__ suh13, const int64_t* __restrict__ meta13,
        const int64_t* __restrict__ meta2, uint32_t rates13, uint32_t rates2,
        const int32_t* __restrict__ sorted_ids,
        const int32_t* __restrict__ expert_ids,
        const int32_t* __restrict__ num_post_pad, MoePairsLayout layout,
        __half* __restrict__ xh13, int h, int slots, int sorted_len, int block,
        int pairs, int topk, int experts) {
  SlotItem it;
  const bool live = layout.topk_ids != nullptr
                        ? pair_slot_item(h, block, pairs, experts, layout, it)
                        : slot_item(h, sorted_len, block, num_post_pad,
                                    sorted_ids, expert_ids, experts, it);
  if (!live) return;
  const int lane = threadIdx.x & 31;
  if (it.col < kHadamard) {  // once per slot
    const int64_t* m13 = meta13 + 4 * static_cast<int64_t>(it.expert);
    const int64_t k_gate = m13[1], k_up = m13[3],
                  k_down = meta2[2 * it.expert + 1];
    auto listed = [](int64_t k2, uint32_t mask) {
      return k2 >= 0 && k2 < 32 && (mask >> k2) & 1u;
    };
    if (!listed(k_gate, rates13) || !listed(k_up, rates13) ||
        !listed(k_down, rates2))
      __trap();
  }
  __half* dst0 = xh13 + static_cast<size_t>(it.slot) * h + it.col;
  __half* dst1 = dst0 + static_cast<size_t>(slots) * h;
  if (it.pair < 0 ||
      it.pair >=
          pairs) {  // padding: zero rows, so the GEMM reads finite values
    *reinterpret_cast<uint2*>(dst0) = make_uint2(0u, 0u);
    *reinterpret_cast<uint2*>(dst1) = make_uint2(0u, 0u);
    return;
  }
  float xv[4];
  load4_f32(x + static_cast<size_t>(it.pair / topk) * h + it.col, xv);
  if (topk_w != nullptr) {
    const float w = topk_w[it.pair];
#pragma unroll
    for (int j = 0; j < 4; ++j) xv[j] *= w;
  }
  const __half* su = suh13 + static_cast<size_t>(it.expert) * 2 * h + it.col;
  float s0[4], s1[4], v[4];
  load4_f32(su, s0);
  load4_f32(su + h, s1);
#pragma unroll
  for (int j = 0; j < 4; ++j) v[j] = xv[j];
  store_transformed(v, s0, dst0, lane);
  store_transformed(xv, s1, dst1, lane);
}

// The sum over the splits of one pair's partial row at 4 columns, split 0
// first (a fixed order: the same bits on every run).
__device__ __forceinline__ void sum_splits(const float* __restrict__ part,
                                           size_t split_stride, int splits,
                                           float (&v)[4]) {
  const float4 first = *reinterpret_cast<const float4*>(part);
  v[0] = first.x;
  v[1] = first.y;
  v[2] = first.z;
  v[3] = first.w;
  for (int s = 1; s < splits; ++s) {
    const float4 p = *reinterpret_cast<const float4*>(part + s * split_stride);
    v[0] += p.x;
    v[1] += p.y;
    v[2] += p.z;
    v[3] += p.w;
  }
}

template <typename T>
__global__ void __launch_bounds__(kMoeRowThreads)
    exl3_moe_act_transform_kernel(const T* __restrict__ y13,
                                  const float* __restrict__ partial13,
                                  int splits13, const __half* __restrict__ suh2,
                                  const int32_t* __restrict__ sorted_ids,
                                  const int32_t* __restrict__ expert_ids,
                                  const int32_t* __restrict__ num_post_pad,
                                  __half* __restrict__ xh2, int i, int slots,
                                  int sorted_len, int block, int pairs,
                                  int experts) {
  // The routing and suh2 do not come from the GEMM: read them while it runs.
  // The routing is moe_align_block_size's, complete before the input transform
  // started, or the pairs layout's, written by the input transform, which had
  // completed before this grid could be scheduled: every block of the first
  // gate/up launch waits for it (MoeGemmParams::wait_for_routing) before it
  // releases its dependents.
  SlotItem it;
  const bool live = slot_item(i, sorted_len, block, num_post_pad, sorted_ids,
                              expert_ids, experts, it);
  const bool routed = live && it.pair >= 0 && it.pair < pairs;
  float g[4], u[4], s[4], v[4];
  if (routed) load4_f32(suh2 + static_cast<size_t>(it.expert) * i + it.col, s);
  grid_dependency_wait();  // the gate/up GEMM's rows or partial sums
  if (!live) return;
  const int lane = threadIdx.x & 31;
  __half* dst = xh2 + static_cast<size_t>(it.slot) * i + it.col;
  if (!routed) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(0u, 0u);
    return;
  }
  if (partial13 != nullptr) {
    const size_t role_stride = static_cast<size_t>(pairs) * i;
    const float* src = partial13 + static_cast<size_t>(it.pair) * i + it.col;
    sum_splits(src, 2 * role_stride, splits13, g);
    sum_splits(src + role_stride, 2 * role_stride, splits13, u);
  } else {
    const T* src = y13 + static_cast<size_t>(it.slot) * i + it.col;
    load4_f32(src, g);
    load4_f32(src + static_cast<size_t>(slots) * i, u);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) v[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
  store_transformed(v, s, dst, lane);
}

template <typename T, typename Id>
__global__ void __launch_bounds__(kMoeRowThreads)
    exl3_moe_combine_kernel(const T* __restrict__ rows,
                            const float* __restrict__ partial2, int splits2,
                            const Id* __restrict__ topk_ids,
                            const int32_t* __restrict__ expert_map,
                            int global_experts, int experts, T* __restrict__ y,
                            int m, int h, int topk) {
  grid_dependency_wait();  // the down GEMM's rows or partial sums
  const int64_t warp =
      static_cast<int64_t>(blockIdx.x) * kMoeRowWarps + (threadIdx.x >> 5);
  const int per_row = h / kHadamard;
  if (warp >= static_cast<int64_t>(m) * per_row) return;
  // The op keeps m * h / 128 below 2^31: a 32-bit division (the 64-bit one is a
  // called routine, and its stack frame spilled).
  const int item = static_cast<int>(warp);
  const int token = item / per_row;
  const int col = (item % per_row) * kHadamard + 4 * (threadIdx.x & 31);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int k = 0; k < topk; ++k) {
    const int64_t pair = static_cast<int64_t>(token) * topk + k;
    const int64_t e = static_cast<int64_t>(topk_ids[pair]);
    if (e < 0 || e >= global_experts) continue;
    const int64_t local = expert_map != nullptr ? expert_map[e] : e;
    if (local < 0 || local >= experts)
      continue;  // not routed on this rank: no row written
    float v[4];
    if (partial2 != nullptr)
      sum_splits(partial2 + pair * h + col, static_cast<size_t>(m) * topk * h,
                 splits2, v);
    else
      load4_f32(rows + pair * h + col, v);
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[j] += v[j];
  }
  *reinterpret_cast<uint2*>(y + static_cast<size_t>(token) * h + col) =
      pack4<T>(acc);
}

template <typename T>
__global__ void exl3_moe_finish_sum_kernel(const float4* __restrict__ acc,
                                           uint2* __restrict__ y,
                                           int64_t quads) {
  grid_dependency_wait();  // the down GEMM's sum
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= quads) return;
  const float4 a = acc[i];
  const float v[4] = {a.x, a.y, a.z, a.w};
  y[i] = pack4<T>(v);
}

}  // namespace

void launch_moe_input_transform(
    const void* x, bool bf16, const float* topk_weights, const void* suh13,
    const int64_t* meta13, const int64_t* meta2, uint32_t rates13,
    uint32_t rates2, const int32_t* sorted_ids, const int32_t* expert_ids,
    const int32_t* num_post_pad, const MoePairsLayout* layout, void* xh13,
    int h, int slots, int sorted_len, int block, int pairs, int topk,
    int experts, cudaStream_t stream) {
  const unsigned grid =
      grid_for(static_cast<int64_t>(sorted_len) * (h / kHadamard));
  const MoePairsLayout pairs_layout =
      layout != nullptr ? *layout : MoePairsLayout{};
  auto go = [&](auto* xt) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(xt)>>;
    exl3_moe_input_transform_kernel<T><<<grid, kMoeRowThreads, 0, stream>>>(
        xt, topk_weights, static_cast<const __half*>(suh13), meta13, meta2,
        rates13, rates2, sorted_ids, expert_ids, num_post_pad, pairs_layout,
        static_cast<__half*>(xh13), h, slots, sorted_len, block, pairs, topk,
        experts);
  };
  if (bf16)
    go(static_cast<const __nv_bfloat16*>(x));
  else
    go(static_cast<const __half*>(x));
}

void launch_moe_act_transform(const void* y13, const float* partial13,
                              int splits13, bool bf16, const void* suh2,
                              const int32_t* sorted_ids,
                              const int32_t* expert_ids,
                              const int32_t* num_post_pad, void* xh2, int i,
                              int slots, int sorted_len, int block, int pairs,
                              int experts, cudaStream_t stream) {
  const unsigned grid =
      grid_for(static_cast<int64_t>(sorted_len) * (i / kHadamard));
  auto go = [&](auto* yt) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(yt)>>;
    launch_after_gemm(
        exl3_moe_act_transform_kernel<T>, grid, stream, yt, partial13, splits13,
        static_cast<const __half*>(suh2), sorted_ids, expert_ids, num_post_pad,
        static_cast<__half*>(xh2), i, slots, sorted_len, block, pairs, experts);
  };
  if (bf16)
    go(static_cast<const __nv_bfloat16*>(y13));
  else
    go(static_cast<const __half*>(y13));
}

void launch_moe_combine(const void* rows, const float* partial2, int splits2,
                        const void* topk_ids, bool ids64,
                        const int32_t* expert_map, int global_experts,
                        int experts, void* y, bool bf16, int m, int h, int topk,
                        cudaStream_t stream) {
  const unsigned grid = grid_for(static_cast<int64_t>(m) * (h / kHadamard));
  auto go = [&](auto* rt, auto* ids) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(rt)>>;
    launch_after_gemm(
        exl3_moe_combine_kernel<
            T, std::remove_const_t<std::remove_pointer_t<decltype(ids)>>>,
        grid, stream, rt, partial2, splits2, ids, expert_map, global_experts,
        experts, static_cast<T*>(y), m, h, topk);
  };
  auto with_ids = [&](auto* rt) {
    if (ids64)
      go(rt, static_cast<const int64_t*>(topk_ids));
    else
      go(rt, static_cast<const int32_t*>(topk_ids));
  };
  if (bf16)
    with_ids(static_cast<const __nv_bfloat16*>(rows));
  else
    with_ids(static_cast<const __half*>(rows));
}

void launch_moe_finish_sum(const float* acc, void* y, bool bf16, int64_t count,
                           cudaStream_t stream) {
  const int64_t quads = count / 4;
  const unsigned grid =
      static_cast<unsigned>((quads + kMoeRowThreads - 1) / kMoeRowThreads);
  const float4* a = reinterpret_cast<const float4*>(acc);
  if (bf16)
    launch_after_gemm(exl3_moe_finish_sum_kernel<__nv_bfloat16>, grid, stream,
                      a, static_cast<uint2*>(y), quads);
  else
    launch_after_gemm(exl3_moe_finish_sum_kernel<__half>, grid, stream, a,
                      static_cast<uint2*>(y), quads);
}

}  // namespace vllm_exl3
