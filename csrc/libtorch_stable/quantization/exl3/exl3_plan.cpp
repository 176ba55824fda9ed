// SPDX-License-Identifier: Apache-2.0
// The plans of exl3_linear (exl3_kernels.h): the table lookup, the
// deterministic cost model for a bucket without an entry, and the opt-in timer.
#include <algorithm>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>

#include "../../exl3_mma.cuh"
#include "exl3_kernels.h"

namespace vllm_exl3 {

namespace {

constexpr int kStageK = 64;   // k per GEMM pipeline stage (exl3_gemm.cuh)
constexpr int kBlockN = 128;  // columns per GEMM block
// A k-split shorter than this many stages leaves the cp.async pipeline no
// steady state.
constexpr int kMinChunksPerSplit = 2;
// split_model's rules, from the H100 table's measured best plans (1,046 layer
// keys x 14 buckets; scripts/bench/README.md, "Default plans against the
// tuner's best"). From kMinWaveSplitM rows the split that fills one wave of
// resident blocks without starting a second, slots / tiles rounded down: the
// table's split on 47-63 % of the keys at 32-64 rows and 95-100 % from 128
// (keys on the model's tier and a classic grid), where the rounded-up split
// under the traffic cap matched 20-47 % at 32-256 rows. Below it the largest
// split up to slots / tiles rounded up that divides k's stages evenly (the
// longest block sets the time; 90 % of the table's splits there divide them):
// 40-50 % of the keys, 30-41 % before.
// A block of at least this many rows keeps its SM busy alone: once a split-1
// grid has a block on more than kSplitOneSmNum / kSplitOneSmDen of the SMs,
// splitting only stacks blocks (the table at 128 rows, BM 128: split 3 or
// stream-k at 68-80 tiles, split 1 or stream-k on 56 of 58 keys at 96-128).
constexpr int kOneBlockFillsSmRows = 128;
constexpr int kSplitOneSmNum = 2;
constexpr int kSplitOneSmDen = 3;
// Reconstruct + cuBLAS from buckets of this many rows on. The mma.sync tiers'
// best (BM 128) is level with it at 512 rows and behind from 1024; the wgmma
// engine still wins at 1024 and is level at 4096 (design notes, "large m").
constexpr int kReconstructM = 1024;
constexpr int kReconstructMWgmma = 2048;
// Where wgmma runs, reconstruct + cuBLAS already from kFillReconstructM rows
// when the wgmma tier's split-1 grid fills its waves of resident blocks less
// than kReconstructMaxFill (a short last wave, or fewer tiles than SMs) and k
// is longer than kFusedShortK: cuBLAS's grid fills the card where the fused
// one idles SMs, and a split-k or stream-k grid pays partial sums. The H100
// table at 1024 rows: reconstruct on 475 of the 488 keys under that fill with
// k > 512, the fused GEMM on 479 of the 515 at or above it and on 29 of the 30
// under-filled keys with k <= 512 (its BM 64-128 tiers); the model's path
// matches the table's on 94 % of the 1,046 keys (50 % with the fused GEMM
// throughout). At 512 rows the table reconstructs mostly on grids of at most
// 48 tiles (207 of 229 keys), which no held-out layer has; not modelled.
constexpr int kFillReconstructM = 1024;
constexpr double kReconstructMaxFill = 0.8;
constexpr int kFusedShortK = 512;
// The original-basis reconstruct from this many rows on: its two-sided Hadamard
// costs a fixed k*n pass, the rotated path's transforms grow with m*(k+n). At
// the 2048-row bucket it beat the rotated path on 10 of 11 held-out layers, by
// 1.13-1.56x, cold (scripts/bench/README.md, "Default plans against the
// tuner's best"); the tuner picked it over the rotated path on all 520 keys of
// the H100 table that reconstruct at 1024 rows.
constexpr int kOriginalBasisM = 1024;
// The wgmma engine's smallest tier is 64 tokens; the cost model uses it from
// that bucket on, and the timer from this many rows (a 33..64-row call pads at
// most half the tile).
constexpr int kWgmmaFromM = 64;
constexpr int kMinWgmmaTuneM = 33;
// Candidate set of the timer (plan_candidates), as the online tuner had it:
// below this many rows the reconstruct path is not timed (the fused GEMM is
// decode-bound and reconstruction alone costs more than it);
constexpr int kMinReconstructTuneM = 64;
// where the reconstruct path is timed, a fused tier is timed only while it
// decodes the weights at most this many times (one decode per block row of BM
// rows): past that, reconstruct + cuBLAS won every shape measured;
constexpr int kMaxTunedRowBlocks = 16;
// from this many rows on, also the k-splits that just fill one, two or three
// waves of resident blocks (the split model takes one, or split 1 where a
// tier's blocks fill the SMs alone); below it the splits that divide the k
// chunks evenly, from the model's split / kEvenSplitReach up to twice it
// (fewer, equal blocks: the longest block sets the time).
constexpr int kMinWaveSplitM = 17;
constexpr int kEvenSplitReach = 4;
constexpr int kWaveSplitWaves = 3;
// The stream-k grid is timed only while the classic grid's waves are less full
// than this: above it stream-k's partial sums cost more than the short last
// wave it removes (measured cold; the timer runs warm, where the sums stay in
// L2 and look cheaper than they are).
constexpr double kStreamKMaxFill = 0.85;
// Timer: head start given to the device so the timed launches queue up
// gap-free, and the number of timed repetitions per candidate.
constexpr int kTuneSleepUs = 300;
constexpr int kTuneReps = 5;
constexpr int kMaxDevices = 64;
constexpr double kPermille = 1000.0;

[[noreturn]] void fail(const char* op, const std::string& what) {
  throw std::runtime_error(std::string(op) + ": " + what);
}

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("exl3 plans: ") + what + ": " +
                             cudaGetErrorString(e));
}

