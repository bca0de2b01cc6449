// What `auto` runs in the attention family, from measured tables (issue 18 item 5). The rule for
// each rung names the JSON it comes from; change a threshold only with a new measurement.
#pragma once

#include <cstdint>

#include "attention/attention_params.h"

namespace optimized {

// The hopper forward against flash2 (bf16, H100; bench/results/h100/python-attention-hopper.json,
// fixed length, S_q = S_k, B x N = 16384 tokens, 2048 model width): hopper ahead at every measured
// point, d 64: 1.35x (N = 1k) to 1.40x (16k) unmasked, 1.17x to 1.35x causal; d 128: 1.51x to
// 1.72x unmasked, 1.40x to 1.65x causal. Nothing below N = 1024 was measured (128-row tiles with
// most rows empty, and the prologue of a block of a few key tiles, might not pay): there flash2
// stays. Varlen and S_q != S_k (prefill over a cache) are not in the table either: flash2.
inline constexpr int64_t kHopperForwardMinSeqlen = 1024;

// Whether `auto` runs the hopper forward for validated params p on a device of compute capability
// `cc` (major * 10 + minor), given a build with the sm_90a sources and rows TMA can take.
inline bool auto_runs_hopper_forward(const AttentionParams& p, int cc, bool sm90a_built, bool aligned) {
  return sm90a_built && cc == 90 && aligned && !p.backward && !p.varlen() &&
         (p.dtype == DType::kF16 || p.dtype == DType::kBF16) && (p.head_dim == 64 || p.head_dim == 128) &&
         p.window_left < 0 && p.window_right <= 0 && p.softcap <= 0 && !p.alibi && !p.mask &&
         p.seqlen_q == p.seqlen_k && p.seqlen_q >= kHopperForwardMinSeqlen;
}

}  // namespace optimized
