// optimized-bench: one command that proves every claim of optimized-ops against the best
// alternative measured in the same run (house rule 4).
//
//   optimized-bench all [--json FILE]                 the standard report (ceilings, GPU, CPU)
//   optimized-bench matmul --size 4096 --dtype bf16 --variant all
//   optimized-bench fused --ops rms_norm,softmax --shapes 16384x8192 --dtypes bf16
//   optimized-bench linear --size 8192x4096x4096 --cases bias_gelu,dgelu_bgrad   (vs cuBLASLt epilogues)
//   optimized-bench ceilings
//
// The families are plug-ins (harness/family.h), listed in kFamilies below: each brings its
// subcommand, its share of `all` and its groups; the driver (harness/driver.h) runs the groups.
// This file owns what is common: the measurement options, the ceilings, the report, the exit status.
//
// Exit status: 0 when every row that ran passed validation, 1 when a row failed, 2 on a usage
// error (CLI11 codes for parse errors), 3 on an unexpected error.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "baselines/openblas_gemm.h"
#include "harness/ceilings.h"
#include "harness/driver.h"
#include "harness/family.h"
#include "harness/harness.h"
#include "harness/report.h"
#include "optimized/core.h"

namespace {

// The registry: every family's benchmark, in report order.
std::vector<std::unique_ptr<bench::Family>> make_families() {
  std::vector<std::unique_ptr<bench::Family>> f;
  f.push_back(bench::make_gemm_family());
  f.push_back(bench::make_fused_family());
  f.push_back(bench::make_scaled_gemm_family());
  f.push_back(bench::make_linear_family());
  return f;
}

struct CommonOptions {
  std::string json_path;
  bench::MeasureOptions measure;
  bool no_flush = false;
};

void add_common_options(CLI::App* app, CommonOptions& o) {
  app->add_option("--json", o.json_path, "Also write the report as JSON (schema optimized-ops-bench/1) to FILE")
      ->type_name("FILE");
  app->add_option("--min-samples", o.measure.min_samples, "Samples taken at least, per measurement")
      ->capture_default_str();
  app->add_option("--max-samples", o.measure.max_samples, "Samples taken at most, per measurement")
      ->capture_default_str();
  app->add_option("--min-time", o.measure.min_time_s, "Seconds spent at least, per measurement")
      ->capture_default_str();
  app->add_option("--max-time", o.measure.max_time_s,
                  "Seconds spent at most, per measurement (at least 3 samples are always taken)")
      ->capture_default_str();
  app->add_option("--target-rse", o.measure.target_rse,
                  "Stop once stddev/mean/sqrt(n) falls below this (after the minimums)")
      ->capture_default_str();
  app->add_option("--warmup", o.measure.warmup_s, "Seconds of warm-up runs before timing")->capture_default_str();
  app->add_flag("--no-flush", o.no_flush, "Do not flush the L2 (GPU) / last-level cache (CPU) between samples");
}

int finish(bench::Report& report, bench::Progress& progress, const CommonOptions& common) {
  progress.finish();
  bench::print_machine(stdout, report);
  bench::print_ceilings(stdout, report.ceilings);
  bench::print_results(stdout, report.results);
  bench::print_notes(stdout, report);
  const int failed = static_cast<int>(std::count_if(report.results.begin(), report.results.end(),
                                                    [](const bench::Result& r) { return r.status == "failed"; }));
  if (failed > 0) std::printf("\n%d row(s) FAILED\n", failed);
  std::fflush(stdout);
  if (!common.json_path.empty()) {
    bench::write_json(report, common.json_path);
    std::fprintf(stderr, "wrote %s\n", common.json_path.c_str());
  }
  return failed > 0 ? 1 : 0;
}

// Measures the ceilings, then runs every family's rows (their notes added just before).
void run(bench::Report& report, bench::Progress& progress, const bench::CeilingPlan& ceilings,
         std::vector<bench::FamilyRun>& runs, const bench::MeasureOptions& measure) {
  int tasks = ceilings.count();
  for (const auto& r : runs) tasks += bench::count_tasks(r.groups);
  progress.set_total(tasks);
  report.ceilings = bench::measure_ceilings(ceilings, measure, progress, report.notes);
  for (auto& r : runs) {
    for (auto& n : r.notes) report.notes.push_back(n);
    bench::run_groups(r.groups, r.measure, report.ceilings, progress, report.results, report.notes);
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "optimized-bench: validate, then time, every variant of the optimized-ops kernels against the\n"
      "best alternative (cuBLAS, OpenBLAS) and the machine's ceilings, measured in the same run."};
  app.require_subcommand(1);
  const auto families = make_families();

  // ---- the families' subcommands ------------------------------------------------------------
  std::vector<CLI::App*> subs;
  std::vector<CommonOptions> family_common(families.size());
  for (size_t i = 0; i < families.size(); ++i) {
    subs.push_back(families[i]->add_subcommand(app));
    add_common_options(subs.back(), family_common[i]);
  }

  // ---- ceilings -------------------------------------------------------------------------------
  CommonOptions ceilings_common;
  CLI::App* ceilings = app.add_subcommand(
      "ceilings", "Measure the machine's ceilings: device/host copy bandwidth, cuBLAS and OpenBLAS GEMM rates");
  add_common_options(ceilings, ceilings_common);

  // ---- all ------------------------------------------------------------------------------------
  CommonOptions all_common;
  bench::AllOptions all_options;
  CLI::App* all = app.add_subcommand(
      "all",
      "The standard report: ceilings; every GPU variant at fp32 and bf16 for 1024, 4096, 8192 and\n"
      "4097x4095x4093 vs cuBLAS; every CPU variant at fp32 for 1024 and 2048, 1 and all threads, vs OpenBLAS;\n"
      "the fused ops on their standard grid (see `fused --help`)");
  all->add_flag("--no-cpu", all_options.no_cpu, "Leave out the CPU rows");
  all->add_flag("--no-gpu", all_options.no_gpu, "Leave out the GPU rows and ceilings");
  for (const auto& f : families) f->add_all_options(*all);
  add_common_options(all, all_common);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  try {
    bench::Report report;
    report.created = bench::iso8601_utc_now();
    for (int i = 0; i < argc; ++i) report.command += (i ? " " : "") + std::string(argv[i]);
    report.machine = bench::query_machine();
    const bench::Env env{report.machine.gpu.has_value()};
    bench::Progress progress;

    size_t chosen = families.size();
    for (size_t i = 0; i < families.size(); ++i)
      if (subs[i]->parsed()) chosen = i;
    CommonOptions& common = chosen < families.size() ? family_common[chosen]
                            : ceilings->parsed()     ? ceilings_common
                                                     : all_common;
    common.measure.flush_cache = !common.no_flush;
    auto note_openblas = [&] {
      if (!bench::openblas_available())
        report.notes.push_back("OpenBLAS not found: the CPU rows carry no baseline and no roofline");
    };

    if (chosen < families.size()) {
      bench::SubcommandPlan plan = families[chosen]->plan(env, *subs[chosen], common.measure);
      report.options = common.measure;
      for (auto& n : plan.notes) report.notes.push_back(n);
      run(report, progress, plan.ceilings, plan.runs, common.measure);
      return finish(report, progress, common);
    }
    report.options = common.measure;

    if (ceilings->parsed()) {
      const bench::CeilingPlan plan = bench::CeilingPlan::everything(env.gpu);
      if (!env.gpu)
        report.notes.push_back("no CUDA GPU found (" + optimized::cuda_unavailable_reason() + "): host ceilings only");
      note_openblas();
      std::vector<bench::FamilyRun> none;
      run(report, progress, plan, none, common.measure);
      return finish(report, progress, common);
    }

    // all
    all_options.gpu = env.gpu;
    if (!env.gpu && !all_options.no_gpu) {
      const std::string msg =
          "no CUDA GPU found (" + optimized::cuda_unavailable_reason() + "): running the CPU backend only";
      std::fprintf(stderr, "%s\n", msg.c_str());
      report.notes.push_back(msg);
    }
    if (!all_options.no_cpu) note_openblas();
    std::vector<bench::FamilyRun> runs;
    for (const auto& f : families)
      for (auto& r : f->plan_all(all_options, common.measure)) runs.push_back(std::move(r));
    bench::CeilingPlan plan = bench::CeilingPlan::everything(all_options.run_gpu());
    plan.host_copy = plan.openblas = !all_options.no_cpu;
    run(report, progress, plan, runs, common.measure);
    return finish(report, progress, common);
  } catch (const optimized::Error& e) {
    std::fprintf(stderr, "optimized-bench: %s\n", e.what());
    return e.status() == optimized::Status::kInvalidArgument ? 2 : 3;
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "optimized-bench: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "optimized-bench: error: %s\n", e.what());
    return 3;
  }
}
