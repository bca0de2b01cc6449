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

// The block device under a file, from /sys/dev/block/<major>:<minor>/queue (a partition's queue is its
// disk's). Fields are 0 where unknown (a filesystem without one block device: tmpfs, overlay, NFS).
struct BlockQueue {
  std::string device;                 // "vda", "nvme0n1"; empty when unknown
  uint64_t logical_block_bytes = 0;   // queue/logical_block_size: O_DIRECT's alignment unit
  uint64_t max_request_bytes = 0;     // queue/max_sectors_kb: larger reads are split into requests of this
  uint64_t nr_requests = 0;           // queue/nr_requests: requests the block layer queues per queue
  int rotational = -1;                // queue/rotational
};
BlockQueue block_queue_of(const std::string& file);

// The O_DIRECT defaults (LoaderOptions::queue_depth = 0, chunk_bytes = 0) for the device under the
// dataset, with `why` saying what they came from.
//   read size: 4 MiB, or 1 MiB for a device whose largest request is under 256 KiB (an NVMe drive with
//     a small MDTS, where a 4 MiB read is sixteen requests anyway and 1 MiB reads spread better over its
//     queues). The H100 host's virtio disk read 1.93 GB/s with one 4 MiB read in flight and 0.80-1.81
//     with 32 x 1 MiB (bench/results/h100/loader.md): fewer, larger requests were never slower.
//   queue depth: 128 MiB in flight (32 reads of 4 MiB, 128 of 1 MiB), at least 32 (shuffled batches are
//     record-sized reads, which need the depth more than the bytes), at most 128 and the device's
//     nr_requests.
// Buffered reads (no O_DIRECT) keep the old defaults, 32 x 1 MiB.
struct ReadDefaults {
  int queue_depth = 32;
  uint64_t chunk_bytes = uint64_t{1} << 20;
  std::string why;
};
ReadDefaults default_reads(const BlockQueue& q, bool direct);

}  // namespace optimized::loader
