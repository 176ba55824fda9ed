// SPDX-License-Identifier: Apache-2.0
// Sparse MLA decode over fp8_ds_mla cache rows (656 bytes: e4m3 latent with
// per-128 fp32 scales, bf16 rope).
#include "exl3_sparse_mla.cuh"

namespace vllm_exl3::sparse_mla {

void launch_decode_fp8(const Params& p, bool wgmma, cudaStream_t stream) {
  launch_decode<576, true>(p, wgmma, stream);
}

}  // namespace vllm_exl3::sparse_mla
