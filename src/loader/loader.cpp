// The streaming loader's pipeline (the API is include/optimized/loader.h).
//
//   producer thread   for each batch in order, up to `prefetch` ahead of the consumer: takes a free
//                     staging slot, plans the batch's reads (read_plan.h) and submits them
//   I/O engine        io_uring, a pread pool or cuFile (io_engine.h) reads into the slot
//   worker pool       checks every record's CRC32C, then delivers: on CUDA, allocates the output
//                     from the loader's memory pool and copies on the loader's stream (one H2D per
//                     run, or one H2D of the staging and a gather kernel), recording the batch's
//                     event; on the CPU, packs the records into a new host buffer
//   consumer          next() takes batches in order from the ready map
//
// Batches complete out of order and are handed out in order. A failed read or checksum becomes the
// error of its batch, thrown by next() when that batch's turn comes (and after: nothing is skipped).
// Memory handed out (BatchMemory) is freed by its last owner in stream order, so it may outlive the
// loader; the staging slots, threads and descriptors are the loader's and go with stop().
//
// Shards are opened lazily through a bounded descriptor cache (fd_cache.h). io=mmap checks each
// shard's size (fstat) before a batch touches its pages and reads the pages under a SIGBUS guard
// (mmap_guard.h), so that a shard truncated while mapped is an error, not a crash. A fork is noticed
// by the process id (Loader::live): the child starts a fresh pipeline, or, on CUDA, refuses.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "loader/auto_config.h"
#include "loader/crc32c.h"
#include "loader/cufile_shim.h"
#include "loader/fd_cache.h"
#include "loader/io_engine.h"
#include "loader/mmap_guard.h"
#include "loader/order.h"
#include "loader/read_plan.h"
#include "loader/shard_format.h"
#include "loader/worker_pool.h"
#include "optimized/loader.h"

#if OPTIMIZED_WITH_CUDA
#include "core/cuda_device_guard.h"
#include "loader/gather.h"
#endif

namespace optimized {

using loader::align_up;
using loader::kAlign;

// ---- names ------------------------------------------------------------------------------------

namespace {
constexpr LoaderVariant kLoaderVariants[] = {LoaderVariant::kSynchronous, LoaderVariant::kPipelined};
}  // namespace

std::span<const LoaderVariant> all_loader_variants() { return kLoaderVariants; }
std::string_view loader_variant_name(LoaderVariant v) {
  return v == LoaderVariant::kSynchronous ? "synchronous" : "pipelined";
}
LoaderVariant parse_loader_variant(std::string_view name) {
  std::string choices;
  for (LoaderVariant v : kLoaderVariants) {
    if (name == loader_variant_name(v)) return v;
    choices += (choices.empty() ? "" : ", ") + std::string(loader_variant_name(v));
  }
  throw Error(Status::kInvalidArgument, "variant: expected one of " + choices + "; given '" + std::string(name) + "'");
}
std::string_view io_backend_name(IoBackend b) {
  switch (b) {
    case IoBackend::kIoUring: return "io_uring";
    case IoBackend::kPread: return "pread";
    case IoBackend::kMmap: return "mmap";
    default: return "auto";
  }
}
IoBackend parse_io_backend(std::string_view name) {
  if (name == "auto") return IoBackend::kAuto;
  if (name == "io_uring") return IoBackend::kIoUring;
  if (name == "pread") return IoBackend::kPread;
  if (name == "mmap") return IoBackend::kMmap;
  throw Error(Status::kInvalidArgument,
              "io: expected \"auto\", \"io_uring\", \"pread\" or \"mmap\"; given \"" + std::string(name) + "\"");
}
namespace {
template <typename E>
E parse_tristate(std::string_view name, const char* what) {
  if (name == "auto") return E::kAuto;
  if (name == "on") return E::kOn;
  if (name == "off") return E::kOff;
  throw Error(Status::kInvalidArgument,
              std::string(what) + ": expected \"auto\", \"on\" or \"off\"; given \"" + std::string(name) + "\"");
}
}  // namespace
DirectIo parse_direct_io(std::string_view name) { return parse_tristate<DirectIo>(name, "direct_io"); }
GdsMode parse_gds_mode(std::string_view name) { return parse_tristate<GdsMode>(name, "gds"); }

std::vector<uint64_t> loader_epoch_order(uint64_t num_records, const LoaderOptions& o, uint64_t epoch) {
  const loader::RankOrder order(num_records, o.shuffle, o.seed, o.rank, o.world_size,
                                static_cast<uint64_t>(o.batch_size), o.drop_last);
  std::vector<uint64_t> all, batch;
  for (uint64_t b = 0; b < order.batches; ++b) {
    order.batch_records(epoch, b, batch);
    all.insert(all.end(), batch.begin(), batch.end());
  }
  return all;
}

namespace {

// "Says so once": the first notice of each kind per process goes to stderr; every loader also keeps
// its own in notes().
void notice_once(const std::string& kind, const std::string& text) {
  static std::mutex mutex;
  static std::set<std::string> printed;
  std::lock_guard<std::mutex> lock(mutex);
  if (printed.insert(kind).second) std::fprintf(stderr, "optimized loader: %s\n", text.c_str());
}

// ---- batch memory -----------------------------------------------------------------------------

// Host buffers of one size (a staging slot's capacity), recycled: fresh pages cost a page fault
// each on first touch, which made a 38 MB batch cost more to pack than to read. Keeps up to `keep`
// free buffers; the loader and the batches it handed out share it.
class HostPool {
 public:
  // what: how the size came about, for the allocation error ("a batch of ... (batch_size ...)").
  HostPool(uint64_t bytes, size_t keep, std::string what)
      : bytes_(align_up(std::max<uint64_t>(bytes, 1), kAlign)), keep_(keep), what_(std::move(what)), pid_(::getpid()) {}
  ~HostPool() {
    for (void* p : free_) std::free(p);
  }
  uint8_t* get() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!free_.empty()) {
        void* p = free_.back();
        free_.pop_back();
        return static_cast<uint8_t*>(p);
      }
    }
    void* p = std::aligned_alloc(kAlign, bytes_);  // 4 KiB aligned: O_DIRECT reads into it
    if (!p)
      throw Error(Status::kOutOfMemory, "loader: host allocation of " + std::to_string(bytes_) + " bytes for " + what_ +
                                            " failed (out of memory)");
    return static_cast<uint8_t*>(p);
  }
  void put(void* p) {
    if (!p) return;
    if (::getpid() != pid_) {
      // A batch freed in a forked child: the lock may have been held by a thread of the parent.
      std::free(p);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (free_.size() < keep_) {
        free_.push_back(p);
        return;
      }
    }
    std::free(p);
  }

 private:
  uint64_t bytes_;
  size_t keep_;
  std::string what_;
  pid_t pid_;
  std::mutex mutex_;
  std::vector<void*> free_;
};

// A batch on the CPU: a pool buffer (the staging slot's own buffer when the records already lie
// packed in it, then the slot takes a new one), the records at `offset` in it.
class HostBatchMemory final : public BatchMemory {
 public:
  HostBatchMemory(std::shared_ptr<HostPool> pool, uint8_t* buffer, uint64_t offset)
      : pool_(std::move(pool)), buffer_(buffer), offset_(offset) {}
  ~HostBatchMemory() override { pool_->put(buffer_); }
  void* data() const override { return buffer_ + offset_; }
  void release_after(void*) override {}

 private:
  std::shared_ptr<HostPool> pool_;
  uint8_t* buffer_;
  uint64_t offset_;
};

// 4 KiB-aligned host memory (O_DIRECT needs it), for the O_DIRECT probe.
void* alloc_aligned_host(uint64_t bytes) {
  void* p = std::aligned_alloc(kAlign, align_up(std::max<uint64_t>(bytes, 1), kAlign));
  if (!p) throw Error(Status::kOutOfMemory, "host allocation of " + std::to_string(bytes) + " bytes failed");
  return p;
}

#if OPTIMIZED_WITH_CUDA

// What the loader and the memory it handed out share: the device, the copy stream and the memory
// pool. Lives until the last of them is gone.
struct CudaContext {
  int device = 0;
  const pid_t pid = ::getpid();      // CUDA state is not usable in a forked child: never touched there
  cudaStream_t stream = nullptr;     // the loader's copy stream
  cudaStream_t readback = nullptr;   // GDS + verify: device staging back to the host
  cudaMemPool_t pool = nullptr;

