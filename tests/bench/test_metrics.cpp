// optimized-bench --metrics (bench/metrics.h, issue 23): ncu's CSV parsed from captured samples, the
// row summary (sums, duration-weighted averages, memory_efficiency), absent metrics reported absent,
// the child's arguments; and on a GPU machine with ncu, the counters themselves (skipped elsewhere,
// with the reason).
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "metrics.h"

namespace m = bench::metrics;
using json = nlohmann::ordered_json;

namespace {

// `ncu --csv --page raw --print-units base --metrics ... --log-file F app`: the log holds ncu's own
// lines, then the header, the units row and one row per profiled kernel (two here: the row's kernel
// and a second one, e.g. a split-K reduction).
const char* kTwoKernels =
    "==PROF== Connected to process 4242 (/work/main/build/bench/optimized-bench)\n"
    "==PROF== Profiling \"gemm_naive_kernel\": 0%....50%....100% - 9 passes\n"
    "==PROF== Profiling \"reduce_kernel\": 0%....50%....100% - 9 passes\n"
    "==PROF== Disconnected from process 4242\n"
    "\"ID\",\"Process ID\",\"Process Name\",\"Host Name\",\"Kernel Name\",\"Context\",\"Stream\",\"Block Size\","
    "\"Grid Size\",\"Device\",\"CC\",\"dram__bytes_read.sum\",\"dram__bytes_write.sum\",\"gpu__time_duration.sum\","
    "\"launch__registers_per_thread\",\"sm__warps_active.avg.pct_of_peak_sustained_active\","
    "\"sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active\","
    "\"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio\","
    "\"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio\","
    "\"smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio\","
    "\"smsp__average_warps_issue_stalled_wait_per_issue_active.ratio\","
    "\"l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum\",\"l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum\"\n"
    "\"\",\"\",\"\",\"\",\"\",\"\",\"\",\"\",\"\",\"\",\"\",\"byte\",\"byte\",\"nsecond\",\"register/thread\",\"%\",\"%\","
    "\"\",\"\",\"\",\"\",\"byte\",\"byte\"\n"
    "\"0\",\"4242\",\"optimized-bench\",\"127.0.0.1\",\"void gemm_naive_kernel<float, 32>(Params)\",\"1\",\"13\","
    "\"(32, 8, 1)\",\"(128, 512, 1)\",\"0\",\"9.0\",\"100,000,000\",\"20,000,000\",\"3,000,000\",\"40\",\"80.0\","
    "\"0\",\"12.5\",\"0.5\",\"3.25\",\"1.0\",\"0\",\"0\"\n"
    "\"1\",\"4242\",\"optimized-bench\",\"127.0.0.1\",\"reduce_kernel(float const*, float*, int)\",\"1\",\"13\","
    "\"(256, 1, 1)\",\"(132, 1, 1)\",\"0\",\"9.0\",\"4,000,000\",\"1,000,000\",\"1,000,000\",\"72\",\"40.0\","
    "\"n/a\",\"2.5\",\"6.0\",\"0.25\",\"1.5\",\"1,024\",\"512\"\n";

}  // namespace

TEST(BenchMetrics, SplitsCsvLinesWithQuotesAndCommas) {
  const auto f = m::split_csv_line("\"a\",\"b,c\",\"d\"\"e\",,f");
  ASSERT_EQ(f.size(), 5u);
  EXPECT_EQ(f[0], "a");
  EXPECT_EQ(f[1], "b,c");
  EXPECT_EQ(f[2], "d\"e");
  EXPECT_EQ(f[3], "");
  EXPECT_EQ(f[4], "f");
}

