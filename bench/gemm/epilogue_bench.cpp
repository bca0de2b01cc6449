// The linear-layer plug-in of optimized-bench: `optimized-bench linear`. The GEMMs with fused
// epilogues a linear layer (y = act(x W^T + b)) needs in training, each run through the public
// optimized::matmul(a, b, c, GemmEpilogue, ...), validated against float64 (check_gemm_epilogue),
// then timed next to cuBLASLt running the same product with its own epilogue in the same run
// (baselines/cublaslt_epilogue.h). Sizes are the layer's: M tokens, N output features, K input
// features (--size MxNxK); every case does 2 M N K flops.
//
//   case         GEMM (row-major)                                        epilogue (ours / cuBLASLt)
//   bias         y (M,N) = x (M,K) @ W^T + b, W stored (N,K) (w.t())     bias per column      / BIAS
//   bias_relu    y = relu(x W^T + b)                                      + relu               / RELU_BIAS
//   bias_gelu    y = gelu_tanh(x W^T + b), aux = x W^T + b kept           + gelu_tanh + aux    / GELU_AUX_BIAS
//   dgelu_bgrad  dPre (M,N) = (dY (M,K) @ W (K,N)) * gelu_tanh'(aux),     activation_grad,     / DGELU_BGRAD
//                bgrad = sum over rows of dPre                            aux in, column_sums
//                (W row-major (K, N): the (out, in) weight of the layer after the activation)
//   wgrad_f32    dW (N,K) fp32 += dY^T (N,M) @ X (M,K)   (beta = 1)      fp32 C               / fp32 C, beta 1
//                (dY (M,N) row-major read as a column-major A)            + cublaslt_bgradb row: BGRADB
//
// Where cuBLASLt differs (see also the report's notes):
//   - dgelu_bgrad: cuBLASLt's bias gradient has D's dtype (bf16/fp16; its rule outside int8/fp8),
//     ours is fp32: the same product and the same reduction (cuBLASLt's bias gradient is one per
//     row of its column-major D, i.e. per column of our row-major C, summed over our rows:
//     column_sums), written at 2 instead of 4 bytes per column. Its bias gradient is checked
//     against the float64 sums of its own (validated) output, with the bound of its rounding.
//   - wgrad_f32: our GEMM has no way to fuse the bias gradient of a weight-gradient GEMM (db =
//     sum_t dY[t, :] sums an input's rows; column_sums sum the output's); cuBLASLt's BGRADB does,
//     shown as an extra row `cublaslt_bgradb` (backend cublaslt) against plain cuBLASLt.
//   - bias_gelu: both keep aux = the pre-activation in C's dtype and use the tanh GELU.
//
// min_bytes (GB/s): every tensor read or written once, E = the element size, E_c = C's:
//   bias, bias_relu:  (M K + N K + M N) E + N E              (the epilogue adds N E: the bias)
//   bias_gelu:        (M K + N K + 2 M N) E + N E            (+ M N E aux written, + N E bias)
//   dgelu_bgrad:      (M K + K N + 2 M N) E + 4 N            (+ M N E aux read, + 4 N sums)
//   wgrad_f32:        (M N + M K) E + 2 N K 4                (C fp32 read and written)
// (the per-row bytes_formula says which).
#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "baselines/cublas_gemm.h"
#include "baselines/cublaslt_epilogue.h"
#include "gemm/gemm_bench.h"
#include "harness/data.h"
#include "harness/family.h"
#include "optimized/buffer.h"
#include "optimized/gemm.h"
#include "testing/gemm_check.h"
#include "testing/tolerance.h"

#if OPTIMIZED_WITH_CUDA
#include "gemm/gemm_describe.h"
#endif

