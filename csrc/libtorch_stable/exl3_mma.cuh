// SPDX-License-Identifier: Apache-2.0
// The tensor-core and asynchronous-copy primitives shared by the EXL3 kernels:
// the trellis GEMM (quantization/exl3/) and the sparse-MLA decode
// (attention/exl3_sparse_mla/). mma.sync m16n8k16, ldmatrix and cp.async exist
// on every target the kernels are built for (sm_80 on). Hopper's warpgroup MMA
// (wgmma) exists only in arch-specific sm_90a images: there EXL3_WGMMA is 1;
// elsewhere its wrappers compile to nothing, the kernels that need it trap,
// and the host never selects them (wgmma_supported).
#pragma once

#include <cstdint>

namespace vllm_exl3 {

// Threads of one warpgroup: the unit that issues a wgmma together.
constexpr int kWarpgroupThreads = 128;
// 128-byte swizzle: rows of 128 bytes, 16-byte chunks XORed with (row & 7),
// repeating every 8 rows (1024 bytes). The hardware decodes it from absolute
// address bits, so every operand region must start on a 1024-byte boundary.
constexpr int kSwizzleAtomBytes = 1024;

// Whether `device` runs this build's wgmma code (an sm_90a image on a 9.0
// device), asked of the image the device loaded (exl3_mma.cu). `device` must
// be the current device. No launch and no allocation, so it may be asked
// during CUDA-graph capture.
bool wgmma_supported(int device);

}  // namespace vllm_exl3

#ifdef __CUDACC__
  #if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    #define EXL3_WGMMA 1
    #include "exl3_wgmma_ops.h"
  #else
    #define EXL3_WGMMA 0
  #endif

namespace vllm_exl3 {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global->shared copy to shared address `dst`; src_bytes = 0
// zero-fills the destination without reading (rows past the end).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src,
                                           int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
               "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src,
                                           int src_bytes) {
  cp_async16(smem_addr(dst), src, src_bytes);
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
// Until at most N of this thread's newest commit groups are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four 8x8 b16 matrices from shared memory; lane l supplies the row address
// of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  ldmatrix_x4(r, smem_addr(p));
}
// The same, each matrix transposed.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4],
                                                  const void* p) {
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "r"(smem_addr(p)));
}

// D += A(16x16, row) * B(16x8, col), fp32 accumulators: fp16 operands
// (mma_16816) or bf16 ones (mma_16816_bf16).
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4],
                                          uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
      "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_16816_bf16(float (&d)[4],
                                               const uint32_t (&a)[4],
                                               uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
      "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Warpgroup MMA. Shared-memory matrix descriptor fields (PTX ISA, "Matrix
// Descriptor Format"): addresses and byte offsets are stored >> 4; 1 in bits
// 62-63 selects the 128-byte swizzle.
constexpr uint64_t kDescSwizzle128 = 1ull << 62;
constexpr int kDescAddrBits = 14;

// Descriptor of a K-major N x 64 16-bit tile at `addr` (N rows of 128 bytes).
// The stride between 8-row groups is one swizzle atom; the leading offset is
// unused by K-major swizzled layouts whose k16 step (32 bytes) stays inside a
// row, and is set to 1 by convention.
__device__ __forceinline__ uint64_t wgmma_desc_k_major_sw128(uint32_t addr) {
  return static_cast<uint64_t>((addr >> 4) & ((1u << kDescAddrBits) - 1)) |
         (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(kSwizzleAtomBytes >> 4) << 32) |
         kDescSwizzle128;
}
// Descriptor of an MN-major operand in the same 128-byte swizzle: rows of 64
// MN values (one k each) in atoms of 8 k rows; `mn_block_bytes` apart sit the
// next 64 MN values (the leading offset), one atom apart the next 8 k (the
// stride offset). The sparse-MLA decode reads V this way from the K-major
// rows it gathered for S = Q K^T.
__device__ __forceinline__ uint64_t
wgmma_desc_mn_major_sw128(uint32_t addr, uint32_t mn_block_bytes) {
  return static_cast<uint64_t>((addr >> 4) & ((1u << kDescAddrBits) - 1)) |
         (static_cast<uint64_t>((mn_block_bytes >> 4) &
                                ((1u << kDescAddrBits) - 1))
          << 16) |
         (static_cast<uint64_t>(kSwizzleAtomBytes >> 4) << 32) |
         kDescSwizzle128;
}

__device__ __forceinline__ void wgmma_fence() {
  #if EXL3_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
  #endif
}
__device__ __forceinline__ void wgmma_commit() {
  #if EXL3_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  #endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  #if EXL3_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
  #endif
}
// cp.async and plain stores write shared memory through the generic proxy,
// wgmma reads it through the async proxy: each thread orders its own writes
// before the barrier that publishes them.
__device__ __forceinline__ void fence_proxy_async_shared() {
  #if EXL3_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  #endif
}
// Keeps the accumulators' registers tied to the asynchronous MMA (no
// reordering of their reads or writes across this point by the compiler).
template <int R>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[R]) {
  #pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

}  // namespace vllm_exl3
#endif  // __CUDACC__
