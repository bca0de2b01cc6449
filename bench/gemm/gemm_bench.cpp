// The GEMM plug-in (see gemm_bench.h). Bench code only: every kernel runs through the public
// optimized::matmul; the launchers' *_resources functions are read for the kernel columns.
#include "gemm/gemm_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <optional>
#include <stdexcept>
#include <thread>

#include "baselines/cublas_gemm.h"
#include "baselines/openblas_gemm.h"
#include "gemm/cutlass_peers.h"
#include "harness/data.h"
#include "harness/family.h"
#include "harness/gpu_timer.h"
#include "optimized/buffer.h"
#include "testing/gemm_check.h"

#if OPTIMIZED_WITH_CUDA
#include "gemm/gemm_describe.h"
#endif

namespace bench {

using optimized::Buffer;
using optimized::Device;
using optimized::DType;
using optimized::GemmVariant;
using optimized::TensorView;

std::string GemmShape::layout() const { return std::string(trans_a ? "T" : "N") + (trans_b ? "T" : "N"); }

std::string GemmShape::label() const {
  std::string s = std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k);
  if (batch != 1) s = std::to_string(batch) + "x" + s;
  return trans_a || trans_b ? s + " " + layout() : s;
}

GemmShape parse_gemm_shape(const std::string& text) {
  const std::vector<int64_t> parts = parse_sizes(text, "xX");
  GemmShape s;
  if (parts.size() == 1) {
    s.m = s.n = s.k = parts[0];
  } else if (parts.size() == 3) {
    s.m = parts[0], s.n = parts[1], s.k = parts[2];
  } else if (parts.size() == 4) {
    s.batch = parts[0], s.m = parts[1], s.n = parts[2], s.k = parts[3];
  } else {
    throw std::invalid_argument("--size: expected N, MxNxK or BxMxNxK with positive integers; given '" + text + "'");
  }
  return s;
}

std::vector<GemmVariant> parse_gemm_variants(const std::vector<std::string>& items, bool (*keep)(GemmVariant),
                                             bool with_auto) {
  std::vector<GemmVariant> out;
  auto add = [&](GemmVariant v) {
    if (std::find(out.begin(), out.end(), v) == out.end()) out.push_back(v);
  };
  for (const auto& name : split_commas(items)) {
    if (name == "all" || name == "cpu" || name == "cuda") {
      for (GemmVariant v : optimized::all_gemm_variants())
        if ((!keep || keep(v)) && (name == "all" || optimized::gemm_variant_is_cuda(v) == (name == "cuda"))) add(v);
      if (with_auto && name != "cpu") add(GemmVariant::kAuto);
    } else {
      add(optimized::parse_gemm_variant(name));  // throws Error naming the choices
    }
  }
  return out;
}

namespace {

constexpr uint64_t kSeedStride = 16;  // set i uses seeds 16*i + {1, 2, 3} for A, B, C

bool row_on_cuda(GemmVariant v, bool gpu) { return v == GemmVariant::kAuto ? gpu : optimized::gemm_variant_is_cuda(v); }
std::string variant_name(GemmVariant v) { return std::string(optimized::gemm_variant_name(v)); }
std::string cube(int64_t s) { return std::to_string(s) + "^3"; }

// A contiguous (batch, rows, cols) operand, stored row-major, or column-major (as (batch, cols,
// rows) in memory) when col_major.
TensorView view3(void* data, DType dtype, Device device, int64_t batch, int64_t rows, int64_t cols,
                 bool col_major = false) {
  const int64_t rs = col_major ? 1 : cols, cs = col_major ? rows : 1;
  if (batch == 1) return TensorView(data, dtype, device, {rows, cols}, {rs, cs});
  return TensorView(data, dtype, device, {batch, rows, cols}, {rows * cols, rs, cs});
}

// Operands of one group: nsets rotating sets on the group's device, set 0's inputs also on the host.
struct Operands {
  struct Set {
    Buffer a, b, c;
  };
  GemmShape s;
  std::vector<Set> sets;
  std::vector<uint8_t> host_a, host_b, host_c0, host_out;
  TensorView ha, hb, hc0, hout;  // host views for check_gemm