namespace bench {

using optimized::Activation;
using optimized::Buffer;
using optimized::Device;
using optimized::DType;
using optimized::GemmEpilogue;
using optimized::GemmVariant;
using optimized::TensorView;
using optimized::testing::CheckResult;

namespace {

constexpr uint64_t kSeedStride = 16;  // set i: seeds 16 i + {1 A, 2 B, 3 C0, 4 bias, 5 aux}

enum class LinearCase { kBias, kBiasRelu, kBiasGelu, kDGeluBGrad, kWgradF32 };

struct CaseInfo {
  LinearCase c;
  const char* name;
  const char* direction;
  LtEpilogue peer;
};

constexpr CaseInfo kCases[] = {
    {LinearCase::kBias, "bias", "fwd", LtEpilogue::kBias},
    {LinearCase::kBiasRelu, "bias_relu", "fwd", LtEpilogue::kReluBias},
    {LinearCase::kBiasGelu, "bias_gelu", "fwd", LtEpilogue::kGeluAuxBias},
    {LinearCase::kDGeluBGrad, "dgelu_bgrad", "bwd", LtEpilogue::kDGeluBGrad},
    {LinearCase::kWgradF32, "wgrad_f32", "bwd", LtEpilogue::kDefault},
};

const CaseInfo& case_info(LinearCase c) {
  for (const CaseInfo& i : kCases)
    if (i.c == c) return i;
  throw std::logic_error("linear: unknown case");
}

std::string case_names() {
  std::string s;
  for (const CaseInfo& i : kCases) s += (s.empty() ? "" : ", ") + std::string(i.name);
  return s;
}

LinearCase parse_case(const std::string& name) {
  for (const CaseInfo& i : kCases)
    if (name == i.name) return i.c;
  throw std::invalid_argument("--cases: expected " + case_names() + " or all; given '" + name + "'");
}

// The layer's sizes: M tokens, N output features, K input features.
struct LinearShape {
  int64_t m = 0, n = 0, k = 0;
  std::string label() const { return std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k); }
};

// The GEMM a case runs, C (gm, gn) = A (gm, gk) @ B (gk, gn), and its epilogue's tensors.
struct CaseGemm {
  int64_t gm = 0, gn = 0, gk = 0;
  bool a_col_major = false, b_col_major = false;
  DType ab = DType::kBF16, c = DType::kBF16;
  float beta = 0.0f;
  bool bias = false;
  Activation act = Activation::kNone;
  bool act_grad = false;
  bool aux = false;          // forward: written (the pre-activation); activation_grad: read
  bool column_sums = false;  // fp32 (gn)
  bool peer_bgrad = false;   // the cuBLASLt rows write a bias gradient of their own
};

CaseGemm case_gemm(LinearCase c, const LinearShape& s, DType dtype) {
  CaseGemm g;
  g.ab = g.c = dtype;
  g.gm = s.m, g.gn = s.n, g.gk = s.k;
  switch (c) {
    case LinearCase::kBias:
    case LinearCase::kBiasRelu:
    case LinearCase::kBiasGelu:
      g.b_col_major = true;  // W stored (N, K): B = w.t()
      g.bias = true;
      g.act = c == LinearCase::kBiasRelu ? Activation::kRelu
              : c == LinearCase::kBiasGelu ? Activation::kGeluTanh
                                           : Activation::kNone;
      g.aux = c == LinearCase::kBiasGelu;
      break;
    case LinearCase::kDGeluBGrad:
      g.act = Activation::kGeluTanh;  // W (K, N) row-major
      g.act_grad = true;
      g.aux = true;
      g.column_sums = true;
      g.peer_bgrad = true;
      break;
    case LinearCase::kWgradF32:
      g.gm = s.n, g.gn = s.k, g.gk = s.m;  // dW (N, K) = dY^T (N, M) @ X (M, K)
      g.a_col_major = true;                // dY stored (M, N)
      g.c = DType::kF32;
      g.beta = 1.0f;
      g.peer_bgrad = true;  // cublaslt_bgradb: db (N) = sum_t dY[t, :], fp32
      break;
  }
  return g;
}

// min_bytes and its formula (header).
std::pair<double, std::string> case_bytes(LinearCase c, const LinearShape& s, DType dtype) {
  const double e = static_cast<double>(optimized::dtype_size(dtype));
  const double m = static_cast<double>(s.m), n = static_cast<double>(s.n), k = static_cast<double>(s.k);
  switch (c) {
    case LinearCase::kBias:
    case LinearCase::kBiasRelu:
      return {(m * k + n * k + m * n + n) * e, "(M*K + N*K + M*N + N)*E (x, W, bias; y)"};
    case LinearCase::kBiasGelu:
      return {(m * k + n * k + 2 * m * n + n) * e, "(M*K + N*K + 2*M*N + N)*E (x, W, bias; y, aux)"};
    case LinearCase::kDGeluBGrad:
      return {(m * k + k * n + 2 * m * n) * e + 4 * n, "(M*K + K*N + 2*M*N)*E + 4*N (dY, W, aux; dPre, bgrad fp32)"};
    case LinearCase::kWgradF32:
      return {(m * n + m * k) * e + 8 * n * k, "(M*N + M*K)*E + 2*N*K*4 (dY, X, dW fp32; dW fp32)"};
  }
  return {0, ""};
}

std::string lt_peer_name(LtEpilogue e, const CaseGemm& g) {
  switch (e) {
    case LtEpilogue::kBias: return "cublaslt_bias";
    case LtEpilogue::kReluBias: return "cublaslt_relu_bias";
    case LtEpilogue::kGeluAuxBias: return "cublaslt_gelu_aux_bias";
    case LtEpilogue::kDGeluBGrad: return "cublaslt_dgelu_bgrad";
    case LtEpilogue::kBGradRowsOfA: return "cublaslt_bgradb";
    case LtEpilogue::kDefault: return g.c == DType::kF32 ? "cublaslt_f32_out" : "cublaslt";
  }
  return "cublaslt";
}

// A (rows, cols) matrix view: row-major, or column-major ((cols, rows) in memory).
TensorView matrix_view(void* data, DType dtype, Device device, int64_t rows, int64_t cols, bool col_major) {
  if (col_major) return TensorView(data, dtype, device, {rows, cols}, {1, rows});
  return TensorView(data, dtype, device, {rows, cols});
}

double element(const TensorView& t, int64_t i, int64_t j) {
  return optimized::load_as_double(t.data, t.dtype, i * t.strides[0] + j * t.strides[1]);
}

class LinearGroup : public BenchGroup {
 public:
  LinearGroup(LinearCase c, const LinearShape& s, DType dtype, bool on_cuda, int nthreads, int64_t check_columns)
      : case_(c), s_(s), dtype_(dtype), g_(case_gemm(c, s, dtype)), check_columns_(check_columns) {
    family = "linear";
    cuda = on_cuda;
    threads = nthreads;
    label = std::string(case_info(c).name) + " " + std::string(optimized::dtype_name(dtype)) + " " + s.label();
    if (!cuda) label += " cpu " + std::to_string(threads) + (threads == 1 ? " thread" : " threads");
  }

