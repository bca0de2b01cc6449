// Shared machinery of the fused-family tests (test_fused_cpu, test_fused_cuda, test_fused_errors).
//
// A FusedCase describes one call: op (with the GELU form), forward or backward, dtype, variant,
// device, (rows, width), row padding, view offset, 1-D views, in place, which optional operands
// are present, eps / scale, threads, stream. FusedOperands builds every operand of the call in its
// own host buffer: the view's elements hold fresh random values drawn for the op (seeded from the
// test's name, so a failure reproduces), everything else (row padding, the offset before the view
// and a guard zone after it) is NaN. Outputs are NaN everywhere. run_fused() calls the public API
// (on copies, or on device copies for CUDA) and check_fused() compares every output element with
// the float64 reference (fused_reference_f64), checks that no byte outside an output's view
// changed and that no input changed at all.
//
// ---- The tolerance rule -----------------------------------------------------------------------
// Every element of every output must satisfy
//
//     |out - ref| <= c1 * u_out * |ref|  +  c2 * u_c * (sqrt(n) * S + E)  +  floor
//
//   u_out   unit roundoff of the output's dtype (fp32 2^-24, fp16 2^-11, bf16 2^-8, fp64 2^-53;
//           mean / rstd are fp32): the one rounding of the result. c1 = 2.
//   u_c     unit roundoff of the math (2^-24: fp32 math for fp32/fp16/bf16; 2^-53 for fp64, except
//           the norms' backward, which reads the fp32 mean / rstd the forward saved: 2^-24). c2 = 8.
//   n, S    a sum of n terms computed in floating point is off by about u_c * sqrt(n) times the
//           size of its partial sums (random-walk rounding, any summation order), and partial
//           sums are bounded by S = sum |terms|. For a mean divided by n this is the row's typical
//           term magnitude: sqrt(n) * mean|t| -- e.g. sqrt(width) * mean|h| for layer_norm's mean.
//           Per op, S is that bound carried through to the element (below). Sums over rows
//           (dweight, dbias) use n = rows.
//   E       the element's own non-summed rounding: a handful of fp32 operations, each off by u_c
//           relative to the values it touches (|s_j| and |max| feed softmax's exp, |z| GELU's).
//   floor   the output's smallest meaningful magnitude (fp16 2^-24, its subnormal spacing; fp32 and
//           bf16 2^-126, FLT_MIN, as GPUs may flush fp32 subnormals; fp64 2^-1022).
// Per op (per row; w = weight or 1, b = bias or 0, xhat = (h - mean) * rstd, g = dy * w):
//   softmax       S = |y_j| (sum of e normalized by the sum), E = |y_j| (1 + |s_j| + |max|)
//   log_softmax   S = 1, E = 1 + |s_j| + |max| + |lse|
//   softmax bwd   S = |scale y_j| sum|dy y|, E = |scale y_j| (|dy_j| + |sum dy y|)
//   log_sm bwd    S = |scale| e^y_j sum|dy|, E = |scale| (|dy_j| + e^y_j |sum dy| (1 + |y_j|))
//   layer_norm    S = (|xhat_j| + mean|h| rstd) |w_j|,  E = |xhat_j w_j| + |b_j|
//   rms_norm      S = E = |xhat_j w_j|
//   norm bwd      S = rstd (mean|g| + |xhat_j| mean(|g| K)), E = rstd (|g_j| + |mean g| + K_j |mean(g xhat)|)
//                 + |dres_j|, with K = |xhat| + |mean| rstd + 1 (the saved fp32 mean / rstd and
//                 h - mean carry u_c relative error into xhat)
//   mean          S = mean|h|, E = |mean|;   rstd: S = rstd, E = rstd
//   dweight       n = rows, S = sum_r |dy xhat|, E = sum_r |dy| K;  dbias (norms) S = sum_r |dy|
//   bias_gelu     S = 0, E = |z| (1 + 1.13 + |z| + 0.05 |z|^3)  (z = x + bias rounded to fp32, times
//                 max |gelu'| = 1.13; the erf / tanh evaluation; the tanh form's cubic argument)
//   gelu bwd      E = |dy| (1 + |z|)^3;  dbias: n = rows, S = sum_r |dx|, E = sum_r of dx's E
//   silu_and_mul  E = |y| (2 + |a|);  bwd: E_da = |dy b| sigmoid(a) (1 + |a|) (2 + |a|), E_db = |db| (2 + |a|)
// The add forms round h = x + residual to the dtype before normalizing (fused.h) while the
// reference does not: that one rounding, u_out |h_j|, carried through the normalization, is added
// (layer_norm: u_out rstd |w_j| (|h_j| + mean|h| + |xhat_j| mean(|xhat| |h|)); rms_norm: 2 u_out |y_j|;
// residual_out: c1 u_out |h_j| + u_c |h_j|, the fp32 add and its rounding; the statistics: the same
// carried into mean and rstd).
// NaN must be output where the reference is NaN, and an infinite reference matched exactly.
//
// The bound is a statistical one (far from the worst case n * u_c) and tight enough to catch real
// bugs: test_fused_cpu's ToleranceCatches* tests feed it outputs with a missing eps, a mean over
// n - 1, an rms_norm mean square over n - 1, a softmax sum short of one term, a layer_norm backward
// without its mean(g) term, the wrong GELU form and a dweight short of one row, and expect a
// failure for each dtype where the bug is larger than the dtype's rounding.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iomanip>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fused/fused_params.h"
#include "fused/fused_reference.h"
#include "optimized/buffer.h"
#include "optimized/core.h"
#include "optimized/fused.h"

#if OPTIMIZED_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace optimized::testing {

// ---- random inputs ----------------------------------------------------------------------------

// A generator seeded from the running test's full name and a per-call counter: every test gets
// its own fresh inputs, and a failure reproduces exactly.
inline std::mt19937_64 fused_rng() {
  static std::string last_test;
  static uint64_t counter = 0;
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "none";
  if (name != last_test) {
    last_test = name;
    counter = 0;
  }
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char ch : name) h = (h ^ ch) * 1099511628211ull;
  h ^= 0x9e3779b97f4a7c15ull * ++counter;
  return std::mt19937_64(h);
}

// ---- dtypes -----------------------------------------------------------------------------------

