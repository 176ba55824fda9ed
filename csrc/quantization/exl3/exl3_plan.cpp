// SPDX-License-Identifier: Apache-2.0
#include "exl3_plan.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "exl3_kernels.h"

namespace vllm_exl3 {

namespace {

constexpr int kStageK = 64;        // k per GEMM pipeline stage (exl3_gemm.cuh)
constexpr int kBlockN = 128;       // columns per GEMM block
// A k-split shorter than this many stages leaves the cp.async pipeline no steady state.
constexpr int kMinChunksPerSplit = 2;
// Default cap on split-k accumulator traffic, as a fraction of the weight bytes read.
constexpr double kDefaultSplitTraffic = 0.25;
// Accumulators that fit in half the L2 never reach HBM, so their traffic is this much cheaper.
constexpr double kL2Discount = 4.0;
// Without a measurement, reconstruct + cuBLAS from this many rows on (tensor-core bound there).
constexpr int kDefaultReconstructM = 512;
// Without a measurement, the original-basis reconstruct from this many rows on: its two-sided
// Hadamard costs a fixed k*n pass, the rotated path's transforms grow with m*(k+n).
constexpr int kDefaultOriginalBasisM = 1024;
// Below this many rows the reconstruct path is not even timed (the fused GEMM is decode-bound
// and reconstruction alone costs more than it).
constexpr int kMinReconstructTuneM = 64;
// Where the reconstruct path is timed, a fused tier is timed only while it decodes the weights
// at most this many times (one decode per block row of BM rows). Past that, reconstruct +
// cuBLAS won every shape measured on the H200 (scripts/bench/results, profile_paths and
// bm128_layout_ab: BM 128 is level with it at m = 512 and behind from 1024), and timing a
// BM = 16 GEMM at m = 16384 would cost ~0.1 s per run of the tuner.
constexpr int kMaxTunedRowBlocks = 16;
// The wgmma engine's smallest tier is 64 tokens; below this many rows it only pads.
constexpr int kMinWgmmaM = 33;
// From this many rows on, the tuner also times the k-splits that just fill one, two or three
// waves of resident blocks. The split model aims at one block per slot and is capped by its
// traffic rule, so where the tiles are few it lands past a wave boundary or far short of it
// (ab_session7 call 1, 4-bit, BM 128 wgmma at m = 128: 4096x4096 split 8, 256 blocks in 264
// slots, 17.8 us against 25.9 for the model's best of {1, 2, 4}; 17408x5120 split 6, 58.1 us
// against 78.3 at split 4). Below it the weights are L2-resident while the tuner times them,
// which flatters more splits than a cold call wants (ab_session4 §4), so no candidates are added.
constexpr int kMinWaveSplitM = 17;
// Below kMinWaveSplitM the tuner also times the splits that divide the k chunks evenly (every
// block the same number of stages), from the model's split / kEvenSplitReach up to twice it. In
// the benchmark's own graphs (ab_session8 call 8, 4-bit MCG, m = 1) the model's candidates
// missed them: 4096x4096 ran split 10 of {10, 21, 32} at 11.0 us where split 8 took 9.7 and
// 16 took 10.0; 5120x12288 ran split 14 of {3, 7, 14} at 25.3 us where split 8 took 23.1.
// Fewer, equal blocks win there: each block pays a fixed cost (prologue, partial sums), and
// an uneven split makes the longest block set the time.
constexpr int kEvenSplitReach = 4;
// How many waves' filling splits are timed: every best split of that sweep was the model's or
// filled one or two waves; the third is one more candidate per tier for the shapes not swept.
constexpr int kWaveSplitWaves = 3;
// The stream-k grid is timed for the wgmma tiers only while the classic grid's waves are less
// full than this (tiles / (waves x resident slots)). On the H200, pinned and cold against the
// best classic split (results/ab_session8_h200_2026-11-30 §2), stream-k lost 3-19 % on all three
// points at fills 0.87-0.97, where its partial sums cost more than the short last wave it
// removes; below 0.85 it won up to 24 % on 11 of 17 points and lost up to 14 % on 3, which the
// tuner sorts out. The cut is made here rather than left to the tuner because it times warm,
// where the partial sums stay in L2 and look cheaper than they are cold (it picked stream-k at
// a fill of 0.87).
constexpr double kStreamKMaxFill = 0.85;
// Autotuner: head start given to the device so the timed launches queue up gap-free, and the
// number of timed repetitions per candidate.
constexpr int kTuneSleepUs = 300;
constexpr int kTuneReps = 5;

const char* env_value(const char* name, const char* legacy) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') v = std::getenv(legacy);
  return (v != nullptr && *v != '\0') ? v : nullptr;
}

std::optional<long> env_long(const char* name, const char* legacy) {
  const char* v = env_value(name, legacy);
  if (!v) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v, &end, 10);
  if (errno != 0 || end == v || *end != '\0')
    throw std::runtime_error(std::string("exl3: ") + name + "=" + v + " is not an integer");
  return x;
}