  const CaseGemm& gemm() const { return g_; }
  LtEpilogue peer() const { return case_info(case_).peer; }

  // A planned row: our variant v, or (peer set) a cuBLASLt row with that epilogue.
  void add_row(std::optional<GemmVariant> v, std::optional<LtEpilogue> peer, const std::string& skip) {
    Result r;
    r.op = "linear_" + std::string(case_info(case_).name);
    r.family = "linear";
    r.direction = case_info(case_).direction;
    r.variant = v ? std::string(optimized::gemm_variant_name(*v)) : lt_peer_name(*peer, g_);
    r.backend = v ? (cuda ? "cuda" : "cpu") : "cublaslt";
    r.dtype = std::string(optimized::dtype_name(dtype_));
    r.shape = {{"m", s_.m}, {"n", s_.n}, {"k", s_.k}};
    r.shape_label = s_.label();
    if (!cuda) r.threads = threads;
    r.flops = 2.0 * static_cast<double>(s_.m) * static_cast<double>(s_.n) * static_cast<double>(s_.k);
    const auto [bytes, formula] = case_bytes(case_, s_, dtype_);
    r.min_bytes = bytes;
    r.bytes_formula = formula;
    if (peer && *peer == LtEpilogue::kBGradRowsOfA) {
      r.min_bytes += 4.0 * static_cast<double>(g_.gm);
      r.bytes_formula += " + 4*N (db fp32)";
    }
    if (!skip.empty()) r.status = "skipped", r.reason = skip;
    rows.push_back(r);
    kinds_.push_back({v, peer});
  }

  int64_t set_bytes() const override {
    const int64_t e = static_cast<int64_t>(optimized::dtype_size(g_.ab)), ec = static_cast<int64_t>(optimized::dtype_size(g_.c));
    int64_t b = (g_.gm * g_.gk + g_.gk * g_.gn) * e + g_.gm * g_.gn * ec;
    if (g_.bias) b += g_.gn * ec;
    if (g_.aux) b += g_.gm * g_.gn * ec;
    if (g_.column_sums) b += g_.gn * 4;
    return b;
  }
  int64_t host_budget() const override { return int64_t{2} << 30; }

  void allocate(int nsets, const RunEnv& env) override {
    const Device dev = env.cuda ? Device::cuda(0) : Device::cpu();
    sets_.clear();
    for (int i = 0; i < nsets; ++i) {
      const uint64_t seed = kSeedStride * static_cast<uint64_t>(i);
      const bool first = i == 0;
      Set set;
      set.a = random_buffer(g_.ab, g_.gm * g_.gk, dev, seed + 1, first ? &host_a_ : nullptr);
      set.b = random_buffer(g_.ab, g_.gk * g_.gn, dev, seed + 2, first ? &host_b_ : nullptr);
      if (g_.beta != 0) set.c = random_buffer(g_.c, g_.gm * g_.gn, dev, seed + 3, first ? &host_c0_ : nullptr);
      else set.c = Buffer(g_.c, g_.gm * g_.gn, dev);
      if (g_.bias) set.bias = random_buffer(g_.c, g_.gn, dev, seed + 4, first ? &host_bias_ : nullptr);
      if (g_.aux) {
        if (g_.act_grad) set.aux = random_buffer(g_.c, g_.gm * g_.gn, dev, seed + 5, first ? &host_aux_ : nullptr);
        else set.aux = Buffer(g_.c, g_.gm * g_.gn, dev);
      }
      if (g_.column_sums) set.sums = Buffer(DType::kF32, g_.gn, dev);
      if (g_.peer_bgrad && env.cuda) set.lt_bgrad = Buffer(g_.c, std::max(g_.gm, g_.gn), dev);
      sets_.push_back(std::move(set));
    }
    const size_t es = optimized::dtype_size(g_.c);
    host_out_.resize(static_cast<size_t>(g_.gm * g_.gn) * es);
    if (g_.aux && !g_.act_grad) host_aux_.resize(static_cast<size_t>(g_.gm * g_.gn) * es);
    if (g_.column_sums) host_sums_.resize(static_cast<size_t>(g_.gn));
  }

