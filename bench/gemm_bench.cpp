// The GEMM benchmark (see gemm_bench.h). Bench code only: every kernel runs through the public
// optimized::matmul; the launchers' *_resources functions are read for the kernel columns.
#include "gemm_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <stdexcept>
#include <thread>

#include "baselines/cublas_gemm.h"
#include "baselines/openblas_gemm.h"
#include "data.h"
#include "testing/gemm_check.h"
#include "gpu_timer.h"
#include "optimized/buffer.h"

#if OPTIMIZED_WITH_CUDA
#include "gemm/gemm_describe.h"
#endif

namespace bench {

using optimized::Buffer;
using optimized::Device;
using optimized::DType;
using optimized::GemmVariant;
using optimized::TensorView;

std::string GemmShape::label() const {
  std::string s = std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k);
  return batch == 1 ? s : std::to_string(batch) + "x" + s;
}

GemmShape parse_gemm_shape(const std::string& text) {
  std::vector<int64_t> parts;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t next = text.find_first_of("xX", pos);
    if (next == std::string::npos) next = text.size();
    const std::string part = text.substr(pos, next - pos);
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(part, &used);
    } catch (...) {
      used = 0;
    }
    if (part.empty() || used != part.size() || v < 1)
      throw std::invalid_argument("--size: expected N, MxNxK or BxMxNxK with positive integers; given '" +
                                  text + "'");
    parts.push_back(v);
    pos = next + 1;
  }
  GemmShape s;
  if (parts.size() == 1) {
    s.m = s.n = s.k = parts[0];
  } else if (parts.size() == 3) {
    s.m = parts[0], s.n = parts[1], s.k = parts[2];
  } else if (parts.size() == 4) {
    s.batch = parts[0], s.m = parts[1], s.n = parts[2], s.k = parts[3];
  } else {
    throw std::invalid_argument("--size: expected N, MxNxK or BxMxNxK; given '" + text + "'");
  }
  return s;
}

namespace {

constexpr uint64_t kSeedStride = 16;  // set i uses seeds 16*i + {1, 2, 3} for A, B, C

bool row_on_cuda(GemmVariant v, bool gpu) { return v == GemmVariant::kAuto ? gpu : optimized::gemm_variant_is_cuda(v); }

std::string variant_name(GemmVariant v) { return std::string(optimized::gemm_variant_name(v)); }

std::string cube(int64_t s) { return std::to_string(s) + "^3"; }

// ---- the plan: which rows run and which are skipped (shared by counting and running) -------

struct PlannedRow {
  GemmVariant variant;
  std::string skip;  // non-empty: listed as skipped with this reason
};

struct Group {
  GemmShape shape;
  DType dtype = DType::kF32;
  bool cuda = false;
  int threads = 0;  // CPU groups
  std::vector<PlannedRow> rows;
  bool baseline = false;

