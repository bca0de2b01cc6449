// The MoE tests every backend runs (test_moe_cpu.cpp: kCuda false; test_moe_cuda.cpp: true, each
// test skipped without a CUDA device): routing over the sweep, ties, NaN logits; the permutation over
// E, k, T, routing skews, capacities, invalid ids.
#pragma once

#include "moe_test_util.h"

namespace optimized::testing {

inline void route_sweep(bool cuda) {
  std::mt19937_64 rng = test_rng();
  for (const RouteCase& c : route_cases()) run_and_check_route(c, cuda, rng);
}

// Integer logits with many equal values: the lower index wins every tie, so the ids are exact.
inline void route_ties(bool cuda) {
  std::mt19937_64 rng = test_rng();
  for (MoeScoring s : {MoeScoring::kSoftmax, MoeScoring::kSigmoid})
    for (int groups : {1, 4}) {
      RouteCase c;
      c.tokens = 33, c.experts = 16, c.o.top_k = 4, c.o.scoring = s, c.o.n_groups = groups, c.o.topk_groups = groups > 1 ? 2 : 1;
      std::uniform_int_distribution<int> u(-2, 2);
      run_and_check_route(c, cuda, rng, [&](int64_t, int64_t) { return double(u(rng)); });
      // all equal: experts 0..k-1
      c.tokens = 3;
      std::vector<Buffer> dummy;
      run_and_check_route(c, cuda, rng, [](int64_t, int64_t) { return 0.5; });
    }
}

// A NaN logit: softmax weights and lse NaN, the ids the top-k of the numbers (NaN ranks last).
inline void route_nan(bool cuda) {
  std::mt19937_64 rng = test_rng();
  RouteCase c;
  c.tokens = 5, c.experts = 8, c.o.top_k = 2;
  std::uniform_real_distribution<double> u(-3.0, 3.0);
  run_and_check_route(c, cuda, rng, [&](int64_t t, int64_t e) { return t == 2 && e == 3 ? NAN : u(rng); });
  c.o.scoring = MoeScoring::kSigmoid;  // sigmoid: only the NaN expert's own score is NaN
  run_and_check_route(c, cuda, rng, [&](int64_t t, int64_t e) { return t == 2 && e == 3 ? NAN : u(rng); });
}

inline void permute_sweep(bool cuda) {
  std::mt19937_64 rng = test_rng();
  for (int64_t E : {1, 8, 64, 256, 1024})
    for (int64_t k : {1, 2, 8})
      for (int64_t T : {1, 7, 4097})
        for (int mode = 0; mode < 4; ++mode) {
          if (k > E || (mode == 3 && E < 2)) continue;
          const std::vector<int32_t> ids = make_ids(T * k, E, mode, rng);
          const char* names[] = {"uniform", "one expert", "zipf", "even experts only"};
          run_and_check_permute(ids, T, k, E, 0, cuda, names[mode]);
          if (mode == 0 || mode == 2) {  // capacity: cf 1.0 and 0.5 (drops under skew)
            run_and_check_permute(ids, T, k, E, moe_capacity(1.0, T, k, E), cuda, std::string(names[mode]) + " cf 1");
            run_and_check_permute(ids, T, k, E, moe_capacity(0.5, T, k, E), cuda, std::string(names[mode]) + " cf 0.5");
          }
        }
}

// Ids outside [0, E) are dropped and counted; no rows at all.
inline void permute_edges(bool cuda) {
  std::mt19937_64 rng = test_rng();
  std::vector<int32_t> ids = make_ids(37 * 2, 8, 0, rng);
  ids[3] = -1, ids[10] = 8, ids[11] = 1 << 30;
  run_and_check_permute(ids, 37, 2, 8, 0, cuda, "invalid ids");
  run_and_check_permute(ids, 37, 2, 8, 3, cuda, "invalid ids, capacity 3");
  run_and_check_permute({}, 0, 2, 8, 0, cuda, "no tokens");
}

inline void grouped_sweep(bool cuda) {
  std::mt19937_64 rng = test_rng();
  for (const GroupedCase& c : grouped_cases(cuda ? GroupedGemmVariant::kCudaNaive : GroupedGemmVariant::kCpu))
    run_and_check_grouped(c, cuda, rng);
}

// Offsets with empty groups, one group holding every row, rows past the last offset (zeros), and
// unchecked offsets (negative, decreasing, past M: clamped as documented).
inline void grouped_offsets(bool cuda) {
  std::mt19937_64 rng = test_rng();
  const GroupedGemmVariant v = cuda ? GroupedGemmVariant::kCudaNaive : GroupedGemmVariant::kCpu;
  for (const std::vector<int32_t>& offs : std::vector<std::vector<int32_t>>{
           {0, 0, 37, 37, 37},        // empty groups
           {37, 37, 37, 37, 37},      // all rows to group 0
           {0, 0, 0, 0, 37},          // all rows to the last group
           {5, 9, 20, 20, 30},        // rows 30.. past the end: zeros
           {-3, 12, 7, 50, 1 << 30},  // unchecked: clamped, a running max
       }) {
    GroupedCase c;
    c.variant = v, c.dtype = DType::kBF16, c.m = 37, c.k = 24, c.n = 40, c.groups = 5, c.offs = offs;
    run_and_check_grouped(c, cuda, rng);
  }
}

}  // namespace optimized::testing
