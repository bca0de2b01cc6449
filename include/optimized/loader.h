// The streaming loader: a dataset of fixed-size records stored as shard files, the writer that makes
// them, and a loader that streams batches of records from storage into GPU (or host) memory with
// several batches in flight, so that input does not stall training.
//
// The dataset format (docs/perf-notes/loader.md has the byte table): a directory of shard files
// shard-00000.osh, shard-00001.osh, ...; each file is
//   [4096-byte header][records, packed, record_bytes each][zeros to 4 KiB][one CRC32C per record][zeros to 4 KiB]
// The header holds the magic "OPTSHARD", the version, the dataset id shared by all shards, the shard's
// index and the shard count, its first record's index in the dataset, its record count, the record
// dtype and shape, the CRC32C of the checksum table (the shard checksum) and its own CRC32C.
// While a ShardWriter writes a dataset, the directory also holds the marker file
// "shards.incomplete" (kIncompleteMarker); close() removes it last, so a dataset whose writer failed,
// was aborted or died is refused by open_dataset with a message that says so.
//
// The loader (one per process and rank) reads batches with O_DIRECT through io_uring, or through a
// pool of threads calling pread where io_uring is unavailable, into a ring of pinned, 4 KiB-aligned
// host buffers; checks each record's CRC32C; copies the batch to the GPU with cudaMemcpyAsync on its
// own stream; and hands out a Batch: device memory plus an event to wait on. With GPUDirect Storage
// (cuFile) the reads go to GPU memory directly. Torch-free; the torch glue is src/torch/loader_ops.cpp.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <span>
#include <string_view>
#include <vector>

#include "optimized/core.h"

namespace optimized {

// ---- the dataset format ----------------------------------------------------------------------

inline constexpr uint32_t kShardVersion = 1;
inline constexpr uint64_t kShardHeaderBytes = 4096;  // the header, and the alignment of each section
inline constexpr int kShardMaxRank = 8;              // record shapes have at most 8 dimensions

// Element types a shard may hold: "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64",
// "float16", "bfloat16", "float32", "float64". Their size in bytes; throws Error on other names.
size_t shard_dtype_size(std::string_view dtype);

// "shard-00007.osh": the name of shard `index` inside the dataset directory.
std::string shard_file_name(uint32_t index);

// The file a ShardWriter keeps in the dataset directory until close() has finished every shard.
inline constexpr const char* kIncompleteMarker = "shards.incomplete";

struct ShardInfo {
  std::string file;           // full path
  uint32_t index = 0;         // position in the dataset
  uint64_t first_record = 0;  // dataset index of the shard's first record
  uint64_t record_count = 0;
  uint64_t data_offset = 0;   // byte offset of record 0 (kShardHeaderBytes)
  uint64_t table_offset = 0;  // byte offset of the CRC32C table (4 KiB aligned, after the data)
  uint64_t file_bytes = 0;    // exact expected file size
  uint32_t table_crc = 0;     // CRC32C of the table: the shard's checksum
};

struct DatasetInfo {
  std::string path;                   // the directory
  std::string dtype;                  // element type (see shard_dtype_size)
  std::vector<int64_t> record_shape;  // shape of one record, in elements (may be empty: a scalar)
  uint64_t record_bytes = 0;          // bytes per record = dtype size * prod(record_shape)
  uint64_t num_records = 0;
  uint64_t dataset_id = 0;            // random, the same in every shard of one dataset
  std::vector<ShardInfo> shards;      // in index order
};

// Reads and checks every shard's header and size: a missing, extra, truncated or oversized shard,
// a bad magic, version or header checksum, or shards of different datasets throw Error naming the
// file (and the first record that does not fit); so does a directory whose writer did not finish
// (kIncompleteMarker). Does not read the records.
DatasetInfo open_dataset(const std::string& dir);

// What identifies a dataset's contents, for resuming (a saved LoaderPosition means something only
// for the dataset it was saved with): a 64-bit hash of the dtype, the record shape, the shard
// count, and each shard's record count and shard checksum (the CRC32C of its per-record CRC32C
// table, so every record's bytes count). The same for a copy of the files or a byte-identical
// rewrite; different when any record, shard boundary, dtype or shape differs. Reads no records.
uint64_t dataset_fingerprint(const DatasetInfo& info);

// Reads every shard's checksum table and every record, and checks them all (a full scrub). Throws
// Error naming the file and the record at the first mismatch.
void verify_dataset(const std::string& dir);

// Writes records into a new dataset directory, shard by shard. close() finishes the headers and
// then removes the directory's kIncompleteMarker: until then the dataset cannot be opened. A writer
// destroyed without close() finishes it too (but cannot report errors), except while an exception
// is propagating (the writer's scope is left by a throw): then it aborts, leaving the dataset
// incomplete, so that a failure half-way never looks like a valid, shorter dataset.
class ShardWriter {
 public:
  // dir: created if missing; when it already holds shard files, overwrite=false throws and
  // overwrite=true deletes them first. records_per_shard >= 1. Writes kIncompleteMarker.
  ShardWriter(const std::string& dir, std::string_view dtype, std::vector<int64_t> record_shape,
              uint64_t records_per_shard, bool overwrite = false);
  ~ShardWriter();
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  // Appends `count` records, record_bytes() each, packed, from host memory.
  void append(const void* records, uint64_t count);
  // Finishes the last shard and every header (total count, shard count), removes the marker;
  // returns what was written.
  DatasetInfo close();
  // Stops writing and leaves the dataset visibly incomplete: the shards keep their blank headers and
  // the marker stays, now saying "aborted after N records: <why>", which open_dataset reports. No
  // effect after close() or abort(); never throws.
  void abort(const std::string& why = "") noexcept;