inline double out_roundoff(DType d) {
  switch (d) {
    case DType::kF16: return std::ldexp(1.0, -11);
    case DType::kBF16: return std::ldexp(1.0, -8);
    case DType::kF64: return std::ldexp(1.0, -53);
    default: return std::ldexp(1.0, -24);
  }
}
inline double math_roundoff(DType d) { return d == DType::kF64 ? std::ldexp(1.0, -53) : std::ldexp(1.0, -24); }
inline double out_floor(DType d) {
  switch (d) {
    case DType::kF16: return std::ldexp(1.0, -24);
    case DType::kF64: return std::ldexp(1.0, -1022);
    default: return std::ldexp(1.0, -126);
  }
}
constexpr double kC1 = 2.0;  // roundings of the result
constexpr double kC2 = 8.0;  // fp32 math

// ---- the case ---------------------------------------------------------------------------------

// Operands of a call, by role. Inputs first, then outputs.
enum Role : int { kX, kResidual, kWeight, kBias, kMean, kRstd, kDy, kDres, kY, kResidualOut, kDx, kDweight, kDbias, kRoles };

inline const char* role_name(Role r, bool softmax_backward = false) {
  switch (r) {
    case kX: return softmax_backward ? "y (forward output)" : "x";
    case kResidual: return "residual";
    case kWeight: return "weight";
    case kBias: return "bias";
    case kMean: return "mean";
    case kRstd: return "rstd";
    case kDy: return "dy";
    case kDres: return "dresidual_out";
    case kY: return "y";
    case kResidualOut: return "residual_out";
    case kDx: return "dx";
    case kDweight: return "dweight";
    case kDbias: return "dbias";
    case kRoles: break;
  }
  return "?";
}

inline bool is_add(FusedOp op) { return op == FusedOp::kAddLayerNorm || op == FusedOp::kAddRmsNorm; }
inline bool is_layer(FusedOp op) { return op == FusedOp::kLayerNorm || op == FusedOp::kAddLayerNorm; }
inline bool is_norm(FusedOp op) { return is_layer(op) || op == FusedOp::kRmsNorm || op == FusedOp::kAddRmsNorm; }
inline bool is_softmax(FusedOp op) { return op == FusedOp::kSoftmax || op == FusedOp::kLogSoftmax; }
inline bool reduces(FusedOp op) { return is_softmax(op) || is_norm(op); }

// The op as the tests enumerate it: bias_gelu comes in its two forms.
struct OpSpec {
  FusedOp op = FusedOp::kSoftmax;
  GeluApproximation gelu = GeluApproximation::kNone;
};

inline std::vector<OpSpec> all_op_specs() {
  std::vector<OpSpec> out;
  for (FusedOp op : all_fused_ops()) {
    out.push_back({op, GeluApproximation::kNone});
    if (op == FusedOp::kBiasGelu) out.push_back({op, GeluApproximation::kTanh});
  }
  return out;
}

inline std::string op_label(const OpSpec& s) {
  std::string name(fused_op_name(s.op));
  if (s.op == FusedOp::kBiasGelu) name += s.gelu == GeluApproximation::kTanh ? "_tanh" : "_erf";
  return name;
}

struct FusedCase {
  FusedOp op = FusedOp::kSoftmax;
  GeluApproximation gelu = GeluApproximation::kNone;
  bool backward = false;
  DType dtype = DType::kF32;
  FusedVariant variant = FusedVariant::kCpu;
  Device device = Device::cpu();
  int64_t rows = 1, width = 1;  // width: the normalized length (silu_and_mul: d; x holds 2d)
  int64_t pad = 0;              // row stride = row length + pad, on every (rows, *) operand
  int64_t offset = 0;           // elements from the (256-byte aligned) buffer start to every view
  bool one_d = false;           // rank-1 views of the row operands (rows must be 1)
  bool in_place = false;        // forward: y is x (add forms: residual_out is residual); backward: dx is dy
  bool with_weight = true, with_bias = true;  // optional inputs present (norms, bias_gelu)
  bool with_stats = true;                      // forward norms: mean / rstd written
  bool with_dweight = true, with_dbias = true;  // backward: those gradients wanted
  double eps = 1e-5;   // as the API takes them (double; fp32 math rounds them once)
  double scale = 1.0;
  int cpu_threads = 0;
  void* stream = nullptr;  // cudaStream_t for CUDA runs (nullptr: the legacy default stream)
  bool backend_direct = false;  // CPU: call cpu_fused on FusedParams, bypassing the API's checks

  OpSpec spec() const { return {op, gelu}; }
  int64_t x_cols() const { return op == FusedOp::kSiluAndMul ? 2 * width : width; }

  std::string describe() const {
    std::ostringstream s;
    s << op_label(spec()) << (backward ? " backward " : " forward ") << dtype_name(dtype) << " "
      << fused_variant_name(variant) << " on " << device_name(device) << " rows=" << rows << " width=" << width;
    if (pad) s << " pad=" << pad;
    if (offset) s << " offset=" << offset;
    if (one_d) s << " 1-D";
    if (in_place) s << " in-place";
    if (!with_weight) s << " no-weight";
    if (!with_bias) s << " no-bias";
    if (!with_stats) s << " no-stats";
    if (!with_dweight) s << " no-dweight";
    if (!with_dbias) s << " no-dbias";
    if (eps != 1e-5) s << " eps=" << eps;
    if (scale != 1.0) s << " scale=" << std::setprecision(17) << scale << std::setprecision(6);
    if (cpu_threads) s << " threads=" << cpu_threads;
    if (stream) s << " (own stream)";
    if (backend_direct) s << " (cpu_fused directly)";
    return s.str();
  }
};

// Storage of one operand: (rows, cols) with rows `ld` apart, `offset` elements into a buffer that
// ends with a guard zone.
struct Layout {
  int64_t rows = 0, cols = 0, ld = 0, offset = 0;
  static constexpr int64_t kGuard = 67;
  int64_t storage() const { return offset + rows * ld + kGuard; }
  int64_t index(int64_t i, int64_t j) const { return offset + i * ld + j; }
  int64_t count() const { return rows * cols; }
  std::vector<char> mask() const {
    std::vector<char> m(static_cast<size_t>(storage()), 0);
    for (int64_t i = 0; i < rows; ++i)
      if (cols > 0) std::memset(&m[static_cast<size_t>(index(i, 0))], 1, static_cast<size_t>(cols));
    return m;
  }
};

struct Operand {
  bool present = false;
  bool output = false;
  bool row_operand = false;  // (rows, *): viewed 2-D (or 1-D when the case says so)
  int owner = -1;            // the role whose buffer it uses (itself, or the input it overwrites)
  DType dtype = DType::kF32;
  Layout layout;
  Buffer host;  // valid when owner is this role
};

// Every operand of one case, on the host, filled and poisoned.
class FusedOperands {
 public:
  FusedCase cs;
  std::array<Operand, kRoles> ops;

