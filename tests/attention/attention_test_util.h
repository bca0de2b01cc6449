// Shared machinery of the attention-family tests (test_attention_cpu, test_attention_cuda,
// test_attention_errors).
//
// An AttnCase describes one call: forward or backward, dtype, variant, device, sizes (fixed length
// (B, S_q, S_k) or varlen sequence lengths), GQA heads, head dim, the storage order of the data
// tensors ((B, S, H, D), or (B, H, S, D) seen through a permuted view), row padding and a view
// offset, and every option of optimized/attention.h (causal and its alignment, window, soft-cap,
// ALiBi per head or per (batch, head), an explicit bool / additive mask with broadcast dimensions,
// lse or not, deterministic), threads, stream, an explicit workspace.
//
// AttnOperands builds every operand in its own host buffer: the view's elements hold fresh random
// values (seeded from the test's name: a failure reproduces), everything else (padding, the offset
// before the view, a guard zone after it) is NaN; outputs are NaN everywhere. A backward case gets
// out and lse from the float64 reference (rounded to their dtypes), as a forward would give them.
// run_attention() calls the public API (or, backend_direct, cpu_attention on the params) on copies
// (CUDA: device copies through run_on_cuda), and check_run() holds every output to the float64
// reference with flash-attention's rule (src/testing/attention_check.h), checks that no byte
// outside an output's view changed and that no input changed at all.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "attention/attention_params.h"
#include "attention/cpu/attention_cpu.h"
#include "common/test_util.h"
#include "optimized/attention.h"
#include "optimized/buffer.h"
#include "optimized/core.h"
#include "testing/attention_check.h"
#include "testing/attention_reference.h"

namespace optimized::testing {

// ---- the case ---------------------------------------------------------------------------------

enum class DataLayout : uint8_t { kBSHD, kBHSD };  // storage order of q, k, v, out and the gradients
enum class MaskKind : uint8_t { kNone, kBool, kAdditive };
enum class Alibi : uint8_t { kNone, kPerHead, kPerBatchHead };

struct AttnCase {
  bool backward = false;
  DType dtype = DType::kF32;
  AttentionVariant variant = AttentionVariant::kCpu;
  Device device = Device::cpu();
  int64_t batch = 1, seqlen_q = 7, seqlen_k = 7, heads_q = 2, heads_kv = 1, head_dim = 8;
  std::vector<int32_t> lens_q, lens_k;  // non-empty: varlen with these lengths (batch = their count)
  DataLayout layout = DataLayout::kBSHD;
  int64_t pad = 0;     // elements after each row's head_dim values
  int64_t offset = 0;  // elements before every view
  bool causal = false, top_left = false;
  int64_t window_left = -1, window_right = -1;
  double softcap = 0.0;
  double scale = std::numeric_limits<double>::quiet_NaN();
  Alibi alibi = Alibi::kNone;
  MaskKind mask = MaskKind::kNone;
  DType mask_dtype = DType::kF32;                        // additive: q's dtype or fp32
  std::array<bool, 4> mask_full = {true, true, true, true};  // false: that dimension broadcasts
  bool mask_stride0 = false;  // broadcast dimensions keep their full size with stride 0 (else size 1)
  double mask_density = 0.75;  // bool: chance of true; additive: chance of a finite value (else -inf)
  bool with_lse = true;  // forward: lse wanted
  bool deterministic = false;
  int cpu_threads = 0;
  void* stream = nullptr;
  bool backend_direct = false;      // CPU: cpu_attention on the params, bypassing the API
  bool explicit_workspace = false;  // CUDA: ctx.workspace of exactly attention_workspace_bytes
  double in_scale = 1.5;            // q, k uniform in (-in_scale, in_scale); v, dout in (-1, 1)
  int64_t max_seqlen_bound = 0;     // varlen: > 0 passes this as max_seqlen_q and _k (a loose bound)

