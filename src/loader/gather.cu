// Gather kernel: copies placements (src offset, dst offset, bytes) from one device buffer to another.
//
//   one block per piece (grid-stride over pieces), 256 threads
//   16-byte vector copies where source, destination and length are 16-byte aligned (records whose
//   size is a multiple of 16 under a 4 KiB-aligned read), else 4-byte, else byte copies; threads
//   step through the piece together so consecutive threads touch consecutive addresses.
// The input is at most tens of MB per batch and HBM moves TB/s, so this is far from the critical
// path next to the PCIe copy that precedes it.
#include "loader/gather.h"

namespace optimized::loader {

namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 4096;

template <typename T>
__device__ void copy_as(const uint8_t* src, uint8_t* dst, uint64_t bytes) {
  const T* s = reinterpret_cast<const T*>(src);
  T* d = reinterpret_cast<T*>(dst);
  const uint64_t n = bytes / sizeof(T);
  for (uint64_t i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
}

__global__ void __launch_bounds__(kThreads) gather_kernel(const uint8_t* __restrict__ src_base,
                                                          uint8_t* __restrict__ dst_base,
                                                          const Placement* __restrict__ pieces, int64_t count) {
  for (int64_t p = blockIdx.x; p < count; p += gridDim.x) {
    const Placement piece = pieces[p];
    const uint8_t* src = src_base + piece.src;
    uint8_t* dst = dst_base + piece.dst;
    const uint64_t misaligned = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) | piece.bytes;
    if ((misaligned & 15) == 0) {
      copy_as<uint4>(src, dst, piece.bytes);
    } else if ((misaligned & 3) == 0) {
      copy_as<uint32_t>(src, dst, piece.bytes);
    } else {
      copy_as<uint8_t>(src, dst, piece.bytes);
    }
  }
}

}  // namespace

cudaError_t launch_gather(const uint8_t* src_base, uint8_t* dst_base, const Placement* pieces, int64_t count,
                          cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  const int blocks = static_cast<int>(count < kMaxBlocks ? count : kMaxBlocks);
  gather_kernel<<<blocks, kThreads, 0, stream>>>(src_base, dst_base, pieces, count);
  return cudaGetLastError();
}

}  // namespace optimized::loader
