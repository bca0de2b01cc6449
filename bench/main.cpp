// optimized-bench: one command that proves every claim of optimized-ops against the best
// alternative measured in the same run (house rule 4).
//
//   optimized-bench all [--json FILE]                 the standard report (ceilings, GPU, CPU)
//   optimized-bench matmul --size 4096 --dtype bf16 --variant all
//   optimized-bench fused --ops rms_norm,softmax --shapes 16384x8192 --dtypes bf16
//   optimized-bench ceilings
//
// Exit status: 0 when every row that ran passed validation, 1 when a row failed, 2 on a usage
// error (CLI11 codes for parse errors), 3 on an unexpected error.
#include <algorithm>
#include <cstdio>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "baselines/openblas_gemm.h"
#include "ceilings.h"
#include "fused_bench.h"
#include "gemm_bench.h"
#include "gpu_timer.h"
#include "harness.h"
#include "optimized/core.h"
#include "optimized/fused.h"
#include "optimized/gemm.h"
#include "report.h"

namespace {

using optimized::DType;
using optimized::GemmVariant;

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

int all_threads() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

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

std::vector<GemmVariant> parse_variants(const std::vector<std::string>& items) {
  std::vector<GemmVariant> out;
  auto add = [&](GemmVariant v) {
    if (std::find(out.begin(), out.end(), v) == out.end()) out.push_back(v);
  };
  for (const auto& name : split_commas(items)) {
    if (name == "all") {
      for (GemmVariant v : optimized::all_gemm_variants()) add(v);
    } else if (name == "cpu" || name == "cuda") {
      for (GemmVariant v : optimized::all_gemm_variants())
        if (optimized::gemm_variant_is_cuda(v) == (name == "cuda")) add(v);
    } else {
      add(optimized::parse_gemm_variant(name));  // throws Error naming the choices
    }
  }
  return out;
}

std::vector<DType> parse_dtypes(const std::vector<std::string>& items) {
  std::vector<DType> out;
  for (const auto& name : split_commas(items)) {
    const DType d = optimized::parse_dtype(name);
    if (d != DType::kF32 && d != DType::kF16 && d != DType::kBF16)
      throw std::invalid_argument("--dtype: matmul takes fp32, fp16 or bf16; given '" + name + "'");
    if (std::find(out.begin(), out.end(), d) == out.end()) out.push_back(d);
  }
  return out;
}

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

bool any_failed(const bench::Report& report) {
  return std::any_of(report.results.begin(), report.results.end(),
                     [](const bench::Result& r) { return r.status == "failed"; });
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
  return any_failed(report) ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "optimized-bench: validate, then time, every variant of the optimized-ops kernels against the\n"
      "best alternative (cuBLAS, OpenBLAS) and the machine's ceilings, measured in the same run."};
  app.require_subcommand(1);

  // ---- matmul ---------------------------------------------------------------------------------
  CommonOptions matmul_common;
  std::vector<std::string> sizes, dtypes{"fp32"}, variants{"all"};
  int64_t m = 0, n = 0, k = 0, batch = 1;
  std::vector<int> threads;
  float alpha = 1.0f, beta = 0.0f;
  int64_t cpu_max_size = 0;
  bool no_baseline = false, no_ceilings = false;
  CLI::App* matmul = app.add_subcommand("matmul", "Benchmark GEMM variants (C = alpha*A@B + beta*C)");
  matmul->add_option("--size", sizes,
                     "N (N^3), MxNxK or BxMxNxK; repeat or separate with commas [default: 1024]")
      ->delimiter(',');
  matmul->add_option("--m", m, "M (with --n and --k: one more shape)");
  matmul->add_option("--n", n, "N (with --m and --k)");
  matmul->add_option("--k", k, "K (with --m and --n)");
  matmul->add_option("--batch", batch, "Batch count for every shape given by --m/--n/--k or a plain --size")
      ->capture_default_str();
  matmul->add_option("--dtype", dtypes, "fp32, fp16, bf16; repeat or separate with commas")
      ->delimiter(',')
      ->capture_default_str();
  matmul->add_option("--variant", variants,
                     "all | cpu | cuda | names (cpu_naive, cpu_blocked, cpu_packed, naive, coalesced, "
                     "smem_tiled, register_tiled, wmma, mma_pipeline, auto), separated by commas")
      ->delimiter(',')
      ->capture_default_str();
  matmul->add_option("--threads", threads, "CPU thread counts (0: all) [default: 1 and all]")->delimiter(',');
  matmul->add_option("--alpha", alpha, "alpha")->capture_default_str();
  matmul->add_option("--beta", beta, "beta (non-zero: C is read too and counted in min bytes)")->capture_default_str();
  matmul->add_option("--cpu-max-size", cpu_max_size,
                     "Run cpu_naive and cpu_blocked up to M*N*K <= S^3 [default: naive 1024, blocked 2048]");
  matmul->add_flag("--no-baseline", no_baseline, "Do not measure cuBLAS / OpenBLAS next to each row");
  matmul->add_flag("--no-ceilings", no_ceilings, "Do not measure the ceilings (no roofline column)");
  add_common_options(matmul, matmul_common);

