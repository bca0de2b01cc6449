// Shared machinery of the fused-family tests (test_fused_cpu, test_fused_cuda, test_fused_errors).
//
// A FusedCase describes one call: op (with the GELU form), forward or backward, dtype, variant,
// device, (rows, width), row padding, view offset, 1-D views, in place, which optional operands
// are present, eps / scale, threads, stream. FusedOperands builds every operand of the call in its
// own host buffer: the view's elements hold fresh random values drawn for the op (seeded from the
// test's name, so a failure reproduces), everything else (row padding, the offset before the view
// and a guard zone after it) is NaN. Outputs are NaN everywhere. run_fused() calls the public API
// (on copies, or on device copies for CUDA: run_on_cuda of tests/common) and check_fused() holds
// every output element to the float64 reference with the rule below, checks that no byte outside
// an output's view changed and that no input changed at all.
//
// ---- The tolerance rule -----------------------------------------------------------------------
// The fused family's one rule, from optimized_ops_testing (src/testing/tolerance.h, applied by
// src/testing/fused_check.h), per row of a row output, per row's statistic, per parameter gradient:
//
//     max |out - ref| <= 2 * max |same - ref| + 2 * u_out * max |ref| + 16 * sqrt(n) * u_acc * scale + floor
//
// ref the float64 reference, same the same-dtype reference (the op computed the plain way in the
// dtype's working precision, as torch in that dtype does), n the reduction length, scale the
// largest of |ref| and the magnitude of the terms summed. The C++ benchmark validates with the same
// check and pytest with the same rule (torch in the same dtype as `same`).
//
// The rule is tight enough to catch real bugs: test_fused_cpu's ToleranceCatches* tests feed it
// outputs with a missing eps, a mean over n - 1, an rms_norm mean square over n - 1, a softmax sum
// short of one term, a layer_norm backward without its mean(g) term, the wrong GELU form and a
// dweight short of one row, and expect a failure for each dtype where the bug is larger than the
// dtype's rounding.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iomanip>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/test_util.h"
#include "fused/cpu/fused_cpu.h"
#include "fused/fused_params.h"
#include "optimized/buffer.h"
#include "optimized/core.h"
#include "optimized/fused.h"
#include "testing/fused_check.h"
#include "testing/fused_reference.h"
#include "testing/tolerance.h"

