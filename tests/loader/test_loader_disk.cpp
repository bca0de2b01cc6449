// The disk (O_DIRECT) path of issue 19: io_uring fixed buffers, reads coalesced across small gaps,
// and the read defaults derived from the block device.
//   - fixed buffers on, off (OPTIMIZED_LOADER_FIXED_BUFFERS=off) and refused (=fail) give the same
//     bytes in the same order, sequential and shuffled, for record sizes that are not multiples of
//     the block size (the last record of a shard ends inside a block), and notes() says which
//   - the io_uring engine alone: fixed reads, a short read at the end of a file whose size is not a
//     multiple of 4 KiB, a buffer replaced in place (update_buffer), a destination outside every
//     registered buffer (a plain read)
//   - read plans with coalescing: exactly the expected records land at record_src, with fewer reads,
//     within the staging limit (and none when the limit leaves no slack)
//   - default_reads: the depth and read size for a few devices; notes() says what was picked
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <fstream>
#include <map>
#include <mutex>
#include <numeric>
#include <random>

#include "loader/auto_config.h"
#include "loader/fd_cache.h"
#include "loader/io_engine.h"
#include "loader/read_plan.h"
#include "loader_test_util.h"

namespace optimized {
namespace {

using namespace loader_test;

// Sets an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    if (value) ::setenv(name, value, 1);
    else ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_) ::setenv(name_.c_str(), old_.c_str(), 1);
    else ::unsetenv(name_.c_str());
  }

 private:
  std::string name_, old_;
  bool had_ = false;
};

std::string joined(const std::vector<std::string>& notes) {
  std::string s;
  for (const std::string& n : notes) s += n + "\n";
  return s;
}

// Two epochs: the batches' indices, in order; every batch checked byte-exact against `data`.
std::vector<uint64_t> two_epochs(Loader& loader, const std::vector<uint8_t>& data, uint64_t r) {
  std::vector<uint64_t> ids;
  for (int e = 0; e < 2; ++e) {
    while (std::optional<Batch> b = loader.next()) {
      EXPECT_TRUE(batch_matches(static_cast<const uint8_t*>(b->data()), b->indices(), data, r));
      ids.insert(ids.end(), b->indices().begin(), b->indices().end());
    }
  }
  return ids;
}

struct DiskCase {
  uint64_t record_bytes;
  uint64_t records;
  uint64_t per_shard;
  bool shuffle;
};

class LoaderFixedBuffers : public ::testing::TestWithParam<DiskCase> {};

TEST_P(LoaderFixedBuffers, OnOffAndRefusedGiveTheSameBytesInTheSameOrder) {
  const DiskCase c = GetParam();
  TempDir tmp;
  if (const std::string why = direct_io_unavailable(tmp.path()); !why.empty())
    GTEST_SKIP() << "O_DIRECT unavailable in " << tmp.path() << ": " << why;
  const std::vector<uint8_t> data = make_records(c.records, c.record_bytes, 7);
  write_dataset(tmp.sub("ds"), data, c.record_bytes, c.per_shard);
  LoaderOptions o;
  o.batch_size = 9;
  o.shuffle = c.shuffle;
  o.seed = 5;
  o.io = IoBackend::kIoUring;
  o.direct_io = DirectIo::kOn;
  o.chunk_bytes = 16 * 1024;  // several reads per run: reads end inside a registered slot, and at its end
  o.queue_depth = 0;          // automatic
  o.prefetch = 3;
  o.threads = 2;
  o.epochs = 2;
  std::map<std::string, std::vector<uint64_t>> orders;
  for (const char* mode : {"on", "off", "fail"}) {
    ScopedEnv env("OPTIMIZED_LOADER_FIXED_BUFFERS", mode);
    Loader loader(tmp.sub("ds"), o);
    if (loader.io_backend() != "io_uring") GTEST_SKIP() << "io_uring unavailable: " << joined(loader.notes());
    const std::string said = joined(loader.notes());
    EXPECT_NE(said.find("loader reads: io_uring with O_DIRECT"), std::string::npos) << said;
    EXPECT_NE(said.find("reads in flight of up to 16 KiB"), std::string::npos) << said;
    if (std::string(mode) == "off") {
      EXPECT_NE(said.find("staging not registered (OPTIMIZED_LOADER_FIXED_BUFFERS=off)"), std::string::npos) << said;
      EXPECT_EQ(said.find("fixed buffers unavailable"), std::string::npos) << said;  // off is not a failure
    } else if (std::string(mode) == "fail") {
      EXPECT_NE(said.find("io_uring fixed buffers unavailable (io_uring_register_buffers failed: forced by "
                          "OPTIMIZED_LOADER_FIXED_BUFFERS=fail); plain reads"),
                std::string::npos)
          << said;
    } else {
      // The kernel may refuse (RLIMIT_MEMLOCK for an unprivileged user): then the note says why.
      EXPECT_TRUE(said.find("staging registered as io_uring fixed buffers") != std::string::npos ||
                  said.find("io_uring fixed buffers unavailable (io_uring_register_buffers failed") !=
                      std::string::npos)
          << said;
    }
    orders[mode] = two_epochs(loader, data, c.record_bytes);
    EXPECT_EQ(loader.stats().record_bytes, 2 * c.records * c.record_bytes);
  }
  std::vector<uint64_t> expected = loader_epoch_order(c.records, o, 0);
  const std::vector<uint64_t> e1 = loader_epoch_order(c.records, o, 1);
  expected.insert(expected.end(), e1.begin(), e1.end());
  EXPECT_EQ(orders["on"], expected);
  EXPECT_EQ(orders["off"], expected);
  EXPECT_EQ(orders["fail"], expected);
}

