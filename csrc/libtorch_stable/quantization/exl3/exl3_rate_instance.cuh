// SPDX-License-Identifier: Apache-2.0
// Launchers of one bitrate: every codebook x BM tier of the GEMM and both
// reconstructs. Included once per exl3_rate_k<K2>.cu (generate_kernels.py),
// which calls EXL3_DEFINE_RATE(K2) (and EXL3_DEFINE_MOE_RATE(K2),
// exl3_moe.cuh).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "exl3_gemm.cuh"
#include "exl3_reconstruct.cuh"

namespace vllm_exl3 {

// Raise a kernel's dynamic shared-memory limit once per device (the attribute
// is per context). A refused limit throws here: unchecked, the kernel's
// launches would fail later with a bare "invalid argument".
template <typename Kernel>
inline void allow_smem(Kernel kernel, int bytes, unsigned& done_mask) {
  int dev = 0;
  cudaGetDevice(&dev);
  const unsigned bit = 1u << (dev & 31);
  if (!(done_mask & bit)) {
    const cudaError_t e = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e != cudaSuccess) {
      cudaGetLastError();  // not sticky: clear it so the caller's launch check
                           // is not misled
      throw std::runtime_error(
          "exl3: the device refused a kernel's dynamic shared-memory limit "
          "of " +
          std::to_string(bytes) + " bytes (" + cudaGetErrorString(e) + ")");
    }
    done_mask |= bit;
  }
}

// One GEMM kernel instantiation's shared memory on each device: its static part
// (split-k reduction scratch), read once, and its dynamic limit raised once to
// all a block may have beside it, so that a Plan::spread launch may ask for
// more than the kernel needs. Owned per instantiation (every GEMM kernel has
// the same function-pointer type).
struct GemmSmem {
  unsigned done = 0;
  int static_bytes[32] = {};
};
template <typename Kernel>
inline int prepare_gemm_smem(Kernel kernel, GemmSmem& st) {
  int dev = 0;
  cudaGetDevice(&dev);
  const unsigned bit = 1u << (dev & 31);
  if (!(st.done & bit)) {
    cudaFuncAttributes a{};
    if (cudaFuncGetAttributes(&a, kernel) != cudaSuccess) {
      cudaGetLastError();
      throw std::runtime_error(
          "exl3: cannot read a GEMM kernel's attributes on device " +
          std::to_string(dev));
    }
    const int static_bytes = static_cast<int>(a.sharedSizeBytes);
    unsigned once = 0;
    allow_smem(kernel, smem_dynamic_ceiling(static_bytes), once);
    st.static_bytes[dev & 31] = static_bytes;
    st.done |= bit;
  }
  return st.static_bytes[dev & 31];
}

// Half rates exist only with MUL1 (docs/design/exl3_format.md §1.5); the host
// validates before dispatch.
template <int K2>
constexpr bool codebook_valid(int cb) {
  return (K2 & 1) ? cb == kMul1 : (cb >= 0 && cb <= 2);
}

template <int K2, int CB, int MT, bool WG, bool SK>
void gemm_launch_grid(const GemmParams& p, const dim3 grid,
                      cudaStream_t stream) {
  using Shape = GemmShape<K2, MT, WG>;
  static GemmSmem smem_state;
  auto kernel = exl3_gemm_kernel<K2, CB, MT, WG, SK>;
  const int static_bytes = prepare_gemm_smem(kernel, smem_state);
  const int smem =
      p.spread ? smem_to_spread(static_cast<int64_t>(grid.x) * grid.y * grid.z,
                                Shape::kSmemBytes, static_bytes)
               : Shape::kSmemBytes;
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute attr[1];
  programmatic_launch(cfg, attr, grid, dim3(kGemmThreads), smem, stream);
  cudaLaunchKernelEx(&cfg, kernel, p);
}

template <int K2, int CB, int MT, bool WG>
void gemm_launch_tier(const GemmParams& p, cudaStream_t stream) {
  using Shape = GemmShape<K2, MT, WG>;
  if constexpr (WG && MT >= kStreamKMinTiles) {
    if (p.stream_blocks > 0) {
      gemm_launch_grid<K2, CB, MT, WG, true>(p, dim3(p.stream_blocks), stream);
      return;
    }
  }
  gemm_launch_grid<K2, CB, MT, WG, false>(
      p, dim3((p.m + Shape::kBM - 1) / Shape::kBM, p.n / kBlockN, p.splits),
      stream);
}

