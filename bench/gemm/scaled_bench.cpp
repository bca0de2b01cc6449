// The scaled (fp8) GEMM plug-in of optimized-bench: `optimized-bench scaled_mm`. For each (shape,
// formats, scale layout, operand layout, output dtype) a group of scaled_matmul variants on random
// fp8 operands (uniform [-1, 1] rounded to fp8, a fixed seed per rotating set) and random scales
// in [0.5, 2), each validated against the float64 reference of the dequantized inputs
// (check_scaled_gemm, promotion every 128 of K), then timed next to cuBLASLt's fp8 GEMM on the same
// operands in the same run (per-tensor or per-row/column scales as the rows; for block scales,
// cuBLASLt with per-tensor scales: the block-scaled target is a ratio to the per-tensor
// rate).
//   flops = 2 M N K; min_bytes = M K + K N (fp8) + M N E_out.
// --layout TN (default): A row-major, B column-major (both K-major: what fp8 wgmma and cuBLASLt
// take); NN: B row-major, so wgmma_fp8 copies it K-major first (the cost the layout adds, inside
// the timed call); the cuBLASLt baseline always runs on K-major copies (one per rotating set) made
// outside the timing.
#include <algorithm>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>

#include "baselines/cublaslt_fp8.h"
#include "gemm/cutlass_peers.h"
#include "harness/data.h"
#include "gemm/gemm_bench.h"
#include "harness/family.h"
#include "optimized/buffer.h"
#include "optimized/gemm.h"
#include "testing/scaled_gemm_reference.h"

#if OPTIMIZED_WITH_CUDA
#include "gemm/gemm_describe.h"
#endif

namespace bench {

using optimized::Buffer;
using optimized::Device;
using optimized::DType;
using optimized::ScaledGemmVariant;
using optimized::ScaleLayout;
using optimized::TensorView;

namespace {

constexpr uint64_t kSeedStride = 16;

struct ScaledShape {
  int64_t m, n, k;
  std::string label() const { return std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k); }
};

// The scale layouts of a group: "tensor", "rowwise", or "block" (A 1x128, B 128x128: DeepSeek-V3's).
struct ScaleMode {
  std::string name;
  ScaleLayout a, b;
};

ScaleMode parse_scale_mode(const std::string& s) {
  if (s == "tensor") return {s, ScaleLayout::kTensor, ScaleLayout::kTensor};
  if (s == "rowwise") return {s, ScaleLayout::kRowwise, ScaleLayout::kRowwise};
  if (s == "block") return {s, ScaleLayout::kBlock1x128, ScaleLayout::kBlock128x128};
  throw std::invalid_argument("--scales: expected tensor, rowwise or block; given '" + s + "'");
}

struct ScaledConfig {
  std::vector<ScaledShape> shapes;
  std::vector<std::pair<DType, DType>> formats;  // (a, b)
  std::vector<ScaleMode> scales;
  std::vector<bool> b_row_major;  // layouts: false TN, true NN
  DType out = DType::kBF16;
  std::vector<ScaledGemmVariant> variants;
  std::vector<std::string> peers;  // CUTLASS peers (parse_cutlass_peers), rows of the CUDA groups after ours
  bool baselines = true;
};

std::vector<float> random_scales(int64_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(0.5f, 2.0f);
  std::vector<float> s(static_cast<size_t>(count));
  for (float& x : s) x = dist(rng);
  return s;
}

optimized::testing::Fp8Format fp8_format(DType d) {
  return d == DType::kF8E5M2 ? optimized::testing::Fp8Format::kE5M2 : optimized::testing::Fp8Format::kE4M3;
}

class ScaledGroup : public BenchGroup {
 public:
  ScaledGroup(const ScaledShape& s, DType fa, DType fb, const ScaleMode& scales, bool b_row_major, DType out,
              bool on_cuda)
      : s_(s), fa_(fa), fb_(fb), scales_(scales), b_row_major_(b_row_major), out_(out) {
    family = "scaled_mm";
    cuda = on_cuda;
    label = std::string(optimized::dtype_name(fa)) + "x" + std::string(optimized::dtype_name(fb)) + " -> " +
            std::string(optimized::dtype_name(out)) + " " + s.label() + " " + layout() + " scales " + scales.name;
  }

