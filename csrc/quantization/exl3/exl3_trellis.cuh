// SPDX-License-Identifier: Apache-2.0
// Trellis decode: one lane's 8 consecutive positions of a 16x16 tile -> its two mma B fragments.
//
// exl3-format.md §3: a tile is a tail-biting ring of 256 codes packed MSB-first into uint32 words
// (read little-endian, bit 31 of word u is stream bit 32u). The state of position i is the 16
// stream bits ending at S_i. Lane t owns positions 8t..8t+7 (§3.2), whose window ends lie at
// 4*t*K2 + E_j with compile-time E_j (K2 = twice the bitrate; for half rates odd positions carry
// one extra bit). So a lane aligns its window once per tile (one funnel shift per word) and then
// cuts every state at a compile-time bit offset.
//
// The state extraction is __host__ __device__ so a CPU test can check it against the reference.
#pragma once

#include <utility>

#include "exl3_common.cuh"

namespace vllm_exl3 {

__host__ __device__ __forceinline__ uint32_t funnel_l(uint32_t lo, uint32_t hi, int s) {
#ifdef __CUDA_ARCH__
  return __funnelshift_l(lo, hi, s);
#else
  return static_cast<uint32_t>(((static_cast<uint64_t>(hi) << 32 | lo) << (s & 31)) >> 32);
#endif
}
__host__ __device__ __forceinline__ uint32_t funnel_r(uint32_t lo, uint32_t hi, int s) {
#ifdef __CUDA_ARCH__
  return __funnelshift_r(lo, hi, s);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(hi) << 32 | lo) >> (s & 31));
#endif
}

// Bit geometry of one rate. K2 = 2 * bits: 2..16 even for integer rates, 3/5/7 for 1.5/2.5/3.5.
template <int K2>
struct Rate {
  static constexpr bool kHalf = (K2 & 1) != 0;
  static constexpr int kLow = K2 / 2;  // bits of an even position (all positions if integer)
  static constexpr int kTileWords = 4 * K2;  // uint32 words per tile (256 * K / 32)
  static constexpr int kTileBytes = 16 * K2;
  static constexpr int kRingBits = 128 * K2;
  static constexpr int kLaneBits = 4 * K2;  // stream bits a lane's 8 codes take
  // End (exclusive) of lane-local position j's code, relative to the lane's first bit.
  __host__ __device__ static constexpr int end(int j) {
    return kHalf ? kLow * (j + 1) + (j + 1) / 2 : kLow * (j + 1);
  }
  // A lane needs the bits from the first state's start to the last state's end.
  static constexpr int kWindowBits = end(7) - end(0) + 16;
  static constexpr int kAligned = (kWindowBits + 31) / 32;
  // One more raw word than aligned words: the alignment shift pulls bits from the next word.
  static constexpr int kRaw = kAligned + 1;
  static_assert(K2 >= 2 && K2 <= 16, "bitrate out of range");
  static_assert(kAligned <= 3, "window must fit three words");
};

// Per-lane constants: byte offsets of the raw words inside a tile (ring wrap already applied)
// and the alignment shift. The same for every tile, so computed once per kernel.
template <int K2>
struct LaneWindow {
  uint32_t off[Rate<K2>::kRaw];
  int shift;
  __host__ __device__ __forceinline__ void init(int lane) {
    using R = Rate<K2>;
    int start = lane * R::kLaneBits + R::end(0) - 16;
    if (start < 0) start += R::kRingBits;  // lane 0's first state wraps to the ring's end
    const int word = start >> 5;
    shift = start & 31;
#pragma unroll
    for (int i = 0; i < R::kRaw; ++i) {
      int w = word + i;
      if (w >= R::kTileWords) w -= R::kTileWords;
      off[i] = static_cast<uint32_t>(w) * 4u;
    }
  }
};

// State j of a lane from its aligned window words w (window bit 0 = bit 31 of w[0]). The bit
// offset is a compile-time constant, so each state is one shift (+ mask) or one funnel shift.
template <int K2, int J>
__host__ __device__ __forceinline__ uint32_t state_at(const uint32_t (&w)[Rate<K2>::kAligned]) {
  using R = Rate<K2>;
  constexpr int o = R::end(J) - R::end(0);  // window bit where state J starts
  constexpr int i = o >> 5, r = o & 31;
  if constexpr (r == 0) {
    return w[i] >> 16;  // already 16 bits wide
  } else if constexpr (r <= 16) {
    return (w[i] >> (16 - r)) & 0xFFFFu;
  } else {
    static_assert(i + 1 < R::kAligned, "state straddles past the window");
    return funnel_r(w[i + 1], w[i], 48 - r) & 0xFFFFu;
  }
}

template <int K2, int... J>
__host__ __device__ __forceinline__ void states_at(const uint32_t (&w)[Rate<K2>::kAligned],
                                                   uint32_t (&st)[8],
                                                   std::integer_sequence<int, J...>) {
  ((st[J] = state_at<K2, J>(w)), ...);
}

// The 8 states of a lane, given the tile's raw words (already loaded, see load_raw).
template <int K2>
__host__ __device__ __forceinline__ void states_from_raw(const uint32_t (&raw)[Rate<K2>::kRaw],
                                                         int shift, uint32_t (&st)[8]) {
  using R = Rate<K2>;
  uint32_t w[R::kAligned];
#pragma unroll
  for (int i = 0; i < R::kAligned; ++i) w[i] = funnel_l(raw[i + 1], raw[i], shift);
  states_at<K2>(w, st, std::make_integer_sequence<int, kPositionsPerLane>{});
}