// Device facts the cost model needs (cached per device).
struct DeviceInfo {
  int sms = 0;
  int64_t l2_bytes = 0;
  int wgmma = -1;  // -1 = not asked yet
};

std::mutex g_mutex;
DeviceInfo g_devices[kMaxDevices];

DeviceInfo device_info(int device) {
  if (device < 0 || device >= kMaxDevices)
    throw std::runtime_error("exl3 plans: device index " +
                             std::to_string(device) + " out of range");
  std::lock_guard<std::mutex> lock(g_mutex);
  DeviceInfo& di = g_devices[device];
  if (di.sms == 0) {
    int l2 = 0;
    cuda_check(
        cudaDeviceGetAttribute(&di.sms, cudaDevAttrMultiProcessorCount, device),
        "SM count");
    cuda_check(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device),
               "L2 size");
    di.l2_bytes = l2;
    di.wgmma = wgmma_supported(device) ? 1 : 0;
  }
  return di;
}

int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

int tier_for_m(int m) { return m <= 16 ? 1 : m <= 32 ? 2 : m <= 64 ? 4 : 8; }
int wgmma_tier_for_m(int m) { return m <= 64 ? 4 : m <= 128 ? 8 : 16; }

bool is_gemm_tier(int mt) {
  return std::find(std::begin(kGemmTiers), std::end(kGemmTiers), mt) !=
         std::end(kGemmTiers);
}
bool is_wgmma_tier(int mt) {
  return std::find(std::begin(kWgmmaTiers), std::end(kWgmmaTiers), mt) !=
         std::end(kWgmmaTiers);
}

int max_splits(const Problem& pr) {
  return std::max(1, pr.k / kStageK / kMinChunksPerSplit);
}

// A tier's output tiles (BM rows x 128 columns) and the blocks the device holds
// at once.
struct GridFill {
  int64_t tiles;
  int64_t slots;
};

GridFill grid_fill(const Problem& pr, int mt, bool wgmma) {
  const DeviceInfo di = device_info(pr.device);
  const RateKernels& rk = rate_kernels(pr.k2);
  const int blocks_per_sm = wgmma ? rk.gemm_wgmma_blocks_per_sm(pr.cb, mt)
                                  : rk.gemm_blocks_per_sm(pr.cb, mt);
  return {static_cast<int64_t>(ceil_div(pr.m, kRowsPerTier * mt)) *
              (pr.n / kBlockN),
          static_cast<int64_t>(di.sms) * blocks_per_sm};
}

