// SPDX-License-Identifier: Apache-2.0
// Trellis decode: one lane's 8 consecutive positions of a 16x16 tile -> its two
// mma B fragments.
//
// docs/design/exl3_format.md §3: a tile is a tail-biting ring of 256 codes
// packed MSB-first into uint32 words (read little-endian, bit 31 of word u is
// stream bit 32u). The state of position i is the 16 stream bits ending at S_i.
// Lane t owns positions 8t..8t+7 (§3.2), whose window ends lie at 4*t*K2 + E_j
// with compile-time E_j (K2 = twice the bitrate; for half rates odd positions
// carry one extra bit). So every state sits at a compile-time offset from the
// lane's window start; a per-rate plan (CutPlan) cuts the 8 states with one
// instruction each plus a few funnel shifts.
//
// The state extraction is __host__ __device__ so a CPU test can check it
// against the reference.
#pragma once

#include <cmath>
#include <cstdint>
#include <utility>

#include "exl3_common.cuh"

namespace vllm_exl3 {

// Exact host emulation of the few fp16 operations the trellis decode uses
// (add.rn.f16x2, fma.rn.f16x2), so the decode's own source runs on the CPU in
// the codebook test (tests/kernels/test_host_decode.py) and only the PTX
// mapping is left to the GPU check. Each lane is computed in double and rounded
// once to fp16, nearest-even. A sum of two fp16 values is exact in double; an
// fma is exact when a*b+c spans <= 53 significant bits, which holds for the
// codebook operands (an integer <= 2044 times 0x1EEE plus 0xC931: 22 bits).
namespace fp16_emulation {

inline double to_double(uint16_t h) {
  const int exp = (h >> 10) & 0x1F;
  const int mant = h & 0x3FF;
  double v;
  if (exp == 0x1F) {
    v = mant ? NAN : INFINITY;
  } else if (exp == 0) {
    v = std::ldexp(static_cast<double>(mant), -24);  // subnormal: quantum 2^-24
  } else {
    v = std::ldexp(static_cast<double>(1024 + mant), exp - 25);
  }
  return (h & 0x8000) ? -v : v;
}

// Round to the nearest fp16 (ties to even), saturating to infinity past the
// largest finite.
inline uint16_t from_double(double v) {
  const uint16_t sign = std::signbit(v) ? 0x8000 : 0;
  if (std::isnan(v)) return 0x7E00;
  const double a = std::fabs(v);
  if (a == 0.0) return sign;
  int e = 0;
  std::frexp(a, &e);         // a = f * 2^e, f in [0.5, 1)
  int exp = e - 1;           // a in [2^exp, 2^(exp+1))
  if (exp < -14) exp = -14;  // below the normal range the quantum stays 2^-24
  const double quantum = std::ldexp(1.0, exp - 10);
  const double m =
      std::nearbyint(a / quantum);  // the default rounding mode: nearest-even
  const double r = m * quantum;
  if (r > 65504.0) return sign | 0x7C00;
  if (r < std::ldexp(1.0, -14))
    return sign | static_cast<uint16_t>(m);  // subnormal
  std::frexp(r, &e);
  const int mant = static_cast<int>(std::ldexp(r, 11 - e)) -
                   1024;  // r = (1024+mant) 2^(e-11)
  return sign | static_cast<uint16_t>(((e - 1 + 15) << 10) | mant);
}

inline uint32_t add2(uint32_t a, uint32_t b) {
  uint32_t r = 0;
  for (int h = 0; h < 2; ++h) {
    const double s = to_double(a >> (16 * h)) + to_double(b >> (16 * h));
    r |= static_cast<uint32_t>(from_double(s)) << (16 * h);
  }
  return r;
}

inline uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r = 0;
  for (int h = 0; h < 2; ++h) {
    const double s = to_double(a >> (16 * h)) * to_double(b >> (16 * h)) +
                     to_double(c >> (16 * h));
    r |= static_cast<uint32_t>(from_double(s)) << (16 * h);
  }
  return r;
}

}  // namespace fp16_emulation