  explicit CudaContext(int dev, bool with_readback) : device(dev) {
    DeviceGuard guard(device);
    // The highest priority: the gather kernels are small and should not queue behind the
    // training step's kernels for SMs (the copies themselves use the copy engines).
    int least = 0, greatest = 0;
    check_cuda(cudaDeviceGetStreamPriorityRange(&least, &greatest), "loader: cudaDeviceGetStreamPriorityRange");
    check_cuda(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, greatest), "loader: cudaStreamCreate");
    if (with_readback)
      check_cuda(cudaStreamCreateWithFlags(&readback, cudaStreamNonBlocking), "loader: cudaStreamCreate");
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    check_cuda(cudaMemPoolCreate(&pool, &props), "loader: cudaMemPoolCreate");
    // Keep freed batches in the pool for the next ones instead of returning them at each sync.
    uint64_t keep = UINT64_MAX;
    check_cuda(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep),
               "loader: cudaMemPoolSetAttribute");
  }
  ~CudaContext() {
    if (::getpid() != pid) return;  // a forked child's copy: leaked
    // Errors are ignored: this may run at process exit, after the CUDA runtime has gone.
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device);
    if (stream) cudaStreamSynchronize(stream);
    if (pool) cudaMemPoolDestroy(pool);
    if (stream) cudaStreamDestroy(stream);
    if (readback) cudaStreamDestroy(readback);
    cudaGetLastError();
    cudaSetDevice(previous);
  }
};

class DeviceBatchMemory final : public BatchMemory {
 public:
  DeviceBatchMemory(std::shared_ptr<CudaContext> ctx, uint64_t bytes) : ctx_(std::move(ctx)) {
    check_cuda(cudaMallocFromPoolAsync(&data_, std::max<uint64_t>(bytes, 1), ctx_->pool, ctx_->stream),
               "loader: cudaMallocFromPoolAsync of " + std::to_string(bytes) + " bytes");
    const cudaError_t e = cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming);
    if (e != cudaSuccess) {
      cudaFreeAsync(data_, ctx_->stream);
      check_cuda(e, "loader: cudaEventCreate");
    }
  }
  ~DeviceBatchMemory() override {
    if (::getpid() != ctx_->pid) return;  // freed in a forked child, where CUDA cannot be used: leaked
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(ctx_->device);
    // Freed on the copy stream (so after the copy into it), after the consumers' streams reach the
    // points release_after() marked.
    for (cudaEvent_t e : released_) {
      cudaStreamWaitEvent(ctx_->stream, e, 0);
      cudaEventDestroy(e);
    }
    cudaFreeAsync(data_, ctx_->stream);
    cudaEventDestroy(ready_);
    cudaGetLastError();
    cudaSetDevice(previous);
  }
  void* data() const override { return data_; }
  void release_after(void* stream) override {
    DeviceGuard guard(ctx_->device);
    cudaEvent_t e;
    check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "loader: cudaEventCreate");
    std::lock_guard<std::mutex> lock(mutex_);
    released_.push_back(e);
    check_cuda(cudaEventRecord(e, static_cast<cudaStream_t>(stream)), "loader: cudaEventRecord (release_after)");
  }
  cudaEvent_t ready() const { return ready_; }

 private:
  std::shared_ptr<CudaContext> ctx_;
  void* data_ = nullptr;
  cudaEvent_t ready_ = nullptr;
  std::mutex mutex_;
  std::vector<cudaEvent_t> released_;
};

#endif  // OPTIMIZED_WITH_CUDA

}  // namespace

// ---- Batch ------------------------------------------------------------------------------------

void* Batch::data() const { return memory_ ? memory_->data() : nullptr; }

void Batch::wait(void* stream) const {
#if OPTIMIZED_WITH_CUDA
  if (ready_event_) {
    DeviceGuard guard(device_.index);
    check_cuda(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(ready_event_), 0),
               "Batch::wait: cudaStreamWaitEvent");
  }
#else
  (void)stream;
#endif
}

void Batch::synchronize() const {
#if OPTIMIZED_WITH_CUDA
  if (ready_event_) {
    DeviceGuard guard(device_.index);
    check_cuda(cudaEventSynchronize(static_cast<cudaEvent_t>(ready_event_)), "Batch::synchronize: cudaEventSynchronize");
  }
#endif
}

// ---- the pipeline -----------------------------------------------------------------------------

namespace {

struct Slot {
  enum class State { kFree, kBusy, kCopying };
  uint8_t* host = nullptr;              // staging: pinned (CUDA) or 4 KiB-aligned (CPU)
  bool host_mapped = false;             // CUDA: host is an anonymous mapping registered with cudaHostRegister
                                        // (so that io_uring can register it too), else cudaHostAlloc's
  loader::Placement* pieces = nullptr;  // gather table (pinned), CUDA only
  uint64_t max_pieces = 0;
  uint8_t* device = nullptr;            // GDS staging (registered with cuFile)
  State state = State::kFree;
#if OPTIMIZED_WITH_CUDA
  cudaEvent_t copied = nullptr;         // the copy out of this slot has finished
#endif
};

struct Job {
  uint64_t seq = 0;
  LoaderPosition position;
  int slot = -1;
  std::vector<uint64_t> ids;
  loader::ReadPlan plan;
  std::atomic<int64_t> pending{0};
  std::mutex mutex;
  bool failed = false;
  Status status = Status::kOk;
  std::string error;

  void fail(Status s, const std::string& message) {
    std::lock_guard<std::mutex> lock(mutex);
    if (failed) return;  // the first error is the one reported
    failed = true;
    status = s;
    error = message;
  }
};

struct Ready {
  Batch batch;
  bool failed = false;
  Status status = Status::kOk;
  std::string error;
};

// Copies of one batch with at most this many runs go straight from staging to the output, one
// cudaMemcpyAsync per run; more runs go through one staging copy and the gather kernel.
constexpr size_t kMaxDirectCopies = 8;

}  // namespace

struct Loader::Impl {
  const LoaderOptions given;         // the options as passed (a forked child starts again from them)
  const pid_t pid = ::getpid();      // the process that made this pipeline
  DatasetInfo info;
  LoaderOptions opt;
  loader::RankOrder order;
  uint64_t alignment = 1;
  bool direct = false;
  bool use_gds = false;
  std::string backend;
  std::vector<std::string> notes;
  std::vector<std::vector<uint32_t>> tables;  // per shard: the CRC32C of each record
  std::unique_ptr<loader::FdCache> files;     // the shards' descriptors, opened as reads need them
  std::vector<uint8_t*> maps;        // io=mmap: each shard mapped whole (file_bytes)
  bool registered = false;           // io=mmap on CUDA: the mappings are registered (pinned)
  std::string io_reason;             // why io=auto took what it took (choose_io), for the "auto" note
  std::string reads_reason;          // where queue_depth / chunk_bytes = 0 (auto) came from (resolve_reads)
  bool fixed_buffers = false;        // the staging slots are io_uring fixed buffers
  std::string fixed_why_not;         // why not, when the engine is io_uring
  std::vector<void*> cufile_handles;
  loader::CuFile* cufile = nullptr;
  std::unique_ptr<loader::WorkerPool> pool;
  std::unique_ptr<loader::IoEngine> engine;
  std::vector<Slot> slots;
  int slot_count = 1;                // staging slots: prefetch (1 for the synchronous rung), or fewer
  uint64_t batch_records = 1;        // most records in one of this loader's batches
  uint64_t slot_capacity = 0;
  std::shared_ptr<HostPool> host_pool;  // CPU device: staging and batch buffers
#if OPTIMIZED_WITH_CUDA
  std::shared_ptr<CudaContext> cuda;
  std::mutex copy_mutex;  // one batch's copy sequence at a time on the stream
#endif

  // Which batches, in which order (see LoaderOptions::worker): from `phase` (the start or the last
  // seek), batches first(e), first(e) + K, ... of each epoch e, where first(e) is worker plus the
  // phase's batch in the phase's epoch, and worker in later ones. seq counts them from the phase.
  uint64_t worker = 0, stride = 1;  // K = stride = num_workers
  LoaderPosition phase;

  // Shared state, under `mutex`.
  std::mutex mutex;
  std::condition_variable cv;
  LoaderPosition position;
  uint64_t consumer_seq = 0;   // the next batch the consumer takes
  uint64_t requested = 0;      // synchronous: batches the consumer has asked for
  std::map<uint64_t, Ready> ready;
  std::map<uint64_t, std::shared_ptr<Job>> active;
  bool producer_stop = false;
  bool aborting = false;       // in-flight jobs are being drained: no work, no delivery
  bool stopped = false;
  std::optional<Error> failure;  // sticky: next() throws it until seek()
  std::thread producer;
  LoaderStats stats;
  std::atomic<uint64_t> read_bytes{0};
  bool abandoned = false;      // a forked child's copy, given up (abandon_after_fork)

  Impl(const std::string& dir, const LoaderOptions& o);
  ~Impl();
  // Checks the options, opens the dataset and builds the pipeline, not yet started.
  static std::unique_ptr<Impl> build(const std::string& dir, const LoaderOptions& o);