  explicit FusedOperands(const FusedCase& c) : cs(c) {
    const int64_t R = c.rows, W = c.width, XC = c.x_cols();
    const bool fwd = !c.backward, add = is_add(c.op), layer = is_layer(c.op), norm = is_norm(c.op);
    auto rows_op = [&](Role r, int64_t cols, bool output) {
      Operand& o = ops[r];
      o.present = true;
      o.output = output;
      o.row_operand = true;
      o.dtype = c.dtype;
      o.layout = {R, cols, cols + c.pad, c.offset};
    };
    auto vec_op = [&](Role r, int64_t n, DType dtype, bool output) {
      Operand& o = ops[r];
      o.present = true;
      o.output = output;
      o.dtype = dtype;
      o.layout = {1, n, n, c.offset};
    };
    rows_op(kX, XC, false);
    if (fwd) {
      if (add) rows_op(kResidual, W, false);
      if (norm && c.with_weight) vec_op(kWeight, W, c.dtype, false);
      if ((layer || c.op == FusedOp::kBiasGelu) && c.with_bias) vec_op(kBias, W, c.dtype, false);
      rows_op(kY, W, true);
      if (add) rows_op(kResidualOut, W, true);
      if (layer && c.with_stats) vec_op(kMean, R, DType::kF32, true);
      if (norm && c.with_stats) vec_op(kRstd, R, DType::kF32, true);
    } else {
      rows_op(kDy, W, false);
      if (norm && c.with_weight) vec_op(kWeight, W, c.dtype, false);
      if (c.op == FusedOp::kBiasGelu && c.with_bias) vec_op(kBias, W, c.dtype, false);
      if (layer) vec_op(kMean, R, DType::kF32, false);
      if (norm) vec_op(kRstd, R, DType::kF32, false);
      if (add) rows_op(kDres, W, false);
      rows_op(kDx, XC, true);
      if (norm && c.with_weight && c.with_dweight) vec_op(kDweight, W, c.dtype, true);
      if ((layer || c.op == FusedOp::kBiasGelu) && c.with_dbias) vec_op(kDbias, W, c.dtype, true);
    }
    for (int r = 0; r < kRoles; ++r) ops[r].owner = r;
    if (c.in_place) {
      if (fwd) {
        ops[kY].owner = kX;
        if (add) ops[kResidualOut].owner = kResidual;
      } else {
        ops[kDx].owner = kDy;
      }
    }
    std::mt19937_64 rng = fused_rng();
    for (int r = 0; r < kRoles; ++r) {
      Operand& o = ops[r];
      if (!o.present || o.owner != r) continue;
      o.host = Buffer(o.dtype, o.layout.storage(), Device::cpu());
      o.host.fill_bytes(0xFF);  // NaN: outputs unwritten, inputs read outside their views, show up
    }
    fill_inputs(rng);
  }

  Operand& op(Role r) { return ops[r]; }
  const Operand& op(Role r) const { return ops[r]; }
  bool has(Role r) const { return ops[r].present; }
  const Buffer& storage(Role r) const { return ops[ops[r].owner].host; }
  double get(Role r, int64_t i, int64_t j) const {
    return load_as_double(storage(r).data(), ops[r].dtype, ops[r].layout.index(i, j));
  }
  void set(Role r, int64_t i, int64_t j, double v) {
    store_from_double(ops[ops[r].owner].host.data(), ops[r].dtype, ops[r].layout.index(i, j), v);
  }
  // Pointer to element (0, 0) of role r's view inside `base` (that role's buffer, or a copy).
  void* at(Role r, void* base) const {
    return static_cast<char*>(base) + ops[r].layout.offset * static_cast<int64_t>(dtype_size(ops[r].dtype));
  }

  // The params the reference reads: host pointers into the (pristine) input buffers.
  FusedParams reference_params() const {
    FusedParams p;
    p.op = cs.op;
    p.backward = cs.backward;
    p.dtype = cs.dtype;
    p.rows = cs.rows;
    p.width = cs.width;
    p.eps = cs.eps;
    p.scale = cs.scale;
    p.gelu = cs.gelu;
    auto ptr = [&](Role r) -> void* { return has(r) ? at(r, storage(r).data()) : nullptr; };
    auto ld = [&](Role r) { return has(r) ? ops[r].layout.ld : 0; };
    p.x = ptr(kX);
    p.ld_x = ld(kX);
    p.residual = ptr(kResidual);
    p.ld_residual = ld(kResidual);
    p.weight = ptr(kWeight);
    p.bias = ptr(kBias);
    p.dy = ptr(kDy);
    p.ld_dy = ld(kDy);
    p.dresidual_out = ptr(kDres);
    p.ld_dresidual_out = ld(kDres);
    // A backward add form is the plain norm's backward plus dresidual_out: same reference.
    return p;
  }

  // The params of the call itself over storage `bases` (as fused.cpp would fill them).
  FusedParams call_params(const std::array<void*, kRoles>& bases) const {
    FusedParams p = reference_params();
    auto ptr = [&](Role r) -> void* { return has(r) ? at(r, bases[static_cast<size_t>(ops[r].owner)]) : nullptr; };
    auto ld = [&](Role r) { return has(r) ? ops[r].layout.ld : 0; };
    p.x = ptr(kX);
    p.residual = ptr(kResidual);
    p.weight = ptr(kWeight);
    p.bias = ptr(kBias);
    p.dy = ptr(kDy);
    p.dresidual_out = ptr(kDres);
    p.y = ptr(kY);
    p.ld_y = ld(kY);
    p.residual_out = ptr(kResidualOut);
    p.ld_residual_out = ld(kResidualOut);
    p.mean = static_cast<float*>(ptr(kMean));
    p.rstd = static_cast<float*>(ptr(kRstd));
    p.dx = ptr(kDx);
    p.ld_dx = ld(kDx);
    p.dweight = ptr(kDweight);
    p.dbias = ptr(kDbias);
    return p;
  }

  // Backward norms: the saved mean / rstd are the float64 statistics of h, rounded to fp32 (what
  // an exact forward would have saved). Called again after a test edits h.
  void refresh_stats() {
    if (!cs.backward || !is_norm(cs.op)) return;
    FusedParams p = reference_params();
    p.backward = false;
    p.op = is_layer(cs.op) ? FusedOp::kLayerNorm : FusedOp::kRmsNorm;  // stats of h itself
    p.residual = nullptr;
    const FusedReference f = fused_reference_f64(p);
    for (int64_t r = 0; r < cs.rows; ++r) {
      if (has(kMean)) set(kMean, 0, r, static_cast<float>(f.mean[static_cast<size_t>(r)]));
      set(kRstd, 0, r, static_cast<float>(f.rstd[static_cast<size_t>(r)]));
    }
  }