  Operands(const GemmShape& shape, DType dtype, Device device, float beta, int nsets) : s(shape) {
    const int64_t a_count = s.batch * s.m * s.k, b_count = s.batch * s.k * s.n, c_count = s.batch * s.m * s.n;
    for (int i = 0; i < nsets; ++i) {
      const uint64_t seed = kSeedStride * static_cast<uint64_t>(i);
      Set set;
      set.a = random_buffer(dtype, a_count, device, seed + 1, i == 0 ? &host_a : nullptr);
      set.b = random_buffer(dtype, b_count, device, seed + 2, i == 0 ? &host_b : nullptr);
      if (beta != 0) set.c = random_buffer(dtype, c_count, device, seed + 3, i == 0 ? &host_c0 : nullptr);
      else set.c = Buffer(dtype, c_count, device);
      sets.push_back(std::move(set));
    }
    host_out.resize(static_cast<size_t>(c_count) * optimized::dtype_size(dtype));
    ha = view3(host_a.data(), dtype, Device::cpu(), s.batch, s.m, s.k, s.trans_a);
    hb = view3(host_b.data(), dtype, Device::cpu(), s.batch, s.k, s.n, s.trans_b);
    if (beta != 0) hc0 = view3(host_c0.data(), dtype, Device::cpu(), s.batch, s.m, s.n);
    hout = view3(host_out.data(), dtype, Device::cpu(), s.batch, s.m, s.n);
  }

  const Set& set(int i) const { return sets[static_cast<size_t>(i) % sets.size()]; }
  TensorView a(int i) const {
    return view3(set(i).a.data(), set(i).a.dtype(), set(i).a.device(), s.batch, s.m, s.k, s.trans_a);
  }
  TensorView b(int i) const {
    return view3(set(i).b.data(), set(i).b.dtype(), set(i).b.device(), s.batch, s.k, s.n, s.trans_b);
  }
  TensorView c(int i) const { return view3(set(i).c.data(), set(i).c.dtype(), set(i).c.device(), s.batch, s.m, s.n); }

  // Set 0's C in its pre-run state: poisoned (NaN) when beta == 0, else C0.
  void reset_c(float beta) {
    if (beta == 0) sets[0].c.fill_bytes(0xFF);
    else sets[0].c.copy_from_host(host_c0.data());
  }
};

#if OPTIMIZED_WITH_CUDA
// The report of the kernel the library would run for these operands (no launch).
std::optional<KernelInfo> kernel_info(GemmVariant v, const Operands& ops, float alpha, float beta) {
  try {
    return kernel_info_of(optimized::describe_gemm_kernel(ops.a(0), ops.b(0), ops.c(0), alpha, beta, v));
  } catch (const optimized::Error&) {
    return std::nullopt;  // a variant that cannot take these operands has no kernel to report
  }
}
#endif

class GemmGroup : public BenchGroup {
 public:
  GemmGroup(const GemmShape& shape, DType dtype, bool on_cuda, int nthreads, const GemmBenchConfig& cfg)
      : s_(shape), dtype_(dtype), alpha_(cfg.alpha), beta_(cfg.beta) {
    family = "matmul";
    cuda = on_cuda;
    threads = nthreads;
    label = std::string(optimized::dtype_name(dtype)) + " " + shape.label();
    if (!cuda) label += " cpu " + std::to_string(threads) + (threads == 1 ? " thread" : " threads");
  }

  // A planned row of variant v, or of the peer named `peer` (a CUTLASS GEMM) ("ok", or skipped with
  // `skip`).
  void add_row(GemmVariant v, const std::string& skip, const std::string& peer = "") {
    Result r;
    r.op = "matmul";
    r.variant = peer.empty() ? variant_name(v) : peer;
    r.backend = cuda ? "cuda" : "cpu";
    r.dtype = std::string(optimized::dtype_name(dtype_));
    r.shape = {{"m", s_.m}, {"n", s_.n}, {"k", s_.k}, {"batch", s_.batch}};
    if (s_.trans_a) r.shape.push_back({"trans_a", 1});
    if (s_.trans_b) r.shape.push_back({"trans_b", 1});
    r.shape_label = s_.label();
    if (!cuda) r.threads = threads;
    const double es = static_cast<double>(optimized::dtype_size(dtype_));
    r.flops = 2.0 * s_.m * s_.n * s_.k * s_.batch;
    r.min_bytes = (static_cast<double>(s_.m) * s_.k + static_cast<double>(s_.k) * s_.n +
                   static_cast<double>(s_.m) * s_.n * (beta_ != 0 ? 2 : 1)) * es * s_.batch;
    if (!skip.empty()) r.status = "skipped", r.reason = skip;
    rows.push_back(r);
    variants_.push_back(v);
    peers_.push_back(peer);
  }