// Whether Plan::spread can place a classic grid of `splits` k-splits
// differently: its even share of blocks per SM is below what an SM holds, so
// without the cap the block scheduler may stack blocks on some SMs and leave
// others idle (measured: up to 2.8x on such grids).
bool spreads_anything(const Problem& pr, int mt, bool wgmma, int splits) {
  const auto [tiles, slots] = grid_fill(pr, mt, wgmma);
  const int64_t sms = device_info(pr.device).sms;
  return tiles * splits <=
         slots - sms;  // at most one block fewer per SM than it holds
}

// The k-splits of a classic grid: one wave of the resident blocks (the rules
// above), partial sums past half the L2 capped at pol.traffic of the weight
// bytes (it binds on no key of the table below 2048 rows). Sums within half
// the L2 are not capped: the table's best splits there move up to 43 times the
// weight bytes in partial sums.
int split_model(const Problem& pr, int mt, const Policy& pol, bool wgmma) {
  const DeviceInfo di = device_info(pr.device);
  const auto [tiles, slots] = grid_fill(pr, mt, wgmma);
  if (tiles >= slots) return 1;
  if (kRowsPerTier * mt >= kOneBlockFillsSmRows &&
      tiles * kSplitOneSmDen > static_cast<int64_t>(di.sms) * kSplitOneSmNum)
    return 1;
  int s;
  if (pr.m < kMinWaveSplitM) {
    const int chunks = pr.k / kStageK;
    s = std::min(ceil_div(slots, tiles), max_splits(pr));
    while (chunks % s != 0) --s;
  } else {
    s = static_cast<int>(std::min<int64_t>(slots / tiles, max_splits(pr)));
  }
  const double acc_bytes = static_cast<double>(pr.m) * pr.n * sizeof(float);
  if (acc_bytes > di.l2_bytes / 2.0) {
    const double weight_bytes = static_cast<double>(pr.k) * pr.n * pr.k2 / 16.0;
    // Each split reads and writes its partial sums once (a reduction is a
    // read-modify-write).
    s = std::min(
        s, static_cast<int>(pol.traffic * weight_bytes / (2.0 * acc_bytes)));
  }
  return std::max(1, s);
}

// Stream-k work units (output tiles x k chunks) of pr at tier mt.
int64_t stream_units(const Problem& pr, int mt) {
  return static_cast<int64_t>(ceil_div(pr.m, kRowsPerTier * mt)) *
         (pr.n / kBlockN) * (pr.k / kStageK);
}

// The stream-k grid: every resident block slot, but no block with fewer than
// kMinChunksPerSplit k chunks; 0 where it does not fit the kernel's 32-bit
// share-out.
int stream_grid(const Problem& pr, int mt) {
  const auto [tiles, slots] = grid_fill(pr, mt, true);
  const int64_t units = stream_units(pr, mt);
  const int64_t blocks =
      std::max<int64_t>(1, std::min(slots, units / kMinChunksPerSplit));
  if (blocks * units > std::numeric_limits<uint32_t>::max()) return 0;
  return static_cast<int>(blocks);
}

bool wgmma_available(const Problem& pr, const Policy& pol) {
  return pol.wgmma != 0 && !pol.batch_invariant &&
         device_info(pr.device).wgmma == 1;
}

// The fill rule of kFillReconstructM (the bucket's wgmma tier, split 1).
bool underfilled_reconstructs(const Problem& pr) {
  if (pr.m < kFillReconstructM || pr.k <= kFusedShortK) return false;
  const auto [tiles, slots] = grid_fill(pr, wgmma_tier_for_m(pr.m), true);
  const int64_t waves = ceil_div(tiles, slots);
  return tiles < kReconstructMaxFill * static_cast<double>(waves * slots);
}

Path default_basis(const Problem& pr) {
  return pr.m >= kOriginalBasisM ? Path::kReconOriginal : Path::kReconRotated;
}