TEST(BenchMetrics, ParsesRawPageSkippingProfilerLines) {
  const m::ParsedCsv csv = m::parse_ncu_csv(kTwoKernels);
  ASSERT_EQ(csv.kernels.size(), 2u);
  EXPECT_EQ(csv.metric_columns.size(), 12u);  // the info columns are not metrics
  EXPECT_EQ(csv.kernels[0].name, "void gemm_naive_kernel<float, 32>(Params)");
  EXPECT_DOUBLE_EQ(csv.kernels[0].values.at("dram__bytes_read.sum"), 1e8);  // "100,000,000"
  EXPECT_DOUBLE_EQ(csv.kernels[1].values.at("l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum"), 1024);
  // "n/a" is absent, not 0
  EXPECT_EQ(csv.kernels[1].values.count("sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"), 0u);
  ASSERT_EQ(csv.kernels[1].absent.size(), 1u);
}

TEST(BenchMetrics, ScalesAutoUnitsToBaseUnits) {
  // --print-units auto (ncu's default) prints Mbyte / usecond: the units row scales them back.
  const std::string text =
      "\"ID\",\"Process ID\",\"Process Name\",\"Host Name\",\"Kernel Name\",\"Context\",\"Stream\",\"Block Size\","
      "\"Grid Size\",\"Device\",\"CC\",\"dram__bytes_read.sum\",\"dram__bytes_write.sum\",\"gpu__time_duration.sum\"\n"
      "\"\",\"\",\"\",\"\",\"\",\"\",\"\",\"\",\"\",\"\",\"\",\"Mbyte\",\"Kbyte\",\"usecond\"\n"
      "\"0\",\"1\",\"p\",\"h\",\"copy_kernel\",\"1\",\"7\",\"(256, 1, 1)\",\"(1024, 1, 1)\",\"0\",\"9.0\",\"268.44\","
      "\"512\",\"181.25\"\n";
  const m::ParsedCsv csv = m::parse_ncu_csv(text);
  ASSERT_EQ(csv.kernels.size(), 1u);
  EXPECT_DOUBLE_EQ(csv.kernels[0].values.at("dram__bytes_read.sum"), 268.44e6);
  EXPECT_DOUBLE_EQ(csv.kernels[0].values.at("dram__bytes_write.sum"), 512e3);
  EXPECT_DOUBLE_EQ(csv.kernels[0].values.at("gpu__time_duration.sum"), 181250);
}

TEST(BenchMetrics, NoHeaderThrows) {
  EXPECT_THROW(m::parse_ncu_csv("==PROF== Connected\n==ERROR== The application returned an error code (1).\n"),
               std::runtime_error);
}

TEST(BenchMetrics, HeaderWithoutKernelsSummarizesAsFailed) {
  const std::string text =
      "\"ID\",\"Process ID\",\"Process Name\",\"Host Name\",\"Kernel Name\",\"dram__bytes_read.sum\"\n"
      "\"\",\"\",\"\",\"\",\"\",\"byte\"\n";
  const json j = m::summarize(m::parse_ncu_csv(text), 100, {"dram__bytes_read.sum"}, 90);
  EXPECT_EQ(j["status"], "failed");
}

