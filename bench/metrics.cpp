// Hardware-counter metrics of a benchmark row (see metrics.h): the metric set, ncu's CSV, the row
// summary, running the child under ncu, the table. No CUDA here: tested without a GPU.
#include "metrics.h"

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>

namespace bench::metrics {

using json = nlohmann::ordered_json;

// ---- the metric set ---------------------------------------------------------------------------------

namespace {

// Checked against the Nsight Compute metrics reference and the sections' metric names (SpeedOfLight,
// Occupancy, MemoryWorkloadAnalysis, WarpStateStats, LaunchStats).
const char* const kDuration = "gpu__time_duration.sum";
const char* const kOccupancy = "sm__warps_active.avg.pct_of_peak_sustained_active";
const char* const kDramRead = "dram__bytes_read.sum";
const char* const kDramWrite = "dram__bytes_write.sum";
const char* const kDramPct = "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed";
const char* const kL2Bytes = "lts__t_bytes.sum";
const char* const kL1Bytes = "l1tex__t_bytes.sum";
const char* const kGlobalLdSectors = "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum";
const char* const kGlobalStSectors = "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum";
const char* const kSharedLdInst = "smsp__inst_executed_op_shared_ld.sum";
const char* const kSharedStInst = "smsp__inst_executed_op_shared_st.sum";
const char* const kSharedLdWaves = "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum";
const char* const kSharedStWaves = "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum";
const char* const kSharedConflicts = "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum";
const char* const kLocalLd = "l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum";
const char* const kLocalSt = "l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum";
const char* const kRegisters = "launch__registers_per_thread";
const char* const kHmma = "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active";
const char* const kGmma = "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active";

}  // namespace

const std::vector<std::string>& stall_reasons() {
  static const std::vector<std::string> r = {
      "barrier",  "branch_resolving", "dispatch_stall", "drain",     "imc_miss",      "lg_throttle",
      "long_scoreboard", "math_pipe_throttle", "membar", "mio_throttle", "misc",     "no_instruction",
      "not_selected", "selected", "short_scoreboard", "sleeping", "tex_throttle", "wait"};
  return r;
}

std::string stall_metric(const std::string& reason) {
  return "smsp__average_warps_issue_stalled_" + reason + "_per_issue_active.ratio";
}

std::vector<std::string> metric_set(int cc) {
  std::vector<std::string> m = {kDuration,       kOccupancy,      kDramRead,      kDramWrite,     kDramPct,
                                kL2Bytes,        kL1Bytes,        kGlobalLdSectors, kGlobalStSectors,
                                kSharedLdInst,   kSharedStInst,   kSharedLdWaves, kSharedStWaves, kSharedConflicts,
                                kLocalLd,        kLocalSt,        kRegisters};
  // The tensor pipes, per architecture: mma.sync (hmma) from Volta on; the Hopper wgmma pipe (gmma)
  // on sm_90 only (Blackwell's tcgen05 pipe has other names: not asked for; the column stays absent).
  if (cc >= 70 && cc < 100) m.push_back(kHmma);
  if (cc >= 90 && cc < 100) m.push_back(kGmma);
  for (const auto& r : stall_reasons()) m.push_back(stall_metric(r));
  return m;
}

// ---- CSV -----------------------------------------------------------------------------------------------

std::vector<std::string> split_csv_line(const std::string& line) {
  std::vector<std::string> out;
  std::string cur;
  bool quoted = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted) {
      if (c == '"') {
        if (i + 1 < line.size() && line[i + 1] == '"') {
          cur += '"';
          ++i;
        } else {
          quoted = false;
        }
      } else {
        cur += c;
      }
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      out.push_back(cur);
      cur.clear();
    } else if (c != '\r') {
      cur += c;
    }
  }
  out.push_back(cur);
  return out;
}