  uint64_t record_bytes() const;
  uint64_t records_written() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// ---- the loader ------------------------------------------------------------------------------

// kPipelined reads up to `prefetch` batches ahead of the consumer, overlapping storage, the copy and
// the consumer's compute. kSynchronous reads a batch only when next() asks and returns when it is in
// place: the ladder's first rung, for comparison.
enum class LoaderVariant : uint8_t { kSynchronous, kPipelined };
// kMmap (page cache only): maps the shards and, on CUDA, registers the mappings as pinned read-only
// host memory, so that the copy engine reads the page cache directly with no CPU copy (every run of a
// batch in one batched DMA call, so shuffled batches move as fast as sequential ones); it keeps the whole dataset resident (pinned) while
// the loader lives, so it is for datasets that fit in RAM. kAuto: on CUDA, kMmap when the page cache
// holds >= 90% of the dataset (mincore) and the dataset is at most a quarter of the physical memory
// (unless direct_io or gds is on); otherwise, and on the CPU, io_uring for O_DIRECT, else pread.
// notes() says what was picked and why.
enum class IoBackend : uint8_t { kAuto, kIoUring, kPread, kMmap };
enum class DirectIo : uint8_t { kAuto, kOn, kOff };          // kAuto: O_DIRECT where the filesystem takes it
enum class GdsMode : uint8_t { kAuto, kOn, kOff };           // GPUDirect Storage (cuFile)

std::span<const LoaderVariant> all_loader_variants();   // every variant, in ladder order
std::string_view loader_variant_name(LoaderVariant v);  // "synchronous", "pipelined"
LoaderVariant parse_loader_variant(std::string_view name);
std::string_view io_backend_name(IoBackend b);          // "auto", "io_uring", "pread", "mmap"
IoBackend parse_io_backend(std::string_view name);
DirectIo parse_direct_io(std::string_view name);        // "auto", "on", "off"
GdsMode parse_gds_mode(std::string_view name);          // "auto", "on", "off"

// Where the loader is: the next batch that next() returns is batch `batch` of epoch `epoch`
// (batch == batches_per_epoch(): the next call ends the epoch).
struct LoaderPosition {
  uint64_t epoch = 0;
  uint64_t batch = 0;
  bool operator==(const LoaderPosition&) const = default;
};

struct LoaderOptions {
  int64_t batch_size = 1;          // records per batch
  Device device = Device::cpu();   // where batches are delivered
  bool shuffle = false;            // a permutation of all records per epoch, from (seed, epoch)
  uint64_t seed = 0;
  int rank = 0;                    // data-parallel rank in [0, world_size)
  int world_size = 1;
  // false: every record once per epoch across the ranks; a rank's last batch may be short and ranks
  // may differ by one batch. true: every rank yields floor(num_records / world_size / batch_size) full
  // batches; the rest of the epoch's order (different records each epoch when shuffled) is dropped.
  bool drop_last = false;
  uint64_t epochs = 0;             // 0: no limit
  LoaderPosition start;            // resume here (LoaderPosition returned by position())
  LoaderVariant variant = LoaderVariant::kPipelined;
  int prefetch = 4;                // batches in flight ahead of the consumer (>= 1)
  int threads = 0;                 // worker threads (pread, checksums, packing); 0: 3/4 of the hardware
                                   // threads, 2 to 32 (notes() says how many)
  // io_uring reads in flight and the largest single read (a multiple of 4 KiB). 0 (the default):
  // automatic, from the block device under the dataset (its largest request and queue size) with O_DIRECT:
  // reads of 4 MiB (1 MiB on a device whose requests are under 256 KiB), 128 MiB in flight, 32 to 128
  // reads; through the page cache 32 x 1 MiB (the defaults before). notes() says what was picked, and
  // whether the staging is registered with io_uring (fixed buffers).
  int queue_depth = 0;
  uint64_t chunk_bytes = 0;
  IoBackend io = IoBackend::kAuto;
  DirectIo direct_io = DirectIo::kAuto;
  GdsMode gds = GdsMode::kAuto;
  bool verify = true;              // check every record's CRC32C as it arrives
  // The most host memory the staging ring may hold (pinned on CUDA). Each of the `prefetch` slots
  // holds one batch as read: up to min(batch_size, records this rank reads per epoch) records, plus
  // with O_DIRECT the widening of each run to 4 KiB pages (at most the shards' data). When the slots
  // do not fit, direct_io=auto first reads through the page cache (no widening) if that fits, then
  // fewer slots are used (a shallower prefetch); both are said in notes(). When one slot does not
  // fit, the constructor throws naming batch_size and the bytes.
  uint64_t staging_bytes = uint64_t{1} << 30;
  // Interleaving one loader's batches over several consumers (torch DataLoader workers that inherited
  // a loader): this one yields batches worker, worker + num_workers, ... of each epoch, counted from
  // `start` in the first epoch, so that taking one batch from each consumer in turn gives the
  // sequence of a single loader. Positions stay in the numbering of the whole sequence.
  int worker = 0;                  // in [0, num_workers)
  int num_workers = 1;
};

// The memory of one delivered batch (device or host). Freed when the last owner drops it: on CUDA
// after the copy into it and the work queued on the stream named by release_after() have finished,
// so that a tensor made over it may outlive the Batch and the Loader.
class BatchMemory {
 public:
  virtual ~BatchMemory() = default;
  virtual void* data() const = 0;
  // The memory is reused only after the work queued on `stream` (a cudaStream_t; nullptr: the legacy
  // default stream) up to this call has finished. No effect on the CPU.
  virtual void release_after(void* stream) = 0;
};

class Batch {
 public:
  Batch() = default;
  void* data() const;
  int64_t records() const { return static_cast<int64_t>(indices_.size()); }
  uint64_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  LoaderPosition position() const { return position_; }
  // Dataset index of each record, in batch order.
  const std::vector<uint64_t>& indices() const { return indices_; }
  // The cudaEvent_t recorded after the copy into data() (nullptr on the CPU): wait for it before use.
  void* ready_event() const { return ready_event_; }
  // Makes `stream` (a cudaStream_t; nullptr: the legacy default stream) wait for the copy. CPU: no-op.
  void wait(void* stream) const;
  void synchronize() const;  // the host waits for the copy
  const std::shared_ptr<BatchMemory>& memory() const { return memory_; }

