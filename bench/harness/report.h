// Result records shared by every op family of optimized-bench, and their two renderings: an
// aligned table for people (stdout) and JSON for tools (schema "optimized-ops-bench/1").
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "harness/harness.h"

namespace bench {

struct Validation {
  bool passed = false;
  double max_rel_error = 0;
  double worst_ratio = 0;  // error / allowed error, worst element (<= 1 passes)
  int64_t checked = 0;
};

// What the compiler and the occupancy calculator say of a GPU kernel.
struct KernelInfo {
  std::string name;
  int registers = 0;
  int static_smem = 0;
  int dynamic_smem = 0;
  int threads = 0;
  int blocks_per_sm = 0;
  double occupancy = 0;
  int local_bytes = 0;
};

// A named rate: a roofline peak (TFLOP/s) or bandwidth (GB/s).
struct Rate {
  std::string name;
  double value = 0;
  std::string unit;
};

struct BaselineResult {
  std::string name;  // "cublas_bf16", "openblas_sgemm"
  Stats time;
  double tflops = 0;
  std::optional<Validation> validation;
};

// One row: an op variant at one shape, dtype and backend (and thread count on the CPU).
struct Result {
  std::string op;       // "matmul"
  std::string variant;  // "register_tiled"
  std::string backend;  // "cuda" | "cpu"
  std::string dtype;    // "bf16"
  std::vector<std::pair<std::string, int64_t>> shape;  // {{"m", 4096}, {"n", ...}, ...}
  std::string shape_label;                              // "4096x4096x4096"
  std::optional<int> threads;                           // CPU rows
  std::string status = "ok";                            // "ok" | "skipped" | "failed"
  std::string reason;
  std::optional<Validation> validation;
  Stats time;
  double flops = 0;
  double min_bytes = 0;
  std::optional<BaselineResult> baseline;
  std::optional<Rate> roofline_peak;       // compute ceiling used for the roofline (TFLOP/s)
  std::optional<Rate> roofline_bandwidth;  // memory ceiling used for the roofline (GB/s)
  std::optional<KernelInfo> kernel;
  std::string resolved_variant;            // for "auto": what it resolved to
  // Memory-bound families (fused_bench.h); empty / absent for GEMM rows.
  std::string family;                      // "fused": names the results file (fused.json)
  std::string direction;                   // "fwd" | "bwd"
  std::string bytes_formula;               // how min_bytes was counted: "2*R*W*E (read x, write y)"
  std::optional<Stats> copy_same_size;     // a device copy moving min_bytes (min_bytes/2 read and
                                           // min_bytes/2 written), timed the same way in the same run

  bool timed() const { return status == "ok" && time.valid(); }
  double tflops() const;             // flops / median time / 1e12; NaN when not timed
  double gbps() const;               // min_bytes / median time / 1e9
  double vs_baseline() const;        // baseline median / our median (> 1: faster); NaN when none
  double roofline_fraction() const;  // max(flops/peak, bytes/bandwidth) / time; NaN when no peak
                                     // (rows with flops == 0: bytes/bandwidth, the copy fraction)
  double vs_copy_same_size() const;  // copy_same_size median / our median; NaN when none
};

// A machine ceiling measured in the same run.
struct Ceiling {
  std::string name;   // "device_copy", "host_copy", "cublas_bf16", ..., "openblas_sgemm"
  std::string unit;   // "GB/s" | "TFLOP/s" | "GFLOP/s"
  std::string shape;  // "4096x4096x4096" for GEMMs; empty otherwise
  double value = 0;
  Stats time;
  int64_t bytes = 0;  // copies: bytes moved per run (read + written)
  int threads = 0;    // CPU ceilings
};

// Best (highest) ceiling of that name, or null.
const Ceiling* best_ceiling(const std::vector<Ceiling>& ceilings, const std::string& name);

struct Machine {
  std::optional<std::string> gpu;
  std::string gpu_key = "cpu";
  int sm_count = 0;
  int64_t l2_bytes = 0;
  int cuda_runtime = 0;
  int cuda_driver = 0;
  std::string cpu;
  int cpu_threads = 0;
  std::string cpu_isa;
  int64_t cpu_llc_bytes = 0;
};

struct Report {
  std::string created;  // ISO-8601 UTC
  std::string command;  // argv joined
  Machine machine;
  MeasureOptions options;
  std::vector<Ceiling> ceilings;
  std::vector<Result> results;
  std::vector<std::string> notes;  // "OpenBLAS not found: the CPU rows carry no baseline"
};

std::string iso8601_utc_now();
Machine query_machine();

nlohmann::ordered_json stats_json(const Stats& s);
nlohmann::ordered_json report_json(const Report& report);
// Writes report_json(report) to `path`; throws std::runtime_error when the file cannot be written.
void write_json(const Report& report, const std::string& path);

void print_machine(FILE* out, const Report& report);
void print_ceilings(FILE* out, const std::vector<Ceiling>& ceilings);
void print_results(FILE* out, const std::vector<Result>& results);
void print_notes(FILE* out, const Report& report);

// Progress on stderr: "[12/64] matmul register_tiled bf16 4096x4096x4096 ..."; rewritten in place
// (\r) when stderr is a terminal, one line per step otherwise.
class Progress {
 public:
  explicit Progress(int total = 0);
  void set_total(int total) { total_ = total; }
  void step(const std::string& what);
  void finish();  // ends the in-place line

 private:
  int total_ = 0;
  int done_ = 0;
  bool tty_ = false;
  bool open_line_ = false;
};

}  // namespace bench