  uint64_t first_in(uint64_t epoch) const { return (epoch == phase.epoch ? phase.batch : 0) + worker; }
  uint64_t count_in(uint64_t epoch) const {
    const uint64_t f = first_in(epoch);
    return f < order.batches ? (order.batches - f + stride - 1) / stride : 0;
  }
  // Batches from the phase to the end (UINT64_MAX: no end).
  uint64_t limit() const {
    const uint64_t c0 = count_in(phase.epoch), c = count_in(phase.epoch + 1);
    if (opt.epochs) return phase.epoch >= opt.epochs ? 0 : c0 + (opt.epochs - phase.epoch - 1) * c;
    return c == 0 ? c0 : UINT64_MAX;
  }
  // The position of batch `seq` (seq < limit()).
  LoaderPosition position_of(uint64_t seq) const {
    const uint64_t c0 = count_in(phase.epoch);
    if (seq < c0) return {phase.epoch, first_in(phase.epoch) + seq * stride};
    seq -= c0;
    const uint64_t c = count_in(phase.epoch + 1);
    return {phase.epoch + 1 + seq / c, worker + (seq % c) * stride};
  }
  // The first position at or after the start of `epoch` that this loader delivers (batch ==
  // order.batches: none; next() then ends the epoch at once).
  LoaderPosition epoch_start(uint64_t epoch) const { return {epoch, std::min(first_in(epoch), order.batches)}; }
  // Continue from `p` (under the lock, with the producer stopped).
  void restart_at(LoaderPosition p) {
    phase = p;
    position = epoch_start(p.epoch);
    consumer_seq = 0;
    requested = 0;
  }

  void note(const std::string& kind, const std::string& text) {
    notes.push_back(text);
    notice_once(kind, text);
  }

  void choose_io();
  void choose_direct();
  void plan_staging();
  bool map_files();
  void resolve_reads();
  void choose_engine();
  void allocate_slots();
  void register_staging();
  std::string reads_note() const;
  void start_producer();
  void quiesce();
  void shutdown();
  void abandon_after_fork();

  void produce(uint64_t seq);
  int acquire_slot();
  bool check_mapped_sizes(Job* job);
  void on_read(const loader::IoRequest& req, int64_t result);
  void after_reads(Job* job);
  void verify_range(Job* job, size_t first, size_t last);
  void finish(Job* job);
  Batch deliver(Job* job);
};

Loader::Impl::Impl(const std::string& dir, const LoaderOptions& o)
    : given(o),
      info(open_dataset(dir)),
      opt(o),
      order(info.num_records, o.shuffle, o.seed, o.rank < 0 ? 0 : o.rank, o.world_size < 1 ? 1 : o.world_size,
            o.batch_size < 1 ? 1 : static_cast<uint64_t>(o.batch_size), o.drop_last),
      worker(static_cast<uint64_t>(std::max(o.worker, 0))),
      stride(static_cast<uint64_t>(std::max(o.num_workers, 1))) {}

Loader::Impl::~Impl() {
  if (!abandoned) shutdown();
}

// io=auto on CUDA: where the page cache holds the dataset (>= 90% of its bytes, by mincore) and the
// dataset is at most a quarter of the physical memory, the shards are mapped and registered (io=mmap:
// the copy engine reads the page cache, no CPU copy: 0.81-0.99x of pinned host-to-device on the H100,
// where the pread pool reached 0.49-0.58x); else the reads go to storage (io_uring with
// O_DIRECT, or the pread pool). direct_io=on or gds=on keep their paths. The CPU device keeps its path
// (a pread into the slot is the batch already; mapping would add a copy).
void Loader::Impl::choose_io() {
  if (opt.io != IoBackend::kAuto || !opt.device.is_cuda() || opt.direct_io == DirectIo::kOn ||
      opt.gds == GdsMode::kOn)
    return;
  std::vector<std::string> names;
  names.reserve(info.shards.size());
  for (const ShardInfo& sh : info.shards) names.push_back(sh.file);
  const loader::PageCacheResidency res = loader::page_cache_residency(names);
  const uint64_t memory = loader::physical_memory_bytes();
  auto gib = [](uint64_t b) {
    char t[32];
    std::snprintf(t, sizeof(t), "%.2f GiB", static_cast<double>(b) / (1ull << 30));
    return std::string(t);
  };
  const std::string cached = std::to_string(static_cast<int>(res.fraction() * 100 + 0.5)) + "% of the dataset's " +
                             gib(res.file_bytes) + " in the page cache";
  if (!res.error.empty()) {
    io_reason = "the page cache could not be checked (" + res.error + ")";
  } else if (res.fraction() < 0.9) {
    io_reason = cached + " (mmap from 90%)";
  } else if (memory == 0 || res.file_bytes > memory / 4) {
    io_reason = cached + ", but the dataset is more than a quarter of the " +
                (memory ? gib(memory) : std::string("unknown")) + " of memory that mmap would pin";
  } else {
    opt.io = IoBackend::kMmap;
    io_reason = cached + ", within a quarter of the " + gib(memory) + " of memory";
  }
}

// O_DIRECT bypasses the page cache: reads go from the device into the staging buffers once, with no
// kernel copy and without evicting the training process's memory. Some filesystems refuse it (at
// open or at the first read): probed on the first shard; kAuto then falls back to buffered reads and
// says so.
void Loader::Impl::choose_direct() {
  if (opt.io == IoBackend::kMmap) {
    if (opt.direct_io == DirectIo::kOn)
      throw Error(Status::kInvalidArgument,
                  "io=mmap reads the page cache; direct_io must be auto or off (given on)");
    opt.direct_io = DirectIo::kOff;
  }
  direct = opt.direct_io != DirectIo::kOff;
  if (direct) {
    const std::string& file = info.shards.front().file;
    std::string why_not;
    const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
    if (fd < 0 && errno == EINVAL) {
      why_not = "open with O_DIRECT: " + std::string(std::strerror(errno));
    } else if (fd < 0) {
      if (errno == ENOENT) loader::throw_dataset_error(file, "missing (removed after the dataset was opened?)");
      loader::throw_os_error(file, "open", errno);
    } else {
      // Probe one aligned read: some filesystems accept the flag at open and reject the reads.
      void* probe = alloc_aligned_host(kAlign);
      const ssize_t n = ::pread(fd, probe, kAlign, 0);
      const int err = errno;
      std::free(probe);
      ::close(fd);
      if (n < 0 && err == EINVAL) why_not = "O_DIRECT read: " + std::string(std::strerror(err));
    }
    if (!why_not.empty()) {
      if (opt.direct_io == DirectIo::kOn)
        throw Error(Status::kUnsupported, file + ": direct_io=on, but " + why_not +
                                              " (the filesystem does not support O_DIRECT); use direct_io=auto or off");
      note("direct_io", "O_DIRECT unavailable for " + info.path + " (" + why_not + "); reading through the page cache");
      opt.direct_io = DirectIo::kOff;
      direct = false;
    }
  }
  alignment = direct ? kAlign : 1;
}

// Sizes the staging ring: a slot holds the largest batch this loader delivers (not batch_size when
// the rank has fewer records), as read (widened to pages with O_DIRECT, bounded by the shards' data);
// the slots together stay within opt.staging_bytes (LoaderOptions::staging_bytes says how).
void Loader::Impl::plan_staging() {
  const uint64_t r = info.record_bytes;
  batch_records = std::max<uint64_t>(1, std::min<uint64_t>(static_cast<uint64_t>(opt.batch_size), order.count));
  const uint64_t max_runs = opt.shuffle ? batch_records : std::max<uint64_t>(1, info.shards.size());
  const uint64_t data_bytes = loader::aligned_data_bytes(info);
  auto capacity = [&](uint64_t align) {
    return loader::staging_capacity(batch_records, r, align, max_runs, data_bytes);
  };
  const int wanted = opt.variant == LoaderVariant::kSynchronous ? 1 : opt.prefetch;
  const uint64_t budget = opt.staging_bytes;
  const bool mmap_io = opt.io == IoBackend::kMmap;
  // io=mmap reads no staging on CUDA; on the CPU its slots are the batches' buffers (the records, packed).
  auto fits = [&](uint64_t bytes, int slots) { return bytes <= budget / static_cast<uint64_t>(slots); };
  const std::string batch_what = "a batch of " + std::to_string(batch_records) + " records of " + std::to_string(r) +
                                 " bytes (batch_size " + std::to_string(opt.batch_size) + ")";
  slot_capacity = capacity(alignment);
  if (!mmap_io && !fits(slot_capacity, wanted) && direct && opt.direct_io == DirectIo::kAuto &&
      fits(capacity(1), wanted)) {
    note("staging", "staging: with O_DIRECT (each run widened to 4 KiB pages) " + std::to_string(wanted) +
                        " slots of " + std::to_string(slot_capacity) + " bytes for " + batch_what +
                        " exceed staging_bytes = " + std::to_string(budget) + "; reading through the page cache");
    opt.direct_io = DirectIo::kOff;
    direct = false;
    alignment = 1;
    slot_capacity = capacity(1);
  }
  slot_count = wanted;
  if (!fits(slot_capacity, slot_count)) {
    if (!fits(slot_capacity, 1))
      throw Error(Status::kInvalidArgument,
                  "batch_size: " + batch_what + " needs " + std::to_string(slot_capacity) + " bytes of staging" +
                      (direct ? " (O_DIRECT widens each run to 4 KiB pages)" : "") + ", more than staging_bytes = " +
                      std::to_string(budget) + ": lower batch_size or raise staging_bytes");
    slot_count = static_cast<int>(std::min<uint64_t>(static_cast<uint64_t>(wanted), budget / slot_capacity));
    note("staging", "staging: " + std::to_string(wanted) + " slots of " + std::to_string(slot_capacity) +
                        " bytes for " + batch_what + " exceed staging_bytes = " + std::to_string(budget) +
                        "; prefetching " + std::to_string(slot_count) + " batches instead of " +
                        std::to_string(wanted));
  }
}