  std::string layout() const { return b_row_major_ ? "NN" : "TN"; }

  // A row of variant v, or of the peer named `peer` (a CUTLASS GEMM).
  void add_row(ScaledGemmVariant v, const std::string& skip, const std::string& peer = "") {
    Result r;
    r.op = "scaled_mm";
    r.variant = peer.empty() ? std::string(optimized::scaled_gemm_variant_name(v)) : peer;
    r.backend = cuda ? "cuda" : "cpu";
    // "e4m3xe5m2>bf16": the formats of A and B, then the output's dtype.
    const auto fmt = [](DType d) { return std::string(optimized::dtype_name(d)).substr(4); };
    r.dtype = fmt(fa_) + "x" + fmt(fb_) + ">" + std::string(optimized::dtype_name(out_));
    r.shape = {{"m", s_.m}, {"n", s_.n}, {"k", s_.k}, {"b_row_major", b_row_major_ ? 1 : 0}};
    r.shape_label = s_.label() + " " + layout() + " " + scales_.name;
    r.flops = 2.0 * s_.m * s_.n * s_.k;
    r.min_bytes = static_cast<double>(s_.m * s_.k + s_.k * s_.n) +
                  static_cast<double>(s_.m * s_.n) * static_cast<double>(optimized::dtype_size(out_));
    if (!skip.empty()) r.status = "skipped", r.reason = skip;
    rows.push_back(r);
    variants_.push_back(v);
    peers_.push_back(peer);
  }

  // The problem as the CUTLASS peers take it: per-tensor scales as alpha, read on the device.
  CutlassProblem cutlass_problem() const {
    CutlassProblem p;
    p.m = s_.m, p.n = s_.n, p.k = s_.k;
    p.trans_b = !b_row_major_;
    p.in = fa_;
    p.out = out_;
    p.alpha_device = static_cast<const float*>(alpha_.data());
    return p;
  }

  // Why the CUTLASS peer `peer` cannot run this group ("" when it can).
  std::string cutlass_rejects(const std::string& peer) const {
    if (scales_.a != ScaleLayout::kTensor || scales_.b != ScaleLayout::kTensor)
      return "the CUTLASS peers take per-tensor scales only (alpha = scale_a * scale_b); " + scales_.name +
             " scales would need CUTLASS's row/column-broadcast (EVT) or blockwise-scaled kernels, not built";
    if (fa_ != DType::kF8E4M3 || fb_ != DType::kF8E4M3) return "the CUTLASS peers are built for e4m3 x e4m3 only";
    return cutlass_peer_rejects(peer, cutlass_problem());
  }

  int64_t set_bytes() const override {
    return s_.m * s_.k + s_.k * s_.n + s_.m * s_.n * static_cast<int64_t>(optimized::dtype_size(out_));
  }

  void allocate(int sets, const RunEnv& env) override {
    const Device dev = env.cuda ? Device::cuda(0) : Device::cpu();
    sets_.clear();
    for (int i = 0; i < sets; ++i) {
      const uint64_t seed = kSeedStride * static_cast<uint64_t>(i);
      Set set;
      set.a = random_buffer(fa_, s_.m * s_.k, dev, seed + 1, i == 0 ? &host_a_ : nullptr);
      set.b = random_buffer(fb_, s_.k * s_.n, dev, seed + 2, i == 0 ? &host_b_ : nullptr);
      set.c = Buffer(out_, s_.m * s_.n, dev);
      sets_.push_back(std::move(set));
    }
    const auto upload = [&](const std::vector<float>& h) {
      Buffer b(DType::kF32, static_cast<int64_t>(h.size()), dev);
      b.copy_from_host(h.data());
      return b;
    };
    host_sa_ = random_scales(optimized::scale_count(scales_.a, s_.m, s_.k, true), 101);
    host_sb_ = random_scales(optimized::scale_count(scales_.b, s_.k, s_.n, false), 102);
    sa_ = upload(host_sa_);
    sb_ = upload(host_sb_);
    // The CUTLASS peers' alpha: the product of the per-tensor scales (fp32, as cuBLASLt forms it).
    if (scales_.a == ScaleLayout::kTensor && scales_.b == ScaleLayout::kTensor)
      alpha_ = upload({host_sa_[0] * host_sb_[0]});
    host_out_.resize(static_cast<size_t>(s_.m * s_.n) * optimized::dtype_size(out_));
  }
  void release() override {
    sets_.clear();
    sa_ = Buffer();
    sb_ = Buffer();
    alpha_ = Buffer();
    lt_b_.clear();
    lt_sa_ = Buffer();
    lt_sb_ = Buffer();
  }