 private:
  void fill_uniform(Role r, std::mt19937_64& rng, double lo, double hi) {
    if (!has(r)) return;
    std::uniform_real_distribution<double> u(lo, hi);
    const Layout& l = ops[r].layout;
    for (int64_t i = 0; i < l.rows; ++i)
      for (int64_t j = 0; j < l.cols; ++j) set(r, i, j, u(rng));
  }

  void fill_inputs(std::mt19937_64& rng) {
    const FusedOp op = cs.op;
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    const Layout& lx = ops[kX].layout;
    if (is_softmax(op)) {
      if (!cs.backward) {
        fill_uniform(kX, rng, -4.0, 4.0);
      } else {
        // y must be a softmax (log_softmax) output: of random logits, rounded to the dtype.
        std::vector<double> s(static_cast<size_t>(lx.cols));
        for (int64_t i = 0; i < lx.rows; ++i) {
          double m = -INFINITY, total = 0;
          for (double& e : s) m = std::max(m, e = 4.0 * u(rng));
          for (double e : s) total += std::exp(e - m);
          for (int64_t j = 0; j < lx.cols; ++j) {
            const double e = s[static_cast<size_t>(j)] - m;
            set(kX, i, j, op == FusedOp::kLogSoftmax ? e - std::log(total) : std::exp(e) / total);
          }
        }
      }
    } else if (is_norm(op)) {
      // Rows with an offset and an amplitude of their own: a mean far from 0 (a wrong mean shows;
      // one-pass variance cancels), variances above and below eps.
      std::uniform_real_distribution<double> offset(-2.0, 2.0), log_amp(std::log(0.05), std::log(4.0));
      for (int64_t i = 0; i < lx.rows; ++i) {
        const double o = offset(rng), a = std::exp(log_amp(rng));
        for (int64_t j = 0; j < lx.cols; ++j) set(kX, i, j, o + a * u(rng));
      }
      fill_uniform(kResidual, rng, -1.0, 1.0);
      fill_uniform(kWeight, rng, -2.0, 2.0);
      fill_uniform(kBias, rng, -1.0, 1.0);
    } else if (op == FusedOp::kBiasGelu) {
      fill_uniform(kX, rng, -4.0, 4.0);
      fill_uniform(kBias, rng, -1.0, 1.0);
    } else {
      fill_uniform(kX, rng, -5.0, 5.0);
    }
    fill_uniform(kDy, rng, -1.0, 1.0);
    fill_uniform(kDres, rng, -1.0, 1.0);
    refresh_stats();
  }
};

// ---- expected outputs: the reference and the allowed error per element ----------------------

struct Expected {
  std::array<std::vector<double>, kRoles> ref, allowed;  // per output role, in (rows, cols) order
};

