// What a CUDA device offers (SM count, shared memory opt-in, compute capability, L2, occupancy
// limits), read once per device and cached for the life of the process: launchers size their grids
// from these on every call, so they must not cost a driver query each time. CUDA builds only.
#pragma once

#include <cuda_runtime.h>

namespace optimized {

struct DeviceFacts {
  int ordinal = 0;
  int compute_capability = 0;      // major * 10 + minor: 90 for sm_90
  int sm_count = 0;
  int max_smem_per_block_optin = 0;// bytes a block may use after cudaFuncAttributeMaxDynamicSharedMemorySize
  int max_smem_per_sm = 0;         // bytes
  int l2_bytes = 0;
  int max_threads_per_sm = 0;
  int max_blocks_per_sm = 0;
  int warp_size = 32;
};

// Facts of CUDA device `device`. Never throws: a failed query returns its error (and caches
// nothing, so a later call asks again). *out stays valid for the life of the process.
cudaError_t device_facts(int device, const DeviceFacts** out);
// Facts of the current device (cudaGetDevice).
cudaError_t current_device_facts(const DeviceFacts** out);

// The stream-ordered memory pool the C++ API allocates call workspaces from (when the caller gave
// none) on CUDA device `device`: created on first use, it keeps freed memory for the next call
// (release threshold: unlimited), as torch's caching allocator does, instead of the default pool,
// which returns it to the driver at every synchronisation, so that each call paid the mapping of
// fresh physical memory before its first kernel could start (+0.1 to +0.7 ms per call for the
// unfused rungs on the H100). A caller who wants the memory back passes its own workspace
// (ExecutionContext::workspace). Never throws.
cudaError_t workspace_pool(int device, cudaMemPool_t* out);

}  // namespace optimized
