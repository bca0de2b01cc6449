// The torch glue of the streaming loader (include/optimized/loader.h): torch custom classes
//
//   torch.classes.optimized.StreamingLoader   batches as tensors (records, *record_shape) of the
//                                             dataset's dtype, on the loader's device
//   torch.classes.optimized.ShardWriter       tensors -> shard files
//   torch.ops.optimized.shard_dataset_info    what a dataset directory holds
//   torch.ops.optimized.verify_shards         every record's checksum
//   torch.ops.optimized.loader_read_bandwidth the storage ceiling, for the benchmark
//
// A CUDA batch becomes a tensor over the loader's device memory (no copy). Before it is returned,
// the current stream waits for the batch's copy event, so the tensor is ready for work queued on
// that stream. When torch frees the tensor, its deleter asks that the memory be reused only after
// the work queued on the then-current stream, the caching allocator's rule for tensors freed on
// their stream. The Python API (optimized_ops.data) wraps these classes.
//
// Checks (common.h says who checks what): the glue converts torch's int64 arguments to the C++
// types (unsigned counts, 32-bit ints), refusing what does not fit and naming the argument; checks
// the records a writer appends against its dtype and record shape (the C++ writer takes bytes);
// and leaves every other check (batch_size, rank, chunk_bytes, ...) to the C++ API, whose messages
// arrive as they are, and whose errors become ValueError, NotImplementedError or RuntimeError.
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "common.h"
#include "optimized/core.h"
#include "optimized/loader.h"

namespace optimized::torch_glue {

namespace {

struct DtypeName {
  at::ScalarType type;
  const char* name;
};
constexpr DtypeName kDtypes[] = {{at::kByte, "uint8"},     {at::kChar, "int8"},       {at::kShort, "int16"},
                                 {at::kUInt16, "uint16"},  {at::kInt, "int32"},       {at::kUInt32, "uint32"},
                                 {at::kLong, "int64"},     {at::kHalf, "float16"},    {at::kBFloat16, "bfloat16"},
                                 {at::kFloat, "float32"},  {at::kDouble, "float64"}};

at::ScalarType scalar_type_of(const std::string& name) {
  for (const DtypeName& d : kDtypes)
    if (name == d.name) return d.type;
  TORCH_CHECK_TYPE(false, "optimized loader: the dataset's dtype \"" + name + "\" has no torch dtype");
}

const char* dtype_name_of(at::ScalarType t) {
  for (const DtypeName& d : kDtypes)
    if (t == d.type) return d.name;
  return nullptr;
}

// The loader's messages name their argument (and the file) themselves: no op prefix.
[[noreturn]] void rethrow(const Error& e) { torch_glue::rethrow("", e); }

// An int64 argument as the C++ API's unsigned count: >= 0.
uint64_t as_unsigned(const char* where, const char* name, int64_t v) {
  TORCH_CHECK_VALUE(v >= 0, std::string(where) + ": " + name + ": expected >= 0; given " + std::to_string(v));
  return static_cast<uint64_t>(v);
}

// An int64 argument as the C++ API's int.
int as_int(const char* where, const char* name, int64_t v) {
  TORCH_CHECK_VALUE(v >= INT32_MIN && v <= INT32_MAX,
                    std::string(where) + ": " + name + ": expected a 32-bit integer; given " + std::to_string(v));
  return static_cast<int>(v);
}

class StreamingLoader : public torch::CustomClassHolder {
 public:
  StreamingLoader(std::string path, int64_t batch_size, std::string device, bool shuffle, int64_t seed, int64_t rank,
                  int64_t world_size, bool drop_last, int64_t epochs, int64_t start_epoch, int64_t start_batch,
                  std::string variant, int64_t prefetch, int64_t threads, std::string io, std::string direct_io,
                  std::string gds, bool verify, int64_t chunk_bytes, int64_t queue_depth, int64_t staging_bytes,
                  int64_t worker, int64_t num_workers)
      : device_(device) {
    constexpr const char* kWhere = "StreamingLoader";
    if (device_.is_cuda() && !device_.has_index())
      device_ = at::Device(at::kCUDA, c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice().index());
    LoaderOptions o;
    o.device = to_device(device_, "StreamingLoader: device: ");  // cpu or cuda
    o.batch_size = batch_size;
    o.shuffle = shuffle;
    o.seed = as_unsigned(kWhere, "seed", seed);
    o.rank = as_int(kWhere, "rank", rank);
    o.world_size = as_int(kWhere, "world_size", world_size);
    o.drop_last = drop_last;
    o.epochs = as_unsigned(kWhere, "epochs", epochs);
    o.start = {as_unsigned(kWhere, "start_epoch", start_epoch), as_unsigned(kWhere, "start_batch", start_batch)};
    o.prefetch = as_int(kWhere, "prefetch", prefetch);
    o.threads = as_int(kWhere, "threads", threads);
    o.chunk_bytes = as_unsigned(kWhere, "chunk_bytes", chunk_bytes);
    o.queue_depth = as_int(kWhere, "queue_depth", queue_depth);
    o.verify = verify;
    o.staging_bytes = as_unsigned(kWhere, "staging_bytes", staging_bytes);
    o.worker = as_int(kWhere, "worker", worker);
    o.num_workers = as_int(kWhere, "num_workers", num_workers);
    try {
      o.variant = parse_loader_variant(variant);
      o.io = parse_io_backend(io);
      o.direct_io = parse_direct_io(direct_io);
      o.gds = parse_gds_mode(gds);
      loader_ = std::make_unique<Loader>(path, o);
    } catch (const Error& e) {
      rethrow(e);
    }
    const DatasetInfo& info = loader_->dataset();
    dtype_ = scalar_type_of(info.dtype);
    shape_ = info.record_shape;
  }

