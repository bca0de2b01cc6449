// Decode attention, CUDA rung 3: paged_split (flash-decoding). paged's mainloop (decode_tile.cuh)
// over p.splits chunks of each sequence's keys: block (sequence, kv head, row group, split) writes
// its rows' normalized partial output o_s and lse_s (fp32) into the workspace; the merge
// (split_merge.cuh, shared with paged_mma) then combines the splits of each (sequence, query head,
// query) by their LSE.
// What changed from paged, and why it is faster: at B = 1 with 8 kv heads paged runs 8 blocks;
// with the plan's splits (kv_cache_config.h: about two blocks per SM) the same keys are read by
// 2 x 132 blocks at once, so a long sequence streams at the memory's speed; the price is one
// extra fp32 row per (query row, split) written and read back by the merge. splits = 1 runs
// paged's kernel directly (no workspace, no merge).
//
// Workspace (kv_cache_paged_split_workspace): with splits > 1, the partial results (split_merge.cuh).
#include <cuda_runtime.h>

#include <cstdint>

#include "core/workspace.h"
#include "kernels/dispatch.cuh"
#include "kv_cache/cuda/decode_tile.cuh"
#include "kv_cache/cuda/split_merge.cuh"
#include "kv_cache/launchers.h"

namespace optimized::cuda {
namespace {

using namespace optimized::kernels;
using namespace optimized::cuda::kv_cache_cuda;

int64_t splits_of(const KvDecodeParams& p) { return p.splits < 1 ? 1 : p.splits; }

}  // namespace

cudaError_t kv_cache_paged_split_workspace(const KvDecodeParams& p, size_t* bytes) {
  *bytes = split_workspace_bytes(p, splits_of(p));
  return cudaSuccess;
}

cudaError_t kv_cache_paged_split(const KvDecodeParams& p, const Workspace& workspace, cudaStream_t stream) {
  if (p.batch <= 0 || p.heads_q <= 0) return cudaSuccess;
  const int64_t splits = splits_of(p);
  if (!split_count_ok(splits)) return cudaErrorInvalidValue;
  const bool fp8 = p.cache.dtype == DType::kF8E4M3;
  if (splits == 1)
    return dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
      return fp8 ? launch_decode_tile<T, Fp8>(p, 1, {}, stream) : launch_decode_tile<T, T>(p, 1, {}, stream);
    });
  WorkspaceArena arena(workspace);
  const SplitOut part = carve_split_out(p, splits, arena);
  if (!arena.ok()) return cudaErrorInvalidValue;
  return dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    const cudaError_t e =
        fp8 ? launch_decode_tile<T, Fp8>(p, splits, part, stream) : launch_decode_tile<T, T>(p, splits, part, stream);
    if (e != cudaSuccess) return e;
    return launch_merge_splits<T>(p, splits, part, stream);
  });
}

}  // namespace optimized::cuda