  int runnable() const {
    return static_cast<int>(std::count_if(rows.begin(), rows.end(), [](const PlannedRow& r) { return r.skip.empty(); }));
  }
  int tasks() const { return runnable() + (baseline && runnable() > 0 ? 1 : 0); }
};

std::vector<Group> plan_groups(const GemmBenchConfig& cfg, bool gpu) {
  std::vector<Group> groups;
  const bool has_one_thread = std::find(cfg.threads.begin(), cfg.threads.end(), 1) != cfg.threads.end();
  for (const GemmShape& shape : cfg.shapes) {
    const double volume = static_cast<double>(shape.m) * shape.n * shape.k * shape.batch;
    for (DType dtype : cfg.dtypes) {
      Group g{shape, dtype, true, 0, {}, false};
      for (GemmVariant v : cfg.variants) {
        if (!row_on_cuda(v, gpu)) continue;
        PlannedRow row{v, ""};
        if (!gpu) row.skip = "no CUDA GPU found (" + optimized::cuda_unavailable_reason() + ")";
        else if (v != GemmVariant::kAuto) row.skip = optimized::gemm_variant_rejects_dtype(v, dtype);
        g.rows.push_back(row);
      }
      g.baseline = cfg.baselines && gpu;
      if (!g.rows.empty()) groups.push_back(g);

      for (int threads : cfg.threads) {
        Group c{shape, dtype, false, threads, {}, false};
        for (GemmVariant v : cfg.variants) {
          if (row_on_cuda(v, gpu)) continue;
          PlannedRow row{v, ""};
          if (v != GemmVariant::kAuto) row.skip = optimized::gemm_variant_rejects_dtype(v, dtype);
          if (row.skip.empty() && v == GemmVariant::kCpuNaive && threads != 1 && has_one_thread)
            row.skip = "single-threaded rung (see its 1-thread row)";
          if (row.skip.empty() && v == GemmVariant::kCpuNaive &&
              volume > std::pow(static_cast<double>(cfg.cpu_naive_max), 3))
            row.skip = "too slow above " + cube(cfg.cpu_naive_max) + " (use --cpu-max-size)";
          if (row.skip.empty() && v == GemmVariant::kCpuBlocked &&
              volume > std::pow(static_cast<double>(cfg.cpu_blocked_max), 3))
            row.skip = "too slow above " + cube(cfg.cpu_blocked_max) + " (use --cpu-max-size)";
          c.rows.push_back(row);
        }
        c.baseline = cfg.baselines && dtype == DType::kF32 && openblas_available();
        if (!c.rows.empty()) groups.push_back(c);
      }
    }
  }
  return groups;
}

// ---- rows ---------------------------------------------------------------------------------

Result base_row(const Group& g, GemmVariant v, float beta) {
  Result r;
  r.op = "matmul";
  r.variant = variant_name(v);
  r.backend = g.cuda ? "cuda" : "cpu";
  r.dtype = std::string(optimized::dtype_name(g.dtype));
  const GemmShape& s = g.shape;
  r.shape = {{"m", s.m}, {"n", s.n}, {"k", s.k}, {"batch", s.batch}};
  r.shape_label = s.label();
  if (!g.cuda) r.threads = g.threads;
  const double es = static_cast<double>(optimized::dtype_size(g.dtype));
  r.flops = 2.0 * s.m * s.n * s.k * s.batch;
  r.min_bytes = (static_cast<double>(s.m) * s.k + static_cast<double>(s.k) * s.n +
                 static_cast<double>(s.m) * s.n * (beta != 0 ? 2 : 1)) * es * s.batch;
  return r;
}

Validation to_validation(const optimized::testing::CheckResult& c) {
  return Validation{c.passed, c.max_rel_error, c.worst_ratio, c.checked};
}

std::string failure_reason(const optimized::testing::CheckResult& c) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "validation: %lld of %lld checked elements over their bound (worst ratio %.3g)",
                static_cast<long long>(c.failures), static_cast<long long>(c.checked), c.worst_ratio);
  std::string s = buf;
  if (!c.first_failure.empty()) s += "; first: " + c.first_failure;
  return s;
}

int64_t check_samples(const GemmShape& s) {
  const double volume = static_cast<double>(s.m) * s.n * s.k * s.batch;
  return volume <= static_cast<double>(int64_t{1} << 27) ? 0 : 2048;
}

TensorView view3(void* data, DType dtype, Device device, int64_t batch, int64_t rows, int64_t cols) {
  if (batch == 1) return TensorView(data, dtype, device, {rows, cols});
  return TensorView(data, dtype, device, {batch, rows, cols});
}

std::string group_label(const Group& g) {
  std::string s = std::string(optimized::dtype_name(g.dtype)) + " " + g.shape.label();
  if (!g.cuda) s += " cpu " + std::to_string(g.threads) + (g.threads == 1 ? " thread" : " threads");
  return s;
}

// Operands of one group: nsets rotating sets on the device, set 0's inputs also on the host.
struct Operands {
  struct Set {
    Buffer a, b, c;
  };
  std::vector<Set> sets;
  std::vector<uint8_t> host_a, host_b, host_c0, host_out;
  TensorView ha, hb, hc0, hout;  // host views for check_gemm

  Operands(const GemmShape& s, DType dtype, Device device, float beta, int nsets) {
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
    ha = view3(host_a.data(), dtype, Device::cpu(), s.batch, s.m, s.k);
    hb = view3(host_b.data(), dtype, Device::cpu(), s.batch, s.k, s.n);
    if (beta != 0) hc0 = view3(host_c0.data(), dtype, Device::cpu(), s.batch, s.m, s.n);
    hout = view3(host_out.data(), dtype, Device::cpu(), s.batch, s.m, s.n);
  }

  TensorView a(const GemmShape& s, int i) const {
    const Set& set = sets[i % sets.size()];
    return view3(set.a.data(), set.a.dtype(), set.a.device(), s.batch, s.m, s.k);
  }
  TensorView b(const GemmShape& s, int i) const {
    const Set& set = sets[i % sets.size()];
    return view3(set.b.data(), set.b.dtype(), set.b.device(), s.batch, s.k, s.n);
  }
  TensorView c(const GemmShape& s, int i) const {
    const Set& set = sets[i % sets.size()];
    return view3(set.c.data(), set.c.dtype(), set.c.device(), s.batch, s.m, s.n);
  }
  const Set& set(int i) const { return sets[i % sets.size()]; }