namespace {

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

// A cell as a number: thousands separators dropped; nullopt for "n/a", "", text.
std::optional<double> parse_number(const std::string& cell) {
  std::string s;
  for (char c : trim(cell))
    if (c != ',') s += c;
  if (s.empty()) return std::nullopt;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (end == s.c_str() || *end != '\0' || !std::isfinite(v)) return std::nullopt;
  return v;
}

// The factor from a unit of ncu's to the base unit (byte, nsecond, ...); ncu's prefixes are decimal.
double unit_scale(const std::string& unit) {
  static const std::map<std::string, double> k = {
      {"byte", 1},        {"Kbyte", 1e3},     {"Mbyte", 1e6},     {"Gbyte", 1e9},   {"Tbyte", 1e12},
      {"KB", 1e3},        {"MB", 1e6},        {"GB", 1e9},        {"TB", 1e12},     {"nsecond", 1},
      {"usecond", 1e3},   {"msecond", 1e6},   {"second", 1e9},    {"ns", 1},        {"us", 1e3},
      {"ms", 1e6},        {"s", 1e9},         {"Kcycle", 1e3},    {"Mcycle", 1e6},  {"Ksector", 1e3},
      {"Msector", 1e6},   {"Gsector", 1e9},   {"Kinst", 1e3},     {"Minst", 1e6},   {"Ginst", 1e9}};
  const auto it = k.find(trim(unit));
  return it == k.end() ? 1.0 : it->second;
}

// Columns of the raw page that are not metrics.
bool is_info_column(const std::string& name) {
  static const std::set<std::string> k = {"ID",     "Process ID", "Process Name", "Host Name", "Kernel Name",
                                          "Context", "Stream",    "Block Size",   "Grid Size", "Device",
                                          "CC",     "Section Name", "Kernel Time", "Function Name", "Demangled Name",
                                          "Mangled Name", "Estimated Speedup", "Launch Name", "Range Name"};
  return k.count(name) > 0;
}

}  // namespace

ParsedCsv parse_ncu_csv(const std::string& text) {
  std::vector<std::vector<std::string>> rows;
  std::istringstream in(text);
  std::string line;
  bool started = false;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (!started) {
      if (line.rfind("\"ID\"", 0) == 0 || line.rfind("ID,", 0) == 0) started = true;
      else continue;
    }
    if (line.rfind("==", 0) == 0 || trim(line).empty()) continue;  // ==PROF== / ==WARNING== lines
    if (line[0] != '"' && line.find(',') == std::string::npos) continue;  // the application's lines
    rows.push_back(split_csv_line(line));
  }
  if (rows.empty()) throw std::runtime_error("ncu CSV: no header line (\"ID\",...) found");
  const std::vector<std::string>& header = rows[0];
  int name_col = -1;
  std::vector<int> metric_cols;
  ParsedCsv out;
  for (size_t c = 0; c < header.size(); ++c) {
    if (header[c] == "Kernel Name") name_col = static_cast<int>(c);
    else if (!is_info_column(header[c]) && !header[c].empty()) {
      metric_cols.push_back(static_cast<int>(c));
      out.metric_columns.push_back(header[c]);
    }
  }
  size_t first = 1;
  std::vector<double> scale(header.size(), 1.0);
  if (rows.size() > 1 && !rows[1].empty() && trim(rows[1][0]).empty()) {  // the units row
    for (size_t c = 0; c < header.size() && c < rows[1].size(); ++c) scale[c] = unit_scale(rows[1][c]);
    first = 2;
  }
  for (size_t r = first; r < rows.size(); ++r) {
    const auto& cells = rows[r];
    if (cells.size() < header.size()) continue;  // a truncated line
    KernelRecord k;
    k.id = cells[0];
    if (name_col >= 0) k.name = cells[name_col];
    for (size_t i = 0; i < metric_cols.size(); ++i) {
      const int c = metric_cols[i];
      if (const auto v = parse_number(cells[c])) k.values[header[c]] = *v * scale[c];
      else k.absent.push_back(header[c]);
    }
    out.kernels.push_back(std::move(k));
  }
  return out;
}

