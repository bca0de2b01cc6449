// The KV-cache family's CUDA launchers (CUDA builds only), under the launcher contract
// (src/core/cuda_launch.h): never throw, never allocate, never synchronize; return the first CUDA
// error. Params have passed the API's checks (kv_cache.cpp): dtypes fp16 / bf16 / fp32 (cache of q's
// dtype or fp8 e4m3 with scales), head_dim <= kv_cache_config::kMaxHeadDim, batch >= 1.
//
//   kv_cache_append            (cuda/append.cu): append_kv for every CUDA variant
//   kv_cache_gather            (cuda/gather.cu): pages -> packed K/V + cu_seqlens, prefill's attention path
//   kv_cache_lse_unpack        (cuda/gather.cu): varlen's (H_q, B * q_len) lse -> the caller's (B, H_q, q_len)
//   kv_cache_contiguous_naive  (cuda/contiguous_naive.cu): one block per (sequence, query head, query)
//   kv_cache_paged             (cuda/paged.cu): one block per (sequence, kv head[, row group]), GQA packed
//   kv_cache_paged_split       (cuda/paged_split.cu): paged over p.splits key chunks + an LSE merge
//   kv_cache_paged_mma         (cuda/paged_mma.cu): paged_split's split with per-warp cp.async rings and
//                              mma.sync (fp16 / bf16 q, head_dim 64 / 128 / 256, 16-byte aligned rows)
//
// paged_split and paged_mma need a workspace (the partial results, when p.splits > 1): their
// queries say how much for the same params (only the shape fields and p.splits are read); a launch
// refuses a smaller one with cudaErrorInvalidValue. kv_cache_paged_mma_splits gives its
// split for a shape (kv_cache_config::mma_decode_splits with the instance's occupancy).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "kv_cache/kv_cache_params.h"
#include "optimized/core.h"

namespace optimized::cuda {

cudaError_t kv_cache_append(const KvAppendParams& p, const Workspace& workspace, cudaStream_t stream);
cudaError_t kv_cache_gather(const KvGatherParams& g, cudaStream_t stream);
// lse[b * lse_b + h * lse_h + t] = packed[h * (batch * q_len) + b * q_len + t].
cudaError_t kv_cache_lse_unpack(const float* packed, float* lse, int64_t batch, int64_t heads, int64_t q_len,
                                int64_t lse_b, int64_t lse_h, cudaStream_t stream);

cudaError_t kv_cache_contiguous_naive(const KvDecodeParams& p, const Workspace& workspace, cudaStream_t stream);
cudaError_t kv_cache_paged(const KvDecodeParams& p, const Workspace& workspace, cudaStream_t stream);
cudaError_t kv_cache_paged_split(const KvDecodeParams& p, const Workspace& workspace, cudaStream_t stream);

cudaError_t kv_cache_paged_mma(const KvDecodeParams& p, const Workspace& workspace, cudaStream_t stream);

cudaError_t kv_cache_paged_split_workspace(const KvDecodeParams& p, size_t* bytes);
cudaError_t kv_cache_paged_mma_workspace(const KvDecodeParams& p, size_t* bytes);
cudaError_t kv_cache_paged_mma_splits(const KvDecodeParams& p, int64_t max_seq_len, int64_t* splits);

}  // namespace optimized::cuda
