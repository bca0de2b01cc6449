// The shard format: header encoding and checks, open_dataset (every header and size checked),
// verify_dataset (every record checked), and ShardWriter.
//
// Every check throws Error naming the file and, for data, the record: a loader that meets a broken
// dataset stops with a message a person can act on, and never skips or repeats a record. A dataset
// is complete only once its writer's close() has removed the directory's kIncompleteMarker.
#include "loader/shard_format.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <random>

#include "loader/crc32c.h"

namespace optimized {

using loader::align_up;
using loader::kAlign;
using loader::ShardHeader;
using loader::throw_dataset_error;
using loader::throw_os_error;
namespace off = loader::header_offset;

namespace {

struct DtypeRow {
  const char* name;
  size_t size;
};
constexpr DtypeRow kDtypes[] = {{"uint8", 1},   {"int8", 1},    {"int16", 2},    {"uint16", 2},
                                {"int32", 4},   {"uint32", 4},  {"int64", 8},    {"float16", 2},
                                {"bfloat16", 2}, {"float32", 4}, {"float64", 8}};

std::string dtype_list() {
  std::string s;
  for (const DtypeRow& r : kDtypes) s += (s.empty() ? "" : ", ") + std::string(r.name);
  return s;
}

template <typename T>
void put(uint8_t* out, size_t offset, T v) {
  std::memcpy(out + offset, &v, sizeof(T));  // little-endian hosts only (x86-64, aarch64)
}
template <typename T>
T get(const uint8_t* in, size_t offset) {
  T v;
  std::memcpy(&v, in + offset, sizeof(T));
  return v;
}

// RAII file descriptor.
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
};

Fd open_read(const std::string& file) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) throw_dataset_error(file, "missing (no such file)");
    throw_os_error(file, "open", errno);
  }
  return Fd(fd);
}

uint64_t file_size(int fd, const std::string& file) {
  struct stat st;
  if (::fstat(fd, &st) != 0) throw_os_error(file, "fstat", errno);
  return static_cast<uint64_t>(st.st_size);
}

// "shard-00012.osh" -> 12; -1 for other names.
int64_t parse_shard_name(const char* name) {
  const size_t len = std::strlen(name);
  if (len < 11 || std::strncmp(name, "shard-", 6) != 0 || std::strcmp(name + len - 4, ".osh") != 0) return -1;
  int64_t index = 0;
  for (size_t i = 6; i < len - 4; ++i) {
    if (name[i] < '0' || name[i] > '9' || index > (int64_t{1} << 32)) return -1;
    index = index * 10 + (name[i] - '0');
  }
  return index;
}

std::map<int64_t, std::string> list_shards(const std::string& dir) {
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) {
    if (errno == ENOENT) throw_dataset_error(dir, "dataset directory does not exist");
    throw_os_error(dir, "stat", errno);
  }
  if (!S_ISDIR(st.st_mode))
    throw_dataset_error(dir, "expected a dataset directory of shard files (shard-NNNNN.osh); given a file");
  DIR* d = ::opendir(dir.c_str());
  if (!d) throw_os_error(dir, "opendir", errno);
  std::map<int64_t, std::string> shards;
  while (const dirent* e = ::readdir(d)) {
    const int64_t index = parse_shard_name(e->d_name);
    if (index >= 0) shards[index] = dir + "/" + e->d_name;
  }
  ::closedir(d);
  return shards;
}

ShardHeader read_header(const std::string& file, int fd) {
  uint8_t bytes[kShardHeaderBytes];
  const uint64_t got = loader::pread_full(fd, bytes, kShardHeaderBytes, 0, file);
  if (got < kShardHeaderBytes)
    throw_dataset_error(file, "truncated: " + std::to_string(got) + " bytes, fewer than the " +
                                  std::to_string(kShardHeaderBytes) + "-byte header");
  return loader::decode_header(bytes, file);
}