  void release() override {
    sets_.clear();
    workspace_ = Buffer();
    host_a_.clear(), host_b_.clear(), host_c0_.clear(), host_bias_.clear(), host_aux_.clear(), host_out_.clear();
    host_sums_.clear();
  }

  Candidate row_candidate(size_t i, const RunEnv& env) override {
    const Kind kind = kinds_[i];
    if (!kind.ours) return peer_candidate(*kind.peer, env);
    const GemmVariant v = *kind.ours;
    optimized::ExecutionContext ctx = env.context();
    // The exact workspace the call needs, allocated once (a framework's caching allocator would
    // hand it over the same way); without it the library would allocate and free per call.
    {
      const Views d = views(0);
      GemmEpilogue e = epilogue(d);
      const size_t need = optimized::matmul_workspace_bytes(d.a, d.b, d.c, e, g_.beta, v);
      if (need > workspace_.bytes()) {
        workspace_ = Buffer();
        workspace_ = Buffer(DType::kF8E4M3, static_cast<int64_t>(need), env.cuda ? Device::cuda(0) : Device::cpu());
      }
      ctx.workspace = {need > 0 ? workspace_.data() : nullptr, need};
    }
    Candidate c;
    c.run = [this, v, ctx](int it) {
      const Views d = views(it);
      optimized::matmul(d.a, d.b, d.c, epilogue(d), 1.0f, g_.beta, v, ctx);
    };
    c.prepare = [this] { poison(); };
    c.check = [this] { return check_ours(); };
    c.annotate = [this, v, env](Result& r) {
      const Views d = views(0);
      const GemmEpilogue e = epilogue(d);
      GemmVariant resolved = v;
      if (v == GemmVariant::kAuto) {
        resolved = optimized::resolve_gemm_variant(d.a, d.b, d.c, e);
        r.resolved_variant = std::string(optimized::gemm_variant_name(resolved));
      }
#if OPTIMIZED_WITH_CUDA
      if (env.cuda) {
        try {
          r.kernel = kernel_info_of(optimized::describe_gemm_kernel(d.a, d.b, d.c, 1.0f, g_.beta, resolved, &e));
        } catch (const optimized::Error&) {
          // no kernel report for this variant and these operands: the columns stay empty
        }
      }
#else
      (void)env;
#endif
    };
    return c;
  }

  Candidate baseline_candidate(const RunEnv& env) override { return peer_candidate(peer(), env); }

  void roofline(const std::vector<Ceiling>& ceilings, const std::optional<BaselineResult>&, std::optional<Rate>& peak,
                std::optional<Rate>& bandwidth) const override {
    if (cuda) {
      if (const Ceiling* c = best_ceiling(ceilings, cublas_mode_name(cublas_mode_for(dtype_))))
        peak = Rate{c->name + " " + c->shape, c->value, c->unit};
      if (const Ceiling* c = best_ceiling(ceilings, "device_copy")) bandwidth = Rate{c->name, c->value, c->unit};
      return;
    }
    if (const Ceiling* c = best_ceiling(ceilings, "host_copy")) bandwidth = Rate{c->name, c->value, c->unit};
  }

 private:
  struct Set {
    Buffer a, b, c, bias, aux, sums, lt_bgrad;
  };
  struct Kind {
    std::optional<GemmVariant> ours;
    std::optional<LtEpilogue> peer;
  };
  // The views of one set (device or host alike); epilogue() points into them.
  struct Views {
    TensorView a, b, c, bias, aux, sums;
  };

  const Set& set(int i) const { return sets_[static_cast<size_t>(i) % sets_.size()]; }

  Views views(int i) const {
    const Set& s = set(i);
    const Device dev = s.a.device();
    Views v;
    v.a = matrix_view(s.a.data(), g_.ab, dev, g_.gm, g_.gk, g_.a_col_major);
    v.b = matrix_view(s.b.data(), g_.ab, dev, g_.gk, g_.gn, g_.b_col_major);
    v.c = TensorView(s.c.data(), g_.c, dev, {g_.gm, g_.gn});
    if (g_.bias) v.bias = TensorView(s.bias.data(), g_.c, dev, {g_.gn});
    if (g_.aux) v.aux = TensorView(s.aux.data(), g_.c, dev, {g_.gm, g_.gn});
    if (g_.column_sums) v.sums = TensorView(s.sums.data(), DType::kF32, dev, {g_.gn});
    return v;
  }