struct Pins {
  bool deterministic = false;
  int mt = 0;      // 0 = free
  int splits = 0;  // 0 = free
  int wgmma = -1;  // -1 = the tuner chooses, 0 = never, 1 = the fused path always uses it
  std::optional<long> reconstruct_m;
  std::optional<Path> basis;  // pinned reconstruct flavour
  double traffic = kDefaultSplitTraffic;
  int stream_k = -1;  // -1 = the tuner chooses, 0 = never, 1 = the wgmma candidates are stream-k
  // VLLM_EXL3_SPREAD (Plan::spread): -1 = the tuner chooses (spreads_anything), 0 = never,
  // 1 = every fused plan spreads.
  int spread = -1;
};

Pins read_pins() {
  Pins p;
  if (auto d = env_long("VLLM_EXL3_DETERMINISTIC", "CUDA_EXL3_DETERMINISTIC")) p.deterministic = *d != 0;
  if (auto bm = env_long("VLLM_EXL3_BM", "CUDA_EXL3_BM")) {
    if (*bm != 16 && *bm != 32 && *bm != 64 && *bm != 128 && *bm != 256)
      throw std::runtime_error("exl3: VLLM_EXL3_BM=" + std::to_string(*bm) +
                               " must be one of 16, 32, 64, 128 (mma.sync) or 64, 128, 256 "
                               "(wgmma)");
    p.mt = static_cast<int>(*bm / kRowsPerTier);
  }
  if (auto s = env_long("VLLM_EXL3_SPLIT_K", "CUDA_EXL3_SPLIT_K")) {
    if (*s < 1) throw std::runtime_error("exl3: VLLM_EXL3_SPLIT_K must be >= 1");
    p.splits = static_cast<int>(*s);
  }
  if (auto w = env_long("VLLM_EXL3_WGMMA", "CUDA_EXL3_WGMMA")) {
    if (*w != 0 && *w != 1)
      throw std::runtime_error("exl3: VLLM_EXL3_WGMMA=" + std::to_string(*w) + " must be 0 or 1");
    p.wgmma = static_cast<int>(*w);
  }
  if (auto sk = env_long("VLLM_EXL3_STREAM_K", "CUDA_EXL3_STREAM_K")) {
    if (*sk != 0 && *sk != 1)
      throw std::runtime_error("exl3: VLLM_EXL3_STREAM_K=" + std::to_string(*sk) +
                               " must be 0 or 1");
    p.stream_k = static_cast<int>(*sk);
    if (p.stream_k == 1 && p.splits)
      throw std::runtime_error("exl3: VLLM_EXL3_STREAM_K=1 and VLLM_EXL3_SPLIT_K exclude each "
                               "other (stream-k sets its own k ranges)");
  }
  if (p.mt == 16 && p.wgmma == 0)
    throw std::runtime_error("exl3: VLLM_EXL3_BM=256 exists only for the wgmma engine, which "
                             "VLLM_EXL3_WGMMA=0 turns off");
  if (auto s = env_long("VLLM_EXL3_SPREAD", "CUDA_EXL3_SPREAD"))
    p.spread = *s != 0 ? 1 : 0;
  p.reconstruct_m = env_long("VLLM_EXL3_RECONSTRUCT_M", "CUDA_EXL3_RECONSTRUCT_M");
  if (const char* b = env_value("VLLM_EXL3_RECONSTRUCT_BASIS", "CUDA_EXL3_RECONSTRUCT_BASIS")) {
    const std::string v(b);
    if (v == "original") p.basis = Path::kReconOriginal;
    else if (v == "rotated") p.basis = Path::kReconRotated;
    else throw std::runtime_error("exl3: VLLM_EXL3_RECONSTRUCT_BASIS=" + v +
                                  " must be 'original' or 'rotated'");
  }
  if (const char* t = env_value("VLLM_EXL3_SPLIT_K_TRAFFIC", "CUDA_EXL3_SPLIT_K_TRAFFIC")) {
    char* end = nullptr;
    const double x = std::strtod(t, &end);
    if (end == t || *end != '\0' || !(x > 0.0))
      throw std::runtime_error(std::string("exl3: VLLM_EXL3_SPLIT_K_TRAFFIC=") + t +
                               " must be a positive number");
    p.traffic = x;
  }
  if (p.deterministic) {
    p.splits = 1;  // split-k and stream-k sum in a run-dependent order
    p.stream_k = 0;
  }
  return p;
}