__host__ __device__ __forceinline__ uint32_t funnel_l(uint32_t lo, uint32_t hi,
                                                      int s) {
#ifdef __CUDA_ARCH__
  return __funnelshift_l(lo, hi, s);
#else
  return static_cast<uint32_t>(
      ((static_cast<uint64_t>(hi) << 32 | lo) << (s & 31)) >> 32);
#endif
}
// Byte permute (PRMT): output byte i = byte (sel >> 4i) & 7 of the 8-byte value
// b:a (default mode).
__host__ __device__ __forceinline__ uint32_t byte_perm(uint32_t a, uint32_t b,
                                                       uint32_t sel) {
#ifdef __CUDA_ARCH__
  return __byte_perm(a, b, sel);
#else
  const uint64_t v = static_cast<uint64_t>(b) << 32 | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i)
    r |= static_cast<uint32_t>((v >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF)
         << (8 * i);
  return r;
#endif
}

constexpr int gcd_int(int a, int b) { return b == 0 ? a : gcd_int(b, a % b); }

// Bit geometry of one rate. K2 = 2 * bits: 2..16 even for integer rates, 3/5/7
// for 1.5/2.5/3.5.
template <int K2>
struct Rate {
  static constexpr bool kHalf = (K2 & 1) != 0;
  static constexpr int kLow =
      K2 / 2;  // bits of an even position (all positions if integer)
  static constexpr int kTileWords =
      4 * K2;  // uint32 words per tile (256 * K / 32)
  static constexpr int kTileBytes = 16 * K2;
  static constexpr int kRingBits = 128 * K2;
  static constexpr int kLaneBits = 4 * K2;  // stream bits a lane's 8 codes take
  // End (exclusive) of lane-local position j's code, relative to the lane's
  // first bit.
  __host__ __device__ static constexpr int end(int j) {
    return kHalf ? kLow * (j + 1) + (j + 1) / 2 : kLow * (j + 1);
  }
  // A lane needs the bits from the first state's start to the last state's end.
  static constexpr int kWindowBits = end(7) - end(0) + 16;
  static constexpr int kAligned = (kWindowBits + 31) / 32;
  // Lane t's window starts at stream bit t * kLaneBits + end(0) - 16 (mod the
  // ring, a multiple of 32), so its bit offset inside its first word takes the
  // values kShiftBase mod kShiftStep, stepping by kShiftStep. With 4 or 8 bits
  // (kLaneBits a multiple of 32) it is the same for every lane: a compile-time
  // constant.
  static constexpr int kShiftStep = gcd_int(kLaneBits, 32);
  static constexpr int kShiftBase = ((end(0) - 16) % 32 + 32) % 32;
  static constexpr bool kFixedShift = kShiftStep == 32;
  static constexpr int kMaxShift = 32 - kShiftStep + kShiftBase % kShiftStep;
  // Words a lane loads: enough for the window at the largest offset any lane
  // has.
  static constexpr int kRaw = (kMaxShift + kWindowBits + 31) / 32;
  // First word pair (i, i+1) that is one 8-byte-aligned load for every lane
  // (consecutive, no ring wrap between them, i even in the tile), or -1. With 8
  // bits every lane's first word is odd, so its words 1 and 2 come in one
  // 64-bit load.
  static constexpr int paired_word() {
    for (int i = 0; i + 1 < kRaw; ++i) {
      bool all = true;
      for (int lane = 0; lane < 32 && all; ++lane) {
        int start = lane * kLaneBits + end(0) - 16;
        if (start < 0) start += kRingBits;
        const int w = ((start >> 5) + i) %
                      kTileWords;  // after the ring wrap, as LaneWindow
        all = w % 2 == 0 && w + 1 < kTileWords;
      }
      if (all) return i;
    }
    return -1;
  }
  static constexpr int kPairedWord = paired_word();
  static_assert(K2 >= 2 && K2 <= 16, "bitrate out of range");
  static_assert(kAligned <= 3 && kRaw <= 4,
                "window must fit 3 aligned (4 raw) words");
};

