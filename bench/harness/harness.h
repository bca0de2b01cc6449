// The measurement harness shared by every benchmark of optimized-bench (house rule 4):
// validate first (the caller's job), then time with warm-up, cold caches between samples,
// rotating inputs (the caller's run_once(i) picks set i % n) and a noise-based stopping rule.
//
// Stopping rule, per measurement:
//   take at least min_samples samples and spend at least min_time_s (wall clock, flushes
//   included); then stop as soon as the relative standard error of the mean
//   (stddev / mean / sqrt(n)) is below target_rse, or at max_samples / max_time_s.
//   A measurement whose single sample is slower than max_time_s still takes kHardMinSamples.
//
// Timing: CPU samples are timed with std::chrono::steady_clock around run_once; GPU samples
// with CUDA events recorded on the stream around run_once (see gpu_timer.h), the cache flush
// being enqueued before the start event so it is outside the timed region.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace bench {

struct MeasureOptions {
  int min_samples = 10;
  int max_samples = 200;
  double min_time_s = 0.2;
  double max_time_s = 2.0;
  double target_rse = 0.01;  // stop when stddev / mean / sqrt(n) < this
  double warmup_s = 0.05;    // warm-up runs until this much time has passed ...
  int max_warmup = 10;       // ... or this many runs (0: none, e.g. when a validation run just
                             // warmed the same code on the same data)
  bool flush_cache = true;   // cold L2 (GPU) / LLC (CPU) before every sample
};

constexpr int kHardMinSamples = 3;

// Summary of one measurement, in milliseconds.
struct Stats {
  double median = 0;
  double p10 = 0;
  double p90 = 0;
  double mean = 0;
  double cv = 0;  // stddev / mean
  int samples = 0;
  bool valid() const { return samples > 0; }
};

// Percentiles by linear interpolation between order statistics; cv with the n-1 stddev.
Stats summarize(std::vector<double> samples_ms);

// The stopping rule above, given the samples so far and the wall time spent on them.
bool should_stop(const std::vector<double>& samples_ms, double elapsed_s, const MeasureOptions& opt);

// Time a synchronous host function. run_once(i) runs sample i (i counts from 0 over warm-up and
// samples alike, so rotating inputs keep rotating); between() runs untimed before every sample
// when opt.flush_cache (nullptr: the built-in host cache flush of flush_host_cache()).
Stats measure_cpu(const std::function<void(int)>& run_once, const MeasureOptions& opt,
                  const std::function<void()>& between = nullptr);

// Read (all threads) a buffer of twice the last-level cache (at most 512 MiB) so that the next
// sample starts cold.
void flush_host_cache();
// Last-level cache of the host CPU in bytes (sysfs, then a 32 MiB guess).
int64_t host_llc_bytes();

// Time asynchronous GPU work enqueued by run_once(i) on `stream` (a cudaStream_t) with CUDA
// events. When opt.flush_cache, an L2 flush (a memset of 2x the L2 size) is enqueued on the stream
// before the start event of every sample. Throws std::runtime_error when built without CUDA or
// on CUDA errors.
Stats measure_gpu(const std::function<void(int)>& run_once, void* stream, const MeasureOptions& opt);

// How many copies of an input set of `set_bytes` to rotate through: enough to cover 2x `cache_bytes`
// (so consecutive samples touch different memory even without a flush), at least 2 and at most
// `max_sets`, and never more than fit in `budget_bytes` (then 1 when even 2 do not fit).
int rotating_set_count(int64_t set_bytes, int64_t cache_bytes, int64_t budget_bytes, int max_sets = 8);

// All hardware threads (>= 1).
int all_threads();

// Short human form of a stats record: "1.234 [1.230-1.240]".
std::string format_ms(const Stats& s);

}  // namespace bench
