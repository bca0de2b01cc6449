// Hardware-counter metrics of a benchmark row, from Nsight Compute (issue 23).
//
//   optimized-bench <family> ... --metrics
//
// After the timed run, every CUDA row that ran ("ok") runs once more in a child process under ncu:
//
//   ncu --csv --page raw --print-units base --profile-from-start off --target-processes all
//       --metrics <metric_set(arch)> --log-file ROW.csv
//       optimized-bench <the same arguments> --only-row I --metrics-child
//
// The child plans the same rows, keeps row I alone (every other row skipped, no baseline, no
// ceilings, one sample), validates it, and runs its first timed call between cudaProfilerStart and
// cudaProfilerStop (metrics_child.cpp): with --profile-from-start off ncu profiles exactly that
// call's kernels, nothing of the validation, the poisoning or the cache flushes. ncu's own cache
// control (flush before every replay pass) gives the cold-L2 DRAM bytes the timed samples see.
//
// This file holds what needs no GPU and no ncu (and is tested without them): the metric set per
// architecture, the CSV parser, the row summary (sums over the row's kernels, duration-weighted
// averages, memory_efficiency = min_bytes / DRAM bytes), the "skipped" objects and the table.
// Absent metrics (not collected on this architecture, "n/a") are reported as absent, never as 0.
#pragma once

#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace bench::metrics {

// ---- the metric set -----------------------------------------------------------------------------

// The fixed metric set for a compute capability (major*10 + minor; 0: unknown). Every architecture
// gets the core set; the tensor-pipe metrics depend on the architecture (hmma on sm_70..sm_90, the
// wgmma pipe "gmma" on sm_90). Names ncu reports as unknown are dropped and retried (run_ncu_row).
std::vector<std::string> metric_set(int compute_capability);
// The stall reasons asked for, as ncu's WarpStateStats section names them:
// smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio.
const std::vector<std::string>& stall_reasons();
std::string stall_metric(const std::string& reason);

// ---- ncu's CSV ----------------------------------------------------------------------------------

// One profiled kernel: its name and the metrics that had a value (in base units: bytes, ns, %).
struct KernelRecord {
  std::string id;
  std::string name;
  std::map<std::string, double> values;
  std::vector<std::string> absent;  // columns present with "n/a" / empty / non-numeric values
};

struct ParsedCsv {
  std::vector<std::string> metric_columns;  // the metric columns of the header, in order
  std::vector<KernelRecord> kernels;
};

// Parses the output of `ncu --csv --page raw` (the whole log: "==PROF==" / "==WARNING==" lines and
// the application's own lines are skipped; the CSV starts at the header line beginning "ID").
// Row 1: the header ("ID", "Process ID", ..., "Kernel Name", ..., metric names); row 2 (when its ID
// cell is empty): the units, used to scale values to base units (Kbyte -> bytes, usecond -> ns),
// so both --print-units base and auto parse the same; then one row per kernel. Numbers may carry
// thousands separators ("1,048,576"). Throws std::runtime_error when there is no header.
ParsedCsv parse_ncu_csv(const std::string& text);
// The RFC 4180 fields of one CSV line ("a","b,c","d""e" -> a | b,c | d"e).
std::vector<std::string> split_csv_line(const std::string& line);
// The names of the metrics ncu refused ("==ERROR== Failed to find metric X", "... metric X not
// found"), from its log.
std::vector<std::string> unknown_metrics(const std::string& log);

// ---- the row's metrics object ---------------------------------------------------------------------

// Sums / weighted averages over the row's kernels; min_bytes <= 0: no memory_efficiency.
// `requested`: the metrics asked for (those missing from every kernel are listed as "absent").
nlohmann::ordered_json summarize(const ParsedCsv& csv, double min_bytes, const std::vector<std::string>& requested,
                                 int compute_capability);
// min_bytes / (read + write); nullopt when either count is absent or the total is 0.
std::optional<double> memory_efficiency(double min_bytes, std::optional<double> dram_read,
                                        std::optional<double> dram_write);
// {"status": "skipped", "reason": ...} / {"status": "failed", "reason": ...}
nlohmann::ordered_json skipped(const std::string& reason);
nlohmann::ordered_json failed(const std::string& reason);

// ---- finding and running ncu ----------------------------------------------------------------------

// $OPTIMIZED_NCU when set (empty when that file is not executable), else `ncu` on $PATH, else "".
std::string find_ncu();
// The message --metrics prints once where ncu is absent (also each row's reason).
std::string ncu_missing_reason();
// The shell-quoted words: 'a b' -> "'a b'", it's -> 'it'\''s'.
std::string shell_quote(const std::string& word);
// The child's arguments: argv[1..] without --metrics / --json FILE / --json=FILE (the parent
// writes the JSON), plus --only-row ROW --metrics-child.
std::vector<std::string> child_arguments(const std::vector<std::string>& argv_tail, int row);
// The ncu command line (without the application).
std::vector<std::string> ncu_arguments(const std::string& ncu, const std::vector<std::string>& metrics,
                                       const std::string& log_file);

// The identity of a row the child prints and the parent checks ("matmul register_tiled bf16 ...").
struct RowIdentity {
  std::string op, variant, backend, dtype, shape_label, direction;
  int threads = 0;
  std::string text() const;
};
// The line the child prints: "OPTIMIZED_METRICS_ROW <text>".
std::string identity_line(const RowIdentity& id);

// Runs one row's child under ncu and returns its metrics object (status ok / failed). `exe`: this
// executable's path; `workdir`: where the CSV and logs go.
nlohmann::ordered_json run_ncu_row(const std::string& ncu, const std::string& exe,
                                   const std::vector<std::string>& argv_tail, int row, const RowIdentity& id,
                                   double min_bytes, int compute_capability, const std::string& workdir);

// ---- the table -----------------------------------------------------------------------------------

struct TableRow {
  std::string label;  // "matmul register_tiled bf16 4096x4096x4096"
  nlohmann::ordered_json metrics;
};
void print_table(FILE* out, const std::vector<TableRow>& rows);

}  // namespace bench::metrics