  // The problem as the CUTLASS peers take it.
  CutlassProblem cutlass_problem() const {
    CutlassProblem p;
    p.m = s_.m, p.n = s_.n, p.k = s_.k, p.batch = s_.batch;
    p.trans_a = s_.trans_a, p.trans_b = s_.trans_b;
    p.in = p.out = dtype_;
    p.alpha = alpha_, p.beta = beta_;
    return p;
  }

  int64_t set_bytes() const override {
    return (s_.m * s_.k + s_.k * s_.n + s_.m * s_.n) * s_.batch * static_cast<int64_t>(optimized::dtype_size(dtype_));
  }
  int64_t host_budget() const override { return int64_t{2} << 30; }

  void allocate(int sets, const RunEnv& env) override {
    ops_ = std::make_unique<Operands>(s_, dtype_, env.cuda ? Device::cuda(0) : Device::cpu(), beta_, sets);
  }
  void release() override { ops_.reset(); }

  Candidate row_candidate(size_t i, const RunEnv& env) override {
    if (!peers_[i].empty()) return peer_candidate(peers_[i], env);
    const GemmVariant v = variants_[i];
    const optimized::ExecutionContext ctx = env.context();
    Candidate c = checked([this, v, ctx](int it) {
      optimized::matmul(ops_->a(it), ops_->b(it), ops_->c(it), alpha_, beta_, v, ctx);
    });
    c.annotate = [this, v, env](Result& r) {
      GemmVariant resolved = v;
      if (v == GemmVariant::kAuto) {
        resolved = optimized::resolve_gemm_variant(ops_->a(0), ops_->b(0), ops_->c(0));
        r.resolved_variant = variant_name(resolved);
      }
#if OPTIMIZED_WITH_CUDA
      if (env.cuda) r.kernel = kernel_info(resolved, *ops_, alpha_, beta_);
#else
      (void)env;
#endif
    };
    return c;
  }

  Candidate baseline_candidate(const RunEnv& env) override {
    if (env.cuda) {
#if OPTIMIZED_WITH_CUDA
      auto cublas = std::make_shared<CublasGemm>(static_cast<cudaStream_t>(env.stream));
      const CublasMode mode = cublas_mode_for(dtype_);
      return checked([this, cublas, mode](int i) {
        const auto& set = ops_->set(i);
        cublas->run(mode, s_.m, s_.n, s_.k, s_.batch, set.a.data(), set.b.data(), set.c.data(), alpha_, beta_,
                    s_.trans_a, s_.trans_b);
      });
#endif
    }
    const int nthreads = threads;
    Candidate c = checked([this, nthreads](int i) {
      const auto& set = ops_->set(i);
      openblas_sgemm(s_.m, s_.n, s_.k, s_.batch, static_cast<const float*>(set.a.data()),
                     static_cast<const float*>(set.b.data()), static_cast<float*>(set.c.data()), alpha_, beta_,
                     nthreads, s_.trans_a, s_.trans_b);
    });
    // OpenBLAS worker threads spin for ~2^28 cycles after a call before they sleep; let them settle
    // so they do not steal cores from the OpenMP threads of the rows that follow.
    if (nthreads > 1) c.settle = [] { std::this_thread::sleep_for(std::chrono::milliseconds(250)); };
    return c;
  }

