// SPDX-License-Identifier: Apache-2.0
// Kernels of the 8-bit rate (K2 = 16): every codebook x BM tier, both reconstructs.
#include "exl3_rate_instance.cuh"

EXL3_DEFINE_RATE(16)
