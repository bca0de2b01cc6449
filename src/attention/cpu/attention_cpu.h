// The CPU rung of the attention family (cpu/attention_cpu.cpp): forward or backward by
// params.backward, on host memory; threads over (batch, head, query rows) in the forward and over
// (batch, kv head) in the backward (so that dk / dv sums over a GQA group stay in one thread and
// the result does not depend on the thread count). fp32 math for fp32 / fp16 / bf16, fp64 for fp64.
#pragma once

#include "attention/attention_params.h"

namespace optimized {

// `threads` as ExecutionContext::cpu_threads (0: every hardware thread).
void cpu_attention(const AttentionParams& params, int threads);

}  // namespace optimized