// io=mmap: maps every shard; on CUDA also registers the mappings (read-only, pinned) so that
// cudaMemcpyAsync reads the page cache by DMA. False, with a note, when either step fails: the
// loader then reads with pread.
bool Loader::Impl::map_files() {
  std::string why_not;
  for (size_t i = 0; i < info.shards.size() && why_not.empty(); ++i) {
    // The mapping outlives the descriptor: the cache may close it afterwards.
    const int fd = files->acquire(static_cast<uint32_t>(i));
    if (fd < 0) {
      if (fd == -ENOENT)
        loader::throw_dataset_error(info.shards[i].file, "missing (removed after the dataset was opened?)");
      loader::throw_os_error(info.shards[i].file, "open", -fd);
    }
    void* p = ::mmap(nullptr, info.shards[i].file_bytes, PROT_READ, MAP_SHARED, fd, 0);
    const int err = errno;
    files->release(static_cast<uint32_t>(i));
    if (p == MAP_FAILED) why_not = info.shards[i].file + ": mmap failed: " + std::strerror(err);
    else maps.push_back(static_cast<uint8_t*>(p));
  }
#if OPTIMIZED_WITH_CUDA
  if (why_not.empty() && cuda) {
    DeviceGuard guard(cuda->device);
    size_t done = 0;
    for (; done < maps.size(); ++done) {
      // Pins the file's page-cache pages (reading them in if they are not cached yet).
      const cudaError_t e = cudaHostRegister(maps[done], info.shards[done].file_bytes, cudaHostRegisterReadOnly);
      if (e != cudaSuccess) {
        cudaGetLastError();
        why_not = info.shards[done].file + ": cudaHostRegister(read-only) of the mapping failed: " +
                  cudaGetErrorString(e);
        break;
      }
    }
    if (!why_not.empty())
      for (size_t i = 0; i < done; ++i) cudaHostUnregister(maps[i]);
    else
      registered = true;
  }
#endif
  if (why_not.empty()) return true;
  for (size_t i = 0; i < maps.size(); ++i) ::munmap(maps[i], info.shards[i].file_bytes);
  maps.clear();
  note("mmap", "io=mmap unavailable (" + why_not + "); reading with a pool of " + std::to_string(pool->size()) +
                   " pread threads");
  return false;
}

// queue_depth = 0 / chunk_bytes = 0: from the block device under the dataset (auto_config.h says how),
// once O_DIRECT is decided.
void Loader::Impl::resolve_reads() {
  if (opt.queue_depth != 0 && opt.chunk_bytes != 0) return;
  const loader::ReadDefaults d = loader::default_reads(loader::block_queue_of(info.shards.front().file), direct);
  if (opt.queue_depth == 0) opt.queue_depth = d.queue_depth;
  if (opt.chunk_bytes == 0) opt.chunk_bytes = d.chunk_bytes;
  reads_reason = d.why;
}

std::string Loader::Impl::reads_note() const {
  std::string s = "loader reads: " + backend + (direct ? " with O_DIRECT" : " through the page cache") + ", ";
  if (backend == "io_uring") s += std::to_string(opt.queue_depth) + " reads in flight";
  else s += std::to_string(pool ? pool->size() : 0) + " threads";
  s += " of up to " + std::to_string(opt.chunk_bytes >> 10) + " KiB";
  if (direct) s += ", ranges under " + std::to_string(loader::kCoalesceGapBytes >> 10) + " KiB apart coalesced";
  if (!reads_reason.empty()) s += " (automatic: " + reads_reason + ")";
  if (backend == "io_uring")
    s += fixed_buffers ? "; staging registered as io_uring fixed buffers (read_fixed)"
                       : "; staging not registered (" + fixed_why_not + ")";
  return s;
}

// The staging slots as io_uring fixed buffers (see io_engine.h), slot i at index i. The CPU device
// hands a slot's buffer out with its batch; deliver() then registers the slot's new buffer in place.
void Loader::Impl::register_staging() {
  if (backend != "io_uring" || slots.empty()) return;
  if (loader::fixed_buffers_env() == "off") {
    fixed_why_not = "OPTIMIZED_LOADER_FIXED_BUFFERS=off";
    return;
  }
  std::vector<std::pair<void*, uint64_t>> buffers;
  for (const Slot& s : slots) {
    if (!s.host) {
      fixed_why_not = "no host staging";
      return;
    }
    buffers.emplace_back(s.host, slot_capacity);
  }
#if OPTIMIZED_WITH_CUDA
  if (cuda && !std::all_of(slots.begin(), slots.end(), [](const Slot& s) { return s.host_mapped; })) {
    fixed_why_not = fixed_why_not.empty() ? "the staging is cudaHostAlloc memory" : fixed_why_not;
    note("fixed_buffers", "io_uring fixed buffers unavailable (" + fixed_why_not + "); plain reads");
    return;
  }
#endif
  std::string why_not;
  fixed_buffers = engine->register_buffers(buffers, why_not);
  if (!fixed_buffers) {
    fixed_why_not = why_not;
    if (why_not != "OPTIMIZED_LOADER_FIXED_BUFFERS=off")
      note("fixed_buffers", "io_uring fixed buffers unavailable (" + why_not + "); plain reads");
  }
}

void Loader::Impl::choose_engine() {
  const bool cuda_device = opt.device.is_cuda();
  // GPUDirect Storage: reads straight into GPU memory, where the system has it. cuFile handles need
  // every shard open for the loader's life, so only datasets within the descriptor budget take it.
  // (io=mmap, asked for or picked by choose_io, reads the page cache itself: GDS only when forced on)
  if (cuda_device && (opt.gds == GdsMode::kOn || (opt.gds == GdsMode::kAuto && opt.io != IoBackend::kMmap))) {
    std::string why_not;
    if (info.shards.size() > files->capacity()) {
      why_not = std::to_string(info.shards.size()) + " shards, more than the " + std::to_string(files->capacity()) +
                " descriptors the loader keeps open (a quarter of RLIMIT_NOFILE)";
    } else {
      cufile = loader::CuFile::open(opt.gds == GdsMode::kAuto, why_not);
    }
    if (cufile) {
      for (size_t i = 0; i < info.shards.size() && why_not.empty(); ++i) {
        const int fd = files->acquire(static_cast<uint32_t>(i));  // pinned until shutdown()
        if (fd < 0) {
          why_not = info.shards[i].file + ": open failed: " + std::strerror(-fd);
          break;
        }
        void* h = cufile->register_file(fd, why_not);
        if (h) cufile_handles.push_back(h);
        else why_not = info.shards[i].file + ": " + why_not;
        if (!h) files->release(static_cast<uint32_t>(i));
      }
      if (!why_not.empty()) {
        for (size_t i = 0; i < cufile_handles.size(); ++i) {
          cufile->deregister_file(cufile_handles[i]);
          files->release(static_cast<uint32_t>(i));
        }
        cufile_handles.clear();
      }
    }
    if (!cufile || !why_not.empty()) {
      if (opt.gds == GdsMode::kOn)
        throw Error(Status::kUnsupported, "gds=on: GPUDirect Storage unavailable: " + why_not);
      note("gds", "GPUDirect Storage unavailable (" + why_not + "); reading through pinned host buffers");
    } else {
      use_gds = true;
    }
  }
  if (use_gds) {
    engine = loader::make_cufile_engine(*cufile, *pool, cufile_handles,
                                        [this](const loader::IoRequest& r, int64_t n) { on_read(r, n); });
    backend = "cufile";
    return;
  }
  if (opt.io == IoBackend::kMmap) {
    if (map_files()) {
      backend = "mmap";
      engine =
          loader::make_pread_engine(*pool, *files, [this](const loader::IoRequest& r, int64_t n) { on_read(r, n); });
      return;  // (the pread engine stays idle: nothing is read)
    }
  }
  // io_uring keeps many O_DIRECT reads in flight from one thread. For buffered reads of cached data
  // it copies from the page cache inline on that one thread, which caps it near one core's memcpy;
  // the pread pool spreads those copies over all its threads, so kAuto picks it there.
  const bool want_uring = opt.io == IoBackend::kIoUring || (opt.io == IoBackend::kAuto && direct);
  if (want_uring) {
    std::string why_not;
    engine = loader::make_uring_engine(*files, opt.queue_depth,
                                       [this](const loader::IoRequest& r, int64_t n) { on_read(r, n); }, why_not);
    if (engine) {
      backend = "io_uring";
      return;
    }
    note("io_uring", "io_uring unavailable (" + why_not + "); reading with a pool of " +
                         std::to_string(pool->size()) + " pread threads");
  }
  engine = loader::make_pread_engine(*pool, *files, [this](const loader::IoRequest& r, int64_t n) { on_read(r, n); });
  backend = "pread";
}