int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

int pow2_ceil(int x) {
  int p = 1;
  while (p < x) p <<= 1;
  return p;
}

int tier_for_m(int m) { return m <= 16 ? 1 : m <= 32 ? 2 : m <= 64 ? 4 : 8; }

int max_splits(const Problem& pr) { return std::max(1, pr.k / kStageK / kMinChunksPerSplit); }

// A tier's output tiles (BM rows x 128 columns) and the blocks the device holds at once.
struct GridFill {
  int64_t tiles;
  int64_t slots;
};

GridFill grid_fill(const Problem& pr, int mt, bool wgmma) {
  const DeviceInfo di = device_info(pr.device);
  const RateKernels& rk = rate_kernels(pr.k2);
  const int blocks_per_sm =
      wgmma ? rk.gemm_wgmma_blocks_per_sm(pr.cb, mt) : rk.gemm_blocks_per_sm(pr.cb, mt);
  return {static_cast<int64_t>(ceil_div(pr.m, kRowsPerTier * mt)) * (pr.n / kBlockN),
          static_cast<int64_t>(di.sms) * blocks_per_sm};
}

// Whether Plan::spread can place a classic grid of `splits` k-splits differently: its even share
// of blocks per SM is below what an SM holds, so without the cap the block scheduler may stack
// blocks on some SMs and leave others idle. It does: from 17 rows (pinned cold, ab_session13
// call 11) spreading took 5120x12288 m = 128 at BM 128 (96 blocks) from 82.5 to 50.0 µs,
// 4096x4096 m = 256 at BM 128 split 2 from 39.4 to 27.1 µs, and BM 64 / 32 grids 2.2-2.8x down.
bool spreads_anything(const Problem& pr, int mt, bool wgmma, int splits) {
  const auto [tiles, slots] = grid_fill(pr, mt, wgmma);
  const int64_t sms = device_info(pr.device).sms;
  return tiles * splits <= slots - sms;  // at most one block fewer per SM than it holds
}

