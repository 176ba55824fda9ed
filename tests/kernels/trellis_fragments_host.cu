// SPDX-License-Identifier: Apache-2.0
// Host driver for tests/kernels/test_trellis_fragments.py: runs the kernels' whole per-lane
// decode (exl3_trellis.cuh decode_fragments: the rate's cut plan, the codebook products with
// their paired-view shortcut, the fp16 values; compiled for the host with its exact fallbacks)
// over tiles read from a file and prints the 256 fp16 bit patterns of each tile in
// trellis-position order (lane t, register q, half h -> position 8t + 2q + h).
//   trellis_fragments_host <K2> <codebook> <tiles> <file of int16 words>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "exl3_trellis.cuh"

using namespace vllm_exl3;

template <int K2, int CB>
int run(FILE* f, int tiles) {
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

template <int K2>
int run_codebook(int cb, FILE* f, int tiles) {
  if constexpr (K2 & 1) {
    return cb == kMul1 ? run<K2, kMul1>(f, tiles) : 1;  // half rates are MUL1 only
  } else {
    switch (cb) {
      case kThreeInst: return run<K2, kThreeInst>(f, tiles);
      case kMcg: return run<K2, kMcg>(f, tiles);
      case kMul1: return run<K2, kMul1>(f, tiles);
    }
    return 1;
  }
}

int main(int argc, char** argv) {
  if (argc != 5) return 1;
  const int k2 = atoi(argv[1]), cb = atoi(argv[2]), tiles = atoi(argv[3]);
  FILE* f = fopen(argv[4], "rb");
  if (!f) return 1;
  switch (k2) {
#define EXL3_RATE(X) \
  case X:            \
    return run_codebook<X>(cb, f, tiles);
    EXL3_RATE(2) EXL3_RATE(3) EXL3_RATE(4) EXL3_RATE(5) EXL3_RATE(6) EXL3_RATE(7) EXL3_RATE(8)
    EXL3_RATE(10) EXL3_RATE(12) EXL3_RATE(14) EXL3_RATE(16)
  }
  return 1;
}
