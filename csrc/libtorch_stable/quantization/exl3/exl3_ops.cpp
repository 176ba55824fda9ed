// SPDX-License-Identifier: Apache-2.0
// torch.ops._C.exl3_linear / exl3_reconstruct / exl3_plan / exl3_time_plans:
// the launch resources (the device's shared-memory limits, the wgmma engine's
// tensor map of the activations), input validation, plan execution,
// registration. Stable ABI only
// (torch/csrc/stable, torch/headeronly, the AOTI shim for the current stream
// and torch's cuBLAS handle),
// so the same file builds into vLLM's _C_stable_libtorch and into the
// standalone _exl3_C.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <cublas_v2.h>
#include <cudaTypedefs.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "../../exl3_tensor_checks.h"
#include "exl3_kernels.h"

// Host-side launch resources. Buffers (the split-k workspace, scratch) are
// torch tensors from the caller or torch's caching allocator, and the cuBLAS
// handle is torch's.
namespace vllm_exl3 {

namespace {

constexpr int kMaxDevices = 64;

// The driver's tensor-map encoder, fetched through the runtime so nothing links
// libcuda directly.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    const cudaError_t e = cudaGetDriverEntryPointByVersion(
        "cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q);
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || p == nullptr)
      throw std::runtime_error(
          "exl3: the CUDA driver has no cuTensorMapEncodeTiled (the wgmma "
          "engine needs a CUDA 12 driver)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// One stage's A tile: kTmaBoxK fp16 = one 128-byte row per token, the 128-byte
// swizzle period.
constexpr cuuint32_t kTmaBoxK = 64;

struct SmemLimits {
  int sms = 0, per_sm = 0, reserved_per_block = 0, optin_per_block = 0;
};
SmemLimits smem_limits() {
  static SmemLimits cached[kMaxDevices];
  int dev = 0;
  cudaGetDevice(&dev);
  SmemLimits& l = cached[dev >= 0 && dev < kMaxDevices ? dev : 0];
  if (l.per_sm == 0) {
    cudaDeviceGetAttribute(&l.sms, cudaDevAttrMultiProcessorCount, dev);
    cudaDeviceGetAttribute(&l.per_sm,
                           cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev);
    cudaDeviceGetAttribute(&l.reserved_per_block,
                           cudaDevAttrReservedSharedMemoryPerBlock, dev);
    cudaDeviceGetAttribute(&l.optin_per_block,
                           cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  }
  return l;
}
// Shared memory is allocated to blocks in these units.
constexpr int kSmemGranule = 128;
}  // namespace

int smem_dynamic_ceiling(int static_bytes) {
  return smem_limits().optin_per_block - static_bytes;
}

int smem_to_spread(int64_t grid_blocks, int need, int static_bytes) {
  const SmemLimits l = smem_limits();
  const int blocks = static_cast<int>((grid_blocks + l.sms - 1) / l.sms);
  // blocks + 1 blocks, each with its dynamic, static and reserved parts, must
  // not fit on one SM.
  int bytes = l.per_sm / (blocks + 1) - l.reserved_per_block - static_bytes +
              kSmemGranule;
  bytes = (bytes + kSmemGranule - 1) / kSmemGranule * kSmemGranule;
  if (bytes < need) bytes = need;
  return std::min(bytes, smem_dynamic_ceiling(static_bytes));
}

void encode_xh_map(CUtensorMap* map, const void* xh, int shards, int m, int k,
                   int bm) {
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(k),
                              static_cast<cuuint64_t>(m),
                              static_cast<cuuint64_t>(shards)};
  // Byte strides of dims 1 and 2 (dim 0 is contiguous).
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(k) * 2,
                                 static_cast<cuuint64_t>(m) * k * 2};
  const cuuint32_t box[3] = {kTmaBoxK, static_cast<cuuint32_t>(bm), 1};
  const cuuint32_t unit[3] = {1, 1, 1};
  const CUresult r = tensor_map_encoder()(
      map, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3, const_cast<void*>(xh), dims,
      strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw std::runtime_error(
        "exl3: encoding the activations' tensor map failed (CUresult " +
        std::to_string(static_cast<int>(r)) + ", m = " + std::to_string(m) +
        ", k = " + std::to_string(k) + ", BM = " + std::to_string(bm) + ")");
}

}  // namespace vllm_exl3