  bool varlen() const { return !lens_q.empty(); }
  int64_t nseq() const { return varlen() ? static_cast<int64_t>(lens_q.size()) : batch; }
  int64_t total_q() const {
    if (!varlen()) return batch * seqlen_q;
    int64_t t = 0;
    for (int32_t l : lens_q) t += l;
    return t;
  }
  int64_t total_k() const {
    if (!varlen()) return batch * seqlen_k;
    int64_t t = 0;
    for (int32_t l : lens_k) t += l;
    return t;
  }
  int64_t max_q() const { return varlen() ? *std::max_element(lens_q.begin(), lens_q.end()) : seqlen_q; }
  int64_t max_k() const { return varlen() ? *std::max_element(lens_k.begin(), lens_k.end()) : seqlen_k; }

  AttentionOptions options() const {
    AttentionOptions o;
    o.softmax_scale = scale;
    o.causal = causal;
    o.alignment = top_left ? CausalAlignment::kTopLeft : CausalAlignment::kBottomRight;
    o.window_left = window_left;
    o.window_right = window_right;
    o.softcap = softcap;
    o.deterministic = deterministic;
    return o;
  }

  std::string describe() const {
    std::ostringstream s;
    s << (backward ? "backward " : "forward ") << dtype_name(dtype) << " " << attention_variant_name(variant) << " on "
      << device_name(device);
    if (varlen()) {
      s << " varlen q=[";
      for (size_t i = 0; i < lens_q.size(); ++i) s << (i ? "," : "") << lens_q[i];
      s << "] k=[";
      for (size_t i = 0; i < lens_k.size(); ++i) s << (i ? "," : "") << lens_k[i];
      s << "]";
    } else {
      s << " B=" << batch << " Sq=" << seqlen_q << " Sk=" << seqlen_k;
    }
    s << " Hq=" << heads_q << " Hkv=" << heads_kv << " D=" << head_dim;
    if (layout == DataLayout::kBHSD) s << " (B,H,S,D) storage";
    if (pad) s << " pad=" << pad;
    if (offset) s << " offset=" << offset;
    if (causal) s << (top_left ? " causal(top-left)" : " causal");
    else if (top_left) s << " top-left";
    if (window_left >= 0 || window_right >= 0) s << " window=(" << window_left << "," << window_right << ")";
    if (softcap > 0) s << " softcap=" << softcap;
    if (!std::isnan(scale)) s << " scale=" << scale;
    if (alibi != Alibi::kNone) s << (alibi == Alibi::kPerHead ? " alibi(H)" : " alibi(B,H)");
    if (mask != MaskKind::kNone) {
      s << (mask == MaskKind::kBool ? " bool-mask" : " additive-mask(") ;
      if (mask == MaskKind::kAdditive) s << dtype_name(mask_dtype) << ")";
      s << "[" << (mask_full[0] ? "B" : "1") << (mask_full[1] ? "H" : "1") << (mask_full[2] ? "Q" : "1")
        << (mask_full[3] ? "K" : "1") << (mask_stride0 ? " stride0" : "") << "]";
    }
    if (!with_lse && !backward) s << " no-lse";
    if (deterministic) s << " deterministic";
    if (cpu_threads) s << " threads=" << cpu_threads;
    if (stream) s << " (own stream)";
    if (backend_direct) s << " (cpu_attention directly)";
    if (explicit_workspace) s << " (explicit workspace)";
    return s.str();
  }
};

// ---- operands ---------------------------------------------------------------------------------

enum Role : int { kQ, kK, kV, kOut, kLse, kDout, kDq, kDk, kDv, kMask, kAlibiSlopes, kCuQ, kCuK, kRoles };

inline const char* role_name(Role r) {
  static const char* const kNames[kRoles] = {"q",  "k",  "v",    "out",          "lse",          "dout",        "dq",
                                             "dk", "dv", "mask", "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k"};
  return r < kRoles ? kNames[r] : "?";
}

// One operand: a view (shape, strides, offset) into its own host buffer with a guard zone.
struct Operand {
  bool present = false;
  bool output = false;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape, strides;
  int64_t offset = 0;
  int64_t storage = 0;  // elements of the buffer
  Buffer host;
  static constexpr int64_t kGuard = 67;

