// The io_uring engine (see io_engine.h): one thread owns one ring, moves queued requests into
// submission entries while fewer than queue_depth are in flight, submits and waits in one call,
// and reaps completions, resubmitting the rest of a short read. Each read holds its file's
// descriptor (FdCache) from submission to completion; when the cache cannot give one without
// waiting, the request stays queued until a completion releases one. Built only with liburing
// (OPTIMIZED_WITH_LIBURING); elsewhere make_uring_engine says why not.
//
// Fixed buffers: the loader registers its staging slots with the ring (register_buffers). A read
// whose destination lies inside a registered buffer is submitted as IORING_OP_READ_FIXED: the kernel
// pinned those pages once, at registration, instead of pinning (get_user_pages) and unpinning the
// destination of every O_DIRECT read. A fixed read the kernel rejects (EFAULT, EINVAL) is retried
// once as a plain read, so registration can only cost a retry, never a failed batch.
#include <sys/resource.h>
#include <sys/uio.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "loader/io_engine.h"

#if OPTIMIZED_WITH_LIBURING
#include <liburing.h>
#endif

namespace optimized::loader {

std::string fixed_buffers_env() {
  const char* v = std::getenv("OPTIMIZED_LOADER_FIXED_BUFFERS");
  const std::string s = v ? v : "";
  return s == "off" || s == "fail" ? s : "on";
}

#if OPTIMIZED_WITH_LIBURING

namespace {

class UringEngine final : public IoEngine {
 public:
  UringEngine(FdCache& files, int depth, IoDone done) : files_(files), depth_(depth), done_(std::move(done)) {}

  // Returns 0 or -errno from io_uring_queue_init.
  int init() {
    const int rc = io_uring_queue_init(static_cast<unsigned>(depth_), &ring_, 0);
    if (rc == 0) {
      ready_ = true;
      thread_ = std::thread([this] { run(); });
    }
    return rc;
  }

  ~UringEngine() override {
    if (!ready_) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();  // the thread leaves once nothing is queued or in flight
    io_uring_queue_exit(&ring_);
  }

  void submit(const IoRequest* requests, size_t count) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (size_t i = 0; i < count; ++i) queue_.push_back({requests[i], 0});
    }
    cv_.notify_one();
  }

  const char* name() const override { return "io_uring"; }

