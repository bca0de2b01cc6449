// What the loader reads from the machine to pick its defaults (LoaderOptions::threads = 0, io = kAuto):
// the core count, how much of the dataset the page cache holds, and the physical memory.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace optimized::loader {

// Worker threads for `hardware_threads` (std::thread::hardware_concurrency(); 0 when unknown): three
// quarters of them, 2 to 32. Measured on the H100 host (16 threads, page cache, pread pool): 8 threads
// 28.2 GB/s, 12 threads 37.0, 16 threads 30.8 (the readers then compete with the checksums, the
// consumer and the training step); docs/perf-notes/loader.md.
int default_threads(unsigned hardware_threads);

struct PageCacheResidency {
  uint64_t file_bytes = 0;      // the files' sizes, summed
  uint64_t resident_bytes = 0;  // of which in the page cache (mincore), whole pages
  std::string error;            // why a file could not be checked (then resident_bytes counts it as absent)
  double fraction() const { return file_bytes ? static_cast<double>(resident_bytes) / file_bytes : 1.0; }
};

// How much of `files` (paths) the page cache holds, by mincore(2) over a read-only mapping of each.
// Reads no data and changes nothing in the cache.
PageCacheResidency page_cache_residency(const std::vector<std::string>& files);

// Physical memory in bytes (sysconf), 0 when unknown.
uint64_t physical_memory_bytes();

}  // namespace optimized::loader
