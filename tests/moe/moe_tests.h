// The MoE tests every backend runs (test_moe_cpu.cpp: kCuda false; test_moe_cuda.cpp: true, each
// test skipped without a CUDA device): routing over the sweep, ties, NaN logits; routing's backward
// over the sweep, NaN logits, odd ids; the permutation over E, k, T, routing skews, capacities, invalid
// ids.
#pragma once

#include <array>

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

inline void route_backward_sweep(bool cuda) {
  std::mt19937_64 rng = test_rng();
  for (const RouteBackwardCase& c : route_backward_cases()) run_and_check_route_backward(c, cuda, rng);
}

// NaN logits, each mode: token 1 a NaN the choice skips, token 2 all NaN (sigmoid chooses NaN experts),
// token 3 a NaN with zero incoming gradients (exact zeros: autograd's zeros for unused outputs), token
// 4 a NaN with only grad_lse (NaN row), token 5 a NaN with only grad_weights (sigmoid: finite).
inline void route_backward_nan(bool cuda) {
  std::mt19937_64 rng = test_rng();
  std::uniform_real_distribution<double> u(-3.0, 3.0), ug(-1.0, 1.0);
  const auto logit = [&](int64_t t, int64_t e) { return (t == 2 || (t > 0 && e == 3)) ? NAN : u(rng); };
  const auto gw = [&](int64_t t, int64_t) { return t == 3 || t == 4 ? 0.0 : ug(rng); };
  const auto gl = [&](int64_t t) { return t == 3 || t == 5 ? 0.0 : ug(rng); };
  for (int mode = 0; mode < 4; ++mode) {
    RouteBackwardCase c;
    c.route.tokens = 6, c.route.experts = 8, c.route.o.top_k = 2;
    c.route.o.topk_softmax = mode == 1;
    c.route.o.scoring = mode >= 2 ? MoeScoring::kSigmoid : MoeScoring::kSoftmax;
    c.route.o.normalize = mode == 3;
    run_and_check_route_backward(c, cuda, rng, logit, {}, gw, gl);
  }
}

// Ids the forward would not give (out of range: left out; repeated: each pair adds its term), absent
// incoming gradients (exact zeros), a huge routed_scale, and no tokens at all (nothing written).
inline void route_backward_edges(bool cuda) {
  std::mt19937_64 rng = test_rng();
  for (int mode = 0; mode < 4; ++mode) {
    RouteBackwardCase c;
    c.route.tokens = 5, c.route.experts = 8, c.route.o.top_k = 3;
    c.route.o.topk_softmax = mode == 1;
    c.route.o.scoring = mode >= 2 ? MoeScoring::kSigmoid : MoeScoring::kSoftmax;
    c.route.o.normalize = mode == 0 || mode == 3;
    const std::vector<int32_t> ids{0, 1, 2, -1, 4, 5, 6, 8, 1 << 30, 7, 7, 2, 3, 3, 3};
    run_and_check_route_backward(c, cuda, rng, nullptr, ids);
    c.grad_weights = c.grad_lse = false;
    run_and_check_route_backward(c, cuda, rng);
    c.grad_weights = true, c.route.o.routed_scale = 1e6f;
    run_and_check_route_backward(c, cuda, rng);
  }
  RouteBackwardCase c;
  c.route.tokens = 0;
  run_and_check_route_backward(c, cuda, rng);
}