INSTANTIATE_TEST_SUITE_P(
    Sizes, LoaderFixedBuffers,
    ::testing::Values(DiskCase{13, 301, 100, false}, DiskCase{13, 301, 100, true},  // many records per block
                      DiskCase{4095, 40, 7, true}, DiskCase{4097, 33, 5, false}, DiskCase{4097, 33, 5, true},
                      DiskCase{12345, 20, 1, true},  // one record per shard: every run ends the data section
                      DiskCase{150528, 9, 4, false}, DiskCase{150528, 9, 4, true}),
    [](const auto& info) {
      const DiskCase& c = info.param;
      return "r" + std::to_string(c.record_bytes) + "_n" + std::to_string(c.records) + "_s" +
             std::to_string(c.per_shard) + (c.shuffle ? "_shuffled" : "_sequential");
    });

// The CPU device hands a slot's buffer out with its batch and registers the slot's new one in place:
// batches held past many later reads keep their bytes (a read into a stale registration would
// overwrite them).
TEST(LoaderFixedBuffersCpu, BatchesHeldWhileTheSlotsAreReRegisteredKeepTheirBytes) {
  TempDir tmp;
  if (const std::string why = direct_io_unavailable(tmp.path()); !why.empty()) GTEST_SKIP() << why;
  const uint64_t r = 8192;  // whole pages: one run per sequential batch, handed out without a copy
  const std::vector<uint8_t> data = make_records(64, r, 3);
  write_dataset(tmp.sub("ds"), data, r, 64);
  LoaderOptions o;
  o.batch_size = 4;
  o.io = IoBackend::kIoUring;
  o.direct_io = DirectIo::kOn;
  o.prefetch = 2;
  o.threads = 2;
  Loader loader(tmp.sub("ds"), o);
  if (loader.io_backend() != "io_uring") GTEST_SKIP() << joined(loader.notes());
  std::vector<Batch> held;
  for (int e = 0; e < 3; ++e)
    while (std::optional<Batch> b = loader.next()) held.push_back(std::move(*b));
  ASSERT_EQ(held.size(), 48u);
  for (const Batch& b : held)
    EXPECT_TRUE(batch_matches(static_cast<const uint8_t*>(b.data()), b.indices(), data, r));
}

// ---- the engine alone ---------------------------------------------------------------------------

struct Completions {
  std::mutex mutex;
  std::condition_variable cv;
  std::map<void*, int64_t> results;
  loader::IoDone done() {
    return [this](const loader::IoRequest& req, int64_t n) {
      std::lock_guard<std::mutex> lock(mutex);
      results[req.tag] = n;
      cv.notify_all();
    };
  }
  void wait(size_t n) {
    std::unique_lock<std::mutex> lock(mutex);
    cv.wait(lock, [&] { return results.size() >= n; });
  }
};

