#include "loader/auto_config.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sys/sysmacros.h>

namespace optimized::loader {

int default_threads(unsigned hardware_threads) {
  const int n = hardware_threads == 0 ? 4 : static_cast<int>(hardware_threads);
  return std::clamp(n * 3 / 4, 2, 32);
}

PageCacheResidency page_cache_residency(const std::vector<std::string>& files) {
  PageCacheResidency r;
  const long page = ::sysconf(_SC_PAGESIZE);
  const uint64_t page_bytes = page > 0 ? static_cast<uint64_t>(page) : 4096;
  std::vector<unsigned char> pages;
  for (const std::string& f : files) {
    const int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    struct stat st{};
    if (fd < 0 || ::fstat(fd, &st) != 0) {
      if (r.error.empty()) r.error = f + ": " + std::strerror(errno);
      if (fd >= 0) ::close(fd);
      continue;
    }
    const uint64_t bytes = static_cast<uint64_t>(st.st_size);
    r.file_bytes += bytes;
    if (bytes == 0) {
      ::close(fd);
      continue;
    }
    void* p = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
    const int map_errno = errno;
    ::close(fd);
    if (p == MAP_FAILED) {
      if (r.error.empty()) r.error = f + ": mmap: " + std::strerror(map_errno);
      continue;
    }
    const uint64_t n = (bytes + page_bytes - 1) / page_bytes;
    pages.assign(n, 0);
    if (::mincore(p, bytes, pages.data()) == 0) {
      uint64_t resident = 0;
      for (unsigned char v : pages) resident += v & 1u;
      r.resident_bytes += std::min(bytes, resident * page_bytes);
    } else if (r.error.empty()) {
      r.error = f + ": mincore: " + std::strerror(errno);
    }
    ::munmap(p, bytes);
  }
  return r;
}

uint64_t physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) : 0;
}

namespace {
uint64_t read_sys_number(const std::string& file) {
  std::ifstream in(file);
  uint64_t v = 0;
  if (!(in >> v)) return 0;
  return v;
}
}  // namespace

BlockQueue block_queue_of(const std::string& file) {
  BlockQueue q;
  struct stat st{};
  if (::stat(file.c_str(), &st) != 0 || major(st.st_dev) == 0) return q;
  std::string dir = "/sys/dev/block/" + std::to_string(major(st.st_dev)) + ":" + std::to_string(minor(st.st_dev));
  struct stat qs{};
  // A partition has no queue/ of its own: its disk is the parent directory.
  if (::stat((dir + "/queue").c_str(), &qs) != 0) dir += "/..";
  if (::stat((dir + "/queue").c_str(), &qs) != 0) return q;
  char resolved[4096];
  if (::realpath(dir.c_str(), resolved)) {
    const std::string r = resolved;
    q.device = r.substr(r.find_last_of('/') + 1);
  }
  q.logical_block_bytes = read_sys_number(dir + "/queue/logical_block_size");
  q.max_request_bytes = read_sys_number(dir + "/queue/max_sectors_kb") * 1024;
  q.nr_requests = read_sys_number(dir + "/queue/nr_requests");
  std::ifstream rot(dir + "/queue/rotational");
  int r = -1;
  if (rot >> r) q.rotational = r;
  return q;
}

ReadDefaults default_reads(const BlockQueue& q, bool direct) {
  ReadDefaults d;
  if (!direct) {
    d.why = "buffered reads";
    return d;
  }
  const uint64_t MiB = uint64_t{1} << 20;
  d.chunk_bytes = (q.max_request_bytes != 0 && q.max_request_bytes < 256 * 1024) ? MiB : 4 * MiB;
  int depth = static_cast<int>((128 * MiB) / d.chunk_bytes);
  depth = std::clamp(depth, 32, 128);
  if (q.nr_requests >= 1) depth = std::min<int>(depth, static_cast<int>(std::max<uint64_t>(q.nr_requests, 1)));
  d.queue_depth = std::max(depth, 1);
  if (q.device.empty()) {
    d.why = "no block device found under the dataset";
  } else {
    d.why = q.device + ": largest request " + std::to_string(q.max_request_bytes >> 10) + " KiB, nr_requests " +
            std::to_string(q.nr_requests) + ", logical block " + std::to_string(q.logical_block_bytes) + " B";
  }
  return d;
}

}  // namespace optimized::loader
