// SPDX-License-Identifier: Apache-2.0
// torch.ops._C.exl3_moe: one EXL3 mixture-of-experts layer (routed experts)
// over vLLM's expert alignment, or (no alignment given) over the pairs layout
// of few tokens, a row block per routed pair that the input transform lays out
// itself (exl3_moe.h MoePairsLayout): input validation, the kernel sequence,
// registration. Stable ABI only, like exl3_ops.cpp. Scratch comes from torch's
// caching allocator (new_empty) and the split-k partial sums from the caller's
// workspace, so the op is safe under CUDA-graph capture; it never synchronises
// and never reads device data on the host. The k-splits are arguments: the
// caller's rule (moe_kernels.py) picks them from host-known shapes only.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "../../exl3_mma.cuh"
#include "../../exl3_tensor_checks.h"
#include "exl3_kernels.h"
#include "exl3_moe.h"

namespace vllm_exl3 {

namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

constexpr const char* kOp = "exl3_moe";
constexpr int64_t kHadamardBlock =
    128;  // h and the expert width come in whole blocks
constexpr int64_t kTileEdge = 16;
constexpr int64_t kMaxTopk =
    64;  // a bound for the combine's loop, far above real models
constexpr int64_t kMetaFields = 2;  // (offset, k2)
constexpr int64_t kGateUpRoles = 2;
// CUDA's grid z limit: the reconstruct runs one (expert, role) per z.
constexpr int64_t kMaxGridZ = 65535;
// k per grouped-GEMM pipeline stage (exl3_gemm.cuh kStageK): a k-split owns
// whole stages, so a stage count bounds the splits.
constexpr int64_t kStageDepth = 64;
// 16-byte rows for cp.async and vector access; 8 bytes for 4-element vector
// loads.
constexpr uintptr_t kRowAlign = 16;
constexpr uintptr_t kVectorAlign = 8;
constexpr uintptr_t kWordAlign = 4;

void check_shape(const char* name, const Tensor& t, std::vector<int64_t> want,
                 const char* op = kOp) {
  bool same = t.dim() == static_cast<int64_t>(want.size());
  for (size_t d = 0; same && d < want.size(); ++d) same = t.size(d) == want[d];
  std::string w = "[";
  for (size_t d = 0; d < want.size(); ++d)
    w += (d ? ", " : "") + std::to_string(want[d]);
  STD_TORCH_CHECK(same, op, ": ", name, " must be ", w, "], got ",
                  shape_str(t));
}

bool valid_k2(int64_t k2) {
  return (k2 >= 2 && k2 <= 16 && k2 % 2 == 0) || k2 == 3 || k2 == 5 || k2 == 7;
}

// The distinct bitrates a weight set's meta table holds (the caller's host
// copy): each a rate, no repeats, half rates only with MUL1.
std::vector<int> check_rates(const char* name, const std::vector<int64_t>& k2s,
                             int64_t codebook, const char* op = kOp) {
  STD_TORCH_CHECK(!k2s.empty(), op, ": ", name,
                  " (the distinct 2*bits of the experts) is empty");
  std::vector<int> out;
  for (int64_t k2 : k2s) {
    STD_TORCH_CHECK(valid_k2(k2), op, ": ", name, " holds 2*bits = ", k2,
                    "; rates are 1..8 bits (2..16) or 1.5/2.5/3.5 (3, 5, 7)");
    STD_TORCH_CHECK(
        k2 % 2 == 0 || codebook == 2, op, ": ", name, " holds the half rate ",
        k2,
        "/2 bits, which exists only with the MUL1 codebook (2), got codebook ",
        codebook);
    STD_TORCH_CHECK(
        std::find(out.begin(), out.end(), static_cast<int>(k2)) == out.end(),
        op, ": ", name, " lists 2*bits = ", k2, " twice");
    out.push_back(static_cast<int>(k2));
  }
  return out;
}

cudaStream_t current_stream(int32_t device) {
  void* s = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(device, &s));
  return static_cast<cudaStream_t>(s);
}