TEST(UringEngine, FixedReadsShortReadAtAnUnalignedEndUpdatesAndPlainReads) {
  TempDir tmp;
  if (const std::string why = direct_io_unavailable(tmp.path()); !why.empty()) GTEST_SKIP() << why;
  // A file of 3 pages and 1000 bytes: its last block is partial.
  const uint64_t size = 3 * 4096 + 1000;
  std::vector<uint8_t> bytes = make_records(1, size, 9);
  const std::string file = tmp.sub("f");
  {
    const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::write(fd, bytes.data(), size), static_cast<ssize_t>(size));
    ::close(fd);
  }
  loader::FdCache files({file}, O_RDONLY | O_CLOEXEC | O_DIRECT, 4);
  Completions got;
  std::string why_not;
  std::unique_ptr<loader::IoEngine> engine = loader::make_uring_engine(files, 4, got.done(), why_not);
  if (!engine) GTEST_SKIP() << why_not;
  const uint64_t slot = 4 * 4096;
  auto alloc = [&] {
    void* p = ::mmap(nullptr, slot, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    EXPECT_NE(p, MAP_FAILED);
    std::memset(p, 0xAB, slot);  // poisoned: an unwritten byte fails
    return static_cast<uint8_t*>(p);
  };
  uint8_t* a = alloc();
  uint8_t* b = alloc();
  uint8_t* c = alloc();  // never registered: plain reads
  const bool fixed = engine->register_buffers({{a, slot}, {b, slot}}, why_not);
  if (!fixed) {
    EXPECT_NE(why_not.find("io_uring_register_buffers failed"), std::string::npos) << why_not;
  }

  int tags[8];
  // Whole file into a (a short read: 13288 of 16384), the first two pages into b at offset 4096, the
  // last page (partial) into c.
  std::vector<loader::IoRequest> reqs = {{0, 0, slot, a, 0, &tags[0]},
                                         {0, 0, 2 * 4096, b, 4096, &tags[1]},
                                         {0, 3 * 4096, 4096, c, 0, &tags[2]}};
  engine->submit(reqs.data(), reqs.size());
  got.wait(3);
  EXPECT_EQ(got.results[&tags[0]], static_cast<int64_t>(size));
  EXPECT_EQ(got.results[&tags[1]], 2 * 4096);
  EXPECT_EQ(got.results[&tags[2]], 1000);
  EXPECT_EQ(std::memcmp(a, bytes.data(), size), 0);
  // (the rest of the last block may be written: O_DIRECT transfers whole blocks, zeros past the end)
  EXPECT_EQ(std::memcmp(b + 4096, bytes.data(), 2 * 4096), 0);
  EXPECT_EQ(b[0], 0xAB);
  EXPECT_EQ(std::memcmp(c, bytes.data() + 3 * 4096, 1000), 0);
  // a and b (and a's second read, after the short one); c is outside every registered buffer.
  const uint64_t fixed_before = engine->fixed_reads();
  if (fixed) {
    EXPECT_GE(fixed_before, 2u);
  } else {
    EXPECT_EQ(fixed_before, 0u);
  }

  // Slot 1 gets a new buffer (c) in place: reads into c are then fixed, reads into b plain.
  if (fixed) {
    ASSERT_TRUE(engine->update_buffer(1, c, slot));
    std::memset(b, 0xAB, slot);
    std::memset(c, 0xAB, slot);
    std::vector<loader::IoRequest> more = {{0, 4096, 2 * 4096, c, 4096, &tags[3]},
                                           {0, 0, 4096, b, 0, &tags[4]}};
    engine->submit(more.data(), more.size());
    got.wait(5);
    EXPECT_EQ(got.results[&tags[3]], 2 * 4096);
    EXPECT_EQ(got.results[&tags[4]], 4096);
    EXPECT_EQ(std::memcmp(c + 4096, bytes.data() + 4096, 2 * 4096), 0);
    EXPECT_EQ(std::memcmp(b, bytes.data(), 4096), 0);
    EXPECT_EQ(engine->fixed_reads(), fixed_before + 1);  // c's read fixed, b's plain
  }
  engine.reset();
  for (uint8_t* p : {a, b, c}) ::munmap(p, slot);
}