  // The next batch, or None at the end of the epoch.
  std::optional<at::Tensor> next() {
    std::optional<Batch> batch;
    try {
      batch = loader_->next();
    } catch (const Error& e) {
      rethrow(e);
    }
    if (!batch) return std::nullopt;
    std::vector<int64_t> sizes{batch->records()};
    sizes.insert(sizes.end(), shape_.begin(), shape_.end());
    const at::Device device = device_;
    if (device.is_cuda()) {
      try {
        batch->wait(current_cuda_stream(device));
      } catch (const Error& e) {
        rethrow(e);
      }
    }
    std::shared_ptr<BatchMemory> memory = batch->memory();
    auto deleter = [memory, device](void*) {
      if (!device.is_cuda()) return;
      try {
        memory->release_after(current_cuda_stream(device));
      } catch (...) {  // at interpreter exit CUDA may be gone; the memory is freed all the same
      }
    };
    at::Tensor t = at::for_blob(batch->data(), sizes)
                       .deleter(deleter)
                       .options(at::TensorOptions().dtype(dtype_).device(device))
                       .target_device(device)
                       .make_tensor();
    const std::vector<uint64_t>& ids = batch->indices();
    last_indices_ = at::empty({static_cast<int64_t>(ids.size())}, at::kLong);
    std::copy(ids.begin(), ids.end(), last_indices_.data_ptr<int64_t>());
    return t;
  }

  at::Tensor last_indices() const { return last_indices_.defined() ? last_indices_ : at::empty({0}, at::kLong); }
  std::vector<int64_t> position() const {
    try {
      const LoaderPosition p = loader_->position();
      return {static_cast<int64_t>(p.epoch), static_cast<int64_t>(p.batch)};
    } catch (const Error& e) {
      rethrow(e);
    }
  }
  void seek(int64_t epoch, int64_t batch) {
    const LoaderPosition to{as_unsigned("StreamingLoader.seek", "epoch", epoch),
                            as_unsigned("StreamingLoader.seek", "batch", batch)};
    try {
      loader_->seek(to);
    } catch (const Error& e) {
      rethrow(e);
    }
  }
  void stop() { loader_->stop(); }
  // dataset_fingerprint of the dataset, as 16 hex digits.
  std::string fingerprint() const {
    char text[24];
    std::snprintf(text, sizeof(text), "%016llx",
                  static_cast<unsigned long long>(dataset_fingerprint(loader_->dataset())));
    return text;
  }
  int64_t staging_bytes() const { return static_cast<int64_t>(loader_->staging_bytes()); }
  int64_t prefetch() const { return loader_->prefetch(); }
  // The C++ loader's address, for optimized_loader_wait through ctypes (waits without the GIL).
  int64_t handle() const { return static_cast<int64_t>(reinterpret_cast<intptr_t>(loader_.get())); }
  int64_t batches_per_epoch() const { return static_cast<int64_t>(loader_->batches_per_epoch()); }
  int64_t records_per_epoch() const { return static_cast<int64_t>(loader_->records_per_epoch()); }
  int64_t num_records() const { return static_cast<int64_t>(loader_->dataset().num_records); }
  int64_t record_bytes() const { return static_cast<int64_t>(loader_->dataset().record_bytes); }
  std::string dtype() const { return loader_->dataset().dtype; }
  std::vector<int64_t> record_shape() const { return shape_; }
  std::string io_backend() const { return loader_->io_backend(); }
  bool direct_io() const { return loader_->direct_io(); }
  bool gds() const { return loader_->gds(); }
  std::vector<std::string> notes() const { return loader_->notes(); }
  // [batches, record bytes, bytes read, seconds the consumer waited]
  std::vector<double> stats() const {
    LoaderStats s;
    try {
      s = loader_->stats();
    } catch (const Error& e) {
      rethrow(e);
    }
    return {static_cast<double>(s.batches), static_cast<double>(s.record_bytes), static_cast<double>(s.read_bytes),
            s.consumer_wait_s};
  }

