// Shared machinery of the linear family's tests: a case (dtype, x's leading dimensions, K, N, row
// padding, activation, bias, pre kept or recomputed, gradient dtype, accumulate, variant), its host
// buffers with fresh random inputs and poisoned (NaN) outputs, the views the public API takes over
// any base pointers (host or device copies), and the checks against the float64 reference
// (src/testing/linear_reference.h).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/test_util.h"
#include "optimized/buffer.h"
#include "optimized/linear.h"
#include "testing/linear_reference.h"
#include "testing/scaled_gemm_reference.h"
#include "testing/tolerance.h"

namespace optimized::testing {

struct LinearCase {
  DType dtype = DType::kF32;
  std::vector<int64_t> lead = {7};  // x's leading dimensions (M = their product)
  int64_t k = 5, n = 5;
  int64_t pad = 0;                  // extra elements between the rows of x and of grad_output
  Activation act = Activation::kNone;
  bool bias = true;
  bool keep_pre = true;             // the forward writes pre and the backward reads it; else recomputed
  DType grad_dtype = DType::kF32;   // grad_weight / grad_bias (the dtype, or fp32 for 16-bit)
  bool same_grad_dtype = true;      // grad_dtype = dtype
  bool accumulate = false;
  bool want_gi = true, want_gw = true, want_gb = true;
  bool fp8 = false;                 // the fp8 GEMMs (LinearForwardOptions::fp8): checked by run_and_check_fp8
  LinearVariant variant = LinearVariant::kCpu;
  int cpu_threads = 0;

  DType gdt() const { return same_grad_dtype ? dtype : grad_dtype; }
  std::string name() const {
    std::string s = std::string(dtype_name(dtype)) + " " + std::string(linear_variant_name(variant)) + " x(";
    for (int64_t d : lead) s += std::to_string(d) + ",";
    s += std::to_string(k) + ") n=" + std::to_string(n) + " pad=" + std::to_string(pad) + " act=" +
         std::string(activation_name(act)) + (bias ? " bias" : "") + (keep_pre ? " pre" : " recompute") +
         " grads=" + std::string(dtype_name(gdt())) + (accumulate ? " accumulate" : "") + (fp8 ? " fp8" : "");
    return s;
  }
};

inline void fill_uniform(Buffer& b, std::mt19937_64& rng, double lo = -1.0, double hi = 1.0) {
  std::uniform_real_distribution<double> u(lo, hi);
  for (int64_t i = 0; i < b.count(); ++i) store_from_double(b.data(), b.dtype(), i, u(rng));
}

// The buffers of one case (host), in the order of `all()`: x, w, b, dy, y, pre, gi, gw, gb.
struct LinearData {
  LinearCase c;
  int64_t m = 1, ld = 0;  // rows of x / dy, their row stride
  Buffer x, w, b, dy, y, pre, gi, gw, gb;
  enum : size_t { kX, kW, kB, kDy, kY, kPre, kGi, kGw, kGb };

