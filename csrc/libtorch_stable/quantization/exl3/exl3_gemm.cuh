// SPDX-License-Identifier: Apache-2.0
// The trellis GEMM: y = epilogue(xh @ Ŵ) without ever materialising Ŵ.
//
// A block owns BM rows x 128 columns (one Hadamard block, so the output
// transform stays in the block) x all of k or one k-split. Its 8 warps each own
// one 16-column trellis tile column and decode every tile of it exactly once,
// for all BM rows: lane t's 8 positions are its two mma B fragments (§3.2), so
// a decoded tile feeds 2 * BM/16 mma.m16n8k16 straight from registers.
// Activations (fp16, already Hadamard-transformed) and trellis words stream
// through a multi-stage cp.async pipeline in stages of 64 k; A rows are 128
// bytes, XOR-swizzled in 16-byte chunks so the ldmatrix phases hit distinct
// banks.
//
// On Hopper the same block can run its math on wgmma instead (WG = true,
// exl3_wgmma.cuh): the BM rows become the wgmma's N, each warp's decoded tile
// its 16 rows of the register A operand, and the tensor core reads the
// activations straight from the swizzled stage (the swizzle above is wgmma's
// 128-byte mode).
#pragma once

#include "exl3_hadamard.cuh"
#include "exl3_kernels.h"
#include "exl3_trellis.cuh"
#include "exl3_wgmma.cuh"

#include <cstddef>
#include <type_traits>
#include <utility>