  // Put set 0's C in its pre-run state: poisoned (NaN) when beta == 0, else C0.
  void reset_c(float beta) {
    if (beta == 0) sets[0].c.fill_bytes(0xFF);
    else sets[0].c.copy_from_host(host_c0.data());
  }
};

// Run once on set 0 (after reset_c), wait, copy C to the host and check it against float64.
template <typename RunOnce, typename Wait>
optimized::testing::CheckResult run_and_check(Operands& ops, const GemmShape& s, float alpha, float beta,
                                         const RunOnce& run_once, const Wait& wait, double* seconds) {
  ops.reset_c(beta);
  wait();
  const auto t0 = std::chrono::steady_clock::now();
  run_once(0);
  wait();
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ops.sets[0].c.copy_to_host(ops.host_out.data());
  return optimized::testing::check_gemm(ops.ha, ops.hb, beta != 0 ? &ops.hc0 : nullptr, ops.hout, alpha, beta,
                               check_samples(s));
}

// A validation run that took longer than the warm-up budget is warm-up enough.
MeasureOptions after_validation(MeasureOptions opt, double validation_s) {
  if (validation_s >= opt.warmup_s) opt.max_warmup = 0;
  return opt;
}

// Exceptions from a row: kUnsupported from the library means "skipped", anything else "failed".
void record_exception(Result& r, const std::exception& e) {
  if (auto* oe = dynamic_cast<const optimized::Error*>(&e); oe && oe->status() == optimized::Status::kUnsupported) {
    r.status = "skipped";
  } else {
    r.status = "failed";
  }
  r.reason = e.what();
  r.time = Stats{};
}

#if OPTIMIZED_WITH_CUDA

// The report of the kernel the library would run for these operands (no launch).
std::optional<KernelInfo> kernel_info(GemmVariant v, const Operands& ops, const GemmShape& s, float alpha,
                                      float beta) {
  try {
    const optimized::cuda::KernelResources res =
        optimized::describe_gemm_kernel(ops.a(s, 0), ops.b(s, 0), ops.c(s, 0), alpha, beta, v);
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
  } catch (const optimized::Error&) {
    return std::nullopt;  // a variant that cannot take these operands has no kernel to report
  }
}