namespace optimized::testing {

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

using Layout = GuardedLayout;

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
    const DType stat_dtype = c.dtype == DType::kF64 ? DType::kF64 : DType::kF32;  // as the API wants them
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
      if (layer && c.with_stats) vec_op(kMean, R, stat_dtype, true);
      if (norm && c.with_stats) vec_op(kRstd, R, stat_dtype, true);
    } else {
      rows_op(kDy, W, false);
      if (norm && c.with_weight) vec_op(kWeight, W, c.dtype, false);
      if (c.op == FusedOp::kBiasGelu && c.with_bias) vec_op(kBias, W, c.dtype, false);
      if (layer) vec_op(kMean, R, stat_dtype, false);
      if (norm) vec_op(kRstd, R, stat_dtype, false);
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
    std::mt19937_64 rng = test_rng();
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

  // The statistics' pointers as fused.cpp fills them: mean64 / rstd64 for fp64 data, else mean / rstd.
  void set_stats(FusedParams& p, void* mean, void* rstd) const {
    if (cs.dtype == DType::kF64) {
      p.mean64 = static_cast<double*>(mean);
      p.rstd64 = static_cast<double*>(rstd);
    } else {
      p.mean = static_cast<float*>(mean);
      p.rstd = static_cast<float*>(rstd);
    }
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
    if (cs.backward) set_stats(p, ptr(kMean), ptr(kRstd));  // the saved statistics (the same-dtype
                                                            // reference reads them, as the library does)
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
    set_stats(p, ptr(kMean), ptr(kRstd));
    p.dx = ptr(kDx);
    p.ld_dx = ld(kDx);
    p.dweight = ptr(kDweight);
    p.dbias = ptr(kDbias);
    return p;
  }

  // Backward norms: the saved mean / rstd are the float64 statistics of h, rounded to their dtype
  // (fp32; fp64 for fp64 data: what an exact forward would have saved). Called again after a test edits h.
  void refresh_stats() {
    if (!cs.backward || !is_norm(cs.op)) return;
    FusedParams p = reference_params();
    p.backward = false;
    p.op = is_layer(cs.op) ? FusedOp::kLayerNorm : FusedOp::kRmsNorm;  // stats of h itself
    p.residual = nullptr;
    const FusedReference f = fused_reference_f64(p);
    for (int64_t r = 0; r < cs.rows; ++r) {
      if (has(kMean)) set(kMean, 0, r, f.mean[static_cast<size_t>(r)]);  // set rounds to the dtype
      set(kRstd, 0, r, f.rstd[static_cast<size_t>(r)]);
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

// ---- expected outputs ---------------------------------------------------------------------------

// The output of the check that role r is (roles that are no output: none).
inline bool output_of(Role r, FusedOutput* out) {
  switch (r) {
    case kY: *out = FusedOutput::kY; return true;
    case kResidualOut: *out = FusedOutput::kResidualOut; return true;
    case kMean: *out = FusedOutput::kMean; return true;
    case kRstd: *out = FusedOutput::kRstd; return true;
    case kDx: *out = FusedOutput::kDx; return true;
    case kDweight: *out = FusedOutput::kDweight; return true;
    case kDbias: *out = FusedOutput::kDbias; return true;
    default: return false;
  }
}

// The references and terms of the case's call (src/testing/fused_check.h).
inline FusedExpected expected_outputs(const FusedOperands& o) { return fused_expected(o.reference_params()); }

// The values of output role r checked against the rule.
inline CheckResult check_output(const FusedOperands& o, const FusedExpected& ex, Role r, const std::vector<double>& values) {
  FusedOutput out{};
  if (!output_of(r, &out)) {
    CheckResult c;
    c.failures = 1;
    c.first_failure = std::string(role_name(r)) + " is no output";
    return c;
  }
  return check_fused_output(o.reference_params(), ex, out, values);
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
  std::vector<const Buffer*> host(kRoles, nullptr);
  for (int r = 0; r < kRoles; ++r)
    if (o.ops[r].present && o.ops[r].owner == r) host[static_cast<size_t>(r)] = &o.ops[r].host;
  ExecutionContext ctx;
  ctx.cuda_stream = cs.stream;
  std::vector<Buffer> after;
  run.error = run_on_cuda(host, cs.device, cs.stream,
                          [&](const std::vector<void*>& d) {
                            std::array<void*, kRoles> dbases{};
                            std::copy(d.begin(), d.end(), dbases.begin());
                            call_fused(o, dbases, cs.device, ctx);
                          },
                          after);
  if (!run.error.empty()) return run;
  for (int r = 0; r < kRoles; ++r)
    if (host[static_cast<size_t>(r)]) run.after[r] = std::move(after[static_cast<size_t>(r)]);
  run.ok = true;
  return run;
}

// ---- checking -----------------------------------------------------------------------------------

struct FusedCheck {
  bool passed = true;
  std::vector<std::string> problems;  // one line per failed output / touched storage
  double worst_ratio = 0;
  std::array<std::vector<double>, kRoles> values;  // outputs as read back
};

inline FusedCheck check_fused(const FusedOperands& o, const FusedRun& run, const FusedExpected& ex) {
  FusedCheck c;
  const bool sm_bwd = is_softmax(o.cs.op) && o.cs.backward;
  for (int r = 0; r < kRoles; ++r) {
    const Operand& op = o.ops[r];
    if (!op.present) continue;
    const Role role = static_cast<Role>(r);
    const Buffer& after = run.after[static_cast<size_t>(op.owner)];
    if (op.output) {
      c.values[r] = read_output(o, role, after);
      const CheckResult oc = check_output(o, ex, role, c.values[r]);
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
    int64_t first = -1;
    const int64_t changed =
        changed_elements(op.layout, dtype_size(op.dtype), op.host.data(), after.data(), overwritten, &first);
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
  const FusedExpected ex = expected_outputs(o);
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