namespace vllm_exl3 {

constexpr int kGemmThreads = 256;
constexpr int kGemmWarps = kGemmThreads / kWarpSize;
constexpr int kBlockN = kHadamard;  // whole Hadamard block: in-block epilogue
constexpr int kBlockTiles =
    kBlockN / kTile;  // 16-column trellis tiles across a block
// k per pipeline stage: 64 fp16 = one 128-byte A row = 8 16-byte chunks, the
// swizzle period.
constexpr int kStageK = 64;
constexpr int kStageKSteps = kStageK / kTile;
constexpr int kARowBytes = kStageK * 2;
// Stages in flight: 3 loads ahead of the one being consumed hides HBM latency
// at small m.
constexpr int kGemmStages = 4;
// Stages per k-loop iteration (sass_loop.py reads this name): one per slot,
// unrolled.
constexpr int kLoopStages = kGemmStages;
// fp32 staging row stride for the epilogue, padded so the accumulator stores
// are conflict-free and rows stay 16-byte aligned for the float4 row reads.
// mma.sync stores float2 at (row g, column 2q): +8 floats puts a half-warp's 4
// rows 8 banks apart. wgmma stores single floats at (token 2q, column g): +4
// floats puts the 4 tokens 8 banks apart (+8 would pair tokens 0 and 4).
constexpr int kCStrideMma = kBlockN + 8;
constexpr int kCStrideWgmma = kBlockN + 4;
// Rows a warp finishes together in the epilogue: their Hadamards are
// independent, so the group's shuffles overlap. One row at a time, a warp of a
// 256-row tile paid its LDS + five- shuffle dependency chain 32 times in a row.
constexpr int kEpilogueRowGroup = 4;

// Runs stage(it + s, s) for s = 0, 1, ... while it + s < n (a compile-time slot
// per call).
template <typename Stage, int... S>
__device__ __forceinline__ void stage_sequence(
    int it, int n, Stage& stage, std::integer_sequence<int, S...>) {
  (void)((it + S < n &&
          (stage(it + S, std::integral_constant<int, S>{}), true)) &&
         ...);
}

// An opaque copy: the compiler keeps the value in a register instead of
// recomputing it from the lane index inside the k loop (it otherwise sinks
// per-lane address math into the loop).
__device__ __forceinline__ uint32_t keep_in_register(uint32_t v) {
  asm volatile("" : "+r"(v));
  return v;
}

// WG selects the math engine: false = mma.sync (every target), true = Hopper's
// wgmma with the tile's tokens as its N (exl3_wgmma.cuh; sm_90a only). Loader,
// pipeline and epilogue are shared.
template <int K2, int MT, bool WG = false>
struct GemmShape {
  static constexpr int kBM = MT * kTile;
  // Warp layout: one warp row, so each warp decodes its own 16-column tile
  // exactly once for all BM rows. A 2 x 4 grid at BM = 128 (half the ldmatrix
  // traffic, each tile decoded twice) was measured against it on the H200
  // (design notes, "warp layout"): no faster at m = 256/512 and 10 % slower at
  // m = 128, so the single row stays; kWarpsM keeps the grid arithmetic below
  // explicit.
  static constexpr int kWarpsM = 1;
  static constexpr int kWarpsN = kGemmWarps / kWarpsM;
  static constexpr int kWarpMT = MT / kWarpsM;  // m-tiles of one warp
  static constexpr int kWarpTiles =
      kBlockTiles / kWarpsN;  // trellis tiles of one warp
  static_assert(kWarpsM * kWarpsN == kGemmWarps && kWarpMT * kWarpsM == MT &&
                    kWarpTiles * kWarpsN == kBlockTiles,
                "the warp grid must tile the block");
  static constexpr int kABytes = kBM * kARowBytes;
  static constexpr int kTBytes =
      kStageKSteps * kBlockTiles * Rate<K2>::kTileBytes;
  static constexpr int kPipeBytes = kGemmStages * (kABytes + kTBytes);
  static constexpr int kCStride = WG ? kCStrideWgmma : kCStrideMma;
  static constexpr int kStagingBytes = kBM * kCStride * 4;
  // Rows of one epilogue group: the warps' share of the tile, at most
  // kEpilogueRowGroup, so a group never reaches past the tile (BM is a multiple
  // of kGemmWarps * kEpiRows).
  static constexpr int kEpiRows = kBM / kGemmWarps < kEpilogueRowGroup
                                      ? kBM / kGemmWarps
                                      : kEpilogueRowGroup;
  static_assert(kBM % (kGemmWarps * kEpiRows) == 0,
                "epilogue groups must tile the block's rows");
  // wgmma: one 8-byte mbarrier per stage slot, on which that slot's TMA copy of
  // A completes, past both the pipeline and the epilogue's staging (which
  // reuses the pipeline's bytes).
  static constexpr int kBarOffset =
      ((kPipeBytes > kStagingBytes ? kPipeBytes : kStagingBytes) + 7) / 8 * 8;
  static constexpr int kSmemBytes = kBarOffset + (WG ? 8 * kGemmStages : 0);
  // Register cap hint: 128-row blocks hold 64 fp32 accumulators per thread; ask
  // for 2 blocks/SM there (<= 128 registers), and let the smaller tiers keep
  // more blocks resident. wgmma holds BM / 2 accumulators per thread: 256
  // tokens need the whole register file of one block per SM.
  static constexpr int kMinBlocks = WG ? (MT >= 16 ? 1 : (MT >= 8 ? 2 : 3))
                                       : (MT >= 8 ? 2 : (MT >= 4 ? 3 : 4));
  // Accumulators per thread: mma.sync's [m-tile][8-column half][4], or wgmma's
  // 64 x BM fragment.
  static constexpr int kWgAcc = WG ? kBM / 2 : 1;
  static_assert(!WG || (kWarpTiles == 1 &&
                        kGemmWarps == 2 * kWarpgroupThreads / kWarpSize),
                "wgmma: two warpgroups, each warp supplying its own tile as 16 "
                "rows of A");
  static_assert(!WG || kABytes % kSwizzleAtomBytes == 0,
                "wgmma stages must stay atom-aligned");
};

// The epilogue of a staged tile (fp32 [BM][Shape::kCStride] in shared memory,
// `rows` of them valid): warp w takes rows w, w + kGemmWarps, ... in groups of
// Shape::kEpiRows, and either adds them into the split-k workspace or finishes
// them (Ĥ, svh, bias) into y. Rows of a group past `rows` read finite staging
// values and skip their stores.
template <typename Shape, typename T>
__device__ __forceinline__ void store_tile(const GemmParams& p,
                                           const float* s_c, int m0, int n0,
                                           int rows, bool to_ws) {
  constexpr int G = Shape::kEpiRows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  ColumnFactors f;
  if (!to_ws)
    load_column_factors(static_cast<const __half*>(p.svh),
                        static_cast<const T*>(p.bias), lane, n0, f);
  for (int r0 = warp; r0 < rows; r0 += G * kGemmWarps) {
    float v[G][4];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float4 c4 = *reinterpret_cast<const float4*>(
          s_c + (r0 + g * kGemmWarps) * Shape::kCStride + 4 * lane);
      v[g][0] = c4.x;
      v[g][1] = c4.y;
      v[g][2] = c4.z;
      v[g][3] = c4.w;
    }
    if (to_ws) {
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const int r = r0 + g * kGemmWarps;
        // One contiguous 512-byte row segment per warp instruction: coalesced
        // reductions.
        if (r < rows)
          red_add_f32x4(
              p.ws + static_cast<size_t>(m0 + r) * p.n + n0 + 4 * lane, v[g][0],
              v[g][1], v[g][2], v[g][3]);
      }
    } else {
      hadamard128(v, lane);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const int r = r0 + g * kGemmWarps;
        if (r < rows)
          store_transformed_row<T>(
              v[g], lane, f,
              static_cast<T*>(p.y) + static_cast<size_t>(m0 + r) * p.n, n0);
      }
    }
  }
}

