// The driver of optimized-bench (see driver.h).
#include "harness/driver.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "harness/gpu_timer.h"

namespace bench {

using optimized::testing::CheckResult;

optimized::ExecutionContext RunEnv::context() const {
  optimized::ExecutionContext ctx;
  if (cuda) ctx.cuda_stream = stream;
  else ctx.cpu_threads = threads;
  return ctx;
}

int BenchGroup::runnable() const {
  return static_cast<int>(std::count_if(rows.begin(), rows.end(), [](const Result& r) { return r.status == "ok"; }));
}

int BenchGroup::tasks() const {
  const int n = runnable();
  if (n == 0) return 0;
  return n + (baseline && baseline->row < 0 ? 1 : 0) + extra_tasks;
}

Candidate BenchGroup::baseline_candidate(const RunEnv&) {
  throw std::logic_error(family + " " + label + ": a baseline of its own was planned but not provided");
}

int count_tasks(const Groups& groups) {
  int n = 0;
  for (const auto& g : groups) n += g->tasks();
  return n;
}

std::string failure_reason(const CheckResult& c) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "validation: %lld of %lld checked elements over their bound (worst ratio %.3g)",
                static_cast<long long>(c.failures), static_cast<long long>(c.checked), c.worst_ratio);
  std::string s = buf;
  if (!c.first_failure.empty()) s += "; first: " + c.first_failure;
  return s;
}

Validation to_validation(const CheckResult& c) { return Validation{c.passed, c.max_rel_error, c.worst_ratio, c.checked}; }

std::vector<std::string> split_commas(const std::vector<std::string>& items) {
  std::vector<std::string> out;
  for (const auto& item : items) {
    std::stringstream ss(item);
    std::string part;
    while (std::getline(ss, part, ','))
      if (!part.empty()) out.push_back(part);
  }
  return out;
}

std::vector<int64_t> parse_sizes(const std::string& text, const std::string& separators) {
  std::vector<int64_t> out;
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t next = std::min(text.find_first_of(separators, pos), text.size());
    const std::string part = text.substr(pos, next - pos);
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(part, &used);
    } catch (...) {
      used = 0;
    }
    if (part.empty() || used != part.size() || v < 1) return {};
    out.push_back(v);
    pos = next + 1;
  }
  return out;
}

std::vector<optimized::DType> parse_float_dtypes(const std::vector<std::string>& items, const std::string& what) {
  using optimized::DType;
  std::vector<DType> out;
  for (const auto& name : split_commas(items)) {
    const DType d = optimized::parse_dtype(name);
    if (d != DType::kF32 && d != DType::kF16 && d != DType::kBF16)
      throw std::invalid_argument(what + " fp32, fp16 or bf16; given '" + name + "'");
    if (std::find(out.begin(), out.end(), d) == out.end()) out.push_back(d);
  }
  return out;
}

namespace {

// A validation run that took longer than the warm-up budget is warm-up enough.
MeasureOptions after_validation(MeasureOptions opt, double validation_s) {
  if (validation_s >= opt.warmup_s) opt.max_warmup = 0;
  return opt;
}

// Exceptions from a row: kUnsupported from the library means "skipped", anything else "failed".
void record_exception(Result& r, const std::exception& e) {
  if (auto* oe = dynamic_cast<const optimized::Error*>(&e); oe && oe->status() == optimized::Status::kUnsupported)
    r.status = "skipped";
  else
    r.status = "failed";
  r.reason = e.what();
  r.time = Stats{};
}

// Everything a group's run needs besides the group.
struct Runner {
  RunEnv env;
  MeasureOptions measure;
  std::function<void()> wait;

  Stats time(const std::function<void(int)>& run, const MeasureOptions& opt) const {
    if (env.cuda) return measure_gpu(run, env.stream, opt);
    return measure_cpu(run, opt);
  }

