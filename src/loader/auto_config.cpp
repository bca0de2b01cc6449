#include "loader/auto_config.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

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

}  // namespace optimized::loader