inline Expected expected_outputs(const FusedOperands& o) {
  const FusedCase& cs = o.cs;
  const FusedReference f = fused_reference_f64(o.reference_params());
  Expected e;
  const int64_t R = cs.rows, W = cs.width;
  const double ud = out_roundoff(cs.dtype), uc = math_roundoff(cs.dtype), fl = out_floor(cs.dtype);
  const double u32 = out_roundoff(DType::kF32), fl32 = out_floor(DType::kF32);
  const double sn = std::sqrt(static_cast<double>(W)), sr = std::sqrt(static_cast<double>(R));
  auto fin = [](double v) { return std::isfinite(v) ? std::fabs(v) : 0.0; };
  // The norms' backward reads fp32 statistics whatever the dtype: fp32 accuracy at best.
  const double um = cs.backward && is_norm(cs.op) ? std::max(uc, u32) : uc;
  auto bound = [&](double ref, double s_sum, double e_own, double u_out, double floor, double extra = 0) {
    return kC1 * u_out * fin(ref) + kC2 * um * (s_sum + e_own) + extra + floor;
  };
  auto w_at = [&](int64_t j) { return o.has(kWeight) ? o.get(kWeight, 0, j) : 1.0; };
  auto b_at = [&](int64_t j) { return o.has(kBias) ? o.get(kBias, 0, j) : 0.0; };
  auto sized = [&](Role r, size_t n) {
    e.ref[r].assign(n, 0.0);
    e.allowed[r].assign(n, 0.0);
  };
  const FusedOp op = cs.op;
  const size_t RW = static_cast<size_t>(R * W);

  if (is_softmax(op) && !cs.backward) {
    sized(kY, RW);
    e.ref[kY] = f.y;
    for (int64_t i = 0; i < R; ++i) {
      double m = -INFINITY, total = 0;
      for (int64_t j = 0; j < W; ++j) m = std::max(m, cs.scale * o.get(kX, i, j));
      for (int64_t j = 0; j < W; ++j) total += std::exp(cs.scale * o.get(kX, i, j) - m);
      const double lse = std::log(total);
      for (int64_t j = 0; j < W; ++j) {
        const size_t k = static_cast<size_t>(i * W + j);
        const double y = f.y[k], s = fin(cs.scale * o.get(kX, i, j));
        const double own = 1 + s + fin(m);
        e.allowed[kY][k] = op == FusedOp::kSoftmax ? bound(y, sn * fin(y), fin(y) * own, ud, fl)
                                                   : bound(y, sn, own + fin(lse), ud, fl);
      }
    }
  } else if (is_softmax(op)) {
    sized(kDx, RW);
    e.ref[kDx] = f.dx;
    const double sc = std::fabs(cs.scale);
    for (int64_t i = 0; i < R; ++i) {
      double dot = 0, adot = 0, sdy = 0, asdy = 0;
      for (int64_t j = 0; j < W; ++j) {
        const double y = o.get(kX, i, j), dy = o.get(kDy, i, j);
        dot += dy * y;
        adot += std::fabs(dy * y);
        sdy += dy;
        asdy += std::fabs(dy);
      }
      for (int64_t j = 0; j < W; ++j) {
        const size_t k = static_cast<size_t>(i * W + j);
        const double y = o.get(kX, i, j), dy = std::fabs(o.get(kDy, i, j));
        if (op == FusedOp::kSoftmax) {
          e.allowed[kDx][k] = bound(f.dx[k], sc * fin(y) * sn * adot, sc * fin(y) * (dy + std::fabs(dot)), ud, fl);
        } else {
          const double ey = std::exp(y);
          e.allowed[kDx][k] = bound(f.dx[k], sc * ey * sn * asdy, sc * (dy + ey * std::fabs(sdy) * (1 + fin(y))), ud, fl);
        }
      }
    }
  } else if (is_norm(op) && !cs.backward) {
    const bool layer = is_layer(op), add = is_add(op);
    sized(kY, RW);
    e.ref[kY] = f.y;
    if (add) {
      sized(kResidualOut, RW);
      e.ref[kResidualOut] = f.residual_out;
    }
    if (o.has(kMean)) {
      sized(kMean, static_cast<size_t>(R));
      e.ref[kMean] = f.mean;
    }
    if (o.has(kRstd)) {
      sized(kRstd, static_cast<size_t>(R));
      e.ref[kRstd] = f.rstd;
    }
    for (int64_t i = 0; i < R; ++i) {
      const double mean = layer ? f.mean[static_cast<size_t>(i)] : 0.0, rstd = f.rstd[static_cast<size_t>(i)];
      double m1 = 0, mxh = 0;  // mean|h|, mean(|xhat| |h|)
      for (int64_t j = 0; j < W; ++j) {
        const double h = add ? f.residual_out[static_cast<size_t>(i * W + j)] : o.get(kX, i, j);
        m1 += std::fabs(h) / W;
        mxh += std::fabs((h - mean) * rstd * h) / W;
      }
      for (int64_t j = 0; j < W; ++j) {
        const size_t k = static_cast<size_t>(i * W + j);
        const double h = add ? f.residual_out[k] : o.get(kX, i, j);
        const double xhat = (h - mean) * rstd, w = std::fabs(w_at(j));
        if (layer) {
          const double h_round = add ? ud * rstd * w * (std::fabs(h) + m1 + std::fabs(xhat) * mxh) : 0.0;
          e.allowed[kY][k] = bound(f.y[k], sn * (std::fabs(xhat) + m1 * rstd) * w,
                                   std::fabs(xhat) * w + std::fabs(b_at(j)), ud, fl, h_round);
        } else {
          const double h_round = add ? 2 * ud * fin(f.y[k]) : 0.0;
          e.allowed[kY][k] = bound(f.y[k], sn * std::fabs(xhat) * w, std::fabs(xhat) * w, ud, fl, h_round);
        }
        if (add) e.allowed[kResidualOut][k] = kC1 * ud * std::fabs(h) + uc * std::fabs(h) + fl;
      }
      const size_t r = static_cast<size_t>(i);
      if (o.has(kMean))
        e.allowed[kMean][r] = bound(mean, sn * m1, std::fabs(mean), u32, fl32, add ? kC1 * ud * m1 : 0.0);
      if (o.has(kRstd)) {
        const double h_round = add ? kC1 * ud * rstd * (layer ? rstd * mxh : 1.0) : 0.0;
        e.allowed[kRstd][r] = bound(rstd, sn * rstd, rstd, u32, fl32, h_round);
      }
    }
  } else if (is_norm(op)) {
    const bool layer = is_layer(op);
    sized(kDx, RW);
    e.ref[kDx] = f.dx;
    if (o.has(kDweight)) {
      sized(kDweight, static_cast<size_t>(W));
      e.ref[kDweight] = f.dweight;
    }
    if (o.has(kDbias)) {
      sized(kDbias, static_cast<size_t>(W));
      e.ref[kDbias] = f.dbias;
    }
    std::vector<double> dw_s(static_cast<size_t>(W), 0.0), dw_e(static_cast<size_t>(W), 0.0),
        db_s(static_cast<size_t>(W), 0.0);
    for (int64_t i = 0; i < R; ++i) {
      const double mean = layer ? f.mean[static_cast<size_t>(i)] : 0.0, rstd = f.rstd[static_cast<size_t>(i)];
      double mg = 0, mgx = 0, g1 = 0, gk = 0;
      for (int64_t j = 0; j < W; ++j) {
        const double xhat = (o.get(kX, i, j) - mean) * rstd, g = o.get(kDy, i, j) * w_at(j);
        const double kk = std::fabs(xhat) + std::fabs(mean) * rstd + 1;
        mg += g / W;
        mgx += g * xhat / W;
        g1 += std::fabs(g) / W;
        gk += std::fabs(g) * kk / W;
      }
      if (!layer) mg = 0;
      for (int64_t j = 0; j < W; ++j) {
        const size_t k = static_cast<size_t>(i * W + j);
        const double dy = o.get(kDy, i, j), xhat = (o.get(kX, i, j) - mean) * rstd;
        const double kk = std::fabs(xhat) + std::fabs(mean) * rstd + 1, g = std::fabs(dy * w_at(j));
        const double dres = o.has(kDres) ? std::fabs(o.get(kDres, i, j)) : 0.0;
        e.allowed[kDx][k] = bound(f.dx[k], sn * rstd * (g1 + std::fabs(xhat) * gk),
                                  rstd * (g + std::fabs(mg) + kk * std::fabs(mgx)) + dres, ud, fl);
        dw_s[static_cast<size_t>(j)] += std::fabs(dy * xhat);
        dw_e[static_cast<size_t>(j)] += std::fabs(dy) * kk;
        db_s[static_cast<size_t>(j)] += std::fabs(dy);
      }
    }
    for (int64_t j = 0; j < W; ++j) {
      const size_t k = static_cast<size_t>(j);
      if (o.has(kDweight)) e.allowed[kDweight][k] = bound(f.dweight[k], sr * dw_s[k], dw_e[k], ud, fl);
      if (o.has(kDbias)) e.allowed[kDbias][k] = bound(f.dbias[k], sr * db_s[k], 0.0, ud, fl);
    }
  } else if (op == FusedOp::kBiasGelu) {
    const Role out = cs.backward ? kDx : kY;
    sized(out, RW);
    e.ref[out] = cs.backward ? f.dx : f.y;
    if (o.has(kDbias)) {
      sized(kDbias, static_cast<size_t>(W));
      e.ref[kDbias] = f.dbias;
    }
    std::vector<double> db_s(static_cast<size_t>(W), 0.0), db_e(static_cast<size_t>(W), 0.0);
    for (int64_t i = 0; i < R; ++i)
      for (int64_t j = 0; j < W; ++j) {
        const size_t k = static_cast<size_t>(i * W + j);
        const double z = std::fabs(o.get(kX, i, j) + b_at(j));
        if (!cs.backward) {
          // |gelu'(z)| <= 1.13: a constant bound keeps the derivative out of this file.
          e.allowed[kY][k] = bound(f.y[k], 0.0, fin(z) * (1 + 1.13 + fin(z) + 0.05 * fin(z * z * z)), ud, fl);
        } else {
          const double own = std::fabs(o.get(kDy, i, j)) * fin((1 + z) * (1 + z) * (1 + z));
          e.allowed[kDx][k] = bound(f.dx[k], 0.0, own, ud, fl);
          db_s[static_cast<size_t>(j)] += fin(f.dx[k]);
          db_e[static_cast<size_t>(j)] += own;
        }
      }
    if (o.has(kDbias))
      for (int64_t j = 0; j < W; ++j) {
        const size_t k = static_cast<size_t>(j);
        e.allowed[kDbias][k] = bound(f.dbias[k], sr * db_s[k], db_e[k], ud, fl);
      }
  } else {  // silu_and_mul
    if (!cs.backward) {
      sized(kY, RW);
      e.ref[kY] = f.y;
      for (int64_t i = 0; i < R; ++i)
        for (int64_t j = 0; j < W; ++j) {
          const size_t k = static_cast<size_t>(i * W + j);
          e.allowed[kY][k] = bound(f.y[k], 0.0, fin(f.y[k]) * (2 + fin(o.get(kX, i, j))), ud, fl);
        }
    } else {
      sized(kDx, static_cast<size_t>(R * 2 * W));
      e.ref[kDx] = f.dx;
      for (int64_t i = 0; i < R; ++i)
        for (int64_t j = 0; j < W; ++j) {
          const double a = o.get(kX, i, j), b = o.get(kX, i, W + j), dy = o.get(kDy, i, j);
          const double sig = 1.0 / (1.0 + std::exp(-a)), aa = fin(a);
          const size_t ka = static_cast<size_t>(i * 2 * W + j), kb = ka + static_cast<size_t>(W);
          e.allowed[kDx][ka] = bound(f.dx[ka], 0.0, fin(dy * b) * sig * (1 + aa) * (2 + aa), ud, fl);
          e.allowed[kDx][kb] = bound(f.dx[kb], 0.0, fin(f.dx[kb]) * (2 + aa), ud, fl);
        }
    }
  }
  return e;
}