  // ---- fused ---------------------------------------------------------------------------------
  CommonOptions fused_common;
  bench::FusedFilters fused_filters;
  bool fused_quick = false, fused_no_baseline = false, fused_no_copy = false, fused_no_ceilings = false;
  std::string fused_gelu = "none";
  int fused_threads = 0, fused_check_rows = 64;
  int64_t fused_cpu_max = 0;
  CLI::App* fused = app.add_subcommand(
      "fused",
      "Benchmark the fused memory-bound ops (softmax, log_softmax, layer_norm, rms_norm, add_layer_norm,\n"
      "add_rms_norm, bias_gelu, silu_and_mul; fwd and bwd) in GB/s of their minimum bytes, vs the unfused\n"
      "variant, the measured device copy bandwidth and a same-size copy. Default: bf16 on rows {4096, 16384} x\n"
      "width {1024 ... 32768} and edge shapes, fp16/fp32 on a few shapes, the cpu variant at two small shapes");
  fused->add_option("--ops", fused_filters.ops, "all, or op names separated by commas")->delimiter(',')->capture_default_str();
  fused->add_option("--directions", fused_filters.directions, "fwd, bwd")->delimiter(',')->capture_default_str();
  fused->add_option("--dtypes", fused_filters.dtypes, "fp32, fp16, bf16 [default: each standard config's]")
      ->delimiter(',');
  fused->add_option("--shapes", fused_filters.shapes,
                    "ROWSxWIDTH or ROWSxWIDTH:LD (row stride), separated by commas [default: the standard grid]; "
                    "silu_and_mul's WIDTH is d (x holds 2*d)")
      ->delimiter(',');
  fused->add_option("--variants", fused_filters.variants,
                    "all | cuda | cpu | names (unfused, fused_streaming, fused_registers, auto, cpu)")
      ->delimiter(',')
      ->capture_default_str();
  fused->add_flag("--quick", fused_quick, "A few shapes per dtype and short measurements (--min-time 0.05 --max-time 0.3)");
  fused->add_option("--threads", fused_threads, "CPU rows: thread count (0: all)")->capture_default_str();
  fused->add_option("--gelu", fused_gelu, "bias_gelu's form: none (erf) or tanh")->capture_default_str();
  fused->add_option("--check-rows", fused_check_rows,
                    "Rows validated per large group (first, last, evenly spaced); groups of <= 2^24 elements are checked whole")
      ->capture_default_str();
  fused->add_option("--cpu-max-elements", fused_cpu_max, "Run the cpu variant up to rows*width <= N [default: 2^24]");
  fused->add_flag("--no-baseline", fused_no_baseline, "Do not time the unfused variant next to the CUDA rows");
  fused->add_flag("--no-copy", fused_no_copy, "Do not time the same-size device copy next to each group");
  fused->add_flag("--no-ceilings", fused_no_ceilings, "Do not measure the copy bandwidth (no roofline column)");
  add_common_options(fused, fused_common);

  // ---- ceilings -------------------------------------------------------------------------------
  CommonOptions ceilings_common;
  CLI::App* ceilings = app.add_subcommand(
      "ceilings", "Measure the machine's ceilings: device/host copy bandwidth, cuBLAS and OpenBLAS GEMM rates");
  add_common_options(ceilings, ceilings_common);

  // ---- all ------------------------------------------------------------------------------------
  CommonOptions all_common;
  bool all_no_cpu = false, all_no_gpu = false, all_no_fused = false, all_fused_quick = false;
  int64_t all_cpu_max_size = 0;
  CLI::App* all = app.add_subcommand(
      "all",
      "The standard report: ceilings; every GPU variant at fp32 and bf16 for 1024, 4096, 8192 and\n"
      "4097x4095x4093 vs cuBLAS; every CPU variant at fp32 for 1024 and 2048, 1 and all threads, vs OpenBLAS;\n"
      "the fused ops on their standard grid (see `fused --help`)");
  all->add_flag("--no-cpu", all_no_cpu, "Leave out the CPU rows");
  all->add_flag("--no-gpu", all_no_gpu, "Leave out the GPU rows and ceilings");
  all->add_option("--cpu-max-size", all_cpu_max_size,
                  "Run cpu_naive and cpu_blocked up to M*N*K <= S^3 [default: naive 1024, blocked 2048]");
  all->add_flag("--no-fused", all_no_fused, "Leave out the fused ops");
  all->add_flag("--fused-quick", all_fused_quick, "The fused ops on a few shapes only (as `fused --quick`)");
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
    const bool gpu = report.machine.gpu.has_value();
    bench::Progress progress;

