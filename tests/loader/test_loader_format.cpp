// The dataset format and the loader's pure parts, no threads: CRC32C (known vectors, hardware vs
// portable, chaining), the shuffle permutation and rank split (bijection, coverage, no overlap),
// read plans (alignment, runs, odd record sizes, shared pages read once), the writer and open_dataset
// round trip, and every way a dataset can be broken (missing, extra, truncated, oversized shard;
// bad magic, header and table checksums; mixed datasets; a corrupted record), each named in the
// error. And the machine facts io=auto and threads=0 read (auto_config.h).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <set>

#include "loader/auto_config.h"
#include "loader/crc32c.h"
#include "loader/order.h"
#include "loader/read_plan.h"
#include "loader/shard_format.h"
#include "loader_test_util.h"

namespace optimized {
namespace {

using namespace loader_test;

// ---- the machine facts of the defaults -----------------------------------------------------------

TEST(LoaderAutoConfig, ThreadsAreThreeQuartersOfTheHardwareWithinBounds) {
  EXPECT_EQ(loader::default_threads(16), 12);  // the H100 host: 12 threads measured best (perf notes)
  EXPECT_EQ(loader::default_threads(2), 2);
  EXPECT_EQ(loader::default_threads(1), 2);
  EXPECT_EQ(loader::default_threads(0), 3);    // unknown: as for 4
  EXPECT_EQ(loader::default_threads(8), 6);
  EXPECT_EQ(loader::default_threads(256), 32);
}

TEST(LoaderAutoConfig, PageCacheResidencyCountsWhatWasJustWrittenAndNamesMissingFiles) {
  TempDir tmp;
  const std::string f = tmp.sub("cached.bin"), empty = tmp.sub("empty.bin");
  const std::vector<uint8_t> bytes = make_records(1, 3 * 4096 + 100, 3);
  {
    const int fd = ::open(f.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
    ::close(fd);
    const int fe = ::open(empty.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ASSERT_GE(fe, 0);
    ::close(fe);
  }
  std::vector<uint8_t> back(bytes.size());
  {
    const int fd = ::open(f.c_str(), O_RDONLY);  // read through the cache: resident now
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::pread(fd, back.data(), back.size(), 0), static_cast<ssize_t>(back.size()));
    ::close(fd);
  }
  const loader::PageCacheResidency r = loader::page_cache_residency({f, empty});
  EXPECT_TRUE(r.error.empty()) << r.error;
  EXPECT_EQ(r.file_bytes, bytes.size());
  EXPECT_EQ(r.resident_bytes, bytes.size());  // whole pages, capped at the file's end
  EXPECT_DOUBLE_EQ(r.fraction(), 1.0);

  const loader::PageCacheResidency missing = loader::page_cache_residency({f, tmp.sub("absent.bin")});
  EXPECT_NE(missing.error.find("absent.bin"), std::string::npos) << missing.error;
  EXPECT_EQ(missing.file_bytes, bytes.size());
  EXPECT_DOUBLE_EQ(loader::page_cache_residency({}).fraction(), 1.0);
  EXPECT_GT(loader::physical_memory_bytes(), uint64_t{1} << 26);
}

// ---- CRC32C -----------------------------------------------------------------------------------

TEST(Crc32c, KnownVectors) {
  EXPECT_EQ(loader::crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(loader::crc32c_portable("123456789", 9), 0xE3069283u);
  EXPECT_EQ(loader::crc32c("", 0), 0u);
  const std::vector<uint8_t> zeros(32, 0), ones(32, 0xFF);
  EXPECT_EQ(loader::crc32c(zeros.data(), 32), 0x8A9136AAu);  // RFC 3720 B.4
  EXPECT_EQ(loader::crc32c(ones.data(), 32), 0x62A8AB43u);
}

TEST(Crc32c, HardwareMatchesPortableAtEveryLength) {
  // Lengths around the three-lane blocks (3 x 512, 3 x 8192) and their remainders.
  const std::vector<uint8_t> data = make_records(1, 3 * 8192 * 3 + 1000, 7);
  std::vector<size_t> lengths;
  for (size_t n = 0; n < 80; ++n) lengths.push_back(n);
  for (size_t base : {1536u, 24576u, 49152u, 73728u})
    for (int d = -9; d <= 9; ++d) lengths.push_back(base + d);
  lengths.push_back(data.size());
  for (size_t n : lengths) {
    for (size_t offset : {0u, 1u, 3u}) {
      if (offset + n > data.size()) continue;
      EXPECT_EQ(loader::crc32c(data.data() + offset, n), loader::crc32c_portable(data.data() + offset, n))
          << "length " << n << " offset " << offset << " hardware " << loader::crc32c_hardware();
    }
  }
}

TEST(Crc32c, Chains) {
  const std::vector<uint8_t> data = make_records(1, 50000, 3);
  const uint32_t whole = loader::crc32c(data.data(), data.size());
  for (size_t cut : {0u, 1u, 7u, 4096u, 30000u, 50000u})
    EXPECT_EQ(loader::crc32c(data.data() + cut, data.size() - cut, loader::crc32c(data.data(), cut)), whole) << cut;
}

// ---- order ------------------------------------------------------------------------------------

TEST(LoaderOrder, PermutationIsABijection) {
  for (uint64_t n : {1ull, 2ull, 3ull, 5ull, 16ull, 17ull, 1000ull, 4097ull, 65536ull}) {
    const loader::Permutation p(n, 42, 3);
    std::vector<char> seen(n, 0);
    for (uint64_t i = 0; i < n; ++i) {
      const uint64_t v = p(i);
      ASSERT_LT(v, n) << "n " << n;
      ASSERT_FALSE(seen[v]) << "n " << n << ": " << v << " twice";
      seen[v] = 1;
    }
  }
}

TEST(LoaderOrder, PermutationDependsOnSeedAndEpoch) {
  const uint64_t n = 1000;
  auto order = [&](uint64_t seed, uint64_t epoch) {
    const loader::Permutation p(n, seed, epoch);
    std::vector<uint64_t> v(n);
    for (uint64_t i = 0; i < n; ++i) v[i] = p(i);
    return v;
  };
  EXPECT_EQ(order(1, 0), order(1, 0));
  EXPECT_NE(order(1, 0), order(1, 1));
  EXPECT_NE(order(1, 0), order(2, 0));
  std::vector<uint64_t> identity(n);
  std::iota(identity.begin(), identity.end(), 0);
  const std::vector<uint64_t> o = order(5, 0);
  // Shuffled, not merely rotated: few records stay in place.
  size_t fixed = 0;
  for (uint64_t i = 0; i < n; ++i) fixed += o[i] == i;
  EXPECT_LT(fixed, 20u);
  EXPECT_NE(o, identity);
}

TEST(LoaderOrder, RanksCoverTheEpochWithoutOverlap) {
  for (uint64_t n : {1ull, 7ull, 100ull, 101ull, 1023ull}) {
    for (int world : {1, 2, 3, 8}) {
      for (bool shuffle : {false, true}) {
        std::vector<int> count(n, 0);
        uint64_t min_records = UINT64_MAX, max_records = 0;
        for (int rank = 0; rank < world; ++rank) {
          LoaderOptions o;
          o.batch_size = 4;
          o.shuffle = shuffle;
          o.seed = 9;
          o.rank = rank;
          o.world_size = world;
          const std::vector<uint64_t> ids = loader_epoch_order(n, o, 2);
          for (uint64_t id : ids) ++count[id];
          min_records = std::min<uint64_t>(min_records, ids.size());
          max_records = std::max<uint64_t>(max_records, ids.size());
        }
        for (uint64_t i = 0; i < n; ++i)
          ASSERT_EQ(count[i], 1) << "n " << n << " world " << world << " shuffle " << shuffle << " record " << i;
        EXPECT_LE(max_records - min_records, 1u);
      }
    }
  }
}

TEST(LoaderOrder, DropLastGivesEveryRankTheSameFullBatches) {
  const uint64_t n = 103;
  for (bool shuffle : {false, true}) {
    std::set<uint64_t> seen;
    for (int rank = 0; rank < 4; ++rank) {
      LoaderOptions o;
      o.batch_size = 5;
      o.shuffle = shuffle;
      o.rank = rank;
      o.world_size = 4;
      o.drop_last = true;
      const loader::RankOrder order(n, shuffle, 0, rank, 4, 5, true);
      EXPECT_EQ(order.batches, (n / 4) / 5);
      const std::vector<uint64_t> ids = loader_epoch_order(n, o, 0);
      EXPECT_EQ(ids.size(), order.batches * 5);
      for (uint64_t id : ids) EXPECT_TRUE(seen.insert(id).second) << "record " << id << " on two ranks";
    }
  }
}

TEST(LoaderOrder, SequentialOrderIsTheIdentity) {
  LoaderOptions o;
  o.batch_size = 3;
  const std::vector<uint64_t> ids = loader_epoch_order(10, o, 5);
  std::vector<uint64_t> identity(10);
  std::iota(identity.begin(), identity.end(), 0);
  EXPECT_EQ(ids, identity);
}

// ---- read plans ---------------------------------------------------------------------------------

TEST(ReadPlan, SequentialBatchIsOneAlignedRunPerShard) {
  const DatasetInfo info = fake_info(1000, {10, 10});
  loader::ReadPlan plan;
  loader::plan_batch(info, {3, 4, 5, 6, 7, 8, 9, 10, 11}, 4096, 1 << 20, plan);
  ASSERT_EQ(plan.placements.size(), 2u);  // shard 0: 3..9, shard 1: 10..11
  for (const loader::ReadChunk& c : plan.chunks) {
    EXPECT_EQ(c.file_offset % 4096, 0u);
    EXPECT_EQ(c.bytes % 4096, 0u);
    EXPECT_EQ(c.staging_offset % 4096, 0u);
  }
  // Record k of the batch starts where its file offset falls within the aligned read.
  const uint64_t begin = 4096 + 3 * 1000;
  EXPECT_EQ(plan.record_src[0], begin - 4096);
  EXPECT_EQ(plan.record_src[1], plan.record_src[0] + 1000);
  EXPECT_EQ(plan.placements[1].dst, 7u * 1000);
  EXPECT_EQ(plan.record_shard[8], 1u);
  EXPECT_FALSE(plan.packed);
  EXPECT_LE(plan.staging_bytes, loader::staging_capacity(9, 1000, 4096));
}

TEST(ReadPlan, UnalignedPlanIsPacked) {
  const DatasetInfo info = fake_info(7, {5, 5, 5});
  loader::ReadPlan plan;
  loader::plan_batch(info, {14, 2, 3, 9, 0}, 1, 1 << 20, plan);
  EXPECT_TRUE(plan.packed);
  for (size_t k = 0; k < 5; ++k) EXPECT_EQ(plan.record_src[k], k * 7);
  EXPECT_EQ(plan.staging_bytes, 35u);
  EXPECT_EQ(plan.read_bytes, 35u);
}

TEST(ReadPlan, ChunksSplitLongRunsAndStayInCapacity) {
  std::mt19937_64 rng(3);
  for (uint64_t r : {1ull, 7ull, 4095ull, 4096ull, 4097ull, 150528ull}) {
    const DatasetInfo info = fake_info(r, {40, 1, 23});
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<uint64_t> ids(info.num_records);
      std::iota(ids.begin(), ids.end(), 0);
      if (trial % 2) std::shuffle(ids.begin(), ids.end(), rng);
      ids.resize(1 + rng() % ids.size());
      for (uint64_t align : {1ull, 4096ull}) {
        loader::ReadPlan plan;
        loader::plan_batch(info, ids, align, 64 * 1024, plan);
        EXPECT_LE(plan.staging_bytes, loader::staging_capacity(ids.size(), r, align)) << r;
        uint64_t placed = 0;
        for (const loader::Placement& p : plan.placements) placed += p.bytes;
        EXPECT_EQ(placed, ids.size() * r);
        for (const loader::ReadChunk& c : plan.chunks) {
          EXPECT_LE(c.bytes, 64u * 1024);
          EXPECT_LE(c.staging_offset + c.bytes, plan.staging_bytes);
        }
      }
    }
  }
}

// Small shuffled records share pages: each page is read once (reads never overlap), the staging is
// bounded by the shards' data, and the placements still put every record where it belongs.
TEST(ReadPlan, AlignedReadsOfSharedPagesAreMergedAndExact) {
  std::mt19937_64 rng(5);
  for (uint64_t r : {1ull, 8ull, 13ull, 1000ull, 4095ull, 4097ull}) {
    const DatasetInfo info = fake_info(r, {700, 3, 450});
    // The "files": byte j of shard s is a function of (s, j).
    auto file_byte = [](uint32_t shard, uint64_t offset) { return static_cast<uint8_t>(offset * 131 + shard * 7 + 1); };
    for (int trial = 0; trial < 6; ++trial) {
      std::vector<uint64_t> ids(info.num_records);
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng);
      ids.resize(trial == 0 ? ids.size() : 1 + rng() % ids.size());
      loader::ReadPlan plan;
      loader::plan_batch(info, ids, 4096, 64 * 1024, plan);
      // Reads: aligned, within the data sections, no two overlapping.
      std::vector<std::pair<uint64_t, uint64_t>> spans;  // (shard << 40 | offset, end)
      std::vector<uint8_t> staging(plan.staging_bytes, 0);
      for (const loader::ReadChunk& c : plan.chunks) {
        ASSERT_EQ(c.file_offset % 4096, 0u);
        ASSERT_LE(c.staging_offset + c.bytes, plan.staging_bytes);
        const ShardInfo& s = info.shards[c.shard];
        ASSERT_GE(c.file_offset, s.data_offset);
        ASSERT_LE(c.file_offset + c.bytes, s.data_offset + loader::align_up(s.record_count * r, 4096));
        const uint64_t key = uint64_t{c.shard} << 40;
        spans.push_back({key | c.file_offset, key | (c.file_offset + c.bytes)});
        for (uint64_t k = 0; k < c.bytes; ++k) staging[c.staging_offset + k] = file_byte(c.shard, c.file_offset + k);
      }
      std::sort(spans.begin(), spans.end());
      for (size_t k = 1; k < spans.size(); ++k) ASSERT_GE(spans[k].first, spans[k - 1].second) << "a page read twice";
      EXPECT_EQ(plan.read_bytes, plan.staging_bytes);
      EXPECT_LE(plan.staging_bytes, loader::aligned_data_bytes(info)) << r;
      EXPECT_LE(plan.staging_bytes,
                loader::staging_capacity(ids.size(), r, 4096, ids.size(), loader::aligned_data_bytes(info)));
      // Assembled through the placements, the batch is the records asked for.
      std::vector<uint8_t> batch(ids.size() * r, 0);
      for (const loader::Placement& p : plan.placements)
        std::memcpy(batch.data() + p.dst, staging.data() + p.src, p.bytes);
      for (size_t k = 0; k < ids.size(); ++k) {
        const uint32_t shard = plan.record_shard[k];
        const ShardInfo& s = info.shards[shard];
        const uint64_t offset = s.data_offset + (ids[k] - s.first_record) * r;
        for (uint64_t j = 0; j < r; ++j) {
          ASSERT_EQ(batch[k * r + j], file_byte(shard, offset + j)) << "record " << ids[k] << " byte " << j;
          ASSERT_EQ(staging[plan.record_src[k] + j], file_byte(shard, offset + j));
        }
      }
    }
  }
  // The capacity bounds: the dataset's pages, whatever the batch size.
  const DatasetInfo info = fake_info(8, {1000});
  EXPECT_EQ(loader::staging_capacity(65536, 8, 4096, 65536, loader::aligned_data_bytes(info)), 8192u);
  EXPECT_EQ(loader::staging_capacity(65536, 8, 1), 65536u * 8);
  EXPECT_EQ(loader::staging_capacity(10, 4096, 4096, 1), 10u * 4096 + 4096);  // one run (sequential)
}

// ---- writer and open_dataset --------------------------------------------------------------------

TEST(ShardFormat, RoundTrip) {
  TempDir tmp;
  for (uint64_t r : {1ull, 13ull, 4096ull, 5000ull}) {
    for (uint64_t per_shard : {1ull, 7ull, 100ull}) {
      const std::string dir = tmp.sub("r" + std::to_string(r) + "_" + std::to_string(per_shard));
      const std::vector<uint8_t> data = make_records(23, r, r);
      const DatasetInfo info = write_dataset(dir, data, r, per_shard);
      EXPECT_EQ(info.num_records, 23u);
      EXPECT_EQ(info.record_bytes, r);
      EXPECT_EQ(info.dtype, "uint8");
      EXPECT_EQ(info.shards.size(), (23 + per_shard - 1) / per_shard);
      const DatasetInfo again = open_dataset(dir + "/");
      EXPECT_EQ(again.dataset_id, info.dataset_id);
      EXPECT_EQ(again.path, dir);
      uint64_t first = 0;
      for (const ShardInfo& s : again.shards) {
        EXPECT_EQ(s.first_record, first);
        struct stat st;
        ASSERT_EQ(::stat(s.file.c_str(), &st), 0);
        EXPECT_EQ(static_cast<uint64_t>(st.st_size), s.file_bytes);
        EXPECT_EQ(s.file_bytes % 4096, 0u);
        first += s.record_count;
      }
      verify_dataset(dir);
    }
  }
}

TEST(ShardFormat, ShapesAndDtypes) {
  TempDir tmp;
  ShardWriter w(tmp.sub("d"), "bfloat16", {3, 5, 7}, 4);
  EXPECT_EQ(w.record_bytes(), 2u * 3 * 5 * 7);
  std::vector<uint8_t> data = make_records(9, w.record_bytes());
  w.append(data.data(), 9);
  const DatasetInfo info = w.close();
  EXPECT_EQ(info.dtype, "bfloat16");
  EXPECT_EQ(info.record_shape, (std::vector<int64_t>{3, 5, 7}));
  EXPECT_EQ(shard_dtype_size("float64"), 8u);
  EXPECT_EQ(shard_dtype_size("uint16"), 2u);
  EXPECT_TRUE(contains_all(error_of([] { shard_dtype_size("complex64"); }), {"dtype", "complex64", "float32"}));
}

TEST(ShardFormat, EmptyDatasetHasOneEmptyShard) {
  TempDir tmp;
  ShardWriter w(tmp.sub("e"), "int32", {4}, 10);
  const DatasetInfo info = w.close();
  EXPECT_EQ(info.num_records, 0u);
  ASSERT_EQ(info.shards.size(), 1u);
  EXPECT_EQ(info.shards[0].record_count, 0u);
}

TEST(ShardFormat, WriterArgumentsAndOverwrite) {
  TempDir tmp;
  EXPECT_TRUE(contains_all(error_of([&] { ShardWriter(tmp.sub("a"), "int32", {0}, 1); }), {"record_shape", "[0]"}));
  EXPECT_TRUE(contains_all(error_of([&] { ShardWriter(tmp.sub("a"), "int32", {1}, 0); }), {"records_per_shard"}));
  EXPECT_TRUE(contains_all(error_of([&] { ShardWriter(tmp.sub("a"), "float", {1}, 1); }), {"dtype", "\"float\""}));
  const std::vector<uint8_t> data = make_records(5, 3);
  write_dataset(tmp.sub("b"), data, 3, 2);
  EXPECT_TRUE(contains_all(error_of([&] { ShardWriter(tmp.sub("b"), "uint8", {3}, 2); }), {tmp.sub("b"), "overwrite"}));
  {
    ShardWriter w(tmp.sub("b"), "uint8", {3}, 10, /*overwrite=*/true);
    w.append(data.data(), 5);
    EXPECT_EQ(w.close().shards.size(), 1u);  // the three old shards are gone
  }
  // A writer destroyed without close() still leaves a readable dataset.
  {
    ShardWriter w(tmp.sub("c"), "uint8", {3}, 2);
    w.append(data.data(), 5);
  }
  EXPECT_EQ(open_dataset(tmp.sub("c")).num_records, 5u);
}

// ---- broken datasets --------------------------------------------------------------------------

class BrokenDataset : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = tmp.sub("ds");
    data = make_records(20, kRecord);
    write_dataset(dir, data, kRecord, 6);  // shards of 6, 6, 6, 2 records
  }
  std::string shard(int i) const { return dir + "/" + shard_file_name(i); }
  static constexpr uint64_t kRecord = 1000;
  TempDir tmp;
  std::string dir;
  std::vector<uint8_t> data;
};