// The plan for pr (pr.m = the bucket) without a measurement, the policy's pins
// applied.
Plan cost_model(const Problem& pr, const Policy& pol) {
  Plan p;
  const bool wg_avail = wgmma_available(pr, pol);
  if (!pol.batch_invariant) {
    const int64_t threshold = pol.reconstruct_m >= 0 ? pol.reconstruct_m
                              : wg_avail             ? kReconstructMWgmma
                                                     : kReconstructM;
    if ((threshold > 0 && pr.m >= threshold) ||
        (pol.reconstruct_m < 0 && wg_avail && underfilled_reconstructs(pr))) {
      p.path =
          pol.basis >= 0 ? static_cast<Path>(pol.basis) : default_basis(pr);
      return p;
    }
  }
  // A pin only the wgmma engine has (BM 256, stream-k) asks for it; validation
  // reports a device without it.
  if (pol.wgmma == 1 || pol.mt > kGemmTiers[kNumGemmTiers - 1] ||
      pol.stream_k == 1)
    p.wgmma = !pol.batch_invariant;
  else
    p.wgmma = wg_avail && pr.m >= kWgmmaFromM;
  p.mt = pol.mt ? pol.mt : p.wgmma ? wgmma_tier_for_m(pr.m) : tier_for_m(pr.m);
  const bool single = pol.deterministic || pol.batch_invariant;
  if (p.wgmma && pol.stream_k == 1 && !single) {
    p.stream_blocks = is_wgmma_tier(p.mt) ? stream_grid(pr, p.mt) : 0;
    p.splits = 1;
  } else if (single) {
    p.splits = 1;
  } else if (pol.splits) {
    p.splits = std::min(pol.splits, max_splits(pr));
  } else {
    const bool known = p.wgmma ? is_wgmma_tier(p.mt) : is_gemm_tier(p.mt);
    p.splits = known ? split_model(pr, p.mt, pol, p.wgmma) : 1;
  }
  if (pol.spread >= 0) {
    p.spread = pol.spread == 1;
  } else {
    const bool known = p.wgmma ? is_wgmma_tier(p.mt) : is_gemm_tier(p.mt);
    p.spread = known && p.stream_blocks == 0 &&
               spreads_anything(pr, p.mt, p.wgmma, p.splits);
  }
  return p;
}

std::string bm_str(int mt) { return std::to_string(kRowsPerTier * mt); }

// Checks `plan` against the device, the problem and the policy's modes.
void validate(const Problem& pr, const Plan& plan, const Policy& pol,
              const char* op, const char* origin) {
  const std::string where =
      std::string(" (") + origin + ", m = " + std::to_string(pr.m) +
      ", k = " + std::to_string(pr.k) + ", n = " + std::to_string(pr.n) + ")";
  if (pol.batch_invariant && (plan.path != Path::kFused || plan.wgmma ||
                              plan.splits != 1 || plan.stream_blocks))
    fail(op,
         "batch-invariant mode admits only the mma.sync fused engine with "
         "split 1 and no "
         "stream-k (one reduction order for every m)" +
             where);
  if (pol.deterministic && plan.uses_workspace())
    fail(op, "deterministic mode admits no split-k or stream-k plan" + where);
  if (plan.path != Path::kFused) return;
  if (plan.wgmma) {
    if (device_info(pr.device).wgmma != 1)
      fail(op,
           "the plan asks for the wgmma engine, which needs an sm_90a build on "
           "a "
           "compute-capability 9.0 GPU; this device or build has none" +
               where);
    if (!is_wgmma_tier(plan.mt))
      fail(op, "BM " + bm_str(plan.mt) + " is not a wgmma tier (64, 128, 256)" +
                   where);
  } else if (!is_gemm_tier(plan.mt)) {
    fail(op, "BM " + bm_str(plan.mt) +
                 " is not an mma.sync tier (16, 32, 64, 128; 256 is "
                 "wgmma only)" +
                 where);
  }
  if (plan.splits < 1 || plan.splits > max_splits(pr))
    fail(op, "split_k " + std::to_string(plan.splits) + " is outside 1.." +
                 std::to_string(max_splits(pr)) + " (k / 64 stages, at least " +
                 std::to_string(kMinChunksPerSplit) + " per split)" + where);
  if (plan.stream_blocks < 0) fail(op, "stream_blocks must be >= 0" + where);
  if (plan.stream_blocks > 0 &&
      (!plan.wgmma || plan.mt < kStreamKMinTiles || plan.splits != 1))
    fail(op,
         "stream-k is built only for the wgmma engine's tiers of at least BM " +
             bm_str(kStreamKMinTiles) + ", with split_k 1 (the plan has BM " +
             bm_str(plan.mt) + ", wgmma " + std::to_string(plan.wgmma) +
             ", split_k " + std::to_string(plan.splits) + ")" + where);
}