    CommonOptions& common = matmul->parsed()   ? matmul_common
                             : fused->parsed()  ? fused_common
                             : ceilings->parsed() ? ceilings_common
                                                  : all_common;
    common.measure.flush_cache = !common.no_flush;
    if (fused->parsed() && fused_quick) {  // shorter measurements unless given
      if (fused->count("--min-time") == 0) common.measure.min_time_s = 0.05;
      if (fused->count("--max-time") == 0) common.measure.max_time_s = 0.3;
    }
    report.options = common.measure;

    auto note_openblas = [&] {
      if (!bench::openblas_available())
        report.notes.push_back("OpenBLAS not found: the CPU rows carry no baseline and no roofline");
    };

    if (ceilings->parsed()) {
      const bench::CeilingPlan plan = bench::CeilingPlan::everything(gpu);
      if (!gpu) report.notes.push_back("no CUDA GPU found (" + optimized::cuda_unavailable_reason() + "): host ceilings only");
      note_openblas();
      progress.set_total(plan.count());
      report.ceilings = bench::measure_ceilings(plan, common.measure, progress, report.notes);
      return finish(report, progress, common);
    }

    if (all->parsed()) {
      bench::GemmBenchConfig gpu_cfg, cpu_cfg;
      gpu_cfg.measure = cpu_cfg.measure = common.measure;
      gpu_cfg.shapes = {{1024, 1024, 1024}, {4096, 4096, 4096}, {8192, 8192, 8192}, {4097, 4095, 4093}};
      gpu_cfg.dtypes = {DType::kF32, DType::kBF16};
      for (GemmVariant v : optimized::all_gemm_variants())
        if (optimized::gemm_variant_is_cuda(v)) gpu_cfg.variants.push_back(v);
      cpu_cfg.shapes = {{1024, 1024, 1024}, {2048, 2048, 2048}};
      cpu_cfg.dtypes = {DType::kF32};
      for (GemmVariant v : optimized::all_gemm_variants())
        if (!optimized::gemm_variant_is_cuda(v)) cpu_cfg.variants.push_back(v);
      cpu_cfg.threads = resolve_threads({});
      if (all_cpu_max_size > 0) cpu_cfg.cpu_naive_max = cpu_cfg.cpu_blocked_max = all_cpu_max_size;

      const bool run_gpu = gpu && !all_no_gpu;
      if (!gpu && !all_no_gpu) {
        const std::string msg =
            "no CUDA GPU found (" + optimized::cuda_unavailable_reason() + "): running the CPU backend only";
        std::fprintf(stderr, "%s\n", msg.c_str());
        report.notes.push_back(msg);
      }
      if (!all_no_cpu) note_openblas();
      // The fused ops: the standard GPU configs when the GPU rows run, the CPU one with the CPU rows.
      std::vector<bench::FusedBenchConfig> fused_cfgs;
      if (!all_no_fused) {
        for (bench::FusedBenchConfig c : bench::default_fused_configs(all_fused_quick, run_gpu)) {
          const bool cpu_config = c.variants == std::vector<optimized::FusedVariant>{optimized::FusedVariant::kCpu};
          if (cpu_config && all_no_cpu) continue;
          c.measure = common.measure;
          fused_cfgs.push_back(c);
        }
      }
      int fused_tasks = 0;
      for (const auto& c : fused_cfgs) fused_tasks += bench::count_fused_tasks(c, run_gpu);
      bench::CeilingPlan plan = bench::CeilingPlan::everything(run_gpu);
      plan.host_copy = plan.openblas = !all_no_cpu;
      progress.set_total(plan.count() + (run_gpu ? bench::count_gemm_tasks(gpu_cfg, true) : 0) +
                         (all_no_cpu ? 0 : bench::count_gemm_tasks(cpu_cfg, gpu)) + fused_tasks);
      report.ceilings = bench::measure_ceilings(plan, common.measure, progress, report.notes);
      if (run_gpu) bench::run_gemm_bench(gpu_cfg, report.ceilings, progress, report.results, report.notes);
      if (!all_no_cpu) bench::run_gemm_bench(cpu_cfg, report.ceilings, progress, report.results, report.notes);
      if (!fused_cfgs.empty()) {
        for (auto& n : bench::fused_notes(fused_cfgs)) report.notes.push_back(n);
        for (const auto& c : fused_cfgs)
          bench::run_fused_bench(c, report.ceilings, progress, report.results, report.notes);
      }
      return finish(report, progress, common);
    }