void Loader::Impl::allocate_slots() {
  const uint64_t b = batch_records;
  const std::string what = std::to_string(b) + " records of " + std::to_string(info.record_bytes) +
                           " bytes (batch_size " + std::to_string(opt.batch_size) + ")";
  slots.resize(slot_count);
  for (Slot& s : slots) {
#if OPTIMIZED_WITH_CUDA
    if (cuda) {
      DeviceGuard guard(cuda->device);
      check_cuda(cudaEventCreateWithFlags(&s.copied, cudaEventDisableTiming), "loader: cudaEventCreate");
      if (!maps.empty()) continue;  // io=mmap: the copies read the registered page cache, no staging
      // Pinned (page-locked) staging: the DMA engine reads it directly at full PCIe speed; pageable
      // memory would be staged through the driver's own pinned buffers at a fraction of it.
      s.max_pieces = slot_capacity / loader::kGatherPieceBytes + b + 1;
      void* p = nullptr;
      // With io_uring the staging is anonymous memory pinned by cudaHostRegister, which io_uring can
      // also register as fixed buffers (it refuses device-file mappings like cudaHostAlloc's). The
      // copy engine reads both at the same speed. Where either step fails: cudaHostAlloc, plain reads.
      if (backend == "io_uring" && loader::fixed_buffers_env() != "off") {
        const uint64_t bytes = align_up(std::max<uint64_t>(slot_capacity, 1), kAlign);
        void* m = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
        if (m == MAP_FAILED) {
          fixed_why_not = std::string("mmap of the staging failed: ") + std::strerror(errno);
        } else {
          const cudaError_t e = cudaHostRegister(m, bytes, cudaHostRegisterDefault);
          if (e == cudaSuccess) {
            s.host = static_cast<uint8_t*>(m);
            s.host_mapped = true;
          } else {
            cudaGetLastError();
            ::munmap(m, bytes);
            fixed_why_not = std::string("cudaHostRegister of the staging failed: ") + cudaGetErrorString(e);
          }
        }
      }
      if (!s.host) {
        check_cuda(cudaHostAlloc(&p, std::max<uint64_t>(slot_capacity, 1), cudaHostAllocDefault),
                   "loader: cudaHostAlloc of " + std::to_string(slot_capacity) + " staging bytes for " + what);
        s.host = static_cast<uint8_t*>(p);
      }
      check_cuda(cudaHostAlloc(&p, s.max_pieces * sizeof(loader::Placement), cudaHostAllocDefault),
                 "loader: cudaHostAlloc of the gather table");
      s.pieces = static_cast<loader::Placement*>(p);
      if (use_gds) {
        check_cuda(cudaMalloc(&p, std::max<uint64_t>(slot_capacity, 1)),
                   "loader: cudaMalloc of " + std::to_string(slot_capacity) + " GDS staging bytes for " + what);
        s.device = static_cast<uint8_t*>(p);
        cufile->register_buffer(s.device, slot_capacity);  // optional: unregistered buffers work, slower
      }
      continue;
    }
#endif
    if (!host_pool)
      host_pool = std::make_shared<HostPool>(slot_capacity, static_cast<size_t>(slot_count) + 4, "a batch of " + what);
    if (maps.empty()) s.host = host_pool->get();  // io=mmap: no staging; batches are packed from the maps
  }
}

std::unique_ptr<Loader::Impl> Loader::Impl::build(const std::string& dir, const LoaderOptions& o) {
  auto bad = [](const std::string& what) { throw Error(Status::kInvalidArgument, what); };
  if (o.batch_size < 1) bad("batch_size: expected >= 1; given " + std::to_string(o.batch_size));
  if (o.world_size < 1) bad("world_size: expected >= 1; given " + std::to_string(o.world_size));
  if (o.rank < 0 || o.rank >= o.world_size)
    bad("rank: expected in [0, " + std::to_string(o.world_size) + "); given " + std::to_string(o.rank));
  if (o.num_workers < 1) bad("num_workers: expected >= 1; given " + std::to_string(o.num_workers));
  if (o.worker < 0 || o.worker >= o.num_workers)
    bad("worker: expected in [0, " + std::to_string(o.num_workers) + "); given " + std::to_string(o.worker));
  if (o.prefetch < 1) bad("prefetch: expected >= 1; given " + std::to_string(o.prefetch));
  if (o.threads < 0) bad("threads: expected >= 0 (0: automatic); given " + std::to_string(o.threads));
  if (o.queue_depth < 0 || o.queue_depth > 4096)
    bad("queue_depth: expected in [1, 4096], or 0 (automatic); given " + std::to_string(o.queue_depth));
  if (o.chunk_bytes != 0 &&
      (o.chunk_bytes < kAlign || o.chunk_bytes % kAlign != 0 || o.chunk_bytes > (uint64_t{1} << 30)))
    bad("chunk_bytes: expected a multiple of 4096 in [4096, 2^30], or 0 (automatic); given " +
        std::to_string(o.chunk_bytes));
  if (o.staging_bytes < 1) bad("staging_bytes: expected >= 1; given 0");
  if (o.device.is_cuda()) {
    if (!built_with_cuda())
      throw Error(Status::kUnsupported, "device: cuda needs a CUDA build; this build is CPU-only");
    const int n = cuda_device_count();
    if (o.device.index < 0 || o.device.index >= n)
      throw Error(Status::kInvalidArgument, "device: expected a CUDA device in [0, " + std::to_string(n) + "); given " +
                                                device_name(o.device) +
                                                (n == 0 ? " (" + cuda_unavailable_reason() + ")" : ""));
  }

  auto impl = std::make_unique<Impl>(dir, o);
  Impl& m = *impl;
  if (o.start.batch > m.order.batches)
    bad("start: batch " + std::to_string(o.start.batch) + " is past the epoch's " +
        std::to_string(m.order.batches) + " batches");
  if (o.verify) {
    m.tables.reserve(m.info.shards.size());
    for (const ShardInfo& s : m.info.shards) m.tables.push_back(loader::read_checksum_table(s));
  }
  m.choose_io();
  m.choose_direct();
  m.plan_staging();
  m.resolve_reads();
  std::vector<std::string> names;
  names.reserve(m.info.shards.size());
  for (const ShardInfo& s : m.info.shards) names.push_back(s.file);
  m.files = std::make_unique<loader::FdCache>(std::move(names), O_RDONLY | O_CLOEXEC | (m.direct ? O_DIRECT : 0),
                                              loader::descriptor_budget(m.info.shards.size()));
  int threads = o.threads;
  if (threads == 0) threads = loader::default_threads(std::thread::hardware_concurrency());
  m.pool = std::make_unique<loader::WorkerPool>(threads);
#if OPTIMIZED_WITH_CUDA
  if (o.device.is_cuda()) {
    const bool maybe_gds = o.gds != GdsMode::kOff;
    m.cuda = std::make_shared<CudaContext>(o.device.index, maybe_gds && o.verify);
  }
#endif
  m.choose_engine();
  if (o.io == IoBackend::kAuto || o.threads == 0)
    m.note("auto", "loader: io=" + m.backend + (m.direct ? " (O_DIRECT)" : "") +
                       (m.io_reason.empty() ? "" : ": " + m.io_reason) + "; " + std::to_string(threads) +
                       " worker threads" +
                       (o.threads == 0 ? " (of " + std::to_string(std::thread::hardware_concurrency()) +
                                             " hardware threads)"
                                       : ""));
  m.allocate_slots();
  m.register_staging();
  if (m.backend == "io_uring" || m.backend == "pread") m.note("reads", m.reads_note());
  m.restart_at(o.start);
  return impl;
}

Loader::Loader(const std::string& dir, const LoaderOptions& options) {
  impl_ = Impl::build(dir, options);
  impl_->start_producer();
}

Loader::~Loader() {
  if (impl_ && impl_->pid != ::getpid()) {
    // A forked child's copy of a loader it never used: the parent's threads are not here to join.
    impl_->abandon_after_fork();
    (void)impl_.release();
    return;
  }
  try {
    stop();
  } catch (...) {  // a destructor cannot report
  }
}

Loader::Impl& Loader::live() const {
  Impl& m = *impl_;
  if (m.pid == ::getpid()) return m;
  // This process is a fork of the one that made the pipeline: its threads are not here, its locks may
  // be held forever, its io_uring ring is the parent's. Give all of it up (leaked: nothing of it can
  // be run or joined here) and, on the CPU, build a fresh one that continues where the loader was.
  const pid_t parent = m.pid;
  m.abandon_after_fork();
  if (m.given.device.is_cuda())
    throw Error(Status::kUnsupported,
                "Loader: this loader delivers to " + device_name(m.given.device) + " and was created in process " +
                    std::to_string(parent) + "; process " + std::to_string(::getpid()) +
                    " is a fork of it, and CUDA cannot be used in a forked child. Create the loader in the "
                    "process that uses it (in the child's function, or in a torch DataLoader worker: in the "
                    "dataset's __iter__ or worker_init_fn), or start the child with the \"spawn\" or "
                    "\"forkserver\" method (multiprocessing.get_context(\"spawn\"), or DataLoader("
                    "multiprocessing_context=\"spawn\"))");
  // Only the consumer changes these, and the consumer is the thread that forked (one consumer at a
  // time): they are as the parent left them.
  const LoaderPosition phase = m.phase, position = m.position;
  const uint64_t consumer_seq = m.consumer_seq;
  const bool stopped = m.stopped;
  LoaderOptions o = m.given;
  o.start = phase;
  std::unique_ptr<Impl> fresh = Impl::build(m.info.path, o);
  (void)impl_.release();  // the parent's pipeline: leaked in this process
  impl_ = std::move(fresh);
  Impl& n = *impl_;
  n.position = position;
  n.consumer_seq = n.requested = consumer_seq;
  if (stopped) n.shutdown();
  else n.start_producer();
  return n;
}