TEST(BenchMetrics, SummarizesTheRowsKernels) {
  const m::ParsedCsv csv = m::parse_ncu_csv(kTwoKernels);
  const double min_bytes = 62.5e6;
  const json j = m::summarize(csv, min_bytes, m::metric_set(90), 90);
  ASSERT_EQ(j["status"], "ok");
  EXPECT_EQ(j["arch"], "sm_90");
  EXPECT_EQ(j["kernels"], 2);
  EXPECT_DOUBLE_EQ(j["dram_read_bytes"].get<double>(), 104e6);
  EXPECT_DOUBLE_EQ(j["dram_write_bytes"].get<double>(), 21e6);
  EXPECT_DOUBLE_EQ(j["dram_bytes"].get<double>(), 125e6);
  EXPECT_DOUBLE_EQ(j["memory_efficiency"].get<double>(), 0.5);  // 62.5 MB needed, 125 MB moved
  EXPECT_DOUBLE_EQ(j["duration_ns"].get<double>(), 4e6);
  // occupancy weighted by duration: (80 * 3 + 40 * 1) / 4
  EXPECT_DOUBLE_EQ(j["achieved_occupancy_pct"].get<double>(), 70.0);
  // the tensor pipe only where a kernel has it (the second's "n/a" is not a 0)
  EXPECT_DOUBLE_EQ(j["tensor_pipe_pct"].get<double>(), 0.0);
  EXPECT_DOUBLE_EQ(j["registers_per_thread"].get<double>(), 72);  // the max
  EXPECT_DOUBLE_EQ(j["local_bytes"].get<double>(), 1536);
  // stalls weighted: long_scoreboard (12.5*3 + 2.5)/4 = 10, mio_throttle (3.25*3+0.25)/4 = 2.5,
  // barrier (0.5*3 + 6)/4 = 1.875, wait (3 + 1.5)/4 = 1.125
  ASSERT_EQ(j["top_stalls"].size(), 3u);
  EXPECT_EQ(j["top_stalls"][0]["reason"], "long_scoreboard");
  EXPECT_DOUBLE_EQ(j["top_stalls"][0]["warps_per_issue"].get<double>(), 10.0);
  EXPECT_EQ(j["top_stalls"][1]["reason"], "mio_throttle");
  EXPECT_EQ(j["top_stalls"][2]["reason"], "barrier");
  // asked for, never reported: absent (and no key), e.g. the L2 bytes and the gmma pipe
  EXPECT_FALSE(j.contains("l2_bytes"));
  EXPECT_FALSE(j.contains("tensor_pipe_gmma_pct"));
  const auto& absent = j["absent"];
  EXPECT_NE(std::find(absent.begin(), absent.end(), "lts__t_bytes.sum"), absent.end());
  EXPECT_NE(std::find(absent.begin(), absent.end(),
                      "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"),
            absent.end());
  EXPECT_EQ(std::find(absent.begin(), absent.end(), "dram__bytes_read.sum"), absent.end());
}

TEST(BenchMetrics, MemoryEfficiencyArithmetic) {
  EXPECT_DOUBLE_EQ(*m::memory_efficiency(2e9, 1e9, 1e9), 1.0);
  EXPECT_DOUBLE_EQ(*m::memory_efficiency(1e9, 3e9, 1e9), 0.25);
  EXPECT_FALSE(m::memory_efficiency(1e9, std::nullopt, 1e9));  // absent, not 0
  EXPECT_FALSE(m::memory_efficiency(1e9, 0.0, 0.0));           // nothing counted
  EXPECT_FALSE(m::memory_efficiency(0, 1e9, 1e9));             // no byte model
}

TEST(BenchMetrics, MissingDramCountsGiveNoEfficiency) {
  const std::string text =
      "\"ID\",\"Process ID\",\"Process Name\",\"Host Name\",\"Kernel Name\",\"dram__bytes_read.sum\","
      "\"sm__warps_active.avg.pct_of_peak_sustained_active\"\n"
      "\"0\",\"1\",\"p\",\"h\",\"k\",\"n/a\",\"55.5\"\n";
  const json j = m::summarize(m::parse_ncu_csv(text), 1e6, {"dram__bytes_read.sum", "dram__bytes_write.sum"}, 80);
  EXPECT_EQ(j["status"], "ok");
  EXPECT_FALSE(j.contains("memory_efficiency"));
  EXPECT_FALSE(j.contains("dram_bytes"));
  EXPECT_DOUBLE_EQ(j["achieved_occupancy_pct"].get<double>(), 55.5);
  EXPECT_EQ(j["absent"].size(), 2u);
}

