// SPDX-License-Identifier: Apache-2.0
// Host driver for tests/kernels/test_trellis_states.py: runs the kernels' own per-lane state
// extraction (exl3_trellis.cuh, compiled for the host) over tiles read from a file and prints
// the 256 states of each tile in trellis-position order (lane t, slot j -> position 8t + j).
//   trellis_states_host <K2> <tiles> <file of int16 words>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "exl3_trellis.cuh"

using namespace vllm_exl3;

template <int K2>
int run(FILE* f, int tiles) {
  std::vector<uint8_t> buf(Rate<K2>::kTileBytes);
  for (int t = 0; t < tiles; ++t) {
    if (fread(buf.data(), 1, buf.size(), f) != buf.size()) return 2;
    for (int lane = 0; lane < 32; ++lane) {
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

int main(int argc, char** argv) {
  if (argc != 4) return 1;
  const int k2 = atoi(argv[1]), tiles = atoi(argv[2]);
  FILE* f = fopen(argv[3], "rb");
  if (!f) return 1;
  switch (k2) {
#define EXL3_RATE(X) \
  case X:            \
    return run<X>(f, tiles);
    EXL3_RATE(2) EXL3_RATE(3) EXL3_RATE(4) EXL3_RATE(5) EXL3_RATE(6) EXL3_RATE(7) EXL3_RATE(8)
    EXL3_RATE(10) EXL3_RATE(12) EXL3_RATE(14) EXL3_RATE(16)
  }
  return 1;
}