// Enough k-splits to give every SM its resident blocks, unless the fp32 partial sums would cost
// more than a fraction of the weight traffic.
int split_model(const Problem& pr, int mt, const Pins& pins, bool wgmma = false) {
  const DeviceInfo di = device_info(pr.device);
  const auto [tiles, slots] = grid_fill(pr, mt, wgmma);
  if (tiles >= slots) return 1;
  int s = ceil_div(slots, tiles);
  s = std::min(s, max_splits(pr));
  const double acc_bytes = static_cast<double>(pr.m) * pr.n * sizeof(float);
  const double weight_bytes = static_cast<double>(pr.k) * pr.n * pr.k2 / 16.0;
  const double frac = pins.traffic * (acc_bytes <= di.l2_bytes / 2.0 ? kL2Discount : 1.0);
  // Each split reads and writes its partial sums once (a reduction is a read-modify-write).
  const int cap = static_cast<int>(frac * weight_bytes / (2.0 * acc_bytes));
  return std::max(1, std::min(s, cap));
}

// The wgmma tier's stream-k grid (built for BM 128 and 256): every resident block slot, but no
// block with fewer than kMinChunksPerSplit k chunks; 0 where it is not offered (pinned off, a
// pinned split, a smaller tier, or a classic grid whose waves are kStreamKMaxFill full or more,
// unless pinned on).
int stream_blocks(const Problem& pr, int mt, const Pins& pins) {
  if (pins.stream_k == 0 || pins.splits || mt < kStreamKMinTiles) return 0;
  const auto [tiles, slots] = grid_fill(pr, mt, true);
  const int64_t waves = ceil_div(tiles, slots);
  if (pins.stream_k != 1 && tiles >= kStreamKMaxFill * static_cast<double>(waves * slots))
    return 0;
  const int64_t units = tiles * (pr.k / kStageK);
  const int64_t blocks = std::max<int64_t>(1, std::min(slots, units / kMinChunksPerSplit));
  // The kernel shares out units in 32-bit arithmetic (block index x units).
  if (blocks * units > std::numeric_limits<uint32_t>::max()) return 0;
  return static_cast<int>(blocks);
}

Path default_basis(const Problem& pr, const Pins& pins) {
  if (pins.basis) return *pins.basis;
  return pr.m >= kDefaultOriginalBasisM ? Path::kReconOriginal : Path::kReconRotated;
}

std::vector<Plan> reconstruct_candidates(const Pins& pins) {
  if (pins.basis) return {Plan{*pins.basis, 1, 1}};
  return {Plan{Path::kReconRotated, 1, 1}, Plan{Path::kReconOriginal, 1, 1}};
}

Plan cost_model(const Problem& pr, const Pins& pins) {
  Plan p;
  if (!pins.reconstruct_m && pr.m >= kDefaultReconstructM) {
    p.path = default_basis(pr, pins);
    return p;
  }
  // The cost model serves capture without a tuned plan: the portable engine, whose tiers it knows.
  p.mt = pins.mt && pins.mt <= 8 ? pins.mt : tier_for_m(pr.m);
  p.splits = pins.splits ? std::min(pins.splits, max_splits(pr)) : split_model(pr, p.mt, pins);
  return p;
}