uint64_t record_bytes_of(std::string_view dtype, const std::vector<int64_t>& shape) {
  uint64_t bytes = shard_dtype_size(dtype);
  for (int64_t d : shape) bytes *= static_cast<uint64_t>(d);
  return bytes;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// ---- the incomplete marker ----

std::string marker_path(const std::string& dir) { return dir + "/" + kIncompleteMarker; }

// Its first line, or nullopt when there is no marker.
std::optional<std::string> read_marker(const std::string& dir) {
  const int fd = ::open(marker_path(dir).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  char text[512] = {};
  const ssize_t n = ::read(fd, text, sizeof(text) - 1);
  ::close(fd);
  std::string line(text, n > 0 ? static_cast<size_t>(n) : 0);
  const size_t end = line.find('\n');
  if (end != std::string::npos) line.resize(end);
  return line;
}

void write_marker(const std::string& dir, const std::string& line) {
  const std::string path = marker_path(dir);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw_os_error(path, "open for writing", errno);
  Fd guard(fd);
  const std::string text = line + "\n";
  loader::pwrite_full(fd, text.data(), text.size(), 0, path);
}

// Makes the directory's entries (a removed marker) durable.
void sync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  (void)::fsync(fd);
  ::close(fd);
}

}  // namespace

// ---- names and helpers ------------------------------------------------------------------------

size_t shard_dtype_size(std::string_view dtype) {
  for (const DtypeRow& r : kDtypes)
    if (dtype == r.name) return r.size;
  throw Error(Status::kInvalidArgument,
              "dtype: expected one of " + dtype_list() + "; given \"" + std::string(dtype) + "\"");
}

std::string shard_file_name(uint32_t index) {
  char name[32];
  std::snprintf(name, sizeof(name), "shard-%05u.osh", index);
  return name;
}

namespace loader {

void throw_dataset_error(const std::string& file, const std::string& what) {
  throw Error(Status::kInvalidArgument, file + ": " + what);
}

void throw_os_error(const std::string& file, const std::string& call, int err) {
  throw Error(Status::kInternal, file + ": " + call + " failed: " + std::strerror(err));
}

std::string hex32(uint32_t v) {
  char s[16];
  std::snprintf(s, sizeof(s), "0x%08x", v);
  return s;
}

std::string record_location(const ShardInfo& shard, uint64_t record, uint64_t record_bytes) {
  const uint64_t begin = shard.data_offset + record * record_bytes;
  return shard.file + ": record " + std::to_string(record) + " (dataset record " +
         std::to_string(shard.first_record + record) + ", bytes " + std::to_string(begin) + ".." +
         std::to_string(begin + record_bytes) + ")";
}

uint64_t pread_full(int fd, void* dst, uint64_t bytes, uint64_t offset, const std::string& file) {
  uint64_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd, static_cast<uint8_t*>(dst) + done, bytes - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_os_error(file, "pread at byte " + std::to_string(offset + done), errno);
    }
    if (n == 0) break;
    done += static_cast<uint64_t>(n);
  }
  return done;
}

void pwrite_full(int fd, const void* src, uint64_t bytes, uint64_t offset, const std::string& file) {
  uint64_t done = 0;
  while (done < bytes) {
    const ssize_t n =
        ::pwrite(fd, static_cast<const uint8_t*>(src) + done, bytes - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_os_error(file, "pwrite at byte " + std::to_string(offset + done), errno);
    }
    done += static_cast<uint64_t>(n);
  }
}

void encode_header(const ShardHeader& h, uint8_t* out) {
  std::memset(out, 0, kShardHeaderBytes);
  std::memcpy(out + off::kMagic, kShardMagic, sizeof(kShardMagic));
  put<uint32_t>(out, off::kVersion, kShardVersion);
  put<uint32_t>(out, off::kHeaderBytes, static_cast<uint32_t>(kShardHeaderBytes));
  put<uint64_t>(out, off::kDatasetId, h.dataset_id);
  put<uint32_t>(out, off::kShardIndex, h.shard_index);
  put<uint32_t>(out, off::kShardCount, h.shard_count);
  put<uint64_t>(out, off::kFirstRecord, h.first_record);
  put<uint64_t>(out, off::kRecordCount, h.record_count);
  put<uint64_t>(out, off::kTotalRecords, h.total_records);
  put<uint64_t>(out, off::kRecordBytes, h.record_bytes);
  put<uint64_t>(out, off::kDataOffset, h.data_offset);
  put<uint64_t>(out, off::kTableOffset, h.table_offset);
  std::memcpy(out + off::kDtype, h.dtype.data(), std::min(h.dtype.size(), off::kDtypeBytes - 1));
  put<uint32_t>(out, off::kRank, static_cast<uint32_t>(h.shape.size()));
  put<uint32_t>(out, off::kTableCrc, h.table_crc);
  for (size_t i = 0; i < h.shape.size(); ++i) put<int64_t>(out, off::kShape + 8 * i, h.shape[i]);
  put<uint32_t>(out, off::kHeaderCrc, crc32c(out, off::kHeaderCrc));
}

