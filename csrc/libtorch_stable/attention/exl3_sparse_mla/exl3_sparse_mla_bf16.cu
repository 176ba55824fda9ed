// SPDX-License-Identifier: Apache-2.0
// Sparse MLA decode over bf16 cache rows (576 and 512 wide) and the split-k
// combine.
#include "exl3_sparse_mla.cuh"

namespace vllm_exl3::sparse_mla {

// Merges the split partials of one (token, head) per CTA: 4 dims a thread.
constexpr int kCombineThreads = kLatent / 4;

__global__ void __launch_bounds__(kCombineThreads)
    sparse_mla_combine_kernel(const __grid_constant__ Params p) {
  const int64_t th = blockIdx.x;
  const int64_t plane = static_cast<int64_t>(p.num_tokens) * p.num_heads;
  float best = -INFINITY;
  bool nan_seen = false;
  for (int s = 0; s < p.num_splits; ++s) {
    const float v = p.part_lse[s * plane + th];
    nan_seen |= v != v;
    best = fmaxf(best, v);
  }
  // fmaxf drops NaN; a split that saw a NaN score poisons the result.
  if (nan_seen) best = NAN;
  const int dim = threadIdx.x * 4;
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + th * kLatent + dim;
  float o[4] = {0.f, 0.f, 0.f, 0.f};
  float wsum = 0.f;
  if (best != -INFINITY) {
    for (int s = 0; s < p.num_splits; ++s) {
      const float w = exp2f(p.part_lse[s * plane + th] - best);
      const float4 v = *reinterpret_cast<const float4*>(
          p.part_out + (s * plane + th) * kLatent + dim);
      wsum += w;
      o[0] += w * v.x;
      o[1] += w * v.y;
      o[2] += w * v.z;
      o[3] += w * v.w;
    }
    const float inv = 1.f / wsum;
#pragma unroll
    for (int i = 0; i < 4; ++i) o[i] *= inv;
  }
  *reinterpret_cast<uint2*>(out) =
      make_uint2(pack_bf16(o[0], o[1]), pack_bf16(o[2], o[3]));
  if (threadIdx.x == 0)
    p.lse[th] = best != -INFINITY ? (best + log2f(wsum)) * kLn2 : -INFINITY;
}

void launch_decode_bf16(const Params& p, int d, bool wgmma,
                        cudaStream_t stream) {
  if (d == 576)
    launch_decode<576, false>(p, wgmma, stream);
  else
    launch_decode<512, false>(p, wgmma, stream);
}

void launch_combine(const Params& p, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(p.num_tokens) * p.num_heads;
  sparse_mla_combine_kernel<<<static_cast<unsigned>(rows), kCombineThreads, 0,
                              stream>>>(p);
}

}  // namespace vllm_exl3::sparse_mla
