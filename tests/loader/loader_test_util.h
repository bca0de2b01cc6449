// Shared helpers of the loader tests: a temporary directory, datasets of distinct pseudo-random
// records (every byte depends on the record index, so a misplaced, repeated or torn record fails),
// and byte-exact batch checks against the records written.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/test_util.h"
#include "optimized/loader.h"

namespace optimized::loader_test {

// From tests/common: contains_all(message, {parts}) and error_of(fn).
using ::optimized::testing::contains_all;
using ::optimized::testing::error_of;

// mkdtemp under $TMPDIR (or /tmp), removed with its files on destruction.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string pattern = std::string(base && *base ? base : "/tmp") + "/optimized-loader-XXXXXX";
    std::vector<char> buf(pattern.begin(), pattern.end());
    buf.push_back('\0');
    if (!::mkdtemp(buf.data())) throw std::runtime_error("mkdtemp failed");
    path_ = buf.data();
  }
  ~TempDir() { remove_tree(path_); }
  const std::string& path() const { return path_; }
  std::string sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  static void remove_tree(const std::string& p) {
    if (DIR* d = ::opendir(p.c_str())) {
      while (const dirent* e = ::readdir(d)) {
        const std::string name = e->d_name;
        if (name == "." || name == "..") continue;
        const std::string child = p + "/" + name;
        struct stat st;
        if (::lstat(child.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) remove_tree(child);
        else ::unlink(child.c_str());
      }
      ::closedir(d);
    }
    ::rmdir(p.c_str());
  }
  std::string path_;
};

inline uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// n records of r bytes; byte j of record i is a hash of (seed, i, j / 8) -- never all zeros.
inline std::vector<uint8_t> make_records(uint64_t n, uint64_t r, uint64_t seed = 1) {
  std::vector<uint8_t> data(n * r);
  for (uint64_t i = 0; i < n; ++i) {
    for (uint64_t j = 0; j < r; j += 8) {
      const uint64_t v = mix64(seed * 0x100000001B3ull ^ mix64(i) ^ (j << 20));
      std::memcpy(data.data() + i * r + j, &v, std::min<uint64_t>(8, r - j));
    }
  }
  return data;
}

// Writes `data` (n records of uint8[r]) as a dataset of `per_shard` records per shard.
inline DatasetInfo write_dataset(const std::string& dir, const std::vector<uint8_t>& data, uint64_t r,
                                 uint64_t per_shard) {
  ShardWriter w(dir, "uint8", {static_cast<int64_t>(r)}, per_shard);
  const uint64_t n = data.size() / r;
  // Appended in uneven pieces, so that the writer's shard boundaries fall inside an append.
  uint64_t done = 0, step = 1;
  while (done < n) {
    const uint64_t k = std::min(step, n - done);
    w.append(data.data() + done * r, k);
    done += k;
    step = step * 3 + 1;
  }
  return w.close();
}

// Each batch's bytes equal the records its indices name.
inline ::testing::AssertionResult batch_matches(const uint8_t* got, const std::vector<uint64_t>& ids,
                                                const std::vector<uint8_t>& data, uint64_t r) {
  for (size_t k = 0; k < ids.size(); ++k) {
    if (ids[k] * r + r > data.size()) return ::testing::AssertionFailure() << "index " << ids[k] << " out of range";
    if (std::memcmp(got + k * r, data.data() + ids[k] * r, r) != 0) {
      uint64_t byte = 0;
      while (got[k * r + byte] == data[ids[k] * r + byte]) ++byte;
      return ::testing::AssertionFailure() << "record " << k << " of the batch (dataset record " << ids[k]
                                           << ") differs at byte " << byte;
    }
  }
  return ::testing::AssertionSuccess();
}