  // The host views of set 0 for the check: inputs as generated, outputs as read back.
  Views host_views() {
    const Device cpu = Device::cpu();
    Views v;
    v.a = matrix_view(host_a_.data(), g_.ab, cpu, g_.gm, g_.gk, g_.a_col_major);
    v.b = matrix_view(host_b_.data(), g_.ab, cpu, g_.gk, g_.gn, g_.b_col_major);
    v.c = TensorView(host_out_.data(), g_.c, cpu, {g_.gm, g_.gn});
    if (g_.bias) v.bias = TensorView(host_bias_.data(), g_.c, cpu, {g_.gn});
    if (g_.aux) v.aux = TensorView(host_aux_.data(), g_.c, cpu, {g_.gm, g_.gn});
    if (g_.column_sums) v.sums = TensorView(host_sums_.data(), DType::kF32, cpu, {g_.gn});
    return v;
  }

  GemmEpilogue epilogue(const Views& v, bool with_sums = true) const {
    GemmEpilogue e;
    if (g_.bias) e.bias = &v.bias;
    e.activation = g_.act;
    e.activation_grad = g_.act_grad;
    if (g_.aux) e.aux = &v.aux;
    if (g_.column_sums && with_sums) e.column_sums = &v.sums;
    return e;
  }

  // Set 0's outputs in their pre-run state: C poisoned (NaN), or C0 when beta != 0; aux (when
  // written), the column sums and cuBLASLt's bias gradient poisoned.
  void poison() {
    Set& s = sets_[0];
    if (g_.beta != 0) s.c.copy_from_host(host_c0_.data());
    else s.c.fill_bytes(0xFF);
    if (g_.aux && !g_.act_grad) s.aux.fill_bytes(0xFF);
    if (g_.column_sums) s.sums.fill_bytes(0xFF);
    if (s.lt_bgrad.data()) s.lt_bgrad.fill_bytes(0xFF);
  }

  // Columns of C checked whole (every row, so that each one's sum is checked too): all of them
  // up to 2^27 multiply-adds, else check_columns_ sampled ones plus the first and the last.
  int64_t samples() const {
    const double volume = static_cast<double>(g_.gm) * static_cast<double>(g_.gn) * static_cast<double>(g_.gk);
    return volume <= static_cast<double>(int64_t{1} << 27) ? 0 : check_columns_;
  }

  // Reads set 0's outputs back; check_gemm_epilogue on C, aux and (with_sums) the column sums.
  CheckResult check_outputs(bool with_sums) {
    const Set& s = sets_[0];
    s.c.copy_to_host(host_out_.data());
    if (g_.aux && !g_.act_grad) s.aux.copy_to_host(host_aux_.data());
    if (g_.column_sums && with_sums) s.sums.copy_to_host(host_sums_.data());
    const Views h = host_views();
    TensorView c0;
    if (g_.beta != 0) c0 = TensorView(host_c0_.data(), g_.c, Device::cpu(), {g_.gm, g_.gn});
    return optimized::testing::check_gemm_epilogue(h.a, h.b, g_.beta != 0 ? &c0 : nullptr, h.c,
                                                   epilogue(h, with_sums), 1.0f, g_.beta, samples());
  }

  CheckResult check_ours() { return check_outputs(true); }

  // cuBLASLt's own bias gradient (in C's dtype), checked with its rounding:
  //   kDGeluBGrad:   bgrad[j] against the float64 sum of its own C's column j (C itself validated
  //                  against float64 just before): |got - S| <= (u_c + M u_32) sum|C| + u_c |S| + floor
  //                  (the C values it summed may be the unrounded ones, then fp32 summation, then
  //                  one rounding to C's dtype);
  //   kBGradRowsOfA: db[i] = sum_k A[i, k] against float64: |got - S| <= K u_32 sum|A| + u_c |S| + floor.
  CheckResult check_peer_bgrad(LtEpilogue e) {
    CheckResult r;
    const size_t count = static_cast<size_t>(e == LtEpilogue::kDGeluBGrad ? g_.gn : g_.gm);
    std::vector<uint8_t> got(count * optimized::dtype_size(g_.c));
    copy_prefix(sets_[0].lt_bgrad, got.data(), got.size());
    const double u_c = optimized::testing::unit_roundoff(g_.c), u32 = std::ldexp(1.0, -24);
    const double floor = optimized::testing::reduction_floor(g_.c);
    const Views h = host_views();
    std::vector<double> sum(count, 0.0), mag(count, 0.0);
    int64_t terms = 0;
    if (e == LtEpilogue::kDGeluBGrad) {
      terms = g_.gm;
      for (int64_t i = 0; i < g_.gm; ++i)
        for (int64_t j = 0; j < g_.gn; ++j) {
          const double x = optimized::load_as_double(host_out_.data(), g_.c, i * g_.gn + j);
          sum[static_cast<size_t>(j)] += x;
          mag[static_cast<size_t>(j)] += std::fabs(x);
        }
    } else {
      terms = g_.gk;
      for (int64_t i = 0; i < g_.gm; ++i)
        for (int64_t kk = 0; kk < g_.gk; ++kk) {
          const double x = element(h.a, i, kk);
          sum[static_cast<size_t>(i)] += x;
          mag[static_cast<size_t>(i)] += std::fabs(x);
        }
    }
    const double rel = (e == LtEpilogue::kDGeluBGrad ? u_c : 0.0) + static_cast<double>(terms) * u32;
    for (size_t j = 0; j < count; ++j) {
      const double g = optimized::load_as_double(got.data(), g_.c, static_cast<int64_t>(j));
      const double allowed = rel * mag[j] + u_c * std::fabs(sum[j]) + floor;
      double ratio = 0;
      ++r.checked;
      if (!optimized::testing::element_ok(g, sum[j], allowed, &ratio) && r.failures++ == 0)
        r.first_failure = "bgrad[" + std::to_string(j) + "] = " + std::to_string(g) + ", expected " +
                          std::to_string(sum[j]) + " (allowed error " + std::to_string(allowed) + ")";
      r.worst_ratio = std::max(r.worst_ratio, ratio);
    }
    r.passed = r.failures == 0 && r.checked > 0;
    return r;
  }