ShardHeader decode_header(const uint8_t* in, const std::string& file) {
  if (std::memcmp(in + off::kMagic, kShardMagic, sizeof(kShardMagic)) != 0) {
    std::string found;
    for (size_t i = 0; i < sizeof(kShardMagic); ++i) {
      const char c = static_cast<char>(in[i]);
      found += (c >= 32 && c < 127) ? std::string(1, c) : "\\x" + hex32(in[i]).substr(8);
    }
    throw_dataset_error(file, "bad magic: expected \"OPTSHARD\" at byte 0; found \"" + found +
                                  "\" (not a shard file, or its header is overwritten)");
  }
  const uint32_t stored_crc = get<uint32_t>(in, off::kHeaderCrc);
  const uint32_t actual_crc = crc32c(in, off::kHeaderCrc);
  if (stored_crc != actual_crc)
    throw_dataset_error(file, "header checksum mismatch: expected " + hex32(stored_crc) + " (stored at byte " +
                                  std::to_string(off::kHeaderCrc) + "); found " + hex32(actual_crc) +
                                  " (the header is corrupted)");
  const uint32_t version = get<uint32_t>(in, off::kVersion);
  if (version != kShardVersion)
    throw_dataset_error(file, "unsupported version: expected " + std::to_string(kShardVersion) + "; found " +
                                  std::to_string(version));
  if (get<uint32_t>(in, off::kHeaderBytes) != kShardHeaderBytes)
    throw_dataset_error(file, "header size: expected " + std::to_string(kShardHeaderBytes) + "; found " +
                                  std::to_string(get<uint32_t>(in, off::kHeaderBytes)));
  ShardHeader h;
  h.dataset_id = get<uint64_t>(in, off::kDatasetId);
  h.shard_index = get<uint32_t>(in, off::kShardIndex);
  h.shard_count = get<uint32_t>(in, off::kShardCount);
  h.first_record = get<uint64_t>(in, off::kFirstRecord);
  h.record_count = get<uint64_t>(in, off::kRecordCount);
  h.total_records = get<uint64_t>(in, off::kTotalRecords);
  h.record_bytes = get<uint64_t>(in, off::kRecordBytes);
  h.data_offset = get<uint64_t>(in, off::kDataOffset);
  h.table_offset = get<uint64_t>(in, off::kTableOffset);
  h.table_crc = get<uint32_t>(in, off::kTableCrc);
  char dtype[off::kDtypeBytes + 1] = {};
  std::memcpy(dtype, in + off::kDtype, off::kDtypeBytes);
  h.dtype = dtype;
  const uint32_t rank = get<uint32_t>(in, off::kRank);
  if (rank > static_cast<uint32_t>(kShardMaxRank))
    throw_dataset_error(file, "record rank: expected <= " + std::to_string(kShardMaxRank) + "; found " +
                                  std::to_string(rank));
  for (uint32_t i = 0; i < rank; ++i) h.shape.push_back(get<int64_t>(in, off::kShape + 8 * i));
  // The fields must agree with one another (the checksum says they were written so; these catch a
  // writer bug or a hand-made file).
  size_t dsize = 0;
  try {
    dsize = shard_dtype_size(h.dtype);
  } catch (const Error& e) {
    throw_dataset_error(file, std::string("header: ") + e.what());
  }
  uint64_t expect_record_bytes = dsize;
  for (int64_t d : h.shape) {
    if (d < 1) throw_dataset_error(file, "header: record shape " + shape_str(h.shape) + " has a dimension < 1");
    expect_record_bytes *= static_cast<uint64_t>(d);
  }
  if (h.record_bytes != expect_record_bytes)
    throw_dataset_error(file, "header: record_bytes " + std::to_string(h.record_bytes) + " does not match dtype " +
                                  h.dtype + " and shape " + shape_str(h.shape) + " (" +
                                  std::to_string(expect_record_bytes) + " bytes)");
  if (h.shard_index >= h.shard_count)
    throw_dataset_error(file, "header: shard index " + std::to_string(h.shard_index) + " >= shard count " +
                                  std::to_string(h.shard_count));
  if (h.data_offset != kShardHeaderBytes ||
      h.table_offset != loader::table_offset_for(h.record_count, h.record_bytes))
    throw_dataset_error(file, "header: data/table offsets " + std::to_string(h.data_offset) + "/" +
                                  std::to_string(h.table_offset) + " do not match " +
                                  std::to_string(h.record_count) + " records of " +
                                  std::to_string(h.record_bytes) + " bytes");
  return h;
}