// store_tile's output path for the wgmma tiers from kQuadFromBM rows:
// kQuadLanes lanes per row (hadamard128_quad), a warp finishing
// kQuadRowsPerWarp rows per pass: faster from BM 128 on, 2 % slower at BM 64
// (one pass, 3 blocks per SM), so that tier keeps store_tile's
// four-rows-per-warp groups (design notes, "quad epilogue"). Of the 8 lanes of
// an LDS.128 phase, the two rows are kQuadRowSkew rows apart: with the wgmma
// staging stride (kCStrideWgmma = 128 + 4 words) that puts them 16 banks apart,
// conflict-free.
constexpr int kQuadRowsPerWarp = kWarpSize / kQuadLanes;
constexpr int kQuadMinBM = kGemmWarps * kQuadRowsPerWarp;
constexpr int kQuadRowSkew = 4;
constexpr int kQuadFromBM = 2 * kQuadMinBM;
static_assert(kQuadRowSkew * kCStrideWgmma % 32 == 16,
              "the phase's two rows must not share banks");

template <typename Shape, typename T>
__device__ __forceinline__ void store_tile_quad(const GemmParams& p,
                                                const float* s_c, int m0,
                                                int n0, int rows) {
  static_assert(
      Shape::kCStride == kCStrideWgmma && Shape::kBM % kQuadMinBM == 0,
      "the quad epilogue is laid out for the wgmma tiers' staging");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int j = lane % kQuadLanes, rs = lane / kQuadLanes;
  // The lane's row within its warp's 8: pairs (rs, rs + 1) of a phase -> rows
  // kQuadRowSkew apart.
  const int sub = (rs >> 1) + (rs & 1) * kQuadRowSkew;
  // Column factors of the lane's chunks (columns n0 + 16 i + 4 j), kept packed
  // (16-bit).
  const __half* svh = static_cast<const __half*>(p.svh) + n0 + 4 * j;
  const T* bias = static_cast<const T*>(p.bias);
  uint2 svh_p[kQuadChunks], bias_p[kQuadChunks];
#pragma unroll
  for (int i = 0; i < kQuadChunks; ++i) {
    svh_p[i] = *reinterpret_cast<const uint2*>(svh + 16 * i);
    bias_p[i] =
        bias != nullptr
            ? *reinterpret_cast<const uint2*>(bias + n0 + 4 * j + 16 * i)
            : make_uint2(0u, 0u);
  }
  for (int r0 = 0; r0 < rows; r0 += kQuadMinBM) {
    const int r = r0 + warp * kQuadRowsPerWarp + sub;
    float v[kQuadChunks][4];
#pragma unroll
    for (int i = 0; i < kQuadChunks; ++i) {
      const float4 c4 = *reinterpret_cast<const float4*>(
          s_c + r * Shape::kCStride + 16 * i + 4 * j);
      v[i][0] = c4.x;
      v[i][1] = c4.y;
      v[i][2] = c4.z;
      v[i][3] = c4.w;
    }
    hadamard128_quad(v, lane);
    if (r < rows) {
      T* y =
          static_cast<T*>(p.y) + static_cast<size_t>(m0 + r) * p.n + n0 + 4 * j;
#pragma unroll
      for (int i = 0; i < kQuadChunks; ++i) {
        const __half* sv = reinterpret_cast<const __half*>(&svh_p[i]);
        const T* bv = reinterpret_cast<const T*>(&bias_p[i]);
#pragma unroll
        for (int q = 0; q < 4; ++q)
          v[i][q] = v[i][q] * kHadamardScale * __half2float(sv[q]) +
                    Fp16Like<T>::to_float(bv[q]);
        *reinterpret_cast<uint2*>(y + 16 * i) = pack4<T>(v[i]);
      }
    }
  }
}