// Wider than the sweep: 1024 experts (32 a lane on CUDA), k = 32 (a pair on every lane).
inline void route_backward_widest(bool cuda) {
  std::mt19937_64 rng = test_rng();
  for (int mode = 0; mode < 3; ++mode) {
    RouteBackwardCase c;
    c.route.tokens = 67, c.route.experts = 1024, c.route.o.top_k = 32, c.route.dtype = DType::kBF16;
    c.route.o.normalize = mode != 0;
    c.route.o.scoring = mode == 2 ? MoeScoring::kSigmoid : MoeScoring::kSoftmax;
    run_and_check_route_backward(c, cuda, rng);
  }
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

// The rungs of the backend: cpu; naive and loop on CUDA, and wgmma on a compute capability 9.0 device.
inline std::vector<GroupedGemmVariant> grouped_rungs(bool cuda) {
  if (!cuda) return {GroupedGemmVariant::kCpu};
  if (hopper_device()) return {GroupedGemmVariant::kCudaNaive, GroupedGemmVariant::kCudaLoop, GroupedGemmVariant::kCudaWgmma};
  return {GroupedGemmVariant::kCudaNaive, GroupedGemmVariant::kCudaLoop};
}

inline void grouped_sweep(bool cuda) {
  std::mt19937_64 rng = test_rng();
  for (GroupedGemmVariant v : grouped_rungs(cuda))
    for (const GroupedCase& c : v == GroupedGemmVariant::kCudaWgmma ? grouped_wgmma_cases() : grouped_cases(v))
      run_and_check_grouped(c, cuda, rng);
}

// grouped_mm_swiglu on every rung of the backend (wgmma: SwiGLU in the epilogue; the others through
// silu_and_mul), with and without pre: F not a multiple of the tile's 128 outputs (wgmma takes multiples of 8),
// empty groups, rows past the end.
inline void grouped_swiglu(bool cuda) {
  std::mt19937_64 rng = test_rng();
  for (GroupedGemmVariant v : grouped_rungs(cuda)) {
    int i = 0;
    for (int64_t E : {1, 8})
      for (const auto& [M, K, F] : std::vector<std::array<int64_t, 3>>{{1, 8, 8}, {131, 72, 104}, {700, 136, 296}}) {
        GroupedCase c;
        c.variant = v, c.groups = E, c.m = M, c.k = K, c.n = F;
        c.dtype = v == GroupedGemmVariant::kCpu && i % 3 == 0 ? DType::kF32 : i % 2 ? DType::kBF16 : DType::kF16;
        c.pad = i % 2 ? 8 : 0;
        if (E == 8 && M == 131) c.offs = {0, 20, 20, 20, 77, 100, 100, 120};  // empty groups, rows past the end
        run_and_check_swiglu(c, cuda, rng, i % 3 != 2);
        ++i;
      }
  }
}

// Offsets with empty groups, one group holding every row, rows past the last offset (zeros), and
// unchecked offsets (negative, decreasing, past M: clamped as documented).
inline void grouped_offsets(bool cuda) {
  std::mt19937_64 rng = test_rng();
  for (GroupedGemmVariant v : grouped_rungs(cuda))
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

// The gather: every slot's row the token's row exactly (a copy), zeros for unused slots (-1, and pairs
// outside [0, T k)); strided x, every dtype, rows whose bytes are and are not whole 16-byte units.
inline void gather_checks(bool cuda) {
  std::mt19937_64 rng = test_rng();
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16})
    for (const auto& [T, k, N, pad] : std::vector<std::array<int64_t, 4>>{{1, 1, 1, 0}, {37, 2, 67, 3}, {131, 8, 64, 8}}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " T=" + std::to_string(T) + " k=" + std::to_string(k) + " N=" +
                   std::to_string(N));
      const int64_t S = T * k + 5, ld = N + pad;
      std::vector<int32_t> pairs(static_cast<size_t>(S));
      std::uniform_int_distribution<int32_t> u(0, static_cast<int32_t>(T * k - 1));
      for (auto& p : pairs) p = u(rng);
      pairs[0] = -1, pairs[S - 1] = static_cast<int32_t>(T * k);  // unused, out of range
      Buffer x(dt, T * ld, Device::cpu()), sp(DType::kI32, S, Device::cpu()), xs(dt, S * N, Device::cpu());
      std::uniform_real_distribution<double> v(-1.0, 1.0);
      for (int64_t i = 0; i < T * ld; ++i) store_from_double(x.data(), dt, i, v(rng));
      std::memcpy(sp.data(), pairs.data(), pairs.size() * 4);
      xs.fill_bytes(0xFF);
      std::vector<Buffer> r = run_case(cuda, {&x, &sp, &xs}, [&](const std::vector<void*>& p, Device d) {
        moe_gather(raw(p[0], dt, d, {T, N}, {ld, 1}), raw(p[1], DType::kI32, d, {S}, {1}), k, raw(p[2], dt, d, {S, N}, {N, 1}));
      });
      if (r.size() != 3) continue;
      int failures = 0;
      for (int64_t s = 0; s < S && failures < 3; ++s)
        for (int64_t c = 0; c < N && failures < 3; ++c) {
          const int32_t p = pairs[static_cast<size_t>(s)];
          const double want = p >= 0 && p < T * k ? load_as_double(x.data(), dt, (p / k) * ld + c) : 0.0;
          const double got = load_as_double(r[2].data(), dt, s * N + c);
          if (!(got == want)) {
            ADD_FAILURE() << "xs[" << s << ", " << c << "] = " << got << ", expected " << want;
            ++failures;
          }
        }
    }
}

