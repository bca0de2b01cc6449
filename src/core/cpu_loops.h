// What the CPU backends of every family share: how many OpenMP threads a loop over `items` work
// items gets, and the NaN-propagating max of a row (torch's max reduction). Host only.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace optimized {

// ExecutionContext::cpu_threads (0: every hardware thread), never more threads than items, at least 1.
inline int cpu_thread_count(int threads, int64_t items) {
  const int64_t want = threads > 0 ? threads : omp_get_max_threads();
  return static_cast<int>(std::max<int64_t>(1, std::min(want, items)));
}

// max over v[0..n): -inf for none; once a NaN is seen, that NaN.
template <class A>
A nan_propagating_max(const A* v, int64_t n) {
  A m = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    if (std::isnan(v[j])) return v[j];
    if (v[j] > m) m = v[j];
  }
  return m;
}

}  // namespace optimized
