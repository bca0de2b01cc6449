// Device facts, cached per device: the first call for a device reads its attributes (under a lock),
// later calls read the cache without one.
#if OPTIMIZED_WITH_CUDA
#include "core/device_facts.h"

#include <atomic>
#include <cstdint>
#include <mutex>

namespace optimized {

namespace {
constexpr int kMaxDevices = 64;  // ordinals beyond this are read every time (never seen in practice)

struct Cache {
  std::mutex lock;
  std::atomic<bool> ready[kMaxDevices] = {};
  DeviceFacts facts[kMaxDevices];
};
Cache& cache() {
  static Cache c;
  return c;
}

cudaError_t read_facts(int device, DeviceFacts* f) {
  struct Query {
    cudaDeviceAttr attr;
    int* value;
  };
  int major = 0, minor = 0;
  const Query queries[] = {
      {cudaDevAttrComputeCapabilityMajor, &major},
      {cudaDevAttrComputeCapabilityMinor, &minor},
      {cudaDevAttrMultiProcessorCount, &f->sm_count},
      {cudaDevAttrMaxSharedMemoryPerBlockOptin, &f->max_smem_per_block_optin},
      {cudaDevAttrMaxSharedMemoryPerMultiprocessor, &f->max_smem_per_sm},
      {cudaDevAttrL2CacheSize, &f->l2_bytes},
      {cudaDevAttrMaxThreadsPerMultiProcessor, &f->max_threads_per_sm},
      {cudaDevAttrMaxBlocksPerMultiprocessor, &f->max_blocks_per_sm},
      {cudaDevAttrWarpSize, &f->warp_size},
  };
  for (const Query& q : queries)
    if (cudaError_t e = cudaDeviceGetAttribute(q.value, q.attr, device); e != cudaSuccess) return e;
  f->ordinal = device;
  f->compute_capability = major * 10 + minor;
  return cudaSuccess;
}
}  // namespace

cudaError_t device_facts(int device, const DeviceFacts** out) {
  Cache& c = cache();
  if (device < 0 || device >= kMaxDevices) {
    thread_local DeviceFacts uncached;
    if (cudaError_t e = read_facts(device, &uncached); e != cudaSuccess) return e;
    *out = &uncached;
    return cudaSuccess;
  }
  if (!c.ready[device].load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> hold(c.lock);
    if (!c.ready[device].load(std::memory_order_relaxed)) {
      DeviceFacts f;
      if (cudaError_t e = read_facts(device, &f); e != cudaSuccess) return e;
      c.facts[device] = f;
      c.ready[device].store(true, std::memory_order_release);
    }
  }
  *out = &c.facts[device];
  return cudaSuccess;
}

cudaError_t workspace_pool(int device, cudaMemPool_t* out) {
  static std::mutex lock;
  static cudaMemPool_t pools[kMaxDevices] = {};
  if (device < 0 || device >= kMaxDevices) return cudaDeviceGetDefaultMemPool(out, device);
  std::lock_guard<std::mutex> hold(lock);
  if (!pools[device]) {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.handleTypes = cudaMemHandleTypeNone;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    cudaMemPool_t pool = nullptr;
    if (cudaError_t e = cudaMemPoolCreate(&pool, &props); e != cudaSuccess) return e;
    uint64_t keep = UINT64_MAX;
    if (cudaError_t e = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep); e != cudaSuccess) {
      cudaMemPoolDestroy(pool);
      return e;
    }
    pools[device] = pool;
  }
  *out = pools[device];
  return cudaSuccess;
}

cudaError_t current_device_facts(const DeviceFacts** out) {
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  return device_facts(device, out);
}

}  // namespace optimized
#endif  // OPTIMIZED_WITH_CUDA