template <int K2, int CB, int MT, bool WG>
int gemm_occupancy_tier() {
  static int cached[32] = {0};
  int dev = 0;
  cudaGetDevice(&dev);
  int& c = cached[dev & 31];
  if (c == 0) {
    using Shape = GemmShape<K2, MT, WG>;
    static GemmSmem smem_state;
    auto kernel = exl3_gemm_kernel<K2, CB, MT, WG>;
    // The same limit as gemm_launch_grid's (either may run first).
    prepare_gemm_smem(kernel, smem_state);
    int blocks = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kGemmThreads,
                                                  Shape::kSmemBytes);
    c = blocks > 0 ? blocks : 1;
  }
  return c;
}

// mt -> the templated tier (of the engine: kGemmTiers or kWgmmaTiers); cb ->
// the codebook.
template <bool WG, typename F>
inline auto with_tier(int mt, F&& f) {
  if constexpr (WG) {
    switch (mt) {
      case 4:
        return f(std::integral_constant<int, 4>{});
      case 8:
        return f(std::integral_constant<int, 8>{});
      default:
        return f(std::integral_constant<int, 16>{});
    }
  } else {
    switch (mt) {
      case 1:
        return f(std::integral_constant<int, 1>{});
      case 2:
        return f(std::integral_constant<int, 2>{});
      case 4:
        return f(std::integral_constant<int, 4>{});
      default:
        return f(std::integral_constant<int, 8>{});
    }
  }
}

template <int K2, typename F>
inline auto with_codebook(int cb, F&& f) {
  if constexpr (K2 & 1) {
    return f(std::integral_constant<int, kMul1>{});
  } else {
    switch (cb) {
      case kThreeInst:
        return f(std::integral_constant<int, kThreeInst>{});
      case kMcg:
        return f(std::integral_constant<int, kMcg>{});
      default:
        return f(std::integral_constant<int, kMul1>{});
    }
  }
}

template <int K2, bool WG>
void gemm_launch(int cb, int mt, const GemmParams& p, cudaStream_t stream) {
  with_codebook<K2>(cb, [&](auto c) {
    with_tier<WG>(mt, [&](auto t) {
      gemm_launch_tier<K2, decltype(c)::value, decltype(t)::value, WG>(p,
                                                                       stream);
    });
  });
}

template <int K2, bool WG>
int gemm_blocks_per_sm(int cb, int mt) {
  return with_codebook<K2>(cb, [&](auto c) {
    return with_tier<WG>(mt, [&](auto t) {
      return gemm_occupancy_tier<K2, decltype(c)::value, decltype(t)::value,
                                 WG>();
    });
  });
}

template <int K2>
void reconstruct_rotated_launch(int cb, const ReconParams& p,
                                cudaStream_t stream) {
  with_codebook<K2>(cb, [&](auto c) {
    const dim3 grid(p.n / kHadamard, p.k / kTile);
    exl3_reconstruct_rotated_kernel<K2, decltype(c)::value>
        <<<grid, kReconThreads, 0, stream>>>(p);
  });
}

template <int K2>
void reconstruct_original_launch(int cb, const ReconParams& p,
                                 cudaStream_t stream) {
  with_codebook<K2>(cb, [&](auto c) {
    const dim3 grid(p.n / kHadamard, p.k / kHadamard);
    constexpr int kSmem = recon_original_smem<K2>();
    auto go = [&](auto kernel, unsigned& done) {
      allow_smem(kernel, kSmem, done);
      kernel<<<grid, kReconThreads, kSmem, stream>>>(p);
    };
    static unsigned done_bf16 = 0, done_fp16 = 0;
    if (p.out_bf16)
      go(exl3_reconstruct_original_kernel<K2, decltype(c)::value,
                                          __nv_bfloat16>,
         done_bf16);
    else
      go(exl3_reconstruct_original_kernel<K2, decltype(c)::value, __half>,
         done_fp16);
  });
}

template <int K2>
const RateKernels& make_rate_kernels() {
  static const RateKernels k{
      &gemm_launch<K2, false>,         &gemm_blocks_per_sm<K2, false>,
      &gemm_launch<K2, true>,          &gemm_blocks_per_sm<K2, true>,
      &reconstruct_rotated_launch<K2>, &reconstruct_original_launch<K2>};
  return k;
}

}  // namespace vllm_exl3

#define EXL3_DEFINE_RATE(K2)                                                  \
  namespace vllm_exl3 {                                                       \
  const RateKernels& rate_kernels_k##K2() { return make_rate_kernels<K2>(); } \
  }