bool flag01(int64_t v) { return v == 0 || v == 1; }

}  // namespace

int m_bucket(int m) {
  int p = 1;
  while (p < m) p <<= 1;
  return p;
}

PlanTable parse_plan_table(const std::vector<int64_t>& plans, const char* op) {
  if (plans.size() < static_cast<size_t>(kPlanHeaderLen))
    fail(op, "plans has " + std::to_string(plans.size()) +
                 " ints; the header alone has " +
                 std::to_string(kPlanHeaderLen) +
                 " (ops.py documents the layout)");
  if (plans[0] != kPlanVersion)
    fail(op, "plans version " + std::to_string(plans[0]) +
                 ", this build reads version " + std::to_string(kPlanVersion) +
                 " (Python and kernels from different builds?)");
  if ((plans.size() - kPlanHeaderLen) % kPlanFields != 0)
    fail(op, "plans has " + std::to_string(plans.size() - kPlanHeaderLen) +
                 " ints past the header, not a multiple of " +
                 std::to_string(kPlanFields));
  PlanTable t;
  Policy& p = t.policy;
  const int64_t flags = plans[1];
  if (flags & ~kKnownFlags)
    fail(op, "unknown plan flags " + std::to_string(flags));
  p.deterministic = flags & kFlagDeterministic;
  p.batch_invariant = flags & kFlagBatchInvariant;
  p.basis = static_cast<int>(plans[2]);
  if (p.basis != -1 && p.basis != static_cast<int>(Path::kReconOriginal) &&
      p.basis != static_cast<int>(Path::kReconRotated))
    fail(op, "pinned basis " + std::to_string(p.basis) +
                 " is neither original (1) nor rotated "
                 "(2)");
  if (plans[3] < 0 || plans[3] % kRowsPerTier != 0 ||
      plans[3] > 16 * kRowsPerTier)
    fail(op, "pinned BM " + std::to_string(plans[3]) +
                 " is not 0 (free) or one of 16, 32, 64, "
                 "128, 256");
  p.mt = static_cast<int>(plans[3] / kRowsPerTier);
  if (p.mt && !is_gemm_tier(p.mt) && !is_wgmma_tier(p.mt))
    fail(op, "pinned BM " + std::to_string(plans[3]) +
                 " is not one of 16, 32, 64, 128, 256");
  if (plans[4] < 0) fail(op, "pinned split_k must be >= 0 (0 = free)");
  p.splits = static_cast<int>(
      std::min<int64_t>(plans[4], std::numeric_limits<int>::max()));
  for (int i = 5; i <= 7; ++i)
    if (plans[i] < -1 || plans[i] > 1)
      fail(op,
           "plan header field " + std::to_string(i) + " must be -1, 0 or 1");
  p.wgmma = static_cast<int>(plans[5]);
  p.stream_k = static_cast<int>(plans[6]);
  p.spread = static_cast<int>(plans[7]);
  if (plans[8] < -1)
    fail(op, "pinned reconstruct_m must be -1 (model), 0 (never) or > 0");
  p.reconstruct_m = plans[8];
  if (plans[9] <= 0) fail(op, "split_k_traffic must be positive (per mille)");
  p.traffic = static_cast<double>(plans[9]) / kPermille;
  int64_t prev = 0;
  for (size_t i = kPlanHeaderLen; i < plans.size(); i += kPlanFields) {
    const int64_t* e = &plans[i];
    const std::string at =
        "plan entry " + std::to_string((i - kPlanHeaderLen) / kPlanFields);
    if (e[0] <= prev)
      fail(op, at + ": m_max " + std::to_string(e[0]) +
                   " must be positive and "
                   "above the previous entry's");
    prev = e[0];
    if (e[1] < 0 || e[1] > 2)
      fail(op, at + ": unknown path " + std::to_string(e[1]) +
                   " (0 fused, 1 original, 2 rotated)");
    if (e[2] <= 0 || e[2] % kRowsPerTier != 0 || e[3] < 1 || e[5] < 0 ||
        !flag01(e[4]) || !flag01(e[6]) || !flag01(e[7]) ||
        e[2] > std::numeric_limits<int>::max() ||
        e[3] > std::numeric_limits<int>::max() ||
        e[5] > std::numeric_limits<int>::max())
      fail(op, at + ": bm must be a positive multiple of 16, split_k >= 1, "
                    "stream_blocks >= 0, "
                    "wgmma / early_release / spread 0 or 1");
    Plan pl;
    pl.path = static_cast<Path>(e[1]);
    pl.mt = static_cast<int>(e[2] / kRowsPerTier);
    pl.splits = static_cast<int>(e[3]);
    pl.wgmma = e[4] == 1;
    pl.stream_blocks = static_cast<int>(e[5]);
    pl.early_release = e[6] == 1;
    pl.spread = e[7] == 1;
    t.m_max.push_back(e[0]);
    t.entries.push_back(pl);
  }
  return t;
}

