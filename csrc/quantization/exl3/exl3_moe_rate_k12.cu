// SPDX-License-Identifier: Apache-2.0
// Grouped MoE GEMMs of the 6-bit rate (K2 = 12): every codebook x BM tier x stage.
#include "exl3_moe.cuh"

EXL3_DEFINE_MOE_RATE(12)
