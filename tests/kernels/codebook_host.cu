// SPDX-License-Identifier: Apache-2.0
// Host driver for tests/kernels/test_host_decode.py: runs the kernels' own pair decode
// (exl3_trellis.cuh decode_pair, compiled for the host with its exact fallbacks) over every
// 16-bit state in both halves of the pair, and writes uint16 [3 codebooks][2 halves][65536]
// (little-endian fp16 bit patterns; half 0 indexed by the even state, half 1 by the odd one).
//   codebook_host <output file>
#include <cstdio>
#include <vector>

#include "exl3_trellis.cuh"

using namespace vllm_exl3;

// The odd position's state runs through all 65536 values too, in another order (an odd
// multiplier is a bijection mod 2^16), so the two halves never see the same pairs.
constexpr uint32_t kPartnerMult = 40503u;
constexpr uint32_t kPartnerAdd = 12345u;
constexpr int kStates = 1 << 16;

template <int CB>
void table(std::vector<uint16_t>& out, uint32_t halves_xor) {
  uint16_t* even = out.data() + static_cast<size_t>(CB) * 2 * kStates;
  uint16_t* odd = even + kStates;
  for (uint32_t s = 0; s < kStates; ++s) {
    const uint32_t partner = (s * kPartnerMult + kPartnerAdd) & 0xFFFFu;
    const uint32_t v = decode_pair<CB>(s, partner, halves_xor);
    even[s] = static_cast<uint16_t>(v & 0xFFFFu);
    odd[partner] = static_cast<uint16_t>(v >> 16);
  }
}

int main(int argc, char** argv) {
  if (argc != 2) return 1;
  std::vector<uint16_t> out(3 * 2 * kStates);
  const uint32_t halves_xor = halves_xor_register();
  table<kThreeInst>(out, halves_xor);
  table<kMcg>(out, halves_xor);
  table<kMul1>(out, halves_xor);
  FILE* f = fopen(argv[1], "wb");
  if (!f) return 1;
  const bool ok = fwrite(out.data(), sizeof(uint16_t), out.size(), f) == out.size();
  return (fclose(f) == 0 && ok) ? 0 : 2;
}