// ---- comparing ----------------------------------------------------------------------------------

struct OutputCheck {
  int64_t checked = 0, failures = 0;
  double worst_ratio = 0;  // max error / allowed over finite elements (<= 1 passes)
  std::string first_failure;
};

// values[k] against ref[k] within allowed[k]: NaN where the reference is NaN, an infinite
// reference matched exactly, otherwise within the bound (a NaN output fails).
inline OutputCheck compare(const std::string& name, int64_t cols, const std::vector<double>& values,
                           const std::vector<double>& ref, const std::vector<double>& allowed) {
  OutputCheck c;
  for (size_t k = 0; k < ref.size(); ++k) {
    const double v = values[k], r = ref[k];
    ++c.checked;
    bool ok;
    double err = 0;
    if (std::isnan(r)) {
      ok = std::isnan(v);
    } else if (std::isinf(r)) {
      ok = v == r;
    } else {
      err = std::fabs(v - r);
      ok = err <= allowed[k];  // false for NaN
      if (std::isfinite(v) && allowed[k] > 0) c.worst_ratio = std::max(c.worst_ratio, err / allowed[k]);
    }
    if (!ok && c.failures++ == 0) {
      std::ostringstream s;
      s.precision(9);
      s << name << "[" << static_cast<int64_t>(k) / cols << ", " << static_cast<int64_t>(k) % cols << "] = " << v
        << ", expected " << r << " (error " << err << ", allowed " << allowed[k] << ")";
      c.first_failure = s.str();
    }
  }
  return c;
}

// The values of output role r of a run, read from its storage, in (rows, cols) order.
inline std::vector<double> read_output(const FusedOperands& o, Role r, const Buffer& storage) {
  const Operand& op = o.op(r);
  std::vector<double> v(static_cast<size_t>(op.layout.count()));
  for (int64_t i = 0; i < op.layout.rows; ++i)
    for (int64_t j = 0; j < op.layout.cols; ++j)
      v[static_cast<size_t>(i * op.layout.cols + j)] = load_as_double(storage.data(), op.dtype, op.layout.index(i, j));
  return v;
}

// ---- running ------------------------------------------------------------------------------------

// A view of role r's storage at `base` on `device`.
inline TensorView view_of(const FusedOperands& o, Role r, void* base, Device device) {
  const Operand& op = o.op(r);
  if (!op.present) return TensorView{};
  void* data = o.at(r, base);
  if (!op.row_operand) return TensorView(data, op.dtype, device, {op.layout.cols}, {1});
  if (o.cs.one_d) return TensorView(data, op.dtype, device, {op.layout.cols}, {1});
  return TensorView(data, op.dtype, device, {op.layout.rows, op.layout.cols}, {op.layout.ld, 1});
}

// Calls the public API for the case on the operand storage `bases` (per role; in-place outputs
// point at their input's storage) on `device`.
inline void call_fused(const FusedOperands& o, const std::array<void*, kRoles>& bases, Device device,
                       const ExecutionContext& ctx) {
  const FusedCase& cs = o.cs;
  auto v = [&](Role r) { return view_of(o, r, bases[static_cast<size_t>(o.op(r).owner)], device); };
  const FusedVariant var = cs.variant;
  switch (cs.op) {
    case FusedOp::kSoftmax:
    case FusedOp::kLogSoftmax: {
      const bool log = cs.op == FusedOp::kLogSoftmax;
      if (!cs.backward) softmax_forward(v(kX), v(kY), cs.scale, log, var, ctx);
      else softmax_backward(v(kX), v(kDy), v(kDx), cs.scale, log, var, ctx);
      return;
    }
    case FusedOp::kLayerNorm:
    case FusedOp::kAddLayerNorm:
      if (!cs.backward)
        layer_norm_forward(v(kX), v(kResidual), v(kWeight), v(kBias), cs.eps, v(kY), v(kResidualOut), v(kMean),
                           v(kRstd), var, ctx);
      else
        layer_norm_backward(v(kDy), v(kX), v(kWeight), v(kMean), v(kRstd), v(kDres), v(kDx), v(kDweight), v(kDbias),
                            var, ctx);
      return;
    case FusedOp::kRmsNorm:
    case FusedOp::kAddRmsNorm:
      if (!cs.backward)
        rms_norm_forward(v(kX), v(kResidual), v(kWeight), cs.eps, v(kY), v(kResidualOut), v(kRstd), var, ctx);
      else
        rms_norm_backward(v(kDy), v(kX), v(kWeight), v(kRstd), v(kDres), v(kDx), v(kDweight), var, ctx);
      return;
    case FusedOp::kBiasGelu:
      if (!cs.backward) bias_gelu_forward(v(kX), v(kBias), cs.gelu, v(kY), var, ctx);
      else bias_gelu_backward(v(kDy), v(kX), v(kBias), cs.gelu, v(kDx), v(kDbias), var, ctx);
      return;
    case FusedOp::kSiluAndMul:
      if (!cs.backward) silu_and_mul_forward(v(kX), v(kY), var, ctx);
      else silu_and_mul_backward(v(kDy), v(kX), v(kDx), var, ctx);
      return;
  }
}

