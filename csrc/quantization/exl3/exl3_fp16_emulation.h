// SPDX-License-Identifier: Apache-2.0
// Exact host emulation of the few fp16 operations the trellis decode uses
// (add.rn.f16x2, fma.rn.f16x2), so the decode's own source runs on the CPU in
// the codebook test (tests/kernels/test_host_decode.py) and only the PTX
// mapping is left to the GPU check. Each lane is computed in double and rounded
// once to fp16, nearest-even. A sum of two fp16 values is exact in double; an
// fma is exact when a*b+c spans <= 53 significant bits, which holds for the
// codebook operands (an integer <= 2044 times 0x1EEE plus 0xC931: 22 bits).
#pragma once

#include <cmath>
#include <cstdint>

namespace vllm_exl3 {
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
}  // namespace vllm_exl3
