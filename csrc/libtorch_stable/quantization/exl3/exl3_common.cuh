// SPDX-License-Identifier: Apache-2.0
// Constants and helpers shared by the trellis kernels (GEMM, MoE GEMM,
// reconstructs, transforms). Their tensor-core and cp.async primitives, which
// the sparse-MLA decode uses too, are in ../../exl3_mma.cuh: mma.sync
// m16n8k16, ldmatrix and cp.async, so one source serves every target from
// sm_80 on. The one exception is the GEMM's optional Hopper engine
// (exl3_wgmma.cuh), compiled only into sm_90a images and chosen at run time
// only where the device runs one.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#include "../../exl3_mma.cuh"

namespace vllm_exl3 {

// Format (docs/design/exl3_format.md §2, §3): Hadamard blocks are 128 wide,
// trellis tiles 16x16 = 256 weights.
constexpr int kHadamard = 128;
constexpr int kTile = 16;
constexpr int kTilePositions = kTile * kTile;
// 1/sqrt(128): the normalisation of Ĥ, applied once per side.
constexpr float kHadamardScale = 0.08838834764831845f;
constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
// Each lane of a warp owns 8 consecutive trellis positions = its two mma B
// fragments (§3.2).
constexpr int kPositionsPerLane = kTilePositions / kWarpSize;
// The format allows k, n and shard widths only in whole Hadamard blocks; fused
// layers have at most qkv/gate_up-style shards, so a small fixed table in the
// kernel parameters suffices.
constexpr int kMaxShards = 8;

// Codebook ids (format.py Codebook) and their constants (§4).
enum CodebookId : int { kThreeInst = 0, kMcg = 1, kMul1 = 2 };
constexpr uint32_t kThreeInstMult = 89226354u;
constexpr uint32_t kThreeInstAdd = 64248484u;
constexpr uint32_t kMcgMult = 0xCBAC1FEDu;
constexpr uint32_t kMul1Mult = 0x83DCD12Du;
// 3INST/MCG: keep each half's sign and low 12 bits, force its exponent into
// 0b011xx.
constexpr uint32_t kHalvesAnd = 0x8FFF8FFFu;
constexpr uint32_t kHalvesXor = 0x3B603B60u;
// MUL1: byte sum t added to the fp16 pattern of 1024 (0x6400) gives the number
// 1024 + t exactly, in both halves of a half2; then one fp16 fma with these two
// constants.
constexpr uint32_t kMul1ByteOnes = 0x01010101u;
constexpr uint32_t kMul1Base2 = 0x64006400u;
constexpr uint16_t kMul1ScaleBits = 0x1EEE;
constexpr uint16_t kMul1BiasBits = 0xC931;

// 8-byte global->shared copy (only the L1-allocating .ca form exists at this
// size); src_bytes = 0 zero-fills.
__device__ __forceinline__ void cp_async8(uint32_t dst, const void* src,
                                          int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst),
               "l"(src), "r"(src_bytes));
}

// Programmatic dependent launch (sm_90+): a grid launched with programmatic
// stream serialization may start while its predecessor runs; it must wait
// before reading what the predecessor writes. The predecessor lets it be
// scheduled early. No-ops on older targets and when the launch attribute is
// absent.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Four fp32 added into global memory. sm_90 has a vector reduction (one L2
// transaction for 16 bytes); older targets fall back to scalar reductions.
__device__ __forceinline__ void red_add_f32x4(float* dst, float a, float b,
                                              float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1,%2,%3,%4};\n" ::"l"(dst),
               "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
#else
  atomicAdd(dst + 0, a);
  atomicAdd(dst + 1, b);
  atomicAdd(dst + 2, c);
  atomicAdd(dst + 3, d);
#endif
}

// The two 16-bit activation/output types (bf16 or fp16): packing and widening.
template <typename T>
struct Fp16Like;
template <>
struct Fp16Like<__half> {
  __device__ static __forceinline__ uint32_t pack2(float x, float y) {
    __half2 a = __floats2half2_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&a);
  }
  __device__ static __forceinline__ float to_float(__half v) {
    return __half2float(v);
  }
};
template <>
struct Fp16Like<__nv_bfloat16> {
  __device__ static __forceinline__ uint32_t pack2(float x, float y) {
    __nv_bfloat162 a = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&a);
  }
  __device__ static __forceinline__ float to_float(__nv_bfloat16 v) {
    return __bfloat162float(v);
  }
};

// Four fp32 rounded to T, as one 8-byte store's worth.
template <typename T>
__device__ __forceinline__ uint2 pack4(const float (&v)[4]) {
  return make_uint2(Fp16Like<T>::pack2(v[0], v[1]),
                    Fp16Like<T>::pack2(v[2], v[3]));
}

// Four consecutive 16-bit floats (8 bytes) to fp32.
template <typename T>
__device__ __forceinline__ void load4_f32(const T* p, float (&v)[4]) {
  uint2 raw = *reinterpret_cast<const uint2*>(p);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int j = 0; j < 4; ++j) v[j] = Fp16Like<T>::to_float(e[j]);
}

}  // namespace vllm_exl3