template <int K2>
__host__ __device__ __forceinline__ void load_raw(const uint8_t* tile, const LaneWindow<K2>& lw,
                                                  uint32_t (&raw)[Rate<K2>::kRaw]) {
#pragma unroll
  for (int i = 0; i < Rate<K2>::kRaw; ++i)
    raw[i] = *reinterpret_cast<const uint32_t*>(tile + lw.off[i]);
}

#ifdef __CUDACC__
// Codebook decode of two states into one half2 register (low half = the even position, which
// is the lower k row of the B fragment pair, §3.2). Exactly one fp16 rounding, as the format says.
// (x & mask) ^ c in one LOP3 (LUT 0xF0 & 0xCC ^ 0xAA = 0x6A). A SASS LOP3 encodes one immediate,
// so c must come in a register (loaded once per kernel); written as C the compiler emits two.
template <uint32_t kMask>
__device__ __forceinline__ uint32_t and_xor(uint32_t x, uint32_t c) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0x6A;\n" : "=r"(r) : "r"(x), "n"(kMask), "r"(c));
  return r;
}

template <int CB>
__device__ __forceinline__ uint32_t decode_pair(uint32_t sa, uint32_t sb, uint32_t halves_xor) {
  if constexpr (CB == kMul1) {
    const uint32_t xa = sa * kMul1Mult;
    const uint32_t xb = sb * kMul1Mult;
    // Low half: 0x6400 + byte sum of xa; high half: 0x6400 + byte sum of xb (sums <= 1020).
    const uint32_t ta = __dp4a(xa, kMul1ByteOnes, kMul1Base2);
    const uint32_t tb = __dp4a(xb, kMul1ByteOnes, 0u);
    const uint32_t packed = ta + (tb << 16);
    const __half2 scale = __half2(__ushort_as_half(kMul1ScaleBits), __ushort_as_half(kMul1ScaleBits));
    const __half2 bias = __half2(__ushort_as_half(kMul1BiasBits), __ushort_as_half(kMul1BiasBits));
    __half2 v = __hfma2(*reinterpret_cast<const __half2*>(&packed), scale, bias);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    uint32_t xa, xb;
    if constexpr (CB == kThreeInst) {
      xa = sa * kThreeInstMult + kThreeInstAdd;
      xb = sb * kThreeInstMult + kThreeInstAdd;
    } else {
      xa = sa * kMcgMult;
      xb = sb * kMcgMult;
    }
    xa = and_xor<kHalvesAnd>(xa, halves_xor);
    xb = and_xor<kHalvesAnd>(xb, halves_xor);
    // value = fp16(lo) + fp16(hi): gather the low halves and the high halves, one HADD2.
    const uint32_t lo = __byte_perm(xa, xb, 0x5410);
    const uint32_t hi = __byte_perm(xa, xb, 0x7632);
    __half2 v = __hadd2(*reinterpret_cast<const __half2*>(&lo),
                        *reinterpret_cast<const __half2*>(&hi));
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// A lane's two B fragments for the tile at `tile` (shared or global memory):
// b[0], b[1] = n-columns 0..7, b[2], b[3] = n-columns 8..15.
// `halves_xor` is kHalvesXor held in a register (see and_xor); MUL1 ignores it.
template <int K2, int CB>
__device__ __forceinline__ void fragments_from_raw(const uint32_t (&raw)[Rate<K2>::kRaw], int shift,
                                                   uint32_t halves_xor, uint32_t (&b)[4]) {
  uint32_t st[8];
  states_from_raw<K2>(raw, shift, st);
#pragma unroll
  for (int q = 0; q < 4; ++q) b[q] = decode_pair<CB>(st[2 * q], st[2 * q + 1], halves_xor);
}

template <int K2, int CB>
__device__ __forceinline__ void decode_fragments(const uint8_t* tile, const LaneWindow<K2>& lw,
                                                 uint32_t halves_xor, uint32_t (&b)[4]) {
  uint32_t raw[Rate<K2>::kRaw];
  load_raw<K2>(tile, lw, raw);
  fragments_from_raw<K2, CB>(raw, lw.shift, halves_xor, b);
}

// kHalvesXor in a register the compiler cannot fold back into an immediate.
__device__ __forceinline__ uint32_t halves_xor_register() {
  uint32_t r;
  asm volatile("mov.b32 %0, %1;\n" : "=r"(r) : "n"(kHalvesXor));
  return r;
}

// A lane's raw words of one tile in shared memory: per-word byte offsets from `base` (ring wrap
// already applied) plus the tile's offset, a compile-time constant inside an unrolled stage.
template <int K2>
__device__ __forceinline__ void load_tile_words(const uint8_t* base,
                                                const uint32_t (&off)[Rate<K2>::kRaw],
                                                uint32_t tile_offset,
                                                uint32_t (&raw)[Rate<K2>::kRaw]) {
#pragma unroll
  for (int i = 0; i < Rate<K2>::kRaw; ++i)
    raw[i] = *reinterpret_cast<const uint32_t*>(base + off[i] + tile_offset);
}
// Tile coordinates of lane position j (0..7): row (k) and column (n) inside the 16x16 tile.
__device__ __forceinline__ int position_row(int lane, int j) {
  return 2 * (lane & 3) + (j & 1) + 8 * ((j >> 1) & 1);
}
__device__ __forceinline__ int position_col(int lane, int j) {
  return (lane >> 2) + 8 * ((j >> 2) & 1);
}
#endif

}  // namespace vllm_exl3
