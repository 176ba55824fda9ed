// SPDX-License-Identifier: Apache-2.0
// How one exl3_linear call runs: the fused trellis GEMM with a BM tier and a
// split-k factor, or reconstruct + cuBLAS. The caller passes a plan table
// (built in Python at load time, from the checked-in per-device tables or the
// opt-in tuner); the op picks the entry of its own m bucket at run time, so one
// CUDA graph or compiled graph serves every m with that m's plan. A bucket
// without an entry goes to the cost model here: deterministic, no timing, no
// environment.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace vllm_exl3 {

enum class Path {
  kFused = 0,  // input transform + trellis GEMM with fused epilogue (+ split-k
               // finish)
  kReconOriginal = 1,  // W = diag(suh) Ĥ Ŵ Ĥ diag(svh) in x's dtype, one cuBLAS
                       // GEMM on raw x
  kReconRotated = 2,   // input transform, Ŵ (fp16), cuBLAS into fp32,
                       // output-side finish kernel
};

constexpr int kRowsPerTier = 16;  // BM = 16 * mt

// The plan table's layout (ops.py documents it; the Python side mirrors these
// numbers).
constexpr int64_t kPlanVersion = 1;
constexpr int kPlanHeaderLen = 10;
constexpr int kPlanFields = 8;
constexpr int64_t kFlagDeterministic = 1;
constexpr int64_t kFlagBatchInvariant = 2;
constexpr int64_t kKnownFlags = kFlagDeterministic | kFlagBatchInvariant;
enum PlanSource : int64_t { kSourceTable = 0, kSourceCostModel = 1 };

struct Plan {
  Path path = Path::kFused;
  int mt = 1;          // fused: m16 tiles per block (BM = 16 * mt)
  int splits = 1;      // fused: k-splits (1 = full k, epilogue in the GEMM)
  bool wgmma = false;  // fused: Hopper's wgmma engine (mt one of kWgmmaTiers)
  // fused, wgmma only: > 0 = the stream-k grid over this many resident blocks
  // (splits unused; partial sums through the split-k workspace and finish
  // kernel, as with splits > 1)
  int stream_blocks = 0;
  // fused: the input transform releases the GEMM at its start, so the GEMM's
  // blocks prefetch their trellis while it runs. They are then placed beside
  // the transform's resident blocks, which can stack one SM with a block more
  // than the grid's even share (costly where the transform has many blocks, a
  // gain where it has a few). false: released as the transform's blocks exit.
  bool early_release = true;
  // fused: cap the GEMM's resident blocks per SM at its grid's even share
  // (through the dynamic shared memory it asks for), so that blocks cannot
  // stack three on one SM where the even share is two.
  bool spread = false;
  bool uses_workspace() const {
    return path == Path::kFused && (splits > 1 || stream_blocks > 0);
  }
};

// The header of a plan table: the mode flags and VLLM_EXL3_PLAN's pins for the
// cost model.
struct Policy {
  bool deterministic =
      false;  // no split-k / stream-k (their sums run in varying order)
  bool batch_invariant =
      false;       // one reduction order for every m (vLLM's batch invariance)
  int basis = -1;  // -1 free, else the pinned reconstruct Path
  int mt = 0;      // 0 = free
  int splits = 0;  // 0 = free
  int wgmma = -1;  // -1 = free, 0 = never, 1 = the fused path always uses it
  int stream_k = -1;
  int spread = -1;
  int64_t reconstruct_m =
      -1;  // -1 = the model's threshold, 0 = never, r > 0 = buckets >= r
  double traffic = 0.25;  // split-k traffic cap relative to the weight bytes
};

struct PlanTable {
  Policy policy;
  std::vector<int64_t> m_max;  // ascending
  std::vector<Plan> entries;
};

struct Problem {
  int device;
  int m, k, n;  // m: the bucket's rows when planning
  int k2;       // 2 * bits
  int cb;       // codebook id
  int shards;
  bool bf16;  // activation / output dtype
};

// The token-count bucket of m rows: m rounded up to a power of two.
int m_bucket(int m);

// Parses and checks a plan table's structure (header, flags, entry order);
// throws a std::runtime_error naming the rule broken.
PlanTable parse_plan_table(const std::vector<int64_t>& plans, const char* op);

// The plan for `pr` (pr.m = the call's rows), validated against the device and
// the problem: the entry of m's bucket, else the cost model at the bucket. A
// plan whose partial sums need more than `workspace_floats` runs with split 1
// and no stream-k. `source` gets the PlanSource.
Plan resolve_plan(const Problem& pr, const PlanTable& table,
                  int64_t workspace_floats, const char* op,
                  PlanSource* source = nullptr);

// The entry ints of `plan` for bucket m_max (the layout of one table entry).
std::vector<int64_t> plan_entry(int64_t m_max, const Plan& plan);

// Every candidate worth timing for pr (pr.m = the bucket) under the table's
// policy.
std::vector<Plan> plan_candidates(const Problem& pr, const Policy& policy);

// Runs `plan` once on the call's real buffers (enqueue only).
using PlanRunner = std::function<void(const Plan&)>;

// Mean time of `plan` in ns on `stream` (which must not be capturing): warm-up,
// then repeated runs queued behind a device sleep.
int64_t time_plan(const Plan& plan, cudaStream_t stream, const PlanRunner& run);

}  // namespace vllm_exl3
