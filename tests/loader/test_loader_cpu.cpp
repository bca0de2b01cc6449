// The loader end to end on the CPU device (no GPU needed): every record exactly once per epoch in
// the expected order or permutation, byte-exact, over record sizes that are and are not multiples
// of 4 KiB, one shard and many, io_uring and pread, O_DIRECT and buffered; rank sharding; epochs;
// resume from a position; errors named by file and record, with nothing skipped after them; and a
// stopped loader releasing its threads while handed-out batches stay valid.
#include <dirent.h>

#include <algorithm>
#include <chrono>
#include <set>
#include <thread>

#include "loader_test_util.h"

namespace optimized {
namespace {

using namespace loader_test;

// Runs one epoch; checks bytes and returns the indices in order.
std::vector<uint64_t> run_epoch(Loader& loader, const std::vector<uint8_t>& data, uint64_t r,
                                std::vector<size_t>* batch_sizes = nullptr) {
  std::vector<uint64_t> ids;
  while (std::optional<Batch> b = loader.next()) {
    EXPECT_EQ(b->device(), Device::cpu());
    EXPECT_EQ(b->bytes(), b->indices().size() * r);
    EXPECT_TRUE(batch_matches(static_cast<const uint8_t*>(b->data()), b->indices(), data, r));
    ids.insert(ids.end(), b->indices().begin(), b->indices().end());
    if (batch_sizes) batch_sizes->push_back(b->indices().size());
  }
  return ids;
}

int thread_count() {
  int n = 0;
  if (DIR* d = ::opendir("/proc/self/task")) {
    while (const dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
    ::closedir(d);
  }
  return n;
}

// io_uring's kernel workers show up as threads of the process and leave shortly after the ring.
int settled_thread_count(int expect) {
  int n = thread_count();
  for (int i = 0; i < 200 && n != expect; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    n = thread_count();
  }
  return n;
}

struct Case {
  uint64_t record_bytes;
  uint64_t records;
  uint64_t per_shard;
};

class LoaderCpu : public ::testing::TestWithParam<std::tuple<Case, std::string, std::string>> {};

TEST_P(LoaderCpu, EveryRecordOncePerEpochByteExact) {
  const auto& [c, io, direct] = GetParam();
  TempDir tmp;
  if (direct == "on") {
    const std::string why = direct_io_unavailable(tmp.path());
    if (!why.empty()) GTEST_SKIP() << "O_DIRECT unavailable in " << tmp.path() << ": " << why;
  }
  const std::vector<uint8_t> data = make_records(c.records, c.record_bytes);
  write_dataset(tmp.sub("ds"), data, c.record_bytes, c.per_shard);
  if (io == "mmap" && direct == "on") {  // mmap reads the page cache: O_DIRECT makes no sense with it
    LoaderOptions o;
    o.io = IoBackend::kMmap;
    o.direct_io = DirectIo::kOn;
    EXPECT_TRUE(contains_all(error_of([&] { Loader(tmp.sub("ds"), o); }), {"io=mmap", "direct_io"}));
    return;
  }
  for (bool shuffle : {false, true}) {
    LoaderOptions o;
    o.batch_size = 7;
    o.shuffle = shuffle;
    o.seed = 11;
    o.io = parse_io_backend(io);
    o.direct_io = parse_direct_io(direct);
    o.chunk_bytes = 64 * 1024;  // several reads per run
    o.prefetch = 3;
    o.threads = 3;
    o.epochs = 2;
    Loader loader(tmp.sub("ds"), o);
    if (io != "pread" && loader.io_backend() != io)
      GTEST_SKIP() << io << " unavailable here: " << (loader.notes().empty() ? "" : loader.notes().front());
    EXPECT_EQ(loader.direct_io(), direct == "on");
    EXPECT_EQ(loader.batches_per_epoch(), (c.records + 6) / 7);
    for (uint64_t epoch = 0; epoch < 2; ++epoch) {
      std::vector<size_t> sizes;
      const std::vector<uint64_t> ids = run_epoch(loader, data, c.record_bytes, &sizes);
      EXPECT_EQ(ids, loader_epoch_order(c.records, o, epoch)) << "epoch " << epoch;
      std::vector<uint64_t> sorted = ids;
      std::sort(sorted.begin(), sorted.end());
      for (uint64_t i = 0; i < c.records; ++i) ASSERT_EQ(sorted[i], i) << "record " << i << " missing or repeated";
      EXPECT_EQ(sorted.size(), c.records);
      for (size_t k = 0; k + 1 < sizes.size(); ++k) EXPECT_EQ(sizes[k], 7u);
    }
    EXPECT_FALSE(loader.next().has_value());  // epochs = 2: done
    EXPECT_FALSE(loader.next().has_value());
    const LoaderStats st = loader.stats();
    EXPECT_EQ(st.record_bytes, 2 * c.records * c.record_bytes);
    EXPECT_GE(st.read_bytes, st.record_bytes);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Sizes, LoaderCpu,
    ::testing::Combine(::testing::Values(Case{1, 50, 50}, Case{13, 61, 10}, Case{4095, 40, 7}, Case{4096, 30, 30},
                                         Case{4097, 33, 5}, Case{12345, 20, 1}, Case{150528, 9, 4}),
                       ::testing::Values("pread", "io_uring", "mmap"), ::testing::Values("on", "off")),
    [](const auto& info) {
      const Case& c = std::get<0>(info.param);
      return "r" + std::to_string(c.record_bytes) + "_n" + std::to_string(c.records) + "_s" +
             std::to_string(c.per_shard) + "_" + std::get<1>(info.param) + "_direct_" + std::get<2>(info.param);
    });

TEST(LoaderCpuDefaults, SaysWhatItPicked) {
  TempDir tmp;
  write_dataset(tmp.sub("ds"), make_records(20, 100), 100, 10);
  LoaderOptions o;
  o.batch_size = 4;
  Loader loader(tmp.sub("ds"), o);
  std::string said;
  for (const std::string& s : loader.notes()) said += s + "\n";
  const std::string threads = std::to_string(std::clamp(static_cast<int>(std::thread::hardware_concurrency()) * 3 / 4, 2, 32));
  EXPECT_NE(said.find("loader: io=" + loader.io_backend()), std::string::npos) << said;
  EXPECT_NE(said.find(threads + " worker threads (of " + std::to_string(std::thread::hardware_concurrency())),
            std::string::npos)
      << said;
  EXPECT_EQ(said.find("io=mmap"), std::string::npos) << said;  // the CPU device keeps its reads
  o.threads = 3;
  o.io = IoBackend::kPread;
  Loader forced(tmp.sub("ds"), o);
  for (const std::string& s : forced.notes()) EXPECT_EQ(s.find("loader: io="), std::string::npos) << s;
}

TEST(LoaderCpuRanks, ShardingCoversTheDatasetWithoutOverlap) {
  TempDir tmp;
  const uint64_t n = 101, r = 300;
  const std::vector<uint8_t> data = make_records(n, r);
  write_dataset(tmp.sub("ds"), data, r, 17);
  for (bool shuffle : {false, true}) {
    std::vector<int> seen(n, 0);
    for (int rank = 0; rank < 4; ++rank) {
      LoaderOptions o;
      o.batch_size = 8;
      o.shuffle = shuffle;
      o.seed = 5;
      o.rank = rank;
      o.world_size = 4;
      Loader loader(tmp.sub("ds"), o);
      const std::vector<uint64_t> ids = run_epoch(loader, data, r);
      EXPECT_EQ(ids, loader_epoch_order(n, o, 0));
      EXPECT_EQ(ids.size(), loader.records_per_epoch());
      for (uint64_t id : ids) ++seen[id];
    }
    for (uint64_t i = 0; i < n; ++i) EXPECT_EQ(seen[i], 1) << "record " << i << " shuffle " << shuffle;
  }
}

TEST(LoaderCpuRanks, DropLast) {
  TempDir tmp;
  const uint64_t n = 50, r = 64;
  const std::vector<uint8_t> data = make_records(n, r);
  write_dataset(tmp.sub("ds"), data, r, 50);
  for (int rank = 0; rank < 3; ++rank) {
    LoaderOptions o;
    o.batch_size = 4;
    o.rank = rank;
    o.world_size = 3;
    o.drop_last = true;
    Loader loader(tmp.sub("ds"), o);
    std::vector<size_t> sizes;
    run_epoch(loader, data, r, &sizes);
    EXPECT_EQ(sizes, std::vector<size_t>(4, 4u)) << "rank " << rank;  // floor(50 / 3 / 4) = 4 full batches
  }
}

TEST(LoaderCpuEpochs, EachEpochHasItsOwnPermutationAndPrefetchCrossesEpochs) {
  TempDir tmp;
  const uint64_t n = 64, r = 100;
  const std::vector<uint8_t> data = make_records(n, r);
  write_dataset(tmp.sub("ds"), data, r, 10);
  LoaderOptions o;
  o.batch_size = 10;  // a short last batch
  o.shuffle = true;
  o.seed = 3;
  o.prefetch = 16;    // more than one epoch ahead
  Loader loader(tmp.sub("ds"), o);
  std::vector<uint64_t> e0 = run_epoch(loader, data, r);
  std::vector<uint64_t> e1 = run_epoch(loader, data, r);
  EXPECT_EQ(e0, loader_epoch_order(n, o, 0));
  EXPECT_EQ(e1, loader_epoch_order(n, o, 1));
  EXPECT_NE(e0, e1);
  EXPECT_EQ(loader.position(), (LoaderPosition{2, 0}));
}

TEST(LoaderCpuResume, FromAPositionContinuesTheSameSequence) {
  TempDir tmp;
  const uint64_t n = 45, r = 777;
  const std::vector<uint8_t> data = make_records(n, r);
  write_dataset(tmp.sub("ds"), data, r, 8);
  LoaderOptions o;
  o.batch_size = 4;
  o.shuffle = true;
  o.seed = 77;
  // The uninterrupted sequence of three epochs (with the epoch ends as -1).
  auto sequence = [&](Loader& l, int batches) {
    std::vector<int64_t> out;
    for (int i = 0; i < batches; ++i) {
      std::optional<Batch> b = l.next();
      if (!b) {
        out.push_back(-1);
        continue;
      }
      EXPECT_TRUE(batch_matches(static_cast<const uint8_t*>(b->data()), b->indices(), data, r));
      for (uint64_t id : b->indices()) out.push_back(static_cast<int64_t>(id));
    }
    return out;
  };
  Loader full(tmp.sub("ds"), o);
  const std::vector<int64_t> all = sequence(full, 3 * 13);  // 12 batches + the end, per epoch

  for (int stop_after : {0, 1, 5, 12, 13, 14, 20}) {
    Loader first(tmp.sub("ds"), o);
    std::vector<int64_t> got = sequence(first, stop_after);
    const LoaderPosition p = first.position();
    first.stop();
    LoaderOptions resumed = o;
    resumed.start = p;
    Loader second(tmp.sub("ds"), resumed);
    const std::vector<int64_t> rest = sequence(second, 3 * 13 - stop_after);
    got.insert(got.end(), rest.begin(), rest.end());
    EXPECT_EQ(got, all) << "stopped after " << stop_after << " calls at epoch " << p.epoch << " batch " << p.batch;
  }
  // seek() on a live loader does the same.
  Loader l(tmp.sub("ds"), o);
  sequence(l, 7);
  l.seek({0, 2});
  std::vector<int64_t> got = sequence(l, 3 * 13 - 2);
  EXPECT_EQ(got, std::vector<int64_t>(all.begin() + 8, all.end()));  // batches 0, 1 hold 8 records
}

TEST(LoaderCpuVariants, SynchronousDeliversTheSameBatches) {
  TempDir tmp;
  const uint64_t n = 30, r = 5000;
  const std::vector<uint8_t> data = make_records(n, r);
  write_dataset(tmp.sub("ds"), data, r, 7);
  LoaderOptions o;
  o.batch_size = 4;
  o.shuffle = true;
  o.variant = LoaderVariant::kSynchronous;
  Loader loader(tmp.sub("ds"), o);
  EXPECT_EQ(run_epoch(loader, data, r), loader_epoch_order(n, o, 0));
  EXPECT_EQ(parse_loader_variant(loader_variant_name(LoaderVariant::kPipelined)), LoaderVariant::kPipelined);
}

TEST(LoaderCpuErrors, CorruptedRecordIsNamedAndNothingIsSkipped) {
  TempDir tmp;
  const uint64_t n = 40, r = 1000;
  const std::vector<uint8_t> data = make_records(n, r);
  write_dataset(tmp.sub("ds"), data, r, 10);
  const std::string file = tmp.sub("ds") + "/" + shard_file_name(2);
  corrupt(file, kShardHeaderBytes + 3 * r + 10);  // shard 2, record 3 = dataset record 23
  for (const char* io : {"pread", "io_uring", "mmap"}) {
    LoaderOptions o;
    o.batch_size = 5;
    o.io = parse_io_backend(io);
    o.prefetch = 8;
    Loader loader(tmp.sub("ds"), o);
    std::vector<uint64_t> ids;
    std::string error;
    try {
      while (std::optional<Batch> b = loader.next()) ids.insert(ids.end(), b->indices().begin(), b->indices().end());
    } catch (const Error& e) {
      error = e.what();
    }
    EXPECT_TRUE(contains_all(error, {file, "record 3 (dataset record 23", "checksum mismatch"})) << io;
    // Every batch before the broken one (records 0..19), none after.
    std::vector<uint64_t> expect(20);
    for (uint64_t i = 0; i < 20; ++i) expect[i] = i;
    EXPECT_EQ(ids, expect) << io;
    // The loader keeps failing until seek().
    EXPECT_TRUE(contains_all(error_of([&] { loader.next(); }), {"record 3 (dataset record 23"}));
    loader.seek({0, 5});
    std::optional<Batch> b = loader.next();
    ASSERT_TRUE(b.has_value());
    EXPECT_EQ(b->indices().front(), 25u);
  }
  // verify=false delivers the record as it is on disk.
  LoaderOptions o;
  o.batch_size = 5;
  o.verify = false;
  Loader loader(tmp.sub("ds"), o);
  uint64_t batches = 0;
  while (loader.next()) ++batches;
  EXPECT_EQ(batches, 8u);
}

TEST(LoaderCpuErrors, BrokenDatasetsFailAtConstruction) {
  TempDir tmp;
  const std::vector<uint8_t> data = make_records(20, 100);
  write_dataset(tmp.sub("ds"), data, 100, 5);
  LoaderOptions o;
  o.batch_size = 4;
  const std::string shard1 = tmp.sub("ds") + "/" + shard_file_name(1);
  const ShardInfo s1 = open_dataset(tmp.sub("ds")).shards[1];
  corrupt(shard1, s1.table_offset);  // the checksum table: caught when the loader reads it
  EXPECT_TRUE(contains_all(error_of([&] { Loader(tmp.sub("ds"), o); }), {shard1, "shard checksum mismatch"}));
  truncate_file(shard1, kShardHeaderBytes + 250);
  EXPECT_TRUE(contains_all(error_of([&] { Loader(tmp.sub("ds"), o); }), {shard1, "truncated", "record 2 (dataset record 7)"}));
  ::unlink(shard1.c_str());
  EXPECT_TRUE(contains_all(error_of([&] { Loader(tmp.sub("ds"), o); }), {shard1, "missing"}));
}

TEST(LoaderCpuErrors, Arguments) {
  TempDir tmp;
  write_dataset(tmp.sub("ds"), make_records(10, 8), 8, 10);
  auto with = [&](auto change) {
    LoaderOptions o;
    o.batch_size = 2;
    change(o);
    return error_of([&] { Loader(tmp.sub("ds"), o); });
  };
  EXPECT_TRUE(contains_all(with([](LoaderOptions& o) { o.batch_size = 0; }), {"batch_size", ">= 1", "0"}));
  EXPECT_TRUE(contains_all(with([](LoaderOptions& o) { o.rank = 2; o.world_size = 2; }), {"rank", "[0, 2)", "given 2"}));
  EXPECT_TRUE(contains_all(with([](LoaderOptions& o) { o.world_size = 0; }), {"world_size"}));
  EXPECT_TRUE(contains_all(with([](LoaderOptions& o) { o.prefetch = 0; }), {"prefetch"}));
  EXPECT_TRUE(contains_all(with([](LoaderOptions& o) { o.chunk_bytes = 5000; }), {"chunk_bytes", "5000"}));
  EXPECT_TRUE(contains_all(with([](LoaderOptions& o) { o.start = {0, 6}; }), {"start", "batch 6", "5 batches"}));
  EXPECT_TRUE(contains_all(error_of([] { parse_io_backend("aio"); }), {"io", "aio"}));
  EXPECT_TRUE(contains_all(error_of([] { parse_gds_mode("yes"); }), {"gds", "yes"}));
  if (cuda_device_count() == 0) {
    EXPECT_TRUE(contains_all(with([](LoaderOptions& o) { o.device = Device::cuda(0); }), {"device"}));
  }
}

TEST(LoaderCpuLifetime, StopReleasesThreadsAndBatchesOutliveTheLoader) {
  TempDir tmp;
  const uint64_t n = 200, r = 4000;
  const std::vector<uint8_t> data = make_records(n, r);
  write_dataset(tmp.sub("ds"), data, r, 50);
  const int before = thread_count();
  std::vector<Batch> kept;
  {
    LoaderOptions o;
    o.batch_size = 8;
    o.threads = 4;
    o.prefetch = 6;
    Loader loader(tmp.sub("ds"), o);
    EXPECT_GE(thread_count(), before + 5);  // the producer and the pool (and io_uring's thread)
    for (int i = 0; i < 3; ++i) kept.push_back(*loader.next());
    // Destroyed with batches in flight.
  }
  EXPECT_EQ(settled_thread_count(before), before);
  for (const Batch& b : kept)
    EXPECT_TRUE(batch_matches(static_cast<const uint8_t*>(b.data()), b.indices(), data, r));
  // stop() then next(): a clear error, not a hang.
  LoaderOptions o;
  o.batch_size = 8;
  Loader loader(tmp.sub("ds"), o);
  loader.next();
  loader.stop();
  loader.stop();
  EXPECT_EQ(settled_thread_count(before), before);
  EXPECT_TRUE(contains_all(error_of([&] { loader.next(); }), {"stopped"}));
}

TEST(LoaderCpuLifetime, ManyLoadersOneAfterAnother) {
  TempDir tmp;
  const std::vector<uint8_t> data = make_records(30, 100);
  write_dataset(tmp.sub("ds"), data, 100, 30);
  for (int i = 0; i < 20; ++i) {
    LoaderOptions o;
    o.batch_size = 3;
    o.prefetch = 1 + i % 4;
    Loader loader(tmp.sub("ds"), o);
    for (int k = 0; k < i % 5; ++k) loader.next();
  }
}

TEST(LoaderCpuReadBandwidth, ReadsEveryByteOfEveryShard) {
  TempDir tmp;
  const DatasetInfo info = write_dataset(tmp.sub("ds"), make_records(50, 3000), 3000, 17);
  uint64_t total = 0;
  for (const ShardInfo& s : info.shards) total += s.file_bytes;
  const bool direct = direct_io_unavailable(tmp.path()).empty();
  for (IoBackend io : {IoBackend::kIoUring, IoBackend::kPread}) {
    const ReadBandwidth r = measure_read_bandwidth(tmp.sub("ds"), io, 3, 8192, 0, direct);
    EXPECT_EQ(r.bytes, total);
    EXPECT_GT(r.seconds, 0.0);
    if (io == IoBackend::kPread) {
      EXPECT_EQ(r.io, "pread");
    }
  }
  EXPECT_LE(measure_read_bandwidth(tmp.sub("ds"), IoBackend::kPread, 2, 8192, 16384, direct).bytes, 16384u);
  EXPECT_TRUE(contains_all(error_of([&] { measure_read_bandwidth(tmp.sub("ds"), IoBackend::kPread, 2, 100, 0); }),
                       {"chunk_bytes"}));
}

TEST(LoaderCpuEmpty, DatasetWithoutRecordsEndsEveryEpochAtOnce) {
  TempDir tmp;
  ShardWriter w(tmp.sub("ds"), "int64", {2}, 4);
  w.close();
  LoaderOptions o;
  o.batch_size = 3;
  Loader loader(tmp.sub("ds"), o);
  EXPECT_EQ(loader.batches_per_epoch(), 0u);
  EXPECT_FALSE(loader.next().has_value());
  EXPECT_EQ(loader.position(), (LoaderPosition{1, 0}));
}

}  // namespace
}  // namespace optimized
