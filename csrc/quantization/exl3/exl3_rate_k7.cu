// SPDX-License-Identifier: Apache-2.0
// Kernels of the 3.5-bit rate (K2 = 7) (MUL1 only): every codebook x BM tier, both reconstructs.
#include "exl3_rate_instance.cuh"

EXL3_DEFINE_RATE(7)