void run_cuda_group(const GemmBenchConfig& cfg, const Group& g, const std::vector<Ceiling>& ceilings,
                    Progress& progress, std::vector<Result>& results, std::vector<std::string>& notes) {
  const GemmShape& s = g.shape;
  const float alpha = cfg.alpha, beta = cfg.beta;
  std::vector<Result> rows;
  for (const PlannedRow& pr : g.rows) {
    Result r = base_row(g, pr.variant, beta);
    if (!pr.skip.empty()) r.status = "skipped", r.reason = pr.skip;
    rows.push_back(r);
  }
  // Roofline ceilings of this dtype.
  std::optional<Rate> peak, bandwidth;
  const CublasMode mode = cublas_mode_for(g.dtype);
  if (const Ceiling* c = best_ceiling(ceilings, cublas_mode_name(mode)))
    peak = Rate{c->name + " " + c->shape, c->value, c->unit};
  if (const Ceiling* c = best_ceiling(ceilings, "device_copy")) bandwidth = Rate{c->name, c->value, c->unit};

  auto finish = [&] {
    for (auto& r : rows) results.push_back(std::move(r));
  };
  if (g.runnable() == 0) return finish();

  std::unique_ptr<Operands> ops;
  std::unique_ptr<CudaStream> stream;
  try {
    const int64_t es = static_cast<int64_t>(optimized::dtype_size(g.dtype));
    const int64_t set_bytes = (s.m * s.k + s.k * s.n + s.m * s.n) * s.batch * es;
    size_t free_b = 0, total_b = 0;
    check_cuda(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
    int l2 = 0;
    check_cuda(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0), "cudaDeviceGetAttribute");
    const int nsets = rotating_set_count(set_bytes, l2, static_cast<int64_t>(free_b / 2));
    ops = std::make_unique<Operands>(s, g.dtype, Device::cuda(0), beta, nsets);
    stream = std::make_unique<CudaStream>();
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize after allocating operands");
  } catch (const std::exception& e) {
    for (auto& r : rows) {
      if (r.status != "ok") continue;
      progress.step("matmul " + r.variant + " " + group_label(g));
      r.status = "failed";
      r.reason = std::string("setting up operands: ") + e.what();
    }
    if (g.baseline) progress.step("matmul cublas " + group_label(g));
    return finish();
  }
  cudaStream_t st = stream->get();
  auto wait = [&] { check_cuda(cudaStreamSynchronize(st), "cudaStreamSynchronize"); check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); };

  std::optional<BaselineResult> baseline;
  if (g.baseline) {
    const std::string name = cublas_mode_name(mode);
    progress.step("matmul " + name + " (baseline) " + group_label(g));
    try {
      CublasGemm cublas(st);
      auto run = [&](int i) {
        const auto& set = ops->set(i);
        cublas.run(mode, s.m, s.n, s.k, s.batch, set.a.data(), set.b.data(), set.c.data(), alpha, beta);
      };
      double seconds = 0;
      const auto check = run_and_check(*ops, s, alpha, beta, run, wait, &seconds);
      BaselineResult b;
      b.name = name;
      b.validation = to_validation(check);
      if (!check.passed)
        notes.push_back(name + " at " + group_label(g) + " failed validation (" + failure_reason(check) +
                        "): a harness or tolerance problem, not a kernel one");
      b.time = measure_gpu(run, st, after_validation(cfg.measure, seconds));
      b.tflops = rows.front().flops / (b.time.median * 1e-3) / 1e12;
      baseline = b;
    } catch (const std::exception& e) {
      notes.push_back(name + " baseline at " + group_label(g) + " failed: " + e.what());
    }
  }

  for (size_t i = 0; i < rows.size(); ++i) {
    Result& r = rows[i];
    if (r.status != "ok") continue;
    const GemmVariant v = g.rows[i].variant;
    progress.step("matmul " + r.variant + " " + group_label(g));
    optimized::ExecutionContext ctx;
    ctx.cuda_stream = st;
    GemmVariant resolved = v;
    try {
      if (v == GemmVariant::kAuto) {
        resolved = optimized::resolve_gemm_variant(ops->a(s, 0), ops->b(s, 0), ops->c(s, 0));
        r.resolved_variant = variant_name(resolved);
      }
      auto run = [&](int it) { optimized::matmul(ops->a(s, it), ops->b(s, it), ops->c(s, it), alpha, beta, v, ctx); };
      double seconds = 0;
      const auto check = run_and_check(*ops, s, alpha, beta, run, wait, &seconds);
      r.validation = to_validation(check);
      if (!check.passed) {
        r.status = "failed";
        r.reason = failure_reason(check);
      } else {
        r.time = measure_gpu(run, st, after_validation(cfg.measure, seconds));
      }
    } catch (const std::exception& e) {
      record_exception(r, e);
    }
    r.kernel = kernel_info(resolved, *ops, s, alpha, beta);
    r.baseline = baseline;
    r.roofline_peak = peak;
    r.roofline_bandwidth = bandwidth;
  }
  finish();
}

#endif  // OPTIMIZED_WITH_CUDA