// Overwrites `bytes` bytes at `offset` of `file` with their complement.
inline void corrupt(const std::string& file, uint64_t offset, uint64_t bytes = 1) {
  const int fd = ::open(file.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << file;
  std::vector<uint8_t> b(bytes);
  ASSERT_EQ(::pread(fd, b.data(), bytes, static_cast<off_t>(offset)), static_cast<ssize_t>(bytes));
  for (uint8_t& x : b) x = static_cast<uint8_t>(~x);
  ASSERT_EQ(::pwrite(fd, b.data(), bytes, static_cast<off_t>(offset)), static_cast<ssize_t>(bytes));
  ::close(fd);
}

inline void truncate_file(const std::string& file, uint64_t bytes) { ASSERT_EQ(::truncate(file.c_str(), static_cast<off_t>(bytes)), 0); }

// Whether O_DIRECT reads work in `dir` (tmpfs before Linux 6.6 and some overlays refuse them).
inline std::string direct_io_unavailable(const std::string& dir) {
  const std::string f = dir + "/.direct-probe";
  int fd = ::open(f.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return "cannot create a probe file";
  std::vector<char> z(4096, 1);
  (void)!::write(fd, z.data(), z.size());
  ::close(fd);
  std::string why;
  fd = ::open(f.c_str(), O_RDONLY | O_DIRECT);
  if (fd < 0) {
    why = std::string("O_DIRECT open: ") + std::strerror(errno);
  } else {
    void* p = std::aligned_alloc(4096, 4096);
    if (::pread(fd, p, 4096, 0) != 4096) why = std::string("O_DIRECT read: ") + std::strerror(errno);
    std::free(p);
    ::close(fd);
  }
  ::unlink(f.c_str());
  return why;
}

// Runs `fn` in a forked child and waits for it at most `timeout_s` seconds (then kills it), so that a
// hang or a crash fails the test instead of stopping the test binary. The child exits with fn's
// return value without running destructors or atexit handlers (_exit): it is a copy of this process.
struct ChildResult {
  bool timed_out = false;
  int exit_code = -1;  // when it exited
  int signal = 0;      // when a signal ended it
  std::string describe() const {
    if (timed_out) return "the child did not finish in time (hung) and was killed";
    if (signal)
      return std::string("the child was killed by signal ") + std::to_string(signal) + " (" + strsignal(signal) + ")";
    return "the child exited with " + std::to_string(exit_code);
  }
  bool ok() const { return !timed_out && signal == 0 && exit_code == 0; }
};

inline ChildResult run_in_child(const std::function<int()>& fn, double timeout_s = 30) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    int code = 120;
    try {
      code = fn();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child: exception: %s\n", e.what());
      code = 121;
    } catch (...) {
      code = 122;
    }
    std::fflush(nullptr);
    ::_exit(code);
  }
  ChildResult r;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  int status = 0;
  for (;;) {
    const pid_t w = ::waitpid(pid, &status, WNOHANG);
    if (w == pid) break;
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      r.timed_out = true;
      return r;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) r.signal = WTERMSIG(status);
  return r;
}

// In a child: reports a failed expectation on stderr and returns its code (for run_in_child).
#define CHILD_EXPECT(cond, code)                                                              \
  do {                                                                                        \
    if (!(cond)) {                                                                            \
      std::fprintf(stderr, "child: %s:%d: expected %s\n", __FILE__, __LINE__, #cond);         \
      return (code);                                                                          \
    }                                                                                         \
  } while (0)

// A dataset description without files, for read plans: shards of `counts` records of `record_bytes`,
// the data after the header, the record table after the data (page-aligned), as the writer lays them out.
inline DatasetInfo fake_info(uint64_t record_bytes, std::vector<uint64_t> counts) {
  DatasetInfo info;
  info.record_bytes = record_bytes;
  uint64_t first = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    ShardInfo s;
    s.file = "shard" + std::to_string(i);
    s.index = static_cast<uint32_t>(i);
    s.first_record = first;
    s.record_count = counts[i];
    s.data_offset = kShardHeaderBytes;
    s.table_offset = kShardHeaderBytes + ((counts[i] * record_bytes + 4095) / 4096) * 4096;
    s.file_bytes = s.table_offset + 4096;
    first += counts[i];
    info.shards.push_back(s);
  }
  info.num_records = first;
  return info;
}

}  // namespace optimized::loader_test
