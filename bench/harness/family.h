// A family's place in the optimized-bench CLI: its subcommand (`optimized-bench matmul ...`), its
// share of the standard report (`optimized-bench all`), and the groups both plan for the driver
// (driver.h). bench/main.cpp lists the families (the registry) and owns what is common: the
// measurement options, the ceilings, the report, the exit status.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "harness/ceilings.h"
#include "harness/driver.h"
#include "harness/harness.h"

namespace bench {

// What the machine offers.
struct Env {
  bool gpu = false;
};

// The options of `optimized-bench all` every family reads.
struct AllOptions {
  bool gpu = false;     // the machine has one
  bool no_cpu = false;  // leave out the CPU rows
  bool no_gpu = false;  // leave out the GPU rows and ceilings
  bool run_gpu() const { return gpu && !no_gpu; }
};

// The rows of one family's config, with the measurement options they run under and the notes the
// report carries about them (added just before they run).
struct FamilyRun {
  Groups groups;
  MeasureOptions measure;
  std::vector<std::string> notes;
};

// What a subcommand asks for.
struct SubcommandPlan {
  std::vector<FamilyRun> runs;
  CeilingPlan ceilings;             // the ceilings its rooflines need
  std::vector<std::string> notes;   // added to the report first (no GPU, no OpenBLAS, ...)
};

class Family {
 public:
  virtual ~Family() = default;
  // Adds the family's subcommand (with its options) to `app`; the shared measurement options are
  // added by main. Returns the subcommand.
  virtual CLI::App* add_subcommand(CLI::App& app) = 0;
  // Adds the family's options of `optimized-bench all`.
  virtual void add_all_options(CLI::App& all) = 0;
  // The subcommand's plan, after parsing. `measure`: the shared options as given; the family may
  // adjust what was not given (quick runs). Throws std::invalid_argument / optimized::Error on
  // bad option values.
  virtual SubcommandPlan plan(const Env& env, const CLI::App& sub, MeasureOptions& measure) = 0;
  // The family's share of `optimized-bench all`.
  virtual std::vector<FamilyRun> plan_all(const AllOptions& all, const MeasureOptions& measure) = 0;
};

// The families (bench/main.cpp's registry), in report order.
std::unique_ptr<Family> make_gemm_family();   // bench/gemm/gemm_bench.cpp
std::unique_ptr<Family> make_fused_family();  // bench/fused/fused_bench.cpp
std::unique_ptr<Family> make_scaled_gemm_family();  // bench/gemm/scaled_bench.cpp
std::unique_ptr<Family> make_linear_family();  // bench/gemm/epilogue_bench.cpp

}  // namespace bench
