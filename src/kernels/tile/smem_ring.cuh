// The stage index of a multi-stage shared-memory ring: kStages buffers filled and drained in
// turn (a producer writes stage w while consumers read stage r; each advances modulo kStages).
#pragma once

#include <cuda_runtime.h>

namespace optimized::kernels {

// The stage after `stage` in a ring of kStages (a compare and a select, no division).
template <int kStages>
__device__ __forceinline__ int ring_next(int stage) {
  static_assert(kStages >= 2, "a ring needs two stages at least");
  return stage + 1 == kStages ? 0 : stage + 1;
}

}  // namespace optimized::kernels