  // A (M, K) row-major; B stored (N, K) (TN) or (K, N) (NN).
  TensorView a(int i) const { return TensorView(set(i).a.data(), fa_, set(i).a.device(), {s_.m, s_.k}); }
  TensorView b(int i) const {
    if (b_row_major_) return TensorView(set(i).b.data(), fb_, set(i).b.device(), {s_.k, s_.n});
    return TensorView(set(i).b.data(), fb_, set(i).b.device(), {s_.k, s_.n}, {1, s_.k});
  }
  TensorView c(int i) const { return TensorView(set(i).c.data(), out_, set(i).c.device(), {s_.m, s_.n}); }
  TensorView scale(const Buffer& buf) const {
    return TensorView(buf.data(), DType::kF32, buf.device(), {buf.count()});
  }

  Candidate row_candidate(size_t i, const RunEnv& env) override {
    if (!peers_[i].empty()) return peer_candidate(peers_[i], env);
    const ScaledGemmVariant v = variants_[i];
    const optimized::ExecutionContext ctx = env.context();
    Candidate cand = checked([this, v, ctx](int it) {
      optimized::scaled_matmul(a(it), b(it), c(it), scale(sa_), scales_.a, scale(sb_), scales_.b, nullptr, v, ctx);
    });
    cand.annotate = [this, v, env](Result& r) {
      if (v == ScaledGemmVariant::kAuto)
        r.resolved_variant = std::string(
            optimized::scaled_gemm_variant_name(optimized::resolve_scaled_gemm_variant(a(0), b(0), c(0))));
#if OPTIMIZED_WITH_CUDA
      if (env.cuda) {
        try {
          const TensorView sa = scale(sa_), sb = scale(sb_);
          r.kernel = kernel_info_of(optimized::describe_scaled_gemm_kernel(a(0), b(0), c(0), sa, scales_.a, sb,
                                                                           scales_.b, nullptr, v));
        } catch (const optimized::Error&) {
          // a variant without a kernel report for these operands: the column stays empty
        }
      }
#else
      (void)env;
#endif
    };
    return cand;
  }