// The op's `wgmma` argument: let the op choose, never, or always (where it
// cannot run: an error).
constexpr int64_t kWgmmaAuto = -1;
constexpr int64_t kWgmmaForce = 1;
// Devices the engine answer is cached for (as exl3_plan.cpp's device facts).
constexpr int kMaxDevices = 64;

// Whether `device` (the current one) runs the wgmma engine, asked of its loaded
// image once.
bool device_has_wgmma(int32_t device) {
  static std::mutex mutex;
  static int8_t known[kMaxDevices] = {};  // 0 = not asked yet, 1 = no, 2 = yes
  STD_TORCH_CHECK(device >= 0 && device < kMaxDevices, kOp, ": device index ",
                  device, " out of range");
  std::lock_guard<std::mutex> lock(mutex);
  if (known[device] == 0) known[device] = wgmma_supported(device) ? 2 : 1;
  return known[device] == 2;
}

void check_launch(const char* what, const char* op = kOp) {
  const cudaError_t e = cudaGetLastError();
  STD_TORCH_CHECK(e == cudaSuccess, op, ": ", what,
                  " launch failed: ", cudaGetErrorString(e));
}

}  // namespace

Tensor exl3_moe(Tensor x, Tensor topk_weights, Tensor topk_ids,
                std::optional<Tensor> sorted_ids,
                std::optional<Tensor> expert_ids,
                std::optional<Tensor> num_tokens_post_pad,
                std::optional<Tensor> expert_map, Tensor w13_trellis,
                Tensor w13_meta, Tensor w13_suh, Tensor w13_svh,
                Tensor w2_trellis, Tensor w2_meta, Tensor w2_suh, Tensor w2_svh,
                int64_t block_size, std::vector<int64_t> w13_k2s,
                std::vector<int64_t> w2_k2s, int64_t global_num_experts,
                int64_t codebook, bool apply_router_weight_on_input,
                bool deterministic, int64_t gate_up_splits, int64_t down_splits,
                std::optional<Tensor> workspace, int64_t wgmma) {
  STD_TORCH_CHECK(x.is_cuda(), kOp, ": x must be a CUDA tensor");
  const int32_t dev = x.get_device_index();
  check_tensor(kOp, "x", x, 2, dev, kRowAlign);
  const ScalarType dtype = x.scalar_type();
  STD_TORCH_CHECK(dtype == ScalarType::BFloat16 || dtype == ScalarType::Half,
                  kOp, ": x must be bfloat16 or float16, got ",
                  dtype_str(dtype));
  const int64_t m = x.size(0), h = x.size(1);
  STD_TORCH_CHECK(h > 0 && h % kHadamardBlock == 0, kOp, ": x ", shape_str(x),
                  " has hidden size ", h,
                  ", which must be a positive multiple of 128");

  check_tensor(kOp, "topk_ids", topk_ids, 2, dev, kWordAlign);
  STD_TORCH_CHECK(topk_ids.scalar_type() == ScalarType::Int ||
                      topk_ids.scalar_type() == ScalarType::Long,
                  kOp, ": topk_ids must be int32 or int64, got ",
                  dtype_str(topk_ids.scalar_type()));
  const int64_t topk = topk_ids.size(1);
  STD_TORCH_CHECK(topk >= 1 && topk <= kMaxTopk, kOp, ": top-k = ", topk,
                  " is outside 1..", kMaxTopk);
  check_shape("topk_ids", topk_ids, {m, topk});
  check_tensor(kOp, "topk_weights", topk_weights, 2, dev, kWordAlign);
  check_dtype(kOp, "topk_weights", topk_weights, ScalarType::Float);
  check_shape("topk_weights", topk_weights, {m, topk});

  // Experts and widths from the weights.
  check_tensor(kOp, "w13_meta", w13_meta, 3, dev, kVectorAlign);
  check_dtype(kOp, "w13_meta", w13_meta, ScalarType::Long);
  const int64_t experts = w13_meta.size(0);
  STD_TORCH_CHECK(experts >= 1, kOp,
                  ": the layer has no local experts (w13_meta ",
                  shape_str(w13_meta), ")");
  check_shape("w13_meta", w13_meta, {experts, kGateUpRoles, kMetaFields});
  check_tensor(kOp, "w13_svh", w13_svh, 2, dev, kVectorAlign);
  check_dtype(kOp, "w13_svh", w13_svh, ScalarType::Half);
  const int64_t inter = w13_svh.size(1) / 2;
  STD_TORCH_CHECK(inter > 0 && inter % kHadamardBlock == 0, kOp, ": w13_svh ",
                  shape_str(w13_svh), " gives an expert width of ", inter,
                  ", which must be a positive multiple of 128");
  check_shape("w13_svh", w13_svh, {experts, 2 * inter});
  check_tensor(kOp, "w13_suh", w13_suh, 3, dev, kVectorAlign);
  check_dtype(kOp, "w13_suh", w13_suh, ScalarType::Half);
  check_shape("w13_suh", w13_suh, {experts, kGateUpRoles, h});
  check_tensor(kOp, "w2_meta", w2_meta, 2, dev, kVectorAlign);
  check_dtype(kOp, "w2_meta", w2_meta, ScalarType::Long);
  check_shape("w2_meta", w2_meta, {experts, kMetaFields});
  check_tensor(kOp, "w2_suh", w2_suh, 2, dev, kVectorAlign);
  check_dtype(kOp, "w2_suh", w2_suh, ScalarType::Half);
  check_shape("w2_suh", w2_suh, {experts, inter});
  check_tensor(kOp, "w2_svh", w2_svh, 2, dev, kVectorAlign);
  check_dtype(kOp, "w2_svh", w2_svh, ScalarType::Half);
  check_shape("w2_svh", w2_svh, {experts, h});
  check_tensor(kOp, "w13_trellis", w13_trellis, -1, dev, kRowAlign);
  check_dtype(kOp, "w13_trellis", w13_trellis, ScalarType::Short);
  check_tensor(kOp, "w2_trellis", w2_trellis, -1, dev, kRowAlign);
  check_dtype(kOp, "w2_trellis", w2_trellis, ScalarType::Short);
  STD_TORCH_CHECK(codebook >= 0 && codebook <= 2, kOp,
                  ": codebook must be 0 (3INST), 1 (MCG) or 2 (MUL1), got ",
                  codebook);
  const std::vector<int> rates13 = check_rates("w13_k2s", w13_k2s, codebook);
  const std::vector<int> rates2 = check_rates("w2_k2s", w2_k2s, codebook);

  // Routing.
  STD_TORCH_CHECK(global_num_experts >= experts, kOp,
                  ": global_num_experts = ", global_num_experts,
                  " is below the ", experts, " local experts");
  const int32_t* map_ptr = nullptr;
  if (expert_map.has_value()) {
    check_tensor(kOp, "expert_map", *expert_map, 1, dev, kWordAlign);
    check_dtype(kOp, "expert_map", *expert_map, ScalarType::Int);
    check_shape("expert_map", *expert_map, {global_num_experts});
    map_ptr = static_cast<const int32_t*>(expert_map->data_ptr());
  } else {
    STD_TORCH_CHECK(global_num_experts == experts, kOp,
                    ": without an expert_map the ", experts,
                    " local experts must be all ", global_num_experts);
  }
  bool tier = false;
  std::string tiers;
  for (int t : kMoeTiers) {
    tier = tier || block_size == kTileEdge * t;
    tiers += (tiers.empty() ? "" : ", ") + std::to_string(kTileEdge * t);
  }
  STD_TORCH_CHECK(tier, kOp, ": block_size ", block_size,
                  " is not a tier of the grouped GEMM (", tiers, ")");
  // The alignment's three arrays come together (the aligned layout) or not at
  // all (the pairs layout: block b serves routed pair b alone).
  const int given = sorted_ids.has_value() + expert_ids.has_value() +
                    num_tokens_post_pad.has_value();
  STD_TORCH_CHECK(given == 0 || given == 3, kOp,
                  ": sorted_ids, expert_ids and num_tokens_post_pad are given "
                  "together (moe_align_block_size's layout) or all None (the "
                  "pairs layout), got ",
                  given, " of them");
  const bool pairs_layout = given == 0;
  const int64_t pairs = m * topk;
  int64_t sorted_len = pairs * block_size;
  if (!pairs_layout) {
    check_tensor(kOp, "sorted_ids", *sorted_ids, 1, dev, kWordAlign);
    check_dtype(kOp, "sorted_ids", *sorted_ids, ScalarType::Int);
    check_tensor(kOp, "expert_ids", *expert_ids, 1, dev, kWordAlign);
    check_dtype(kOp, "expert_ids", *expert_ids, ScalarType::Int);
    check_tensor(kOp, "num_tokens_post_pad", *num_tokens_post_pad, 1, dev,
                 kWordAlign);
    check_dtype(kOp, "num_tokens_post_pad", *num_tokens_post_pad,
                ScalarType::Int);
    check_shape("num_tokens_post_pad", *num_tokens_post_pad, {1});
    sorted_len = sorted_ids->size(0);
    check_shape("expert_ids", *expert_ids,
                {(sorted_len + block_size - 1) / block_size});
  }
  const int64_t row_blocks = (sorted_len + block_size - 1) / block_size;
  const int64_t slots = row_blocks * block_size;
  STD_TORCH_CHECK(
      pairs < (int64_t{1} << 31) && kGateUpRoles * slots < (int64_t{1} << 31) &&
          m * (h / kHadamardBlock) < (int64_t{1} << 31) &&
          slots * std::max(h, inter) * kGateUpRoles < (int64_t{1} << 40),
      kOp, ": problem too large (", pairs, " routed pairs, ", slots, " slots)");
  STD_TORCH_CHECK(w13_trellis.numel() < (int64_t{1} << 40) &&
                      w2_trellis.numel() < (int64_t{1} << 40),
                  kOp, ": trellis too large");

  // Split-k (the caller's rule, moe_kernels.py): each split owns at least one
  // stage of k; the partial sums live in the caller's fp32 workspace, gate/up's
  // [gate_up_splits][2][pairs][inter] first, then down's
  // [down_splits][pairs][h] (an unsplit stage takes none).
  STD_TORCH_CHECK(gate_up_splits >= 1 && gate_up_splits <= h / kStageDepth, kOp,
                  ": gate_up_splits = ", gate_up_splits, " is outside 1..",
                  h / kStageDepth, " (the 64-deep stages of the hidden size ",
                  h, ")");
  STD_TORCH_CHECK(down_splits >= 1 && down_splits <= inter / kStageDepth, kOp,
                  ": down_splits = ", down_splits, " is outside 1..",
                  inter / kStageDepth,
                  " (the 64-deep stages of the expert width ", inter, ")");
  const bool split13 = gate_up_splits > 1, split2 = down_splits > 1;
  STD_TORCH_CHECK(
      !(split13 || split2) || block_size <= kTileEdge * kMoeSplitMaxTier, kOp,
      ": k-splits (", gate_up_splits, ", ", down_splits,
      ") are built for block sizes up to ", kTileEdge * kMoeSplitMaxTier,
      ", got block_size ", block_size);
  const int64_t partial13 =
      split13 ? gate_up_splits * kGateUpRoles * pairs * inter : 0;
  const int64_t partial2 = split2 ? down_splits * pairs * h : 0;
  float* ws = nullptr;
  if (split13 || split2) {
    STD_TORCH_CHECK(workspace.has_value(), kOp,
                    ": gate_up_splits = ", gate_up_splits,
                    " and down_splits = ", down_splits, " need a workspace of ",
                    partial13 + partial2, " float32 elements, got none");
    check_tensor(kOp, "workspace", *workspace, 1, dev, kRowAlign);
    check_dtype(kOp, "workspace", *workspace, ScalarType::Float);
    STD_TORCH_CHECK(
        workspace->numel() >= partial13 + partial2, kOp, ": workspace ",
        shape_str(*workspace), " holds fewer than the ", partial13 + partial2,
        " float32 partial sums of ", gate_up_splits, " gate/up and ",
        down_splits, " down splits over ", pairs, " routed pairs");
    ws = static_cast<float*>(workspace->data_ptr());
  }

  torch::stable::accelerator::DeviceGuard guard(dev);
  const cudaStream_t stream = current_stream(dev);
  // The math engine of both grouped GEMMs: wgmma on sm_90a for the unsplit
  // tiers it is built for (the caller passes 0 where one reduction order must
  // serve every batch size), mma.sync elsewhere.
  const int mt = static_cast<int>(block_size / kTileEdge);
  STD_TORCH_CHECK(wgmma >= kWgmmaAuto && wgmma <= kWgmmaForce, kOp,
                  ": wgmma must be -1 (auto), 0 (never) or 1 (always), got ",
                  wgmma);
  const bool wg_tier =
      std::find(std::begin(kMoeWgmmaTiers), std::end(kMoeWgmmaTiers), mt) !=
          std::end(kMoeWgmmaTiers) &&
      !split13 && !split2;
  const bool wg_device = wgmma != 0 && device_has_wgmma(dev);
  if (wgmma == kWgmmaForce) {
    STD_TORCH_CHECK(wg_tier, kOp, ": wgmma = 1 needs an unsplit block_size of ",
                    kTileEdge * kMoeWgmmaTiers[0], " or ",
                    kTileEdge * kMoeWgmmaTiers[1], ", got block_size ",
                    block_size, " with splits (", gate_up_splits, ", ",
                    down_splits, ")");
    STD_TORCH_CHECK(wg_device, kOp,
                    ": wgmma = 1 needs a compute capability 9.0 device with "
                    "this build's sm_90a image; device ",
                    dev, " is not one");
  }
  const bool use_wgmma = wg_tier && wg_device;
  Tensor y = torch::stable::new_empty(x, {m, h});
  if (m == 0) return y;
  const bool bf16 = dtype == ScalarType::BFloat16;
  const float* weights = static_cast<const float*>(topk_weights.data_ptr());
  // The pairs layout's arrays, written by the input transform: sorted_ids
  // [slots], expert_ids [row_blocks], num_post_pad [1], in one scratch tensor.
  std::optional<Tensor> layout_arrays;
  MoePairsLayout layout{};
  if (pairs_layout) {
    layout_arrays =
        torch::stable::new_empty(x, {slots + row_blocks + 1}, ScalarType::Int);
    int32_t* base = static_cast<int32_t*>(layout_arrays->data_ptr());
    layout.topk_ids = topk_ids.data_ptr();
    layout.ids64 = topk_ids.scalar_type() == ScalarType::Long;
    layout.expert_map = map_ptr;
    layout.global_experts = static_cast<int>(global_num_experts);
    layout.sorted_ids = base;
    layout.expert_ids = base + slots;
    layout.num_post_pad = base + slots + row_blocks;
  }
  const int32_t* sorted =
      pairs_layout ? layout.sorted_ids
                   : static_cast<const int32_t*>(sorted_ids->data_ptr());
  const int32_t* blocks =
      pairs_layout ? layout.expert_ids
                   : static_cast<const int32_t*>(expert_ids->data_ptr());
  const int32_t* post_pad =
      pairs_layout
          ? layout.num_post_pad
          : static_cast<const int32_t*>(num_tokens_post_pad->data_ptr());

  // The fast combine adds the top-k rows into one fp32 sum per token (order
  // unspecified); zero it first, before anything else is queued, so it never
  // sits between two dependent grids. A split down projection needs neither:
  // its partial rows go to the workspace, and the combine sums them in a fixed
  // order in both modes (one node fewer than zeroing plus rounding).
  const bool atomic_sum = !deterministic && !split2;
  std::optional<Tensor> acc;
  if (atomic_sum) {
    acc = torch::stable::new_empty(x, {m, h}, ScalarType::Float);
    const cudaError_t e = cudaMemsetAsync(
        acc->data_ptr(), 0, static_cast<size_t>(m * h) * sizeof(float), stream);
    STD_TORCH_CHECK(e == cudaSuccess, kOp,
                    ": zeroing the sum failed: ", cudaGetErrorString(e));
  }

  Tensor xh13 =
      torch::stable::new_empty(x, {kGateUpRoles, slots, h}, ScalarType::Half);
  uint32_t mask13 = 0, mask2 = 0;
  for (int k2 : rates13) mask13 |= 1u << k2;
  for (int k2 : rates2) mask2 |= 1u << k2;
  launch_moe_input_transform(
      x.data_ptr(), bf16, apply_router_weight_on_input ? weights : nullptr,
      w13_suh.data_ptr(), static_cast<const int64_t*>(w13_meta.data_ptr()),
      static_cast<const int64_t*>(w2_meta.data_ptr()), mask13, mask2, sorted,
      blocks, post_pad, pairs_layout ? &layout : nullptr, xh13.data_ptr(),
      static_cast<int>(h), static_cast<int>(slots),
      static_cast<int>(sorted_len), static_cast<int>(block_size),
      static_cast<int>(pairs), static_cast<int>(topk),
      static_cast<int>(experts), stream);
  check_launch("input transform");

  MoeGemmParams p{};
  p.sorted_ids = sorted;
  p.expert_ids = blocks;
  p.num_post_pad = post_pad;
  p.slots = static_cast<int>(slots);
  p.sorted_len = static_cast<int>(sorted_len);
  p.pairs = static_cast<int>(pairs);
  p.topk = static_cast<int>(topk);
  p.experts = static_cast<int>(experts);
  p.out_bf16 = bf16;
  p.splits = 1;

  // Unsplit, gate/up writes its rows in the activation dtype; split, the
  // partial sums replace them.
  std::optional<Tensor> y13;
  if (!split13) y13 = torch::stable::new_empty(x, {kGateUpRoles, slots, inter});
  float* part13 = split13 ? ws : nullptr;
  float* part2 = split2 ? ws + partial13 : nullptr;
  MoeGemmParams g = p;
  g.xh = xh13.data_ptr();
  g.trellis = w13_trellis.data_ptr();
  g.trellis_numel = w13_trellis.numel();
  g.meta = static_cast<const int64_t*>(w13_meta.data_ptr());
  g.svh = w13_svh.data_ptr();
  g.out = split13 ? nullptr : y13->data_ptr();
  g.partial = part13;
  g.splits = static_cast<int>(gate_up_splits);
  g.k = static_cast<int>(h);
  g.n = static_cast<int>(inter);
  g.roles = static_cast<int>(kGateUpRoles);
  if (use_wgmma)
    encode_xh_map(&g.xh_map, g.xh, 1, g.roles * g.slots, g.k,
                  static_cast<int>(block_size));
  // The pairs layout's arrays come from the input transform, which only the
  // first gate/up launch overlaps: its blocks wait for it before reading them.
  // Every grid after it (the other rates' launches, the SwiGLU transform, the
  // down GEMM) is scheduled only once each of its blocks has passed that wait
  // (a working block releases its dependents as its k loop starts, an idle one
  // as it ends), i.e. after the transform completed, and reads them as it reads
  // the alignment's.
  g.wait_for_routing = pairs_layout;
  for (int k2 : rates13) {
    moe_rate_kernels(k2).gemm(MoeStage::kGateUp, static_cast<int>(codebook), mt,
                              use_wgmma, g, stream);
    check_launch("gate/up GEMM");
    g.wait_for_routing = false;
  }

  Tensor xh2 = torch::stable::new_empty(x, {slots, inter}, ScalarType::Half);
  launch_moe_act_transform(
      split13 ? nullptr : y13->data_ptr(), part13,
      static_cast<int>(gate_up_splits), bf16, w2_suh.data_ptr(), sorted, blocks,
      post_pad, xh2.data_ptr(), static_cast<int>(inter),
      static_cast<int>(slots), static_cast<int>(sorted_len),
      static_cast<int>(block_size), static_cast<int>(pairs),
      static_cast<int>(experts), stream);
  check_launch("SwiGLU transform");

  std::optional<Tensor> rows;
  if (deterministic && !split2) rows = torch::stable::new_empty(x, {pairs, h});
  MoeGemmParams d = p;
  d.xh = xh2.data_ptr();
  d.trellis = w2_trellis.data_ptr();
  d.trellis_numel = w2_trellis.numel();
  d.meta = static_cast<const int64_t*>(w2_meta.data_ptr());
  d.svh = w2_svh.data_ptr();
  d.topk_weights = apply_router_weight_on_input ? nullptr : weights;
  d.out = split2 ? nullptr : atomic_sum ? acc->data_ptr() : rows->data_ptr();
  d.accumulate = atomic_sum;
  d.partial = part2;
  d.splits = static_cast<int>(down_splits);
  d.k = static_cast<int>(inter);
  d.n = static_cast<int>(h);
  d.roles = 1;
  if (use_wgmma)
    encode_xh_map(&d.xh_map, d.xh, 1, d.slots, d.k,
                  static_cast<int>(block_size));
  for (int k2 : rates2) {
    moe_rate_kernels(k2).gemm(MoeStage::kDown, static_cast<int>(codebook), mt,
                              use_wgmma, d, stream);
    check_launch("down GEMM");
  }

  if (!atomic_sum) {
    launch_moe_combine(split2 ? nullptr : rows->data_ptr(), part2,
                       static_cast<int>(down_splits), topk_ids.data_ptr(),
                       topk_ids.scalar_type() == ScalarType::Long, map_ptr,
                       static_cast<int>(global_num_experts),
                       static_cast<int>(experts), y.data_ptr(), bf16,
                       static_cast<int>(m), static_cast<int>(h),
                       static_cast<int>(topk), stream);
    check_launch("combine");
  } else {
    launch_moe_finish_sum(static_cast<const float*>(acc->data_ptr()),
                          y.data_ptr(), bf16, m * h, stream);
    check_launch("sum rounding");
  }
  return y;
}