// wgmma: one thread initialises the mbarriers of the A stage slots (a slot's
// TMA copy completes on its barrier) before any copy is issued; the block
// barrier publishes them.
template <typename Shape>
__device__ __forceinline__ void init_a_barriers() {
  extern __shared__ __align__(128) uint8_t smem[];
  if (threadIdx.x == 0) {
    const uint32_t bars = smem_addr(smem) + Shape::kBarOffset;
#pragma unroll
    for (int s = 0; s < kGemmStages; ++s) mbarrier_init(bars + 8 * s, 1);
    mbarrier_init_fence();
  }
  __syncthreads();
}

// One output tile (BM rows x 128 columns at m0, n0) over the k chunks [c_begin,
// c_end): the pipelined k loop, then the epilogue, or the fp32 partial sums
// added into p.ws (to_ws). a_phase (wgmma): bit s = the parity of slot s's A
// barrier that its next wait expects; it runs on across a stream-k block's
// segments. Epi: the dense layers' epilogue (nullptr_t), or a caller's own:
// epi.template store<Shape>( s_c, rows) gets the staged fp32 tile (the grouped
// MoE GEMM scatters rows by routing). xh_map (wgmma): the activations' tensor
// map, a kernel parameter (TMA reads it from there); null = p.xh_map, the
// dense kernel's own. A caller whose p is a local copy passes its kernel
// parameter's map instead.
template <int K2, int CB, int MT, bool WG, typename Epi = std::nullptr_t>
__device__ __forceinline__ void gemm_segment(
    const GemmParams& p, const int m0, const int n0, const int c_begin,
    const int c_end, const bool to_ws, uint32_t& a_phase,
    const Epi& epi = nullptr, const CUtensorMap* xh_map = nullptr) {
  using R = Rate<K2>;
  using Shape = GemmShape<K2, MT, WG>;
  constexpr int BM = Shape::kBM;
  // A copy unit: 16-byte chunks, or 8-byte halves when a stage's A tile is too
  // small to give every thread a whole chunk (BM = 16), so that no thread needs
  // a predicate to skip its copy.
  constexpr int kACopyBytes = BM * kARowBytes >= kGemmThreads * 16 ? 16 : 8;
  constexpr int kACopiesPerRow = kARowBytes / kACopyBytes;
  constexpr int kAChunks = BM * kACopiesPerRow;
  constexpr int kTChunks = Shape::kTBytes / 16;
  constexpr int kTRowChunks =
      kBlockTiles * R::kTileBytes / 16;  // one k16 row of 8 tiles
  constexpr int kAPerThread = (kAChunks + kGemmThreads - 1) / kGemmThreads;
  constexpr int kTPerThread = (kTChunks + kGemmThreads - 1) / kGemmThreads;

  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t s_a = smem_addr(smem);
  const uint32_t s_t = s_a + kGemmStages * Shape::kABytes;
  const uint8_t* s_t_ptr = smem + kGemmStages * Shape::kABytes;
  const uint32_t s_bar =
      s_a + Shape::kBarOffset;  // wgmma: the A slots' mbarriers

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int warp_m = warp / Shape::kWarpsN, warp_n = warp % Shape::kWarpsN;
  const int shard = shard_of_column(p.shards, n0);
  const int n_chunks = c_end - c_begin;
  if constexpr (WG) {
    // The swizzle is decoded from absolute address bits (exl3_mma.cuh): a
    // misplaced stage would be a silent wrong answer, so stop instead.
    if ((s_a & (kSwizzleAtomBytes - 1)) != 0) __trap();
  }

  // Let the split-k finish kernel (launched with programmatic serialization)
  // get scheduled as soon as every block of this grid is running; it waits for
  // our completion itself.
  grid_dependents_launch();

  // Loader assignment, fixed for the whole k loop: running source pointers
  // advance one stage per issue (stages are issued in order), destinations are
  // offsets inside a stage slot. The trellis pointers advance before their copy
  // (by a runtime stride: advancing after made the compiler copy the pointer
  // every stage), A's after (its constant stride folds into immediate offsets).
  const __half* xa =
      static_cast<const __half*>(p.xh) + static_cast<size_t>(shard) * p.m * p.k;
  const __half* a_src[kAPerThread];
  uint32_t a_dst[kAPerThread];
  int a_bytes[kAPerThread];
#pragma unroll
  for (int i = 0; i < kAPerThread; ++i) {
    const int q = tid + i * kGemmThreads;
    const int row = q / kACopiesPerRow, part = q % kACopiesPerRow;
    const int byte = part * kACopyBytes,
              ch = byte / 16;  // ch: the 16-byte chunk of the row
    const bool valid = q < kAChunks && m0 + row < p.m;
    a_src[i] = xa + (valid ? static_cast<size_t>(m0 + row) * p.k : 0) +
               byte / 2 + static_cast<size_t>(c_begin) * kStageK;
    a_dst[i] = s_a + row * kARowBytes + ((ch ^ (row & 7)) * 16) + byte % 16;
    a_bytes[i] = valid ? kACopyBytes : 0;
  }
  const uint8_t* trellis = static_cast<const uint8_t*>(p.trellis);
  const size_t t_row_stride =
      static_cast<size_t>(p.n / kTile) * R::kTileBytes;  // one k16 row
  const size_t t_stage_stride = kStageKSteps * t_row_stride;
  const uint8_t* t_src[kTPerThread];
#pragma unroll
  for (int i = 0; i < kTPerThread; ++i) {
    const int q = tid + i * kGemmThreads;
    const int kk = q / kTRowChunks, w = q % kTRowChunks;
    t_src[i] = trellis + kk * t_row_stride +
               static_cast<size_t>(n0 / kTile) * R::kTileBytes + w * 16 +
               static_cast<ptrdiff_t>(t_stage_stride) * (c_begin - 1);
  }

  auto load_t = [&](int slot) {
#pragma unroll
    for (int i = 0; i < kTPerThread; ++i) {
      t_src[i] += t_stage_stride;
      if (kTChunks % kGemmThreads == 0 || tid + i * kGemmThreads < kTChunks)
        cp_async16(s_t + slot * Shape::kTBytes + (tid + i * kGemmThreads) * 16,
                   t_src[i], 16);
    }
  };
  int a_k = c_begin * kStageK;  // wgmma: the k coordinate of the next A stage
  const CUtensorMap* a_map = xh_map != nullptr ? xh_map : &p.xh_map;
  auto load_a = [&](int slot) {
    if constexpr (WG) {
      tma_load_3d(tid == 0, s_a + slot * Shape::kABytes, a_map,
                  s_bar + 8 * slot, Shape::kABytes, a_k, m0, shard);
      a_k += kStageK;
    } else {
#pragma unroll
      for (int i = 0; i < kAPerThread; ++i) {
        if (kAChunks % kGemmThreads == 0 || tid + i * kGemmThreads < kAChunks) {
          if constexpr (kACopyBytes == 16)
            cp_async16(a_dst[i] + slot * Shape::kABytes, a_src[i], a_bytes[i]);
          else
            cp_async8(a_dst[i] + slot * Shape::kABytes, a_src[i], a_bytes[i]);
        }
        a_src[i] += kStageK;
      }
    }
  };

  LaneWindow<K2> lw;
  lw.init(lane);
  // Byte offsets (from the trellis stage area) of this lane's words in its
  // warp's first tile of k step 0; its other tiles and k steps are compile-time
  // offsets from there.
  uint32_t t_lane[R::kRaw];
#pragma unroll
  for (int i = 0; i < R::kRaw; ++i)
    t_lane[i] = keep_in_register(warp_n * Shape::kWarpTiles * R::kTileBytes +
                                 lw.off[i]);
  const uint32_t halves_xor = halves_xor_register();
  // ldmatrix.x4 source of this lane for each 16-wide k step: rows lane%16, k
  // chunk 2kk + lane/16.
  uint32_t a_ld[kStageKSteps];
#pragma unroll
  for (int kk = 0; kk < kStageKSteps; ++kk) {
    const int row = warp_m * Shape::kWarpMT * kTile + (lane & 15),
              ch = 2 * kk + (lane >> 4);
    a_ld[kk] =
        WG ? 0u
           : keep_in_register(s_a + row * kARowBytes + ((ch ^ (row & 7)) * 16));
  }

  // acc[m-tile][8-column half of the warp's tiles][mma accumulator]
  constexpr int kHalves = 2 * Shape::kWarpTiles;
  float acc[WG ? 1 : Shape::kWarpMT][WG ? 1 : kHalves][4];
#pragma unroll
  for (int mt = 0; mt < (WG ? 1 : Shape::kWarpMT); ++mt)
#pragma unroll
    for (int h = 0; h < (WG ? 1 : kHalves); ++h)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][h][e] = 0.0f;
  // wgmma: element 4j + e of the 64 x BM fragment is output column 16 * warp +
  // lane / 4
  // (+8 for e >= 2) of the block, token 8j + 2 * (lane % 4) + (e & 1).
  float acc_wg[Shape::kWgAcc];
