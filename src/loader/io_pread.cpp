// The pread engine: each request is a task on the worker pool (see io_engine.h).
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <mutex>

#include "loader/io_engine.h"

namespace optimized::loader {

namespace {

class PreadEngine final : public IoEngine {
 public:
  PreadEngine(WorkerPool& pool, FdCache& files, IoDone done) : pool_(pool), files_(files), done_(std::move(done)) {}

  ~PreadEngine() override {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return in_flight_ == 0; });
  }

  void submit(const IoRequest* requests, size_t count) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      in_flight_ += count;
    }
    for (size_t i = 0; i < count; ++i) {
      pool_.post([this, req = requests[i]] {
        done_(req, read(req));
        std::lock_guard<std::mutex> lock(mutex_);
        if (--in_flight_ == 0) cv_.notify_all();
      });
    }
  }

  const char* name() const override { return "pread"; }

 private:
  int64_t read(const IoRequest& req) const {
    const int fd = files_.acquire(req.file);
    if (fd < 0) return fd;
    uint64_t got = 0;
    int64_t result = 0;
    while (got < req.bytes) {
      const ssize_t n = ::pread(fd, req.base + req.base_offset + got, req.bytes - got,
                                static_cast<off_t>(req.offset + got));
      if (n < 0) {
        if (errno == EINTR) continue;
        result = -errno;
        break;
      }
      if (n == 0) break;  // end of file: the caller reports the short read
      got += static_cast<uint64_t>(n);
    }
    files_.release(req.file);
    return result < 0 ? result : static_cast<int64_t>(got);
  }

  WorkerPool& pool_;
  FdCache& files_;
  IoDone done_;
  std::mutex mutex_;
  std::condition_variable cv_;
  size_t in_flight_ = 0;
};

}  // namespace

std::unique_ptr<IoEngine> make_pread_engine(WorkerPool& pool, FdCache& files, IoDone done) {
  return std::make_unique<PreadEngine>(pool, files, std::move(done));
}

}  // namespace optimized::loader