Plan resolve_plan(const Problem& pr, const PlanTable& table,
                  int64_t workspace_floats, const char* op,
                  PlanSource* source) {
  Plan plan;
  const char* origin = "plan table entry";
  PlanSource src = kSourceTable;
  size_t i = 0;
  while (i < table.m_max.size() && table.m_max[i] < pr.m) ++i;
  if (i < table.m_max.size()) {
    plan = table.entries[i];
  } else {
    Problem bucket = pr;
    bucket.m = m_bucket(pr.m);
    plan = cost_model(bucket, table.policy);
    origin = "cost model with VLLM_EXL3_PLAN's pins";
    src = kSourceCostModel;
  }
  validate(pr, plan, table.policy, op, origin);
  if (plan.stream_blocks > 0) {
    // A table entry's grid was sized for its bucket; fewer rows have fewer
    // units to share out.
    const int64_t units = stream_units(pr, plan.mt);
    plan.stream_blocks = static_cast<int>(std::max<int64_t>(
        1, std::min<int64_t>(plan.stream_blocks, units / kMinChunksPerSplit)));
    if (plan.stream_blocks * units > std::numeric_limits<uint32_t>::max())
      plan.stream_blocks = 0;
  }
  if (plan.uses_workspace() &&
      static_cast<int64_t>(pr.m) * pr.n > workspace_floats) {
    plan.splits = 1;
    plan.stream_blocks = 0;
  }
  if (source) *source = src;
  return plan;
}

std::vector<int64_t> plan_entry(int64_t m_max, const Plan& p) {
  return {m_max,
          static_cast<int64_t>(p.path),
          static_cast<int64_t>(p.mt) * kRowsPerTier,
          p.splits,
          p.wgmma ? 1 : 0,
          p.stream_blocks,
          p.early_release ? 1 : 0,
          p.spread ? 1 : 0};
}