TEST(UringEngine, RegistrationRefusedByTheEnvironment) {
  TempDir tmp;
  const std::string file = tmp.sub("f");
  { std::ofstream(file) << "x"; }
  loader::FdCache files({file}, O_RDONLY | O_CLOEXEC, 4);
  std::string why_not;
  std::unique_ptr<loader::IoEngine> engine = loader::make_uring_engine(files, 2, [](auto&, int64_t) {}, why_not);
  if (!engine) GTEST_SKIP() << why_not;
  std::vector<uint8_t> buf(4096);
  {
    ScopedEnv env("OPTIMIZED_LOADER_FIXED_BUFFERS", "fail");
    EXPECT_FALSE(engine->register_buffers({{buf.data(), buf.size()}}, why_not));
    EXPECT_TRUE(contains_all(why_not, {"forced by OPTIMIZED_LOADER_FIXED_BUFFERS=fail"})) << why_not;
  }
  {
    ScopedEnv env("OPTIMIZED_LOADER_FIXED_BUFFERS", "off");
    EXPECT_FALSE(engine->register_buffers({{buf.data(), buf.size()}}, why_not));
    EXPECT_EQ(why_not, "OPTIMIZED_LOADER_FIXED_BUFFERS=off");
  }
  // The pread engine has none.
  loader::WorkerPool pool(1);
  std::unique_ptr<loader::IoEngine> pread = loader::make_pread_engine(pool, files, [](auto&, int64_t) {});
  EXPECT_FALSE(pread->register_buffers({{buf.data(), buf.size()}}, why_not));
  EXPECT_TRUE(contains_all(why_not, {"pread", "no fixed buffers"})) << why_not;
}

// ---- coalescing read plans ----------------------------------------------------------------------

// Carries out a plan on in-memory "files" (byte j of shard s is a hash of (s, j)) and checks that
// every record is where record_src says, that reads are aligned and inside the files, and that no
// staging byte is written twice.
::testing::AssertionResult plan_delivers(const DatasetInfo& info, const std::vector<uint64_t>& ids,
                                         const loader::ReadPlan& plan) {
  auto file_byte = [](uint32_t s, uint64_t j) { return static_cast<uint8_t>(loader_test::mix64(s * 1000003ull + j)); };
  std::vector<uint8_t> staging(plan.staging_bytes, 0);
  std::vector<uint8_t> written(plan.staging_bytes, 0);
  uint64_t read = 0;
  for (const loader::ReadChunk& c : plan.chunks) {
    if (c.file_offset % 4096 || c.bytes % 4096 || c.staging_offset % 4096)
      return ::testing::AssertionFailure() << "unaligned read at " << c.file_offset;
    if (c.file_offset + c.bytes > info.shards[c.shard].file_bytes)
      return ::testing::AssertionFailure() << "read past the end of shard " << c.shard;
    if (c.staging_offset + c.bytes > plan.staging_bytes) return ::testing::AssertionFailure() << "read past staging";
    for (uint64_t j = 0; j < c.bytes; ++j) {
      if (written[c.staging_offset + j]++) return ::testing::AssertionFailure() << "staging byte written twice";
      staging[c.staging_offset + j] = file_byte(c.shard, c.file_offset + j);
    }
    read += c.bytes;
  }
  if (read != plan.read_bytes) return ::testing::AssertionFailure() << "read_bytes " << plan.read_bytes << " != " << read;
  const uint64_t r = info.record_bytes;
  for (size_t k = 0; k < ids.size(); ++k) {
    const uint32_t s = plan.record_shard[k];
    const ShardInfo& sh = info.shards[s];
    if (ids[k] < sh.first_record || ids[k] >= sh.first_record + sh.record_count)
      return ::testing::AssertionFailure() << "record " << ids[k] << " placed in shard " << s;
    const uint64_t at = sh.data_offset + (ids[k] - sh.first_record) * r;
    for (uint64_t j = 0; j < r; ++j)
      if (staging[plan.record_src[k] + j] != file_byte(s, at + j))
        return ::testing::AssertionFailure() << "batch record " << k << " (dataset record " << ids[k]
                                             << ") wrong at byte " << j;
  }
  // The placements copy each run's records to their batch positions.
  for (const loader::Placement& p : plan.placements) {
    const size_t first = p.dst / r;
    if (p.src != plan.record_src[first]) return ::testing::AssertionFailure() << "placement src";
  }
  return ::testing::AssertionSuccess();
}