// out [E, roles * n, k] (x's dtype: bf16 or fp16) = every (expert, role)
// weight in the original basis, transposed: the w1 / w2 of vLLM's fused MoE.
// meta [E, roles, 2], suh [E, roles, k], svh [E, roles * n]; `k2s` the
// distinct 2*bits of meta (the caller's host copy).
void exl3_moe_reconstruct(Tensor trellis, Tensor meta, Tensor suh, Tensor svh,
                          std::vector<int64_t> k2s, int64_t codebook,
                          Tensor out) {
  const char* op = "exl3_moe_reconstruct";
  STD_TORCH_CHECK(out.is_cuda(), op, ": out must be a CUDA tensor");
  const int32_t dev = out.get_device_index();
  check_tensor(op, "out", out, 3, dev, kRowAlign);
  const ScalarType dtype = out.scalar_type();
  STD_TORCH_CHECK(dtype == ScalarType::BFloat16 || dtype == ScalarType::Half,
                  op, ": out must be bfloat16 or float16, got ",
                  dtype_str(dtype));
  check_tensor(op, "meta", meta, 3, dev, kVectorAlign);
  check_dtype(op, "meta", meta, ScalarType::Long);
  const int64_t experts = meta.size(0), roles = meta.size(1);
  STD_TORCH_CHECK(experts >= 1 && roles >= 1 && roles <= kGateUpRoles &&
                      meta.size(2) == kMetaFields,
                  op, ": meta must be [experts, 1 or 2 roles, 2], got ",
                  shape_str(meta));
  check_tensor(op, "suh", suh, 3, dev, kVectorAlign);
  check_dtype(op, "suh", suh, ScalarType::Half);
  const int64_t k = suh.size(2);
  check_tensor(op, "svh", svh, 2, dev, kVectorAlign);
  check_dtype(op, "svh", svh, ScalarType::Half);
  const int64_t n = svh.size(1) / roles;
  STD_TORCH_CHECK(
      k > 0 && k % kHadamardBlock == 0 && n > 0 && n % kHadamardBlock == 0, op,
      ": suh ", shape_str(suh), " and svh ", shape_str(svh), " give k = ", k,
      ", n = ", n, "; both must be positive multiples of 128");
  STD_TORCH_CHECK(experts * roles <= kMaxGridZ, op, ": ", experts, " x ", roles,
                  " weights exceed one launch's grid");
  check_shape("suh", suh, {experts, roles, k}, op);
  check_shape("svh", svh, {experts, roles * n}, op);
  check_shape("out", out, {experts, roles * n, k}, op);
  check_tensor(op, "trellis", trellis, -1, dev, kRowAlign);
  check_dtype(op, "trellis", trellis, ScalarType::Short);
  STD_TORCH_CHECK(trellis.numel() < (int64_t{1} << 40), op,
                  ": trellis too large");
  STD_TORCH_CHECK(codebook >= 0 && codebook <= 2, op,
                  ": codebook must be 0 (3INST), 1 (MCG) or 2 (MUL1), got ",
                  codebook);
  const std::vector<int> rates = check_rates("k2s", k2s, codebook, op);

  torch::stable::accelerator::DeviceGuard guard(dev);
  const cudaStream_t stream = current_stream(dev);
  MoeReconParams p{};
  p.trellis = trellis.data_ptr();
  p.meta = static_cast<const int64_t*>(meta.data_ptr());
  p.suh = suh.data_ptr();
  p.svh = svh.data_ptr();
  p.w = out.data_ptr();
  p.trellis_numel = trellis.numel();
  p.k = static_cast<int>(k);
  p.n = static_cast<int>(n);
  p.roles = static_cast<int>(roles);
  p.experts = static_cast<int>(experts);
  p.out_bf16 = dtype == ScalarType::BFloat16;
  for (int k2 : rates) {
    moe_rate_kernels(k2).reconstruct(static_cast<int>(codebook), p, stream);
    check_launch("reconstruct", op);
  }
}

}  // namespace vllm_exl3