void Loader::Impl::start_producer() {
  producer_stop = false;
  const uint64_t first = consumer_seq;
  producer = std::thread([this, first] { produce(first); });
}

// Stops the producer and waits for every job in flight to drain; drops batches not yet taken.
void Loader::Impl::quiesce() {
  {
    std::lock_guard<std::mutex> lock(mutex);
    producer_stop = true;
    aborting = true;
  }
  cv.notify_all();
  if (producer.joinable()) producer.join();
  std::map<uint64_t, Ready> dropped;
  {
    std::unique_lock<std::mutex> lock(mutex);
    cv.wait(lock, [&] { return active.empty(); });
    dropped.swap(ready);
    aborting = false;
  }
  // `dropped` frees its batches here, outside the lock.
}

void Loader::Impl::shutdown() {
  if (stopped) return;
  quiesce();
  {
    std::lock_guard<std::mutex> lock(mutex);
    stopped = true;
  }
  cv.notify_all();
  engine.reset();  // before the pool its pread/cufile requests ran on
  pool.reset();
  for (size_t i = 0; i < cufile_handles.size(); ++i) {
    cufile->deregister_file(cufile_handles[i]);
    files->release(static_cast<uint32_t>(i));
  }
  cufile_handles.clear();
  files.reset();  // closes the descriptors
#if OPTIMIZED_WITH_CUDA
  if (cuda) {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(cuda->device);
    cudaStreamSynchronize(cuda->stream);  // every copy out of the slots is done
    for (Slot& s : slots) {
      if (s.copied) cudaEventDestroy(s.copied);
      if (s.host && s.host_mapped) {
        cudaHostUnregister(s.host);
        ::munmap(s.host, align_up(std::max<uint64_t>(slot_capacity, 1), kAlign));
      } else if (s.host) {
        cudaFreeHost(s.host);
      }
      if (s.pieces) cudaFreeHost(s.pieces);
      if (s.device) {
        cufile->deregister_buffer(s.device);
        cudaFree(s.device);
      }
    }
    if (registered)
      for (uint8_t* m : maps) cudaHostUnregister(m);
    registered = false;
    cudaGetLastError();
    cudaSetDevice(previous);
    slots.clear();
    cuda.reset();  // the context lives on while handed-out batches hold it
  }
#endif
  for (size_t i = 0; i < maps.size(); ++i) ::munmap(maps[i], info.shards[i].file_bytes);
  maps.clear();
  for (Slot& s : slots)
    if (host_pool) host_pool->put(s.host);
  slots.clear();
  host_pool.reset();  // lives on while handed-out batches hold it
}

// In the child of a fork: closes what the kernel holds for this pipeline (descriptors, the io_uring
// ring, the mappings), touching no lock, no thread and no CUDA state. The rest is leaked.
void Loader::Impl::abandon_after_fork() {
  if (abandoned) return;
  abandoned = true;
  if (engine) engine->abandon_after_fork();
  if (files) files->close_all_after_fork();
  if (!registered) {  // (registered mappings belong to the CUDA context: left alone)
    for (size_t i = 0; i < maps.size(); ++i) ::munmap(maps[i], info.shards[i].file_bytes);
    maps.clear();
  }
}

// ---- producer ---------------------------------------------------------------------------------

int Loader::Impl::acquire_slot() {
  std::unique_lock<std::mutex> lock(mutex);
  for (;;) {
    if (producer_stop) return -1;
    int copying = -1;
    for (size_t i = 0; i < slots.size(); ++i) {
      if (slots[i].state == Slot::State::kFree) {
        slots[i].state = Slot::State::kBusy;
        return static_cast<int>(i);
      }
      if (slots[i].state == Slot::State::kCopying && copying < 0) copying = static_cast<int>(i);
    }
    if (copying >= 0) {
#if OPTIMIZED_WITH_CUDA
      // Its copy was issued; wait for the DMA to finish reading it (outside the lock).
      slots[copying].state = Slot::State::kBusy;
      lock.unlock();
      DeviceGuard guard(cuda->device);
      check_cuda(cudaEventSynchronize(slots[copying].copied), "loader: cudaEventSynchronize (staging slot)");
      return copying;
#endif
    }
    cv.wait(lock);
  }
}

void Loader::Impl::produce(uint64_t seq) {
  const bool sync = opt.variant == LoaderVariant::kSynchronous;
  const uint64_t depth = sync ? 1 : static_cast<uint64_t>(slot_count);
  for (;; ++seq) {
    {
      std::unique_lock<std::mutex> lock(mutex);
      cv.wait(lock, [&] { return producer_stop || (seq < consumer_seq + depth && (!sync || seq < requested)); });
      if (producer_stop || seq >= limit()) return;
    }
    std::shared_ptr<Job> job;
    try {
      const int slot = acquire_slot();
      if (slot < 0) return;
      job = std::make_shared<Job>();
      job->seq = seq;
      job->position = position_of(seq);
      job->slot = slot;
      order.batch_records(job->position.epoch, job->position.batch, job->ids);
      loader::plan_batch(info, job->ids, alignment, opt.chunk_bytes, job->plan, direct ? loader::kCoalesceGapBytes : 0,
                         slot_capacity);
      {
        std::lock_guard<std::mutex> lock(mutex);
        active[seq] = job;
      }
      Slot& s = slots[slot];
      uint8_t* base = use_gds ? s.device : s.host;
      std::vector<loader::IoRequest> requests;
      requests.reserve(job->plan.chunks.size());
      for (const loader::ReadChunk& c : job->plan.chunks)
        requests.push_back({c.shard, c.file_offset, c.bytes, base, c.staging_offset, job.get()});
      if (!maps.empty()) {
        // io=mmap: the records are in the mapped page cache already, if the files are still whole.
        if (check_mapped_sizes(job.get())) read_bytes += job->ids.size() * info.record_bytes;
        after_reads(job.get());
        continue;
      }
      job->pending = static_cast<int64_t>(requests.size());
      engine->submit(requests.data(), requests.size());
    } catch (const Error& e) {
      // Becomes this batch's error; nothing after it is produced.
      std::lock_guard<std::mutex> lock(mutex);
      Ready r;
      r.failed = true;
      r.status = e.status();
      r.error = e.what();
      if (job) {
        active.erase(seq);
        if (job->slot >= 0) slots[job->slot].state = Slot::State::kFree;
      }
      if (!aborting) ready[seq] = std::move(r);
      cv.notify_all();
      return;
    }
  }
}

// io=mmap: a page past the end of a file that shrank after it was mapped raises SIGBUS when
// touched. Before a batch touches its shards' pages, checks (fstat) that each is still as long as
// mapped; a shorter one fails the batch as a short read does with pread. (A truncation after this
// check is caught by the SIGBUS guard around the reads.)
bool Loader::Impl::check_mapped_sizes(Job* job) {
  std::vector<uint32_t> shards(job->plan.run_shard);
  std::sort(shards.begin(), shards.end());
  shards.erase(std::unique(shards.begin(), shards.end()), shards.end());
  for (uint32_t i : shards) {
    const ShardInfo& shard = info.shards[i];
    const int fd = files->acquire(i);
    struct stat st{};
    const int rc = fd < 0 ? -1 : ::fstat(fd, &st);
    const int err = fd < 0 ? -fd : errno;
    if (fd >= 0) files->release(i);
    if (rc != 0) {
      job->fail(err == ENOENT ? Status::kInvalidArgument : Status::kInternal,
                shard.file + ": " + (err == ENOENT ? std::string("missing (removed after the dataset was opened?)")
                                                   : "fstat failed: " + std::string(std::strerror(err))));
      return false;
    }
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    if (size < shard.file_bytes) {
      const uint64_t cut = (size - std::min(size, shard.data_offset)) / info.record_bytes;
      job->fail(Status::kInvalidArgument,
                loader::record_location(shard, std::min(cut, shard.record_count - 1), info.record_bytes) +
                    ": truncated: the file is now " + std::to_string(size) + " bytes; " +
                    std::to_string(shard.file_bytes) + " were mapped (the file shrank after it was opened?)");
      return false;
    }
  }
  return true;
}

// ---- reads, checks, delivery (engine and pool threads) ---------------------------------------

