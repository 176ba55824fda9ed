// SPDX-License-Identifier: Apache-2.0
// Host-side launch resources of the EXL3 ops: the wgmma engine's tensor map of
// the activations. Buffers (the split-k workspace, scratch) are torch tensors
// from the caller or torch's caching allocator, and the cuBLAS handle is
// torch's (its workspace comes from the same allocator).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

namespace vllm_exl3 {

// `map` = the wgmma engine's view of xh (fp16 [shards][m][k],
// GemmParams::xh_map) with boxes of 64 k x `bm` rows. Throws if the driver
// cannot encode it.
void encode_xh_map(CUtensorMap* map, const void* xh, int shards, int m, int k,
                   int bm);

}  // namespace vllm_exl3