TEST(BenchMetrics, MetricSetPerArchitecture) {
  auto has = [](const std::vector<std::string>& s, const std::string& n) {
    return std::find(s.begin(), s.end(), n) != s.end();
  };
  const auto hopper = m::metric_set(90), ampere = m::metric_set(80), unknown = m::metric_set(0);
  const std::string gmma = "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active";
  const std::string hmma = "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active";
  EXPECT_TRUE(has(hopper, gmma));
  EXPECT_TRUE(has(hopper, hmma));
  EXPECT_FALSE(has(ampere, gmma));
  EXPECT_TRUE(has(ampere, hmma));
  EXPECT_FALSE(has(unknown, hmma));
  for (const auto* s : {&hopper, &ampere, &unknown}) {
    EXPECT_TRUE(has(*s, "sm__warps_active.avg.pct_of_peak_sustained_active"));
    EXPECT_TRUE(has(*s, "dram__bytes_read.sum"));
    EXPECT_TRUE(has(*s, "dram__bytes_write.sum"));
    EXPECT_TRUE(has(*s, "lts__t_bytes.sum"));
    EXPECT_TRUE(has(*s, "launch__registers_per_thread"));
  }
}

TEST(BenchMetrics, UnknownMetricsFromTheLog) {
  const auto u = m::unknown_metrics(
      "==PROF== Connected to process 1\n"
      "==ERROR== Failed to find metric sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active\n"
      "==ERROR== Failed to find metric smsp__average_warps_issue_stalled_misc_per_issue_active.ratio\n");
  ASSERT_EQ(u.size(), 2u);
  EXPECT_EQ(u[0], "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active");
  EXPECT_TRUE(m::unknown_metrics("==PROF== Disconnected\n").empty());
  // the regex form ncu makes of a name ("regex:^name\.(sum|avg|...)$", or of a full name)
  const auto r = m::unknown_metrics(
      "==ERROR== Failed to find metric regex:^flop_count_sp\\.(sum|min|max|avg|pct|ratio|max_rate)$\n"
      "==ERROR== Failed to find metric regex:^lts__t_bytes\\.sum$\n");
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0], "flop_count_sp");
  EXPECT_EQ(r[1], "lts__t_bytes.sum");
}

TEST(BenchMetrics, ChildArgumentsDropTheParentsOutputs) {
  const auto a = m::child_arguments({"matmul", "--size", "4096", "--json", "out.json", "--metrics", "--json=x.json",
                                     "--variant", "naive"},
                                    7);
  const std::vector<std::string> want = {"matmul", "--size", "4096", "--variant", "naive",
                                         "--only-row", "7", "--metrics-child"};
  EXPECT_EQ(a, want);
  const auto n = m::ncu_arguments("/usr/bin/ncu", {"a.sum", "b.sum"}, "/tmp/x.csv");
  EXPECT_NE(std::find(n.begin(), n.end(), "a.sum,b.sum"), n.end());
  EXPECT_NE(std::find(n.begin(), n.end(), "--profile-from-start"), n.end());
  EXPECT_EQ(m::shell_quote("it's"), "'it'\\''s'");
}

TEST(BenchMetrics, NcuAbsentIsSkippedWithTheReason) {
  ::setenv("OPTIMIZED_NCU", "/nonexistent/ncu", 1);
  EXPECT_EQ(m::find_ncu(), "");
  EXPECT_NE(m::ncu_missing_reason().find("OPTIMIZED_NCU"), std::string::npos);
  const json j = m::skipped(m::ncu_missing_reason());
  EXPECT_EQ(j["status"], "skipped");
  ::unsetenv("OPTIMIZED_NCU");
  const std::string saved = std::getenv("PATH") ? std::getenv("PATH") : "";
  ::setenv("PATH", "/nonexistent", 1);
  EXPECT_EQ(m::find_ncu(), "");
  EXPECT_NE(m::ncu_missing_reason().find("PATH"), std::string::npos);
  ::setenv("PATH", saved.c_str(), 1);
}

namespace {

void write_exec(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
  ::chmod(path.c_str(), 0755);
}

}  // namespace