TEST_F(BrokenDataset, MissingShard) {
  ASSERT_EQ(::unlink(shard(2).c_str()), 0);
  EXPECT_TRUE(contains_all(error_of([&] { open_dataset(dir); }), {shard(2), "missing", "4 shards"}));
  ASSERT_EQ(::unlink(shard(0).c_str()), 0);  // the count then comes from another shard's header
  EXPECT_TRUE(contains_all(error_of([&] { open_dataset(dir); }), {shard(0), "missing"}));
}

TEST_F(BrokenDataset, MissingDirectoryAndEmptyDirectory) {
  EXPECT_TRUE(contains_all(error_of([&] { open_dataset(dir + "/nope"); }), {dir + "/nope", "does not exist"}));
  EXPECT_TRUE(contains_all(error_of([&] { open_dataset(shard(0)); }), {shard(0), "directory"}));
  ::mkdir(tmp.sub("empty").c_str(), 0755);
  EXPECT_TRUE(contains_all(error_of([&] { open_dataset(tmp.sub("empty")); }), {"no shard files"}));
}

TEST_F(BrokenDataset, ExtraShard) {
  const std::string extra = dir + "/" + shard_file_name(4);
  ::link(shard(3).c_str(), extra.c_str());
  EXPECT_TRUE(contains_all(error_of([&] { open_dataset(dir); }), {extra, "unexpected shard", "4 shards"}));
}