void run_cpu_group(const GemmBenchConfig& cfg, const Group& g, const std::vector<Ceiling>& ceilings,
                   Progress& progress, std::vector<Result>& results, std::vector<std::string>& notes) {
  const GemmShape& s = g.shape;
  const float alpha = cfg.alpha, beta = cfg.beta;
  std::vector<Result> rows;
  for (const PlannedRow& pr : g.rows) {
    Result r = base_row(g, pr.variant, beta);
    if (!pr.skip.empty()) r.status = "skipped", r.reason = pr.skip;
    rows.push_back(r);
  }
  auto finish = [&] {
    for (auto& r : rows) results.push_back(std::move(r));
  };
  if (g.runnable() == 0) return finish();

  std::optional<Rate> bandwidth;
  if (const Ceiling* c = best_ceiling(ceilings, "host_copy")) bandwidth = Rate{c->name, c->value, c->unit};

  std::unique_ptr<Operands> ops;
  try {
    const int64_t es = static_cast<int64_t>(optimized::dtype_size(g.dtype));
    const int64_t set_bytes = (s.m * s.k + s.k * s.n + s.m * s.n) * s.batch * es;
    const int nsets = rotating_set_count(set_bytes, host_llc_bytes(), int64_t{2} << 30);
    ops = std::make_unique<Operands>(s, g.dtype, Device::cpu(), beta, nsets);
  } catch (const std::exception& e) {
    for (auto& r : rows) {
      if (r.status != "ok") continue;
      progress.step("matmul " + r.variant + " " + group_label(g));
      r.status = "failed";
      r.reason = std::string("setting up operands: ") + e.what();
    }
    if (g.baseline) progress.step("matmul openblas_sgemm " + group_label(g));
    return finish();
  }
  auto wait = [] {};

  std::optional<BaselineResult> baseline;
  if (g.baseline) {
    progress.step("matmul openblas_sgemm (baseline) " + group_label(g));
    try {
      auto run = [&](int i) {
        const auto& set = ops->set(i);
        openblas_sgemm(s.m, s.n, s.k, s.batch, static_cast<const float*>(set.a.data()),
                       static_cast<const float*>(set.b.data()), static_cast<float*>(set.c.data()), alpha,
                       beta, g.threads);
      };
      double seconds = 0;
      const auto check = run_and_check(*ops, s, alpha, beta, run, wait, &seconds);
      BaselineResult b;
      b.name = "openblas_sgemm";
      b.validation = to_validation(check);
      if (!check.passed)
        notes.push_back("openblas_sgemm at " + group_label(g) + " failed validation (" + failure_reason(check) + ")");
      b.time = measure_cpu(run, after_validation(cfg.measure, seconds));
      b.tflops = rows.front().flops / (b.time.median * 1e-3) / 1e12;
      baseline = b;
      // OpenBLAS worker threads spin for ~2^28 cycles after a call before they sleep; let them
      // settle so they do not steal cores from the OpenMP threads of the rows that follow.
      if (g.threads > 1) std::this_thread::sleep_for(std::chrono::milliseconds(250));
    } catch (const std::exception& e) {
      notes.push_back("openblas_sgemm baseline at " + group_label(g) + " failed: " + e.what());
    }
  }
  std::optional<Rate> peak;
  if (baseline && baseline->time.valid())
    peak = Rate{"openblas_sgemm " + s.label() + " " + std::to_string(g.threads) + " threads", baseline->tflops,
                "TFLOP/s"};

  for (size_t i = 0; i < rows.size(); ++i) {
    Result& r = rows[i];
    if (r.status != "ok") continue;
    const GemmVariant v = g.rows[i].variant;
    progress.step("matmul " + r.variant + " " + group_label(g));
    optimized::ExecutionContext ctx;
    ctx.cpu_threads = g.threads;
    try {
      if (v == GemmVariant::kAuto)
        r.resolved_variant = variant_name(optimized::resolve_gemm_variant(ops->a(s, 0), ops->b(s, 0), ops->c(s, 0)));
      auto run = [&](int it) { optimized::matmul(ops->a(s, it), ops->b(s, it), ops->c(s, it), alpha, beta, v, ctx); };
      double seconds = 0;
      const auto check = run_and_check(*ops, s, alpha, beta, run, wait, &seconds);
      r.validation = to_validation(check);
      if (!check.passed) {
        r.status = "failed";
        r.reason = failure_reason(check);
      } else {
        r.time = measure_cpu(run, after_validation(cfg.measure, seconds));
      }
    } catch (const std::exception& e) {
      record_exception(r, e);
    }
    r.baseline = baseline;
    r.roofline_peak = peak;
    r.roofline_bandwidth = bandwidth;
  }
  finish();
}

}  // namespace

int count_gemm_tasks(const GemmBenchConfig& config, bool gpu_available) {
  int n = 0;
  for (const Group& g : plan_groups(config, gpu_available)) n += g.tasks();
  return n;
}

void run_gemm_bench(const GemmBenchConfig& config, const std::vector<Ceiling>& ceilings, Progress& progress,
                    std::vector<Result>& results, std::vector<std::string>& notes) {
  const bool gpu = optimized::cuda_device_count() > 0;
  for (const Group& g : plan_groups(config, gpu)) {
    if (g.cuda) {
#if OPTIMIZED_WITH_CUDA
      if (gpu) {
        run_cuda_group(config, g, ceilings, progress, results, notes);
        continue;
      }
#endif
      for (const PlannedRow& pr : g.rows) {  // all skipped: no GPU
        Result r = base_row(g, pr.variant, config.beta);
        r.status = "skipped";
        r.reason = pr.skip.empty() ? "no CUDA GPU found (" + optimized::cuda_unavailable_reason() + ")" : pr.skip;
        results.push_back(r);
      }
    } else {
      run_cpu_group(config, g, ceilings, progress, results, notes);
    }
  }
}

}  // namespace bench