std::vector<uint32_t> read_checksum_table(const ShardInfo& shard) {
  Fd fd = open_read(shard.file);
  std::vector<uint32_t> table(shard.record_count);
  const uint64_t bytes = shard.record_count * 4;
  const uint64_t got = pread_full(fd.fd, table.data(), bytes, shard.table_offset, shard.file);
  if (got < bytes)
    throw_dataset_error(shard.file, "truncated: the checksum table at byte " + std::to_string(shard.table_offset) +
                                        " ends after " + std::to_string(got) + " of " + std::to_string(bytes) +
                                        " bytes");
  const uint32_t crc = crc32c(table.data(), bytes);
  if (crc != shard.table_crc)
    throw_dataset_error(shard.file, "shard checksum mismatch: the checksum table at byte " +
                                        std::to_string(shard.table_offset) + " hashes to " + hex32(crc) +
                                        "; the header expects " + hex32(shard.table_crc) + " (the table is corrupted)");
  return table;
}

}  // namespace loader

// ---- open_dataset ---------------------------------------------------------------------------

DatasetInfo open_dataset(const std::string& dir_in) {
  std::string dir = dir_in;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  const std::map<int64_t, std::string> found = list_shards(dir);
  if (const std::optional<std::string> marker = read_marker(dir))
    throw_dataset_error(dir, std::string("incomplete dataset: ") + kIncompleteMarker + " says \"" + *marker +
                                 "\": its ShardWriter did not finish (an exception or abort() before close(), or its "
                                 "process died); write the dataset again (overwrite=true)");
  if (found.empty()) throw_dataset_error(dir, "no shard files (shard-NNNNN.osh) in the dataset directory");

  // The first file found tells the shard count; every shard must agree with it.
  const std::string& ref_file = found.begin()->second;
  ShardHeader ref;
  {
    Fd fd = open_read(ref_file);
    ref = read_header(ref_file, fd.fd);
  }
  for (const auto& [index, file] : found)
    if (index >= ref.shard_count)
      throw_dataset_error(file, "unexpected shard: the dataset has " + std::to_string(ref.shard_count) +
                                    " shards (per the header of " + ref_file + ")");

  DatasetInfo info;
  info.path = dir;
  info.dtype = ref.dtype;
  info.record_shape = ref.shape;
  info.record_bytes = ref.record_bytes;
  info.num_records = ref.total_records;
  info.dataset_id = ref.dataset_id;
  uint64_t next_record = 0;
  for (uint32_t i = 0; i < ref.shard_count; ++i) {
    const auto it = found.find(i);
    const std::string file = dir + "/" + shard_file_name(i);
    if (it == found.end())
      throw_dataset_error(file, "missing: the dataset has " + std::to_string(ref.shard_count) +
                                    " shards (per the header of " + ref_file + ") and this one is not there");
    Fd fd = open_read(file);
    const ShardHeader h = read_header(file, fd.fd);
    auto differs = [&](const std::string& field, const std::string& here, const std::string& there) {
      if (here != there)
        throw_dataset_error(file, "header: " + field + " " + here + " differs from " + there + " in " + ref_file +
                                      " (shards of different datasets?)");
    };
    differs("dataset id", std::to_string(h.dataset_id), std::to_string(ref.dataset_id));
    differs("shard count", std::to_string(h.shard_count), std::to_string(ref.shard_count));
    differs("total records", std::to_string(h.total_records), std::to_string(ref.total_records));
    differs("dtype", h.dtype, ref.dtype);
    differs("record shape", shape_str(h.shape), shape_str(ref.shape));
    if (h.shard_index != i)
      throw_dataset_error(file, "header: shard index " + std::to_string(h.shard_index) + "; expected " +
                                    std::to_string(i) + " from the file name");
    if (h.first_record != next_record)
      throw_dataset_error(file, "header: first record " + std::to_string(h.first_record) + "; expected " +
                                    std::to_string(next_record) + " (the records of the shards before it)");

    ShardInfo s;
    s.file = file;
    s.index = i;
    s.first_record = h.first_record;
    s.record_count = h.record_count;
    s.data_offset = h.data_offset;
    s.table_offset = h.table_offset;
    s.file_bytes = loader::file_bytes_for(h.record_count, h.record_bytes);
    s.table_crc = h.table_crc;
    const uint64_t size = file_size(fd.fd, file);
    if (size != s.file_bytes) {
      std::string what = (size < s.file_bytes ? "truncated: " : "wrong size: ") + std::to_string(size) +
                         " bytes; expected " + std::to_string(s.file_bytes) + " for " +
                         std::to_string(h.record_count) + " records of " + std::to_string(h.record_bytes) +
                         " bytes";
      const uint64_t data_end = s.data_offset + h.record_count * h.record_bytes;
      if (size < data_end) {
        const uint64_t first_cut = (size - std::min(size, s.data_offset)) / h.record_bytes;
        what += "; record " + std::to_string(first_cut) + " (dataset record " +
                std::to_string(s.first_record + first_cut) + ") is the first incomplete one";
      } else if (size < s.file_bytes) {
        what += "; the records are whole, the checksum table is cut short";
      } else {
        what += "; " + std::to_string(size - s.file_bytes) + " extra bytes at the end";
      }
      throw_dataset_error(file, what);
    }
    next_record += h.record_count;
    info.shards.push_back(std::move(s));
  }
  if (next_record != ref.total_records)
    throw_dataset_error(dir, "the shards hold " + std::to_string(next_record) + " records; their headers say " +
                                 std::to_string(ref.total_records));
  return info;
}