TEST(ReadPlanCoalescing, ShuffledBatchesReadFewerRangesAndExactlyTheirRecords) {
  std::mt19937_64 rng(17);
  for (uint64_t r : {1ull, 13ull, 1000ull, 4095ull, 4097ull, 12345ull}) {
    const uint64_t per_shard = std::max<uint64_t>(3, (1u << 20) / r / 2);
    const DatasetInfo info = fake_info(r, {per_shard, per_shard / 3 + 1, per_shard});
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<uint64_t> ids(info.num_records);
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng);
      ids.resize(std::min<uint64_t>(ids.size(), 1 + rng() % 200));
      const uint64_t capacity =
          loader::staging_capacity(ids.size(), r, 4096, ids.size(), loader::aligned_data_bytes(info));
      loader::ReadPlan exact, coalesced;
      loader::plan_batch(info, ids, 4096, 64 * 1024, exact);
      loader::plan_batch(info, ids, 4096, 64 * 1024, coalesced, loader::kCoalesceGapBytes, capacity);
      ASSERT_TRUE(plan_delivers(info, ids, exact)) << "r " << r;
      ASSERT_TRUE(plan_delivers(info, ids, coalesced)) << "r " << r;
      EXPECT_LE(coalesced.staging_bytes, capacity) << "r " << r;
      EXPECT_LE(coalesced.chunks.size(), exact.chunks.size()) << "r " << r;
      EXPECT_GE(coalesced.read_bytes, exact.read_bytes);
      EXPECT_EQ(coalesced.placements.size(), exact.placements.size());
    }
  }
}

TEST(ReadPlanCoalescing, GapsWithinTheLimitAndSlackOnly) {
  // Records of 1000 bytes; 2 and 20 are 17 records (17000 bytes) apart: within one 32 KiB gap.
  const DatasetInfo info = fake_info(1000, {100});
  const std::vector<uint64_t> ids = {20, 2};
  loader::ReadPlan plan;
  loader::plan_batch(info, ids, 4096, 1 << 20, plan);
  ASSERT_EQ(plan.chunks.size(), 2u);  // no coalescing asked for
  const uint64_t exact = plan.staging_bytes;
  loader::plan_batch(info, ids, 4096, 1 << 20, plan, loader::kCoalesceGapBytes);
  ASSERT_EQ(plan.chunks.size(), 1u);  // one read of both and the gap
  EXPECT_GT(plan.staging_bytes, exact);
  EXPECT_TRUE(plan_delivers(info, ids, plan));
  EXPECT_EQ(plan.placements.size(), 2u);
  // No slack in the limit: the two reads stay two.
  loader::plan_batch(info, ids, 4096, 1 << 20, plan, loader::kCoalesceGapBytes, exact);
  EXPECT_EQ(plan.chunks.size(), 2u);
  EXPECT_EQ(plan.staging_bytes, exact);
  EXPECT_TRUE(plan_delivers(info, ids, plan));
  // A gap larger than max_gap, or another shard, is never crossed.
  const DatasetInfo two = fake_info(1000, {100, 100});
  loader::plan_batch(two, {99, 100}, 4096, 1 << 20, plan, loader::kCoalesceGapBytes);
  EXPECT_EQ(plan.chunks.size(), 2u);
  loader::plan_batch(info, {0, 90}, 4096, 1 << 20, plan, loader::kCoalesceGapBytes);
  EXPECT_EQ(plan.chunks.size(), 2u);
  // A coalesced range longer than chunk_bytes is split into aligned reads of at most chunk_bytes.
  loader::plan_batch(info, {0, 20, 40, 60}, 4096, 8192, plan, loader::kCoalesceGapBytes);
  for (const loader::ReadChunk& c : plan.chunks) EXPECT_LE(c.bytes, 8192u);
  EXPECT_TRUE(plan_delivers(info, {0, 20, 40, 60}, plan));
}