  Candidate baseline_candidate(const RunEnv& env) override {
#if OPTIMIZED_WITH_CUDA
    auto lt = std::make_shared<CublasLtFp8>(env.stream);
    // cuBLASLt reads B K-major: a K-major copy of set 0's B for the NN groups (outside the timing),
    // and per-tensor scales for the block groups (their product with the row's at the same scale).
    const bool block = scales_.a != ScaleLayout::kTensor && scales_.a != ScaleLayout::kRowwise;
    if (block) {
      lt_sa_ = Buffer(DType::kF32, 1, Device::cuda(0));
      lt_sb_ = Buffer(DType::kF32, 1, Device::cuda(0));
      const float one = 1.0f;
      lt_sa_.copy_from_host(&one);
      lt_sb_.copy_from_host(&one);
    }
    if (b_row_major_) {
      // One K-major copy per rotating set (the same data as the set's B, regenerated from its seed),
      // so that the baseline rotates through as many bytes as the rows do.
      lt_b_.clear();
      for (size_t i = 0; i < sets_.size(); ++i) {
        const std::vector<uint8_t> rows =
            i == 0 ? host_b_ : random_host(fb_, s_.k * s_.n, kSeedStride * static_cast<uint64_t>(i) + 2);
        std::vector<uint8_t> t(static_cast<size_t>(s_.k * s_.n));
        for (int64_t kk = 0; kk < s_.k; ++kk)
          for (int64_t j = 0; j < s_.n; ++j) t[j * s_.k + kk] = rows[kk * s_.n + j];
        lt_b_.emplace_back(fb_, s_.k * s_.n, Device::cuda(0));
        lt_b_.back().copy_from_host(t.data());
      }
    }
    const bool rowwise = scales_.a == ScaleLayout::kRowwise;
    return checked(
        [this, lt, block, rowwise](int i) {
          const Set& st = set(i);
          const void* bk = b_row_major_ ? lt_b_[static_cast<size_t>(i) % lt_b_.size()].data() : st.b.data();
          lt->run(fa_, fb_, out_, s_.m, s_.n, s_.k, st.a.data(), bk, st.c.data(),
                  static_cast<const float*>(block ? lt_sa_.data() : sa_.data()),
                  static_cast<const float*>(block ? lt_sb_.data() : sb_.data()), rowwise);
        },
        block);
#else
    (void)env;
    throw std::runtime_error("cuBLASLt needs a CUDA build");
#endif
  }

  void roofline(const std::vector<Ceiling>& ceilings, const std::optional<BaselineResult>&, std::optional<Rate>&,
                std::optional<Rate>& bandwidth) const override {
    if (const Ceiling* c = best_ceiling(ceilings, cuda ? "device_copy" : "host_copy"))
      bandwidth = Rate{c->name, c->value, c->unit};
  }

 private:
  struct Set {
    Buffer a, b, c;
  };

  // A CUTLASS peer initialized for every rotating set (outside the timing), validated like the rows.
  Candidate peer_candidate(const std::string& name, const RunEnv& env) {
    std::vector<CutlassOperands> sets;
    for (const Set& st : sets_) sets.push_back({st.a.data(), st.b.data(), st.c.data()});
    std::shared_ptr<CutlassGemm> gemm = make_cutlass_gemm(name, cutlass_problem(), sets, env.stream);
    void* stream = env.stream;
    Candidate c = checked([gemm, stream](int it) { gemm->run(it, stream); });
    c.annotate = [gemm](Result& r) { r.kernel = gemm->report(); };
    return c;
  }
  const Set& set(int i) const { return sets_[static_cast<size_t>(i) % sets_.size()]; }

  // A candidate validated on set 0 (output poisoned first). unit_scales: the baseline of a block
  // group, which ran with scales of 1.
  Candidate checked(std::function<void(int)> run, bool unit_scales = false) {
    Candidate c;
    c.run = std::move(run);
    c.prepare = [this] { sets_[0].c.fill_bytes(0xFF); };
    c.check = [this, unit_scales] {
      sets_[0].c.copy_to_host(host_out_.data());
      using optimized::testing::ScaledOperand;
      static const float one = 1.0f;
      ScaledOperand A{host_a_.data(), s_.m, s_.k, s_.k, 1, fp8_format(fa_),
                      unit_scales ? &one : host_sa_.data(), unit_scales ? ScaleLayout::kTensor : scales_.a};
      ScaledOperand B{host_b_.data(), s_.k, s_.n, b_row_major_ ? s_.n : 1, b_row_major_ ? 1 : s_.k, fp8_format(fb_),
                      unit_scales ? &one : host_sb_.data(), unit_scales ? ScaleLayout::kTensor : scales_.b};
      const double volume = static_cast<double>(s_.m) * s_.n * s_.k;
      const int64_t samples = volume <= static_cast<double>(int64_t{1} << 27) ? 0 : 2048;
      return optimized::testing::check_scaled_gemm(A, B, nullptr, host_out_.data(), out_, s_.n, 128, samples);
    };
    return c;
  }