void Loader::Impl::on_read(const loader::IoRequest& req, int64_t result) {
  Job* job = static_cast<Job*>(req.tag);
  const ShardInfo& shard = info.shards[req.file];
  auto range = [&] {
    return "bytes " + std::to_string(req.offset) + ".." + std::to_string(req.offset + req.bytes);
  };
  // The record at file offset `at`, to name in the message.
  auto record_at = [&](uint64_t offset) {
    const uint64_t at = std::max(offset, shard.data_offset) - shard.data_offset;
    return loader::record_location(shard, std::min(at / info.record_bytes, shard.record_count - 1), info.record_bytes);
  };
  auto first_record = [&] { return record_at(req.offset); };
  if (result == -ENOENT) {
    job->fail(Status::kInvalidArgument, shard.file + ": missing (removed after the dataset was opened?)");
  } else if (result < 0) {
    const int err = static_cast<int>(-result);
    std::string hint;
    if (err == EINVAL && direct) hint = " (O_DIRECT: try direct_io=off)";
    if (err == EMFILE || err == ENFILE) {
      rlimit rl{};
      ::getrlimit(RLIMIT_NOFILE, &rl);
      hint = " (opening the shard: the process has no descriptor left; RLIMIT_NOFILE is " +
             (rl.rlim_cur == RLIM_INFINITY ? std::string("unlimited") : std::to_string(rl.rlim_cur)) + ")";
    }
    job->fail(Status::kInternal, first_record() + ": read of " + range() + " failed: " + std::strerror(err) + hint);
  } else if (static_cast<uint64_t>(result) < req.bytes) {
    // Named: the first record the read did not get whole.
    job->fail(Status::kInvalidArgument, record_at(req.offset + static_cast<uint64_t>(result)) +
                                            ": truncated: reading " + range() + " returned " + std::to_string(result) +
                                            " bytes (the file shrank after it was opened?)");
  }
  if (result > 0) read_bytes += static_cast<uint64_t>(result);
  if (--job->pending == 0) after_reads(job);
}

void Loader::Impl::after_reads(Job* job) {
  bool abort;
  {
    std::lock_guard<std::mutex> lock(mutex);
    abort = aborting;
  }
  if (job->failed || abort || !opt.verify) {
    // Delivery (a memcpy on the CPU, copies on CUDA) runs on the pool, never on the io_uring thread.
    pool->post([this, job] { finish(job); });
    return;
  }
  const Slot& s = slots[job->slot];
#if OPTIMIZED_WITH_CUDA
  if (use_gds) {
    // GPUDirect put the bytes in GPU memory; the checksums are computed on the host copy.
    try {
      DeviceGuard guard(cuda->device);
      check_cuda(cudaMemcpyAsync(s.host, s.device, job->plan.staging_bytes, cudaMemcpyDeviceToHost, cuda->readback),
                 "loader: GDS readback");
      check_cuda(cudaStreamSynchronize(cuda->readback), "loader: GDS readback");
    } catch (const Error& e) {
      job->fail(e.status(), e.what());
      pool->post([this, job] { finish(job); });
      return;
    }
  }
#endif
  (void)s;
  // Split the records into tasks of about 4 MiB for the pool.
  const size_t n = job->ids.size();
  const size_t per_task = std::max<size_t>(1, (4u << 20) / info.record_bytes);
  const size_t tasks = (n + per_task - 1) / per_task;
  job->pending = static_cast<int64_t>(tasks);
  for (size_t t = 0; t < tasks; ++t) {
    const size_t first = t * per_task, last = std::min(n, first + per_task);
    pool->post([this, job, first, last] {
      verify_range(job, first, last);
      if (--job->pending == 0) finish(job);
    });
  }
}

void Loader::Impl::verify_range(Job* job, size_t first, size_t last) {
  const uint8_t* staging = slots[job->slot].host;
  const uint64_t r = info.record_bytes;
  auto check = [&](size_t k, uint32_t found) {
    const uint32_t shard = job->plan.record_shard[k];
    const ShardInfo& s = info.shards[shard];
    const uint64_t local = job->ids[k] - s.first_record;
    const uint32_t expected = tables[shard][local];
    if (found != expected)
      job->fail(Status::kInvalidArgument, loader::record_location(s, local, r) +
                                              ": checksum mismatch: expected crc32c " + loader::hex32(expected) +
                                              "; found " + loader::hex32(found) + " (the record is corrupted)");
  };
  if (maps.empty()) {
    for (size_t k = first; k < last && !job->failed; ++k)
      check(k, loader::crc32c(staging + job->plan.record_src[k], r));
    return;
  }
  // io=mmap: the checksums of up to kBlock records under the SIGBUS guard (no lock or allocation may
  // happen inside it), then their comparisons.
  constexpr size_t kBlock = 256;
  uint32_t found[kBlock];
  for (size_t block = first; block < last && !job->failed; block += kBlock) {
    const size_t end = std::min(last, block + kBlock);
    volatile size_t at = block;  // the record being read when a SIGBUS came
    const bool whole = loader::guarded([&] {
      for (size_t k = block; k < end; ++k) {
        at = k;
        const uint32_t shard = job->plan.record_shard[k];
        const ShardInfo& s = info.shards[shard];
        found[k - block] = loader::crc32c(maps[shard] + s.data_offset + (job->ids[k] - s.first_record) * r, r);
      }
    });
    if (!whole) {
      const ShardInfo& s = info.shards[job->plan.record_shard[at]];
      job->fail(Status::kInvalidArgument,
                loader::record_location(s, job->ids[at] - s.first_record, r) +
                    ": truncated: reading the mapped file raised SIGBUS (the file shrank after it was opened?)");
      return;
    }
    for (size_t k = block; k < end; ++k) check(k, found[k - block]);
  }
}

Batch Loader::Impl::deliver(Job* job) {
  Slot& s = slots[job->slot];
  const loader::ReadPlan& plan = job->plan;
  const uint64_t bytes = job->ids.size() * info.record_bytes;
  Batch b;
  b.indices_ = job->ids;
  b.bytes_ = bytes;
  b.device_ = opt.device;
  b.position_ = job->position;
#if OPTIMIZED_WITH_CUDA
  if (cuda) {
    DeviceGuard guard(cuda->device);
    std::lock_guard<std::mutex> copy_lock(copy_mutex);
    auto memory = std::make_shared<DeviceBatchMemory>(cuda, bytes);
    uint8_t* out = static_cast<uint8_t*>(memory->data());
    cudaStream_t stream = cuda->stream;
    const cudaMemcpyKind kind = use_gds ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice;
    const uint8_t* staging = use_gds ? s.device : s.host;
    if (!maps.empty()) {
      // io=mmap: the runs straight from the registered page cache, in one batched DMA call. One
      // cudaMemcpyAsync per run cost about as much again as each 150 KB copy: shuffled batches ran at
      // 0.41x of the link (22 GB/s); batched, 47 GB/s, level with sequential (H100, page cache;
      // docs/perf-notes/loader.md). (A gather kernel reading the mappings over PCIe managed 22 GB/s too
      // beside a GEMM stream, whose SMs it took: 414 TFLOP/s left of 640.)
      const size_t n = plan.placements.size();
      std::vector<void*> dsts(n);
      std::vector<const void*> srcs(n);
      std::vector<size_t> sizes(n);
      for (size_t i = 0; i < n; ++i) {
        dsts[i] = out + plan.placements[i].dst;
        srcs[i] = maps[plan.run_shard[i]] + plan.run_offset[i];
        sizes[i] = plan.placements[i].bytes;
      }
      cudaMemcpyAttributes attr{};
      attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
      size_t first = 0;
      if (n > 0)
        check_cuda(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), n, &attr, &first, 1, stream),
                   "loader: cudaMemcpyBatchAsync (mapped runs)");
    } else if (plan.packed) {
      check_cuda(cudaMemcpyAsync(out, staging, bytes, kind, stream), "loader: cudaMemcpyAsync (batch)");
    } else if (plan.placements.size() <= kMaxDirectCopies) {
      for (const loader::Placement& p : plan.placements)
        check_cuda(cudaMemcpyAsync(out + p.dst, staging + p.src, p.bytes, kind, stream), "loader: cudaMemcpyAsync (run)");
    } else {
      // Many runs: one copy of the staging (unless it is on the GPU already) and the gather kernel.
      uint64_t pieces = 0;
      for (const loader::Placement& p : plan.placements)
        for (uint64_t o = 0; o < p.bytes; o += loader::kGatherPieceBytes)
          s.pieces[pieces++] = {p.src + o, p.dst + o, std::min(loader::kGatherPieceBytes, p.bytes - o)};
      const uint64_t data_bytes = use_gds ? 0 : align_up(plan.staging_bytes, 256);
      const uint64_t table_bytes = pieces * sizeof(loader::Placement);
      void* scratch = nullptr;
      check_cuda(cudaMallocFromPoolAsync(&scratch, data_bytes + table_bytes, cuda->pool, stream),
                 "loader: cudaMallocFromPoolAsync (gather scratch)");
      uint8_t* scratch8 = static_cast<uint8_t*>(scratch);
      if (!use_gds)
        check_cuda(cudaMemcpyAsync(scratch8, s.host, plan.staging_bytes, cudaMemcpyHostToDevice, stream),
                   "loader: cudaMemcpyAsync (staging)");
      check_cuda(cudaMemcpyAsync(scratch8 + data_bytes, s.pieces, table_bytes, cudaMemcpyHostToDevice, stream),
                 "loader: cudaMemcpyAsync (gather table)");
      check_cuda(loader::launch_gather(use_gds ? s.device : scratch8, out,
                                       reinterpret_cast<const loader::Placement*>(scratch8 + data_bytes),
                                       static_cast<int64_t>(pieces), stream),
                 "loader: gather kernel launch");
      check_cuda(cudaFreeAsync(scratch, stream), "loader: cudaFreeAsync (gather scratch)");
    }
    check_cuda(cudaEventRecord(s.copied, stream), "loader: cudaEventRecord (staging)");
    check_cuda(cudaEventRecord(memory->ready(), stream), "loader: cudaEventRecord (batch)");
    b.ready_event_ = memory->ready();
    b.memory_ = std::move(memory);
    return b;
  }