void verify_dataset(const std::string& dir) {
  const DatasetInfo info = open_dataset(dir);
  const uint64_t r = info.record_bytes;
  const uint64_t per_read = std::max<uint64_t>(1, (8u << 20) / r);  // records per 8 MiB read
  std::vector<uint8_t> buffer(per_read * r);
  for (const ShardInfo& shard : info.shards) {
    const std::vector<uint32_t> table = loader::read_checksum_table(shard);
    Fd fd = open_read(shard.file);
    for (uint64_t first = 0; first < shard.record_count; first += per_read) {
      const uint64_t n = std::min(per_read, shard.record_count - first);
      const uint64_t got = loader::pread_full(fd.fd, buffer.data(), n * r, shard.data_offset + first * r, shard.file);
      if (got < n * r) throw_dataset_error(shard.file, "truncated while reading records");
      for (uint64_t k = 0; k < n; ++k) {
        const uint32_t crc = loader::crc32c(buffer.data() + k * r, r);
        if (crc != table[first + k])
          throw Error(Status::kInvalidArgument, loader::record_location(shard, first + k, r) +
                                                    ": checksum mismatch: expected crc32c " +
                                                    loader::hex32(table[first + k]) + "; found " +
                                                    loader::hex32(crc) + " (the record is corrupted)");
      }
    }
  }
}

// ---- dataset_fingerprint ---------------------------------------------------------------------

uint64_t dataset_fingerprint(const DatasetInfo& info) {
  // FNV-1a (64-bit) over the fields, each as 8 little-endian bytes (strings: length, then bytes).
  uint64_t h = 0xcbf29ce484222325ull;
  auto bytes = [&](const void* p, size_t n) {
    const uint8_t* b = static_cast<const uint8_t*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001b3ull;
  };
  auto u64 = [&](uint64_t v) { bytes(&v, sizeof(v)); };
  const std::string tag = "optimized-ops dataset v1";
  u64(tag.size());
  bytes(tag.data(), tag.size());
  u64(info.dtype.size());
  bytes(info.dtype.data(), info.dtype.size());
  u64(info.record_shape.size());
  for (int64_t d : info.record_shape) u64(static_cast<uint64_t>(d));
  u64(info.record_bytes);
  u64(info.num_records);
  u64(info.shards.size());
  for (const ShardInfo& s : info.shards) {
    u64(s.record_count);
    u64(s.table_crc);
  }
  return h;
}