// How a lane cuts its 8 states out of its words, fixed per rate at compile
// time. A view is 32 consecutive stream bits (one funnel shift, or free where
// it starts on a word). A state starting at bit 0, 8 or 16 of a view costs one
// instruction (shift, byte permute, mask), so the plan covers the 8 states with
// few views: states 16 bits apart share one view, and so do states 8 bits
// apart. The source words are the raw words themselves when the lane offset is
// a compile-time constant (4 and 8 bits), else the words aligned once to the
// window's first bit. At most one view per state, plus the free word views
// considered while planning.
constexpr int kMaxViews = kPositionsPerLane + 4;
struct CutPlan {
  int views;
  int view_bit[kMaxViews];  // first bit of each view, counted from bit 31 of
                            // source word 0
  int state_view[8];
  int state_rel[8];      // 0, 8 or 16: where the state starts inside its view
  int state_partner[8];  // for rel 16: the state at rel 0 of the same view,
                         // else -1
};

template <int K2>
constexpr CutPlan make_cut_plan() {
  using R = Rate<K2>;
  // Offset of the window inside the source words, and the words available.
  constexpr int base = R::kFixedShift ? R::kShiftBase : 0;
  constexpr int words = R::kFixedShift ? R::kRaw : R::kAligned;
  CutPlan p{};
  // Views that start on a word boundary are free: the word itself. Register
  // them first.
  bool free_view[kMaxViews] = {};
  for (int i = 0; i < words; ++i) {
    if (32 * i < base) continue;
    free_view[p.views] = true;
    p.view_bit[p.views++] = 32 * i;
  }
  bool used[kMaxViews] = {};
  for (int j = 0; j < 8; ++j) {
    const int bit = base + R::end(j) - R::end(0);
    int v = -1;
    for (int c = 0; c < p.views && v < 0; ++c) {
      const int rel = bit - p.view_bit[c];
      if (rel == 0 || rel == 8 || rel == 16) v = c;
    }
    if (v < 0) {
      v = p.views;
      p.view_bit[p.views++] = bit;
    }
    used[v] = true;
    p.state_view[j] = v;
    p.state_rel[j] = bit - p.view_bit[v];
  }
  // Drop free views no state uses (they would cost nothing, but keep the plan
  // minimal to read).
  int remap[kMaxViews] = {};
  int n = 0;
  for (int c = 0; c < p.views; ++c) {
    if (!used[c] && free_view[c]) continue;
    remap[c] = n;
    p.view_bit[n++] = p.view_bit[c];
  }
  p.views = n;
  for (int j = 0; j < 8; ++j) p.state_view[j] = remap[p.state_view[j]];
  for (int j = 0; j < 8; ++j) {
    p.state_partner[j] = -1;
    for (int i = 0; i < j && p.state_rel[j] == 16; ++i)
      if (p.state_view[i] == p.state_view[j] && p.state_rel[i] == 0)
        p.state_partner[j] = i;
  }
  return p;
}

template <int K2>
struct Cuts {
  static constexpr CutPlan kPlan = make_cut_plan<K2>();
};