    if (fused->parsed()) {
      std::vector<bench::FusedBenchConfig> cfgs = bench::fused_configs(fused_filters, fused_quick, gpu);
      const optimized::GeluApproximation gelu = fused_gelu == "tanh" ? optimized::GeluApproximation::kTanh
                                                : fused_gelu == "none"
                                                    ? optimized::GeluApproximation::kNone
                                                    : throw std::invalid_argument("--gelu: expected none or tanh; given '" +
                                                                                  fused_gelu + "'");
      if (fused_check_rows < 2) throw std::invalid_argument("--check-rows: expected >= 2");
      bool has_gpu_rows = false, has_cpu_rows = false;
      int tasks = 0;
      for (auto& c : cfgs) {
        c.measure = common.measure;
        c.threads = fused_threads;
        c.gelu = gelu;
        c.check_rows = fused_check_rows;
        c.baseline = !fused_no_baseline;
        c.copy_same_size = !fused_no_copy;
        if (fused_cpu_max > 0) c.cpu_max_elements = fused_cpu_max;
        for (auto v : c.variants)
          ((v == optimized::FusedVariant::kAuto ? gpu : optimized::fused_variant_is_cuda(v)) ? has_gpu_rows
                                                                                             : has_cpu_rows) = true;
        tasks += bench::count_fused_tasks(c, gpu);
      }
      if (cfgs.empty()) throw std::invalid_argument("fused: the filters leave no row to run");
      if (!gpu)
        report.notes.push_back("no CUDA GPU found (" + optimized::cuda_unavailable_reason() +
                               "): the CUDA rows are left out (or listed as skipped when named)");
      bench::CeilingPlan plan;
      if (!fused_no_ceilings) {
        plan.device_copy = has_gpu_rows && gpu;
        plan.host_copy = has_cpu_rows;
      }
      progress.set_total(plan.count() + tasks);
      report.ceilings = bench::measure_ceilings(plan, common.measure, progress, report.notes);
      for (auto& n : bench::fused_notes(cfgs)) report.notes.push_back(n);
      for (const auto& c : cfgs) bench::run_fused_bench(c, report.ceilings, progress, report.results, report.notes);
      return finish(report, progress, common);
    }

    // matmul
    bench::GemmBenchConfig cfg;
    cfg.measure = common.measure;
    for (const auto& text : sizes) {
      bench::GemmShape s = bench::parse_gemm_shape(text);
      if (s.batch == 1) s.batch = batch;
      cfg.shapes.push_back(s);
    }
    const int given_mnk = (m > 0) + (n > 0) + (k > 0);
    if (given_mnk != 0 && given_mnk != 3) throw std::invalid_argument("--m, --n and --k go together (all three, positive)");
    if (given_mnk == 3) cfg.shapes.push_back({m, n, k, batch});
    if (cfg.shapes.empty()) cfg.shapes.push_back({1024, 1024, 1024, batch});
    if (batch < 1) throw std::invalid_argument("--batch: expected >= 1; given " + std::to_string(batch));
    cfg.dtypes = parse_dtypes(dtypes);
    cfg.variants = parse_variants(variants);
    cfg.threads = resolve_threads(threads);
    cfg.alpha = alpha;
    cfg.beta = beta;
    cfg.baselines = !no_baseline;
    if (cpu_max_size > 0) cfg.cpu_naive_max = cfg.cpu_blocked_max = cpu_max_size;

    bool has_gpu_rows = false, has_cpu_rows = false;
    for (GemmVariant v : cfg.variants) {
      const bool on_cuda = v == GemmVariant::kAuto ? gpu : optimized::gemm_variant_is_cuda(v);
      (on_cuda ? has_gpu_rows : has_cpu_rows) = true;
    }
    if (has_gpu_rows && !gpu)
      report.notes.push_back("no CUDA GPU found (" + optimized::cuda_unavailable_reason() + "): the CUDA rows are skipped");
    if (has_cpu_rows && !no_baseline) {
      bool any_fp32 = std::find(cfg.dtypes.begin(), cfg.dtypes.end(), DType::kF32) != cfg.dtypes.end();
      if (any_fp32) note_openblas();
    }
    bench::CeilingPlan plan;
    if (!no_ceilings) {
      if (has_gpu_rows && gpu) {
        plan.device_copy = true;
        for (DType d : cfg.dtypes) plan.cublas_modes.push_back(bench::cublas_mode_for(d));
      }
      plan.host_copy = has_cpu_rows;
    }
    progress.set_total(plan.count() + bench::count_gemm_tasks(cfg, gpu));
    report.ceilings = bench::measure_ceilings(plan, common.measure, progress, report.notes);
    bench::run_gemm_bench(cfg, report.ceilings, progress, report.results, report.notes);
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
