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
  PreadEngine(WorkerPool& pool, std::vector<int> fds, IoDone done)
      : pool_(pool), fds_(std::move(fds)), done_(std::move(done)) {}

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
    uint64_t got = 0;
    while (got < req.bytes) {
      const ssize_t n = ::pread(fds_[req.file], req.base + req.base_offset + got, req.bytes - got,
                                static_cast<off_t>(req.offset + got));
      if (n < 0) {
        if (errno == EINTR) continue;
        return -errno;
      }
      if (n == 0) break;  // end of file: the caller reports the short read
      got += static_cast<uint64_t>(n);
    }
    return static_cast<int64_t>(got);
  }

  WorkerPool& pool_;
  std::vector<int> fds_;
  IoDone done_;
  std::mutex mutex_;
  std::condition_variable cv_;
  size_t in_flight_ = 0;
};

}  // namespace

std::unique_ptr<IoEngine> make_pread_engine(WorkerPool& pool, std::vector<int> fds, IoDone done) {
  return std::make_unique<PreadEngine>(pool, std::move(fds), std::move(done));
}

}  // namespace optimized::loader