 private:
  friend class Loader;
  std::shared_ptr<BatchMemory> memory_;
  std::vector<uint64_t> indices_;
  uint64_t bytes_ = 0;
  Device device_ = Device::cpu();
  LoaderPosition position_;
  void* ready_event_ = nullptr;  // owned by memory_
};

struct LoaderStats {
  uint64_t batches = 0;        // handed to the consumer
  uint64_t record_bytes = 0;   // record bytes handed to the consumer
  uint64_t read_bytes = 0;     // bytes read from storage (alignment makes it >= record bytes)
  double consumer_wait_s = 0;  // time next() spent waiting for a batch
};

// Processes: a loader used in the child of a fork() (multiprocessing's "fork" start method, torch
// DataLoader workers) notices the new process id at its next call. On the CPU it starts afresh in
// the child (new threads, descriptors and io_uring ring; the parent's are left to the parent) at the
// position it had when the process forked, so the child reads what the parent would have read next.
// A CUDA loader cannot: CUDA does not work in a forked child, and every call throws Error
// (kUnsupported) saying to create the loader in the child or to start the child with "spawn".
class Loader {
 public:
  // Opens the dataset (open_dataset's checks), reads every checksum table (checked against the
  // header) and starts the pipeline; shards are opened as reads need them, through a cache of at
  // most a quarter of RLIMIT_NOFILE descriptors. Throws Error on a bad argument or dataset.
  Loader(const std::string& dir, const LoaderOptions& options);
  ~Loader();  // stop()
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  // The next batch of the current epoch; nullopt once at the end of each epoch (the next call starts
  // the next epoch) and always after the last epoch. Throws Error naming the shard file and record
  // when a read fails or a record's checksum does not match; the loader then keeps throwing until
  // seek(). One consumer thread at a time.
  std::optional<Batch> next();
  // Blocks until next() can return without waiting (a batch is ready, the epoch ends, or an error
  // is pending). For callers that must not block inside next(): Python waits here without the GIL.
  void wait();