  LinearData(const LinearCase& cs, std::mt19937_64& rng) : c(cs) {
    for (int64_t d : c.lead) m *= d;
    ld = c.k + c.pad;
    const int64_t ldy = c.n + c.pad;
    x = Buffer(c.dtype, std::max<int64_t>(1, m * ld), Device::cpu());
    w = Buffer(c.dtype, c.n * c.k, Device::cpu());
    b = Buffer(c.dtype, c.n, Device::cpu());
    dy = Buffer(c.dtype, std::max<int64_t>(1, m * ldy), Device::cpu());
    y = Buffer(c.dtype, std::max<int64_t>(1, m * c.n), Device::cpu());
    pre = Buffer(c.dtype, std::max<int64_t>(1, m * c.n), Device::cpu());
    gi = Buffer(c.dtype, std::max<int64_t>(1, m * c.k), Device::cpu());
    gw = Buffer(c.gdt(), c.n * c.k, Device::cpu());
    gb = Buffer(c.gdt(), c.n, Device::cpu());
    for (Buffer* t : {&x, &dy}) t->fill_bytes(0xFF);  // the padding: NaN, never read
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < c.k; ++j) store_from_double(x.data(), c.dtype, i * ld + j, u(rng));
      for (int64_t j = 0; j < c.n; ++j) store_from_double(dy.data(), c.dtype, i * ldy + j, u(rng));
    }
    fill_uniform(w, rng, -0.5, 0.5);
    fill_uniform(b, rng);
    for (Buffer* t : {&y, &pre, &gi, &gw, &gb}) t->fill_bytes(0xFF);  // poisoned outputs
  }
  std::vector<const Buffer*> all() const { return {&x, &w, &b, &dy, &y, &pre, &gi, &gw, &gb}; }

  // (lead..., last) over `base`, rows `row` apart (the leading dimensions contiguous over rows).
  TensorView rows_view(void* base, DType dt, Device d, int64_t last, int64_t row) const {
    std::vector<int64_t> shape = c.lead, strides(c.lead.size() + 1);
    shape.push_back(last);
    strides.back() = 1;
    int64_t s = row;
    for (size_t i = c.lead.size(); i-- > 0;) strides[i] = s, s *= c.lead[i];
    return raw(base, dt, d, shape, strides);
  }
  TensorView xv(void* p, Device d) const { return rows_view(p, c.dtype, d, c.k, ld); }
  TensorView dyv(void* p, Device d) const { return rows_view(p, c.dtype, d, c.n, c.n + c.pad); }
  TensorView yv(void* p, Device d) const { return rows_view(p, c.dtype, d, c.n, c.n); }
  TensorView giv(void* p, Device d) const { return rows_view(p, c.dtype, d, c.k, c.k); }
  TensorView wv(void* p, Device d) const { return raw(p, c.dtype, d, {c.n, c.k}, {c.k, 1}); }
  TensorView gwv(void* p, Device d) const { return raw(p, c.gdt(), d, {c.n, c.k}, {c.k, 1}); }
  TensorView bv(void* p, Device d, DType dt) const { return raw(p, dt, d, {c.n}, {1}); }

  void forward(const std::vector<void*>& p, Device d, const ExecutionContext& ctx = {}) const {
    linear_forward(xv(p[kX], d), wv(p[kW], d), c.bias ? bv(p[kB], d, c.dtype) : TensorView{}, yv(p[kY], d),
                   c.keep_pre ? yv(p[kPre], d) : TensorView{}, LinearForwardOptions{c.act, c.fp8}, c.variant, ctx);
  }
  void backward(const std::vector<void*>& p, Device d, const ExecutionContext& ctx = {}) const {
    LinearBackwardOptions o;
    o.activation = c.act;
    o.accumulate = c.accumulate;
    o.fp8 = c.fp8;
    linear_backward(c.want_gi ? giv(p[kGi], d) : TensorView{}, c.want_gw ? gwv(p[kGw], d) : TensorView{},
                    c.want_gb ? bv(p[kGb], d, c.gdt()) : TensorView{}, dyv(p[kDy], d), xv(p[kX], d), wv(p[kW], d),
                    c.keep_pre ? yv(p[kPre], d) : TensorView{}, c.bias ? bv(p[kB], d, c.dtype) : TensorView{}, o,
                    c.variant, ctx);
  }

  // Dense doubles of a (rows, cols) matrix stored with row stride `row`.
  static std::vector<double> dense(const Buffer& t, int64_t rows, int64_t cols, int64_t row) {
    std::vector<double> out(static_cast<size_t>(rows * cols));
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) out[static_cast<size_t>(i * cols + j)] = load_as_double(t.data(), t.dtype(), i * row + j);
    return out;
  }
  LinearProblemF64 problem() const {
    LinearProblemF64 p;
    p.m = m, p.n = c.n, p.k = c.k, p.act = c.act;
    p.x = dense(x, m, c.k, ld);
    p.w = dense(w, c.n, c.k, c.k);
    if (c.bias) p.b = dense(b, 1, c.n, c.n);
    p.dy = dense(dy, m, c.n, c.n + c.pad);
    return p;
  }
};

inline bool same_bytes(const Buffer& a, const Buffer& b) {
  return a.bytes() == b.bytes() && std::memcmp(a.data(), b.data(), a.bytes()) == 0;
}