namespace vllm_exl3 {

namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

constexpr int64_t kHadamardBlock =
    128;  // k, n and every shard width come in whole blocks
constexpr int64_t kTileEdge = 16;
// Trellis widths (int16 words per tile) that exist: 16 * bits for 1..8 bits,
// and 24/40/56 for the MUL1 half rates 1.5/2.5/3.5. K2 = width / 8 = 2 * bits.
constexpr int64_t kWordsPerK2 = 8;
// cp.async moves 16-byte chunks; 4-element vector loads and stores need 8
// bytes.
constexpr uintptr_t kCpAsyncAlign = 16;
constexpr uintptr_t kVectorAlign = 8;

// Validates the trellis and returns K2 (= 2 * bits).
int check_trellis(const char* op, const Tensor& trellis, int64_t codebook,
                  int32_t device) {
  check_tensor(op, "trellis", trellis, 3, device, kCpAsyncAlign);
  check_dtype(op, "trellis", trellis, ScalarType::Short);
  const int64_t width = trellis.size(2);
  const bool whole = width % 16 == 0 && width >= 16 && width <= 128;
  const bool half = width == 24 || width == 40 || width == 56;
  STD_TORCH_CHECK(
      whole || half, op, ": trellis width ", width,
      " is not 16 * bits for bits in 1..8 or 1.5/2.5/3.5 (24, 40, 56)");
  STD_TORCH_CHECK(codebook >= 0 && codebook <= 2, op,
                  ": codebook must be 0 (3INST), 1 (MCG) ", "or 2 (MUL1), got ",
                  codebook);
  STD_TORCH_CHECK(!half || codebook == 2, op,
                  ": half-integer bitrates (trellis width ", width,
                  ") exist only with the MUL1 codebook (2), got codebook ",
                  codebook);
  const int64_t k = trellis.size(0) * kTileEdge,
                n = trellis.size(1) * kTileEdge;
  STD_TORCH_CHECK(
      k > 0 && n > 0 && k % kHadamardBlock == 0 && n % kHadamardBlock == 0, op,
      ": trellis ", shape_str(trellis), " gives k = ", k, ", n = ", n,
      "; both must be positive multiples of 128 (EXL3 pads to Hadamard "
      "blocks)");
  return static_cast<int>(width / kWordsPerK2);
}

cudaStream_t current_stream(int32_t device) {
  void* s = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(device, &s));
  return static_cast<cudaStream_t>(s);
}

void check_launch(const char* op) {
  const cudaError_t e = cudaGetLastError();
  STD_TORCH_CHECK(e == cudaSuccess, op,
                  ": kernel launch failed: ", cudaGetErrorString(e));
}

ShardTable shard_table(const std::vector<int64_t>& widths, int64_t n) {
  ShardTable t{};
  t.count = static_cast<int>(widths.size());
  int64_t end = 0;
  for (size_t s = 0; s < widths.size(); ++s) {
    STD_TORCH_CHECK(widths[s] > 0 && widths[s] % kHadamardBlock == 0,
                    "exl3_linear: shard_widths[", s, "] = ", widths[s],
                    " must be a positive multiple of 128");
    end += widths[s];
    t.end[s] = static_cast<int>(end);
  }
  STD_TORCH_CHECK(end == n, "exl3_linear: shard_widths sum to ", end,
                  " but the trellis has n = ", n, " columns");
  return t;
}

cublasHandle_t torch_blas_handle() {
  // torch's handle of the current device and thread, bound to the current
  // stream, with its workspace from torch's caching allocator (capture-safe,
  // counted by vLLM's profiling).
  void* h = nullptr;
  TORCH_ERROR_CODE_CHECK(torch_get_current_cuda_blas_handle(&h));
  return static_cast<cublasHandle_t>(h);
}

// One validated exl3_linear problem and how to run a plan on it (the op and the
// plan timer).
struct LinearCall {
  const char* op;
  Tensor x, trellis, suh, svh, workspace;
  std::optional<Tensor> bias;
  int32_t dev = 0;
  int k2 = 0;
  int64_t m = 0, k = 0, n = 0, shards = 1, codebook = 0;
  bool bf16 = false;
  ShardTable table{};
  PlanTable plans;