TEST_F(BrokenDataset, TruncatedShardNamesTheFirstIncompleteRecord) {
  // Shard 1 holds dataset records 6..11; cut inside its record 3 (dataset record 9).
  truncate_file(shard(1), kShardHeaderBytes + 3 * kRecord + 500);
  EXPECT_TRUE(contains_all(error_of([&] { open_dataset(dir); }),
                       {shard(1), "truncated", "record 3 (dataset record 9)"}));
  truncate_file(shard(1), 100);
  EXPECT_TRUE(contains_all(error_of([&] { open_dataset(dir); }), {shard(1), "truncated", "header"}));
}

TEST_F(BrokenDataset, TruncatedChecksumTable) {
  const ShardInfo s = open_dataset(dir).shards[0];
  truncate_file(shard(0), s.table_offset + 8);
  EXPECT_TRUE(contains_all(error_of([&] { open_dataset(dir); }), {shard(0), "truncated", "checksum table"}));
}

TEST_F(BrokenDataset, WrongSize) {
  const ShardInfo s = open_dataset(dir).shards[3];
  truncate_file(shard(3), s.file_bytes + 4096);
  EXPECT_TRUE(contains_all(error_of([&] { open_dataset(dir); }), {shard(3), "wrong size", "4096 extra bytes"}));
}

