// SPDX-License-Identifier: Apache-2.0
// K2 -> the launcher table compiled in that rate's own translation unit.
#include <stdexcept>
#include <string>

#include "exl3_kernels.h"

namespace vllm_exl3 {

#define EXL3_RATES(X) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(10) X(12) X(14) X(16)
#define EXL3_DECLARE(K2) const RateKernels& rate_kernels_k##K2();
EXL3_RATES(EXL3_DECLARE)

const RateKernels& rate_kernels(int k2) {
  switch (k2) {
#define EXL3_CASE(K2) \
  case K2:            \
    return rate_kernels_k##K2();
    EXL3_RATES(EXL3_CASE)
    default:
      throw std::runtime_error("exl3: no kernels for 2*bits = " +
                               std::to_string(k2));
  }
}

}  // namespace vllm_exl3
