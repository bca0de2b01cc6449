// The thread-block cluster barrier (sm_90), split into arrive and wait.
//
// A block may write into a peer's shared memory (distributed shared memory) only once that peer
// has started: every block arrives when it starts (relaxed: the arrive orders no memory) and waits
// right before its first write into a peer (racecheck: "block that might not have entered yet").
#pragma once

#include <cuda_runtime.h>

namespace optimized::kernels::ptx {

__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory"); }

}  // namespace optimized::kernels::ptx
