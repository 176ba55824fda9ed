// SPDX-License-Identifier: Apache-2.0
// Hopper's warpgroup MMA (sm_90a) for the trellis GEMM's token-wide tier.
//
// Why a second math engine: at m = 64..512 the mma.sync GEMM is bound by
// mma.sync itself (636 TFLOP/s measured on the H200, against ~990 for wgmma)
// and by re-reading every activation row through ldmatrix once per warp. wgmma
// reads the activations straight from the swizzled shared-memory stage the
// cp.async pipeline already fills, and takes the decoded trellis tile from
// registers as its A operand, so the decode stays exactly as it is.
//
// Roles are transposed against the mma.sync kernel: D (64 x N) = Ŵᵀ (64 output
// columns x 16 k, registers) * xhᵀ (16 k x N tokens, shared memory). A
// warpgroup's warp w supplies rows 16w..16w+15 of A, which is its own 16-column
// trellis tile: the two B fragments of the tile (b0, b1: columns 0-7, b2, b3:
// columns 8-15; k rows 2q.. in b0/b2, 2q+8.. in b1/b3) are the A fragment {b0,
// b2, b1, b3}. Only compiled for sm_90a; elsewhere the kernel traps and the
// host never selects it (wgmma_supported, asked of the loaded image). The
// wgmma wrappers, descriptors and fences it shares with the sparse-MLA decode
// are in ../../exl3_mma.cuh; here are the GEMM's own: its pipeline depth and
// its TMA loads of the activations.
#pragma once

#include <cstdint>

#include "exl3_common.cuh"

namespace vllm_exl3 {

// The descriptor of the k16 step `kk` inside a 64-k stage row: 32 bytes
// further, in >> 4 units.
constexpr uint64_t kDescK16Step = (16 * 2) >> 4;
// wgmmas a warpgroup leaves in flight while it decodes the next step (each
// holds its own 4 A registers until it completes). With A from cp.async, 2 and
// 3 measured the same as 1 and cost registers. With A by TMA, which frees 54
// registers at BM 256, 2 is 0-3.5 % faster than 1 at BM 64-256 (design notes,
// "wgmma depth"); EXL3_WGMMA_IN_FLIGHT builds the other depths to measure
// again.
#ifndef EXL3_WGMMA_IN_FLIGHT
  #define EXL3_WGMMA_IN_FLIGHT 2
#endif
constexpr int kWgmmaInFlight = EXL3_WGMMA_IN_FLIGHT;

// The activations' stages come from the tensor memory accelerator (TMA): one
// thread issues a stage's whole A tile as one bulk tensor copy and arms that
// slot's mbarrier with its byte count; every thread waits on the barrier's
// phase before the stage's wgmmas read the tile. Both the copy and wgmma go
// through the async proxy, so no proxy fence sits between them.
__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t arrivals) {
#if EXL3_WGMMA
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar),
               "r"(arrivals)
               : "memory");
#endif
}
// Makes the initialised barriers visible to the async proxy (the TMA unit
// completes on them).
__device__ __forceinline__ void mbarrier_init_fence() {
#if EXL3_WGMMA
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
// On `leader` only (a predicate, not a branch: no control flow among in-flight
// wgmmas): arm the barrier for `bytes` and copy the box at (c0, c1, c2) of
// `map` into `dst`.
__device__ __forceinline__ void tma_load_3d(bool leader, uint32_t dst,
                                            const void* map, uint32_t bar,
                                            uint32_t bytes, int c0, int c1,
                                            int c2) {
#if EXL3_WGMMA
  asm volatile(
      "{\n.reg .pred lead;\nsetp.ne.u32 lead, %0, 0;\n"
      "@lead mbarrier.arrive.expect_tx.shared::cta.b64 _, [%3], %4;\n"
      "@lead "
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_"
      "tx::bytes"
      " [%1], [%2, {%5, %6, %7}], [%3];\n}\n" ::"r"(
          static_cast<uint32_t>(leader)),
      "r"(dst), "l"(map), "r"(bar), "r"(bytes), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
#endif
}
// Until the barrier has completed the phase of parity `parity`.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
#if EXL3_WGMMA
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred ready;\nmbarrier.try_wait.parity.shared::cta.b64 ready, "
        "[%1], %2;\n"
        "selp.u32 %0, 1, 0, ready;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
#endif
}

}  // namespace vllm_exl3
