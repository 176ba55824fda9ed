// SPDX-License-Identifier: Apache-2.0
// Kernels of the 1.5-bit rate (K2 = 3) (MUL1 only): every codebook x BM tier, both reconstructs.
#include "exl3_rate_instance.cuh"

EXL3_DEFINE_RATE(3)