STABLE_TORCH_LIBRARY_FRAGMENT(_C, m) {
  m.def(
      "exl3_moe(Tensor x, Tensor topk_weights, Tensor topk_ids, Tensor? "
      "sorted_ids, "
      "Tensor? expert_ids, Tensor? num_tokens_post_pad, Tensor? expert_map, "
      "Tensor w13_trellis, "
      "Tensor w13_meta, Tensor w13_suh, Tensor w13_svh, Tensor w2_trellis, "
      "Tensor w2_meta, "
      "Tensor w2_suh, Tensor w2_svh, int block_size, int[] w13_k2s, int[] "
      "w2_k2s, "
      "int global_num_experts, int codebook, bool "
      "apply_router_weight_on_input, "
      "bool deterministic, int gate_up_splits, int down_splits, "
      "Tensor? workspace, int wgmma) -> Tensor");
  m.def(
      "exl3_moe_reconstruct(Tensor trellis, Tensor meta, Tensor suh, Tensor "
      "svh, int[] k2s, int codebook, Tensor(a!) out) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(_C, CUDA, m) {
  m.impl("exl3_moe", TORCH_BOX(&vllm_exl3::exl3_moe));
  m.impl("exl3_moe_reconstruct", TORCH_BOX(&vllm_exl3::exl3_moe_reconstruct));
}