  // The first `bytes` of a buffer, to the host.
  static void copy_prefix(const Buffer& b, void* dst, size_t bytes) {
    std::vector<uint8_t> all(b.bytes());
    b.copy_to_host(all.data());
    std::copy(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(bytes), static_cast<uint8_t*>(dst));
  }

  Candidate peer_candidate([[maybe_unused]] LtEpilogue e, [[maybe_unused]] const RunEnv& env) {
#if OPTIMIZED_WITH_CUDA
    if (!env.cuda) throw std::logic_error("linear: a cuBLASLt row in a CPU group");
    auto lt = std::make_shared<CublasLtEpilogue>(env.stream);
    LtProblem q;
    q.ab = g_.ab, q.c = g_.c, q.m = g_.gm, q.n = g_.gn, q.k = g_.gk;
    q.a_col_major = g_.a_col_major, q.b_col_major = g_.b_col_major;
    q.beta = g_.beta;
    q.epilogue = e;
    Candidate c;
    c.run = [this, lt, q](int it) {
      const Set& s = set(it);
      LtPointers p;
      p.a = s.a.data(), p.b = s.b.data(), p.c = s.c.data();
      p.bias = s.bias.data();
      p.aux = s.aux.data();
      p.bgrad = s.lt_bgrad.data();
      try {
        lt->run(q, p);
      } catch (const CublasLtUnsupported& ex) {
        throw optimized::Error(optimized::Status::kUnsupported, ex.what());  // the row: "skipped"
      }
    };
    c.prepare = [this] { poison(); };
    c.check = [this, e] {
      CheckResult r = check_outputs(false);
      if (e == LtEpilogue::kDGeluBGrad || e == LtEpilogue::kBGradRowsOfA) r.merge(check_peer_bgrad(e), "bias gradient: ");
      return r;
    };
    return c;
#else
    throw std::runtime_error("cuBLASLt needs a CUDA build");
#endif
  }

