// The stage index of a multi-stage shared-memory ring: kStages buffers filled and drained in
// turn (a producer writes stage w while consumers read stage r; each advances modulo kStages).
#pragma once

#include <cuda_runtime.h>

namespace optimized::kernels {

template <int kStages>
struct RingIndex {
  static_assert(kStages >= 2, "a ring needs two stages at least");
  int stage;

  __device__ __forceinline__ void advance() { stage = stage + 1 == kStages ? 0 : stage + 1; }
};

}  // namespace optimized::kernels