  // Storage index of a logical index.
  int64_t index(std::initializer_list<int64_t> idx) const {
    int64_t at = offset, i = 0;
    for (int64_t x : idx) at += x * strides[static_cast<size_t>(i++)];
    return at;
  }
  // Marks the elements the view covers.
  std::vector<char> covered() const {
    std::vector<char> m(static_cast<size_t>(storage), 0);
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    std::vector<int64_t> idx(shape.size(), 0);
    for (int64_t e = 0; e < n; ++e) {
      int64_t at = offset, rest = e;
      for (size_t d = shape.size(); d-- > 0;) {
        at += (rest % shape[d]) * strides[d];
        rest /= shape[d];
      }
      m[static_cast<size_t>(at)] = 1;
    }
    return m;
  }
};

inline double poison_value() { return std::nan(""); }

class AttnOperands {
 public:
  AttnCase cs;
  std::array<Operand, kRoles> ops;

  explicit AttnOperands(const AttnCase& c) : cs(c) {
    const int64_t B = c.nseq(), Hq = c.heads_q, Hkv = c.heads_kv, D = c.head_dim, row = D + c.pad;
    auto data = [&](Role r, bool like_q, bool output) {
      Operand& o = ops[r];
      o.present = true;
      o.output = output;
      o.dtype = c.dtype;
      o.offset = c.offset;
      const int64_t H = like_q ? Hq : Hkv;
      if (c.varlen()) {
        const int64_t T = like_q ? c.total_q() : c.total_k();
        o.shape = {T, H, D};
        if (c.layout == DataLayout::kBSHD) o.strides = {H * row, row, 1};
        else o.strides = {row, T * row, 1};
        o.storage = c.offset + T * H * row + Operand::kGuard;
      } else {
        const int64_t S = like_q ? c.seqlen_q : c.seqlen_k;
        o.shape = {c.batch, S, H, D};
        if (c.layout == DataLayout::kBSHD) o.strides = {S * H * row, H * row, row, 1};
        else o.strides = {H * S * row, row, S * row, 1};
        o.storage = c.offset + c.batch * S * H * row + Operand::kGuard;
      }
    };
    data(kQ, true, false);
    data(kK, false, false);
    data(kV, false, false);
    data(kOut, true, !c.backward);
    if (c.backward || c.with_lse) {
      Operand& o = ops[kLse];
      o.present = true;
      o.output = !c.backward;
      o.dtype = c.dtype == DType::kF64 ? DType::kF64 : DType::kF32;
      o.offset = c.offset;
      if (c.varlen()) {
        const int64_t T = c.total_q();
        o.shape = {Hq, T};
        o.strides = {T + c.pad, 1};
        o.storage = c.offset + Hq * (T + c.pad) + Operand::kGuard;
      } else {
        const int64_t S = c.seqlen_q;
        o.shape = {c.batch, Hq, S};
        o.strides = {Hq * (S + c.pad), S + c.pad, 1};
        o.storage = c.offset + c.batch * Hq * (S + c.pad) + Operand::kGuard;
      }
    }
    if (c.backward) {
      data(kDout, true, false);
      data(kDq, true, true);
      data(kDk, false, true);
      data(kDv, false, true);
    }
    if (c.mask != MaskKind::kNone) {
      Operand& o = ops[kMask];
      o.present = true;
      o.dtype = c.mask == MaskKind::kBool ? DType::kBool : c.mask_dtype;
      const int64_t full[4] = {c.batch, Hq, c.seqlen_q, c.seqlen_k};
      int64_t stored[4];
      for (int d = 0; d < 4; ++d) stored[d] = c.mask_full[static_cast<size_t>(d)] ? full[d] : 1;
      // Contiguous over the stored sizes; a broadcast dimension: size 1, or (mask_stride0) its full
      // size with stride 0.
      int64_t stride = 1;
      o.shape.assign(4, 0);
      o.strides.assign(4, 0);
      for (int d = 3; d >= 0; --d) {
        const bool bc = !c.mask_full[static_cast<size_t>(d)];
        o.shape[static_cast<size_t>(d)] = bc && c.mask_stride0 ? full[d] : stored[d];
        o.strides[static_cast<size_t>(d)] = bc && c.mask_stride0 ? 0 : stride;
        stride *= stored[d];
      }
      o.offset = c.offset;
      o.storage = c.offset + stride + Operand::kGuard;
    }
    if (c.alibi != Alibi::kNone) {
      Operand& o = ops[kAlibiSlopes];
      o.present = true;
      o.dtype = DType::kF32;
      if (c.alibi == Alibi::kPerHead) o.shape = {Hq}, o.strides = {1};
      else o.shape = {B, Hq}, o.strides = {Hq, 1};
      o.storage = (c.alibi == Alibi::kPerHead ? Hq : B * Hq) + Operand::kGuard;
    }
    if (c.varlen()) {
      for (Role r : {kCuQ, kCuK}) {
        Operand& o = ops[r];
        o.present = true;
        o.dtype = DType::kI32;
        o.shape = {B + 1};
        o.strides = {1};
        o.storage = B + 1;
      }
    }
    for (Operand& o : ops)
      if (o.present) o.host = Buffer(o.dtype, std::max<int64_t>(o.storage, 1), Device::cpu());
    fill();
  }

