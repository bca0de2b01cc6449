// The loader's bounded descriptor cache (see fd_cache.h).
#include "loader/fd_cache.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

namespace optimized::loader {

size_t descriptor_budget(size_t files) {
  uint64_t soft = 1024;
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) soft = rl.rlim_cur;
  else if (rl.rlim_cur == RLIM_INFINITY) soft = uint64_t{1} << 20;
  const size_t budget = static_cast<size_t>(std::clamp<uint64_t>(soft / 4, 4, 1024));
  return std::max<size_t>(1, std::min(budget, files));
}

FdCache::FdCache(std::vector<std::string> files, int flags, size_t capacity)
    : files_(std::move(files)), flags_(flags), capacity_(std::max<size_t>(capacity, 1)), entries_(files_.size()) {}

FdCache::~FdCache() {
  for (Entry& e : entries_)
    if (e.fd >= 0) ::close(e.fd);
}

bool FdCache::evict_one() {
  if (unpinned_.empty()) return false;
  const uint32_t victim = unpinned_.front();
  unpinned_.pop_front();
  ::close(entries_[victim].fd);
  entries_[victim].fd = -1;
  --open_;
  return true;
}

int FdCache::acquire(uint32_t index, bool wait) {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    Entry& e = entries_[index];
    if (e.fd >= 0) {
      if (e.pins++ == 0) {
        unpinned_.erase(e.lru);
        ++pinned_;
      }
      return e.fd;
    }
    if (open_ >= capacity_ && !evict_one()) {
      if (!wait) return -EAGAIN;
      cv_.wait(lock);  // every cached descriptor is in use by a read: one ends soon
      continue;
    }
    const int fd = ::open(files_[index].c_str(), flags_);
    if (fd < 0) {
      const int err = errno;
      if (err == EINTR) continue;
      // The process is at its limit (other code holds descriptors too): give one of ours back.
      if ((err == EMFILE || err == ENFILE) && evict_one()) continue;
      if ((err == EMFILE || err == ENFILE) && pinned_ > 0) {
        if (!wait) return -EAGAIN;
        cv_.wait(lock);
        continue;
      }
      return -err;
    }
    e.fd = fd;
    e.pins = 1;
    ++pinned_;
    ++open_;
    return fd;
  }
}

void FdCache::release(uint32_t index) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Entry& e = entries_[index];
    if (e.pins <= 0) return;  // (a caller bug; never closes a pinned descriptor)
    if (--e.pins == 0) {
      --pinned_;
      e.lru = unpinned_.insert(unpinned_.end(), index);
    }
  }
  cv_.notify_all();
}

size_t FdCache::open_count() {
  std::lock_guard<std::mutex> lock(mutex_);
  return open_;
}

void FdCache::close_all_after_fork() {
  for (Entry& e : entries_) {
    if (e.fd >= 0) ::close(e.fd);
    e.fd = -1;
  }
  // The list and counters are left as they are: this cache is never used again.
}

}  // namespace optimized::loader
