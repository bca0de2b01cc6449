// The one driver of optimized-bench: every family's rows run through it (house rule 4).
//
// A family plug-in (bench/<family>/) plans BenchGroups: rows that share operands (one shape, dtype
// and device), each a Result with its skip reason or "ok", a baseline measured next to them, and
// the family's inputs, variants, bytes / flops and check. The driver owns the rest, the same for
// every family:
//   1. progress: one step per row, baseline and extra measurement (also when they cannot run);
//   2. skips: rows planned as skipped stay so, with their reason; a CUDA group without a GPU is
//      skipped whole; kUnsupported from the library makes a row "skipped", anything else "failed";
//   3. input rotation: enough input sets to cover 2x the L2 (GPU) or the last-level cache (CPU),
//      within half the free device memory / the group's host budget (rotating_set_count);
//   4. validation before timing: set 0's outputs poisoned, one run, checked against the float64
//      reference with the family's rule (optimized_ops_testing); a row that fails is "failed" and
//      not timed; a validation run slower than the warm-up budget counts as the warm-up;
//   5. timing: measure_gpu on a stream of the group's own (CUDA events, cold L2) or measure_cpu;
//   6. baseline: validated and timed first (a vendor baseline is timed even when its check fails:
//      that is a harness or tolerance problem, noted), its time on every row that ran;
//   7. ceilings: the rows' roofline peak and bandwidth, from the ceilings measured in the run;
//   8. rows: appended to the report in the planned order.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "harness/harness.h"
#include "harness/report.h"
#include "optimized/core.h"
#include "testing/check.h"

namespace bench {

// Where a group's candidates run.
struct RunEnv {
  bool cuda = false;
  void* stream = nullptr;  // CUDA groups: the group's cudaStream_t
  int threads = 0;         // CPU groups: ExecutionContext::cpu_threads
  optimized::ExecutionContext context() const;
};

// One thing validated, then timed: a row's variant or a baseline.
struct Candidate {
  std::function<void(int)> run;                           // sample i, on input set i % n
  std::function<void()> prepare;                          // before the validation run: poison set 0's outputs
  std::function<optimized::testing::CheckResult()> check; // after it: set 0's outputs against the reference
  std::function<void(Result&)> annotate;                  // rows, before validating: e.g. what auto resolves to
  std::function<void()> settle;                           // after timing (may be empty)
};

// A group's baseline: a row of the group (timed first, e.g. the fused family's unfused variant) or
// a candidate of its own (cuBLAS, OpenBLAS).
struct BaselinePlan {
  std::string name;               // "cublas_bf16", "openblas_sgemm", "unfused"
  int row = -1;                   // the row that is the baseline; -1: baseline_candidate()
  bool timed_if_invalid = false;  // time (and note) a baseline whose check fails
};

class BenchGroup {
 public:
  virtual ~BenchGroup() = default;

  std::string family;    // "matmul", "fused": the progress lines' first word
  std::string label;     // "bf16 4096x4096x4096 cpu 2 threads": progress lines and notes
  bool cuda = false;
  int threads = 0;       // CPU groups
  std::vector<Result> rows;  // planned: status "ok" (to run) or "skipped" with the reason
  std::optional<BaselinePlan> baseline;
  int extra_tasks = 0;   // measurements after_rows() makes (progress steps of their own)

  int runnable() const;
  int tasks() const;  // progress steps: runnable rows, a baseline of its own, the extras

  // One input set's bytes (for the rotation), and the host memory a CPU group's sets may take.
  virtual int64_t set_bytes() const = 0;
  virtual int64_t host_budget() const { return int64_t{1} << 30; }
  // Allocates `sets` input sets (set 0's inputs kept on the host for the check); throws on failure.
  virtual void allocate(int sets, const RunEnv& env) = 0;
  virtual Candidate row_candidate(size_t row, const RunEnv& env) = 0;
  virtual Candidate baseline_candidate(const RunEnv& env);  // default: throws (no baseline of its own)
  // The rows' roofline rates (the baseline's, where it is the ceiling: OpenBLAS on the CPU).
  virtual void roofline(const std::vector<Ceiling>& ceilings, const std::optional<BaselineResult>& baseline,
                        std::optional<Rate>& peak, std::optional<Rate>& bandwidth) const = 0;
  // Frees the operands.
  virtual void release() = 0;
  // After the rows, operands released: the family's extra measurements (extra_tasks progress
  // steps), attached to the rows that ran ("ok").
  virtual void after_rows(const RunEnv& env, const MeasureOptions& opt, Progress& progress,
                          std::vector<std::string>& notes) {
    (void)env, (void)opt, (void)progress, (void)notes;
  }
};

using Groups = std::vector<std::unique_ptr<BenchGroup>>;

int count_tasks(const Groups& groups);

// Runs every group (see above); appends the rows to `results` and notes to `notes`.
void run_groups(Groups& groups, const MeasureOptions& measure, const std::vector<Ceiling>& ceilings,
                Progress& progress, std::vector<Result>& results, std::vector<std::string>& notes);

// ---- helpers the plug-ins share ---------------------------------------------------------------

// "validation: 3 of 4096 checked elements over their bound (worst ratio 2.1); first: ...".
std::string failure_reason(const optimized::testing::CheckResult& c);
Validation to_validation(const optimized::testing::CheckResult& c);
// Items split at commas, empty ones dropped: {"a,b", "c"} -> {"a", "b", "c"}.
std::vector<std::string> split_commas(const std::vector<std::string>& items);
// The positive integers of `text` separated by any of `separators` ("4097x4095x4093" with "xX":
// {4097, 4095, 4093}); empty when a part is not a positive integer.
std::vector<int64_t> parse_sizes(const std::string& text, const std::string& separators);
// Float dtypes of a --dtype(s) list (fp32, fp16, bf16), in order, once each; `what` names the
// option and the op in the error: "--dtype: matmul takes fp32, fp16 or bf16; given 'fp8'".
std::vector<optimized::DType> parse_float_dtypes(const std::vector<std::string>& items, const std::string& what);
}  // namespace bench