TEST_F(BrokenDataset, BadMagic) {
  corrupt(shard(1), 0, 3);
  EXPECT_TRUE(contains_all(error_of([&] { open_dataset(dir); }), {shard(1), "bad magic", "OPTSHARD"}));
}

TEST_F(BrokenDataset, HeaderChecksumMismatch) {
  corrupt(shard(2), loader::header_offset::kRecordCount);
  EXPECT_TRUE(contains_all(error_of([&] { open_dataset(dir); }), {shard(2), "header checksum mismatch"}));
}

TEST_F(BrokenDataset, ShardsOfAnotherDataset) {
  TempDir other;
  write_dataset(other.sub("x"), data, kRecord, 6);  // same layout, another dataset id
  ASSERT_EQ(::rename((other.sub("x") + "/" + shard_file_name(1)).c_str(), shard(1).c_str()), 0);
  EXPECT_TRUE(contains_all(error_of([&] { open_dataset(dir); }), {shard(1), "dataset id", "different datasets"}));
}

TEST_F(BrokenDataset, ChecksumTableCorrupted) {
  const ShardInfo s = open_dataset(dir).shards[2];
  corrupt(shard(2), s.table_offset + 5);
  EXPECT_TRUE(contains_all(error_of([&] { loader::read_checksum_table(open_dataset(dir).shards[2]); }),
                       {shard(2), "shard checksum mismatch"}));
}

TEST_F(BrokenDataset, VerifyNamesTheCorruptedRecord) {
  // Shard 3 holds dataset records 18 and 19; corrupt one byte of its record 1.
  corrupt(shard(3), kShardHeaderBytes + 1 * kRecord + 777);
  open_dataset(dir);  // sizes and headers are still fine
  EXPECT_TRUE(contains_all(error_of([&] { verify_dataset(dir); }),
                       {shard(3), "record 1 (dataset record 19", "checksum mismatch"}));
}

}  // namespace
}  // namespace optimized