// Forward then backward of one case on the CPU or cuda:0, every output checked against the float64
// reference, absent gradients untouched. c0: the gradients' initial values (accumulate) are random.
inline void run_and_check(const LinearCase& cs, bool cuda, std::mt19937_64& rng) {
  SCOPED_TRACE(cs.name());
  LinearData d(cs, rng);
  if (cs.accumulate) {
    fill_uniform(d.gw, rng);
    fill_uniform(d.gb, rng);
  }
  const LinearProblemF64 prob = d.problem();
  // forward
  std::vector<Buffer> f = run_case(cuda, d.all(), [&](const std::vector<void*>& p, Device dev) { d.forward(p, dev); });
  if (f.size() != 9) return;
  const std::vector<double> y = LinearData::dense(f[LinearData::kY], d.m, cs.n, cs.n);
  const std::vector<double> pre = LinearData::dense(f[LinearData::kPre], d.m, cs.n, cs.n);
  const CheckResult fr = check_linear_forward(prob, cs.dtype, y, cs.keep_pre ? &pre : nullptr);
  EXPECT_TRUE(fr.passed) << "forward: " << fr.first_failure;
  if (!cs.keep_pre) {
    EXPECT_TRUE(same_bytes(f[LinearData::kPre], d.pre)) << "pre written though absent";
  }
  // backward, with the forward's pre
  std::memcpy(d.pre.data(), f[LinearData::kPre].data(), d.pre.bytes());
  std::vector<Buffer> bw = run_case(cuda, d.all(), [&](const std::vector<void*>& p, Device dev) { d.backward(p, dev); });
  if (bw.size() != 9) return;
  std::vector<double> pre_used(static_cast<size_t>(d.m * cs.n));
  if (cs.keep_pre) {
    pre_used = pre;
  } else {
    const LinearForwardF64 ref = linear_forward_f64(prob);
    for (size_t o = 0; o < pre_used.size(); ++o) pre_used[o] = round_to(cs.dtype, ref.pre[o]);
  }
  const std::vector<double> c0w = cs.accumulate ? LinearData::dense(d.gw, cs.n, cs.k, cs.k) : std::vector<double>{};
  const std::vector<double> c0b = cs.accumulate ? LinearData::dense(d.gb, 1, cs.n, cs.n) : std::vector<double>{};
  const LinearBackwardF64 ref =
      linear_backward_f64(prob, pre_used, !cs.keep_pre, cs.dtype, cs.dtype, cs.gdt(), cs.gdt(), c0w, c0b);
  // Each gradient against the reference when asked for, else its buffer untouched.
  const auto check = [&](bool want, const char* name, size_t slot, const Buffer& before, int64_t rows,
                         int64_t cols, const std::vector<double>& expect, const std::vector<double>& bound,
                         int64_t reduction) {
    if (!want) {
      EXPECT_TRUE(same_bytes(bw[slot], before)) << name << " written though absent";
      return;
    }
    const CheckResult r = check_linear_gradient(name, LinearData::dense(bw[slot], rows, cols, cols), expect, bound,
                                                reduction);
    EXPECT_TRUE(r.passed) << r.first_failure;
  };
  check(cs.want_gi, "grad_input", LinearData::kGi, d.gi, d.m, cs.k, ref.grad_input, ref.grad_input_bound, cs.k);
  check(cs.want_gw, "grad_weight", LinearData::kGw, d.gw, cs.n, cs.k, ref.grad_weight, ref.grad_weight_bound, cs.k);
  check(cs.want_gb, "grad_bias", LinearData::kGb, d.gb, 1, cs.n, ref.grad_bias, ref.grad_bias_bound, cs.n);
  // Inputs untouched.
  for (size_t i : {LinearData::kX, LinearData::kW, LinearData::kB, LinearData::kDy, LinearData::kPre})
    EXPECT_TRUE(same_bytes(bw[i], *d.all()[i])) << "input " << i << " changed";
}

// The sweep every backend runs: odd sizes, every activation, pre kept and recomputed, padded rows.
inline std::vector<LinearCase> sweep_cases(DType dtype, LinearVariant variant) {
  std::vector<LinearCase> out;
  const std::vector<std::pair<int64_t, int64_t>> kn = {{1, 1}, {5, 67}, {64, 5}, {67, 130}, {130, 64}, {130, 130}, {1, 64}, {67, 1}};
  const std::vector<int64_t> ms = {0, 1, 7, 37};
  int i = 0;
  for (Activation act : {Activation::kNone, Activation::kRelu, Activation::kGeluErf, Activation::kGeluTanh, Activation::kSilu})
    for (int64_t m : ms)
      for (const auto& [k, n] : kn)
        for (bool keep : {true, false}) {
          LinearCase c;
          c.dtype = dtype, c.variant = variant, c.act = act, c.lead = {m}, c.k = k, c.n = n, c.keep_pre = keep;
          c.bias = (i % 3) != 2;
          c.pad = (i % 4 == 1) ? 3 : 0;
          ++i;
          out.push_back(c);
        }
  return out;
}