  LinearCase case_;
  LinearShape s_;
  DType dtype_;
  CaseGemm g_;
  int64_t check_columns_;
  std::vector<Kind> kinds_;  // per row
  std::vector<Set> sets_;
  Buffer workspace_;
  std::vector<uint8_t> host_a_, host_b_, host_c0_, host_bias_, host_aux_, host_out_;
  std::vector<float> host_sums_;
};

// The default (N, K): a square projection and an MLP's up (4096 -> 14336) and down projections.
constexpr std::pair<int64_t, int64_t> kDefaultWidths[] = {{4096, 4096}, {14336, 4096}, {4096, 14336}};

struct LinearConfig {
  std::vector<LinearCase> cases;
  std::vector<LinearShape> shapes;
  std::vector<DType> dtypes;
  std::vector<GemmVariant> variants;
  int threads = 0;  // CPU rows
  // 14 sampled + the first and the last: 16 columns, one per thread of check_gemm_epilogue on a
  // 16-core host (each column is a whole M x K dot-product sweep in float64).
  int64_t check_columns = 14;
  int64_t cpu_naive_max = 512, cpu_blocked_max = 1024;  // CPU rungs run up to M N K <= cap^3
  bool baselines = true;
};

// "cpu_naive, ..., wgmma_persistent, auto": the variants that take epilogues.
std::string epilogue_variant_names() {
  std::string s;
  for (GemmVariant v : optimized::all_gemm_variants())
    if (optimized::gemm_variant_supports_epilogue(v)) s += std::string(optimized::gemm_variant_name(v)) + ", ";
  return s + "auto";
}

Groups linear_groups(const LinearConfig& cfg, bool gpu) {
  Groups groups;
  for (LinearCase lc : cfg.cases)
    for (const LinearShape& shape : cfg.shapes)
      for (DType dtype : cfg.dtypes)
        for (bool on_cuda : {true, false}) {
          auto g = std::make_unique<LinearGroup>(lc, shape, dtype, on_cuda, on_cuda ? 0 : cfg.threads, cfg.check_columns);
          const CaseGemm& gm = g->gemm();
          const double volume = static_cast<double>(shape.m) * static_cast<double>(shape.n) * static_cast<double>(shape.k);
          for (GemmVariant v : cfg.variants) {
            const bool row_cuda = v == GemmVariant::kAuto ? gpu : optimized::gemm_variant_is_cuda(v);
            if (row_cuda != on_cuda) continue;
            const std::string name(optimized::gemm_variant_name(v));
            std::string skip;
            if (on_cuda && !gpu) skip = "no CUDA GPU found (" + optimized::cuda_unavailable_reason() + ")";
            if (skip.empty() && !optimized::gemm_variant_supports_epilogue(v))
              skip = name + " does not fuse epilogues (the variants that do: " + epilogue_variant_names() + ")";
            if (skip.empty() && v != GemmVariant::kAuto) skip = optimized::gemm_variant_rejects_dtype(v, dtype);
            // Forced, the Hopper rungs load through TMA: stored rows must be multiples of 16 bytes.
            const int64_t per16 = 16 / static_cast<int64_t>(optimized::dtype_size(dtype));
            const int64_t a_width = gm.a_col_major ? gm.gm : gm.gk, b_width = gm.b_col_major ? gm.gk : gm.gn;
            if (skip.empty() && name.starts_with("wgmma_") && (a_width % per16 != 0 || b_width % per16 != 0))
              skip = "TMA needs rows of A and B 16-byte aligned (stored widths multiples of " + std::to_string(per16) +
                     " here); auto copies them into aligned rows or runs mma_pipeline";
            if (skip.empty() && v == GemmVariant::kCpuNaive && volume > std::pow(static_cast<double>(cfg.cpu_naive_max), 3))
              skip = "too slow above " + std::to_string(cfg.cpu_naive_max) + "^3";
            if (skip.empty() && v == GemmVariant::kCpuBlocked &&
                volume > std::pow(static_cast<double>(cfg.cpu_blocked_max), 3))
              skip = "too slow above " + std::to_string(cfg.cpu_blocked_max) + "^3";
            g->add_row(v, std::nullopt, skip);
          }
          if (on_cuda && gpu && cfg.baselines && !g->rows.empty()) {
            g->baseline = BaselinePlan{lt_peer_name(g->peer(), gm), -1, true};
            // What fusing the bias gradient into the weight-gradient GEMM costs cuBLASLt.
            if (lc == LinearCase::kWgradF32) g->add_row(std::nullopt, LtEpilogue::kBGradRowsOfA, "");
          }
          if (!g->rows.empty()) groups.push_back(std::move(g));
        }
  return groups;
}

class LinearFamily : public Family {
 public:
  CLI::App* add_subcommand(CLI::App& app) override {
    CLI::App* sub = app.add_subcommand(
        "linear",
        "Benchmark the GEMMs of a linear layer with fused epilogues (bias, relu, gelu + aux, dgelu + bias gradient,\n"
        "fp32 weight gradient) against cuBLASLt's own epilogues, measured in the same run");
    sub->add_option("--size", sizes_,
                    "MxNxK: M tokens, N output features, K input features; repeat or separate with commas "
                    "[default: M 8192 and 4096 with NxK 4096x4096, 14336x4096, 4096x14336]")
        ->delimiter(',');
    sub->add_option("--cases", cases_, "all, or some of " + case_names() + "; separated by commas")
        ->delimiter(',')
        ->capture_default_str();
    sub->add_option("--dtype", dtypes_, "bf16, fp16; separated by commas")->delimiter(',')->capture_default_str();
    sub->add_option("--variant", variants_,
                    "all | cpu | cuda (the rungs that fuse epilogues) | names (" + epilogue_variant_names() +
                        "), separated by commas")
        ->delimiter(',')
        ->capture_default_str();
    sub->add_option("--threads", threads_, "CPU threads of the CPU rows (0: all)")->capture_default_str();
    sub->add_option("--check-columns", check_columns_,
                    "Columns of C validated (whole, with their sums) beyond 2^27 multiply-adds; all below")
        ->capture_default_str();
    sub->add_flag("--no-baseline", no_baseline_, "Do not measure cuBLASLt next to each group");
    sub->add_flag("--no-ceilings", no_ceilings_, "Do not measure the ceilings (no roofline column)");
    return sub;
  }

  void add_all_options(CLI::App&) override {}

