// optimized-bench: one command that proves every claim of optimized-ops against the best
// alternative measured in the same run (house rule 4).
//
//   optimized-bench all [--json FILE]                 the standard report (ceilings, GPU, CPU)
//   optimized-bench matmul --size 4096 --dtype bf16 --variant all
//   optimized-bench fused --ops rms_norm,softmax --shapes 16384x8192 --dtypes bf16
//   optimized-bench linear --size 8192x4096x4096 --cases bias_gelu,dgelu_bgrad   (vs cuBLASLt epilogues)
//   optimized-bench ceilings
//   optimized-bench matmul --size 4096 --variant all --metrics --json m.json   (+ Nsight Compute counters)
//
// The families are plug-ins (harness/family.h), listed in kFamilies below: each brings its
// subcommand, its share of `all` and its groups; the driver (harness/driver.h) runs the groups.
// This file owns what is common: the measurement options, the ceilings, the report, the exit status.
//
// Exit status: 0 when every row that ran passed validation, 1 when a row failed, 2 on a usage
// error (CLI11 codes for parse errors), 3 on an unexpected error.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
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
#include "metrics.h"
#include "metrics_child.h"
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
  bool metrics = false;        // --metrics: each CUDA row once more under Nsight Compute (metrics.h)
  bool metrics_child = false;  // --metrics-child: this process is that run (under ncu)
  int only_row = -1;           // --only-row: the row it keeps
};

// What the --metrics parent needs to start its children.
struct Invocation {
  std::string exe;                     // this executable
  std::vector<std::string> argv_tail;  // argv[1..]
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
  app->add_flag("--metrics", o.metrics,
                "After the timed run, run each CUDA row once more under Nsight Compute (ncu on PATH or\n"
                "$OPTIMIZED_NCU) and add its hardware counters to the row (JSON `metrics`) and a table");
  app->add_flag("--metrics-child", o.metrics_child, "(internal) the --metrics run of one row, under ncu")
      ->group("");
  app->add_option("--only-row", o.only_row, "(internal) with --metrics-child: the row index to run")->group("");
}

// The rows' metrics objects (metrics.h), in report order: ncu's counters for the CUDA rows that
// ran, "skipped" with the reason for the others (or for all of them where ncu is absent).
std::vector<nlohmann::ordered_json> collect_metrics(bench::Report& report, const Invocation& inv) {
  namespace m = bench::metrics;
  std::vector<nlohmann::ordered_json> out(report.results.size());
  const std::string ncu = m::find_ncu();
  if (ncu.empty()) {
    const std::string reason = m::ncu_missing_reason();
    std::fprintf(stderr, "optimized-bench: --metrics: %s\n", reason.c_str());
    report.notes.push_back("--metrics: " + reason);
    for (size_t i = 0; i < out.size(); ++i)
      out[i] = m::skipped(report.results[i].backend == "cuda" ? reason : "CPU row: no GPU counters");
    return out;
  }
  const int cc = m::device_compute_capability();
  std::string workdir;
  {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/optimized-bench-metrics-XXXXXX";
    std::vector<char> buf(templ.begin(), templ.end());
    buf.push_back('\0');
    if (!::mkdtemp(buf.data())) {
      const std::string reason = "cannot create a directory for ncu's output (" + templ + ")";
      for (auto& j : out) j = m::failed(reason);
      return out;
    }
    workdir = buf.data();
  }
  int profiled = 0, total = 0;
  for (const auto& r : report.results) total += (r.status == "ok" && r.backend == "cuda") ? 1 : 0;
  std::fprintf(stderr, "--metrics: %s, sm_%d, %d row(s); ncu output under %s\n", ncu.c_str(), cc, total,
               workdir.c_str());
  for (size_t i = 0; i < report.results.size(); ++i) {
    const bench::Result& r = report.results[i];
    if (r.backend != "cuda") {
      out[i] = m::skipped("CPU row: no GPU counters");
      continue;
    }
    if (r.status != "ok") {
      out[i] = m::skipped("the row did not run (" + r.status + ")");
      continue;
    }
    const m::RowIdentity id = m::identity_of(r);
    std::fprintf(stderr, "[metrics %d/%d] %s\n", ++profiled, total, id.text().c_str());
    out[i] = m::run_ncu_row(ncu, inv.exe, inv.argv_tail, static_cast<int>(i), id, r.min_bytes, cc, workdir);
  }
  ::rmdir(workdir.c_str());  // left in place (with the failed rows' logs) when not empty
  report.notes.push_back("--metrics: Nsight Compute (" + ncu + "), one run of each CUDA row in a child process; "
                         "memory_efficiency = min_bytes / (DRAM bytes read + written)");
  return out;
}

