// The MoE family's CPU backend (moe_params.h): routing (threads over tokens, each running the rule of
// moe.h in fp32) and
// the permutation (a serial counting sort: the order is the documented one by construction).
#pragma once

#include "moe/moe_params.h"

namespace optimized::cpu {

void moe_route(const MoeRouteParams& p, int cpu_threads);
// The router's backward: threads over tokens, each running moe.h's gradient rule in fp32.
void moe_route_backward(const MoeRouteBackwardParams& p, int cpu_threads);
void moe_permute(const MoePermuteParams& p);
// The combine (p.out set) or its backward (p.dout set): sums in fp32 in the documented order.
void moe_combine(const MoeCombineParams& p, int cpu_threads);
// The gather of token rows into slot order (zeros for unused slots).
void moe_gather(const MoeGatherParams& p, int cpu_threads);
// The grouped GEMM, both directions (GroupedGemmParams::weight_grad): fp32 accumulation, threads
// over the rows of the output (forward) or over the groups' rows of dw (weight grad).
void grouped_gemm(const GroupedGemmParams& p, int cpu_threads);

}  // namespace optimized::cpu