  SubcommandPlan plan(const Env& env, const CLI::App&, MeasureOptions& measure) override {
    LinearConfig cfg;
    for (const std::string& text : split_commas(sizes_)) {
      const std::vector<int64_t> p = parse_sizes(text, "xX");
      if (p.size() == 1) cfg.shapes.push_back({p[0], p[0], p[0]});
      else if (p.size() == 3) cfg.shapes.push_back({p[0], p[1], p[2]});
      else throw std::invalid_argument("--size: expected N or MxNxK (tokens x out x in) with positive integers; given '" + text + "'");
    }
    if (cfg.shapes.empty())
      for (int64_t m : {8192, 4096})
        for (const auto& [n, k] : kDefaultWidths) cfg.shapes.push_back({m, n, k});
    for (const std::string& c : split_commas(cases_)) {
      if (c == "all") {
        for (const CaseInfo& i : kCases)
          if (std::find(cfg.cases.begin(), cfg.cases.end(), i.c) == cfg.cases.end()) cfg.cases.push_back(i.c);
      } else if (const LinearCase lc = parse_case(c); std::find(cfg.cases.begin(), cfg.cases.end(), lc) == cfg.cases.end()) {
        cfg.cases.push_back(lc);
      }
    }
    cfg.dtypes = parse_float_dtypes(dtypes_, "--dtype: linear takes");
    for (DType d : cfg.dtypes)
      if (d == DType::kF32)
        throw std::invalid_argument("--dtype: linear takes bf16 or fp16 (the fp32-output case is wgrad_f32); given 'fp32'");
    // "all" / "cuda" / "cpu": the rungs that fuse epilogues (the others would only be skipped).
    cfg.variants = parse_gemm_variants(variants_, &optimized::gemm_variant_supports_epilogue, true);
    if (threads_ < 0) throw std::invalid_argument("--threads: expected >= 0; given " + std::to_string(threads_));
    cfg.threads = threads_ == 0 ? all_threads() : threads_;
    if (check_columns_ < 1) throw std::invalid_argument("--check-columns: expected >= 1; given " + std::to_string(check_columns_));
    cfg.check_columns = check_columns_;
    cfg.baselines = !no_baseline_;

    SubcommandPlan plan;
    bool has_gpu_rows = false, has_cpu_rows = false;
    for (GemmVariant v : cfg.variants)
      ((v == GemmVariant::kAuto ? env.gpu : optimized::gemm_variant_is_cuda(v)) ? has_gpu_rows : has_cpu_rows) = true;
    if (has_gpu_rows && !env.gpu)
      plan.notes.push_back("no CUDA GPU found (" + optimized::cuda_unavailable_reason() + "): the CUDA rows are skipped");
    if (!no_ceilings_) {
      if (has_gpu_rows && env.gpu) {
        plan.ceilings.device_copy = true;
        for (DType d : cfg.dtypes) plan.ceilings.cublas_modes.push_back(cublas_mode_for(d));
      }
      plan.ceilings.host_copy = has_cpu_rows;
    }
    plan.notes.push_back(
        "linear: sizes are M tokens x N out x K in; flops 2MNK. bias/bias_relu/bias_gelu: y (M,N) = act(x (M,K) @ W^T + b), "
        "W stored (N,K) (B = w.t()), bias per column, vs cuBLASLt BIAS / RELU_BIAS / GELU_AUX_BIAS (aux = the "
        "pre-activation in C's dtype for both; both GELUs the tanh form)");
    plan.notes.push_back(
        "linear dgelu_bgrad: dPre (M,N) = (dY (M,K) @ W (K,N)) * gelu_tanh'(aux), bgrad = sum over the M rows; ours "
        "writes bgrad in fp32 (column_sums), cuBLASLt DGELU_BGRAD in C's dtype (its rule): the same product and "
        "reduction, its bgrad validated against the float64 sums of its own output");
    plan.notes.push_back(
        "linear wgrad_f32: dW (N,K) fp32 += dY^T (N,M) @ X (M,K), bf16/fp16 inputs, beta 1, vs cuBLASLt with an fp32 "
        "C; the cublaslt_bgradb row also writes db = sum_t dY[t,:] (BGRADB, fp32), a fusion our epilogue has no "
        "form for (column_sums sum the output's rows): its ratio is to plain cuBLASLt");
    plan.runs.push_back({linear_groups(cfg, env.gpu), measure, {}});
    return plan;
  }

  // Not part of `optimized-bench all` (its GPU rows would add minutes): run `linear` itself.
  std::vector<FamilyRun> plan_all(const AllOptions&, const MeasureOptions&) override { return {}; }

 private:
  std::vector<std::string> sizes_, cases_{"all"}, dtypes_{"bf16"}, variants_{"auto", "wgmma_persistent", "mma_pipeline"};
  int threads_ = 0;
  int64_t check_columns_ = 14;
  bool no_baseline_ = false, no_ceilings_ = false;
};

}  // namespace

std::unique_ptr<Family> make_linear_family() { return std::make_unique<LinearFamily>(); }

}  // namespace bench