  // A view of role r on the storage at `base` (device `device`).
  TensorView view(Role r, void* base, Device device) const {
    const Operand& o = ops[r];
    if (!o.present) return TensorView{};
    void* data = static_cast<char*>(base) + o.offset * static_cast<int64_t>(dtype_size(o.dtype));
    return raw(data, o.dtype, device, o.shape, o.strides);
  }

  // The params as src/attention/attention.cpp fills them, on the storage `bases` (host or device).
  AttentionParams params(const std::array<void*, kRoles>& bases) const {
    AttentionParams p;
    const AttnCase& c = cs;
    auto at = [&](Role r) -> void* {
      return ops[r].present && bases[r]
                 ? static_cast<char*>(bases[r]) + ops[r].offset * static_cast<int64_t>(dtype_size(ops[r].dtype))
                 : nullptr;
    };
    auto strides = [&](Role r) {
      AttentionStrides s;
      const Operand& o = ops[r];
      if (c.varlen()) s.row = o.strides[0], s.head = o.strides[1];
      else s.batch = o.strides[0], s.row = o.strides[1], s.head = o.strides[2];
      return s;
    };
    p.dtype = c.dtype;
    p.batch = c.nseq();
    p.seqlen_q = c.max_q();
    p.seqlen_k = c.max_k();
    p.heads_q = c.heads_q;
    p.heads_kv = c.heads_kv;
    p.head_dim = c.head_dim;
    p.total_q = c.total_q();
    p.total_k = c.total_k();
    p.q = at(kQ), p.k = at(kK), p.v = at(kV), p.out = at(kOut);
    p.q_s = strides(kQ), p.k_s = strides(kK), p.v_s = strides(kV), p.out_s = strides(kOut);
    if (ops[kLse].present) {
      p.lse = at(kLse);
      if (c.varlen()) p.lse_head = ops[kLse].strides[0];
      else p.lse_batch = ops[kLse].strides[0], p.lse_head = ops[kLse].strides[1];
    }
    if (c.varlen()) {
      p.cu_seqlens_q = static_cast<const int32_t*>(at(kCuQ));
      p.cu_seqlens_k = static_cast<const int32_t*>(at(kCuK));
    }
    p.scale = std::isnan(c.scale) ? 1.0 / std::sqrt(static_cast<double>(c.head_dim)) : c.scale;
    p.causal = c.causal;
    p.top_left = c.top_left;
    p.window_left = c.window_left;
    p.window_right = c.causal ? (c.window_right < 0 ? 0 : std::min<int64_t>(c.window_right, 0)) : c.window_right;
    p.softcap = c.softcap;
    if (ops[kAlibiSlopes].present) {
      p.alibi = static_cast<const float*>(at(kAlibiSlopes));
      p.alibi_batch = c.alibi == Alibi::kPerBatchHead ? c.heads_q : 0;
    }
    if (ops[kMask].present) {
      p.mask = at(kMask);
      p.mask_dtype = ops[kMask].dtype;
      for (int d = 0; d < 4; ++d)
        p.mask_s[d] = ops[kMask].shape[static_cast<size_t>(d)] == 1 ? 0 : ops[kMask].strides[static_cast<size_t>(d)];
    }
    p.backward = c.backward;
    p.deterministic = c.deterministic;
    if (c.backward) {
      p.dout = at(kDout), p.dq = at(kDq), p.dk = at(kDk), p.dv = at(kDv);
      p.dout_s = strides(kDout), p.dq_s = strides(kDq), p.dk_s = strides(kDk), p.dv_s = strides(kDv);
    }
    return p;
  }