#pragma unroll
  for (int i = 0; i < Shape::kWgAcc; ++i) acc_wg[i] = 0.0f;
  const uint64_t desc0 = WG ? wgmma_desc_k_major_sw128(s_a) : 0;

  // Stages loaded ahead of the one being consumed. mma.sync is done with a slot
  // when its warp reaches the next barrier, so the slot consumed last stage is
  // refilled (3 ahead). A wgmma still reads its slot after the warp moved on:
  // up to kWgmmaInFlight per warpgroup stay in flight across the barrier
  // (nothing drains the tensor pipe at stage ends), so the slot refilled is the
  // one consumed two stages ago, whose wgmmas every warp has waited for (2
  // ahead).
  constexpr int kAhead = WG ? kGemmStages - 2 : kGemmStages - 1;
  static_assert(
      !WG || kWgmmaInFlight < kStageKSteps,
      "a slot's wgmmas must be complete one stage after it is consumed");
  // Refills are issued right after the barrier. With cp.async for A, BM 256 had
  // every thread queue 9 copies there, 17-20 % of the engine's time (design
  // notes, "refills"), and moved them behind the stage's first wgmma. The wgmma
  // engine now takes A from one TMA copy per stage, issued by one thread,
  // leaving each thread one trellis copy: no reason to move them.

  // Prologue: the trellis does not depend on the input transform, so its first
  // stages are in flight before waiting for the transform grid (programmatic
  // dependent launch).
