// SPDX-License-Identifier: Apache-2.0
// Process-wide, per-device resources of the EXL3 ops: the split-k fp32 accumulator and the
// cuBLAS handle of the large-m path. Both keep stable addresses so CUDA graphs can capture them.
#pragma once

#include <cublas_v2.h>
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstddef>

namespace vllm_exl3 {

// The split-k accumulator of `device`, all zeros between calls (the finish kernel re-zeroes what
// it read). Returns a buffer of at least `floats` elements, or nullptr when it would have to grow
// and `may_grow` is false (during CUDA-graph capture) or the request exceeds the cap: the caller
// then runs without split-k. A superseded buffer that was handed out during a capture is kept,
// never freed (a captured graph may still address it); one only ever used eagerly (load-time
// warm-up, tuning) is freed when outgrown.
float* splitk_workspace(int device, size_t floats, bool may_grow);

// Largest accumulator the split-k path may ask for (bytes); beyond it split-k is not worth it.
constexpr size_t kSplitkWorkspaceCapBytes = size_t{512} << 20;

// A cuBLAS handle of `device` bound to `stream`, with a fixed workspace (capture-safe).
cublasHandle_t cublas_handle(int device, cudaStream_t stream);

// `map` = the wgmma engine's view of xh (fp16 [shards][m][k], GemmParams::xh_map) with boxes of
// 64 k x `bm` rows. Throws if the driver cannot encode it.
void encode_xh_map(CUtensorMap* map, const void* xh, int shards, int m, int k, int bm);

}  // namespace vllm_exl3