  // The host storage of every operand (the inputs as built, the outputs poisoned).
  std::array<void*, kRoles> host_bases() const {
    std::array<void*, kRoles> b{};
    for (int r = 0; r < kRoles; ++r)
      if (ops[r].present) b[static_cast<size_t>(r)] = ops[r].host.data();
    return b;
  }
  AttentionParams host_params() const { return params(host_bases()); }

  // Element (logical index) of role r's view in the host storage.
  void set(Role r, std::initializer_list<int64_t> idx, double value) {
    store_from_double(ops[r].host.data(), ops[r].dtype, ops[r].index(idx), value);
  }
  double get(Role r, std::initializer_list<int64_t> idx) const {
    return load_as_double(ops[r].host.data(), ops[r].dtype, ops[r].index(idx));
  }
  // Element d of row `row` (packed: b * S + i fixed, cu[b] + i varlen), head h, of a data operand.
  int64_t data_index(Role r, int64_t row, int64_t h, int64_t d) const {
    const Operand& o = ops[r];
    if (cs.varlen()) return o.index({row, h, d});
    const int64_t S = o.shape[1];
    return o.index({row / S, row % S, h, d});
  }
  void set_data(Role r, int64_t row, int64_t h, int64_t d, double value) {
    store_from_double(ops[r].host.data(), ops[r].dtype, data_index(r, row, h, d), value);
  }

  // Recomputes out and lse of a backward case from the float64 reference (after editing inputs).
  void refresh_forward() {
    if (!cs.backward) return;
    AttentionParams fp = host_params();
    fp.backward = false;
    const AttentionReference ref = attention_reference_f64(fp);
    const int64_t rows = attention_rows_q(fp), Hq = cs.heads_q, D = cs.head_dim;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t h = 0; h < Hq; ++h) {
        for (int64_t d = 0; d < D; ++d)
          set_data(kOut, r, h, d, ref.out[static_cast<size_t>((r * Hq + h) * D + d)]);
        const double l = ref.lse[static_cast<size_t>(r * Hq + h)];
        const Operand& o = ops[kLse];
        int64_t at;
        if (cs.varlen()) at = o.index({h, r});
        else at = o.index({r / cs.seqlen_q, h, r % cs.seqlen_q});
        store_from_double(o.host.data(), o.dtype, at, l);
      }
  }

 private:
  void fill() {
    std::mt19937_64 rng = test_rng();
    for (Operand& o : ops) {
      if (!o.present || o.dtype == DType::kI32) continue;
      if (o.dtype == DType::kBool) std::memset(o.host.data(), 0, o.host.bytes());
      else
        for (int64_t i = 0; i < o.storage; ++i) store_from_double(o.host.data(), o.dtype, i, poison_value());
    }
    auto fill_view = [&](Role r, double lo, double hi) {
      Operand& o = ops[r];
      if (!o.present) return;
      std::uniform_real_distribution<double> u(lo, hi);
      const std::vector<char> m = o.covered();
      for (size_t i = 0; i < m.size(); ++i)
        if (m[i]) store_from_double(o.host.data(), o.dtype, static_cast<int64_t>(i), u(rng));
    };
    fill_view(kQ, -cs.in_scale, cs.in_scale);
    fill_view(kK, -cs.in_scale, cs.in_scale);
    fill_view(kV, -1.0, 1.0);
    fill_view(kDout, -1.0, 1.0);
    fill_view(kAlibiSlopes, 0.02, 0.5);
    if (ops[kMask].present) {
      Operand& o = ops[kMask];
      std::uniform_real_distribution<double> u(0.0, 1.0), add(-2.0, 1.0);
      const std::vector<char> m = o.covered();
      for (size_t i = 0; i < m.size(); ++i) {
        if (!m[i]) continue;
        const bool keep = u(rng) < cs.mask_density;
        const double v = cs.mask == MaskKind::kBool ? (keep ? 1.0 : 0.0) : (keep ? add(rng) : -INFINITY);
        store_from_double(o.host.data(), o.dtype, static_cast<int64_t>(i), v);
      }
    }
    if (cs.varlen()) {
      auto* cq = static_cast<int32_t*>(ops[kCuQ].host.data());
      auto* ck = static_cast<int32_t*>(ops[kCuK].host.data());
      cq[0] = ck[0] = 0;
      for (size_t b = 0; b < cs.lens_q.size(); ++b) {
        cq[b + 1] = cq[b] + cs.lens_q[b];
        ck[b + 1] = ck[b] + cs.lens_k[b];
      }
    }
    refresh_forward();
  }
};

