// The shard file format: header layout, encoding and checks, and the small file helpers the writer,
// the dataset checks and the loader share. Byte table in docs/perf-notes/loader.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "optimized/core.h"
#include "optimized/loader.h"

namespace optimized::loader {

inline constexpr char kShardMagic[8] = {'O', 'P', 'T', 'S', 'H', 'A', 'R', 'D'};
inline constexpr uint64_t kAlign = 4096;  // O_DIRECT alignment and section alignment

// Header field offsets (little-endian), kShardHeaderBytes in all; the last 4 bytes hold the CRC32C
// of the bytes before them.
namespace header_offset {
inline constexpr size_t kMagic = 0, kVersion = 8, kHeaderBytes = 12, kDatasetId = 16, kShardIndex = 24,
                        kShardCount = 28, kFirstRecord = 32, kRecordCount = 40, kTotalRecords = 48,
                        kRecordBytes = 56, kDataOffset = 64, kTableOffset = 72, kDtype = 80, kRank = 96,
                        kTableCrc = 100, kShape = 104, kHeaderCrc = kShardHeaderBytes - 4;
inline constexpr size_t kDtypeBytes = 16;
}  // namespace header_offset

struct ShardHeader {
  uint64_t dataset_id = 0;
  uint32_t shard_index = 0, shard_count = 0;
  uint64_t first_record = 0, record_count = 0, total_records = 0;
  uint64_t record_bytes = 0, data_offset = kShardHeaderBytes, table_offset = 0;
  std::string dtype;
  std::vector<int64_t> shape;
  uint32_t table_crc = 0;
};

inline uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }
inline uint64_t align_down(uint64_t x, uint64_t a) { return x / a * a; }
// Where the checksum table starts and the file ends, for `count` records of `record_bytes`.
inline uint64_t table_offset_for(uint64_t count, uint64_t record_bytes) {
  return align_up(kShardHeaderBytes + count * record_bytes, kAlign);
}
inline uint64_t file_bytes_for(uint64_t count, uint64_t record_bytes) {
  return table_offset_for(count, record_bytes) + align_up(count * 4, kAlign);
}

void encode_header(const ShardHeader& h, uint8_t* out);  // kShardHeaderBytes bytes
// Checks magic, header checksum, version and internal consistency; throws Error naming `file`.
ShardHeader decode_header(const uint8_t* bytes, const std::string& file);

// Error(kInvalidArgument) whose message starts with the file: "<file>: <what>".
[[noreturn]] void throw_dataset_error(const std::string& file, const std::string& what);
// Error(kInternal) for a failed system call: "<file>: <call> failed: <strerror(errno)>".
[[noreturn]] void throw_os_error(const std::string& file, const std::string& call, int err);

// Reads exactly `bytes` at `offset` (retrying short reads); returns the bytes read (< bytes at EOF).
uint64_t pread_full(int fd, void* dst, uint64_t bytes, uint64_t offset, const std::string& file);
void pwrite_full(int fd, const void* src, uint64_t bytes, uint64_t offset, const std::string& file);

// The shard's CRC32C table, checked against the header's shard checksum.
std::vector<uint32_t> read_checksum_table(const ShardInfo& shard);

// "0x1234abcd"
std::string hex32(uint32_t v);
// "<file>: record 12 (dataset record 1012, bytes 53248..57344)": how errors name a record.
std::string record_location(const ShardInfo& shard, uint64_t record_in_shard, uint64_t record_bytes);

}  // namespace optimized::loader