// ---- defaults ----------------------------------------------------------------------------------

TEST(LoaderReadDefaults, FromTheBlockDevice) {
  loader::BlockQueue virtio{"vda", 512, 4096 * 1024, 256, 0};
  loader::ReadDefaults d = loader::default_reads(virtio, true);
  EXPECT_EQ(d.chunk_bytes, 4u << 20);
  EXPECT_EQ(d.queue_depth, 32);
  EXPECT_TRUE(contains_all(d.why, {"vda", "4096 KiB", "nr_requests 256"})) << d.why;
  loader::BlockQueue nvme{"nvme0n1", 512, 128 * 1024, 1023, 0};
  d = loader::default_reads(nvme, true);
  EXPECT_EQ(d.chunk_bytes, 1u << 20);
  EXPECT_EQ(d.queue_depth, 128);
  loader::BlockQueue shallow{"sdb", 4096, 512 * 1024, 16, 1};
  d = loader::default_reads(shallow, true);
  EXPECT_EQ(d.chunk_bytes, 4u << 20);
  EXPECT_EQ(d.queue_depth, 16);  // no deeper than the device queues
  d = loader::default_reads(loader::BlockQueue{}, true);  // no block device (overlay, tmpfs)
  EXPECT_EQ(d.chunk_bytes, 4u << 20);
  EXPECT_EQ(d.queue_depth, 32);
  EXPECT_TRUE(contains_all(d.why, {"no block device"})) << d.why;
  d = loader::default_reads(virtio, false);  // buffered: the old defaults
  EXPECT_EQ(d.chunk_bytes, 1u << 20);
  EXPECT_EQ(d.queue_depth, 32);
  // The file's own device: whatever it is, sane values or none.
  TempDir tmp;
  { std::ofstream(tmp.sub("f")) << "x"; }
  const loader::BlockQueue q = loader::block_queue_of(tmp.sub("f"));
  if (!q.device.empty()) {
    EXPECT_GE(q.logical_block_bytes, 512u);
    EXPECT_GE(q.max_request_bytes, 4096u);
  }
  EXPECT_TRUE(loader::block_queue_of(tmp.sub("missing")).device.empty());
}

TEST(LoaderReadDefaults, NotesSayWhatWasPickedAndExplicitValuesStay) {
  TempDir tmp;
  if (const std::string why = direct_io_unavailable(tmp.path()); !why.empty()) GTEST_SKIP() << why;
  write_dataset(tmp.sub("ds"), make_records(20, 5000), 5000, 10);
  LoaderOptions o;
  o.batch_size = 4;
  o.io = IoBackend::kIoUring;
  o.direct_io = DirectIo::kOn;
  {
    Loader loader(tmp.sub("ds"), o);
    if (loader.io_backend() != "io_uring") GTEST_SKIP() << joined(loader.notes());
    const std::string said = joined(loader.notes());
    EXPECT_NE(said.find("loader reads: io_uring with O_DIRECT, "), std::string::npos) << said;
    EXPECT_NE(said.find("(automatic: "), std::string::npos) << said;
    EXPECT_NE(said.find("ranges under 32 KiB apart coalesced"), std::string::npos) << said;
  }
  o.queue_depth = 7;
  o.chunk_bytes = 8192;
  Loader loader(tmp.sub("ds"), o);
  const std::string said = joined(loader.notes());
  EXPECT_NE(said.find("7 reads in flight of up to 8 KiB"), std::string::npos) << said;
  EXPECT_EQ(said.find("(automatic: "), std::string::npos) << said;
  o.queue_depth = -1;
  EXPECT_TRUE(contains_all(error_of([&] { Loader bad(tmp.sub("ds"), o); }), {"queue_depth", "0 (automatic)", "-1"}));
}

}  // namespace
}  // namespace optimized