  bool register_buffers(const std::vector<std::pair<void*, uint64_t>>& buffers, std::string& why_not) override {
    const std::string env = fixed_buffers_env();
    if (env == "off") {
      why_not = "OPTIMIZED_LOADER_FIXED_BUFFERS=off";
      return false;
    }
    if (env == "fail") {
      why_not = "io_uring_register_buffers failed: forced by OPTIMIZED_LOADER_FIXED_BUFFERS=fail";
      return false;
    }
    if (buffers.empty()) {
      why_not = "no staging buffers";
      return false;
    }
    std::vector<iovec> iov;
    for (const auto& [p, n] : buffers) {
      if (n > kMaxFixedBytes) {
        why_not = "a staging slot of " + std::to_string(n) + " bytes is larger than the 1 GiB io_uring takes per "
                  "registered buffer";
        return false;
      }
      iov.push_back({p, static_cast<size_t>(std::max<uint64_t>(n, 1))});
    }
    const int rc = io_uring_register_buffers(&ring_, iov.data(), static_cast<unsigned>(iov.size()));
    if (rc < 0) {
      why_not = std::string("io_uring_register_buffers failed: ") + std::strerror(-rc);
      if (rc == -ENOMEM) {
        rlimit rl{};
        ::getrlimit(RLIMIT_MEMLOCK, &rl);
        why_not += " (RLIMIT_MEMLOCK is " +
                   (rl.rlim_cur == RLIM_INFINITY ? std::string("unlimited") : std::to_string(rl.rlim_cur) + " bytes") +
                   ")";
      } else if (rc == -EOPNOTSUPP || rc == -EFAULT) {
        why_not += " (the staging memory is not anonymous memory the kernel can pin)";
      }
      return false;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    regions_.clear();
    for (size_t i = 0; i < buffers.size(); ++i)
      regions_.push_back({static_cast<uint8_t*>(buffers[i].first), buffers[i].second, static_cast<int>(i)});
    return true;
  }

  bool update_buffer(unsigned index, void* address, uint64_t bytes) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (index >= regions_.size()) return false;
      regions_[index].index = -1;  // plain reads until the update has succeeded
    }
    if (bytes > kMaxFixedBytes) return false;
    iovec iov{address, static_cast<size_t>(std::max<uint64_t>(bytes, 1))};
    __u64 tag = 0;
    if (io_uring_register_buffers_update_tag(&ring_, index, &iov, &tag, 1) != 1) return false;
    std::lock_guard<std::mutex> lock(mutex_);
    regions_[index] = {static_cast<uint8_t*>(address), bytes, static_cast<int>(index)};
    return true;
  }

  uint64_t fixed_reads() const override { return fixed_reads_.load(std::memory_order_relaxed); }

  void abandon_after_fork() override {
    // The ring's memory is shared with the parent's mapping; unmapping and closing it here leaves
    // the parent's ring alone. Our thread does not exist in this process: nothing is joined.
    if (ready_) io_uring_queue_exit(&ring_);
    ready_ = false;
  }

 private:
  static constexpr uint64_t kMaxFixedBytes = uint64_t{1} << 30;  // the kernel's limit per registered buffer

  struct Pending {
    IoRequest req;
    uint64_t done;        // bytes already read (short reads continue from here)
    bool plain = false;   // a fixed read was refused: plain reads from now on
    bool fixed = false;   // in flight as a fixed read
  };
  struct Region {
    uint8_t* base;
    uint64_t bytes;
    int index;  // -1: not registered (an update failed)
  };

  // The registered buffer holding [p, p + n), or -1 (under mutex_).
  int fixed_index(const uint8_t* p, uint64_t n) const {
    for (const Region& r : regions_)
      if (r.index >= 0 && p >= r.base && p + n <= r.base + r.bytes) return r.index;
    return -1;
  }

  void run() {
    std::vector<Pending*> slots(depth_, nullptr);  // in flight, indexed by user_data
    std::vector<int> free_slots;
    for (int i = depth_ - 1; i >= 0; --i) free_slots.push_back(i);
    int in_flight = 0;
    for (;;) {
      int added = 0;
      std::vector<std::pair<IoRequest, int>> unopened;  // requests whose file could not be opened
      {
        std::unique_lock<std::mutex> lock(mutex_);
        if (in_flight == 0) cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (in_flight == 0 && queue_.empty() && stopping_) return;
        while (!queue_.empty() && !free_slots.empty()) {
          // Wait for a descriptor only when nothing is in flight (else a completion frees one).
          const int fd = files_.acquire(queue_.front().req.file, /*wait=*/in_flight + added == 0);
          if (fd == -EAGAIN) break;
          if (fd < 0) {
            unopened.emplace_back(queue_.front().req, fd);
            queue_.pop_front();
            continue;
          }
          io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
          if (!sqe) {
            files_.release(queue_.front().req.file);
            break;
          }
          const int slot = free_slots.back();
          free_slots.pop_back();
          slots[slot] = new Pending(queue_.front());
          queue_.pop_front();
          Pending& p = *slots[slot];
          uint8_t* dst = p.req.base + p.req.base_offset + p.done;
          const uint64_t n = p.req.bytes - p.done;
          const int fixed = p.plain ? -1 : fixed_index(dst, n);
          p.fixed = fixed >= 0;
          if (p.fixed) {
            io_uring_prep_read_fixed(sqe, fd, dst, static_cast<unsigned>(n), p.req.offset + p.done, fixed);
            fixed_reads_.fetch_add(1, std::memory_order_relaxed);
          } else {
            io_uring_prep_read(sqe, fd, dst, static_cast<unsigned>(n), p.req.offset + p.done);
          }
          io_uring_sqe_set_data64(sqe, static_cast<uint64_t>(slot));
          ++added;
        }
      }
      for (const auto& [req, err] : unopened) done_(req, err);
      if (added == 0 && in_flight == 0) continue;  // (only unopened requests this round)
      in_flight += added;
      // Submit what was added and wait for at least one completion. A request queued meanwhile waits
      // for that completion, which comes soon since reads are in flight.
      int rc;
      do {
        rc = io_uring_submit_and_wait(&ring_, 1);
      } while (rc == -EINTR);
      if (rc < 0) {
        // The ring itself failed: fail everything in flight.
        for (int s = 0; s < depth_; ++s)
          if (slots[s]) {
            files_.release(slots[s]->req.file);
            done_(slots[s]->req, rc);
            delete slots[s];
            slots[s] = nullptr;
            free_slots.push_back(s);
            --in_flight;
          }
        continue;
      }
      io_uring_cqe* cqe;
      unsigned head, seen = 0;
      std::vector<Pending*> again;
      io_uring_for_each_cqe(&ring_, head, cqe) {
        ++seen;
        const int slot = static_cast<int>(io_uring_cqe_get_data64(cqe));
        Pending* p = slots[slot];
        slots[slot] = nullptr;
        free_slots.push_back(slot);
        --in_flight;
        files_.release(p->req.file);  // (a resubmission acquires it again)
        const int res = cqe->res;
        if (res == -EINTR || res == -EAGAIN) {
          again.push_back(p);
        } else if (res == -EINVAL && p->done > 0 && (p->req.offset + p->done) % 512 != 0) {
          // The rest of a short O_DIRECT read starts at an unaligned offset, which O_DIRECT refuses:
          // the short read ended at the end of the file.
          done_(p->req, static_cast<int64_t>(p->done));
          delete p;
        } else if ((res == -EFAULT || res == -EINVAL) && p->fixed && !p->plain) {
          p->plain = true;  // the fixed read was refused: once more as a plain read
          again.push_back(p);
        } else if (res < 0) {
          done_(p->req, res);
          delete p;
        } else if (res > 0 && p->done + static_cast<uint64_t>(res) < p->req.bytes) {
          p->done += static_cast<uint64_t>(res);  // short read: continue where it stopped
          again.push_back(p);
        } else {
          done_(p->req, static_cast<int64_t>(p->done + static_cast<uint64_t>(res)));  // res 0: end of file
          delete p;
        }
      }
      io_uring_cq_advance(&ring_, seen);
      if (!again.empty()) {
        std::lock_guard<std::mutex> lock(mutex_);
        for (auto it = again.rbegin(); it != again.rend(); ++it) {
          queue_.push_front(**it);
          delete *it;
        }
      }
    }
  }

  FdCache& files_;
  int depth_;
  IoDone done_;
  io_uring ring_{};
  bool ready_ = false;
  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Pending> queue_;
  bool stopping_ = false;
  std::vector<Region> regions_;  // the registered buffers (under mutex_)
  std::atomic<uint64_t> fixed_reads_{0};
};

}  // namespace

std::unique_ptr<IoEngine> make_uring_engine(FdCache& files, int queue_depth, IoDone done, std::string& why_not) {
  auto engine = std::make_unique<UringEngine>(files, queue_depth, std::move(done));
  const int rc = engine->init();
  if (rc != 0) {
    why_not = std::string("io_uring_queue_init failed: ") + std::strerror(-rc);
    return nullptr;
  }
  return engine;
}

#else

std::unique_ptr<IoEngine> make_uring_engine(FdCache&, int, IoDone, std::string& why_not) {
  why_not = "built without liburing (scripts/install-deps installs liburing-dev; scripts/pack-deps carries it)";
  return nullptr;
}

#endif

}  // namespace optimized::loader
