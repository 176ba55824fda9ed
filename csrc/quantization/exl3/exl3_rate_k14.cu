// SPDX-License-Identifier: Apache-2.0
// Kernels of the 7-bit rate (K2 = 14): every codebook x BM tier, both reconstructs.
#include "exl3_rate_instance.cuh"

EXL3_DEFINE_RATE(14)