#pragma unroll
  for (int s = 0; s < kAhead; ++s)
    if (s < n_chunks) load_t(s);
  grid_dependency_wait();
#pragma unroll
  for (int s = 0; s < kAhead; ++s) {
    if (s < n_chunks) load_a(s);
    cp_async_commit();
  }

  // One pipeline stage: wait for stage `it` (in slot SLOT), refill the slot
  // freed last stage, consume. SLOT is a compile-time constant, so the slot
  // offsets fold into the load addresses.
  auto stage = [&](int it, auto slot_constant) {
    constexpr int slot = decltype(slot_constant)::value;
    cp_async_wait<kAhead - 1>();  // this thread's trellis copies of stage `it`
    if constexpr (WG) {
      mbarrier_wait(s_bar + 8 * slot,
                    (a_phase >> slot) & 1u);  // the stage's A tile
      a_phase ^= 1u << slot;
    }
    __syncthreads();  // stage `it` landed for everyone; the slot to refill is
                      // free again
    constexpr int refill = (slot + kAhead) % kGemmStages;
    if (it + kAhead < n_chunks) {
      load_t(refill);
      load_a(refill);
    }
    cp_async_commit();
    const uint8_t* t_area = s_t_ptr + slot * Shape::kTBytes;
    if constexpr (WG) {
      constexpr uint64_t kSlotDesc =
          static_cast<uint64_t>(slot * Shape::kABytes) >> 4;
      // The trellis words of each k16 step are read one step ahead of their
      // decode: waiting on that read was the largest share of the stalls
      // (Nsight Compute).
      uint32_t raw[R::kRaw];
      load_words<K2>(t_area, t_lane, 0u, raw);
#pragma unroll
      for (int kk = 0; kk < kStageKSteps; ++kk) {
        uint32_t b[4];
        fragments_from_raw<K2, CB>(raw, lw.shift, halves_xor, b);
        if (kk + 1 < kStageKSteps)
          load_words<K2>(t_area, t_lane, (kk + 1) * kBlockTiles * R::kTileBytes,
                         raw);
        const uint32_t a[4] = {b[0], b[2], b[1], b[3]};
        wgmma_fence();  // the decoded registers are written before the
                        // asynchronous read
#if EXL3_WGMMA
        wgmma_rs<BM>(acc_wg, a, desc0 + kSlotDesc + kk * kDescK16Step);
#endif
        wgmma_commit();
        // Decoding runs kWgmmaInFlight steps ahead of the tensor pipe; the
        // oldest step's A registers are free for the next decode once it
        // completes.
        wgmma_wait<kWgmmaInFlight>();
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < kStageKSteps; ++kk) {
        uint32_t b[Shape::kWarpTiles][4];
#pragma unroll
        for (int t = 0; t < Shape::kWarpTiles; ++t) {
          uint32_t raw[R::kRaw];
          load_words<K2>(t_area, t_lane, (kk * kBlockTiles + t) * R::kTileBytes,
                         raw);
          fragments_from_raw<K2, CB>(raw, lw.shift, halves_xor, b[t]);
        }
        // Rows past m are zero-filled in shared memory; computing them costs
        // less than branching.
#pragma unroll
        for (int mt = 0; mt < Shape::kWarpMT; ++mt) {
          uint32_t a[4];
          ldmatrix_x4(
              a, a_ld[kk] + slot * Shape::kABytes + mt * kTile * kARowBytes);
#pragma unroll
          for (int t = 0; t < Shape::kWarpTiles; ++t) {
            mma_16816(acc[mt][2 * t], a, b[t][0], b[t][1]);
            mma_16816(acc[mt][2 * t + 1], a, b[t][2], b[t][3]);
          }
        }
      }
    }
  };
  // The k loop visits the slots in order, kLoopStages stages per iteration
  // (stage it uses slot it % kGemmStages), stopping after stage n_chunks - 1.
  static_assert(kLoopStages == kGemmStages,
                "one loop iteration cycles through every slot once");
  for (int it = 0; it < n_chunks; it += kLoopStages) {
    stage_sequence(it, n_chunks, stage,
                   std::make_integer_sequence<int, kLoopStages>{});
  }
  if constexpr (WG) {
    wgmma_wait<0>();
    wgmma_fence_operands(acc_wg);
  }
  cp_async_wait<0>();
  __syncthreads();  // pipeline buffers are reused as the fp32 staging block

  // Stage the accumulators as fp32 [BM][128] so a warp can own whole rows of
  // the block.
  float* s_c = reinterpret_cast<float*>(smem);
  if constexpr (WG) {
    const int col = warp * kTile + (lane >> 2), tok = 2 * (lane & 3);
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {
      float* c = s_c + (8 * j + tok) * Shape::kCStride + col;
      c[0] = acc_wg[4 * j + 0];
      c[Shape::kCStride] = acc_wg[4 * j + 1];
      c[8] = acc_wg[4 * j + 2];
      c[Shape::kCStride + 8] = acc_wg[4 * j + 3];
    }
  } else {
    const int g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int mt = 0; mt < Shape::kWarpMT; ++mt)
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        const int col = warp_n * Shape::kWarpTiles * kTile + h * 8 + 2 * q;
        const int row = (warp_m * Shape::kWarpMT + mt) * kTile + g;
        *reinterpret_cast<float2*>(s_c + row * Shape::kCStride + col) =
            make_float2(acc[mt][h][0], acc[mt][h][1]);
        *reinterpret_cast<float2*>(s_c + (row + 8) * Shape::kCStride + col) =
            make_float2(acc[mt][h][2], acc[mt][h][3]);
      }
  }
  __syncthreads();

  const int rows = min(BM, p.m - m0);
  if constexpr (!std::is_same_v<Epi, std::nullptr_t>) {
    epi.template store<Shape>(s_c, rows);
  } else if constexpr (WG && BM >= kQuadFromBM) {
    if (!to_ws) {
      if (p.out_bf16)
        store_tile_quad<Shape, __nv_bfloat16>(p, s_c, m0, n0, rows);
      else
        store_tile_quad<Shape, __half>(p, s_c, m0, n0, rows);
    } else {
      store_tile<Shape, __half>(p, s_c, m0, n0, rows,
                                true);  // partial sums: no output dtype
    }
  } else {
    if (p.out_bf16)
      store_tile<Shape, __nv_bfloat16>(p, s_c, m0, n0, rows, to_ws);
    else
      store_tile<Shape, __half>(p, s_c, m0, n0, rows, to_ws);
  }
  // The staging block was accessed through the generic proxy; a stream-k
  // block's next segment refills the same bytes through the async proxy (TMA)
  // after its barrier.
  if constexpr (WG) fence_proxy_async_shared();
}