  LoaderPosition position() const;  // where next() continues: save it to resume (with dataset_fingerprint)
  void seek(LoaderPosition position);
  // Stops the threads and frees the staging buffers; batches already handed out stay valid. next()
  // throws afterwards. Called by the destructor.
  void stop();

  const DatasetInfo& dataset() const;
  uint64_t batches_per_epoch() const;   // this rank's (this worker's: see LoaderOptions::worker)
  uint64_t records_per_epoch() const;   // this rank's (this worker's)
  uint64_t staging_bytes() const;       // host staging the slots hold (LoaderOptions::staging_bytes); 0 with io=mmap
  int prefetch() const;                 // slots in the staging ring: batches read ahead
  std::string io_backend() const;       // "io_uring", "pread", "mmap" or "cufile"
  bool direct_io() const;               // O_DIRECT in use
  bool gds() const;                     // reads go to GPU memory through cuFile
  // Why a preferred path was not taken ("io_uring unavailable: ...", "GPUDirect Storage unavailable: ..."),
  // one line each. The first of each kind is also printed once per process to stderr.
  const std::vector<std::string>& notes() const;
  LoaderStats stats() const;

 private:
  struct Impl;
  // impl_, started afresh first when this process is a fork of the one that made it (see above).
  Impl& live() const;
  mutable std::unique_ptr<Impl> impl_;
};

// The storage ceiling the loader is measured against: reads the dataset's shard files front to back
// (whole files) with `queue_depth` reads of `chunk_bytes` in flight through `io` ("io_uring" or
// "pread"), O_DIRECT unless direct is false, into a few aligned buffers, and nothing else (no
// checksums, no copies). Stops after max_bytes (0: everything). Returns bytes read and seconds.
struct ReadBandwidth {
  uint64_t bytes = 0;
  double seconds = 0;
  std::string io;  // the engine used ("io_uring" or "pread")
};
ReadBandwidth measure_read_bandwidth(const std::string& dir, IoBackend io, int queue_depth, uint64_t chunk_bytes,
                                     uint64_t max_bytes, bool direct = true);

// The dataset indices this rank reads in `epoch`, in order (the concatenation of its batches): for
// tests and tools. Depends on num_records and on options' shuffle, seed, rank, world_size,
// batch_size and drop_last only.
std::vector<uint64_t> loader_epoch_order(uint64_t num_records, const LoaderOptions& options, uint64_t epoch);

}  // namespace optimized
