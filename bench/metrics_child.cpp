// The --metrics child's side (see metrics_child.h).
#include "metrics_child.h"

#include <memory>
#include <stdexcept>

#if OPTIMIZED_WITH_CUDA
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>
#endif

namespace bench::metrics {

namespace {

#if OPTIMIZED_WITH_CUDA
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
#endif

// A group whose row `row` runs its second call (the first after the validation run: a warm-up or the
// first sample) inside the profiler range; everything else is the wrapped group's.
class ProfiledGroup : public BenchGroup {
 public:
  ProfiledGroup(std::unique_ptr<BenchGroup> inner, size_t row) : inner_(std::move(inner)), row_(row) {
    family = inner_->family;
    label = inner_->label;
    cuda = inner_->cuda;
    threads = inner_->threads;
    rows = inner_->rows;
    baseline = inner_->baseline;
    extra_tasks = inner_->extra_tasks;
  }
  int64_t set_bytes() const override { return inner_->set_bytes(); }
  int64_t host_budget() const override { return inner_->host_budget(); }
  void allocate(int sets, const RunEnv& env) override { inner_->allocate(sets, env); }
  Candidate row_candidate(size_t row, const RunEnv& env) override {
    Candidate c = inner_->row_candidate(row, env);
    if (row != row_) return c;
    auto calls = std::make_shared<int>(0);
    auto run = c.run;
    c.run = [run, calls](int i) {
      if (++*calls != 2) return run(i);
#if OPTIMIZED_WITH_CUDA
      check(cudaDeviceSynchronize(), "cudaDeviceSynchronize before the profiled call");
      check(cudaProfilerStart(), "cudaProfilerStart");
      run(i);
      check(cudaDeviceSynchronize(), "cudaDeviceSynchronize after the profiled call");
      check(cudaProfilerStop(), "cudaProfilerStop");
#else
      run(i);
#endif
    };
    return c;
  }
  Candidate baseline_candidate(const RunEnv& env) override { return inner_->baseline_candidate(env); }
  void roofline(const std::vector<Ceiling>& ceilings, const std::optional<BaselineResult>& b,
                std::optional<Rate>& peak, std::optional<Rate>& bandwidth) const override {
    inner_->roofline(ceilings, b, peak, bandwidth);
  }
  void release() override { inner_->release(); }
  void after_rows(const RunEnv&, const MeasureOptions&, Progress&, std::vector<std::string>&) override {
    // the family's extra measurements (same-size copies) are not needed by the child
  }

 private:
  std::unique_ptr<BenchGroup> inner_;
  size_t row_;
};

}  // namespace

RowIdentity identity_of(const Result& r) {
  RowIdentity id;
  id.op = r.op;
  id.variant = r.variant;
  id.backend = r.backend;
  id.dtype = r.dtype;
  id.shape_label = r.shape_label;
  id.direction = r.direction;
  id.threads = r.threads.value_or(0);
  return id;
}

bool keep_only_row(std::vector<FamilyRun>& runs, int row, RowIdentity& identity) {
  int index = 0;
  bool found = false;
  for (auto& run : runs) {
    run.measure.min_samples = 1;
    run.measure.max_samples = 1;
    run.measure.min_time_s = 0;
    run.measure.max_time_s = 0;
    run.measure.warmup_s = 0;
    run.measure.max_warmup = 1;
    for (auto& g : run.groups) {
      std::optional<size_t> keep;
      for (size_t i = 0; i < g->rows.size(); ++i, ++index) {
        Result& r = g->rows[i];
        if (index == row && r.status == "ok" && g->cuda) {
          keep = i;
          identity = identity_of(r);
          continue;
        }
        if (r.status == "ok") {
          r.status = "skipped";
          r.reason = "--only-row " + std::to_string(row);
        }
      }
      g->extra_tasks = 0;
      if (keep) {
        found = true;
        g->baseline.reset();  // neither cuBLAS nor another row runs beside the profiled one
        g = std::make_unique<ProfiledGroup>(std::move(g), *keep);
      } else {
        g->baseline.reset();
      }
    }
  }
  return found;
}

int device_compute_capability() {
#if OPTIMIZED_WITH_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    return 0;
  }
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) return 0;
  return p.major * 10 + p.minor;
#else
  return 0;
#endif
}

}  // namespace bench::metrics