// `wgmma_ok`: the engine exists on this device and is not turned off.
std::vector<Plan> candidates(const Problem& pr, const Pins& pins, bool wgmma_ok) {
  std::vector<Plan> out;
  const int bucket = pow2_ceil(std::max(pr.m, kRowsPerTier));
  const bool tune_reconstruct = !pins.reconstruct_m && pr.m >= kMinReconstructTuneM;
  auto add_tier = [&](int mt, bool wg) {
    // wgmma's smallest tier serves any m it is asked for (VLLM_EXL3_WGMMA=1 below 33 rows).
    const int largest = wg ? std::max(bucket, kRowsPerTier * kWgmmaTiers[0]) : bucket;
    if (pins.mt ? mt != pins.mt : kRowsPerTier * mt > largest) return;
    if (tune_reconstruct && !pins.mt && ceil_div(bucket, kRowsPerTier * mt) > kMaxTunedRowBlocks)
      return;
    std::vector<int> splits;
    if (pins.splits) {
      splits = {std::min(pins.splits, max_splits(pr))};
    } else {
      const int s = split_model(pr, mt, pins, wg);
      splits = {s, std::max(1, s / 2), std::min(max_splits(pr), s * 2)};
      if (pr.m >= kMinWaveSplitM) {
        const auto [tiles, slots] = grid_fill(pr, mt, wg);
        for (int64_t w = 1; w <= kWaveSplitWaves; ++w) {
          if (w * slots < tiles) continue;  // not even one block per tile fits in w waves
          const int64_t fill = std::min<int64_t>(w * slots / tiles, max_splits(pr));
          splits.push_back(static_cast<int>(fill));
        }
      } else if (!wg) {
        const int chunks = pr.k / kStageK;
        for (int d = std::max(1, s / kEvenSplitReach); d <= std::min(max_splits(pr), 2 * s); ++d)
          if (chunks % d == 0) splits.push_back(d);
      }
    }
    std::sort(splits.begin(), splits.end());
    splits.erase(std::unique(splits.begin(), splits.end()), splits.end());
    if (!(wg && pins.stream_k == 1))
      for (int s : splits) {
        Plan plan{Path::kFused, mt, s, wg};
        plan.spread = pins.spread == 1;
        out.push_back(plan);
        // Below kMinWaveSplitM grids are a few blocks per SM, where the GEMM's placement beside
        // the input transform's blocks decides its time (Plan::early_release, Plan::spread).
        // From it on, a grid with room to stack is also timed spread. A plan pinned whole (BM
        // and split) stays one candidate, timed by nothing.
        if (pr.m < kMinWaveSplitM && !(pins.mt && pins.splits)) {
          out.push_back(Plan{Path::kFused, mt, s, wg, 0, false});
          if (pins.spread == -1) {
            plan.spread = true;
            out.push_back(plan);
          }
        } else if (pins.spread == -1 && !(pins.mt && pins.splits) &&
                   spreads_anything(pr, mt, wg, s)) {
          plan.spread = true;
          out.push_back(plan);
        }
      }
    if (wg)
      if (const int g = stream_blocks(pr, mt, pins); g > 0)
        out.push_back(Plan{Path::kFused, mt, 1, true, g});
  };
  const bool only_wgmma = wgmma_ok && pins.wgmma == 1;
  if (!only_wgmma)
    for (int mt : kGemmTiers) add_tier(mt, false);
  // A pinned BM past the mma.sync tiers (256) asks for the wgmma engine whatever m is.
  if (wgmma_ok && (only_wgmma || pr.m >= kMinWgmmaM || pins.mt > kGemmTiers[kNumGemmTiers - 1]))
    for (int mt : kWgmmaTiers) add_tier(mt, true);
  if (tune_reconstruct)
    for (const Plan& r : reconstruct_candidates(pins)) out.push_back(r);
  return out;
}

using Key = std::tuple<int, int, int, int, int, int, int, bool, int, int, long, double, bool, int,
                       int, int, int>;

std::mutex g_mutex;
std::map<Key, Plan> g_cache;
std::map<int, DeviceInfo> g_devices;

Key make_key(const Problem& pr, const Pins& pins) {
  return Key{pr.device, pow2_ceil(std::max(pr.m, 1)), pr.k, pr.n, pr.k2, pr.cb, pr.shards,
             pr.bf16, pins.mt, pins.splits, pins.reconstruct_m.value_or(-1), pins.traffic,
             pins.deterministic, pins.basis ? static_cast<int>(*pins.basis) : -1, pins.wgmma,
             pins.stream_k, pins.spread};
}

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("exl3 autotuner: ") + what + ": " + cudaGetErrorString(e));
}

float time_plan(const Plan& plan, cudaStream_t stream, const PlanRunner& run) {
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
  return ms / kTuneReps;
}

}  // namespace

