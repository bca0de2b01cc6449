// Decode attention, CUDA rung 2: paged. One block per (sequence, kv head) serves every query head
// of the GQA group and every query token (up to 32 rows a block; more: another row group) from one
// read of each K / V row, in one pass (online softmax), with 16-byte loads of the page rows and the
// fp8 cache dequantized in registers: decode_tile.cuh holds the mainloop.
//
// What changed from contiguous_naive, and why it is faster: the cache is read once per (sequence,
// kv head) instead of once per query head and query and pass (16x less traffic for a group of 4
// with q_len 2), in 16-byte vectors instead of 2-byte scalars. What it still lacks: with a small
// batch it launches B * H_kv blocks (8 for B = 1 and 8 kv heads), leaving most of the 132 SMs of
// an H100 idle however long the sequence; paged_split cuts the keys into chunks to fill them.
// No workspace.
#include <cuda_runtime.h>

#include "kernels/dispatch.cuh"
#include "kv_cache/cuda/decode_tile.cuh"
#include "kv_cache/launchers.h"

namespace optimized::cuda {

cudaError_t kv_cache_paged(const KvDecodeParams& p, const Workspace&, cudaStream_t stream) {
  using namespace kv_cache_cuda;
  if (p.batch <= 0 || p.heads_q <= 0) return cudaSuccess;
  const bool fp8 = p.cache.dtype == DType::kF8E4M3;
  return kernels::dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    return fp8 ? launch_decode_tile<T, Fp8>(p, 1, {}, stream) : launch_decode_tile<T, T>(p, 1, {}, stream);
  });
}

}  // namespace optimized::cuda