// ---- ShardWriter ----------------------------------------------------------------------------

struct ShardWriter::Impl {
  std::string dir;
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t record_bytes = 0;
  uint64_t per_shard = 0;
  uint64_t dataset_id = 0;
  bool closed = false;
  int uncaught = std::uncaught_exceptions();  // at construction: more at destruction means a throw

  // The shard being written.
  int fd = -1;
  std::string file;
  uint64_t count = 0;
  std::vector<uint32_t> crcs;

  struct Done {
    std::string file;
    uint64_t count;
    uint32_t table_crc;
  };
  std::vector<Done> done;
  uint64_t total = 0;

  void open_shard() {
    file = dir + "/" + shard_file_name(static_cast<uint32_t>(done.size()));
    fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) throw_os_error(file, "open for writing", errno);
    count = 0;
    crcs.clear();
    static const uint8_t zeros[kShardHeaderBytes] = {};
    loader::pwrite_full(fd, zeros, kShardHeaderBytes, 0, file);  // the header comes at close()
  }

  void finish_shard() {
    const uint64_t data_end = kShardHeaderBytes + count * record_bytes;
    const uint64_t table_at = loader::table_offset_for(count, record_bytes);
    const uint64_t table_bytes = count * 4;
    std::vector<uint8_t> tail(table_at - data_end + align_up(table_bytes, kAlign), 0);
    std::memcpy(tail.data() + (table_at - data_end), crcs.data(), table_bytes);
    loader::pwrite_full(fd, tail.data(), tail.size(), data_end, file);
    done.push_back({file, count, loader::crc32c(crcs.data(), table_bytes)});
    ::close(fd);
    fd = -1;
  }

  void write_headers() {
    const uint32_t shard_count = static_cast<uint32_t>(done.size());
    uint64_t first = 0;
    uint8_t bytes[kShardHeaderBytes];
    for (uint32_t i = 0; i < shard_count; ++i) {
      ShardHeader h;
      h.dataset_id = dataset_id;
      h.shard_index = i;
      h.shard_count = shard_count;
      h.first_record = first;
      h.record_count = done[i].count;
      h.total_records = total;
      h.record_bytes = record_bytes;
      h.table_offset = loader::table_offset_for(done[i].count, record_bytes);
      h.dtype = dtype;
      h.shape = shape;
      h.table_crc = done[i].table_crc;
      loader::encode_header(h, bytes);
      const int f = ::open(done[i].file.c_str(), O_WRONLY | O_CLOEXEC);
      if (f < 0) throw_os_error(done[i].file, "open for the header", errno);
      Fd guard(f);
      loader::pwrite_full(f, bytes, kShardHeaderBytes, 0, done[i].file);
      if (::fsync(f) != 0) throw_os_error(done[i].file, "fsync", errno);
      first += done[i].count;
    }
  }
};