DeviceInfo device_info(int device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_devices.find(device);
  if (it != g_devices.end()) return it->second;
  DeviceInfo di{};
  int l2 = 0;
  cuda_check(cudaDeviceGetAttribute(&di.sms, cudaDevAttrMultiProcessorCount, device), "SM count");
  cuda_check(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device), "L2 size");
  di.l2_bytes = l2;
  g_devices[device] = di;
  return di;
}

Plan choose_plan(const Problem& pr, cudaStream_t stream, const PlanRunner& run,
                 const std::function<bool(bool)>& splitk_ok) {
  const Pins pins = read_pins();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cuda_check(cudaStreamIsCapturing(stream, &status), "capture status");
  const bool capturing = status != cudaStreamCaptureStatusNone;
  // A split plan needs the workspace; during capture it can only be used if already big enough.
  auto settle = [&](Plan p) {
    if (p.uses_workspace() && !splitk_ok(!capturing)) {
      p.splits = 1;
      p.stream_blocks = 0;
    }
    return p;
  };

  const bool forced_reconstruct =
      pins.reconstruct_m && *pins.reconstruct_m > 0 && pr.m >= *pins.reconstruct_m;
  const bool wgmma_ok = pins.wgmma != 0 && wgmma_supported(pr.device, !capturing);
  if (pins.wgmma == 1 && !capturing && !wgmma_ok)
    throw std::runtime_error("exl3: VLLM_EXL3_WGMMA=1, but this device or build has no wgmma "
                             "engine (it needs an sm_90a image on a compute-capability 9.0 GPU)");
  const std::vector<Plan> cands =
      forced_reconstruct ? reconstruct_candidates(pins) : candidates(pr, pins, wgmma_ok);
  if (cands.empty())
    throw std::runtime_error(
        "exl3: no GEMM tier matches the pins: VLLM_EXL3_BM=" +
        std::to_string(kRowsPerTier * pins.mt) +
        " (mma.sync tiers 16, 32, 64, 128; wgmma tiers 64, 128, 256, which need the wgmma "
        "engine: " + (wgmma_ok ? "VLLM_EXL3_WGMMA=1 allows only those" :
                                 "this device or build has none, or VLLM_EXL3_WGMMA=0") + ")" +
        (pins.stream_k == 1 ? "; VLLM_EXL3_STREAM_K=1 leaves only the wgmma tiers 128 and 256"
                            : ""));
  if (cands.size() == 1) return settle(cands[0]);
  const Plan fallback =
      forced_reconstruct ? Plan{default_basis(pr, pins), 1, 1} : cost_model(pr, pins);

  const Key key = make_key(pr, pins);
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_cache.find(key);
    if (it != g_cache.end()) return settle(it->second);
  }
  if (capturing) return settle(fallback);

  Plan best = fallback;
  float best_ms = -1.f;
  // VLLM_EXL3_LOG_PLANS=1 prints every timed candidate (bisecting and benchmark reports).
  const bool log = env_long("VLLM_EXL3_LOG_PLANS", "CUDA_EXL3_LOG_PLANS").value_or(0) != 0;
  for (const Plan& c : cands) {
    if (c.uses_workspace() && !splitk_ok(true)) continue;
    const float ms = time_plan(c, stream, run);
    if (log)
      std::fprintf(stderr,
                   "exl3 plan m=%d k=%d n=%d bits2=%d cb=%d: path=%d bm=%d split=%d wgmma=%d "
                   "stream=%d early=%d spread=%d %.1f us\n",
                   pr.m, pr.k, pr.n, pr.k2, pr.cb, static_cast<int>(c.path),
                   c.mt * kRowsPerTier, c.splits, c.wgmma ? 1 : 0, c.stream_blocks,
                   c.early_release ? 1 : 0, c.spread ? 1 : 0, ms * 1e3f);
    if (best_ms < 0.f || ms < best_ms) {
      best_ms = ms;
      best = c;
    }
  }
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_cache[key] = best;
  }
  return settle(best);
}

}  // namespace vllm_exl3
