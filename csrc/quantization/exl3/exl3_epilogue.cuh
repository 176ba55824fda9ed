// SPDX-License-Identifier: Apache-2.0
// The output side of a quantized linear for one row of one 128-column block,
// held by a warp (element e = 4 * lane + j): y = Ĥ(acc) * svh + bias, rounded
// once to the caller's dtype.
#pragma once

#include "exl3_hadamard.cuh"

namespace vllm_exl3 {

// The column factors of a warp's 4 elements. They do not depend on the sums, so
// the split-k finish loads them before waiting for the GEMM grid, off the
// tail's critical path.
struct ColumnFactors {
  float svh[4];
  float bias[4];
  bool has_bias;
};

template <typename T>
__device__ __forceinline__ void load_column_factors(const __half* svh,
                                                    const T* bias, int lane,
                                                    int col0,
                                                    ColumnFactors& f) {
  const int c = col0 + 4 * lane;
  load4_f32(svh + c, f.svh);
  f.has_bias = bias != nullptr;
  if (f.has_bias) load4_f32(bias + c, f.bias);
}

// y_row[col0 + 4 * lane + j] = v[j] * svh * scale + bias, for a row already
// through Ĥ.
template <typename T>
__device__ __forceinline__ void store_transformed_row(float (&v)[4], int lane,
                                                      const ColumnFactors& f,
                                                      T* y_row, int col0) {
#pragma unroll
  for (int j = 0; j < 4; ++j) v[j] = v[j] * kHadamardScale * f.svh[j];
  if (f.has_bias) {
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] += f.bias[j];
  }
  *reinterpret_cast<uint2*>(y_row + col0 + 4 * lane) = pack4<T>(v);
}

template <typename T>
__device__ __forceinline__ void finish_row(float (&v)[4], int lane,
                                           const ColumnFactors& f, T* y_row,
                                           int col0) {
  hadamard128(v, lane);
  store_transformed_row(v, lane, f, y_row, col0);
}

}  // namespace vllm_exl3