  ScaledShape s_;
  DType fa_, fb_;
  ScaleMode scales_;
  bool b_row_major_;
  DType out_;
  std::vector<ScaledGemmVariant> variants_;
  std::vector<std::string> peers_;  // per row: the peer's name, or "" for variants_[row]
  std::vector<Set> sets_;
  Buffer sa_, sb_, alpha_, lt_sa_, lt_sb_;
  std::vector<Buffer> lt_b_;  // NN groups: K-major copies of each set's B for cuBLASLt
  std::vector<uint8_t> host_a_, host_b_, host_out_;
  std::vector<float> host_sa_, host_sb_;
};

Groups scaled_groups(const ScaledConfig& cfg, bool gpu) {
  Groups groups;
  for (const ScaledShape& shape : cfg.shapes)
    for (const auto& [fa, fb] : cfg.formats)
      for (const ScaleMode& sm : cfg.scales)
        for (bool nn : cfg.b_row_major)
          for (bool on_cuda : {true, false}) {
            auto g = std::make_unique<ScaledGroup>(shape, fa, fb, sm, nn, cfg.out, on_cuda);
            for (ScaledGemmVariant v : cfg.variants) {
              const bool row_cuda = v == ScaledGemmVariant::kAuto ? gpu : optimized::scaled_gemm_variant_is_cuda(v);
              if (row_cuda != on_cuda) continue;
              std::string skip;
              if (on_cuda && !gpu) skip = "no CUDA GPU found (" + optimized::cuda_unavailable_reason() + ")";
              g->add_row(v, skip);
            }
            if (on_cuda) {
              const std::vector<std::string> built = cutlass_peer_names(DType::kF8E4M3);
              for (const std::string& peer : cfg.peers) {
                if (std::find(built.begin(), built.end(), peer) == built.end()) continue;  // a bf16-only peer
                std::string skip = g->cutlass_rejects(peer);  // what the kernel cannot take, then the device
                if (skip.empty() && !gpu) skip = "no CUDA GPU found (" + optimized::cuda_unavailable_reason() + ")";
                if (skip.empty()) skip = cutlass_device_rejects();
                g->add_row(ScaledGemmVariant::kAuto, skip, peer);
              }
            }
            if (on_cuda && gpu && cfg.baselines) {
              const bool block = sm.a == ScaleLayout::kBlock1x128;
              g->baseline = BaselinePlan{block ? "cublaslt_fp8_tensor" : "cublaslt_fp8_" + sm.name, -1, true};
            }
            if (!g->rows.empty()) groups.push_back(std::move(g));
          }
  return groups;
}

class ScaledFamily : public Family {
 public:
  CLI::App* add_subcommand(CLI::App& app) override {
    CLI::App* sub = app.add_subcommand("scaled_mm", "Benchmark the scaled (fp8) GEMM against cuBLASLt fp8");
    sub->add_option("--size", sizes_, "N (N^3) or MxNxK; repeat or separate with commas [default: 8192]")
        ->delimiter(',');
    sub->add_option("--format", formats_, "e4m3 (e4m3 x e4m3), e4m3xe5m2, e5m2xe4m3; separated by commas")
        ->delimiter(',')
        ->capture_default_str();
    sub->add_option("--scales", scales_, "tensor, rowwise, block (A 1x128, B 128x128); separated by commas")
        ->delimiter(',')
        ->capture_default_str();
    sub->add_option("--layout", layouts_, "TN (B column-major: K-major, the fast path), NN (B row-major)")
        ->delimiter(',')
        ->capture_default_str();
    sub->add_option("--out", out_, "output dtype: bf16, fp16, fp32")->capture_default_str();
    sub->add_option("--variant", variants_, "auto, cpu, naive, wgmma_fp8, or all; separated by commas")
        ->delimiter(',')
        ->capture_default_str();
    sub->add_option("--peers", peers_,
                    "CUTLASS fp8 GEMMs timed as rows beside ours, validated the same way: cutlass (all: "
                    "cutlass_ws_128x128, cutlass_ws_128x192, cutlass_pingpong_64x128, cutlass_pingpong_64x192, "
                    "cutlass_sm89; e4m3 x e4m3, per-tensor scales, layout TN, bf16 out), names, or none")
        ->delimiter(',');
    sub->add_flag("--no-baseline", no_baseline_, "Do not measure cuBLASLt next to each group");
    return sub;
  }
  void add_all_options(CLI::App&) override {}

