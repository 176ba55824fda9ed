// SPDX-License-Identifier: Apache-2.0
// Host driver for tests/kernels/test_host_embedding.py: runs the quantized
// embedding's per-lane decode (exl3_embedding.cuh, compiled for the host) for
// all 32 lanes of each group, with the cross-lane butterfly stages emulated
// over the lanes' arrays, so only the warp shuffles are left to the GPU test.
//
//   embedding_host <bits> <groups> <rings file> <signs file> <output file>
//     rings: int16 [groups, 1 + 16 * bits]; signs: fp16 [groups, 256];
//     writes fp32 [groups, 256] (little-endian), the decoded groups.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "exl3_embedding.cuh"

using namespace vllm_exl3;
using namespace vllm_exl3::embedding;

namespace {

bool read_all(const char* path, void* dst, size_t bytes) {
  FILE* f = fopen(path, "rb");
  if (!f) return false;
  const bool ok = fread(dst, 1, bytes, f) == bytes;
  fclose(f);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    fprintf(stderr, "usage: %s bits groups rings signs out\n", argv[0]);
    return 1;
  }
  const int bits = atoi(argv[1]);
  const int groups = atoi(argv[2]);
  if (bits < kMinBits || bits > kMaxBits || groups < 1) return 1;
  const int words = group_words(bits);
  std::vector<uint16_t> rings(static_cast<size_t>(groups) * words);
  std::vector<uint16_t> signs(static_cast<size_t>(groups) * kGroup);
  if (!read_all(argv[3], rings.data(), rings.size() * 2)) return 2;
  if (!read_all(argv[4], signs.data(), signs.size() * 2)) return 2;
  std::vector<float> out(static_cast<size_t>(groups) * kGroup);
  for (int g = 0; g < groups; ++g) {
    float x[kWarpSize][kPerLane];
    for (int lane = 0; lane < kWarpSize; ++lane)
      lane_values(&rings[static_cast<size_t>(g) * words], bits, lane, x[lane]);
    for (int mask = 1; mask <= kLastLaneMask; mask *= 2) {
      float next[kWarpSize][kPerLane];
      for (int lane = 0; lane < kWarpSize; ++lane)
        for (int j = 0; j < kPerLane; ++j)
          next[lane][j] = butterfly(x[lane][j], x[lane ^ mask][j], lane & mask);
      for (int lane = 0; lane < kWarpSize; ++lane)
        for (int j = 0; j < kPerLane; ++j) x[lane][j] = next[lane][j];
    }
    for (int lane = 0; lane < kWarpSize; ++lane) {
      lane_finish(&signs[static_cast<size_t>(g) * kGroup], lane, x[lane]);
      for (int j = 0; j < kPerLane; ++j)
        out[static_cast<size_t>(g) * kGroup + lane * kPerLane + j] = x[lane][j];
    }
  }
  FILE* f = fopen(argv[5], "wb");
  if (!f) return 3;
  const bool ok =
      fwrite(out.data(), sizeof(float), out.size(), f) == out.size();
  return (fclose(f) == 0 && ok) ? 0 : 3;
}