int finish(bench::Report& report, bench::Progress& progress, const CommonOptions& common, const Invocation& inv) {
  progress.finish();
  std::vector<nlohmann::ordered_json> metrics;
  if (common.metrics && !common.metrics_child) metrics = collect_metrics(report, inv);
  bench::print_machine(stdout, report);
  bench::print_ceilings(stdout, report.ceilings);
  bench::print_results(stdout, report.results);
  if (!metrics.empty()) {
    std::vector<bench::metrics::TableRow> table;
    for (size_t i = 0; i < report.results.size(); ++i)
      if (report.results[i].backend == "cuda")
        table.push_back({bench::metrics::identity_of(report.results[i]).text(), metrics[i]});
    bench::metrics::print_table(stdout, table);
  }
  bench::print_notes(stdout, report);
  const int failed = static_cast<int>(std::count_if(report.results.begin(), report.results.end(),
                                                    [](const bench::Result& r) { return r.status == "failed"; }));
  if (failed > 0) std::printf("\n%d row(s) FAILED\n", failed);
  std::fflush(stdout);
  if (!common.json_path.empty() && metrics.empty()) {
    bench::write_json(report, common.json_path);
    std::fprintf(stderr, "wrote %s\n", common.json_path.c_str());
  } else if (!common.json_path.empty()) {  // the report's JSON, each row with its `metrics`
    nlohmann::ordered_json j = bench::report_json(report);
    for (size_t i = 0; i < metrics.size() && i < j["results"].size(); ++i) j["results"][i]["metrics"] = metrics[i];
    std::ofstream f(common.json_path);
    if (!f) throw std::runtime_error("--json: cannot open '" + common.json_path + "' for writing");
    f << j.dump(2) << "\n";
    if (!f) throw std::runtime_error("--json: writing '" + common.json_path + "' failed");
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
    Invocation inv;
    {
      char buf[4096];
      const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
      inv.exe = n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string(argv[0]);
      for (int i = 1; i < argc; ++i) inv.argv_tail.emplace_back(argv[i]);
    }
    if (common.metrics_child != (common.only_row >= 0))
      throw std::invalid_argument("--metrics-child and --only-row go together (the --metrics run of one row)");
    // The --metrics child: one row, no ceilings (metrics.h).
    auto child = [&](std::vector<bench::FamilyRun>& runs, bench::CeilingPlan& ceilings) {
      if (!common.metrics_child) return;
      bench::metrics::RowIdentity id;
      if (!bench::metrics::keep_only_row(runs, common.only_row, id))
        throw std::invalid_argument("--only-row " + std::to_string(common.only_row) +
                                    ": no CUDA row planned to run at that index");
      ceilings = bench::CeilingPlan{};
      std::printf("%s\n", bench::metrics::identity_line(id).c_str());
      std::fflush(stdout);
    };
    auto note_openblas = [&] {
      if (!bench::openblas_available())
        report.notes.push_back("OpenBLAS not found: the CPU rows carry no baseline and no roofline");
    };

    if (chosen < families.size()) {
      bench::SubcommandPlan plan = families[chosen]->plan(env, *subs[chosen], common.measure);
      report.options = common.measure;
      for (auto& n : plan.notes) report.notes.push_back(n);
      child(plan.runs, plan.ceilings);
      run(report, progress, plan.ceilings, plan.runs, common.measure);
      return finish(report, progress, common, inv);
    }
    report.options = common.measure;

    if (ceilings->parsed()) {
      const bench::CeilingPlan plan = bench::CeilingPlan::everything(env.gpu);
      if (!env.gpu)
        report.notes.push_back("no CUDA GPU found (" + optimized::cuda_unavailable_reason() + "): host ceilings only");
      note_openblas();
      std::vector<bench::FamilyRun> none;
      run(report, progress, plan, none, common.measure);
      return finish(report, progress, common, inv);
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
    child(runs, plan);
    run(report, progress, plan, runs, common.measure);
    return finish(report, progress, common, inv);
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
