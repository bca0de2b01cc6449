// Statistics, the stopping rule and host-side timing of the benchmark harness (see harness.h).
#include "harness/harness.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <numeric>
#include <thread>

#include <unistd.h>

namespace bench {

namespace {

double percentile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0;
  const double pos = q * static_cast<double>(sorted.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  const double frac = pos - static_cast<double>(lo);
  return sorted[lo] * (1 - frac) + sorted[hi] * frac;
}

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int64_t parse_cache_size(const std::string& text) {  // "32768K", "1M"
  if (text.empty()) return 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (v <= 0) return 0;
  if (end && (*end == 'K' || *end == 'k')) return v * 1024;
  if (end && (*end == 'M' || *end == 'm')) return v * 1024 * 1024;
  return v;
}

}  // namespace

Stats summarize(std::vector<double> samples_ms) {
  Stats s;
  s.samples = static_cast<int>(samples_ms.size());
  if (samples_ms.empty()) return s;
  std::sort(samples_ms.begin(), samples_ms.end());
  s.median = percentile(samples_ms, 0.5);
  s.p10 = percentile(samples_ms, 0.1);
  s.p90 = percentile(samples_ms, 0.9);
  s.mean = std::accumulate(samples_ms.begin(), samples_ms.end(), 0.0) / s.samples;
  if (s.samples > 1 && s.mean > 0) {
    double ss = 0;
    for (double x : samples_ms) ss += (x - s.mean) * (x - s.mean);
    s.cv = std::sqrt(ss / (s.samples - 1)) / s.mean;
  }
  return s;
}

bool should_stop(const std::vector<double>& samples_ms, double elapsed_s, const MeasureOptions& opt) {
  const int n = static_cast<int>(samples_ms.size());
  if (n >= std::max(opt.max_samples, 1)) return true;
  if (elapsed_s >= opt.max_time_s && n >= kHardMinSamples) return true;
  if (n < opt.min_samples || elapsed_s < opt.min_time_s) return false;
  const Stats s = summarize(samples_ms);
  const double rse = s.cv / std::sqrt(static_cast<double>(n));
  return rse < opt.target_rse;
}

int all_threads() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

int64_t host_llc_bytes() {
  static const int64_t bytes = [] {
    int64_t best = 0;
    for (int index = 0; index < 8; ++index) {
      std::ifstream f("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/size");
      if (!f) continue;
      std::string text;
      f >> text;
      best = std::max(best, parse_cache_size(text));
    }
#ifdef _SC_LEVEL3_CACHE_SIZE
    if (best == 0) best = std::max<int64_t>(0, sysconf(_SC_LEVEL3_CACHE_SIZE));
#endif
    return best > 0 ? best : int64_t{32} << 20;
  }();
  return bytes;
}

void flush_host_cache() {
  // 2x the LLC, capped at 512 MiB (hosts that report a very large shared L3). The buffer is read,
  // not written: a written flush leaves the cache full of dirty lines whose write-back then lands
  // in the next timed sample (seen on the H100 host: CV 43% with a memset flush, 3% with none).
  // Every hardware thread reads a slice, so the private L2 of every core is flushed too. The
  // readers are plain std::threads joined before the sample: an OpenMP team would leave its
  // threads spinning (libgomp's spin-wait) into the timed region and slow down OpenBLAS's own
  // threads (seen: OpenBLAS 3x slower at 1024^3 on 16 threads).
  static const int64_t words =
      std::min<int64_t>(2 * host_llc_bytes(), int64_t{512} << 20) / static_cast<int64_t>(sizeof(uint64_t));
  static const std::unique_ptr<uint64_t[]> buffer = [] {
    std::unique_ptr<uint64_t[]> b(new uint64_t[words]);
    for (int64_t i = 0; i < words; ++i) b[i] = static_cast<uint64_t>(i);
    return b;
  }();
  const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<uint64_t> sums(static_cast<size_t>(threads) * 8, 0);  // 64 bytes apart
  std::vector<std::thread> readers;
  readers.reserve(threads);
  for (int t = 0; t < threads; ++t) {
    readers.emplace_back([t, threads, &sums] {
      const int64_t lo = words * t / threads, hi = words * (t + 1) / threads;
      const uint64_t* p = buffer.get();
      uint64_t sum = 0;
      for (int64_t i = lo - lo % 8; i < hi; i += 8) sum += p[i];  // one load per 64-byte line
      sums[static_cast<size_t>(t) * 8] = sum;
    });
  }
  for (auto& r : readers) r.join();
  uint64_t total = 0;
  for (int t = 0; t < threads; ++t) total += sums[static_cast<size_t>(t) * 8];
  asm volatile("" : : "r"(total));  // keep the loads
}

Stats measure_cpu(const std::function<void(int)>& run_once, const MeasureOptions& opt,
                  const std::function<void()>& between) {
  int iteration = 0;
  const auto warm0 = Clock::now();
  for (int w = 0; w < opt.max_warmup; ++w) {
    run_once(iteration++);
    if (seconds_since(warm0) >= opt.warmup_s) break;
  }
  std::vector<double> samples;
  const auto t0 = Clock::now();
  while (true) {
    if (opt.flush_cache) {
      if (between) between(); else flush_host_cache();
    }
    const auto s0 = Clock::now();
    run_once(iteration++);
    samples.push_back(std::chrono::duration<double, std::milli>(Clock::now() - s0).count());
    if (should_stop(samples, seconds_since(t0), opt)) break;
  }
  return summarize(std::move(samples));
}

int rotating_set_count(int64_t set_bytes, int64_t cache_bytes, int64_t budget_bytes, int max_sets) {
  if (set_bytes <= 0) return 2;
  int64_t want = (2 * cache_bytes + set_bytes - 1) / set_bytes;
  want = std::clamp<int64_t>(want, 2, std::max(max_sets, 2));
  while (want > 1 && want * set_bytes > budget_bytes) --want;
  return static_cast<int>(want);
}

std::string format_ms(const Stats& s) {
  if (!s.valid()) return "-";
  auto fmt = [](double v) {
    char buf[32];
    if (v >= 100) std::snprintf(buf, sizeof buf, "%.1f", v);
    else if (v >= 1) std::snprintf(buf, sizeof buf, "%.3f", v);
    else std::snprintf(buf, sizeof buf, "%.4f", v);
    return std::string(buf);
  };
  return fmt(s.median) + " [" + fmt(s.p10) + "-" + fmt(s.p90) + "]";
}

}  // namespace bench