// ---- fp8 (LinearForwardOptions::fp8) -------------------------------------------------------------
//
// The reference quantizes as the op documents (include/optimized/linear.h): q = fp8_max / amax in
// fp32, t8 = fp8(clamp(t * q)) round to nearest even, dequantized t8 * (1 / q); then the float64
// reference of the layer on the dequantized operands. The bounds are the fp8 GEMM's
// (scaled_gemm_allowed_error with promotion 128: Hopper's fp8 tensor cores keep ~14 bits between
// promotions). g = round(dy * act'(pre)) is emulated in fp32 as the op computes it; where the
// device's act' differs by an ulp, one element of g may land on the neighbouring e5m2 value, so
// with an activation each gradient element may also be off by one e5m2 step (2^-2 relative) of
// its largest term.

// The dequantized copy of t (doubles holding values of dtype) with per-tensor current scaling;
// *deq_out (when given): the dequantization scale 1 / q.
inline std::vector<double> fp8_emulate(const std::vector<double>& t, bool e5m2, double* deq_out = nullptr) {
  const float fmax = e5m2 ? 57344.0f : 448.0f;
  float amax = 0.0f;
  for (double v : t) amax = std::max(amax, static_cast<float>(std::fabs(v)));
  const float q = amax == 0.0f ? 1.0f : std::min(fmax / amax, 3.4028235e38f);
  const double deq = static_cast<double>(1.0f / q);
  if (deq_out) *deq_out = deq;
  std::vector<double> out(t.size());
  for (size_t i = 0; i < t.size(); ++i) {
    const float v = std::min(fmax, std::max(-fmax, static_cast<float>(t[i]) * q));
    out[i] = (e5m2 ? fp8_e5m2_to_float(float_to_fp8_e5m2(v)) : fp8_e4m3_to_float(float_to_fp8_e4m3(v))) * deq;
  }
  return out;
}

// a (rows, inner) times b (inner, cols) given as element functions: the product, its magnitude
// (sum |a b|), `largest`: the largest of step(i, t) |b(t, j)| (one quantization step of a's
// element), and `carried`: sum of err(i, t) |b(t, j)| (what a's element may be off before it is
// quantized).
struct Product {
  std::vector<double> value, magnitude, largest, carried;
};
inline Product product(int64_t rows, int64_t inner, int64_t cols, const std::function<double(int64_t, int64_t)>& a,
                       const std::function<double(int64_t, int64_t)>& b,
                       const std::function<double(int64_t, int64_t)>& step,
                       const std::function<double(int64_t, int64_t)>& err) {
  Product p;
  p.value.assign(static_cast<size_t>(rows * cols), 0.0);
  p.magnitude = p.largest = p.carried = p.value;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      double s = 0, mag = 0, big = 0, carried = 0;
      for (int64_t t = 0; t < inner; ++t) {
        const double bt = b(t, j), v = a(i, t) * bt;
        s += v, mag += std::fabs(v), big = std::max(big, step(i, t) * std::fabs(bt));
        carried += err(i, t) * std::fabs(bt);
      }
      const size_t o = static_cast<size_t>(i * cols + j);
      p.value[o] = s, p.magnitude[o] = mag, p.largest[o] = big, p.carried[o] = carried;
    }
  return p;
}

// Every element of got (dense doubles) within bound(o) of ref; the first failure named.
inline void expect_within(const char* name, const std::vector<double>& got, const std::vector<double>& ref,
                          const std::function<double(size_t)>& bound) {
  ASSERT_EQ(got.size(), ref.size()) << name;
  for (size_t o = 0; o < ref.size(); ++o) {
    const double err = std::fabs(got[o] - ref[o]);
    if (!(err <= bound(o))) {
      ADD_FAILURE() << name << "[" << o << "]: got " << got[o] << ", expected " << ref[o] << " (error " << err
                    << " > allowed " << bound(o) << ")";
      return;
    }
  }
}