  void roofline(const std::vector<Ceiling>& ceilings, const std::optional<BaselineResult>& baseline,
                std::optional<Rate>& peak, std::optional<Rate>& bandwidth) const override {
    if (cuda) {
      if (const Ceiling* c = best_ceiling(ceilings, cublas_mode_name(cublas_mode_for(dtype_))))
        peak = Rate{c->name + " " + c->shape, c->value, c->unit};
      if (const Ceiling* c = best_ceiling(ceilings, "device_copy")) bandwidth = Rate{c->name, c->value, c->unit};
      return;
    }
    if (baseline && baseline->time.valid())
      peak = Rate{"openblas_sgemm " + s_.label() + " " + std::to_string(threads) + " threads", baseline->tflops,
                  "TFLOP/s"};
    if (const Ceiling* c = best_ceiling(ceilings, "host_copy")) bandwidth = Rate{c->name, c->value, c->unit};
  }

 private:
  // A CUTLASS peer, initialized here for every rotating set (outside the timing), then validated and
  // timed like the rows.
  Candidate peer_candidate(const std::string& name, const RunEnv& env) {
    std::vector<CutlassOperands> sets;
    for (const auto& set : ops_->sets) sets.push_back({set.a.data(), set.b.data(), set.c.data()});
    std::shared_ptr<CutlassGemm> gemm = make_cutlass_gemm(name, cutlass_problem(), sets, env.stream);
    void* stream = env.stream;
    Candidate c = checked([gemm, stream](int it) { gemm->run(it, stream); });
    c.annotate = [gemm](Result& r) { r.kernel = gemm->report(); };
    return c;
  }

  // A candidate that runs `run`, with set 0's C reset before and checked against float64 after.
  Candidate checked(std::function<void(int)> run) {
    Candidate c;
    c.run = std::move(run);
    c.prepare = [this] { ops_->reset_c(beta_); };
    c.check = [this] {
      ops_->sets[0].c.copy_to_host(ops_->host_out.data());
      const double volume = static_cast<double>(s_.m) * s_.n * s_.k * s_.batch;
      const int64_t samples = volume <= static_cast<double>(int64_t{1} << 27) ? 0 : 2048;
      return optimized::testing::check_gemm(ops_->ha, ops_->hb, beta_ != 0 ? &ops_->hc0 : nullptr, ops_->hout,
                                            alpha_, beta_, samples);
    };
    return c;
  }

  GemmShape s_;
  DType dtype_;
  float alpha_, beta_;
  std::vector<GemmVariant> variants_;  // per row
  std::vector<std::string> peers_;     // per row: the peer's name, or "" for variants_[row]
  std::unique_ptr<Operands> ops_;
};

}  // namespace

#if OPTIMIZED_WITH_CUDA
KernelInfo kernel_info_of(const optimized::cuda::KernelResources& res) {
  KernelInfo k;
  k.name = res.kernel_name ? res.kernel_name : "";
  k.registers = res.registers_per_thread;
  k.static_smem = res.static_smem_bytes;
  k.dynamic_smem = res.dynamic_smem_bytes;
  k.threads = res.threads_per_block;
  k.blocks_per_sm = res.blocks_per_sm;
  k.occupancy = res.theoretical_occupancy;
  k.local_bytes = res.local_bytes_per_thread;
  return k;
}
#endif