ShardWriter::ShardWriter(const std::string& dir, std::string_view dtype, std::vector<int64_t> record_shape,
                         uint64_t records_per_shard, bool overwrite)
    : impl_(std::make_unique<Impl>()) {
  Impl& w = *impl_;
  w.dir = dir;
  while (w.dir.size() > 1 && w.dir.back() == '/') w.dir.pop_back();
  w.dtype = std::string(dtype);
  shard_dtype_size(dtype);  // throws on unknown names
  if (record_shape.size() > static_cast<size_t>(kShardMaxRank))
    throw Error(Status::kInvalidArgument, "record_shape: expected at most " + std::to_string(kShardMaxRank) +
                                              " dimensions; given " + std::to_string(record_shape.size()));
  for (int64_t d : record_shape)
    if (d < 1)
      throw Error(Status::kInvalidArgument,
                  "record_shape: expected dimensions >= 1; given " + shape_str(record_shape));
  if (records_per_shard < 1)
    throw Error(Status::kInvalidArgument, "records_per_shard: expected >= 1; given 0");
  w.shape = std::move(record_shape);
  w.record_bytes = record_bytes_of(w.dtype, w.shape);
  w.per_shard = records_per_shard;

  struct stat st;
  if (::stat(w.dir.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode)) throw_dataset_error(w.dir, "exists and is not a directory");
    const auto existing = list_shards(w.dir);
    if (!existing.empty() && !overwrite)
      throw_dataset_error(w.dir, "already holds " + std::to_string(existing.size()) +
                                     " shard files; pass overwrite=true to replace them");
    for (const auto& [index, file] : existing)
      if (::unlink(file.c_str()) != 0) throw_os_error(file, "unlink", errno);
  } else {
    // mkdir -p
    for (size_t pos = 1; pos <= w.dir.size(); ++pos) {
      if (pos == w.dir.size() || w.dir[pos] == '/') {
        const std::string part = w.dir.substr(0, pos);
        if (::mkdir(part.c_str(), 0755) != 0 && errno != EEXIST) throw_os_error(part, "mkdir", errno);
      }
    }
  }
  std::random_device rd;
  w.dataset_id = (uint64_t{rd()} << 32) ^ rd() ^
                 static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  // Until close() has finished, the directory says it is incomplete (also if this process dies).
  write_marker(w.dir, "being written by process " + std::to_string(::getpid()) +
                          "; incomplete until its ShardWriter's close() finishes");
}

ShardWriter::~ShardWriter() {
  if (!impl_ || impl_->closed) return;
  if (std::uncaught_exceptions() > impl_->uncaught) {
    // Destroyed by a throw out of the writer's scope: what was written is not the dataset.
    abort("an exception was thrown before close()");
    return;
  }
  try {
    close();
  } catch (...) {  // a destructor cannot report; close() does (the marker stays: incomplete)
  }
}

void ShardWriter::abort(const std::string& why) noexcept {
  Impl& w = *impl_;
  if (w.closed) return;
  w.closed = true;
  if (w.fd >= 0) {
    ::close(w.fd);
    w.fd = -1;
  }
  try {
    write_marker(w.dir, "aborted after " + std::to_string(w.total) + " records" + (why.empty() ? "" : ": " + why));
  } catch (...) {  // the marker written at construction stays: still incomplete
  }
}

uint64_t ShardWriter::record_bytes() const { return impl_->record_bytes; }
uint64_t ShardWriter::records_written() const { return impl_->total; }

void ShardWriter::append(const void* records, uint64_t count) {
  Impl& w = *impl_;
  if (w.closed) throw Error(Status::kInvalidArgument, "ShardWriter::append: the writer is closed");
  const uint8_t* p = static_cast<const uint8_t*>(records);
  while (count > 0) {
    if (w.fd < 0) w.open_shard();
    const uint64_t n = std::min(count, w.per_shard - w.count);
    const uint64_t offset = kShardHeaderBytes + w.count * w.record_bytes;
    loader::pwrite_full(w.fd, p, n * w.record_bytes, offset, w.file);
    for (uint64_t k = 0; k < n; ++k) w.crcs.push_back(loader::crc32c(p + k * w.record_bytes, w.record_bytes));
    w.count += n;
    w.total += n;
    p += n * w.record_bytes;
    count -= n;
    if (w.count == w.per_shard) w.finish_shard();
  }
}

DatasetInfo ShardWriter::close() {
  Impl& w = *impl_;
  if (w.closed) throw Error(Status::kInvalidArgument, "ShardWriter::close: already closed");
  w.closed = true;
  try {
    if (w.fd >= 0 || w.done.empty()) {  // the partial last shard, or one empty shard for 0 records
      if (w.fd < 0) w.open_shard();
      w.finish_shard();
    }
    w.write_headers();  // each fsync'ed
  } catch (const std::exception& e) {
    try {
      write_marker(w.dir, "close() failed after " + std::to_string(w.total) + " records: " + e.what());
    } catch (...) {
    }
    throw;
  }
  const std::string marker = marker_path(w.dir);
  if (::unlink(marker.c_str()) != 0 && errno != ENOENT) throw_os_error(marker, "unlink", errno);
  sync_directory(w.dir);
  return open_dataset(w.dir);
}

}  // namespace optimized
