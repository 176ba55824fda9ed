// SPDX-License-Identifier: Apache-2.0
// Rate-independent kernels: the input transform, the split-k finish, the bias
// broadcast of the cuBLAS path and the plan timer's device sleep.

#include "exl3_hadamard.cuh"
#include "exl3_kernels.h"

namespace vllm_exl3 {

constexpr int kRowThreads = 256;
constexpr int kRowWarps = kRowThreads / kWarpSize;

// One warp per (row, 128-block of k); x is read once and every shard's row is
// written from it.
template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    exl3_input_transform_kernel(const T* __restrict__ x,
                                const __half* __restrict__ suh,
                                __half* __restrict__ xh, int m, int k,
                                int shards, bool release_early) {
  // Early release: the GEMM's blocks get scheduled now and prefetch their
  // trellis meanwhile. Otherwise they are released as this grid's blocks exit
  // (Plan::early_release says when).
  if (release_early) grid_dependents_launch();
  const int lane = threadIdx.x & 31;
  const int64_t item =
      static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  const int blocks_per_row = k / kHadamard;
  if (item >= static_cast<int64_t>(m) * blocks_per_row) return;
  const int row = static_cast<int>(item / blocks_per_row);
  const int col =
      static_cast<int>(item % blocks_per_row) * kHadamard + 4 * lane;
  float xv[4];
  load4_f32(x + static_cast<size_t>(row) * k + col, xv);
  for (int s = 0; s < shards; ++s) {
    float su[4], v[4];
    load4_f32(suh + static_cast<size_t>(s) * k + col, su);
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = xv[j] * su[j];
    hadamard128(v, lane);
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] *= kHadamardScale;
    *reinterpret_cast<uint2*>(xh + (static_cast<size_t>(s) * m + row) * k +
                              col) = pack4<__half>(v);
  }
}

// One warp per (row, 128-block of n): finish an fp32 [m][n] sum (split-k
// partials, or the cuBLAS product of the rotated reconstruct path). The split-k
// workspace is left zeroed, so the next call needs no memset. Launched with
// programmatic serialization: it may be scheduled while its producer runs,
// loads the column factors meanwhile, and waits for it before reading the sums.
template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    exl3_splitk_finish_kernel(float* __restrict__ acc,
                              const __half* __restrict__ svh,
                              const T* __restrict__ bias, T* __restrict__ y,
                              int m, int n, bool zero) {
  const int lane = threadIdx.x & 31;
  const int64_t item =
      static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5);
  const int blocks_per_row = n / kHadamard;
  const bool active = item < static_cast<int64_t>(m) * blocks_per_row;
  const int row = active ? static_cast<int>(item / blocks_per_row) : 0;
  const int col0 =
      active ? static_cast<int>(item % blocks_per_row) * kHadamard : 0;
  ColumnFactors f;
  if (active) load_column_factors(svh, bias, lane, col0, f);
  grid_dependency_wait();
  if (!active) return;
  float4* src =
      reinterpret_cast<float4*>(acc + static_cast<size_t>(row) * n + col0) +
      lane;
  const float4 c4 = *src;
  if (zero) *src = make_float4(0.f, 0.f, 0.f, 0.f);
  float v[4] = {c4.x, c4.y, c4.z, c4.w};
  finish_row<T>(v, lane, f, y + static_cast<size_t>(row) * n, col0);
}

template <typename T>
__global__ void exl3_bias_broadcast_kernel(const T* __restrict__ bias,
                                           T* __restrict__ y, int m, int n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < static_cast<int64_t>(m) * n) y[i] = bias[i % n];
}

__global__ void exl3_device_sleep_kernel(int64_t nanoseconds) {
  const int64_t start = clock64();
  // clock64 counts SM cycles; 1 cycle >= 0.5 ns below 2 GHz, so 2 cycles per ns
  // never undershoots by more than the clock ratio, which only lengthens the
  // (untimed) head start.
  constexpr int64_t kCyclesPerNs = 2;
  while (clock64() - start < nanoseconds * kCyclesPerNs) {
  }
}

static unsigned grid_for_warps(int64_t warps) {
  return static_cast<unsigned>((warps + kRowWarps - 1) / kRowWarps);
}

void launch_input_transform(const void* x, bool x_bf16, const void* suh,
                            void* xh, int m, int k, int shards,
                            bool release_early, cudaStream_t stream) {
  const unsigned grid =
      grid_for_warps(static_cast<int64_t>(m) * (k / kHadamard));
  if (x_bf16)
    exl3_input_transform_kernel<__nv_bfloat16>
        <<<grid, kRowThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(x),
                                           static_cast<const __half*>(suh),
                                           static_cast<__half*>(xh), m, k,
                                           shards, release_early);
  else
    exl3_input_transform_kernel<__half><<<grid, kRowThreads, 0, stream>>>(
        static_cast<const __half*>(x), static_cast<const __half*>(suh),
        static_cast<__half*>(xh), m, k, shards, release_early);
}

void launch_splitk_finish(float* acc, const void* svh, const void* bias,
                          void* y, bool out_bf16, int m, int n, bool zero,
                          cudaStream_t stream) {
  const unsigned grid =
      grid_for_warps(static_cast<int64_t>(m) * (n / kHadamard));
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute attr[1];
  programmatic_launch(cfg, attr, dim3(grid), dim3(kRowThreads), 0, stream);
  if (out_bf16)
    cudaLaunchKernelEx(&cfg, exl3_splitk_finish_kernel<__nv_bfloat16>, acc,
                       static_cast<const __half*>(svh),
                       static_cast<const __nv_bfloat16*>(bias),
                       static_cast<__nv_bfloat16*>(y), m, n, zero);
  else
    cudaLaunchKernelEx(&cfg, exl3_splitk_finish_kernel<__half>, acc,
                       static_cast<const __half*>(svh),
                       static_cast<const __half*>(bias),
                       static_cast<__half*>(y), m, n, zero);
}

void launch_bias_broadcast(const void* bias, void* y, bool bf16, int m, int n,
                           cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(m) * n;
  const unsigned grid =
      static_cast<unsigned>((total + kRowThreads - 1) / kRowThreads);
  if (bf16)
    exl3_bias_broadcast_kernel<__nv_bfloat16><<<grid, kRowThreads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(bias), static_cast<__nv_bfloat16*>(y),
        m, n);
  else
    exl3_bias_broadcast_kernel<__half><<<grid, kRowThreads, 0, stream>>>(
        static_cast<const __half*>(bias), static_cast<__half*>(y), m, n);
}

void launch_device_sleep(int microseconds, cudaStream_t stream) {
  exl3_device_sleep_kernel<<<1, 1, 0, stream>>>(
      static_cast<int64_t>(microseconds) * 1000);
}

}  // namespace vllm_exl3
