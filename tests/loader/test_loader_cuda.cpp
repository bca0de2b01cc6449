// The loader delivering into GPU memory: every copy path byte-exact (one run: direct H2D; a few
// runs: one H2D each; many runs: staging copy + gather kernel at 16-, 4- and 1-byte alignment;
// buffered reads: packed staging; io=mmap: batched DMA from the registered page cache, one run to
// many, records of 13 bytes to 147 KiB; io=auto on a dataset in the page cache: mmap, said in
// notes()), the ready event honoured by a consumer stream, batches held
// longer than the prefetch depth and past the loader's end, GPUDirect Storage when the machine has
// it, a corrupted record named on this path too, a forked child refused with a clear error, pinned
// staging sized by the dataset, and a shard truncated under io=mmap. A plain C++ file built in every
// configuration: without a CUDA device every test skips with the reason.
#include <algorithm>
#include <tuple>

#include "loader_test_util.h"

#if OPTIMIZED_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace optimized {
namespace {

using namespace loader_test;

#if OPTIMIZED_WITH_CUDA

#define ASSERT_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call << ": " << cudaGetErrorString(cudaGetLastError())

// Copies a delivered batch back on a consumer stream that waits for its event, and checks it.
void check_batch(const Batch& b, cudaStream_t stream, const std::vector<uint8_t>& data, uint64_t r) {
  ASSERT_TRUE(b.device().is_cuda());
  ASSERT_NE(b.ready_event(), nullptr);
  cudaPointerAttributes attr{};
  ASSERT_CUDA(cudaPointerGetAttributes(&attr, b.data()));
  EXPECT_EQ(attr.type, cudaMemoryTypeDevice);
  std::vector<uint8_t> host(b.bytes(), 0xA5);
  b.wait(stream);
  ASSERT_CUDA(cudaMemcpyAsync(host.data(), b.data(), b.bytes(), cudaMemcpyDeviceToHost, stream));
  ASSERT_CUDA(cudaStreamSynchronize(stream));
  EXPECT_TRUE(batch_matches(host.data(), b.indices(), data, r));
  b.memory()->release_after(stream);
}

struct Path {
  const char* name;
  uint64_t record_bytes;
  bool shuffle;
  const char* direct;
  int64_t batch;
  const char* io = "auto";
};

class LoaderCuda : public ::testing::TestWithParam<Path> {};

TEST_P(LoaderCuda, EveryRecordOncePerEpochByteExact) {
  SKIP_WITHOUT_CUDA();
  const Path& p = GetParam();
  TempDir tmp;
  if (std::string(p.direct) == "on") {
    const std::string why = direct_io_unavailable(tmp.path());
    if (!why.empty()) GTEST_SKIP() << "O_DIRECT unavailable in " << tmp.path() << ": " << why;
  }
  const uint64_t n = 97;
  const std::vector<uint8_t> data = make_records(n, p.record_bytes);
  write_dataset(tmp.sub("ds"), data, p.record_bytes, 20);
  LoaderOptions o;
  o.batch_size = p.batch;
  o.device = Device::cuda(0);
  o.shuffle = p.shuffle;
  o.seed = 1234;
  o.direct_io = parse_direct_io(p.direct);
  o.io = parse_io_backend(p.io);
  o.gds = GdsMode::kOff;
  o.prefetch = 3;
  o.epochs = 2;
  Loader loader(tmp.sub("ds"), o);
  if (std::string(p.io) == "mmap") {
    ASSERT_EQ(loader.io_backend(), "mmap") << (loader.notes().empty() ? "" : loader.notes().back());
  }
  if (std::string(p.name).rfind("auto_", 0) == 0) {
    // just written: in the page cache, and far below a quarter of the memory
    std::string said;
    for (const std::string& s : loader.notes()) said += s + "\n";
    if (said.find("io=mmap unavailable") != std::string::npos) GTEST_SKIP() << said;
    EXPECT_EQ(loader.io_backend(), "mmap") << said;
    EXPECT_NE(said.find("loader: io=mmap: 100% of the dataset"), std::string::npos) << said;
    EXPECT_NE(said.find("worker threads (of"), std::string::npos) << said;
  }
  cudaStream_t stream;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (uint64_t epoch = 0; epoch < 2; ++epoch) {
    std::vector<uint64_t> ids;
    while (std::optional<Batch> b = loader.next()) {
      check_batch(*b, stream, data, p.record_bytes);
      ids.insert(ids.end(), b->indices().begin(), b->indices().end());
    }
    EXPECT_EQ(ids, loader_epoch_order(n, o, epoch));
  }
  ASSERT_CUDA(cudaStreamDestroy(stream));
}

INSTANTIATE_TEST_SUITE_P(
    Paths, LoaderCuda,
    ::testing::Values(Path{"one_run_direct", 4097, false, "on", 16},       // 1-2 runs: H2D per run
                      Path{"packed_buffered", 4097, true, "off", 16, "pread"},  // staging = batch layout
                      Path{"gather_16B", 4096 + 48, true, "on", 16},       // many runs, 16-byte copies
                      Path{"gather_4B", 1028, true, "on", 32},             // 4-byte copies
                      Path{"gather_1B", 13, true, "on", 64},               // byte copies, records share blocks
                      Path{"gather_large", 150528, true, "on", 12},        // pieces of 64 KiB
                      Path{"mmap_sequential", 4097, false, "off", 16, "mmap"},  // DMA from the registered page cache
                      Path{"mmap_shuffled_small", 1003, true, "off", 32, "mmap"},  // one DMA per record, batched
                      Path{"mmap_shuffled_tiny", 13, true, "off", 64, "mmap"},
                      Path{"mmap_shuffled_16B", 4096 + 48, true, "off", 16, "mmap"},
                      Path{"mmap_shuffled_large", 150528, true, "off", 12, "mmap"},
                      Path{"auto_cached_shuffled", 4096 + 48, true, "auto", 16},   // io=auto picks mmap
                      Path{"auto_cached_sequential", 4097, false, "auto", 16}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(LoaderCudaLifetime, HeldBatchesAndBatchesPastTheLoader) {
  SKIP_WITHOUT_CUDA();
  TempDir tmp;
  const uint64_t n = 120, r = 3000;
  const std::vector<uint8_t> data = make_records(n, r);
  write_dataset(tmp.sub("ds"), data, r, 50);
  cudaStream_t stream;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<Batch> held;
  {
    LoaderOptions o;
    o.batch_size = 10;
    o.device = Device::cuda(0);
    o.shuffle = true;
    o.prefetch = 2;
    Loader loader(tmp.sub("ds"), o);
    // Hold a whole epoch (more batches than the prefetch depth), then the next epoch after release.
    while (std::optional<Batch> b = loader.next()) held.push_back(std::move(*b));
    EXPECT_EQ(held.size(), 12u);
    for (const Batch& b : held) check_batch(b, stream, data, r);
    held.clear();
    while (std::optional<Batch> b = loader.next()) held.push_back(std::move(*b));
    // The loader goes; its batches stay valid.
  }
  for (const Batch& b : held) check_batch(b, stream, data, r);
  held.clear();
  ASSERT_CUDA(cudaStreamSynchronize(stream));
  ASSERT_CUDA(cudaStreamDestroy(stream));
}

TEST(LoaderCudaVariants, SynchronousReturnsACompletedCopy) {
  SKIP_WITHOUT_CUDA();
  TempDir tmp;
  const uint64_t n = 25, r = 10000;
  const std::vector<uint8_t> data = make_records(n, r);
  write_dataset(tmp.sub("ds"), data, r, 10);
  LoaderOptions o;
  o.batch_size = 4;
  o.device = Device::cuda(0);
  o.variant = LoaderVariant::kSynchronous;
  Loader loader(tmp.sub("ds"), o);
  while (std::optional<Batch> b = loader.next()) {
    ASSERT_CUDA(cudaEventQuery(static_cast<cudaEvent_t>(b->ready_event())));  // already done
    std::vector<uint8_t> host(b->bytes());
    ASSERT_CUDA(cudaMemcpy(host.data(), b->data(), b->bytes(), cudaMemcpyDeviceToHost));
    EXPECT_TRUE(batch_matches(host.data(), b->indices(), data, r));
  }
}

TEST(LoaderCudaErrors, CorruptedRecordIsNamed) {
  SKIP_WITHOUT_CUDA();
  TempDir tmp;
  const uint64_t n = 30, r = 5000;
  const std::vector<uint8_t> data = make_records(n, r);
  write_dataset(tmp.sub("ds"), data, r, 10);
  const std::string file = tmp.sub("ds") + "/" + shard_file_name(1);
  corrupt(file, kShardHeaderBytes + 4 * r + 4999);  // dataset record 14, its last byte
  LoaderOptions o;
  o.batch_size = 6;
  o.device = Device::cuda(0);
  Loader loader(tmp.sub("ds"), o);
  ASSERT_TRUE(loader.next().has_value());  // records 0..5
  ASSERT_TRUE(loader.next().has_value());  // 6..11
  EXPECT_TRUE(contains_all(error_of([&] { loader.next(); }), {file, "record 4 (dataset record 14", "checksum mismatch"}));
}

TEST(LoaderCudaGds, ForcedCuFileDeliversTheSameBytes) {
  SKIP_WITHOUT_CUDA();
  TempDir tmp;
  const uint64_t n = 60, r = 8192 + 100;
  const std::vector<uint8_t> data = make_records(n, r);
  write_dataset(tmp.sub("ds"), data, r, 25);
  LoaderOptions o;
  o.batch_size = 8;
  o.device = Device::cuda(0);
  o.shuffle = true;
  o.gds = GdsMode::kOn;
  std::unique_ptr<Loader> loader;
  try {
    loader = std::make_unique<Loader>(tmp.sub("ds"), o);
  } catch (const Error& e) {
    if (e.status() == Status::kUnsupported) GTEST_SKIP() << e.what();
    throw;
  }
  EXPECT_TRUE(loader->gds());
  EXPECT_EQ(loader->io_backend(), "cufile");
  cudaStream_t stream;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<uint64_t> ids;
  while (std::optional<Batch> b = loader->next()) {
    check_batch(*b, stream, data, r);
    ids.insert(ids.end(), b->indices().begin(), b->indices().end());
  }
  EXPECT_EQ(ids, loader_epoch_order(n, o, 0));
  ASSERT_CUDA(cudaStreamDestroy(stream));
}

TEST(LoaderCudaGds, AutoSaysWhyNotOnce) {
  SKIP_WITHOUT_CUDA();
  TempDir tmp;
  write_dataset(tmp.sub("ds"), make_records(10, 100), 100, 10);
  LoaderOptions o;
  o.batch_size = 5;
  o.device = Device::cuda(0);
  o.io = IoBackend::kPread;  // (io=auto would map this cached dataset and not try GDS)
  Loader loader(tmp.sub("ds"), o);
  if (loader.gds()) GTEST_SKIP() << "GPUDirect Storage is available here";
  ASSERT_FALSE(loader.notes().empty());
  bool said = false;
  for (const std::string& s : loader.notes()) said |= s.find("GPUDirect Storage unavailable") != std::string::npos;
  EXPECT_TRUE(said);
}

// A CUDA loader inherited by a forked child: a clear error there (CUDA does not survive fork), never
// a hang; the parent's loader goes on.
TEST(LoaderCudaFork, ChildGetsAClearErrorAndTheParentGoesOn) {
  SKIP_WITHOUT_CUDA();
  TempDir tmp;
  const uint64_t n = 30, r = 1000;
  const std::vector<uint8_t> data = make_records(n, r);
  write_dataset(tmp.sub("ds"), data, r, 10);
  LoaderOptions o;
  o.batch_size = 4;
  o.device = Device::cuda(0);
  Loader loader(tmp.sub("ds"), o);
  cudaStream_t stream;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  {
    std::optional<Batch> b = loader.next();
    ASSERT_TRUE(b.has_value());
    check_batch(*b, stream, data, r);
  }
  const ChildResult child = run_in_child([&] {
    for (int attempt = 0; attempt < 2; ++attempt) {
      std::string error;
      Status status = Status::kOk;
      try {
        loader.next();
      } catch (const Error& e) {
        error = e.what();
        status = e.status();
      }
      std::fprintf(stderr, "child: %s\n", error.c_str());
      CHILD_EXPECT(status == Status::kUnsupported, 2);
      CHILD_EXPECT(contains_all(error, {"cuda:0", "fork", "CUDA cannot be used", "spawn"}), 3);
    }
    return 0;
  });
  EXPECT_TRUE(child.ok()) << child.describe();
  uint64_t records = 4;
  while (std::optional<Batch> b = loader.next()) {
    check_batch(*b, stream, data, r);
    records += b->indices().size();
  }
  EXPECT_EQ(records, n);
  ASSERT_CUDA(cudaStreamDestroy(stream));
}

TEST(LoaderCudaStaging, PinnedStagingSizedByTheDataset) {
  SKIP_WITHOUT_CUDA();
  TempDir tmp;
  const uint64_t r = 8192;
  const std::vector<uint8_t> data = make_records(20, r);
  write_dataset(tmp.sub("ds"), data, r, 20);
  LoaderOptions o;
  o.batch_size = 10'000'000;
  o.device = Device::cuda(0);
  o.gds = GdsMode::kOff;
  Loader loader(tmp.sub("ds"), o);
  EXPECT_LE(loader.staging_bytes(), 4u * (20 * r + 2 * 4096));
  cudaStream_t stream;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::optional<Batch> b = loader.next();
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->records(), 20);
  check_batch(*b, stream, data, r);
  EXPECT_FALSE(loader.next().has_value());
  ASSERT_CUDA(cudaStreamSynchronize(stream));
  ASSERT_CUDA(cudaStreamDestroy(stream));
}

// io=mmap on CUDA (registered mappings): a shard truncated while open is an error naming it. (In
// this process: the size check comes before any page is touched; a crash would fail this test.)
TEST(LoaderCudaMmap, TruncatedShardIsAnError) {
  SKIP_WITHOUT_CUDA();
  TempDir tmp;
  const uint64_t r = 1000;
  const std::vector<uint8_t> data = make_records(40, r);
  write_dataset(tmp.sub("ds"), data, r, 10);
  const std::string shard3 = tmp.sub("ds") + "/" + shard_file_name(3);
  LoaderOptions o;
  o.batch_size = 5;
  o.prefetch = 2;
  o.device = Device::cuda(0);
  o.io = IoBackend::kMmap;
  o.gds = GdsMode::kOff;
  Loader loader(tmp.sub("ds"), o);
  if (loader.io_backend() != "mmap") GTEST_SKIP() << (loader.notes().empty() ? "" : loader.notes().back());
  ASSERT_TRUE(loader.next().has_value());
  truncate_file(shard3, kShardHeaderBytes + 2 * r + 500);
  std::string error;
  try {
    while (loader.next()) {
    }
  } catch (const Error& e) {
    error = e.what();
  }
  EXPECT_TRUE(contains_all(error, {shard3, "truncated", "record 2 (dataset record 32"}));
}

#else

TEST(LoaderCuda, NeedsACudaBuild) { GTEST_SKIP() << "built without CUDA"; }

#endif

}  // namespace
}  // namespace optimized