Groups gemm_groups(const GemmBenchConfig& cfg, bool gpu) {
  Groups groups;
  const bool has_one_thread = std::find(cfg.threads.begin(), cfg.threads.end(), 1) != cfg.threads.end();
  for (const GemmShape& shape : cfg.shapes) {
    const double volume = static_cast<double>(shape.m) * shape.n * shape.k * shape.batch;
    for (DType dtype : cfg.dtypes) {
      auto g = std::make_unique<GemmGroup>(shape, dtype, true, 0, cfg);
      for (GemmVariant v : cfg.variants) {
        if (!row_on_cuda(v, gpu)) continue;
        std::string skip;
        if (!gpu) skip = "no CUDA GPU found (" + optimized::cuda_unavailable_reason() + ")";
        else if (v != GemmVariant::kAuto) skip = optimized::gemm_variant_rejects_dtype(v, dtype);
        // The Hopper rungs load through TMA, which needs 16-byte rows; the benchmark's operands
        // are contiguous, so the stored widths (K or M of A, N or K of B by layout) must be
        // multiples of 16 bytes (auto falls back elsewhere).
        const int64_t per16 = 16 / static_cast<int64_t>(optimized::dtype_size(dtype));
        const int64_t a_width = shape.trans_a ? shape.m : shape.k, b_width = shape.trans_b ? shape.k : shape.n;
        if (skip.empty() && optimized::gemm_variant_name(v).starts_with("wgmma_") &&
            ((shape.m * shape.k > a_width && a_width % per16 != 0) || (shape.k * shape.n > b_width && b_width % per16 != 0)))
          skip = "TMA needs rows of A and B 16-byte aligned (stored widths multiples of " + std::to_string(per16) +
                 " here); auto copies them into aligned rows or runs mma_pipeline";
        g->add_row(v, skip);
      }
      // The peers built for this dtype (CUTLASS: bf16), after our rows.
      for (const std::string& peer : cfg.peers) {
        const std::vector<std::string> built = cutlass_peer_names(dtype);
        if (std::find(built.begin(), built.end(), peer) == built.end()) continue;
        // What the kernel cannot take first (known without a GPU), then the device.
        std::string skip = cutlass_peer_rejects(peer, g->cutlass_problem());
        if (skip.empty() && !gpu) skip = "no CUDA GPU found (" + optimized::cuda_unavailable_reason() + ")";
        if (skip.empty()) skip = cutlass_device_rejects();
        g->add_row(GemmVariant::kAuto, skip, peer);
      }
      if (cfg.baselines && gpu) g->baseline = BaselinePlan{cublas_mode_name(cublas_mode_for(dtype)), -1, true};
      if (!g->rows.empty()) groups.push_back(std::move(g));

      for (int threads : cfg.threads) {
        auto c = std::make_unique<GemmGroup>(shape, dtype, false, threads, cfg);
        for (GemmVariant v : cfg.variants) {
          if (row_on_cuda(v, gpu)) continue;
          std::string skip;
          if (v != GemmVariant::kAuto) skip = optimized::gemm_variant_rejects_dtype(v, dtype);
          if (skip.empty() && v == GemmVariant::kCpuNaive && threads != 1 && has_one_thread)
            skip = "single-threaded rung (see its 1-thread row)";
          if (skip.empty() && v == GemmVariant::kCpuNaive && volume > std::pow(static_cast<double>(cfg.cpu_naive_max), 3))
            skip = "too slow above " + cube(cfg.cpu_naive_max) + " (use --cpu-max-size)";
          if (skip.empty() && v == GemmVariant::kCpuBlocked &&
              volume > std::pow(static_cast<double>(cfg.cpu_blocked_max), 3))
            skip = "too slow above " + cube(cfg.cpu_blocked_max) + " (use --cpu-max-size)";
          c->add_row(v, skip);
        }
        if (cfg.baselines && dtype == DType::kF32 && openblas_available())
          c->baseline = BaselinePlan{"openblas_sgemm", -1, true};
        if (!c->rows.empty()) groups.push_back(std::move(c));
      }
    }
  }
  return groups;
}

// ---- the CLI: `optimized-bench matmul` and the GEMM rows of `all` ---------------------------

