// Thread-block clusters (sm_90): this block's rank, the address of a variable in a peer block's
// shared memory (distributed shared memory), and the cluster barrier, whole or split into arrive and
// wait; and, host side, set_cluster_dims for a launch. The CUDA intrinsics cooperative_groups wraps,
// without its headers (~1.7 s per translation unit).
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

// The rank of this block in its cluster (0 .. cluster size - 1).
__device__ __forceinline__ unsigned cluster_block_rank() { return __clusterRelativeBlockRank(); }

// `addr` (a variable in this block's shared memory) in the shared memory of block `rank` of the cluster.
template <typename T>
__device__ __forceinline__ T* cluster_map_shared(T* addr, int rank) {
  return static_cast<T*>(__cluster_map_shared_rank(addr, rank));
}

// Every thread of every block of the cluster arrives and waits (orders shared-memory accesses).
__device__ __forceinline__ void cluster_sync() {
  __cluster_barrier_arrive();
  __cluster_barrier_wait();
}

// Host side: makes `config` launch clusters of `blocks` blocks along x through `attribute`, which must
// outlive the launch (cudaLaunchKernelEx reads it then).
inline void set_cluster_dims(cudaLaunchConfig_t& config, cudaLaunchAttribute& attribute, unsigned blocks) {
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = blocks;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
}

}  // namespace optimized::kernels::ptx
