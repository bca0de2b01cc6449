#include "moe/cpu/moe_cpu.h"

#include <algorithm>
#include <vector>

#include "core/cpu_loops.h"

namespace optimized::cpu {

void moe_route(const MoeRouteParams& p, int cpu_threads) {
#pragma omp parallel for num_threads(cpu_thread_count(cpu_threads, p.tokens)) schedule(static)
  for (int64_t t = 0; t < p.tokens; ++t) moe_route_token(p, t);
}

void moe_permute(const MoePermuteParams& p) {
  const int64_t E = p.experts;
  std::vector<int64_t> total(static_cast<size_t>(E), 0), rank(static_cast<size_t>(E), 0);
  int64_t invalid = 0;
  for (int64_t i = 0; i < p.pairs; ++i) {
    const int32_t e = p.ids[i];
    if (e < 0 || e >= E) ++invalid;
    else ++total[static_cast<size_t>(e)];
  }
  int64_t dropped = invalid, at = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t kept = p.capacity > 0 ? std::min(total[e], p.capacity) : total[e];
    dropped += total[e] - kept;
    p.counts[e] = static_cast<int32_t>(kept);
    p.offsets[e] = static_cast<int32_t>(at);
    at += kept;
  }
  p.offsets[E] = static_cast<int32_t>(at);
  for (int64_t s = at; s < p.pairs; ++s) p.sorted_pairs[s] = -1;
  for (int64_t i = 0; i < p.pairs; ++i) {
    const int32_t e = p.ids[i];
    if (e < 0 || e >= E || rank[e] >= p.counts[e]) {
      if (e >= 0 && e < E) ++rank[e];
      p.slot_of[i] = -1;
      continue;
    }
    const int64_t slot = p.offsets[e] + rank[e]++;
    p.sorted_pairs[slot] = static_cast<int32_t>(i);
    p.slot_of[i] = static_cast<int32_t>(slot);
  }
  if (p.dropped) *p.dropped = static_cast<int32_t>(dropped);
}

}  // namespace optimized::cpu