// run_ncu_row end to end with a stand-in ncu (a shell script: refuses the gmma metric once, then writes
// the captured CSV to --log-file and runs the application) and a stand-in child (prints its row line).
TEST(BenchMetrics, RunNcuRowThroughAStandIn) {
  const char* tmp = std::getenv("TMPDIR");
  const std::string dir = std::string(tmp && *tmp ? tmp : "/tmp") + "/bench-metrics-standin-" + std::to_string(::getpid());
  ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
  std::ofstream(dir + "/sample.csv") << kTwoKernels;
  const m::RowIdentity id{"matmul", "naive", "cuda", "fp32", "2048x2048x2048", "", 0};
  write_exec(dir + "/app", "#!/bin/sh\necho 'OPTIMIZED_METRICS_ROW " + id.text() + "'\necho \"args: $*\"\n");
  write_exec(dir + "/ncu",
             "#!/bin/sh\n"
             "log=''; metrics=''\n"
             "while [ $# -gt 0 ]; do\n"
             "  case \"$1\" in\n"
             "    --log-file) log=\"$2\"; shift 2;;\n"
             "    --metrics) metrics=\"$2\"; shift 2;;\n"
             "    --csv|--page|--print-units|--profile-from-start|--target-processes)\n"
             "      if [ \"$1\" = --csv ]; then shift; else shift 2; fi;;\n"
             "    *) break;;\n"
             "  esac\n"
             "done\n"
             "case \"$metrics\" in *gmma*) echo '==ERROR== Failed to find metric "
             "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active' > \"$log\"; exit 1;; esac\n"
             "cp " + dir + "/sample.csv \"$log\"\n"
             "exec \"$@\"\n");
  const json j = m::run_ncu_row(dir + "/ncu", dir + "/app", {"matmul", "--json", "x.json", "--metrics"}, 3, id,
                                62.5e6, 90, dir);
  ASSERT_EQ(j["status"], "ok") << j.dump();
  EXPECT_DOUBLE_EQ(j["memory_efficiency"].get<double>(), 0.5);
  const auto& absent = j["absent"];  // refused by this "ncu": absent, and the run went on without it
  EXPECT_NE(std::find(absent.begin(), absent.end(),
                      "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"),
            absent.end());
  // a child that runs another row is caught
  const m::RowIdentity other{"matmul", "register_tiled", "cuda", "fp32", "2048x2048x2048", "", 0};
  const json k = m::run_ncu_row(dir + "/ncu", dir + "/app", {"matmul"}, 4, other, 1, 80, dir);
  EXPECT_EQ(k["status"], "failed");
  EXPECT_NE(k["reason"].get<std::string>().find("did not run row 4"), std::string::npos) << k.dump();
  std::system(("rm -rf " + m::shell_quote(dir)).c_str());
}

#ifdef OPTIMIZED_BENCH_EXE
// ---- the driver end to end (optimized-bench --metrics) -----------------------------------------------

namespace {

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string temp_json(const char* stem) {
  const char* tmp = std::getenv("TMPDIR");
  return std::string(tmp && *tmp ? tmp : "/tmp") + "/" + stem + "-" + std::to_string(::getpid()) + ".json";
}

// The driver: the build's, or $OPTIMIZED_BENCH_EXE where the test binary was moved to another machine.
std::string bench_exe() {
  const char* moved = std::getenv("OPTIMIZED_BENCH_EXE");
  return moved && *moved ? std::string(moved) : std::string(OPTIMIZED_BENCH_EXE);
}

// Runs optimized-bench with `args`; returns its JSON report (empty on failure).
json run_bench(const std::string& args, const char* stem, const std::string& env = "") {
  const std::string path = temp_json(stem);
  const std::string cmd = env + " " + m::shell_quote(bench_exe()) + " " + args + " --json " + path + " > " + path + ".log 2>&1";
  const int rc = std::system(cmd.c_str());
  if (rc != 0) ADD_FAILURE() << cmd << " exited " << rc << "\n" << slurp(path + ".log");
  json j = json::parse(slurp(path), nullptr, false);
  std::remove(path.c_str());
  std::remove((path + ".log").c_str());
  return j.is_discarded() ? json() : j;
}

bool gpu_present() { return std::system("nvidia-smi -L > /dev/null 2>&1") == 0; }

}  // namespace