// Per-lane constants: byte offsets of the raw words inside a tile (ring wrap
// already applied) and the alignment shift. The same for every tile, so
// computed once per kernel.
template <int K2>
struct LaneWindow {
  uint32_t off[Rate<K2>::kRaw];
  int shift;
  __host__ __device__ __forceinline__ void init(int lane) {
    using R = Rate<K2>;
    int start = lane * R::kLaneBits + R::end(0) - 16;
    if (start < 0)
      start += R::kRingBits;  // lane 0's first state wraps to the ring's end
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

// View V of the plan from the source words x. Bits of a view past the last
// source word are never read by its states (the plan keeps every state inside
// the window), so the last word stands in.
template <int K2, int V, int N>
__host__ __device__ __forceinline__ uint32_t view_at(const uint32_t (&x)[N]) {
  constexpr int bit = Cuts<K2>::kPlan.view_bit[V];
  constexpr int i = bit >> 5, r = bit & 31;
  static_assert(i < N, "view starts past the source words");
  if constexpr (r == 0) {
    return x[i];
  } else {
    return funnel_l(x[i + 1 < N ? i + 1 : i], x[i], r);
  }
}

template <int K2, int J>
__host__ __device__ __forceinline__ uint32_t
state_at(const uint32_t (&v)[kMaxViews]) {
  constexpr int rel = Cuts<K2>::kPlan.state_rel[J];
  const uint32_t x = v[Cuts<K2>::kPlan.state_view[J]];
  if constexpr (rel == 0) {
    return x >> 16;
  } else if constexpr (rel == 8) {
    return byte_perm(x, 0u, 0x4421);  // bytes 1, 2 of x, zero above
  } else {
    static_assert(rel == 16, "a state starts at bit 0, 8 or 16 of its view");
    return x & 0xFFFFu;
  }
}

template <int K2, int N, int... V>
__host__ __device__ __forceinline__ void views_at(
    const uint32_t (&x)[N], uint32_t (&v)[kMaxViews],
    std::integer_sequence<int, V...>) {
  ((v[V] = view_at<K2, V>(x)), ...);
}

template <int K2, int... J>
__host__ __device__ __forceinline__ void states_at(
    const uint32_t (&v)[kMaxViews], uint32_t (&st)[8],
    std::integer_sequence<int, J...>) {
  ((st[J] = state_at<K2, J>(v)), ...);
}

// The plan's views of a lane's window, given the tile's raw words (see
// load_raw). `shift` is LaneWindow::shift; rates whose shift is a compile-time
// constant ignore it.
template <int K2>
__host__ __device__ __forceinline__ void views_from_raw(
    const uint32_t (&raw)[Rate<K2>::kRaw], int shift,
    uint32_t (&v)[kMaxViews]) {
  using R = Rate<K2>;
  using C = Cuts<K2>;
  if constexpr (R::kFixedShift) {
    (void)shift;
    views_at<K2>(raw, v, std::make_integer_sequence<int, C::kPlan.views>{});
  } else {
    uint32_t w[R::kAligned];
#pragma unroll
    for (int i = 0; i < R::kAligned; ++i)
      w[i] = funnel_l(raw[i + 1 < R::kRaw ? i + 1 : i], raw[i], shift);
    views_at<K2>(w, v, std::make_integer_sequence<int, C::kPlan.views>{});
  }
}

// The 8 states of a lane (the extraction test's view of the plan; the kernels
// go straight from views to products, see fragments_from_raw).
template <int K2>
__host__ __device__ __forceinline__ void states_from_raw(
    const uint32_t (&raw)[Rate<K2>::kRaw], int shift, uint32_t (&st)[8]) {
  uint32_t v[kMaxViews];
  views_from_raw<K2>(raw, shift, v);
  states_at<K2>(v, st, std::make_integer_sequence<int, kPositionsPerLane>{});
}

// A lane's raw words of one tile: per-word byte offsets from `base` (ring wrap
// already applied) plus `extra` (the tile's offset, a compile-time constant
// inside an unrolled stage). Where every lane's words i, i+1 are one aligned
// pair (Rate::kPairedWord), they come in one 8-byte load.
template <int K2>
__host__ __device__ __forceinline__ void load_words(
    const uint8_t* base, const uint32_t (&off)[Rate<K2>::kRaw], uint32_t extra,
    uint32_t (&raw)[Rate<K2>::kRaw]) {
  constexpr int pair = Rate<K2>::kPairedWord;
#pragma unroll
  for (int i = 0; i < Rate<K2>::kRaw; ++i) {
    if (i == pair) {
      const uint2 two = *reinterpret_cast<const uint2*>(base + off[i] + extra);
      raw[i] = two.x;
      raw[i + 1] = two.y;
    } else if (pair < 0 || i != pair + 1) {
      raw[i] = *reinterpret_cast<const uint32_t*>(base + off[i] + extra);
    }
  }
}

template <int K2>
__host__ __device__ __forceinline__ void load_raw(
    const uint8_t* tile, const LaneWindow<K2>& lw,
    uint32_t (&raw)[Rate<K2>::kRaw]) {
  load_words<K2>(tile, lw.off, 0u, raw);
}

// The codebook arithmetic's instructions, each with an exact host fallback
// (selected only by
// __CUDA_ARCH__) so the same decode source is checked on the CPU for every
// state. (x & mask) ^ c in one LOP3 (LUT 0xF0 & 0xCC ^ 0xAA = 0x6A). A SASS
// LOP3 encodes one immediate, so c must come in a register (loaded once per
// kernel); written as C the compiler emits two.
template <uint32_t kMask>
__host__ __device__ __forceinline__ uint32_t and_xor(uint32_t x, uint32_t c) {
#ifdef __CUDA_ARCH__
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0x6A;\n"
      : "=r"(r)
      : "r"(x), "n"(kMask), "r"(c));
  return r;
#else
  return (x & kMask) ^ c;
#endif
}

// Unsigned 4-byte dot product plus c (dp4a.u32.u32).
__host__ __device__ __forceinline__ uint32_t dot4_u8(uint32_t a, uint32_t b,
                                                     uint32_t c) {
#ifdef __CUDA_ARCH__
  return __dp4a(a, b, c);
#else
  for (int i = 0; i < 4; ++i)
    c += ((a >> (8 * i)) & 0xFF) * ((b >> (8 * i)) & 0xFF);
  return c;
#endif
}

// fp16(low half) + fp16(high half) of x, one round-to-nearest-even, in both
// halves of the result: one HADD2 whose operands are x's two halves broadcast
// (an operand swizzle, free).
__host__ __device__ __forceinline__ uint32_t add_halves_f16(uint32_t x) {
#ifdef __CUDA_ARCH__
  const __half2 h = *reinterpret_cast<const __half2*>(&x);
  __half2 v = __hadd2(__low2half2(h), __high2half2(h));
  return *reinterpret_cast<uint32_t*>(&v);
#else
  return fp16_emulation::add2((x & 0xFFFFu) * 0x10001u, (x >> 16) * 0x10001u);
#endif
}
__host__ __device__ __forceinline__ uint32_t fma_f16x2(uint32_t a, uint32_t b,
                                                       uint32_t c) {
#ifdef __CUDA_ARCH__
  __half2 v = __hfma2(*reinterpret_cast<const __half2*>(&a),
                      *reinterpret_cast<const __half2*>(&b),
                      *reinterpret_cast<const __half2*>(&c));
  return *reinterpret_cast<uint32_t*>(&v);
#else
  return fp16_emulation::fma2(a, b, c);
#endif
}

// The codebooks (docs/design/exl3_format.md §4) in two steps: the 32-bit
// integer product of a state, then the fp16 value of two products packed into
// one half2 register (low half = the even position, the lower k row of the B
// fragment pair, §3.2), with exactly one fp16 rounding per value.
template <int CB>
struct Codebook {
  static constexpr uint32_t kMult =
      CB == kThreeInst ? kThreeInstMult : (CB == kMcg ? kMcgMult : kMul1Mult);
  static constexpr uint32_t kAdd = CB == kThreeInst ? kThreeInstAdd : 0u;
};

template <int CB>
__host__ __device__ __forceinline__ uint32_t product(uint32_t state) {
  return state * Codebook<CB>::kMult + Codebook<CB>::kAdd;
}

template <int CB>
__host__ __device__ __forceinline__ uint32_t
values_from_products(uint32_t xa, uint32_t xb, uint32_t halves_xor) {
  if constexpr (CB == kMul1) {
    // Low half: 0x6400 + byte sum of xa; high half: 0x6400 + byte sum of xb
    // (sums <= 1020, so the low half never carries into the high one).
    const uint32_t ta = dot4_u8(xa, kMul1ByteOnes, kMul1Base2);
    const uint32_t tb = dot4_u8(xb, kMul1ByteOnes, 0u);
    const uint32_t packed = ta + (tb << 16);
    constexpr uint32_t kScale2 = kMul1ScaleBits * 0x10001u,
                       kBias2 = kMul1BiasBits * 0x10001u;
    return fma_f16x2(packed, kScale2, kBias2);
  } else {
    xa = and_xor<kHalvesAnd>(xa, halves_xor);
    xb = and_xor<kHalvesAnd>(xb, halves_xor);
    // value = fp16(lo) + fp16(hi) per state, then one byte permute packs the
    // pair. (Gathering both low halves and both high halves first also takes 5
    // instructions, but 4 of them on the integer ALU pipe, which the rest of
    // the decode already loads most: see sass_loop.py.)
    return byte_perm(add_halves_f16(xa), add_halves_f16(xb), 0x5410);
  }
}

// Two states -> one half2 B-fragment register (the codebook test drives this on
// the CPU).
template <int CB>
__host__ __device__ __forceinline__ uint32_t decode_pair(uint32_t sa,
                                                         uint32_t sb,
                                                         uint32_t halves_xor) {
  return values_from_products<CB>(product<CB>(sa), product<CB>(sb), halves_xor);
}

// Product of state J straight from its view. A state at bit 16 of a view whose
// bit-0 state P is also cut: with v = s_P * 2^16 + s_J, v * mult = s_J * mult +
// (s_P * mult) * 2^16 (mod 2^32), so s_J's product is v * mult - x_P * 2^16:
// two IMADs on the FMA pipe instead of a mask on the ALU pipe and one IMAD (MCG
// only: 3INST's addend costs the compiler an extra instruction there, and
// MUL1's decode already leans on the FMA-pipe side with dp4a and the fp16 fma).
template <int K2, int CB, int J>
__host__ __device__ __forceinline__ uint32_t
product_at(const uint32_t (&v)[kMaxViews], const uint32_t (&x)[8]) {
  constexpr int partner = Cuts<K2>::kPlan.state_partner[J];
  if constexpr (partner >= 0 && CB == kMcg) {
    static_assert(Codebook<CB>::kAdd == 0,
                  "the shortcut assumes a pure multiply");
    return v[Cuts<K2>::kPlan.state_view[J]] * Codebook<CB>::kMult -
           x[partner] * 0x10000u;
  } else {
    return product<CB>(state_at<K2, J>(v));
  }
}

template <int K2, int CB, int... J>
__host__ __device__ __forceinline__ void products_at(
    const uint32_t (&v)[kMaxViews], uint32_t (&x)[8],
    std::integer_sequence<int, J...>) {
  ((x[J] = product_at<K2, CB, J>(v, x)),
   ...);  // in order: a partner precedes its state
}

// A lane's two B fragments for the tile at `tile` (shared or global memory):
// b[0], b[1] = n-columns 0..7, b[2], b[3] = n-columns 8..15.
// `halves_xor` is kHalvesXor held in a register (see and_xor); MUL1 ignores it.
template <int K2, int CB>
__host__ __device__ __forceinline__ void fragments_from_raw(
    const uint32_t (&raw)[Rate<K2>::kRaw], int shift, uint32_t halves_xor,
    uint32_t (&b)[4]) {
  uint32_t v[kMaxViews], x[8];
  views_from_raw<K2>(raw, shift, v);
  products_at<K2, CB>(v, x,
                      std::make_integer_sequence<int, kPositionsPerLane>{});
#pragma unroll
  for (int q = 0; q < 4; ++q)
    b[q] = values_from_products<CB>(x[2 * q], x[2 * q + 1], halves_xor);
}

template <int K2, int CB>
__host__ __device__ __forceinline__ void decode_fragments(
    const uint8_t* tile, const LaneWindow<K2>& lw, uint32_t halves_xor,
    uint32_t (&b)[4]) {
  uint32_t raw[Rate<K2>::kRaw];
  load_raw<K2>(tile, lw, raw);
  fragments_from_raw<K2, CB>(raw, lw.shift, halves_xor, b);
}

// kHalvesXor in a register the compiler cannot fold back into an immediate.
__host__ __device__ __forceinline__ uint32_t halves_xor_register() {
#ifdef __CUDA_ARCH__
  uint32_t r;
  asm volatile("mov.b32 %0, %1;\n" : "=r"(r) : "n"(kHalvesXor));
  return r;
#else
  return kHalvesXor;
#endif
}

#ifdef __CUDACC__
// Tile coordinates of lane position j (0..7): row (k) and column (n) inside the
// 16x16 tile.
__device__ __forceinline__ int position_row(int lane, int j) {
  return 2 * (lane & 3) + (j & 1) + 8 * ((j >> 1) & 1);
}
__device__ __forceinline__ int position_col(int lane, int j) {
  return (lane >> 2) + 8 * ((j >> 2) & 1);
}
#endif

}  // namespace vllm_exl3