namespace {

std::vector<int> resolve_threads(const std::vector<int>& given) {
  std::vector<int> out;
  auto add = [&](int t) {
    if (t <= 0) t = all_threads();
    if (std::find(out.begin(), out.end(), t) == out.end()) out.push_back(t);
  };
  if (given.empty()) {
    add(1);
    add(all_threads());
  } else {
    for (int t : given) add(t);
  }
  return out;
}

class GemmFamily : public Family {
 public:
  CLI::App* add_subcommand(CLI::App& app) override {
    CLI::App* sub = app.add_subcommand("matmul", "Benchmark GEMM variants (C = alpha*A@B + beta*C)");
    sub->add_option("--size", sizes_, "N (N^3), MxNxK or BxMxNxK; repeat or separate with commas [default: 1024]")
        ->delimiter(',');
    sub->add_option("--m", m_, "M (with --n and --k: one more shape)");
    sub->add_option("--n", n_, "N (with --m and --k)");
    sub->add_option("--k", k_, "K (with --m and --n)");
    sub->add_option("--batch", batch_, "Batch count for every shape given by --m/--n/--k or a plain --size")
        ->capture_default_str();
    sub->add_option("--dtype", dtypes_, "fp32, fp16, bf16; repeat or separate with commas")
        ->delimiter(',')
        ->capture_default_str();
    sub->add_option("--variant", variants_,
                    "all | cpu | cuda | names (cpu_naive, cpu_blocked, cpu_packed, naive, coalesced, "
                    "smem_tiled, register_tiled, wmma, mma_pipeline, wgmma_tma, wgmma_ws, wgmma_persistent, "
                    "gemv, auto), separated by commas")
        ->delimiter(',')
        ->capture_default_str();
    sub->add_option("--peers", peers_,
                    "Other libraries' GEMMs timed as rows beside ours and validated the same way: cutlass (every "
                    "CUTLASS peer: cutlass_ws_128x128, cutlass_ws_128x256, cutlass_pingpong_64x128, "
                    "cutlass_pingpong_128x128, cutlass_sm80; bf16, layouts NN and NT), names, or none "
                    "[default: none; `all` runs the CUTLASS ones on its bf16 rows when built]")
        ->delimiter(',');
    sub->add_option("--layout", layouts_,
                    "NN, NT, TN, TT: A then B row-major (N) or stored column-major (T); every shape runs in each "
                    "[default: NN]")
        ->delimiter(',');
    sub->add_option("--threads", threads_, "CPU thread counts (0: all) [default: 1 and all]")->delimiter(',');
    sub->add_option("--alpha", alpha_, "alpha")->capture_default_str();
    sub->add_option("--beta", beta_, "beta (non-zero: C is read too and counted in min bytes)")->capture_default_str();
    sub->add_option("--cpu-max-size", cpu_max_size_,
                    "Run cpu_naive and cpu_blocked up to M*N*K <= S^3 [default: naive 1024, blocked 2048]");
    sub->add_flag("--no-baseline", no_baseline_, "Do not measure cuBLAS / OpenBLAS next to each row");
    sub->add_flag("--no-ceilings", no_ceilings_, "Do not measure the ceilings (no roofline column)");
    return sub;
  }

  void add_all_options(CLI::App& all) override {
    all.add_option("--cpu-max-size", all_cpu_max_size_,
                   "Run cpu_naive and cpu_blocked up to M*N*K <= S^3 [default: naive 1024, blocked 2048]");
  }

  SubcommandPlan plan(const Env& env, const CLI::App&, MeasureOptions& measure) override {
    GemmBenchConfig cfg;
    cfg.measure = measure;
    for (const auto& text : sizes_) {
      GemmShape s = parse_gemm_shape(text);
      if (s.batch == 1) s.batch = batch_;
      cfg.shapes.push_back(s);
    }
    const int given_mnk = (m_ > 0) + (n_ > 0) + (k_ > 0);
    if (given_mnk != 0 && given_mnk != 3) throw std::invalid_argument("--m, --n and --k go together (all three, positive)");
    if (given_mnk == 3) cfg.shapes.push_back({m_, n_, k_, batch_});
    if (cfg.shapes.empty()) cfg.shapes.push_back({1024, 1024, 1024, batch_});
    if (batch_ < 1) throw std::invalid_argument("--batch: expected >= 1; given " + std::to_string(batch_));
    if (!layouts_.empty()) {
      std::vector<GemmShape> shapes;
      for (const GemmShape& base : cfg.shapes)
        for (const std::string& l : layouts_) {
          if (l.size() != 2 || (l[0] != 'N' && l[0] != 'T') || (l[1] != 'N' && l[1] != 'T'))
            throw std::invalid_argument("--layout: expected NN, NT, TN or TT; given '" + l + "'");
          GemmShape s = base;
          s.trans_a = l[0] == 'T';
          s.trans_b = l[1] == 'T';
          shapes.push_back(s);
        }
      cfg.shapes = shapes;
    }
    cfg.dtypes = parse_float_dtypes(dtypes_, "--dtype: matmul takes");
    cfg.variants = parse_gemm_variants(variants_);
    cfg.peers = parse_cutlass_peers(peers_);
    cfg.threads = resolve_threads(threads_);
    cfg.alpha = alpha_;
    cfg.beta = beta_;
    cfg.baselines = !no_baseline_;
    if (cpu_max_size_ > 0) cfg.cpu_naive_max = cfg.cpu_blocked_max = cpu_max_size_;

    SubcommandPlan plan;
    bool has_gpu_rows = !cfg.peers.empty(), has_cpu_rows = false;
    for (GemmVariant v : cfg.variants) (row_on_cuda(v, env.gpu) ? has_gpu_rows : has_cpu_rows) = true;
    if (!cfg.peers.empty())
      plan.notes.push_back("CUTLASS " + cutlass_version() +
                           " peers: validated like our rows, then timed; each initialized once per rotating set "
                           "outside the timing (a timed call is a launch)");
    if (has_gpu_rows && !env.gpu)
      plan.notes.push_back("no CUDA GPU found (" + optimized::cuda_unavailable_reason() + "): the CUDA rows are skipped");
    const bool any_fp32 = std::find(cfg.dtypes.begin(), cfg.dtypes.end(), DType::kF32) != cfg.dtypes.end();
    if (has_cpu_rows && !no_baseline_ && any_fp32 && !openblas_available())
      plan.notes.push_back("OpenBLAS not found: the CPU rows carry no baseline and no roofline");
    if (!no_ceilings_) {
      if (has_gpu_rows && env.gpu) {
        plan.ceilings.device_copy = true;
        for (DType d : cfg.dtypes) plan.ceilings.cublas_modes.push_back(cublas_mode_for(d));
      }
      plan.ceilings.host_copy = has_cpu_rows;
    }
    plan.runs.push_back({gemm_groups(cfg, env.gpu), cfg.measure, {}});
    return plan;
  }