// The combine and its backward against float64: pairs from a permutation (capacity: some dropped,
// plus -1 and out-of-range slots written by hand), slots no pair uses, strided y, every dtype.
inline void combine_checks(bool cuda) {
  std::mt19937_64 rng = test_rng();
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16})
    for (const auto& [T, k, E, N] : std::vector<std::array<int64_t, 4>>{
             {1, 1, 1, 1}, {37, 2, 8, 67}, {131, 8, 16, 130}, {64, 2, 8, 256}, {33, 3, 4, 24}}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " T=" + std::to_string(T) + " k=" + std::to_string(k) + " N=" +
                   std::to_string(N));
      const std::vector<int32_t> ids = make_ids(T * k, E, 2, rng);
      PermuteRef perm = permute_ref(ids, E, E > 1 ? moe_capacity(0.75, T, k, E) : 0);
      // 3 slots no pair uses; padded rows (whole 16-byte units where N allows: the kernels' 16-byte accesses)
      const int64_t S = T * k + 3, ld = N % 8 == 0 ? N + 8 : N + 5;
      if (T * k > 2) perm.slot_of[1] = -1, perm.slot_of[2] = static_cast<int32_t>(S + 7);  // dropped by hand
      std::vector<int32_t> sorted(static_cast<size_t>(S), -1);
      for (int64_t p = 0; p < T * k; ++p)
        if (perm.slot_of[p] >= 0 && perm.slot_of[p] < S) sorted[perm.slot_of[p]] = static_cast<int32_t>(p);
      Buffer y(dt, S * ld, Device::cpu()), slot(DType::kI32, T * k, Device::cpu()), w(DType::kF32, T * k, Device::cpu());
      Buffer out(dt, T * N, Device::cpu()), dout(dt, T * N, Device::cpu()), sp(DType::kI32, S, Device::cpu());
      Buffer gy(dt, S * ld, Device::cpu()), gw(DType::kF32, T * k, Device::cpu());
      y.fill_bytes(0xFF), out.fill_bytes(0xFF), gy.fill_bytes(0xFF), gw.fill_bytes(0xFF);
      std::uniform_real_distribution<double> u(-1.0, 1.0);
      for (int64_t s = 0; s < S; ++s)
        for (int64_t c = 0; c < N; ++c) store_from_double(y.data(), dt, s * ld + c, u(rng));
      for (int64_t i = 0; i < T * N; ++i) store_from_double(dout.data(), dt, i, u(rng));
      for (int64_t i = 0; i < T * k; ++i) store_from_double(w.data(), DType::kF32, i, u(rng));
      std::memcpy(slot.data(), perm.slot_of.data(), static_cast<size_t>(T * k) * 4);
      std::memcpy(sp.data(), sorted.data(), static_cast<size_t>(S) * 4);
      std::vector<Buffer> r = run_case(cuda, {&y, &slot, &w, &out, &dout, &sp, &gy, &gw},
                                       [&](const std::vector<void*>& p, Device d) {
        const TensorView yv = raw(p[0], dt, d, {S, N}, {ld, 1});
        const TensorView sv = raw(p[1], DType::kI32, d, {T, k}, {k, 1}), wv = raw(p[2], DType::kF32, d, {T, k}, {k, 1});
        moe_combine(yv, sv, wv, raw(p[3], dt, d, {T, N}, {N, 1}));
        moe_combine_backward(raw(p[4], dt, d, {T, N}, {N, 1}), yv, sv, raw(p[5], DType::kI32, d, {S}, {1}), wv,
                             raw(p[6], dt, d, {S, N}, {ld, 1}), raw(p[7], DType::kF32, d, {T, k}, {k, 1}));
      });
      if (r.size() != 8) continue;
      const auto Y = [&](int64_t s, int64_t c) { return load_as_double(y.data(), dt, s * ld + c); };
      const auto DO = [&](int64_t t, int64_t c) { return load_as_double(dout.data(), dt, t * N + c); };
      const auto W = [&](int64_t p) { return load_as_double(w.data(), DType::kF32, p); };
      const auto kept = [&](int64_t p) { return perm.slot_of[p] >= 0 && perm.slot_of[p] < S; };
      int failures = 0;
      const auto expect = [&](const char* what, double got, double ref, double mag, int64_t terms, DType out_dt) {
        if (failures < 3 && !(std::fabs(got - ref) <= gemm_allowed_error(out_dt, std::max<int64_t>(1, terms), ref, mag))) {
          ADD_FAILURE() << what << ": got " << got << ", expected " << ref;
          ++failures;
        }
      };
      for (int64_t t = 0; t < T; ++t)
        for (int64_t c = 0; c < N; ++c) {
          double ref = 0, mag = 0;
          for (int64_t j = 0; j < k; ++j)
            if (kept(t * k + j)) ref += W(t * k + j) * Y(perm.slot_of[t * k + j], c), mag += std::fabs(W(t * k + j) * Y(perm.slot_of[t * k + j], c));
          expect("out", load_as_double(r[3].data(), dt, t * N + c), ref, mag, k, dt);
        }
      for (int64_t s = 0; s < S; ++s)
        for (int64_t c = 0; c < N; ++c) {
          const int32_t p = sorted[s];
          const double ref = p >= 0 ? W(p) * DO(p / k, c) : 0.0;
          expect("grad_y", load_as_double(r[6].data(), dt, s * ld + c), ref, std::fabs(ref), 1, dt);
        }
      for (int64_t p = 0; p < T * k; ++p) {
        double ref = 0, mag = 0;
        for (int64_t c = 0; kept(p) && c < N; ++c) ref += DO(p / k, c) * Y(perm.slot_of[p], c), mag += std::fabs(DO(p / k, c) * Y(perm.slot_of[p], c));
        expect("grad_weights", load_as_double(r[7].data(), DType::kF32, p), ref, mag, N, DType::kF32);
      }
      int64_t at = -1;
      for (int64_t s = 0; s < S && at < 0; ++s)
        for (int64_t c = N; c < ld; ++c)
          if (!std::isnan(load_as_double(r[6].data(), dt, s * ld + c))) at = s;
      EXPECT_LT(at, 0) << "grad_y written past its columns in row " << at;
    }
}

}  // namespace optimized::testing