// SK selects the grid. Classic (false): block (x, y, z) = row block, column
// block, k-split. Stream-k (true; built for the wgmma engine, whose large tiles
// leave SMs idle when the tiles are a little more than a whole number of waves,
// e.g. 136 column blocks on 132 SMs): p.stream_blocks blocks, all resident at
// once, share the tiles x k-chunks units evenly, block b taking units [b U / G,
// (b + 1) U / G) in tile order (row blocks fastest, so neighbouring blocks read
// the same trellis columns); every tile segment adds its partial sums into p.ws
// and the split-k finish kernel runs the epilogue.
template <int K2, int CB, int MT, bool WG = false, bool SK = false>
__global__ void __launch_bounds__(kGemmThreads,
                                  GemmShape<K2, MT, WG>::kMinBlocks)
    exl3_gemm_kernel(const __grid_constant__ GemmParams p) {
#if !EXL3_WGMMA
  if constexpr (WG) {
    __trap();  // never launched: the host selects this engine only where it was
               // compiled
    return;
  }
#endif
  static_assert(
      !SK || (WG && MT >= kStreamKMinTiles),
      "stream-k is built for the wgmma engine's 128- and 256-token tiers only");
  using Shape = GemmShape<K2, MT, WG>;
  constexpr int BM = Shape::kBM;
  const int chunks = p.k / kStageK;
  uint32_t a_phase = 0;
  if constexpr (WG) init_a_barriers<Shape>();
  if constexpr (!SK) {
    const int c_begin =
        static_cast<int>(static_cast<int64_t>(blockIdx.z) * chunks / p.splits);
    const int c_end = static_cast<int>(static_cast<int64_t>(blockIdx.z + 1) *
                                       chunks / p.splits);
    gemm_segment<K2, CB, MT, WG>(p, blockIdx.x * BM, blockIdx.y * kBlockN,
                                 c_begin, c_end, p.splits > 1, a_phase);
  } else {
    // 32-bit unit arithmetic (64-bit division is a called routine with a stack
    // frame): the host offers stream-k only while stream_blocks x units fits
    // (exl3_plan.cpp).
    const uint32_t row_blocks = (p.m + BM - 1) / BM;
    const uint32_t units =
        row_blocks * static_cast<uint32_t>(p.n / kBlockN) * chunks;
    uint32_t u = blockIdx.x * units / p.stream_blocks;
    const uint32_t end = (blockIdx.x + 1) * units / p.stream_blocks;
    while (u < end) {
      const int tile = static_cast<int>(u / chunks),
                c0 = static_cast<int>(u % chunks);
      const int c1 = end - u < static_cast<uint32_t>(chunks - c0)
                         ? c0 + static_cast<int>(end - u)
                         : chunks;
      gemm_segment<K2, CB, MT, WG>(p, (tile % row_blocks) * BM,
                                   (tile / row_blocks) * kBlockN, c0, c1, true,
                                   a_phase);
      u += c1 - c0;
      __syncthreads();  // the staging block is read before the next segment's
                        // pipeline refills
    }
  }
}

}  // namespace vllm_exl3
