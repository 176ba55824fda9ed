// SPDX-License-Identifier: Apache-2.0
// Host driver for tests/kernels/test_host_decode.py: runs the kernels' own decode
// (exl3_trellis.cuh, compiled for the host with its exact fallbacks) in one of three modes:
//
//   decode_host codebook <output file>
//     decode_pair over every 16-bit state in both halves of the pair; writes uint16
//     [3 codebooks][2 halves][65536] (little-endian fp16 bit patterns; half 0 indexed by the
//     even state, half 1 by the odd one).
//   decode_host states <K2> <tiles> <file of int16 words>
//     the per-lane state extraction; prints the 256 states of each tile in trellis-position
//     order (lane t, slot j -> position 8t + j).
//   decode_host fragments <K2> <codebook> <tiles> <file of int16 words>
//     the whole per-lane decode_fragments (the rate's cut plan, the codebook products with
//     their paired-view shortcut, the fp16 values); prints the 256 fp16 bit patterns of each
//     tile in trellis-position order (lane t, register q, half h -> position 8t + 2q + h).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "exl3_trellis.cuh"

using namespace vllm_exl3;

// The odd position's state runs through all 65536 values too, in another order (an odd
// multiplier is a bijection mod 2^16), so the two halves never see the same pairs.
constexpr uint32_t kPartnerMult = 40503u;
constexpr uint32_t kPartnerAdd = 12345u;
constexpr int kStates = 1 << 16;

template <int CB>
void codebook_table(std::vector<uint16_t>& out, uint32_t halves_xor) {
  uint16_t* even = out.data() + static_cast<size_t>(CB) * 2 * kStates;
  uint16_t* odd = even + kStates;
  for (uint32_t s = 0; s < kStates; ++s) {
    const uint32_t partner = (s * kPartnerMult + kPartnerAdd) & 0xFFFFu;
    const uint32_t v = decode_pair<CB>(s, partner, halves_xor);
    even[s] = static_cast<uint16_t>(v & 0xFFFFu);
    odd[partner] = static_cast<uint16_t>(v >> 16);
  }
}

int codebook_tables(const char* path) {
  std::vector<uint16_t> out(3 * 2 * kStates);
  const uint32_t halves_xor = halves_xor_register();
  codebook_table<kThreeInst>(out, halves_xor);
  codebook_table<kMcg>(out, halves_xor);
  codebook_table<kMul1>(out, halves_xor);
  FILE* f = fopen(path, "wb");
  if (!f) return 1;
  const bool ok = fwrite(out.data(), sizeof(uint16_t), out.size(), f) == out.size();
  return (fclose(f) == 0 && ok) ? 0 : 2;
}

template <int K2>
int states(FILE* f, int tiles) {
  std::vector<uint8_t> buf(Rate<K2>::kTileBytes);
  for (int t = 0; t < tiles; ++t) {
    if (fread(buf.data(), 1, buf.size(), f) != buf.size()) return 2;
    for (int lane = 0; lane < kWarpSize; ++lane) {
      LaneWindow<K2> lw;
      lw.init(lane);
      uint32_t raw[Rate<K2>::kRaw];
      load_raw<K2>(buf.data(), lw, raw);
      uint32_t st[8];
      states_from_raw<K2>(raw, lw.shift, st);
      for (int j = 0; j < 8; ++j) printf("%u\n", st[j]);
    }
  }
  return 0;
}

template <int K2, int CB>
int fragments(FILE* f, int tiles) {
  std::vector<uint8_t> buf(Rate<K2>::kTileBytes);
  for (int t = 0; t < tiles; ++t) {
    if (fread(buf.data(), 1, buf.size(), f) != buf.size()) return 2;
    for (int lane = 0; lane < kWarpSize; ++lane) {
      LaneWindow<K2> lw;
      lw.init(lane);
      uint32_t b[4];
      decode_fragments<K2, CB>(buf.data(), lw, halves_xor_register(), b);
      for (int q = 0; q < 4; ++q) printf("%u\n%u\n", b[q] & 0xFFFFu, b[q] >> 16);
    }
  }
  return 0;
}

// cb < 0: the state extraction; else the fragments of that codebook.
template <int K2>
int run(int cb, FILE* f, int tiles) {
  if (cb < 0) return states<K2>(f, tiles);
  if constexpr (K2 & 1) {
    return cb == kMul1 ? fragments<K2, kMul1>(f, tiles) : 1;  // half rates are MUL1 only
  } else {
    switch (cb) {
      case kThreeInst: return fragments<K2, kThreeInst>(f, tiles);
      case kMcg: return fragments<K2, kMcg>(f, tiles);
      case kMul1: return fragments<K2, kMul1>(f, tiles);
    }
    return 1;
  }
}

int main(int argc, char** argv) {
  if (argc == 3 && strcmp(argv[1], "codebook") == 0) return codebook_tables(argv[2]);
  int k2, cb, tiles;
  const char* path;
  if (argc == 5 && strcmp(argv[1], "states") == 0) {
    k2 = atoi(argv[2]), cb = -1, tiles = atoi(argv[3]), path = argv[4];
  } else if (argc == 6 && strcmp(argv[1], "fragments") == 0) {
    k2 = atoi(argv[2]), cb = atoi(argv[3]), tiles = atoi(argv[4]), path = argv[5];
  } else {
    return 1;
  }
  FILE* f = fopen(path, "rb");
  if (!f) return 1;
  switch (k2) {
#define EXL3_RATE(X) \
  case X:            \
    return run<X>(cb, f, tiles);
    EXL3_RATE(2) EXL3_RATE(3) EXL3_RATE(4) EXL3_RATE(5) EXL3_RATE(6) EXL3_RATE(7) EXL3_RATE(8)
    EXL3_RATE(10) EXL3_RATE(12) EXL3_RATE(14) EXL3_RATE(16)
  }
  return 1;
}