  SubcommandPlan plan(const Env& env, const CLI::App&, MeasureOptions& measure) override {
    ScaledConfig cfg;
    for (const std::string& text : split_commas(sizes_)) {
      const std::vector<int64_t> p = parse_sizes(text, "xX");
      if (p.size() == 1) cfg.shapes.push_back({p[0], p[0], p[0]});
      else if (p.size() == 3) cfg.shapes.push_back({p[0], p[1], p[2]});
      else throw std::invalid_argument("--size: expected N or MxNxK with positive integers; given '" + text + "'");
    }
    if (cfg.shapes.empty()) cfg.shapes.push_back({8192, 8192, 8192});
    for (const std::string& f : split_commas(formats_)) {
      if (f == "e4m3") cfg.formats.emplace_back(DType::kF8E4M3, DType::kF8E4M3);
      else if (f == "e4m3xe5m2") cfg.formats.emplace_back(DType::kF8E4M3, DType::kF8E5M2);
      else if (f == "e5m2xe4m3") cfg.formats.emplace_back(DType::kF8E5M2, DType::kF8E4M3);
      else throw std::invalid_argument("--format: expected e4m3, e4m3xe5m2 or e5m2xe4m3; given '" + f + "'");
    }
    for (const std::string& s : split_commas(scales_)) cfg.scales.push_back(parse_scale_mode(s));
    for (const std::string& l : split_commas(layouts_)) {
      if (l != "TN" && l != "NN") throw std::invalid_argument("--layout: expected TN or NN; given '" + l + "'");
      cfg.b_row_major.push_back(l == "NN");
    }
    cfg.out = optimized::parse_dtype(out_);
    if (cfg.out != DType::kBF16 && cfg.out != DType::kF16 && cfg.out != DType::kF32)
      throw std::invalid_argument("--out: expected bf16, fp16 or fp32; given '" + out_ + "'");
    for (const std::string& v : split_commas(variants_)) {
      if (v == "all") {
        for (ScaledGemmVariant x : optimized::all_scaled_gemm_variants()) cfg.variants.push_back(x);
        cfg.variants.push_back(ScaledGemmVariant::kAuto);
      } else {
        cfg.variants.push_back(optimized::parse_scaled_gemm_variant(v));
      }
    }
    cfg.baselines = !no_baseline_;
    cfg.peers = parse_cutlass_peers(peers_);
    SubcommandPlan plan;
    if (!env.gpu) plan.notes.push_back("no CUDA GPU found: the CUDA rows are skipped");
    plan.ceilings.device_copy = env.gpu;
    plan.notes.push_back(
        "scaled_mm baselines: cuBLASLt fp8 (no fast accumulation) with the rows' scales; block-scaled groups are "
        "compared with cuBLASLt's per-tensor fp8 GEMM (the block-scaled target is a ratio to the per-tensor rate)");
    plan.runs.push_back({scaled_groups(cfg, env.gpu), measure, {}});
    return plan;
  }

  std::vector<FamilyRun> plan_all(const AllOptions&, const MeasureOptions&) override { return {}; }

 private:
  std::vector<std::string> sizes_, formats_{"e4m3"}, scales_{"tensor"}, layouts_{"TN"},
      variants_{"wgmma_fp8", "auto"}, peers_;
  std::string out_ = "bf16";
  bool no_baseline_ = false;
};

}  // namespace

std::unique_ptr<Family> make_scaled_gemm_family() { return std::make_unique<ScaledFamily>(); }

}  // namespace bench
