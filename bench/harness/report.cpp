// Tables and JSON of optimized-bench (see report.h).
#include "harness/report.h"

#include <algorithm>
#include <chrono>
#include <ctime>
#include <fstream>
#include <iostream>
#include <limits>
#include <stdexcept>
#include <thread>

#include <unistd.h>

#include "gemm/cpu/cpu_gemm.h"
#include "harness/gpu_timer.h"

namespace bench {

namespace {
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// NaN and infinities become null.
nlohmann::ordered_json num(double v) {
  if (!std::isfinite(v)) return nullptr;
  return v;
}

std::string cpu_model_name() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) == 0) {
      auto colon = line.find(':');
      if (colon != std::string::npos) {
        std::string v = line.substr(colon + 1);
        v.erase(0, v.find_first_not_of(" \t"));
        return v;
      }
    }
  }
  return "unknown";
}

std::string fmt(const char* format, double v) {
  if (!std::isfinite(v)) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

// Three significant-ish digits for rates: 661, 51.2, 0.512.
std::string fmt_rate(double v) {
  if (!std::isfinite(v)) return "-";
  if (v >= 100) return fmt("%.0f", v);
  if (v >= 10) return fmt("%.1f", v);
  if (v >= 1) return fmt("%.2f", v);
  return fmt("%.3g", v);
}

std::string pad(const std::string& s, size_t width, bool right = false) {
  if (s.size() >= width) return s;
  return right ? std::string(width - s.size(), ' ') + s : s + std::string(width - s.size(), ' ');
}

std::string smem_label(int bytes) {
  if (bytes == 0) return "0";
  if (bytes % 1024 == 0) return std::to_string(bytes / 1024) + "K";
  return fmt("%.1fK", bytes / 1024.0);
}
}  // namespace

// ---- derived metrics ------------------------------------------------------------------------

double Result::tflops() const {
  if (!timed() || time.median <= 0 || flops <= 0) return kNaN;  // memory-bound rows count no flops
  return flops / (time.median * 1e-3) / 1e12;
}

double Result::gbps() const {
  if (!timed() || time.median <= 0) return kNaN;
  return min_bytes / (time.median * 1e-3) / 1e9;
}

double Result::vs_baseline() const {
  if (!timed() || !baseline || !baseline->time.valid()) return kNaN;
  return baseline->time.median / time.median;
}

double Result::roofline_fraction() const {
  // Memory-bound rows declare no flops and carry only a bandwidth: the fraction of it they reach.
  if (timed() && flops == 0 && !roofline_peak && roofline_bandwidth && roofline_bandwidth->value > 0)
    return min_bytes / (roofline_bandwidth->value * 1e9) / (time.median * 1e-3);
  if (!timed() || !roofline_peak || roofline_peak->value <= 0) return kNaN;
  double ideal_s = flops / (roofline_peak->value * 1e12);
  if (roofline_bandwidth && roofline_bandwidth->value > 0)
    ideal_s = std::max(ideal_s, min_bytes / (roofline_bandwidth->value * 1e9));
  return ideal_s / (time.median * 1e-3);
}

double Result::vs_copy_same_size() const {
  if (!timed() || !copy_same_size || !copy_same_size->valid() || time.median <= 0) return kNaN;
  return copy_same_size->median / time.median;
}

const Ceiling* best_ceiling(const std::vector<Ceiling>& ceilings, const std::string& name) {
  const Ceiling* best = nullptr;
  for (const auto& c : ceilings)
    if (c.name == name && c.value > 0 && (!best || c.value > best->value)) best = &c;
  return best;
}

// ---- machine ------------------------------------------------------------------------------