TEST(BenchMetrics, DriverWithoutNcuMarksEveryRowSkipped) {
  // CPU rows (or a GPU machine with ncu hidden): the run succeeds, every row says why it has no counters.
  const json j = run_bench("matmul --size 64 --variant naive,cpu_naive --no-ceilings --no-baseline --min-samples 3 "
                           "--max-time 0.05 --metrics",
                           "metrics-absent", "OPTIMIZED_NCU=/nonexistent/ncu");
  ASSERT_TRUE(j.contains("results"));
  int cuda = 0, cpu = 0;
  for (const auto& r : j["results"]) {
    ASSERT_TRUE(r.contains("metrics"));
    EXPECT_EQ(r["metrics"]["status"], "skipped");
    const std::string reason = r["metrics"]["reason"];
    if (r["backend"] == "cuda") {
      ++cuda;
      EXPECT_NE(reason.find("OPTIMIZED_NCU"), std::string::npos) << reason;
    } else {
      ++cpu;
      EXPECT_NE(reason.find("CPU row"), std::string::npos) << reason;
    }
  }
  EXPECT_GT(cuda, 0);  // listed (skipped without a GPU, or run on one)
  EXPECT_GT(cpu, 0);
}

// On the H100 with ncu: the counters are right where the bytes are known, and they order the ladder.
TEST(BenchMetricsGpu, OnePassSoftmaxDramBytesWithin5PercentOfItsBytes) {
  if (!gpu_present()) GTEST_SKIP() << "no CUDA GPU: the hardware counters need one (ncu on the GPU machine)";
  if (m::find_ncu().empty()) GTEST_SKIP() << m::ncu_missing_reason();
  // softmax fwd, bf16, 16384 x 8192: auto is the one-pass registers rung below 32768 columns: it reads x
  // once and writes y once, a copy with a reduction in the middle: 2 R W E bytes, known exactly.
  const json j = run_bench("fused --ops softmax --directions fwd --dtypes bf16 --shapes 16384x8192 --variants auto "
                           "--no-baseline --no-copy --no-ceilings --min-samples 3 --max-time 0.2 --metrics",
                           "metrics-copy");
  ASSERT_TRUE(j.contains("results"));
  bool seen = false;
  for (const auto& r : j["results"]) {
    if (r["backend"] != "cuda" || r["status"] != "ok") continue;
    const auto& mj = r["metrics"];
    ASSERT_EQ(mj["status"], "ok") << mj.dump();
    const double counted = mj["dram_bytes"].get<double>();
    const double known = 2.0 * 16384 * 8192 * 2;
    EXPECT_NEAR(counted / known, 1.0, 0.05) << mj.dump();
    seen = true;
  }
  EXPECT_TRUE(seen);
}

TEST(BenchMetricsGpu, NaiveGemmLessMemoryEfficientThanRegisterTiled) {
  if (!gpu_present()) GTEST_SKIP() << "no CUDA GPU: the hardware counters need one (ncu on the GPU machine)";
  if (m::find_ncu().empty()) GTEST_SKIP() << m::ncu_missing_reason();
  const json j = run_bench("matmul --size 4096 --dtype fp32 --variant naive,register_tiled --no-baseline --no-ceilings "
                           "--min-samples 3 --max-time 0.2 --metrics",
                           "metrics-gemm");
  ASSERT_TRUE(j.contains("results"));
  double naive = -1, tiled = -1;
  for (const auto& r : j["results"]) {
    if (r["status"] != "ok" || !r.contains("metrics") || r["metrics"]["status"] != "ok") continue;
    if (r["variant"] == "naive") naive = r["metrics"]["memory_efficiency"].get<double>();
    if (r["variant"] == "register_tiled") tiled = r["metrics"]["memory_efficiency"].get<double>();
  }
  ASSERT_GT(naive, 0);
  ASSERT_GT(tiled, 0);
  EXPECT_LT(naive, tiled);
}
#endif
