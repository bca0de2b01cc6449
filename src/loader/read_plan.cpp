// Batch -> runs -> aligned reads and placements (see read_plan.h).
#include "loader/read_plan.h"

#include <algorithm>

#include "loader/shard_format.h"

namespace optimized::loader {

uint64_t staging_capacity(uint64_t batch_size, uint64_t record_bytes, uint64_t alignment) {
  if (alignment <= 1) return batch_size * record_bytes;
  return batch_size * (align_up(record_bytes, alignment) + alignment);
}

void plan_batch(const DatasetInfo& info, const std::vector<uint64_t>& ids, uint64_t alignment, uint64_t chunk_bytes,
                ReadPlan& plan) {
  plan.chunks.clear();
  plan.placements.clear();
  plan.record_src.assign(ids.size(), 0);
  plan.record_shard.assign(ids.size(), 0);
  plan.run_shard.clear();
  plan.run_offset.clear();
  plan.staging_bytes = 0;
  plan.read_bytes = 0;
  const uint64_t r = info.record_bytes;
  const bool aligned = alignment > 1;

  auto shard_of = [&](uint64_t id) -> uint32_t {
    // The last shard whose first record is <= id.
    const auto it = std::upper_bound(info.shards.begin(), info.shards.end(), id,
                                     [](uint64_t v, const ShardInfo& s) { return v < s.first_record; });
    return static_cast<uint32_t>(it - info.shards.begin() - 1);
  };

  size_t i = 0;
  while (i < ids.size()) {
    // Extend the run while the next record follows in the same shard.
    const uint32_t shard = shard_of(ids[i]);
    const ShardInfo& s = info.shards[shard];
    size_t j = i + 1;
    while (j < ids.size() && ids[j] == ids[j - 1] + 1 && ids[j] < s.first_record + s.record_count) ++j;
    const uint64_t begin = s.data_offset + (ids[i] - s.first_record) * r;
    const uint64_t end = begin + (j - i) * r;
    const uint64_t read_begin = aligned ? align_down(begin, alignment) : begin;
    const uint64_t read_end = aligned ? align_up(end, alignment) : end;
    // Aligned: runs follow one another in staging. Unaligned: each run goes to its output offset.
    const uint64_t staging = aligned ? plan.staging_bytes : i * r;
    for (uint64_t off = read_begin; off < read_end; off += chunk_bytes) {
      const uint64_t n = std::min(chunk_bytes, read_end - off);
      plan.chunks.push_back({shard, off, n, staging + (off - read_begin)});
      plan.read_bytes += n;
    }
    const uint64_t src = staging + (begin - read_begin);
    plan.placements.push_back({src, i * r, (j - i) * r});
    plan.run_shard.push_back(shard);
    plan.run_offset.push_back(begin);
    for (size_t k = i; k < j; ++k) {
      plan.record_src[k] = src + (k - i) * r;
      plan.record_shard[k] = shard;
    }
    plan.staging_bytes = aligned ? plan.staging_bytes + (read_end - read_begin) : end - begin + staging;
    i = j;
  }
  plan.packed = !aligned;
  if (!aligned) plan.staging_bytes = ids.size() * r;
}

}  // namespace optimized::loader