std::string iso8601_utc_now() {
  const std::time_t t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

Machine query_machine() {
  Machine m;
  const GpuInfo gpu = query_gpu();
  if (gpu.available) {
    m.gpu = gpu.name;
    m.gpu_key = gpu.key;
    m.sm_count = gpu.sm_count;
    m.l2_bytes = gpu.l2_bytes;
    m.cuda_runtime = gpu.cuda_runtime;
    m.cuda_driver = gpu.cuda_driver;
  }
  m.cpu = cpu_model_name();
  m.cpu_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  m.cpu_isa = optimized::cpu::packed_microkernel_isa();
  m.cpu_llc_bytes = host_llc_bytes();
  return m;
}

// ---- JSON ---------------------------------------------------------------------------------

nlohmann::ordered_json stats_json(const Stats& s) {
  nlohmann::ordered_json j;
  j["median"] = num(s.median);
  j["p10"] = num(s.p10);
  j["p90"] = num(s.p90);
  j["cv"] = num(s.cv);
  j["samples"] = s.samples;
  return j;
}

namespace {
nlohmann::ordered_json validation_json(const std::optional<Validation>& v) {
  if (!v) return nullptr;
  nlohmann::ordered_json j;
  j["passed"] = v->passed;
  j["max_rel_error"] = num(v->max_rel_error);
  j["worst_ratio"] = num(v->worst_ratio);
  j["checked"] = v->checked;
  return j;
}

nlohmann::ordered_json rate_json(const std::optional<Rate>& r) {
  if (!r) return nullptr;
  nlohmann::ordered_json j;
  j["name"] = r->name;
  j["value"] = num(r->value);
  j["unit"] = r->unit;
  return j;
}

nlohmann::ordered_json result_json(const Result& r) {
  nlohmann::ordered_json j;
  j["op"] = r.op;
  if (!r.family.empty()) j["family"] = r.family;
  if (!r.direction.empty()) j["direction"] = r.direction;
  j["variant"] = r.variant;
  if (!r.resolved_variant.empty()) j["resolved_variant"] = r.resolved_variant;
  j["backend"] = r.backend;
  j["dtype"] = r.dtype;
  nlohmann::ordered_json shape = nlohmann::ordered_json::object();
  for (const auto& [k, v] : r.shape) shape[k] = v;
  j["shape"] = shape;
  j["shape_label"] = r.shape_label;
  j["threads"] = r.threads ? nlohmann::ordered_json(*r.threads) : nlohmann::ordered_json(nullptr);
  j["status"] = r.status;
  j["reason"] = r.reason;
  j["validation"] = validation_json(r.validation);
  j["time_ms"] = r.timed() ? stats_json(r.time) : nlohmann::ordered_json(nullptr);
  j["flops"] = num(r.flops);
  j["min_bytes"] = num(r.min_bytes);
  if (!r.bytes_formula.empty()) j["bytes_formula"] = r.bytes_formula;
  j["tflops"] = num(r.tflops());
  j["gbps"] = num(r.gbps());
  if (r.baseline) {
    nlohmann::ordered_json b;
    b["name"] = r.baseline->name;
    b["time_ms"] = stats_json(r.baseline->time);
    b["tflops"] = num(r.baseline->tflops);
    if (r.baseline->validation) b["validation"] = validation_json(r.baseline->validation);
    j["baseline"] = b;
  } else {
    j["baseline"] = nullptr;
  }
  j["vs_baseline"] = num(r.vs_baseline());
  j["roofline_fraction"] = num(r.roofline_fraction());
  j["roofline_peak"] = rate_json(r.roofline_peak);
  j["roofline_bandwidth"] = rate_json(r.roofline_bandwidth);
  if (r.copy_same_size) {
    nlohmann::ordered_json c;
    c["time_ms"] = stats_json(*r.copy_same_size);
    c["gbps"] = num(r.copy_same_size->median > 0 ? r.min_bytes / (r.copy_same_size->median * 1e-3) / 1e9 : kNaN);
    j["copy_same_size"] = c;
    j["vs_copy_same_size"] = num(r.vs_copy_same_size());
  }
  if (r.kernel) {
    nlohmann::ordered_json k;
    k["name"] = r.kernel->name;
    k["registers"] = r.kernel->registers;
    k["static_smem"] = r.kernel->static_smem;
    k["dynamic_smem"] = r.kernel->dynamic_smem;
    k["threads"] = r.kernel->threads;
    k["blocks_per_sm"] = r.kernel->blocks_per_sm;
    k["occupancy"] = num(r.kernel->occupancy);
    k["local_bytes"] = r.kernel->local_bytes;
    j["kernel"] = k;
  } else {
    j["kernel"] = nullptr;
  }
  return j;
}
}  // namespace

nlohmann::ordered_json report_json(const Report& report) {
  nlohmann::ordered_json j;
  j["schema"] = "optimized-ops-bench/1";
  j["created"] = report.created;
  j["command"] = report.command;
  const Machine& m = report.machine;
  nlohmann::ordered_json mj;
  mj["gpu"] = m.gpu ? nlohmann::ordered_json(*m.gpu) : nlohmann::ordered_json(nullptr);
  mj["gpu_key"] = m.gpu_key;
  mj["sm_count"] = m.sm_count;
  mj["l2_bytes"] = m.l2_bytes;
  mj["cuda_runtime"] = m.cuda_runtime;
  mj["cuda_driver"] = m.cuda_driver;
  mj["cpu"] = m.cpu;
  mj["cpu_threads"] = m.cpu_threads;
  mj["cpu_isa"] = m.cpu_isa;
  mj["cpu_llc_bytes"] = m.cpu_llc_bytes;
  j["machine"] = mj;
  nlohmann::ordered_json oj;
  oj["min_samples"] = report.options.min_samples;
  oj["max_samples"] = report.options.max_samples;
  oj["min_time_s"] = report.options.min_time_s;
  oj["max_time_s"] = report.options.max_time_s;
  oj["target_rse"] = report.options.target_rse;
  oj["warmup_s"] = report.options.warmup_s;
  oj["flush_cache"] = report.options.flush_cache;
  oj["roofline"] =
      "max(flops / peak, min_bytes / bandwidth) / time; GPU peak: best cuBLAS rate of the dtype "
      "among the ceilings (fp32: cublas_fp32, no TF32), bandwidth: device_copy; CPU peak: the "
      "OpenBLAS rate at the same shape and threads, bandwidth: host_copy";
  j["options"] = oj;
  nlohmann::ordered_json cj = nlohmann::ordered_json::array();
  for (const auto& c : report.ceilings) {
    nlohmann::ordered_json e;
    e["name"] = c.name;
    e["unit"] = c.unit;
    if (!c.shape.empty()) e["shape"] = c.shape;
    if (c.bytes > 0) e["bytes"] = c.bytes;
    if (c.threads > 0) e["threads"] = c.threads;
    e["value"] = num(c.value);
    e["time_ms"] = stats_json(c.time);
    cj.push_back(e);
  }
  j["ceilings"] = cj;
  nlohmann::ordered_json rj = nlohmann::ordered_json::array();
  for (const auto& r : report.results) rj.push_back(result_json(r));
  j["results"] = rj;
  j["notes"] = report.notes;
  return j;
}

void write_json(const Report& report, const std::string& path) {
  std::ofstream f(path);
  if (!f) throw std::runtime_error("--json: cannot open '" + path + "' for writing");
  f << report_json(report).dump(2) << "\n";
  if (!f) throw std::runtime_error("--json: writing '" + path + "' failed");
}

// ---- tables -------------------------------------------------------------------------------

void print_machine(FILE* out, const Report& report) {
  const Machine& m = report.machine;
  if (m.gpu) {
    std::fprintf(out, "GPU: %s (%s), %d SMs, L2 %.0f MiB, CUDA runtime %d, driver %d\n", m.gpu->c_str(),
                 m.gpu_key.c_str(), m.sm_count, m.l2_bytes / 1048576.0, m.cuda_runtime, m.cuda_driver);
  } else {
    std::fprintf(out, "GPU: none\n");
  }
  std::fprintf(out, "CPU: %s, %d threads, microkernel %s, LLC %.0f MiB\n", m.cpu.c_str(), m.cpu_threads,
               m.cpu_isa.c_str(), m.cpu_llc_bytes / 1048576.0);
}

void print_ceilings(FILE* out, const std::vector<Ceiling>& ceilings) {
  if (ceilings.empty()) return;
  std::fprintf(out, "\nCeilings (measured in this run)\n");
  std::fprintf(out, "  %-16s %-16s %12s %-9s %-28s %s\n", "name", "shape", "value", "unit",
               "ms median [p10-p90]", "samples");
  for (const auto& c : ceilings) {
    std::string shape = c.shape;
    if (shape.empty() && c.bytes > 0) shape = fmt("%.0f MiB", c.bytes / 2 / 1048576.0) + " x2";
    if (c.threads > 0) shape += (shape.empty() ? "" : ", ") + std::to_string(c.threads) + " thr";
    std::fprintf(out, "  %-16s %-16s %12s %-9s %-28s %d\n", c.name.c_str(), shape.c_str(),
                 fmt_rate(c.value).c_str(), c.unit.c_str(), format_ms(c.time).c_str(), c.time.samples);
  }
}

void print_results(FILE* out, const std::vector<Result>& results) {
  if (results.empty()) return;
  const std::string header = pad("backend", 7) + " " + pad("thr", 4, true) + "  " + pad("variant", 17) +
                             pad("dtype", 6) + pad("shape", 17) + pad("ms median [p10-p90]", 28) +
                             pad("cv", 6, true) + pad("TFLOP/s", 9, true) + pad("GB/s", 8, true) +
                             pad("vs base", 9, true) + pad("roofline", 9, true) + "  " +
                             "regs  smem(s+d)  occ   local";
  std::fprintf(out, "\nResults (vs base = baseline time / ours, >1 is faster; roofline = ideal time / ours)\n");
  std::fprintf(out, "%s\n", header.c_str());
  // Rows of one op (and direction), backend, dtype, shape and thread count form a group.
  auto group_of = [](const Result& q) {
    return q.op + "|" + q.direction + "|" + q.backend + "|" + q.dtype + "|" + q.shape_label + "|" +
           (q.threads ? std::to_string(*q.threads) : "-");
  };
  std::string last_group;
  for (const auto& r : results) {
    const std::string thr = r.threads ? std::to_string(*r.threads) : "-";
    const std::string group = group_of(r);
    if (group != last_group) {
      last_group = group;
      std::fprintf(out, "\n");
      if (!r.direction.empty()) std::fprintf(out, "%s %s\n", r.op.c_str(), r.direction.c_str());
      // The baseline of the group, as a bracketed pseudo-row.
      for (const auto& q : results) {
        if (group_of(q) != group || !q.baseline) continue;
        const auto& b = *q.baseline;
        std::string line = pad(r.backend, 7) + " " + pad(thr, 4, true) + "  " +
                           pad("[" + b.name + "]", 17) + pad(r.dtype, 6) + pad(r.shape_label, 17) +
                           pad(format_ms(b.time), 28) + pad(fmt("%.1f%%", b.time.cv * 100), 6, true) +
                           pad(fmt_rate(b.tflops), 9, true) +
                           pad(fmt_rate(b.time.median > 0 ? q.min_bytes / (b.time.median * 1e-3) / 1e9 : kNaN), 8, true) +
                           pad("1.00x", 9, true);
        if (b.validation && !b.validation->passed) line += "   (baseline failed validation!)";
        std::fprintf(out, "%s\n", line.c_str());
        break;
      }
    }
    std::string line = pad(r.backend, 7) + " " + pad(thr, 4, true) + "  " + pad(r.variant, 17) +
                       pad(r.dtype, 6) + pad(r.shape_label, 17);
    if (r.status == "skipped") {
      line += "skipped: " + r.reason;
    } else if (r.status == "failed") {
      line += "FAILED: " + r.reason;
    } else {
      line += pad(format_ms(r.time), 28) + pad(fmt("%.1f%%", r.time.cv * 100), 6, true) +
              pad(fmt_rate(r.tflops()), 9, true) + pad(fmt_rate(r.gbps()), 8, true) +
              pad(fmt("%.2fx", r.vs_baseline()), 9, true) +
              pad(fmt("%.0f%%", r.roofline_fraction() * 100), 9, true);
      if (r.kernel) {
        const auto& k = *r.kernel;
        line += "  " + pad(std::to_string(k.registers), 4, true) + "  " +
                pad(smem_label(k.static_smem) + "+" + smem_label(k.dynamic_smem), 10) +
                pad(fmt("%.0f%%", k.occupancy * 100), 5, true) + "  " + std::to_string(k.local_bytes);
      }
      if (r.copy_same_size) line += "  same-size copy " + fmt("%.0f%%", r.vs_copy_same_size() * 100);
    }
    std::fprintf(out, "%s\n", line.c_str());
  }
}

void print_notes(FILE* out, const Report& report) {
  if (report.notes.empty()) return;
  std::fprintf(out, "\nNotes\n");
  for (const auto& n : report.notes) std::fprintf(out, "  - %s\n", n.c_str());
}

// ---- progress -----------------------------------------------------------------------------

Progress::Progress(int total) : total_(total), tty_(isatty(STDERR_FILENO) != 0) {}

void Progress::step(const std::string& what) {
  ++done_;
  const std::string text = "[" + std::to_string(done_) + "/" + std::to_string(std::max(total_, done_)) +
                           "] " + what + " ...";
  if (tty_) {
    std::fprintf(stderr, "\r%s\x1b[K", text.c_str());
    open_line_ = true;
  } else {
    std::fprintf(stderr, "%s\n", text.c_str());
  }
  std::fflush(stderr);
}

void Progress::finish() {
  if (tty_ && open_line_) std::fprintf(stderr, "\r\x1b[K");
  open_line_ = false;
  std::fflush(stderr);
}

}  // namespace bench
