// A bounded cache of open shard descriptors, so that a dataset may have more shards than the
// process may open files (RLIMIT_NOFILE): the loader opens a shard when a read needs it, keeps it
// open while it is used and closes the least recently used one when the cache is full.
//
// A descriptor is pinned from acquire() to release() (one read, or one fstat), and never closed
// while pinned. Reads in flight are bounded (pool threads, or queue_depth for io_uring), so a cache
// of a few descriptors always makes progress: a reader that finds every cached descriptor pinned
// and the cache full waits for a release (or, with wait=false, is told to try later).
#pragma once

#include <cstdint>
#include <condition_variable>
#include <list>
#include <mutex>
#include <string>
#include <vector>

namespace optimized::loader {

// How many shard descriptors a loader keeps open at most: a quarter of the soft RLIMIT_NOFILE
// (the rest is the process's), at least 4, at most 1024, and no more than the shards.
size_t descriptor_budget(size_t files);

class FdCache {
 public:
  // files: full paths; flags: open(2) flags (O_RDONLY | O_CLOEXEC | maybe O_DIRECT).
  FdCache(std::vector<std::string> files, int flags, size_t capacity);
  ~FdCache();  // closes every descriptor
  FdCache(const FdCache&) = delete;
  FdCache& operator=(const FdCache&) = delete;

  // The descriptor of file `index`, opened if needed and pinned until release(index): >= 0, or
  // -errno when it cannot be opened (-ENOENT, -EMFILE with nothing to close, ...). With wait=false,
  // -EAGAIN instead of waiting when the cache is full and every descriptor in it is pinned.
  int acquire(uint32_t index, bool wait = true);
  void release(uint32_t index);

  const std::string& file(uint32_t index) const { return files_[index]; }
  size_t size() const { return files_.size(); }
  size_t capacity() const { return capacity_; }
  size_t open_count();  // descriptors open now (tests)

  // In the child of a fork: closes the descriptors without taking the lock (which a thread of the
  // parent may have held at the fork) and forgets them.
  void close_all_after_fork();

 private:
  struct Entry {
    int fd = -1;
    int pins = 0;
    std::list<uint32_t>::iterator lru;  // valid while open and unpinned
  };
  bool evict_one();  // closes the least recently used unpinned descriptor; false if none

  std::vector<std::string> files_;
  int flags_;
  size_t capacity_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<Entry> entries_;
  std::list<uint32_t> unpinned_;  // open, unpinned, least recently used first
  size_t open_ = 0;
  size_t pinned_ = 0;             // entries with pins > 0
};

}  // namespace optimized::loader