struct FusedRun {
  std::array<Buffer, kRoles> after;  // host copy of every owned storage after the call
  bool ok = false;                   // the call returned and (CUDA) synchronized cleanly
  std::string error;
};

// A call over zero rows: no byte of any operand changes, except dweight / dbias, whose views hold
// zeros afterwards (a sum over no rows; fused.h) while their padding and guard stay untouched.
inline void expect_zero_rows_result(const FusedOperands& o, const FusedRun& run) {
  for (int r = 0; r < kRoles; ++r) {
    const Operand& op = o.ops[r];
    if (!op.present || op.owner != r) continue;
    const bool zeroed = r == kDweight || r == kDbias;
    const size_t elem = dtype_size(op.dtype);
    const auto* before = static_cast<const unsigned char*>(op.host.data());
    const auto* after = static_cast<const unsigned char*>(run.after[r].data());
    const size_t first = static_cast<size_t>(op.layout.offset) * elem;
    const size_t last = first + static_cast<size_t>(op.layout.cols) * elem;
    for (size_t b = 0; b < op.host.bytes(); ++b) {
      const bool in_view = zeroed && b >= first && b < last;
      const unsigned char want = in_view ? 0 : before[b];
      if (after[b] != want) {
        ADD_FAILURE() << o.cs.describe() << ": " << role_name(static_cast<Role>(r)) << " byte " << b
                      << (in_view ? " should be 0 (zero-row gradient)" : " changed");
        break;
      }
    }
  }
}

// Runs the case; throws what the API throws. A CUDA error is reported in FusedRun::error.
inline FusedRun run_fused(const FusedOperands& o) {
  const FusedCase& cs = o.cs;
  FusedRun run;
  std::array<void*, kRoles> bases{};
  for (int r = 0; r < kRoles; ++r) {
    if (!o.ops[r].present || o.ops[r].owner != r) continue;
    run.after[r] = Buffer(o.ops[r].dtype, o.ops[r].layout.storage(), Device::cpu());
    std::memcpy(run.after[r].data(), o.ops[r].host.data(), o.ops[r].host.bytes());
    bases[static_cast<size_t>(r)] = run.after[r].data();
  }
  if (!cs.device.is_cuda()) {
    ExecutionContext ctx;
    ctx.cpu_threads = cs.cpu_threads;
    if (cs.backend_direct)
      cpu_fused(o.call_params(bases), cs.cpu_threads);
    else
      call_fused(o, bases, Device::cpu(), ctx);
    run.ok = true;
    return run;
  }
#if OPTIMIZED_WITH_CUDA
  std::array<Buffer, kRoles> dev;
  std::array<void*, kRoles> dbases{};
  cudaError_t e = cudaSuccess;
  auto stream = static_cast<cudaStream_t>(cs.stream);
  for (int r = 0; r < kRoles; ++r) {
    if (!o.ops[r].present || o.ops[r].owner != r) continue;
    dev[r] = Buffer(o.ops[r].dtype, o.ops[r].layout.storage(), cs.device);
    dbases[static_cast<size_t>(r)] = dev[r].data();
  }
  ExecutionContext ctx;
  ctx.cuda_stream = cs.stream;
  if (!stream) {
    for (int r = 0; r < kRoles; ++r)
      if (dbases[static_cast<size_t>(r)]) dev[r].copy_from_host(o.ops[r].host.data());
    call_fused(o, dbases, cs.device, ctx);
    e = cudaDeviceSynchronize();
    for (int r = 0; r < kRoles && e == cudaSuccess; ++r)
      if (dbases[static_cast<size_t>(r)]) dev[r].copy_to_host(run.after[r].data());
  } else {
    // Everything on the caller's (non-blocking) stream behind a 50 ms host callback, the device
    // storage NaN until the stream's copies land: a kernel on any other stream reads NaN.
    for (int r = 0; r < kRoles; ++r)
      if (dbases[static_cast<size_t>(r)]) dev[r].fill_bytes(0xFF);
    e = cudaLaunchHostFunc(stream, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(50)); }, nullptr);
    for (int r = 0; r < kRoles && e == cudaSuccess; ++r)
      if (dbases[static_cast<size_t>(r)])
        e = cudaMemcpyAsync(dev[r].data(), o.ops[r].host.data(), dev[r].bytes(), cudaMemcpyHostToDevice, stream);
    if (e == cudaSuccess) call_fused(o, dbases, cs.device, ctx);
    for (int r = 0; r < kRoles && e == cudaSuccess; ++r)
      if (dbases[static_cast<size_t>(r)])
        e = cudaMemcpyAsync(run.after[r].data(), dev[r].data(), dev[r].bytes(), cudaMemcpyDeviceToHost, stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
  }
  if (e != cudaSuccess) {
    run.error = std::string("CUDA error around the call: ") + cudaGetErrorString(e);
    return run;
  }
  run.ok = true;
#else
  run.error = "CUDA case in a build without CUDA";
#endif
  return run;
}

// ---- checking -----------------------------------------------------------------------------------

struct FusedCheck {
  bool passed = true;
  std::vector<std::string> problems;  // one line per failed output / touched storage
  double worst_ratio = 0;
  std::array<std::vector<double>, kRoles> values;  // outputs as read back
};

