// The CPU rung of the KV-cache family (cpu/kv_cache_cpu.cpp), on host memory:
//   cpu_kv_append: threads over the new tokens (b, s); RoPE on k (and q in place), quantization to
//                  an fp8 cache; a token whose page is out of the table or the cache is skipped.
//   cpu_kv_decode: threads over (sequence b, kv head g): the group's query heads and q_len queries
//                  over the sequence's visible keys, each K / V row read once through the page table.
//   cpu_kv_gather: prefill's attention path on the host (cuda/gather.cu's twin): every sequence's
//                  K / V out of its pages into packed varlen buffers, and their cu_seqlens.
// fp32 math for fp32 / fp16 / bf16 (and fp8 pages), fp64 for fp64.
#pragma once

#include "kv_cache/kv_cache_params.h"

namespace optimized {

// `threads` as ExecutionContext::cpu_threads (0: every hardware thread).
void cpu_kv_append(const KvAppendParams& params, int threads);
void cpu_kv_decode(const KvDecodeParams& params, int threads);
void cpu_kv_gather(const KvGatherParams& params, int threads);

}  // namespace optimized