std::vector<std::string> unknown_metrics(const std::string& log) {
  std::vector<std::string> out;
  std::istringstream in(log);
  std::string line;
  while (std::getline(in, line)) {
    size_t p = line.find("Failed to find metric");
    size_t skip = std::string("Failed to find metric").size();
    if (p == std::string::npos) {
      p = line.find("metric ");
      if (p == std::string::npos || line.find("not found") == std::string::npos || line.find("ERROR") == std::string::npos)
        continue;
      skip = std::string("metric ").size();
    }
    std::string rest = trim(line.substr(p + skip));
    // ncu names a metric as given, or as the regex it made of it: "regex:^name\.(sum|avg|...)$" for a
    // name without its rollup, "regex:^a\.b$" for a full one: the name is the identifier, unescaped.
    if (rest.rfind("regex:", 0) == 0) rest = rest.substr(6);
    if (!rest.empty() && rest[0] == '^') rest = rest.substr(1);
    std::string name;
    for (char c : rest) {
      if (c == '\\') continue;
      if (std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.') name += c;
      else if (!name.empty()) break;
    }
    while (!name.empty() && name.back() == '.') name.pop_back();
    if (!name.empty() && std::find(out.begin(), out.end(), name) == out.end()) out.push_back(name);
  }
  return out;
}

// ---- the summary ---------------------------------------------------------------------------------------

std::optional<double> memory_efficiency(double min_bytes, std::optional<double> dram_read,
                                        std::optional<double> dram_write) {
  if (!dram_read || !dram_write || min_bytes <= 0) return std::nullopt;
  const double total = *dram_read + *dram_write;
  if (!(total > 0)) return std::nullopt;
  return min_bytes / total;
}

namespace {

// Over the kernels that have metric m: the sum, nullopt when none has it.
std::optional<double> sum_of(const ParsedCsv& csv, const std::string& m) {
  std::optional<double> s;
  for (const auto& k : csv.kernels)
    if (auto it = k.values.find(m); it != k.values.end()) s = s.value_or(0) + it->second;
  return s;
}

std::optional<double> max_of(const ParsedCsv& csv, const std::string& m) {
  std::optional<double> s;
  for (const auto& k : csv.kernels)
    if (auto it = k.values.find(m); it != k.values.end()) s = std::max(s.value_or(it->second), it->second);
  return s;
}

// Duration-weighted mean over the kernels that have m (a plain mean where durations are missing).
std::optional<double> weighted_of(const ParsedCsv& csv, const std::string& m) {
  double num = 0, den = 0, plain = 0;
  int n = 0;
  bool all_timed = true;
  for (const auto& k : csv.kernels) {
    const auto it = k.values.find(m);
    if (it == k.values.end()) continue;
    const auto d = k.values.find(kDuration);
    if (d == k.values.end() || !(d->second > 0)) all_timed = false;
    else num += it->second * d->second, den += d->second;
    plain += it->second;
    ++n;
  }
  if (n == 0) return std::nullopt;
  if (all_timed && den > 0) return num / den;
  return plain / n;
}

void put(json& j, const char* key, std::optional<double> v) {
  if (v) j[key] = *v;
}

std::string arch_name(int cc) { return cc > 0 ? "sm_" + std::to_string(cc) : "unknown"; }

}  // namespace

json summarize(const ParsedCsv& csv, double min_bytes, const std::vector<std::string>& requested, int cc) {
  json j;
  if (csv.kernels.empty()) return failed("ncu profiled no kernel of the row");
  j["status"] = "ok";
  j["tool"] = "ncu";
  j["arch"] = arch_name(cc);
  j["kernels"] = csv.kernels.size();
  std::vector<std::string> names;
  for (const auto& k : csv.kernels)
    if (std::find(names.begin(), names.end(), k.name) == names.end()) names.push_back(k.name);
  j["kernel_names"] = names;
  put(j, "duration_ns", sum_of(csv, kDuration));
  put(j, "achieved_occupancy_pct", weighted_of(csv, kOccupancy));
  const auto rd = sum_of(csv, kDramRead), wr = sum_of(csv, kDramWrite);
  put(j, "dram_read_bytes", rd);
  put(j, "dram_write_bytes", wr);
  if (rd && wr) j["dram_bytes"] = *rd + *wr;
  if (min_bytes > 0) j["min_bytes"] = min_bytes;
  put(j, "memory_efficiency", memory_efficiency(min_bytes, rd, wr));
  put(j, "dram_throughput_pct", weighted_of(csv, kDramPct));
  put(j, "l2_bytes", sum_of(csv, kL2Bytes));
  put(j, "l1_bytes", sum_of(csv, kL1Bytes));
  put(j, "global_load_sectors", sum_of(csv, kGlobalLdSectors));
  put(j, "global_store_sectors", sum_of(csv, kGlobalStSectors));
  put(j, "shared_load_instructions", sum_of(csv, kSharedLdInst));
  put(j, "shared_store_instructions", sum_of(csv, kSharedStInst));
  put(j, "shared_load_wavefronts", sum_of(csv, kSharedLdWaves));
  put(j, "shared_store_wavefronts", sum_of(csv, kSharedStWaves));
  put(j, "shared_bank_conflicts", sum_of(csv, kSharedConflicts));
  // The tensor pipe: per kernel the busier of mma.sync's (hmma) and wgmma's (gmma) pipes, then
  // duration-weighted over the row's kernels.
  {
    ParsedCsv t;
    for (const auto& k : csv.kernels) {
      KernelRecord r;
      r.values = k.values;
      std::optional<double> v;
      for (const char* m : {kHmma, kGmma})
        if (auto it = k.values.find(m); it != k.values.end()) v = std::max(v.value_or(it->second), it->second);
      if (v) r.values["tensor"] = *v;
      t.kernels.push_back(std::move(r));
    }
    put(j, "tensor_pipe_pct", weighted_of(t, "tensor"));
    put(j, "tensor_pipe_hmma_pct", weighted_of(csv, kHmma));
    put(j, "tensor_pipe_gmma_pct", weighted_of(csv, kGmma));
  }
  put(j, "registers_per_thread", max_of(csv, kRegisters));
  const auto lld = sum_of(csv, kLocalLd), lst = sum_of(csv, kLocalSt);
  if (lld || lst) j["local_bytes"] = lld.value_or(0) + lst.value_or(0);  // spill traffic (ld + st)
  // The top three stall reasons (warps stalled per issued instruction, duration-weighted).
  std::vector<std::pair<double, std::string>> stalls;
  for (const auto& r : stall_reasons())
    if (const auto v = weighted_of(csv, stall_metric(r))) stalls.emplace_back(*v, r);
  std::stable_sort(stalls.begin(), stalls.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  if (!stalls.empty()) {
    json top = json::array();
    for (size_t i = 0; i < stalls.size() && i < 3; ++i)
      top.push_back(json{{"reason", stalls[i].second}, {"warps_per_issue", stalls[i].first}});
    j["top_stalls"] = top;
  }
  // What was asked for and had no value in any kernel.
  std::vector<std::string> absent;
  for (const auto& m : requested) {
    bool any = false;
    for (const auto& k : csv.kernels) any = any || k.values.count(m) > 0;
    if (!any) absent.push_back(m);
  }
  j["absent"] = absent;
  return j;
}

json skipped(const std::string& reason) { return json{{"status", "skipped"}, {"reason", reason}}; }
json failed(const std::string& reason) { return json{{"status", "failed"}, {"reason", reason}}; }

// ---- ncu -------------------------------------------------------------------------------------------------

namespace {

bool executable(const std::string& path) {
  struct stat st {};
  return !path.empty() && ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

}  // namespace

std::string find_ncu() {
  if (const char* env = std::getenv("OPTIMIZED_NCU"); env && *env) return executable(env) ? std::string(env) : "";
  const char* path = std::getenv("PATH");
  if (!path) return "";
  std::stringstream ss(path);
  std::string dir;
  while (std::getline(ss, dir, ':')) {
    if (dir.empty()) continue;
    const std::string p = dir + "/ncu";
    if (executable(p)) return p;
  }
  return "";
}

std::string ncu_missing_reason() {
  if (const char* env = std::getenv("OPTIMIZED_NCU"); env && *env)
    return std::string("OPTIMIZED_NCU=") + env + " is not an executable file: no hardware counters collected";
  return "Nsight Compute (ncu) not found on PATH (or set OPTIMIZED_NCU): no hardware counters collected";
}

std::string shell_quote(const std::string& w) {
  std::string out = "'";
  for (char c : w) {
    if (c == '\'') out += "'\\''";
    else out += c;
  }
  return out + "'";
}

std::vector<std::string> child_arguments(const std::vector<std::string>& tail, int row) {
  std::vector<std::string> out;
  for (size_t i = 0; i < tail.size(); ++i) {
    const std::string& a = tail[i];
    if (a == "--metrics" || a == "--metrics-child") continue;
    if (a == "--json" || a == "--only-row") {
      ++i;  // and its value
      continue;
    }
    if (a.rfind("--json=", 0) == 0 || a.rfind("--only-row=", 0) == 0) continue;
    out.push_back(a);
  }
  out.push_back("--only-row");
  out.push_back(std::to_string(row));
  out.push_back("--metrics-child");
  return out;
}

std::vector<std::string> ncu_arguments(const std::string& ncu, const std::vector<std::string>& metrics,
                                       const std::string& log_file) {
  std::string list;
  for (const auto& m : metrics) list += (list.empty() ? "" : ",") + m;
  return {ncu, "--csv", "--page", "raw", "--print-units", "base", "--profile-from-start", "off",
          "--target-processes", "all", "--metrics", list, "--log-file", log_file};
}

std::string RowIdentity::text() const {
  std::string s = op + " " + variant + " " + backend + " " + dtype + " " + shape_label;
  if (!direction.empty()) s += " " + direction;
  if (threads > 0) s += " threads=" + std::to_string(threads);
  return s;
}

std::string identity_line(const RowIdentity& id) { return "OPTIMIZED_METRICS_ROW " + id.text(); }

namespace {

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The last lines of a log, for a failure's reason.
std::string tail_of(const std::string& text, size_t lines = 4) {
  std::vector<std::string> all;
  std::istringstream in(text);
  std::string l;
  while (std::getline(in, l))
    if (!trim(l).empty()) all.push_back(trim(l));
  std::string out;
  for (size_t i = all.size() > lines ? all.size() - lines : 0; i < all.size(); ++i) out += (out.empty() ? "" : " | ") + all[i];
  return out;
}

}  // namespace

json run_ncu_row(const std::string& ncu, const std::string& exe, const std::vector<std::string>& argv_tail, int row,
                 const RowIdentity& id, double min_bytes, int cc, const std::string& workdir) {
  std::vector<std::string> requested = metric_set(cc);
  std::vector<std::string> refused;
  const std::string csv_path = workdir + "/row" + std::to_string(row) + ".csv";
  const std::string out_path = workdir + "/row" + std::to_string(row) + ".out";
  for (int attempt = 0; attempt < 2; ++attempt) {
    std::string cmd;
    for (const auto& w : ncu_arguments(ncu, requested, csv_path)) cmd += shell_quote(w) + " ";
    cmd += shell_quote(exe);
    for (const auto& w : child_arguments(argv_tail, row)) cmd += " " + shell_quote(w);
    cmd += " > " + shell_quote(out_path) + " 2>&1";
    std::remove(csv_path.c_str());
    const int rc = std::system(cmd.c_str());
    const std::string log = read_file(csv_path), out = read_file(out_path);
    const auto unknown = unknown_metrics(log + "\n" + out);
    if (!unknown.empty() && attempt == 0) {  // drop what this ncu / GPU does not know, once
      for (const auto& u : unknown) {  // the name, or its base when ncu named it without the rollup
        for (const auto& r : requested)
          if (r == u || r.rfind(u + ".", 0) == 0) refused.push_back(r);
        requested.erase(std::remove_if(requested.begin(), requested.end(),
                                       [&](const std::string& r) { return r == u || r.rfind(u + ".", 0) == 0; }),
                        requested.end());
      }
      continue;
    }
    const std::string want = identity_line(id);
    if (out.find(want) == std::string::npos)
      return failed("the child did not run row " + std::to_string(row) + " (" + id.text() + "): exit " +
                    std::to_string(WIFEXITED(rc) ? WEXITSTATUS(rc) : -1) + "; " + tail_of(out + "\n" + log));
    try {
      // ncu writes its CSV to --log-file; should a version print it to stdout instead, it is in `out`.
      const bool in_log = log.find("\"ID\"") != std::string::npos;
      const ParsedCsv csv = parse_ncu_csv(in_log ? log : out);
      std::vector<std::string> all = requested;
      all.insert(all.end(), refused.begin(), refused.end());
      json j = summarize(csv, min_bytes, all, cc);
      if (j["status"] != "ok") j["reason"] = j["reason"].get<std::string>() + "; " + tail_of(out + "\n" + log);
      else {
        std::remove(csv_path.c_str());
        std::remove(out_path.c_str());
      }
      return j;
    } catch (const std::exception& e) {
      return failed(std::string(e.what()) + "; exit " + std::to_string(WIFEXITED(rc) ? WEXITSTATUS(rc) : -1) + "; " +
                    tail_of(out + "\n" + log));
    }
  }
  return failed("ncu refused the metric set twice");
}

// ---- the table -----------------------------------------------------------------------------------------

void print_table(FILE* out, const std::vector<TableRow>& rows) {
  if (rows.empty()) return;
  std::fprintf(out, "\nHardware counters (Nsight Compute, one run of each row; memory efficiency = min bytes / DRAM bytes)\n");
  size_t w = 4;
  for (const auto& r : rows) w = std::max(w, r.label.size());
  std::fprintf(out, "%-*s  %7s  %11s  %8s  %7s  %5s  %10s  %s\n", static_cast<int>(w), "row", "occ %", "DRAM MB",
               "mem eff", "tensor%", "regs", "local B", "top stalls / status");
  auto num = [](const json& j, const char* k, const char* fmt, double scale = 1) {
    char buf[32];
    if (!j.contains(k) || !j[k].is_number()) return std::string("-");
    std::snprintf(buf, sizeof buf, fmt, j[k].get<double>() * scale);
    return std::string(buf);
  };
  for (const auto& r : rows) {
    const json& m = r.metrics;
    const std::string status = m.value("status", "");
    if (status != "ok") {
      std::fprintf(out, "%-*s  %s: %s\n", static_cast<int>(w), r.label.c_str(), status.c_str(),
                   m.value("reason", "").c_str());
      continue;
    }
    std::string stalls;
    if (m.contains("top_stalls"))
      for (const auto& s : m["top_stalls"]) stalls += (stalls.empty() ? "" : ", ") + s["reason"].get<std::string>();
    std::fprintf(out, "%-*s  %7s  %11s  %8s  %7s  %5s  %10s  %s\n", static_cast<int>(w), r.label.c_str(),
                 num(m, "achieved_occupancy_pct", "%.1f").c_str(), num(m, "dram_bytes", "%.2f", 1e-6).c_str(),
                 num(m, "memory_efficiency", "%.3f").c_str(), num(m, "tensor_pipe_pct", "%.1f").c_str(),
                 num(m, "registers_per_thread", "%.0f").c_str(), num(m, "local_bytes", "%.0f").c_str(), stalls.c_str());
  }
}

}  // namespace bench::metrics
