// SPDX-License-Identifier: Apache-2.0
// The host side of exl3_mma.cuh: whether the image a device loaded carries the
// sm_90a (wgmma) code. One translation unit for both kernels that ask, the
// trellis GEMM and the sparse-MLA decode: they are built into one extension
// with the same architecture flags, so one image answers for both.
#include <cuda_runtime.h>

#include "exl3_mma.cuh"

namespace vllm_exl3 {

// Never launched: its static shared memory is kWgmmaMarkerWords words in an
// image compiled with the sm_90a features (EXL3_WGMMA) and one word otherwise,
// so cudaFuncGetAttributes asks the image the device actually loaded, without a
// launch or an allocation (safe during capture).
constexpr int kWgmmaMarkerWords = 2;
__global__ void exl3_wgmma_marker_kernel(int* out) {
  __shared__ int words[EXL3_WGMMA ? kWgmmaMarkerWords : 1];
  constexpr int kWords = sizeof(words) / sizeof(int);
  words[threadIdx.x % kWords] = static_cast<int>(threadIdx.x);
  __syncthreads();
  out[threadIdx.x] = words[(threadIdx.x + 1) % kWords];
}

bool wgmma_supported(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor,
                             device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor,
                             device) != cudaSuccess)
    return false;
  if (major != 9 || minor != 0) return false;
  int current = 0;
  if (cudaGetDevice(&current) != cudaSuccess || current != device) return false;
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, exl3_wgmma_marker_kernel) != cudaSuccess) {
    cudaGetLastError();  // no image for this device: not an error of the
                         // caller's
    return false;
  }
  return attr.sharedSizeBytes == kWgmmaMarkerWords * sizeof(int);
}

}  // namespace vllm_exl3
