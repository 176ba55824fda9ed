// SPDX-License-Identifier: Apache-2.0
// 128-point Sylvester Hadamard (H[i][j] = (-1)^popcount(i & j), unnormalised)
// held by one warp, four fp32 values per lane. H is symmetric, so x @ H = H @
// x: one butterfly per index bit. Then the epilogue built on it: the output
// side of a quantized linear for one row of one 128-column block, held by a
// warp (element e = 4 * lane + j): y = Ĥ(acc) * svh + bias, rounded once to the
// caller's dtype.
#pragma once

#include "exl3_common.cuh"

namespace vllm_exl3 {

// Any assignment of the 7 index bits to (2 slot bits j, 5 lane bits) gives the
// same transform, because popcount(i & j) does not change when i and j have
// their bits permuted alike. Callers use e = 4 * lane + j (8-byte vector loads
// of 4 consecutive values) or e = lane + 32 * j (conflict-free column walks
// through a padded shared-memory block). The two index bits inside one lane's 4
// consecutive values, in registers.
__device__ __forceinline__ void butterfly4(float (&v)[4]) {
  const float a0 = v[0] + v[1], a1 = v[0] - v[1];
  const float a2 = v[2] + v[3], a3 = v[2] - v[3];
  v[0] = a0 + a2;
  v[2] = a0 - a2;
  v[1] = a1 + a3;
  v[3] = a1 - a3;
}

// The index bits held by lanes 1, 2, ... LANES / 2 of every group of LANES
// lanes: the partner with the bit clear holds a, the one with it set holds b,
// and (a, b) -> (a + b, a - b).
template <int LANES, int R>
__device__ __forceinline__ void lane_butterflies(float (&v)[R][4], int lane) {
#pragma unroll
  for (int m = 1; m < LANES; m <<= 1) {
    const float sign = (lane & m) ? -1.0f : 1.0f;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float o = __shfl_xor_sync(kFullMask, v[r][j], m);
        v[r][j] = fmaf(sign, v[r][j], o);
      }
  }
}

// R rows at once (v[r]: one row's four values per lane): the rows' butterflies
// are independent, so their shuffles overlap and a warp pays the shuffle
// latency once per group, not per row.
template <int R>
__device__ __forceinline__ void hadamard128(float (&v)[R][4], int lane) {
#pragma unroll
  for (int r = 0; r < R; ++r) butterfly4(v[r]);  // the two slot bits
  lane_butterflies<kWarpSize>(v, lane);          // the five lane bits
}

// The same transform held by kQuadLanes lanes per row: lane part j = lane % 4
// holds the eight 4-column chunks at columns 16 i + 4 j (i < 8), v[i][q] =
// column 16 i + 4 j + q. Five of the seven index bits (q, i) are then in
// registers and only the two of j cross lanes: 8 shuffles per row against the
// 20 of hadamard128 (a warp's shuffle unit issues one per clock, which bounded
// the BM 256 epilogue; design notes, "quad epilogue").
constexpr int kQuadLanes = 4;
constexpr int kQuadChunks = kHadamard / (4 * kQuadLanes);

__device__ __forceinline__ void hadamard128_quad(float (&v)[kQuadChunks][4],
                                                 int lane) {
#pragma unroll
  for (int i = 0; i < kQuadChunks; ++i) butterfly4(v[i]);  // the two bits of q
#pragma unroll
  for (int s = 1; s < kQuadChunks; s <<= 1)  // the three bits of i
#pragma unroll
    for (int i = 0; i < kQuadChunks; ++i)
      if (!(i & s))
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float a = v[i][q], b = v[i + s][q];
          v[i][q] = a + b;
          v[i + s][q] = a - b;
        }
  lane_butterflies<kQuadLanes>(v, lane);  // the two bits of j, across lanes
}

__device__ __forceinline__ void hadamard128(float (&v)[4], int lane) {
  hadamard128<1>(reinterpret_cast<float (&)[1][4]>(v), lane);
}

// The epilogue.
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