 private:
  std::unique_ptr<Loader> loader_;
  at::Device device_;
  at::ScalarType dtype_ = at::kByte;
  std::vector<int64_t> shape_;
  at::Tensor last_indices_;
};

class ShardWriterHolder : public torch::CustomClassHolder {
 public:
  ShardWriterHolder(std::string path, std::string dtype, std::vector<int64_t> record_shape, int64_t records_per_shard,
                    bool overwrite)
      : dtype_(dtype), shape_(record_shape) {
    const uint64_t per_shard = as_unsigned("ShardWriter", "records_per_shard", records_per_shard);
    try {
      writer_ = std::make_unique<ShardWriter>(path, dtype, record_shape, per_shard, overwrite);
    } catch (const Error& e) {
      rethrow(e);
    }
  }

  // records: a CPU tensor (n, *record_shape) of the writer's dtype.
  void append(const at::Tensor& records) {
    TORCH_CHECK_VALUE(writer_, "ShardWriter.append: the writer is closed");
    TORCH_CHECK_VALUE(records.device().is_cpu(), "ShardWriter.append: records: expected a CPU tensor; given one on " +
                                                     records.device().str());
    const char* name = dtype_name_of(records.scalar_type());
    TORCH_CHECK_TYPE(name && dtype_ == name, "ShardWriter.append: records: expected dtype " + dtype_ + "; given " +
                                                 dtype_str(records.scalar_type()));
    bool shape_ok = records.dim() == static_cast<int64_t>(shape_.size()) + 1;
    for (size_t i = 0; shape_ok && i < shape_.size(); ++i) shape_ok = records.size(static_cast<int64_t>(i) + 1) == shape_[i];
    if (!shape_ok) {
      std::string want = "(n", got = "(";
      for (int64_t d : shape_) want += ", " + std::to_string(d);
      for (int64_t i = 0; i < records.dim(); ++i) got += (i ? ", " : "") + std::to_string(records.size(i));
      TORCH_CHECK_VALUE(false, "ShardWriter.append: records: expected shape " + want + "); given " + got + ")");
    }
    const at::Tensor c = records.contiguous();
    try {
      writer_->append(c.data_ptr(), static_cast<uint64_t>(c.size(0)));
    } catch (const Error& e) {
      rethrow(e);
    }
  }

  // Not closed: the writer's Python object was dropped without close() (or an exception left it
  // behind): what was written is not a finished dataset, so it is left incomplete (kIncompleteMarker).
  ~ShardWriterHolder() override {
    if (writer_) writer_->abort("the Python ShardWriter was deleted without close()");
  }

  // Leaves the dataset incomplete (ShardWriter::abort).
  void abort(const std::string& why) {
    if (writer_) writer_->abort(why);
    writer_.reset();
  }

  // Finishes the dataset; returns its shard count.
  int64_t close() {
    TORCH_CHECK_VALUE(writer_, "ShardWriter.close: already closed");
    try {
      const DatasetInfo info = writer_->close();
      writer_.reset();
      return static_cast<int64_t>(info.shards.size());
    } catch (const Error& e) {
      writer_.reset();
      rethrow(e);
    }
  }

  int64_t records_written() const { return writer_ ? static_cast<int64_t>(writer_->records_written()) : -1; }

