// SPDX-License-Identifier: Apache-2.0
// Kernels of the 4-bit rate (K2 = 8): the dense GEMM and the grouped MoE GEMM
// (every codebook x BM tier; MoE: both stages) and both reconstructs. One
// translation unit per rate keeps nvcc's work parallel.
#include "exl3_moe.cuh"
#include "exl3_rate_instance.cuh"

EXL3_DEFINE_RATE(8)
EXL3_DEFINE_MOE_RATE(8)
