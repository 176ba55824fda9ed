// SPDX-License-Identifier: Apache-2.0
// How one exl3_linear call runs: the fused trellis GEMM with a BM tier and a split-k factor, or
// reconstruct + cuBLAS. Chosen per call inside the op (so a CUDA graph records the branch that
// fits its own m), by env pins, then the autotuner's cache, then a cost model.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>

namespace vllm_exl3 {

enum class Path {
  kFused,           // input transform + trellis GEMM with fused epilogue (+ split-k finish)
  kReconOriginal,   // W = diag(suh) Ĥ Ŵ Ĥ diag(svh) in x's dtype, one cuBLAS GEMM on raw x
  kReconRotated,    // input transform, Ŵ (fp16), cuBLAS into fp32, output-side finish kernel
};

constexpr int kRowsPerTier = 16;  // BM = 16 * mt

struct Plan {
  Path path = Path::kFused;
  int mt = 1;      // fused: m16 tiles per block (BM = 16 * mt)
  int splits = 1;  // fused: k-splits (1 = full k, epilogue in the GEMM)
  bool wgmma = false;  // fused: Hopper's wgmma engine (mt one of kWgmmaTiers)
  // fused, wgmma only: > 0 = the stream-k grid over this many resident blocks (splits unused;
  // partial sums through the split-k workspace and finish kernel, as with splits > 1)
  int stream_blocks = 0;
  // fused: the input transform releases the GEMM at its start, so the GEMM's blocks prefetch
  // their trellis while it runs. They are then placed beside the transform's resident blocks,
  // which can stack one SM with a block more than the grid's even share: at 4096x4096 m = 16
  // (BM 16, split 8: 256 blocks, 64 transform blocks) that cost 3.3 µs of 13.5 per op, while
  // at m = 1 (4 transform blocks) the early release saves 0.9 µs (ab_session11 §5). false:
  // released as the transform's blocks exit. The tuner times both below kMinWaveSplitM.
  bool early_release = true;
  // fused: cap the GEMM's resident blocks per SM at its grid's even share (through the dynamic
  // shared memory it asks for), so that blocks released early beside the transform's cannot
  // stack three on one SM where the even share is two. 4096x4096 at m = 16: 10.4 -> 9.8 µs per
  // op (ab_session12 call 3). The tuner times it as a third variant below kMinWaveSplitM, and
  // from there on as a second one wherever the grid leaves room to stack (spreads_anything).
  bool spread = false;
  bool uses_workspace() const {
    return path == Path::kFused && (splits > 1 || stream_blocks > 0);
  }
};

struct Problem {
  int device;
  int m, k, n;
  int k2;     // 2 * bits
  int cb;     // codebook id
  int shards;
  bool bf16;  // activation / output dtype
};

// Device facts the cost model needs (cached per device).
struct DeviceInfo {
  int sms;
  int64_t l2_bytes;
};
DeviceInfo device_info(int device);

// Runs `plan` once on the call's real buffers (enqueue only).
using PlanRunner = std::function<void(const Plan&)>;

// The plan for this call. May time candidates (eager mode only, never while `stream` is
// capturing) by calling `run` on `stream`; the caller must run the returned plan afterwards.
// `splitk_ok(m, n)` tells whether the split-k workspace can hold m x n now (it may grow it).
Plan choose_plan(const Problem& pr, cudaStream_t stream, const PlanRunner& run,
                 const std::function<bool(bool may_grow)>& splitk_ok);

}  // namespace vllm_exl3