  Problem problem() const {
    return Problem{dev,
                   static_cast<int>(m),
                   static_cast<int>(k),
                   static_cast<int>(n),
                   k2,
                   static_cast<int>(codebook),
                   static_cast<int>(shards),
                   bf16};
  }
  int64_t workspace_floats() const { return workspace.numel(); }

  // Enqueues `plan` on `stream`, writing y. Scratch tensors are allocated once
  // per call (torch's caching allocator; the plan timer reuses them across
  // runs).
  void run(const Plan& plan, Tensor& y, cudaStream_t stream,
           std::optional<Tensor>& xh, std::optional<Tensor>& w,
           std::optional<Tensor>& acc) const;
};

LinearCall prepare_linear(const char* op, const Tensor& x,
                          const Tensor& trellis, const Tensor& suh,
                          const Tensor& svh, const std::optional<Tensor>& bias,
                          const std::vector<int64_t>& shard_widths,
                          int64_t codebook, const std::vector<int64_t>& plans,
                          const Tensor& workspace) {
  LinearCall c{op, x, trellis, suh, svh, workspace, bias};
  STD_TORCH_CHECK(x.is_cuda(), op, ": x must be a CUDA tensor");
  const int32_t dev = x.get_device_index();
  c.dev = dev;
  check_tensor(op, "x", x, 2, dev, kCpAsyncAlign);
  const ScalarType dtype = x.scalar_type();
  STD_TORCH_CHECK(dtype == ScalarType::BFloat16 || dtype == ScalarType::Half,
                  op, ": x must be bfloat16 or float16, got ",
                  dtype_str(dtype));
  c.bf16 = dtype == ScalarType::BFloat16;
  c.k2 = check_trellis(op, trellis, codebook, dev);
  c.codebook = codebook;
  c.k = trellis.size(0) * kTileEdge;
  c.n = trellis.size(1) * kTileEdge;
  c.m = x.size(0);
  STD_TORCH_CHECK(x.size(1) == c.k, op, ": x ", shape_str(x), " has ",
                  x.size(1), " input features but the trellis ",
                  shape_str(trellis), " has k = ", c.k);

  STD_TORCH_CHECK(suh.dim() == 1 || suh.dim() == 2, op,
                  ": suh must be [S, k] (or [k]), got ", shape_str(suh));
  check_tensor(op, "suh", suh, suh.dim(), dev, kVectorAlign);
  check_dtype(op, "suh", suh, ScalarType::Half);
  c.shards = suh.dim() == 2 ? suh.size(0) : 1;
  STD_TORCH_CHECK(suh.size(suh.dim() - 1) == c.k, op, ": suh ", shape_str(suh),
                  " does not match k = ", c.k);
  STD_TORCH_CHECK(c.shards >= 1 && c.shards <= kMaxShardsHost, op, ": ",
                  c.shards, " shards; 1..", kMaxShardsHost, " are supported");
  STD_TORCH_CHECK(static_cast<int64_t>(shard_widths.size()) == c.shards, op,
                  ": suh has ", c.shards, " rows but shard_widths has ",
                  shard_widths.size(), " entries");
  c.table = shard_table(shard_widths, c.n);

  check_tensor(op, "svh", svh, 1, dev, kVectorAlign);
  check_dtype(op, "svh", svh, ScalarType::Half);
  STD_TORCH_CHECK(svh.size(0) == c.n, op, ": svh ", shape_str(svh),
                  " does not match n = ", c.n);
  if (bias.has_value()) {
    check_tensor(op, "bias", *bias, 1, dev, kVectorAlign);
    STD_TORCH_CHECK(bias->scalar_type() == dtype, op,
                    ": bias must have x's dtype ", dtype_str(dtype), ", got ",
                    dtype_str(bias->scalar_type()));
    STD_TORCH_CHECK(bias->size(0) == c.n, op, ": bias ", shape_str(*bias),
                    " does not match n = ", c.n);
  }
  check_tensor(op, "workspace", workspace, 1, dev, kCpAsyncAlign);
  check_dtype(op, "workspace", workspace, ScalarType::Float);
  STD_TORCH_CHECK(c.m < (int64_t{1} << 31) / kHadamardBlock &&
                      c.k * c.n < (int64_t{1} << 40),
                  op, ": problem too large (m = ", c.m, ", k = ", c.k,
                  ", n = ", c.n, ")");
  c.plans = parse_plan_table(plans, op);
  return c;
}