 private:
  std::unique_ptr<ShardWriter> writer_;
  std::string dtype_;
  std::vector<int64_t> shape_;
};

// (dtype, record_shape, record_bytes, num_records, num_shards)
std::tuple<std::string, std::vector<int64_t>, int64_t, int64_t, int64_t> shard_dataset_info(const std::string& path) {
  try {
    const DatasetInfo info = open_dataset(path);
    return {info.dtype, info.record_shape, static_cast<int64_t>(info.record_bytes),
            static_cast<int64_t>(info.num_records), static_cast<int64_t>(info.shards.size())};
  } catch (const Error& e) {
    rethrow(e);
  }
}

// [bytes, seconds]: the storage ceiling (measure_read_bandwidth), for the benchmark.
std::vector<double> loader_read_bandwidth(const std::string& path, const std::string& io, int64_t queue_depth,
                                          int64_t chunk_bytes, int64_t max_bytes, bool direct) {
  try {
    const ReadBandwidth r = measure_read_bandwidth(path, parse_io_backend(io), static_cast<int>(queue_depth),
                                                   static_cast<uint64_t>(chunk_bytes),
                                                   static_cast<uint64_t>(std::max<int64_t>(max_bytes, 0)), direct);
    return {static_cast<double>(r.bytes), r.seconds};
  } catch (const Error& e) {
    rethrow(e);
  }
}

// The loader's variants (naive to best).
std::vector<std::string> loader_variants() {
  return variant_names(all_loader_variants(), loader_variant_name);
}

void verify_shards(const std::string& path) {
  try {
    verify_dataset(path);
  } catch (const Error& e) {
    rethrow(e);
  }
}

}  // namespace

}  // namespace optimized::torch_glue

TORCH_LIBRARY_FRAGMENT(optimized, m) {
  using optimized::torch_glue::ShardWriterHolder;
  using optimized::torch_glue::StreamingLoader;
  m.class_<StreamingLoader>("StreamingLoader")
      .def(torch::init<std::string, int64_t, std::string, bool, int64_t, int64_t, int64_t, bool, int64_t, int64_t,
                       int64_t, std::string, int64_t, int64_t, std::string, std::string, std::string, bool, int64_t,
                       int64_t, int64_t, int64_t, int64_t>())
      .def("next", &StreamingLoader::next)
      .def("last_indices", &StreamingLoader::last_indices)
      .def("position", &StreamingLoader::position)
      .def("seek", &StreamingLoader::seek)
      .def("stop", &StreamingLoader::stop)
      .def("fingerprint", &StreamingLoader::fingerprint)
      .def("staging_bytes", &StreamingLoader::staging_bytes)
      .def("prefetch", &StreamingLoader::prefetch)
      .def("handle", &StreamingLoader::handle)
      .def("batches_per_epoch", &StreamingLoader::batches_per_epoch)
      .def("records_per_epoch", &StreamingLoader::records_per_epoch)
      .def("num_records", &StreamingLoader::num_records)
      .def("record_bytes", &StreamingLoader::record_bytes)
      .def("dtype", &StreamingLoader::dtype)
      .def("record_shape", &StreamingLoader::record_shape)
      .def("io_backend", &StreamingLoader::io_backend)
      .def("direct_io", &StreamingLoader::direct_io)
      .def("gds", &StreamingLoader::gds)
      .def("notes", &StreamingLoader::notes)
      .def("stats", &StreamingLoader::stats);
  m.class_<ShardWriterHolder>("ShardWriter")
      .def(torch::init<std::string, std::string, std::vector<int64_t>, int64_t, bool>())
      .def("append", &ShardWriterHolder::append)
      .def("close", &ShardWriterHolder::close)
      .def("abort", &ShardWriterHolder::abort)
      .def("records_written", &ShardWriterHolder::records_written);
  m.def("shard_dataset_info(str path) -> (str, int[], int, int, int)", &optimized::torch_glue::shard_dataset_info);
  m.def("verify_shards(str path) -> ()", &optimized::torch_glue::verify_shards);
  m.def("loader_variants() -> str[]", &optimized::torch_glue::loader_variants);
  m.def("loader_read_bandwidth(str path, str io, int queue_depth, int chunk_bytes, int max_bytes, bool direct) -> float[]",
        &optimized::torch_glue::loader_read_bandwidth);
}
