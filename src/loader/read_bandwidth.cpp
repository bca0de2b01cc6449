// measure_read_bandwidth: the disk's own sequential read through the loader's I/O engines, with
// nothing else done, so that the benchmark compares the loader with the storage it reads from,
// measured the same way (the same engine, depth and request size) in the same run.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "loader/io_engine.h"
#include "loader/shard_format.h"
#include "optimized/loader.h"

namespace optimized {

ReadBandwidth measure_read_bandwidth(const std::string& dir, IoBackend io, int queue_depth, uint64_t chunk_bytes,
                                     uint64_t max_bytes, bool direct) {
  if (queue_depth < 1 || queue_depth > 1024)
    throw Error(Status::kInvalidArgument, "queue_depth: expected in [1, 1024]; given " + std::to_string(queue_depth));
  if (chunk_bytes < loader::kAlign || chunk_bytes % loader::kAlign != 0)
    throw Error(Status::kInvalidArgument, "chunk_bytes: expected a multiple of 4096; given " + std::to_string(chunk_bytes));
  const DatasetInfo info = open_dataset(dir);
  // Shards are opened as the reads reach them (a bounded cache: a dataset may have more shards than
  // the process may open files).
  std::vector<std::string> files;
  for (const ShardInfo& s : info.shards) files.push_back(s.file);
  loader::FdCache fds(files, O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0), loader::descriptor_budget(files.size()));
  // Each buffer is one read in flight; a completed read frees its buffer for the next one.
  std::vector<void*> buffers(queue_depth);
  for (void*& b : buffers) {
    b = std::aligned_alloc(loader::kAlign, chunk_bytes);
    if (!b) throw Error(Status::kOutOfMemory, "measure_read_bandwidth: buffer allocation failed");
    std::memset(b, 0, chunk_bytes);  // fault the pages in before timing
  }
  struct Freer {
    std::vector<void*>& b;
    ~Freer() {
      for (void* p : b) std::free(p);
    }
  } freer{buffers};

  std::mutex mutex;
  std::condition_variable cv;
  std::vector<int> free_buffers;
  for (int i = queue_depth - 1; i >= 0; --i) free_buffers.push_back(i);
  uint64_t done_bytes = 0;
  int in_flight = 0;
  int error = 0;
  auto done = [&](const loader::IoRequest& r, int64_t n) {
    std::lock_guard<std::mutex> lock(mutex);
    if (n < 0) error = static_cast<int>(-n);
    else done_bytes += static_cast<uint64_t>(n);
    free_buffers.push_back(static_cast<int>(reinterpret_cast<intptr_t>(r.tag)));
    --in_flight;
    cv.notify_all();
  };
  std::unique_ptr<loader::WorkerPool> pool;
  std::unique_ptr<loader::IoEngine> engine;
  std::string why_not;
  if (io != IoBackend::kPread) engine = loader::make_uring_engine(fds, queue_depth, done, why_not);
  if (!engine) {
    pool = std::make_unique<loader::WorkerPool>(queue_depth);
    engine = loader::make_pread_engine(*pool, fds, done);
  }
  // The staging buffers as io_uring fixed buffers, as the loader registers its slots (plain reads where
  // the kernel refuses, as there).
  std::vector<std::pair<void*, uint64_t>> fixed;
  for (void* b : buffers) fixed.emplace_back(b, chunk_bytes);
  std::string fixed_why_not;
  (void)engine->register_buffers(fixed, fixed_why_not);
  ReadBandwidth result;
  result.io = engine->name();
  const auto t0 = std::chrono::steady_clock::now();
  uint64_t submitted = 0;
  for (size_t f = 0; f < info.shards.size(); ++f) {
    for (uint64_t off = 0; off < info.shards[f].file_bytes; off += chunk_bytes) {
      if (max_bytes && submitted >= max_bytes) break;
      int buffer;
      {
        std::unique_lock<std::mutex> lock(mutex);
        cv.wait(lock, [&] { return !free_buffers.empty(); });
        if (error) break;
        buffer = free_buffers.back();
        free_buffers.pop_back();
        ++in_flight;
      }
      const uint64_t n = std::min(chunk_bytes, info.shards[f].file_bytes - off);
      loader::IoRequest req{static_cast<uint32_t>(f), off, n, static_cast<uint8_t*>(buffers[buffer]), 0,
                            reinterpret_cast<void*>(static_cast<intptr_t>(buffer))};
      engine->submit(&req, 1);
      submitted += n;
    }
  }
  {
    std::unique_lock<std::mutex> lock(mutex);
    cv.wait(lock, [&] { return in_flight == 0; });
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  result.bytes = done_bytes;
  engine.reset();
  pool.reset();
  if (error)
    throw Error(Status::kInternal, dir + ": measure_read_bandwidth: a read failed: " + std::strerror(error) +
                                       (direct && error == EINVAL ? " (O_DIRECT: pass direct=false)" : ""));
  return result;
}

}  // namespace optimized