std::vector<Plan> plan_candidates(const Problem& pr, const Policy& pol) {
  std::vector<Plan> out;
  const bool single = pol.deterministic || pol.batch_invariant;
  const bool tune_reconstruct = !pol.batch_invariant && pol.reconstruct_m < 0 &&
                                pr.m >= kMinReconstructTuneM;
  const bool forced_reconstruct = !pol.batch_invariant &&
                                  pol.reconstruct_m > 0 &&
                                  pr.m >= pol.reconstruct_m;
  auto add_reconstruct = [&] {
    if (pol.basis >= 0) {
      out.push_back(Plan{static_cast<Path>(pol.basis), 1, 1});
    } else {
      out.push_back(Plan{Path::kReconRotated, 1, 1});
      out.push_back(Plan{Path::kReconOriginal, 1, 1});
    }
  };
  if (forced_reconstruct) {
    add_reconstruct();
    return out;
  }
  // The smallest tier (16 rows) serves every bucket below it.
  const int bucket = std::max(m_bucket(std::max(pr.m, 1)), kRowsPerTier);
  auto add_tier = [&](int mt, bool wg) {
    // wgmma's smallest tier serves any m it is asked for.
    const int largest =
        wg ? std::max(bucket, kRowsPerTier * kWgmmaTiers[0]) : bucket;
    if (pol.mt ? mt != pol.mt : kRowsPerTier * mt > largest) return;
    if (tune_reconstruct && !pol.mt &&
        ceil_div(bucket, kRowsPerTier * mt) > kMaxTunedRowBlocks)
      return;
    std::vector<int> splits;
    if (single) {
      splits = {1};
    } else if (pol.splits) {
      splits = {std::min(pol.splits, max_splits(pr))};
    } else {
      const int s = split_model(pr, mt, pol, wg);
      // The model's split and its neighbours. A third and two thirds keep the
      // splits the checked-in tables hold in the set (they were tuned around
      // the model's earlier, larger splits): all of the H100 table's from 128
      // rows, 81-98 % below.
      splits = {s, std::max(1, s / 3), std::max(1, s / 2),
                std::max(1, 2 * s / 3), std::min(max_splits(pr), s * 2)};
      if (pr.m >= kMinWaveSplitM) {
        const auto [tiles, slots] = grid_fill(pr, mt, wg);
        for (int64_t w = 1; w <= kWaveSplitWaves; ++w) {
          if (w * slots < tiles)
            continue;  // not even one block per tile fits in w waves
          const int64_t fill =
              std::min<int64_t>(w * slots / tiles, max_splits(pr));
          splits.push_back(static_cast<int>(fill));
        }
      } else if (!wg) {
        const int chunks = pr.k / kStageK;
        for (int d = std::max(1, s / kEvenSplitReach);
             d <= std::min(max_splits(pr), 2 * s); ++d)
          if (chunks % d == 0) splits.push_back(d);
      }
    }
    std::sort(splits.begin(), splits.end());
    splits.erase(std::unique(splits.begin(), splits.end()), splits.end());
    if (!(wg && pol.stream_k == 1))
      for (int s : splits) {
        Plan plan{Path::kFused, mt, s, wg};
        plan.spread = pol.spread == 1;
        out.push_back(plan);
        // Below kMinWaveSplitM grids are a few blocks per SM, where the GEMM's
        // placement beside the input transform's blocks decides its time
        // (Plan::early_release, Plan::spread). From it on, a grid with room to
        // stack is also timed spread.
        if (pr.m < kMinWaveSplitM) {
          Plan late = plan;
          late.early_release = false;
          out.push_back(late);
          if (pol.spread == -1) {
            plan.spread = true;
            out.push_back(plan);
          }
        } else if (pol.spread == -1 && spreads_anything(pr, mt, wg, s)) {
          plan.spread = true;
          out.push_back(plan);
        }
      }
    if (wg && !single && pol.stream_k != 0 && !pol.splits &&
        mt >= kStreamKMinTiles) {
      const auto [tiles, slots] = grid_fill(pr, mt, true);
      const int64_t waves = ceil_div(tiles, slots);
      const bool sparse =
          tiles < kStreamKMaxFill * static_cast<double>(waves * slots);
      if (pol.stream_k == 1 || sparse)
        if (const int g = stream_grid(pr, mt); g > 0)
          out.push_back(Plan{Path::kFused, mt, 1, true, g});
    }
  };
  const bool wg_ok = wgmma_available(pr, pol);
  const bool only_wgmma = wg_ok && (pol.wgmma == 1 || pol.stream_k == 1);
  if (!only_wgmma && pol.wgmma != 1)
    for (int mt : kGemmTiers) add_tier(mt, false);
  if (wg_ok && (only_wgmma || pr.m >= kMinWgmmaTuneM ||
                pol.mt > kGemmTiers[kNumGemmTiers - 1]))
    for (int mt : kWgmmaTiers) add_tier(mt, true);
  if (tune_reconstruct && pol.reconstruct_m != 0) add_reconstruct();
  return out;
}

int64_t time_plan(const Plan& plan, cudaStream_t stream,
                  const PlanRunner& run) {
  cudaEvent_t start, stop;
  cuda_check(cudaEventCreate(&start), "event");
  cuda_check(cudaEventCreate(&stop), "event");
  run(plan);  // warm-up: first-launch costs, cuBLAS heuristics
  launch_device_sleep(kTuneSleepUs, stream);
  cuda_check(cudaEventRecord(start, stream), "event record");
  for (int r = 0; r < kTuneReps; ++r) run(plan);
  cuda_check(cudaEventRecord(stop, stream), "event record");
  cuda_check(cudaEventSynchronize(stop), "event sync");
  float ms = 0.f;
  cuda_check(cudaEventElapsedTime(&ms, start, stop), "event time");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return static_cast<int64_t>(static_cast<double>(ms) * 1e6 / kTuneReps);
}

}  // namespace vllm_exl3