void LinearCall::run(const Plan& plan, Tensor& y, cudaStream_t stream,
                     std::optional<Tensor>& xh, std::optional<Tensor>& w,
                     std::optional<Tensor>& acc) const {
  const RateKernels& kernels = rate_kernels(k2);
  const void* bias_ptr = bias.has_value() ? bias->data_ptr() : nullptr;
  const int im = static_cast<int>(m), ik = static_cast<int>(k),
            in = static_cast<int>(n);
  const int cb = static_cast<int>(codebook);
  ReconParams rp{};
  rp.trellis = trellis.data_ptr();
  rp.suh = suh.data_ptr();
  rp.svh = svh.data_ptr();
  rp.k = ik;
  rp.n = in;
  rp.out_bf16 = bf16;
  rp.shards = table;
  const cudaDataType_t act_type = bf16 ? CUDA_R_16BF : CUDA_R_16F;

  auto transform_input = [&](bool release_early) {
    if (!xh) xh = torch::stable::new_empty(x, {shards, m, k}, ScalarType::Half);
    launch_input_transform(x.data_ptr(), bf16, suh.data_ptr(), xh->data_ptr(),
                           im, ik, static_cast<int>(shards), release_early,
                           stream);
    check_launch(op);
  };
  auto check_cublas = [&](cublasStatus_t st) {
    STD_TORCH_CHECK(st == CUBLAS_STATUS_SUCCESS, op,
                    ": cublasGemmEx failed with status ", static_cast<int>(st));
  };

  switch (plan.path) {
    case Path::kReconOriginal: {
      if (!w) w = torch::stable::new_empty(x, {k, n});
      rp.w = w->data_ptr();
      kernels.reconstruct_original(cb, rp, stream);
      check_launch(op);
      if (bias_ptr) {
        launch_bias_broadcast(bias_ptr, y.data_ptr(), bf16, im, in, stream);
        check_launch(op);
      }
      // Row-major y[m][n] = x[m][k] @ W[k][n] is column-major y^T = W^T x^T;
      // beta = 1 adds the broadcast bias inside the GEMM's single rounding.
      const float alpha = 1.0f, beta = bias_ptr ? 1.0f : 0.0f;
      check_cublas(cublasGemmEx(
          torch_blas_handle(), CUBLAS_OP_N, CUBLAS_OP_N, in, im, ik, &alpha,
          w->data_ptr(), act_type, in, x.data_ptr(), act_type, ik, &beta,
          y.data_ptr(), act_type, in, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      return;
    }
    case Path::kReconRotated: {
      transform_input(
          true);  // cuBLAS is launched without programmatic serialization
      if (!w) w = torch::stable::new_empty(x, {k, n}, ScalarType::Half);
      if (!acc) acc = torch::stable::new_empty(x, {m, n}, ScalarType::Float);
      rp.w = w->data_ptr();
      kernels.reconstruct_rotated(cb, rp, stream);
      check_launch(op);
      // Per shard: acc[:, cols_s] = xh[s] @ Ŵ[:, cols_s] (fp16 operands, fp32
      // out, ld = n).
      const float alpha = 1.0f, beta = 0.0f;
      const auto* wh = static_cast<const __half*>(w->data_ptr());
      const auto* xs = static_cast<const __half*>(xh->data_ptr());
      float* out = static_cast<float*>(acc->data_ptr());
      int col = 0;
      for (int s = 0; s < table.count; ++s) {
        const int width = table.end[s] - col;
        check_cublas(cublasGemmEx(torch_blas_handle(), CUBLAS_OP_N, CUBLAS_OP_N,
                                  width, im, ik, &alpha, wh + col, CUDA_R_16F,
                                  in, xs + static_cast<size_t>(s) * m * k,
                                  CUDA_R_16F, ik, &beta, out + col, CUDA_R_32F,
                                  in, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        col = table.end[s];
      }
      launch_splitk_finish(out, svh.data_ptr(), bias_ptr, y.data_ptr(), bf16,
                           im, in, false, stream);
      check_launch(op);
      return;
    }
    case Path::kFused: {
      transform_input(plan.early_release);
      GemmParams gp{};
      gp.xh = xh->data_ptr();
      gp.trellis = trellis.data_ptr();
      gp.svh = svh.data_ptr();
      gp.bias = bias_ptr;
      gp.y = y.data_ptr();
      gp.m = im;
      gp.k = ik;
      gp.n = in;
      gp.out_bf16 = bf16;
      gp.shards = table;
      if (plan.wgmma)
        encode_xh_map(&gp.xh_map, gp.xh, static_cast<int>(shards), im, ik,
                      plan.mt * kRowsPerTier);
      gp.spread = plan.spread;
      gp.splits = plan.splits;
      gp.stream_blocks = plan.stream_blocks;
      float* ws = static_cast<float*>(workspace.data_ptr());
      gp.ws = plan.uses_workspace() ? ws : nullptr;
      STD_TORCH_CHECK(!plan.uses_workspace() || workspace_floats() >= m * n, op,
                      ": the workspace holds ", workspace_floats(),
                      " floats, the plan's partial "
                      "sums need ",
                      m * n);
      (plan.wgmma ? kernels.gemm_wgmma : kernels.gemm)(cb, plan.mt, gp, stream);
      check_launch(op);
      if (plan.uses_workspace()) {
        launch_splitk_finish(ws, gp.svh, bias_ptr, gp.y, bf16, im, in, true,
                             stream);
        check_launch(op);
      }
      return;
    }
  }
}

}  // namespace

Tensor exl3_linear(Tensor x, Tensor trellis, Tensor suh, Tensor svh,
                   std::optional<Tensor> bias,
                   std::vector<int64_t> shard_widths, int64_t codebook,
                   std::vector<int64_t> plans, Tensor workspace) {
  const LinearCall c = prepare_linear("exl3_linear", x, trellis, suh, svh, bias,
                                      shard_widths, codebook, plans, workspace);
  torch::stable::accelerator::DeviceGuard guard(c.dev);
  Tensor y = torch::stable::new_empty(x, {c.m, c.n});
  if (c.m == 0) return y;
  const Plan plan =
      resolve_plan(c.problem(), c.plans, c.workspace_floats(), c.op);
  std::optional<Tensor> xh, w, acc;
  c.run(plan, y, current_stream(c.dev), xh, w, acc);
  return y;
}

std::vector<int64_t> exl3_time_plans(Tensor x, Tensor trellis, Tensor suh,
                                     Tensor svh, std::optional<Tensor> bias,
                                     std::vector<int64_t> shard_widths,
                                     int64_t codebook,
                                     std::vector<int64_t> plans,
                                     Tensor workspace) {
  const LinearCall c =
      prepare_linear("exl3_time_plans", x, trellis, suh, svh, bias,
                     shard_widths, codebook, plans, workspace);
  STD_TORCH_CHECK(c.m > 0, c.op, ": x has no rows");
  torch::stable::accelerator::DeviceGuard guard(c.dev);
  const cudaStream_t stream = current_stream(c.dev);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  STD_TORCH_CHECK(
      cudaStreamIsCapturing(stream, &status) == cudaSuccess &&
          status == cudaStreamCaptureStatusNone,
      c.op,
      ": the plan timer synchronizes and must not run during CUDA-graph "
      "capture");
  Problem pr = c.problem();
  pr.m = m_bucket(pr.m);
  const int64_t bucket = pr.m;
  Tensor y = torch::stable::new_empty(x, {c.m, c.n});
  std::optional<Tensor> xh, w, acc;
  std::vector<int64_t> out;
  for (const Plan& cand : plan_candidates(pr, c.plans.policy)) {
    if (cand.uses_workspace() && c.workspace_floats() < c.m * c.n) continue;
    const int64_t ns = time_plan(
        cand, stream, [&](const Plan& p) { c.run(p, y, stream, xh, w, acc); });
    std::vector<int64_t> entry = plan_entry(bucket, cand);
    out.insert(out.end(), entry.begin(), entry.end());
    out.push_back(ns);
  }
  return out;
}

std::vector<int64_t> exl3_plan(Tensor trellis, int64_t shards, int64_t codebook,
                               bool bf16, int64_t m, std::vector<int64_t> plans,
                               int64_t workspace_floats) {
  const char* op = "exl3_plan";
  STD_TORCH_CHECK(trellis.is_cuda(), op, ": trellis must be a CUDA tensor");
  const int32_t dev = trellis.get_device_index();
  const int k2 = check_trellis(op, trellis, codebook, dev);
  STD_TORCH_CHECK(shards >= 1 && shards <= kMaxShardsHost, op, ": ", shards,
                  " shards; 1..", kMaxShardsHost, " are supported");
  STD_TORCH_CHECK(m >= 1 && m < (int64_t{1} << 31) / kHadamardBlock, op,
                  ": m = ", m, " is out of range");
  torch::stable::accelerator::DeviceGuard guard(dev);
  const PlanTable table = parse_plan_table(plans, op);
  const Problem pr{dev,
                   static_cast<int>(m),
                   static_cast<int>(trellis.size(0) * kTileEdge),
                   static_cast<int>(trellis.size(1) * kTileEdge),
                   k2,
                   static_cast<int>(codebook),
                   static_cast<int>(shards),
                   bf16};
  PlanSource source = kSourceTable;
  const Plan plan = resolve_plan(pr, table, workspace_floats, op, &source);
  std::vector<int64_t> out = plan_entry(m_bucket(pr.m), plan);
  out.push_back(source);
  return out;
}

Tensor exl3_reconstruct(Tensor trellis, int64_t codebook) {
  const char* op = "exl3_reconstruct";
  STD_TORCH_CHECK(trellis.is_cuda(), op, ": trellis must be a CUDA tensor");
  const int32_t dev = trellis.get_device_index();
  const int k2 = check_trellis(op, trellis, codebook, dev);
  const int64_t k = trellis.size(0) * kTileEdge,
                n = trellis.size(1) * kTileEdge;
  torch::stable::accelerator::DeviceGuard guard(dev);
  Tensor w = torch::stable::new_empty(trellis, {k, n}, ScalarType::Half);
  ReconParams rp{};
  rp.trellis = trellis.data_ptr();
  rp.w = w.data_ptr();
  rp.k = static_cast<int>(k);
  rp.n = static_cast<int>(n);
  rate_kernels(k2).reconstruct_rotated(static_cast<int>(codebook), rp,
                                       current_stream(dev));
  check_launch(op);
  return w;
}

}  // namespace vllm_exl3

STABLE_TORCH_LIBRARY_FRAGMENT(_C, m) {
  m.def(
      "exl3_linear(Tensor x, Tensor trellis, Tensor suh, Tensor svh, Tensor? "
      "bias, "
      "int[] shard_widths, int codebook, int[] plans, Tensor workspace) -> "
      "Tensor");
  m.def("exl3_reconstruct(Tensor trellis, int codebook) -> Tensor");
  m.def(
      "exl3_plan(Tensor trellis, int shards, int codebook, bool bf16, int m, "
      "int[] plans, "
      "int workspace_floats) -> int[]");
  m.def(
      "exl3_time_plans(Tensor x, Tensor trellis, Tensor suh, Tensor svh, "
      "Tensor? bias, "
      "int[] shard_widths, int codebook, int[] plans, Tensor workspace) -> "
      "int[]");
}

STABLE_TORCH_LIBRARY_IMPL(_C, CUDA, m) {
  m.impl("exl3_linear", TORCH_BOX(&vllm_exl3::exl3_linear));
  m.impl("exl3_reconstruct", TORCH_BOX(&vllm_exl3::exl3_reconstruct));
  m.impl("exl3_plan", TORCH_BOX(&vllm_exl3::exl3_plan));
  m.impl("exl3_time_plans", TORCH_BOX(&vllm_exl3::exl3_time_plans));
}