inline FusedCheck check_fused(const FusedOperands& o, const FusedRun& run, const Expected& ex) {
  FusedCheck c;
  const bool sm_bwd = is_softmax(o.cs.op) && o.cs.backward;
  for (int r = 0; r < kRoles; ++r) {
    const Operand& op = o.ops[r];
    if (!op.present) continue;
    const Role role = static_cast<Role>(r);
    const Buffer& after = run.after[static_cast<size_t>(op.owner)];
    if (op.output) {
      c.values[r] = read_output(o, role, after);
      const OutputCheck oc = compare(role_name(role), std::max<int64_t>(op.layout.cols, 1), c.values[r],
                                     ex.ref[r], ex.allowed[r]);
      c.worst_ratio = std::max(c.worst_ratio, oc.worst_ratio);
      if (oc.failures) {
        c.passed = false;
        c.problems.push_back(std::string(role_name(role)) + ": " + std::to_string(oc.failures) + " of " +
                             std::to_string(oc.checked) + " elements wrong; first " + oc.first_failure);
      }
    }
    if (op.owner != r) continue;
    // Bytes that must not change: all of an input's storage (unless an output overwrites it in
    // place, then: outside the view), everything of an output's storage outside its view.
    bool overwritten = op.output;
    for (int q = 0; q < kRoles; ++q)
      if (q != r && o.ops[q].present && o.ops[q].owner == r) overwritten = true;
    const std::vector<char> inside = op.layout.mask();
    const size_t es = dtype_size(op.dtype);
    const auto* before = static_cast<const unsigned char*>(op.host.data());
    const auto* now = static_cast<const unsigned char*>(after.data());
    int64_t changed = 0, first = -1;
    for (size_t i = 0; i < inside.size(); ++i)
      if ((!overwritten || !inside[i]) && std::memcmp(before + i * es, now + i * es, es) != 0) {
        if (changed++ == 0) first = static_cast<int64_t>(i);
      }
    if (changed) {
      c.passed = false;
      c.problems.push_back(std::string(role_name(role, sm_bwd)) + ": " + std::to_string(changed) + " elements of " +
                           (overwritten ? "storage outside the view" : "the input's storage") +
                           " changed; first at storage index " + std::to_string(first));
    }
  }
  return c;
}

inline std::string join(const std::vector<std::string>& lines) {
  std::string s;
  for (const std::string& l : lines) s += "\n  " + l;
  return s;
}

// Runs the prepared operands and asserts: no throw, every output within the bound, nothing
// written outside the outputs' views, no input changed. Returns the check for further asserts.
inline FusedCheck expect_operands_ok(const FusedOperands& o) {
  SCOPED_TRACE(o.cs.describe());
  const Expected ex = expected_outputs(o);
  FusedRun run;
  try {
    run = run_fused(o);
  } catch (const Error& e) {
    ADD_FAILURE() << o.cs.describe() << ": threw (" << status_name(e.status()) << "): " << e.what();
    FusedCheck c;
    c.passed = false;
    return c;
  }
  if (!run.ok) {
    ADD_FAILURE() << o.cs.describe() << ": " << run.error;
    FusedCheck c;
    c.passed = false;
    return c;
  }
  FusedCheck c = check_fused(o, run, ex);
  EXPECT_TRUE(c.passed) << o.cs.describe() << ":" << join(c.problems);
  return c;
}

inline FusedCheck expect_fused_ok(const FusedCase& cs) {
  FusedOperands o(cs);
  return expect_operands_ok(o);
}

// In place as fused.h promises it (y = x, residual_out = residual, dx = dy). src/fused/fused.cpp
// currently refuses some of these (the add forms' forward, the norms' and bias_gelu's backward)
// as overlapping: such a refusal is reported as a skip naming the gap, not as a pass.
inline void expect_in_place_ok(FusedCase cs) {
  cs.in_place = true;
  {
    FusedOperands probe(cs);
    try {
      run_fused(probe);
    } catch (const Error& e) {
      if (e.status() == Status::kInvalidArgument && std::string(e.what()).find("overlap") != std::string::npos)
        GTEST_SKIP() << cs.describe() << ": the API refuses this in-place call although fused.h allows "
                     << "\"y = x, dx = dy\": " << e.what();
    }
  }
  expect_fused_ok(cs);
}

// ---- cases --------------------------------------------------------------------------------------

struct Size {
  int64_t rows, width;
};
inline std::string size_label(const Size& s) { return std::to_string(s.rows) + "x" + std::to_string(s.width); }

// Widths 1, 2, 3, primes and non-multiples of every tile; rows 1, 3, 17, 1000, 4097.
inline std::vector<Size> odd_sizes() {
  return {{1, 1}, {3, 2}, {17, 3}, {1, 127}, {4, 128}, {17, 257}, {3, 1000}, {2, 1031}, {1000, 5}, {4097, 3}, {3, 4099}};
}
// Long rows (tests named "Big"): beyond one block's registers, up to 262144.
inline std::vector<Size> big_sizes() { return {{17, 8191}, {3, 65537}, {2, 262144}, {4097, 127}, {1000, 1000}}; }

inline FusedCase make_case(const OpSpec& spec, bool backward, DType dtype, FusedVariant variant, Device device,
                           Size size) {
  FusedCase cs;
  cs.op = spec.op;
  cs.gelu = spec.gelu;
  cs.backward = backward;
  cs.dtype = dtype;
  cs.variant = variant;
  cs.device = device;
  cs.rows = size.rows;
  cs.width = size.width;
  return cs;
}

// ---- NaN / Inf ----------------------------------------------------------------------------------

// Plants non-finite inputs in a forward case of >= 4 rows and width >= 3 and checks against the
// reference (which gives NaN where torch does): row 0 gets a NaN, row 1 a +inf, row 2 a -inf (and
// for softmax row 3 is all -inf). Row-reducing ops: row 0 must be NaN everywhere, the last row
// (untouched) finite. Element-wise ops: only the planted elements are non-finite.
inline void expect_nan_inf_behaviour(FusedCase cs) {
  ASSERT_FALSE(cs.backward);
  ASSERT_GE(cs.rows, 5);
  ASSERT_GE(cs.width, 3);
  FusedOperands o(cs);
  const int64_t W = cs.width, j = W / 2;
  o.set(kX, 0, j, std::nan(""));
  o.set(kX, 1, j, INFINITY);
  o.set(kX, 2, 0, -INFINITY);
  if (is_softmax(cs.op))
    for (int64_t k = 0; k < W; ++k) o.set(kX, 3, k, -INFINITY);
  const FusedCheck c = expect_operands_ok(o);
  if (!c.passed) return;
  const std::vector<double>& y = c.values[kY];
  const int64_t last = cs.rows - 1;
  if (reduces(cs.op)) {
    for (int64_t k = 0; k < W; ++k) {
      EXPECT_TRUE(std::isnan(y[static_cast<size_t>(k)])) << cs.describe() << ": y[0, " << k << "] should be NaN";
      EXPECT_TRUE(std::isfinite(y[static_cast<size_t>(last * W + k)])) << cs.describe() << ": y[last, " << k << "]";
    }
  } else {
    // x[0, j] is NaN: y[0, j] alone is NaN (silu_and_mul: j < d is in the a half).
    for (int64_t k = 0; k < W; ++k)
      EXPECT_EQ(std::isnan(y[static_cast<size_t>(k)]), k == j) << cs.describe() << ": y[0, " << k << "]";
  }
}

}  // namespace optimized::testing
