// The loader against what a demanding user does to it, on the CPU (CI runs these): a loader used in
// a forked child (it continues there, never hangs); a shard truncated under an io=mmap loader (an
// error naming the file, never SIGBUS); staging sized by the dataset and a byte budget, not by
// batch_size alone; a ShardWriter left by an exception (the dataset stays visibly incomplete);
// more shards than the process may open files; the dataset fingerprint that resuming checks; and
// worker interleaving. Whatever could hang or crash runs in a forked child with a deadline.
#include <sys/mman.h>
#include <sys/resource.h>

#include <algorithm>
#include <set>

#include "loader/mmap_guard.h"
#include "loader_test_util.h"

namespace optimized {
namespace {

using namespace loader_test;

// The batches of `loader` until the end of the epoch: their indices, in order; -1 when a batch's
// bytes are wrong.
std::vector<int64_t> drain_epoch(Loader& loader, const std::vector<uint8_t>& data, uint64_t r) {
  std::vector<int64_t> ids;
  while (std::optional<Batch> b = loader.next()) {
    if (!batch_matches(static_cast<const uint8_t*>(b->data()), b->indices(), data, r)) ids.push_back(-1);
    for (uint64_t id : b->indices()) ids.push_back(static_cast<int64_t>(id));
  }
  return ids;
}

std::vector<int64_t> as_signed(const std::vector<uint64_t>& v) { return {v.begin(), v.end()}; }

// ---- 1. fork ----------------------------------------------------------------------------------

class LoaderFork : public ::testing::TestWithParam<std::string> {};

TEST_P(LoaderFork, ChildContinuesWhereTheParentWasAndTheParentGoesOn) {
  const std::string io = GetParam();
  TempDir tmp;
  const uint64_t n = 57, r = 700;
  const std::vector<uint8_t> data = make_records(n, r);
  write_dataset(tmp.sub("ds"), data, r, 9);
  LoaderOptions o;
  o.batch_size = 5;  // 12 batches per epoch
  o.shuffle = true;
  o.seed = 4;
  o.prefetch = 3;
  o.threads = 2;
  o.io = parse_io_backend(io);
  o.epochs = 2;
  Loader loader(tmp.sub("ds"), o);
  if (io != "pread" && loader.io_backend() != io) GTEST_SKIP() << io << " unavailable here";
  // The parent takes 3 batches (more are in flight when it forks).
  std::vector<int64_t> before;
  for (int i = 0; i < 3; ++i) {
    std::optional<Batch> b = loader.next();
    ASSERT_TRUE(b.has_value());
    for (uint64_t id : b->indices()) before.push_back(static_cast<int64_t>(id));
  }
  const std::vector<int64_t> epoch0 = as_signed(loader_epoch_order(n, o, 0));
  const std::vector<int64_t> epoch1 = as_signed(loader_epoch_order(n, o, 1));
  const std::vector<int64_t> rest0(epoch0.begin() + 15, epoch0.end());
  ASSERT_EQ(before, std::vector<int64_t>(epoch0.begin(), epoch0.begin() + 15));

  const ChildResult child = run_in_child([&] {
    // What the parent would have read next: the rest of epoch 0, then epoch 1, then the end.
    CHILD_EXPECT(loader.position() == (LoaderPosition{0, 3}), 2);
    CHILD_EXPECT(drain_epoch(loader, data, r) == rest0, 3);
    CHILD_EXPECT(drain_epoch(loader, data, r) == epoch1, 4);
    CHILD_EXPECT(!loader.next().has_value(), 5);
    CHILD_EXPECT(loader.stats().batches == 12 + 12 - 3, 6);
    // seek and stop work in the child's own pipeline.
    loader.seek({1, 10});
    CHILD_EXPECT(drain_epoch(loader, data, r) == std::vector<int64_t>(epoch1.begin() + 50, epoch1.end()), 7);
    loader.stop();
    return 0;
  });
  EXPECT_TRUE(child.ok()) << child.describe();
  // The parent's loader is untouched by the child.
  EXPECT_EQ(drain_epoch(loader, data, r), rest0);
  EXPECT_EQ(drain_epoch(loader, data, r), epoch1);
}

INSTANTIATE_TEST_SUITE_P(Io, LoaderFork, ::testing::Values("pread", "io_uring", "mmap"));

// Whether next() on a stopped loader refuses with an error that says so.
bool next_says_stopped(Loader& loader) {
  try {
    loader.next();
  } catch (const Error& e) {
    return std::string(e.what()).find("stopped") != std::string::npos;
  }
  return false;
}

TEST(LoaderForkLifetime, ChildDestroysOrStopsTheInheritedLoader) {
  TempDir tmp;
  const uint64_t n = 40, r = 100;
  write_dataset(tmp.sub("ds"), make_records(n, r), r, 10);
  LoaderOptions o;
  o.batch_size = 4;
  o.prefetch = 4;
  auto loader = std::make_unique<Loader>(tmp.sub("ds"), o);
  loader->next();
  // Destroying it in the child must not wait for the parent's threads (they are not in the child).
  ChildResult child = run_in_child([&] {
    loader.reset();
    return 0;
  });
  EXPECT_TRUE(child.ok()) << child.describe();
  child = run_in_child([&] {
    loader->stop();
    CHILD_EXPECT(next_says_stopped(*loader), 2);
    loader.reset();
    return 0;
  });
  EXPECT_TRUE(child.ok()) << child.describe();
  // A loader stopped before the fork stays stopped in the child.
  loader->stop();
  child = run_in_child([&] {
    CHILD_EXPECT(next_says_stopped(*loader), 2);
    return 0;
  });
  EXPECT_TRUE(child.ok()) << child.describe();
}

// ---- worker interleaving ------------------------------------------------------------------------

TEST(LoaderWorkers, TakingOneBatchFromEachWorkerInTurnGivesTheSingleSequence) {
  TempDir tmp;
  const uint64_t n = 53, r = 64;
  const std::vector<uint8_t> data = make_records(n, r);
  write_dataset(tmp.sub("ds"), data, r, 7);
  for (int workers : {1, 2, 3, 5, 20}) {
    for (LoaderPosition start : {LoaderPosition{0, 0}, LoaderPosition{0, 4}, LoaderPosition{1, 13}}) {
      LoaderOptions o;
      o.batch_size = 4;  // 14 batches per epoch, the last one short
      o.shuffle = true;
      o.seed = 8;
      o.epochs = 3;
      o.start = start;
      // The single loader's batches (their first index) from `start`, with the epoch ends as -1.
      auto firsts = [&](Loader& l, std::vector<std::vector<int64_t>>& epochs) {
        epochs.emplace_back();
        while (true) {
          std::optional<Batch> b = l.next();
          if (!b) return;
          ASSERT_TRUE(batch_matches(static_cast<const uint8_t*>(b->data()), b->indices(), data, r));
          epochs.back().push_back(static_cast<int64_t>(b->indices().front()));
        }
      };
      Loader single(tmp.sub("ds"), o);
      std::vector<std::vector<int64_t>> expect;
      for (int e = static_cast<int>(start.epoch); e < 3; ++e) firsts(single, expect);

      std::vector<std::unique_ptr<Loader>> loaders;
      uint64_t records = 0, batches = 0;
      for (int w = 0; w < workers; ++w) {
        LoaderOptions ow = o;
        ow.worker = w;
        ow.num_workers = workers;
        loaders.push_back(std::make_unique<Loader>(tmp.sub("ds"), ow));
        records += loaders.back()->records_per_epoch();
        batches += loaders.back()->batches_per_epoch();
      }
      EXPECT_EQ(records, n);
      EXPECT_EQ(batches, single.batches_per_epoch());
      // Round robin, as torch's DataLoader takes from its workers; a worker at its epoch's end is
      // skipped until every worker is.
      for (size_t e = 0; e < expect.size(); ++e) {
        std::vector<int64_t> got;
        std::vector<bool> done(workers, false);
        int active = workers;
        for (int w = 0; active > 0; w = (w + 1) % workers) {
          if (done[w]) continue;
          std::optional<Batch> b = loaders[w]->next();
          if (!b) {
            done[w] = true;
            --active;
            continue;
          }
          ASSERT_TRUE(batch_matches(static_cast<const uint8_t*>(b->data()), b->indices(), data, r));
          got.push_back(static_cast<int64_t>(b->indices().front()));
        }
        EXPECT_EQ(got, expect[e]) << workers << " workers, start " << start.epoch << "/" << start.batch
                                  << ", epoch " << e;
      }
      for (auto& l : loaders) EXPECT_FALSE(l->next().has_value());
    }
  }
  LoaderOptions o;
  o.worker = 2;
  o.num_workers = 2;
  EXPECT_TRUE(contains_all(error_of([&] { Loader(tmp.sub("ds"), o); }), {"worker", "[0, 2)", "given 2"}));
}

// ---- 2. io=mmap and a truncated shard -----------------------------------------------------------

TEST(LoaderMmap, ShardTruncatedWhileOpenIsAnErrorNotACrash) {
  for (bool verify : {true, false}) {
    for (const char* io : {"mmap", "pread"}) {
      TempDir tmp;
      const uint64_t r = 1000;
      const std::vector<uint8_t> data = make_records(40, r);
      write_dataset(tmp.sub("ds"), data, r, 10);
      const std::string shard3 = tmp.sub("ds") + "/" + shard_file_name(3);
      const ChildResult child = run_in_child([&] {
        LoaderOptions o;
        o.batch_size = 5;
        o.prefetch = 2;
        o.io = parse_io_backend(io);
        o.direct_io = DirectIo::kOff;
        o.verify = verify;
        Loader loader(tmp.sub("ds"), o);
        CHILD_EXPECT(loader.io_backend() == io, 2);
        CHILD_EXPECT(loader.next().has_value(), 3);  // records 0..4; the loader reads ahead to 14
        truncate_file(shard3, kShardHeaderBytes + 2 * r + 500);  // overwritten in place, shorter
        std::string error;
        uint64_t batches = 1;
        try {
          while (loader.next()) ++batches;
        } catch (const Error& e) {
          error = e.what();
        }
        std::fprintf(stderr, "child (%s, verify %d): %s\n", io, verify, error.c_str());
        CHILD_EXPECT(batches == 6, 4);  // records 0..29, then the batch of shard 3
        CHILD_EXPECT(contains_all(error, {shard3, "truncated"}), 5);
        CHILD_EXPECT(contains_all(error, {"record 2 (dataset record 32"}), 6);
        return 0;
      });
      EXPECT_TRUE(child.ok()) << io << " verify " << verify << ": " << child.describe();
    }
  }
}

// The window between the size check and the reads: the guard turns the SIGBUS of a read past the
// end of a truncated mapping into an error, on the thread that read; elsewhere SIGBUS stays fatal.
TEST(LoaderMmap, GuardTurnsTheSigbusOfATruncatedMappingIntoAnError) {
  TempDir tmp;
  const std::string file = tmp.sub("f");
  {
    const std::vector<uint8_t> bytes = make_records(1, 3 * 4096);
    const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
    ::close(fd);
  }
  ChildResult child = run_in_child([&] {
    const int fd = ::open(file.c_str(), O_RDONLY);
    auto* p = static_cast<const volatile uint8_t*>(::mmap(nullptr, 3 * 4096, PROT_READ, MAP_SHARED, fd, 0));
    CHILD_EXPECT(p != MAP_FAILED, 2);
    truncate_file(file, 4096);
    uint8_t sink = 0;
    CHILD_EXPECT(loader::guarded([&] { sink ^= p[0]; }), 3);              // still in the file
    CHILD_EXPECT(!loader::guarded([&] { sink ^= p[2 * 4096 + 5]; }), 4);  // past its end: SIGBUS
    // Again, and from another thread: the handler stays armed, per thread.
    bool other = true;
    std::thread t([&] { other = loader::guarded([&] { sink ^= p[4096]; }); });
    t.join();
    CHILD_EXPECT(!other, 5);
    CHILD_EXPECT(loader::guarded([&] { sink ^= p[100]; }), 6);
    (void)sink;
    return 0;
  });
  EXPECT_TRUE(child.ok()) << child.describe();
  // Outside a guarded call, SIGBUS does what it did before the handler was there: the process ends.
  child = run_in_child([&] {
    const int fd = ::open(file.c_str(), O_RDONLY);
    auto* p = static_cast<const volatile uint8_t*>(::mmap(nullptr, 3 * 4096, PROT_READ, MAP_SHARED, fd, 0));
    CHILD_EXPECT(loader::guarded([&] { (void)p[0]; }), 2);  // installs the handler
    return static_cast<int>(p[2 * 4096]);                   // SIGBUS
  });
  EXPECT_EQ(child.signal, SIGBUS) << child.describe();
}

// ---- 3. staging memory ---------------------------------------------------------------------------

TEST(LoaderStaging, SizedByTheRecordsTheRankSeesNotByBatchSize) {
  TempDir tmp;
  const uint64_t r = 8192;
  const std::vector<uint8_t> data = make_records(20, r);
  write_dataset(tmp.sub("ds"), data, r, 20);
  LoaderOptions o;
  o.batch_size = 10'000'000;  // 82 GB of staging per slot if sized by batch_size
  Loader loader(tmp.sub("ds"), o);
  std::optional<Batch> b = loader.next();
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->records(), 20);
  EXPECT_TRUE(batch_matches(static_cast<const uint8_t*>(b->data()), b->indices(), data, r));
  EXPECT_FALSE(loader.next().has_value());
  EXPECT_LE(loader.staging_bytes(), 4u * (20 * r + 2 * 4096));
}

TEST(LoaderStaging, SmallShuffledRecordsNeedNoMoreThanTheDataset) {
  TempDir tmp;
  const uint64_t r = 8;
  const std::vector<uint8_t> data = make_records(3000, r);
  write_dataset(tmp.sub("ds"), data, r, 1000);
  for (const char* direct : {"auto", "off"}) {
    LoaderOptions o;
    o.batch_size = 65536;  // used to pin 4 slots x 65536 x 8 KiB = 2 GiB whatever the dataset
    o.shuffle = true;
    o.direct_io = parse_direct_io(direct);
    Loader loader(tmp.sub("ds"), o);
    // At most the dataset's pages (3 shards of 8000 bytes: 2 pages each) per slot.
    EXPECT_LE(loader.staging_bytes(), 4u * 3 * 8192) << direct;
    std::vector<int64_t> ids = drain_epoch(loader, data, r);
    EXPECT_EQ(ids, as_signed(loader_epoch_order(3000, o, 0))) << direct;
  }
}

TEST(LoaderStaging, TheByteBudget) {
  TempDir tmp;
  const uint64_t r = 64 * 1024;
  const std::vector<uint8_t> data = make_records(64, r);
  write_dataset(tmp.sub("ds"), data, r, 16);
  LoaderOptions o;
  o.batch_size = 16;  // 1 MiB of records per batch
  o.direct_io = DirectIo::kOff;
  o.prefetch = 4;
  o.staging_bytes = (5u << 20) / 2;  // 2.5 MiB: two slots
  {
    Loader loader(tmp.sub("ds"), o);
    EXPECT_EQ(loader.prefetch(), 2);
    EXPECT_LE(loader.staging_bytes(), o.staging_bytes);
    bool said = false;
    for (const std::string& s : loader.notes()) said |= s.find("prefetching 2 batches instead of 4") != std::string::npos;
    EXPECT_TRUE(said);
    EXPECT_EQ(drain_epoch(loader, data, r), as_signed(loader_epoch_order(64, o, 0)));
  }
  o.staging_bytes = 100 * 1024;  // less than one batch
  EXPECT_TRUE(contains_all(error_of([&] { Loader(tmp.sub("ds"), o); }),
                       {"batch_size", "16 records of 65536 bytes", "1048576 bytes", "staging_bytes = 102400"}));
  o.staging_bytes = 0;
  EXPECT_TRUE(contains_all(error_of([&] { Loader(tmp.sub("ds"), o); }), {"staging_bytes"}));
  // direct_io=auto over the budget only because of O_DIRECT's widening: reads through the page cache.
  const std::string why = direct_io_unavailable(tmp.path());
  if (why.empty()) {
    TempDir tiny;
    const std::vector<uint8_t> small = make_records(20000, 8);
    write_dataset(tiny.sub("ds"), small, 8, 20000);
    LoaderOptions t;
    t.batch_size = 2000;
    t.shuffle = true;
    t.staging_bytes = 4 * 2000 * 8;  // the records fit, their pages (2000 x 4 KiB) do not
    Loader loader(tiny.sub("ds"), t);
    EXPECT_FALSE(loader.direct_io());
    EXPECT_EQ(loader.prefetch(), 4);
    EXPECT_EQ(drain_epoch(loader, small, 8), as_signed(loader_epoch_order(20000, t, 0)));
  }
}

// ---- 5. an exception out of a ShardWriter's scope ------------------------------------------------

TEST(ShardWriterAbort, AnExceptionLeavesTheDatasetVisiblyIncomplete) {
  TempDir tmp;
  const std::string dir = tmp.sub("ds");
  const std::vector<uint8_t> data = make_records(25, 10);
  try {
    ShardWriter w(dir, "uint8", {10}, 10);
    w.append(data.data(), 25);  // two full shards and a partial one
    throw std::runtime_error("the data source failed");
  } catch (const std::runtime_error&) {
  }
  const std::string error = error_of([&] { open_dataset(dir); });
  EXPECT_TRUE(contains_all(error, {dir, "incomplete", "shards.incomplete", "aborted after 25 records",
                               "exception", "overwrite"}));
  LoaderOptions o;
  EXPECT_TRUE(contains_all(error_of([&] { Loader(dir, o); }), {dir, "incomplete"}));
  EXPECT_TRUE(contains_all(error_of([&] { verify_dataset(dir); }), {"incomplete"}));
  // Written again, it is whole and the marker is gone.
  {
    ShardWriter w(dir, "uint8", {10}, 10, /*overwrite=*/true);
    w.append(data.data(), 25);
    EXPECT_EQ(w.close().num_records, 25u);
  }
  EXPECT_NE(::access((dir + "/" + kIncompleteMarker).c_str(), F_OK), 0);
  EXPECT_EQ(open_dataset(dir).num_records, 25u);
}

TEST(ShardWriterAbort, ExplicitAbortAndUnfinishedWriters) {
  TempDir tmp;
  const std::vector<uint8_t> data = make_records(5, 3);
  {
    ShardWriter w(tmp.sub("a"), "uint8", {3}, 2);
    w.append(data.data(), 5);
    w.abort("the user pressed ctrl-c");
    w.abort();  // no effect
    EXPECT_TRUE(contains_all(error_of([&] { w.append(data.data(), 1); }), {"closed"}));
  }
  EXPECT_TRUE(contains_all(error_of([&] { open_dataset(tmp.sub("a")); }),
                       {"incomplete", "aborted after 5 records: the user pressed ctrl-c"}));
  // While a writer is open, its dataset cannot be opened.
  ShardWriter w(tmp.sub("b"), "uint8", {3}, 2);
  w.append(data.data(), 4);
  EXPECT_TRUE(contains_all(error_of([&] { open_dataset(tmp.sub("b")); }), {"incomplete", "being written"}));
  EXPECT_EQ(w.close().num_records, 4u);
  w.abort("after close: no effect");
  EXPECT_EQ(open_dataset(tmp.sub("b")).num_records, 4u);
}

// ---- 6. more shards than descriptors -------------------------------------------------------------

TEST(LoaderFiles, MoreShardsThanTheProcessMayOpenFiles) {
  TempDir tmp;
  const uint64_t n = 300, r = 600;
  const std::vector<uint8_t> data = make_records(n, r);
  write_dataset(tmp.sub("ds"), data, r, 2);  // 150 shards
  for (const char* io : {"pread", "io_uring", "mmap"}) {
    const ChildResult child = run_in_child([&] {
      rlimit rl{};
      ::getrlimit(RLIMIT_NOFILE, &rl);
      rl.rlim_cur = 64;  // fewer than the shards
      CHILD_EXPECT(::setrlimit(RLIMIT_NOFILE, &rl) == 0, 2);
      for (bool shuffle : {false, true}) {
        LoaderOptions o;
        o.batch_size = 7;
        o.shuffle = shuffle;
        o.io = parse_io_backend(io);
        o.queue_depth = 48;
        o.epochs = 1;
        Loader loader(tmp.sub("ds"), o);
        const std::vector<int64_t> ids = drain_epoch(loader, data, r);
        if (ids != as_signed(loader_epoch_order(n, o, 0))) {
          std::fprintf(stderr, "child: %s shuffle %d: %zu ids\n", io, shuffle, ids.size());
          return 3;
        }
      }
      const ReadBandwidth bw = measure_read_bandwidth(tmp.sub("ds"), IoBackend::kPread, 8, 8192, 0, false);
      CHILD_EXPECT(bw.bytes == 150 * 8192 + 150 * 4096, 4);
      return 0;
    }, 60);
    EXPECT_TRUE(child.ok()) << io << ": " << child.describe();
  }
}

// ---- 7. the dataset fingerprint ------------------------------------------------------------------

TEST(DatasetFingerprint, IdentifiesTheRecordsNotTheCopy) {
  TempDir tmp;
  const uint64_t r = 100;
  const std::vector<uint8_t> a = make_records(30, r, 1), b = make_records(30, r, 2);
  const uint64_t fa = dataset_fingerprint(write_dataset(tmp.sub("a"), a, r, 8));
  EXPECT_EQ(dataset_fingerprint(open_dataset(tmp.sub("a"))), fa);
  // The same records written again (another dataset id) or the files copied: the same fingerprint.
  EXPECT_EQ(dataset_fingerprint(write_dataset(tmp.sub("a2"), a, r, 8)), fa);
  ::mkdir(tmp.sub("copy").c_str(), 0755);
  for (const ShardInfo& s : open_dataset(tmp.sub("a")).shards) {
    const std::string to = tmp.sub("copy") + "/" + shard_file_name(s.index);
    ASSERT_EQ(::link(s.file.c_str(), to.c_str()), 0);
  }
  EXPECT_EQ(dataset_fingerprint(open_dataset(tmp.sub("copy"))), fa);
  // The same count of other records, other shard boundaries, or one changed byte: another one.
  EXPECT_NE(dataset_fingerprint(write_dataset(tmp.sub("b"), b, r, 8)), fa);
  EXPECT_NE(dataset_fingerprint(write_dataset(tmp.sub("c"), a, r, 10)), fa);
  std::vector<uint8_t> one = a;
  one[17 * r + 3] ^= 1;
  EXPECT_NE(dataset_fingerprint(write_dataset(tmp.sub("d"), one, r, 8)), fa);
}

}  // namespace
}  // namespace optimized