// Forward then backward of one fp8 case (cs.fp8 set) on the CPU or cuda:0, against the reference.
inline void run_and_check_fp8(LinearCase cs, bool cuda, std::mt19937_64& rng) {
  cs.fp8 = true;
  SCOPED_TRACE(cs.name());
  LinearData d(cs, rng);
  if (cs.accumulate) {
    fill_uniform(d.gw, rng);
    fill_uniform(d.gb, rng);
  }
  const LinearProblemF64 prob = d.problem();
  LinearProblemF64 pq = prob;  // x and W as the GEMM sees them
  pq.x = fp8_emulate(prob.x, false);
  pq.w = fp8_emulate(prob.w, false);
  const int64_t m = d.m, n = cs.n, k = cs.k;
  const DType dt = cs.dtype;
  constexpr int64_t kPromotion = 128;
  std::vector<Buffer> f = run_case(cuda, d.all(), [&](const std::vector<void*>& p, Device dev) { d.forward(p, dev); });
  if (f.size() != 9) return;
  const std::vector<double> y = LinearData::dense(f[LinearData::kY], m, n, n);
  const std::vector<double> pre = LinearData::dense(f[LinearData::kPre], m, n, n);
  const LinearForwardF64 fr = linear_forward_f64(pq);
  const auto acc_bound = [&](DType out, int64_t inner, double ref, double mag) {
    return scaled_gemm_allowed_error(out, inner, kPromotion, ref, mag);
  };
  if (cs.keep_pre)
    expect_within("pre", pre, fr.pre, [&](size_t o) { return acc_bound(dt, k, fr.pre[o], fr.magnitude[o]); });
  else
    EXPECT_TRUE(same_bytes(f[LinearData::kPre], d.pre)) << "pre written though absent";
  expect_within("y", y, fr.y, [&](size_t o) {
    return 1.2 * acc_bound(dt, k, fr.y[o], fr.magnitude[o]) + 1e-6 * (std::fabs(fr.pre[o]) + std::fabs(fr.y[o]));
  });
  if (m == 0) return;

  // backward, with the forward's pre (or recomputed)
  std::memcpy(d.pre.data(), f[LinearData::kPre].data(), d.pre.bytes());
  std::vector<Buffer> bw = run_case(cuda, d.all(), [&](const std::vector<void*>& p, Device dev) { d.backward(p, dev); });
  if (bw.size() != 9) return;
  // The pre the backward evaluates act' at: the forward's; recomputed, it is the fp8 forward's pre
  // again (the same casts and GEMM: the same bits), which a forward with pre shows. (The fp8 GEMM's
  // accumulation error moves pre far more than a rounding, so the exact product would not do.)
  std::vector<double> pre_used = pre;
  if (!cs.keep_pre) {
    std::vector<Buffer> f2 = run_case(cuda, d.all(), [&](const std::vector<void*>& p, Device dev) {
      linear_forward(d.xv(p[LinearData::kX], dev), d.wv(p[LinearData::kW], dev),
                     cs.bias ? d.bv(p[LinearData::kB], dev, dt) : TensorView{}, d.yv(p[LinearData::kY], dev),
                     d.yv(p[LinearData::kPre], dev), LinearForwardOptions{cs.act, true}, cs.variant);
    });
    if (f2.size() != 9) return;
    pre_used = LinearData::dense(f2[LinearData::kPre], m, n, n);
  }
  std::vector<double> g(static_cast<size_t>(m * n));
  for (size_t o = 0; o < g.size(); ++o) {
    const float v = cs.act == Activation::kNone
                        ? static_cast<float>(prob.dy[o])
                        : static_cast<float>(prob.dy[o]) * static_cast<float>(activation_grad_f64(cs.act, pre_used[o]));
    g[o] = round_to(dt, v);
  }
  double deq_g = 0;
  const std::vector<double> gq = fp8_emulate(g, true, &deq_g);
  // With an activation, g's element may differ from the emulation's by e_g (the fp32 act' against
  // the double one: 8 u_fp32 (1 + |pre|) |dy|), and then land one e5m2 step away (2^-2 relative, or
  // the subnormal step 2^-16 times the scale). Without one, g = dy exactly.
  const bool act = cs.act != Activation::kNone;
  const auto step = [&](int64_t i, int64_t j) {
    return act ? std::max(0.25 * std::fabs(gq[i * n + j]), std::ldexp(deq_g, -16)) : 0.0;
  };
  const auto err = [&](int64_t i, int64_t j) {
    const double p = std::fabs(pre_used[i * n + j]), dy = std::fabs(prob.dy[i * n + j]);
    return act ? dy * 8 * std::ldexp(1.0, -24) * (1 + p) : 0.0;
  };
  const DType gdt = cs.gdt();
  if (cs.want_gi) {
    const Product r = product(m, n, k, [&](int64_t i, int64_t j) { return gq[i * n + j]; },
                              [&](int64_t j, int64_t kk) { return pq.w[j * k + kk]; }, step, err);
    expect_within("grad_input", LinearData::dense(bw[LinearData::kGi], m, k, k), r.value, [&](size_t o) {
      return acc_bound(dt, n, r.value[o], r.magnitude[o]) + r.largest[o] + r.carried[o];
    });
  }
  if (cs.want_gw) {
    Product r = product(n, m, k, [&](int64_t j, int64_t i) { return gq[i * n + j]; },
                        [&](int64_t i, int64_t kk) { return pq.x[i * k + kk]; },
                        [&](int64_t j, int64_t i) { return step(i, j); }, [&](int64_t j, int64_t i) { return err(i, j); });
    if (cs.accumulate) {
      const std::vector<double> c0 = LinearData::dense(d.gw, n, k, k);
      for (size_t o = 0; o < c0.size(); ++o) r.value[o] += c0[o], r.magnitude[o] += std::fabs(c0[o]);
    }
    expect_within("grad_weight", LinearData::dense(bw[LinearData::kGw], n, k, k), r.value,
                  [&](size_t o) { return acc_bound(gdt, m, r.value[o], r.magnitude[o]) + r.largest[o] + r.carried[o]; });
  }
  if (cs.want_gb) {  // the bias gradient: sums of the unquantized g, as without fp8
    const std::vector<double> c0b = cs.accumulate ? LinearData::dense(d.gb, 1, n, n) : std::vector<double>{};
    const LinearBackwardF64 ref = linear_backward_f64(prob, pre_used, false, dt, dt, gdt, gdt, {}, c0b);
    const CheckResult r = check_linear_gradient("grad_bias", LinearData::dense(bw[LinearData::kGb], 1, n, n),
                                                ref.grad_bias, ref.grad_bias_bound, n);
    EXPECT_TRUE(r.passed) << r.first_failure;
  }
  for (size_t i : {LinearData::kX, LinearData::kW, LinearData::kB, LinearData::kDy, LinearData::kPre})
    EXPECT_TRUE(same_bytes(bw[i], *d.all()[i])) << "input " << i << " changed";
  EXPECT_TRUE(cs.want_gi || same_bytes(bw[LinearData::kGi], d.gi)) << "grad_input written though absent";
  EXPECT_TRUE(cs.want_gw || same_bytes(bw[LinearData::kGw], d.gw)) << "grad_weight written though absent";
  EXPECT_TRUE(cs.want_gb || same_bytes(bw[LinearData::kGb], d.gb)) << "grad_bias written though absent";
}

// The fp8 sweep: every activation, odd sizes, pre kept and recomputed, padded rows, a bias or none.
inline std::vector<LinearCase> fp8_cases(DType dtype, LinearVariant variant) {
  std::vector<LinearCase> out;
  const std::vector<std::pair<int64_t, int64_t>> kn = {{1, 1}, {5, 67}, {67, 130}, {130, 64}, {200, 136}};
  int i = 0;
  for (Activation act : {Activation::kNone, Activation::kRelu, Activation::kGeluErf, Activation::kGeluTanh, Activation::kSilu})
    for (int64_t m : {1, 37, 131})
      for (const auto& [k, n] : kn) {
        LinearCase c;
        c.dtype = dtype, c.variant = variant, c.act = act, c.lead = {m}, c.k = k, c.n = n;
        c.keep_pre = i % 2 == 0;
        c.bias = (i % 3) != 2;
        c.pad = (i % 4 == 1) ? 3 : 0;
        c.fp8 = true;
        ++i;
        out.push_back(c);
      }
  return out;
}

}  // namespace optimized::testing
