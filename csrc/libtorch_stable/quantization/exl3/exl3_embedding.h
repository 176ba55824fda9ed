// SPDX-License-Identifier: Apache-2.0
// The quantized token embedding's row gather (exl3_embedding.cu), as the op
// (exl3_embedding_ops.cpp) launches it. Host-only declarations.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace vllm_exl3 {

// The output element types the gather writes.
enum class EmbeddingOut : int { kFloat = 0, kHalf = 1, kBFloat16 = 2 };

struct EmbeddingParams {
  const void* ids;        // [tokens] int32 or int64
  bool ids_int64;         // the ids' type
  const int16_t* table;   // trellis [rows, groups * group_words(bits)]
  const uint16_t* signs;  // fp16 bit patterns [groups, 256]
  void* out;              // [tokens, hidden] of `out_type`
  EmbeddingOut out_type;
  int64_t tokens;
  int64_t rows;
  int groups;
  int bits;
  int hidden;
};

// Enqueues the gather on `stream`: out[t] = row ids[t] of the table, decoded.
// An id outside [0, rows) stops the kernel with a message naming it.
void launch_embedding(const EmbeddingParams& p, cudaStream_t stream);

}  // namespace vllm_exl3