// ---- running ------------------------------------------------------------------------------------

// Calls the public API for the case on the operand storage `bases` (per role) on `device`.
// `c`: the case as run (o.cs, or a copy that changes how: threads, deterministic, stream, ...).
inline void call_attention(const AttnOperands& o, const AttnCase& c, const std::array<void*, kRoles>& bases,
                           Device device, const ExecutionContext& ctx) {
  auto v = [&](Role r) { return o.view(r, bases[static_cast<size_t>(r)], device); };
  auto bound = [&](int64_t longest) { return c.max_seqlen_bound > 0 ? c.max_seqlen_bound : longest; };
  AttentionOptions opt = c.options();
  opt.alibi_slopes = v(kAlibiSlopes);
  opt.mask = v(kMask);
  if (!c.varlen()) {
    if (!c.backward) attention_forward(v(kQ), v(kK), v(kV), v(kOut), v(kLse), opt, c.variant, ctx);
    else
      attention_backward(v(kDout), v(kQ), v(kK), v(kV), v(kOut), v(kLse), v(kDq), v(kDk), v(kDv), opt, c.variant, ctx);
  } else {
    if (!c.backward)
      attention_varlen_forward(v(kQ), v(kK), v(kV), v(kCuQ), v(kCuK), bound(c.max_q()), bound(c.max_k()), v(kOut), v(kLse), opt,
                               c.variant, ctx);
    else
      attention_varlen_backward(v(kDout), v(kQ), v(kK), v(kV), v(kCuQ), v(kCuK), bound(c.max_q()), bound(c.max_k()), v(kOut),
                                v(kLse), v(kDq), v(kDk), v(kDv), opt, c.variant, ctx);
  }
}

struct AttnRun {
  std::array<Buffer, kRoles> after;  // host copy of every operand's storage after the call
  bool ok = false;
  std::string error;
};

inline AttentionShape shape_of(const AttnCase& c) {
  AttentionShape s;
  s.batch = c.nseq();
  s.seqlen_q = c.max_q();
  s.seqlen_k = c.max_k();
  s.heads_q = c.heads_q;
  s.heads_kv = c.heads_kv;
  s.head_dim = c.head_dim;
  if (c.varlen()) s.total_q = c.total_q();
  return s;
}