  // Every GPU variant at fp32 and bf16 for 1024, 4096, 8192, 4097x4095x4093 and the Hopper targets vs cuBLAS; every CPU
  // variant at fp32 for 1024 and 2048, 1 and all threads, vs OpenBLAS.
  std::vector<FamilyRun> plan_all(const AllOptions& all, const MeasureOptions& measure) override {
    std::vector<FamilyRun> runs;
    GemmBenchConfig gpu_cfg, cpu_cfg;
    gpu_cfg.measure = cpu_cfg.measure = measure;
    // The square ladder shapes, the odd one, and the Hopper GEMM's targets: a tall product
    // (16384x4096x4096), a short K (4096x4096x1024) and two decode shapes (32x14336x4096,
    // 1x4096x4096).
    gpu_cfg.shapes = {{1024, 1024, 1024},  {4096, 4096, 4096}, {8192, 8192, 8192},  {4097, 4095, 4093},
                      {16384, 4096, 4096}, {4096, 4096, 1024}, {32, 14336, 4096}, {1, 4096, 4096}};
    gpu_cfg.dtypes = {DType::kF32, DType::kBF16};
    cpu_cfg.shapes = {{1024, 1024, 1024}, {2048, 2048, 2048}};
    cpu_cfg.dtypes = {DType::kF32};
    for (GemmVariant v : optimized::all_gemm_variants())
      (optimized::gemm_variant_is_cuda(v) ? gpu_cfg : cpu_cfg).variants.push_back(v);
    gpu_cfg.peers = cutlass_peer_names(DType::kBF16);  // the CUTLASS peers on the bf16 rows, when built
    cpu_cfg.threads = resolve_threads({});
    if (all_cpu_max_size_ > 0) cpu_cfg.cpu_naive_max = cpu_cfg.cpu_blocked_max = all_cpu_max_size_;
    if (all.run_gpu()) runs.push_back({gemm_groups(gpu_cfg, true), measure, {}});
    if (!all.no_cpu) runs.push_back({gemm_groups(cpu_cfg, all.gpu), measure, {}});
    return runs;
  }

 private:
  std::vector<std::string> sizes_, dtypes_{"fp32"}, variants_{"all"}, layouts_, peers_;
  int64_t m_ = 0, n_ = 0, k_ = 0, batch_ = 1;
  std::vector<int> threads_;
  float alpha_ = 1.0f, beta_ = 0.0f;
  int64_t cpu_max_size_ = 0, all_cpu_max_size_ = 0;
  bool no_baseline_ = false, no_ceilings_ = false;
};

}  // namespace

std::unique_ptr<Family> make_gemm_family() { return std::make_unique<GemmFamily>(); }

}  // namespace bench
