// SPDX-License-Identifier: Apache-2.0
// Grouped MoE GEMMs of the 1-bit rate (K2 = 2): every codebook x BM tier x stage.
#include "exl3_moe.cuh"

EXL3_DEFINE_MOE_RATE(2)