// Runs the case on the operands o; throws what the API throws. A CUDA error is reported in
// AttnRun::error. `how`: run the same operands with other run settings (threads, backend_direct,
// deterministic, stream, explicit_workspace; the sizes and options that shaped o must not change).
inline AttnRun run_attention(const AttnOperands& o, const AttnCase* how = nullptr) {
  const AttnCase& c = how ? *how : o.cs;
  AttnRun run;
  if (!c.device.is_cuda()) {
    std::array<void*, kRoles> bases{};
    for (int r = 0; r < kRoles; ++r) {
      if (!o.ops[r].present) continue;
      run.after[r] = Buffer(o.ops[r].dtype, o.ops[r].host.count(), Device::cpu());
      std::memcpy(run.after[r].data(), o.ops[r].host.data(), o.ops[r].host.bytes());
      bases[static_cast<size_t>(r)] = run.after[r].data();
    }
    ExecutionContext ctx;
    ctx.cpu_threads = c.cpu_threads;
    if (c.backend_direct) cpu_attention(o.params(bases), c.cpu_threads);
    else call_attention(o, c, bases, Device::cpu(), ctx);
    run.ok = true;
    return run;
  }
  std::vector<const Buffer*> host(kRoles, nullptr);
  for (int r = 0; r < kRoles; ++r)
    if (o.ops[r].present) host[static_cast<size_t>(r)] = &o.ops[r].host;
  ExecutionContext ctx;
  ctx.cuda_stream = c.stream;
  Buffer workspace;
  if (c.explicit_workspace) {
    const size_t bytes = attention_workspace_bytes(shape_of(c), c.dtype, c.device, c.backward, c.options(), c.variant);
    if (bytes > 0) {
      workspace = Buffer(DType::kI32, static_cast<int64_t>((bytes + 3) / 4), c.device);
      workspace.fill_bytes(0xFF);
      ctx.workspace = {workspace.data(), bytes};
    }
  }
  std::vector<Buffer> after;
  run.error = run_on_cuda(host, c.device, c.stream,
                          [&](const std::vector<void*>& d) {
                            std::array<void*, kRoles> dbases{};
                            std::copy(d.begin(), d.end(), dbases.begin());
                            call_attention(o, c, dbases, c.device, ctx);
                          },
                          after);
  if (!run.error.empty()) return run;
  for (int r = 0; r < kRoles; ++r)
    if (host[static_cast<size_t>(r)]) run.after[r] = std::move(after[static_cast<size_t>(r)]);
  run.ok = true;
  return run;
}

// ---- checking -----------------------------------------------------------------------------------

struct AttnCheck {
  bool passed = true;
  std::vector<std::string> problems;
  CheckResult result;
  std::array<std::vector<double>, 5> values;  // per AttentionOutput, as read back
};

inline AttentionParams after_params(const AttnOperands& o, const AttnRun& run) {
  std::array<void*, kRoles> b{};
  for (int r = 0; r < kRoles; ++r)
    if (o.ops[r].present) b[static_cast<size_t>(r)] = run.after[r].data();
  return o.params(b);
}

