// SPDX-License-Identifier: Apache-2.0
// Decode of one group of a quantized token embedding row
// (docs/design/exl3_format.md §8), one warp per group: lane t owns the 8
// consecutive elements 8t..8t+7.
//
// A group is a tail-biting ring of 256 K-bit symbols, packed lowest bit first
// into little-endian 16-bit words after one word holding the group's fp16
// scale. Position i's state is ((state_{i-1} << K) | symbol_i) & 0xFFFF around
// the ring; its value is the MUL1 codebook value of the state times the scale.
// The group is then the 256-point Walsh-Hadamard transform of those values,
// divided by 16 and multiplied by the group's signs.
//
// Every fp32 operation happens in the reference's order
// (embedding_reference.py: the butterflies in ascending stride), so the result
// is the reference's bit for bit. The per-lane parts are __host__ __device__: a
// host driver runs them (and emulates the cross-lane stages) against the
// reference without a GPU.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "exl3_trellis.cuh"

namespace vllm_exl3 {
namespace embedding {

// Elements of a group, and so of its ring and its Hadamard transform.
constexpr int kGroup = 256;
constexpr int kPerLane = kGroup / kWarpSize;
// Bits of one stored word of the ring's bitstream.
constexpr int kWordBits = 16;
// Trellis states are 16 bits wide, as in the linear's trellis.
constexpr int kStateBits = 16;
constexpr uint32_t kStateMask = (1u << kStateBits) - 1u;
// Rates the converter writes (--embed_bits 1..8; integers only).
constexpr int kMinBits = 1;
constexpr int kMaxBits = 8;
// Word 0 of a ring: the bit pattern of the group's fp16 scale.
constexpr int kScaleWords = 1;
// int16 words of one group: the scale and 256 * K stream bits.
__host__ __device__ constexpr int group_words(int bits) {
  return kScaleWords + kGroup * bits / kWordBits;
}
constexpr int kMaxGroupWords = group_words(kMaxBits);
// The Hadamard transform's normalisation 1/sqrt(256): a power of two, exact.
constexpr float kGroupNorm = 0.0625f;
// Butterfly strides inside a lane (element index bits 0..2) ...
constexpr int kLaneStrides = kPerLane / 2;
// ... and across lanes (element index bits 3..7 = lane index bits 0..4).
constexpr int kLastLaneMask = kWarpSize / 2;

// Symbol p (0..255) of a ring's bitstream `stream` (16K words): stream bits
// [p*K, p*K + K), read through a two-word window. The symbols tile the ring
// exactly, so none crosses its end: for the last word the window's wrapped
// second word only contributes bits the mask drops.
__host__ __device__ __forceinline__ uint32_t symbol_at(const uint16_t* stream,
                                                       int bits, int p) {
  const int bit = p * bits;
  const int word = bit / kWordBits;
  const int stream_words = kGroup * bits / kWordBits;
  const int next = word + 1 == stream_words ? 0 : word + 1;
  const uint32_t window = static_cast<uint32_t>(stream[word]) |
                          (static_cast<uint32_t>(stream[next]) << kWordBits);
  return (window >> (bit % kWordBits)) & ((1u << bits) - 1u);
}

// The 8 states of lane `lane`. Its first state needs the ceil(16/K) - 1
// symbols before position 8*lane, taken around the ring for lane 0; they fill
// fewer than 16 bits, so nothing is masked until the lane's own positions.
__host__ __device__ __forceinline__ void lane_states(const uint16_t* stream,
                                                     int bits, int lane,
                                                     uint32_t (&states)[8]) {
  const int older = (kStateBits + bits - 1) / bits - 1;
  const int first = lane * kPerLane;
  uint32_t state = 0;
  for (int p = first - older; p < first; ++p)
    state = (state << bits) | symbol_at(stream, bits, (p + kGroup) % kGroup);
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    state = ((state << bits) | symbol_at(stream, bits, first + j)) & kStateMask;
    states[j] = state;
  }
}

// fp16 bit pattern -> float, on both sides of the compiler.
__host__ __device__ __forceinline__ float half_bits_to_float(uint16_t bits) {
#ifdef __CUDA_ARCH__
  return __half2float(__ushort_as_half(bits));
#else
  return static_cast<float>(fp16_emulation::to_double(bits));
#endif
}

// fp32 operations rounded one by one: nvcc would otherwise contract a product
// and the sum that reads it into one fma, which rounds differently from the
// reference (one torch operation per step).
__host__ __device__ __forceinline__ float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
__host__ __device__ __forceinline__ float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
__host__ __device__ __forceinline__ float sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

// One butterfly: the lower element of a pair becomes low + high, the upper one
// low - high.
__host__ __device__ __forceinline__ float butterfly(float mine, float partner,
                                                    bool upper) {
  return upper ? sub_rn(partner, mine) : add_rn(mine, partner);
}

// Lane `lane`'s 8 elements of the ring `ring` (scale word, then the stream):
// codebook values times the scale, through the butterfly stages inside the
// lane (strides 1, 2, 4). The cross-lane stages follow (strides 8..128).
__host__ __device__ __forceinline__ void lane_values(const uint16_t* ring,
                                                     int bits, int lane,
                                                     float (&x)[8]) {
  uint32_t states[kPerLane];
  lane_states(ring + kScaleWords, bits, lane, states);
  const float scale = half_bits_to_float(ring[0]);
#pragma unroll
  for (int q = 0; q < kPerLane / 2; ++q) {
    // One MUL1 decode per pair of states: the linear's codebook code, fp16
    // rounded exactly as the format defines.
    const uint32_t pair =
        decode_pair<kMul1>(states[2 * q], states[2 * q + 1], 0u);
    x[2 * q] = mul_rn(half_bits_to_float(static_cast<uint16_t>(pair & 0xFFFFu)),
                      scale);
    x[2 * q + 1] =
        mul_rn(half_bits_to_float(static_cast<uint16_t>(pair >> 16)), scale);
  }
#pragma unroll
  for (int stride = 1; stride <= kLaneStrides; stride *= 2) {
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      if (j & stride) continue;
      const float low = x[j], high = x[j + stride];
      x[j] = butterfly(low, high, false);
      x[j + stride] = butterfly(high, low, true);
    }
  }
}

// After every butterfly stage: the normalisation, then the group's signs
// (fp16 [256], elements 8*lane..8*lane+7 are this lane's).
__host__ __device__ __forceinline__ void lane_finish(const uint16_t* signs,
                                                     int lane, float (&x)[8]) {
#pragma unroll
  for (int j = 0; j < kPerLane; ++j)
    x[j] = mul_rn(mul_rn(x[j], kGroupNorm),
                  half_bits_to_float(signs[lane * kPerLane + j]));
}

}  // namespace embedding
}  // namespace vllm_exl3
