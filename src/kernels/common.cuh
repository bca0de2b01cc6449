// Integer helpers and CUDA grid limits shared by every launcher and kernel.
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace optimized::kernels {

// ceil(a / b) for a >= 0, b > 0.
OPTIMIZED_HOST_DEVICE constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The smallest power of two >= v (1 for v <= 1); v at most 2^30.
OPTIMIZED_HOST_DEVICE constexpr int pow2_ceil(int64_t v) {
  int r = 1;
  while (r < v) r *= 2;
  return r;
}

// Grid dimensions y and z are capped at 65535 blocks (x at 2^31 - 1): launchers walk larger
// extents in several launches or with grid-stride loops.
constexpr int64_t kMaxGridY = 65535;
constexpr int64_t kMaxGridZ = 65535;

}  // namespace optimized::kernels
