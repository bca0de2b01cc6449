// CRC32C (Castagnoli, the iSCSI/ext4 checksum): each record's checksum in the shard format.
// crc32c(b, crc32c(a)) == crc32c(a || b), like zlib's crc32; crc32c("123456789") == 0xE3069283.
#pragma once

#include <cstddef>
#include <cstdint>

namespace optimized::loader {

uint32_t crc32c(const void* data, size_t bytes, uint32_t crc = 0);
// The portable table-driven version alone (tests compare the two).
uint32_t crc32c_portable(const void* data, size_t bytes, uint32_t crc = 0);
// Whether crc32c() uses the SSE4.2 crc32 instruction on this CPU.
bool crc32c_hardware();

}  // namespace optimized::loader
