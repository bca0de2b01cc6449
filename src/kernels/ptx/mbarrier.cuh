// mbarrier (sm_90): the shared-memory barriers a TMA ring completes on. A barrier counts arrivals
// and, for TMA, transaction bytes: the consumer waits on a phase parity until every expected
// arrival has come and every expected byte has landed.
//
//   init(bar, count)                         one thread, before any use (then fence_barrier_init())
//   arrive_expect_tx(bar, bytes)             the producer: one arrival, and `bytes` the TMA copies will bring
//   wait(bar, phase)                         spin until the phase with parity `phase` has completed
//   arrive(bar)                              a consumer releasing a slot (count = consumers)
//   arrive_cluster(bar, rank)                the same on a peer block's barrier (clusters)
//
// Phases alternate 0, 1, 0, ...: a ring slot's k-th use waits on parity k & 1.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/ptx/smem.cuh"

namespace optimized::kernels::ptx {

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

// Makes the initialised barriers visible to the async proxy (TMA) and to the cluster.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

// One arrival on the barrier at `bar`'s offset in block `rank` of the cluster (this block too).
// Default semantics (release at CTA scope): a release at cluster scope would make every arrival a
// cluster-wide memory fence (measured: "membar" stalls halved the GEMM's rate). The accesses it
// orders here are reads of shared memory by wgmma that wgmma.wait_group has already completed.
__device__ __forceinline__ void mbarrier_arrive_cluster(uint64_t* bar, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(smem_u32(bar)), "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
}

// true once the phase of parity `phase` has completed (one bounded hardware wait).
__device__ __forceinline__ bool mbarrier_try_wait(uint64_t* bar, uint32_t phase) {
  uint32_t done;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(smem_u32(bar)), "r"(phase)
      : "memory");
  return done != 0;
}

__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t phase) {
  while (!mbarrier_try_wait(bar, phase)) {
  }
}

}  // namespace optimized::kernels::ptx
