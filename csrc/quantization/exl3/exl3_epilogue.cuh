// SPDX-License-Identifier: Apache-2.0
// The output side of a quantized linear for one row of one 128-column block, held by a warp
// (element e = 4 * lane + j): y = Ĥ(acc) * svh + bias, rounded once to the caller's dtype.
#pragma once

#include "exl3_hadamard.cuh"

namespace vllm_exl3 {

template <typename T>
__device__ __forceinline__ void finish_row(float (&v)[4], int lane, const __half* svh,
                                           const T* bias, T* y_row, int col0) {
  hadamard128(v, lane);
  const int c = col0 + 4 * lane;
  float s[4];
  load4_f32(svh + c, s);
#pragma unroll
  for (int j = 0; j < 4; ++j) v[j] = v[j] * kHadamardScale * s[j];
  if (bias != nullptr) {
    float b[4];
    load4_f32(bias + c, b);
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] += b[j];
  }
  *reinterpret_cast<uint2*>(y_row + c) = pack4<T>(v);
}

}  // namespace vllm_exl3