  // Validates c on set 0, then (when it passes, or `time_anyway`) times it.
  CheckResult validate_then_time(Candidate& c, bool time_anyway, Stats& stats) const {
    if (c.prepare) c.prepare();
    wait();
    const auto t0 = std::chrono::steady_clock::now();
    c.run(0);
    wait();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const CheckResult check = c.check();
    if (check.passed || time_anyway) {
      stats = time(c.run, after_validation(measure, seconds));
      if (c.settle) c.settle();
    }
    return check;
  }
};

double tflops_of(double flops, const Stats& t) { return t.median > 0 ? flops / (t.median * 1e-3) / 1e12 : 0.0; }

void run_group(BenchGroup& g, const MeasureOptions& measure, const std::vector<Ceiling>& ceilings, Progress& progress,
               std::vector<std::string>& notes) {
  const std::string prefix = g.family + " " + g.label + " ";
  std::vector<size_t> todo;  // the rows to run, the baseline row first
  for (size_t i = 0; i < g.rows.size(); ++i)
    if (g.rows[i].status == "ok") {
      if (g.baseline && g.baseline->row == static_cast<int>(i)) todo.insert(todo.begin(), i);
      else todo.push_back(i);
    }
  if (todo.empty()) return;
  const bool own_baseline = g.baseline && g.baseline->row < 0;

  Runner runner;
  runner.measure = measure;
  runner.env.cuda = g.cuda;
  runner.env.threads = g.threads;
  runner.wait = [] {};
#if OPTIMIZED_WITH_CUDA
  std::unique_ptr<CudaStream> stream;
#endif
  try {
    int sets = 0;
    if (g.cuda) {
#if OPTIMIZED_WITH_CUDA
      size_t free_b = 0, total_b = 0;
      check_cuda(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
      int l2 = 0;
      check_cuda(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0), "cudaDeviceGetAttribute");
      sets = rotating_set_count(g.set_bytes(), l2, static_cast<int64_t>(free_b / 2));
      stream = std::make_unique<CudaStream>();
      runner.env.stream = stream->get();
      cudaStream_t st = stream->get();
      runner.wait = [st] {
        check_cuda(cudaStreamSynchronize(st), "cudaStreamSynchronize");
        check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      };
#else
      throw std::runtime_error("a CUDA group in a build without CUDA");
#endif
    } else {
      sets = rotating_set_count(g.set_bytes(), host_llc_bytes(), g.host_budget());
    }
    g.allocate(sets, runner.env);
#if OPTIMIZED_WITH_CUDA
    if (g.cuda) check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize after allocating operands");
#endif
  } catch (const std::exception& e) {
    for (size_t i : todo) {
      progress.step(prefix + g.rows[i].variant);
      g.rows[i].status = "failed";
      g.rows[i].reason = std::string("setting up operands: ") + e.what();
    }
    if (own_baseline) progress.step(prefix + g.baseline->name + " (baseline)");
    for (int i = 0; i < g.extra_tasks; ++i) progress.step(prefix + "(not measured)");
    g.release();
    return;
  }

  std::optional<BaselineResult> baseline;
  const double flops = g.rows.front().flops;
  if (own_baseline) {
    const BaselinePlan& b = *g.baseline;
    progress.step(prefix + b.name + " (baseline)");
    try {
      Candidate c = g.baseline_candidate(runner.env);
      BaselineResult res;
      res.name = b.name;
      const CheckResult check = runner.validate_then_time(c, b.timed_if_invalid, res.time);
      res.validation = to_validation(check);
      if (!check.passed)
        notes.push_back(b.name + " at " + g.label + " failed validation (" + failure_reason(check) + ")" +
                        (b.timed_if_invalid ? ": a harness or tolerance problem, not a kernel one" : ""));
      if (res.time.valid()) {
        res.tflops = tflops_of(flops, res.time);
        baseline = res;
      }
    } catch (const std::exception& e) {
      notes.push_back(b.name + " baseline at " + g.label + " failed: " + e.what());
    }
  }

  for (size_t i : todo) {
    Result& r = g.rows[i];
    progress.step(prefix + r.variant);
    try {
      Candidate c = g.row_candidate(i, runner.env);
      if (c.annotate) c.annotate(r);
      const CheckResult check = runner.validate_then_time(c, false, r.time);
      r.validation = to_validation(check);
      if (!check.passed) {
        r.status = "failed";
        r.reason = failure_reason(check);
      }
    } catch (const std::exception& e) {
      record_exception(r, e);
    }
    if (g.baseline && g.baseline->row == static_cast<int>(i)) {
      if (r.timed()) baseline = BaselineResult{g.baseline->name, r.time, tflops_of(flops, r.time), r.validation};
      else notes.push_back(g.baseline->name + " baseline at " + g.label + ": " + r.status + " (" + r.reason + ")");
    }
  }
  g.release();

  std::optional<Rate> peak, bandwidth;
  g.roofline(ceilings, baseline, peak, bandwidth);
  for (size_t i : todo) {
    Result& r = g.rows[i];
    r.roofline_peak = peak;
    r.roofline_bandwidth = bandwidth;
    if (r.status == "ok") r.baseline = baseline;
  }
  g.after_rows(runner.env, measure, progress, notes);
}

}  // namespace

void run_groups(Groups& groups, const MeasureOptions& measure, const std::vector<Ceiling>& ceilings,
                Progress& progress, std::vector<Result>& results, std::vector<std::string>& notes) {
  const bool gpu = optimized::cuda_device_count() > 0;
  for (auto& g : groups) {
    if (g->cuda && !gpu) {  // every row skipped: no GPU
      for (Result& r : g->rows)
        if (r.status == "ok") {
          r.status = "skipped";
          r.reason = "no CUDA GPU found (" + optimized::cuda_unavailable_reason() + ")";
        }
    } else {
      run_group(*g, measure, ceilings, progress, notes);
    }
    for (Result& r : g->rows) results.push_back(std::move(r));
    g.reset();  // operands and plan freed as soon as the rows are out
  }
}

}  // namespace bench