inline AttnCheck check_run(const AttnOperands& o, const AttnRun& run, const AttentionExpected& ex) {
  AttnCheck c;
  const AttentionParams p = after_params(o, run);
  for (AttentionOutput out : attention_outputs(p)) {
    c.values[static_cast<size_t>(out)] = read_attention_output(p, out);
    const CheckResult r = check_attention_output(p, ex, out, c.values[static_cast<size_t>(out)]);
    c.result.merge(r, std::string(attention_output_name(out)) + ": ");
    if (r.failures) {
      c.passed = false;
      c.problems.push_back(std::string(attention_output_name(out)) + ": " + std::to_string(r.failures) + " of " +
                           std::to_string(r.checked) + " elements wrong; first " + r.first_failure);
    }
  }
  for (int r = 0; r < kRoles; ++r) {
    const Operand& op = o.ops[r];
    if (!op.present) continue;
    const size_t es = dtype_size(op.dtype);
    const std::vector<char> inside = op.covered();
    const auto* b = static_cast<const unsigned char*>(op.host.data());
    const auto* a = static_cast<const unsigned char*>(run.after[r].data());
    int64_t changed = 0, first = -1;
    for (size_t i = 0; i < inside.size(); ++i)
      if ((!op.output || !inside[i]) && std::memcmp(b + i * es, a + i * es, es) != 0)
        if (changed++ == 0) first = static_cast<int64_t>(i);
    if (changed) {
      c.passed = false;
      c.problems.push_back(std::string(role_name(static_cast<Role>(r))) + ": " + std::to_string(changed) +
                           " elements of " + (op.output ? "storage outside the view" : "the input's storage") +
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

// Runs the prepared operands and asserts: no throw, every output within the bound, nothing written
// outside the outputs' views, no input changed. Returns the check (values for further asserts).
inline AttnCheck expect_operands_ok(const AttnOperands& o, AttnRun* keep = nullptr) {
  SCOPED_TRACE(o.cs.describe());
  const AttentionExpected ex = attention_expected(o.host_params());
  AttnRun run;
  AttnCheck c;
  try {
    run = run_attention(o);
  } catch (const Error& e) {
    ADD_FAILURE() << o.cs.describe() << ": threw (" << status_name(e.status()) << "): " << e.what();
    c.passed = false;
    return c;
  }
  if (!run.ok) {
    ADD_FAILURE() << o.cs.describe() << ": " << run.error;
    c.passed = false;
    return c;
  }
  c = check_run(o, run, ex);
  EXPECT_TRUE(c.passed) << o.cs.describe() << ":" << join(c.problems);
  if (keep) *keep = std::move(run);
  return c;
}

inline AttnCheck expect_attention_ok(const AttnCase& cs) {
  const AttnOperands o(cs);
  return expect_operands_ok(o);
}

// The bytes of every output of two runs of the same operands are identical.
inline ::testing::AssertionResult same_output_bits(const AttnOperands& o, const AttnRun& a, const AttnRun& b) {
  for (int r = 0; r < kRoles; ++r) {
    if (!o.ops[r].present || !o.ops[r].output) continue;
    if (std::memcmp(a.after[r].data(), b.after[r].data(), a.after[r].bytes()) != 0)
      return ::testing::AssertionFailure() << role_name(static_cast<Role>(r)) << " differs between the two runs";
  }
  return ::testing::AssertionSuccess();
}

// ---- cases --------------------------------------------------------------------------------------

inline AttnCase make_case(bool backward, DType dtype, AttentionVariant variant, Device device, int64_t batch,
                          int64_t sq, int64_t sk, int64_t hq, int64_t hkv, int64_t d) {
  AttnCase c;
  c.backward = backward;
  c.dtype = dtype;
  c.variant = variant;
  c.device = device;
  c.batch = batch;
  c.seqlen_q = sq;
  c.seqlen_k = sk;
  c.heads_q = hq;
  c.heads_kv = hkv;
  c.head_dim = d;
  return c;
}

// The score options the feature-matrix tests sweep: causal (both alignments) x window x softcap x
// ALiBi, each applied to a base case.
struct Feature {
  const char* name;
  bool causal, top_left;
  int64_t wl, wr;
  double softcap;
  Alibi alibi;
};
inline std::vector<Feature> feature_matrix() {
  return {
      {"plain", false, false, -1, -1, 0.0, Alibi::kNone},
      {"causal", true, false, -1, -1, 0.0, Alibi::kNone},
      {"causal_top_left", true, true, -1, -1, 0.0, Alibi::kNone},
      {"window", false, false, 3, 2, 0.0, Alibi::kNone},
      {"window_left_only", false, false, 4, -1, 0.0, Alibi::kNone},
      {"causal_window", true, false, 5, -1, 0.0, Alibi::kNone},
      {"causal_top_left_window", true, true, 2, -1, 0.0, Alibi::kNone},
      {"softcap", false, false, -1, -1, 1.5, Alibi::kNone},
      {"alibi", false, false, -1, -1, 0.0, Alibi::kPerHead},
      {"alibi_batch", false, false, -1, -1, 0.0, Alibi::kPerBatchHead},
      {"causal_softcap_alibi", true, false, -1, -1, 2.0, Alibi::kPerHead},
      {"window_softcap_alibi_top_left", false, true, 6, 1, 3.0, Alibi::kPerBatchHead},
      {"causal_window_softcap_alibi", true, true, 4, -1, 1.0, Alibi::kPerHead},
  };
}
inline AttnCase with_feature(AttnCase c, const Feature& f) {
  c.causal = f.causal;
  c.top_left = f.top_left;
  c.window_left = f.wl;
  c.window_right = f.wr;
  c.softcap = f.softcap;
  c.alibi = f.alibi;
  return c;
}

// Varlen batches with empty and length-1 sequences (q lengths, k lengths).
struct VarlenLens {
  std::vector<int32_t> q, k;
};
inline std::vector<VarlenLens> varlen_batches() {
  return {
      {{5, 0, 1, 13, 7}, {5, 3, 1, 13, 0}},
      {{1, 1, 1}, {1, 9, 2}},
      {{17, 4}, {6, 21}},
      {{0, 0}, {3, 0}},
  };
}

}  // namespace optimized::testing