#endif
  if (!maps.empty()) {  // io=mmap on the CPU: pack the runs from the maps (under the SIGBUS guard)
    uint8_t* out = host_pool->get();
    b.memory_ = std::make_shared<HostBatchMemory>(host_pool, out, 0);
    volatile size_t at = 0;
    const bool whole = loader::guarded([&] {
      for (size_t i = 0; i < plan.placements.size(); ++i) {
        at = i;
        std::memcpy(out + plan.placements[i].dst, maps[plan.run_shard[i]] + plan.run_offset[i],
                    plan.placements[i].bytes);
      }
    });
    if (!whole) {
      const ShardInfo& shard = info.shards[plan.run_shard[at]];
      throw Error(Status::kInvalidArgument,
                  loader::record_location(shard, (plan.run_offset[at] - shard.data_offset) / info.record_bytes,
                                          info.record_bytes) +
                      ": truncated: reading the mapped file raised SIGBUS (the file shrank after it was opened?)");
    }
    return b;
  }
  // CPU: hand out the slot's buffer itself when the batch lies packed in it (one run, or reads
  // that went to their output offsets) and give the slot a new one; else pack into a new buffer.
  if (plan.packed || plan.placements.size() == 1) {
    const uint64_t offset = plan.packed ? 0 : plan.placements[0].src;
    uint8_t* fresh = host_pool->get();
    b.memory_ = std::make_shared<HostBatchMemory>(host_pool, s.host, offset);
    s.host = fresh;
    // (the slot's reads are done and its next ones wait for finish(): nothing is in flight into either)
    if (fixed_buffers) engine->update_buffer(static_cast<unsigned>(job->slot), fresh, slot_capacity);
    return b;
  }
  uint8_t* out = host_pool->get();
  b.memory_ = std::make_shared<HostBatchMemory>(host_pool, out, 0);
  for (const loader::Placement& p : plan.placements) std::memcpy(out + p.dst, s.host + p.src, p.bytes);
  return b;
}

void Loader::Impl::finish(Job* job) {
  bool abort;
  {
    std::lock_guard<std::mutex> lock(mutex);
    abort = aborting;
  }
  Ready r;
  bool copying = false;
  if (!job->failed && !abort) {
    try {
      r.batch = deliver(job);
      copying = r.batch.ready_event() != nullptr;
    } catch (const Error& e) {
      job->fail(e.status(), e.what());
    } catch (const std::exception& e) {
      job->fail(Status::kInternal, std::string("loader: ") + e.what());
    }
  }
  if (job->failed) {
    r.failed = true;
    r.status = job->status;
    r.error = job->error;
  }
  const uint64_t seq = job->seq;
  std::shared_ptr<Job> keep;  // the job dies after the lock is released
  {
    std::lock_guard<std::mutex> lock(mutex);
    slots[job->slot].state = copying ? Slot::State::kCopying : Slot::State::kFree;
    if (!aborting) ready[seq] = std::move(r);
    auto it = active.find(seq);
    if (it != active.end()) {
      keep = std::move(it->second);
      active.erase(it);
    }
  }
  cv.notify_all();
}

// ---- consumer ---------------------------------------------------------------------------------

std::optional<Batch> Loader::next() {
  Impl& m = live();
  Ready r;
  {
    std::unique_lock<std::mutex> lock(m.mutex);
    if (m.stopped) throw Error(Status::kInvalidArgument, "Loader::next: the loader is stopped");
    if (m.failure) throw *m.failure;
    if (m.opt.epochs && m.position.epoch >= m.opt.epochs) return std::nullopt;
    if (m.position.batch >= m.order.batches) {
      m.position = m.epoch_start(m.position.epoch + 1);
      return std::nullopt;
    }
    const uint64_t seq = m.consumer_seq;
    m.requested = std::max(m.requested, seq + 1);
    m.cv.notify_all();
    const auto t0 = std::chrono::steady_clock::now();
    m.cv.wait(lock, [&] { return m.ready.count(seq) != 0 || m.stopped; });
    if (m.stopped) throw Error(Status::kInvalidArgument, "Loader::next: the loader was stopped while waiting");
    m.stats.consumer_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    auto it = m.ready.find(seq);
    r = std::move(it->second);
    m.ready.erase(it);
    m.consumer_seq = seq + 1;
    m.position.batch = std::min(m.position.batch + m.stride, m.order.batches);
    if (r.failed) m.failure = Error(r.status, r.error);
    else {
      ++m.stats.batches;
      m.stats.record_bytes += r.batch.bytes();
    }
  }
  m.cv.notify_all();  // the producer may go on
  if (r.failed) throw Error(r.status, r.error);
  if (m.opt.variant == LoaderVariant::kSynchronous) r.batch.synchronize();
  return std::move(r.batch);
}

void Loader::wait() {
  Impl& m = live();
  {
    std::unique_lock<std::mutex> lock(m.mutex);
    if (m.stopped || m.failure) return;
    if (m.opt.epochs && m.position.epoch >= m.opt.epochs) return;
    if (m.position.batch >= m.order.batches) return;
    const uint64_t seq = m.consumer_seq;
    m.requested = std::max(m.requested, seq + 1);
    m.cv.notify_all();
    const auto t0 = std::chrono::steady_clock::now();
    m.cv.wait(lock, [&] { return m.ready.count(seq) != 0 || m.stopped; });
    m.stats.consumer_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
}

LoaderPosition Loader::position() const {
  Impl& m = live();
  std::lock_guard<std::mutex> lock(m.mutex);
  return m.position;
}

void Loader::seek(LoaderPosition p) {
  Impl& m = live();
  if (m.stopped) throw Error(Status::kInvalidArgument, "Loader::seek: the loader is stopped");
  if (p.batch > m.order.batches)
    throw Error(Status::kInvalidArgument, "position: batch " + std::to_string(p.batch) + " is past the epoch's " +
                                              std::to_string(m.order.batches) + " batches");
  m.quiesce();
  {
    std::lock_guard<std::mutex> lock(m.mutex);
    m.restart_at(p);
    m.failure.reset();
  }
  m.start_producer();
}

void Loader::stop() {
  if (!impl_) return;
  if (impl_->pid != ::getpid()) {
    // A forked child's copy: nothing of the parent's pipeline can be stopped here; give it up.
    impl_->abandon_after_fork();
    impl_->stopped = true;
    return;
  }
  impl_->shutdown();
}

const DatasetInfo& Loader::dataset() const { return impl_->info; }
uint64_t Loader::batches_per_epoch() const {
  const Impl& m = *impl_;
  return m.worker < m.order.batches ? (m.order.batches - m.worker + m.stride - 1) / m.stride : 0;
}
uint64_t Loader::records_per_epoch() const {
  const Impl& m = *impl_;
  if (m.stride == 1) return m.order.count;
  // This worker's batches are full except the epoch's last one, which may be short.
  const uint64_t batches = batches_per_epoch(), b = m.order.batch_size;
  uint64_t records = batches * b;
  if (batches > 0 && (m.order.batches - 1) % m.stride == m.worker) records -= m.order.batches * b - m.order.count;
  return records;
}
uint64_t Loader::staging_bytes() const {
  // io=mmap reads no staging (the batches are copied out of the mappings).
  return impl_->maps.empty() ? impl_->slot_capacity * static_cast<uint64_t>(impl_->slot_count) : 0;
}
int Loader::prefetch() const { return impl_->slot_count; }
std::string Loader::io_backend() const { return impl_->backend; }
bool Loader::direct_io() const { return impl_->direct; }
bool Loader::gds() const { return impl_->use_gds; }
const std::vector<std::string>& Loader::notes() const { return impl_->notes; }

LoaderStats Loader::stats() const {
  Impl& m = live();
  std::lock_guard<std::mutex> lock(m.mutex);
  LoaderStats s = m.stats;
  s.read_bytes = m.read_bytes.load();
  return s;
}

}  // namespace optimized
