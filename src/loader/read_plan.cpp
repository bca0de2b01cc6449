// Batch -> runs -> aligned reads and placements (see read_plan.h).
#include "loader/read_plan.h"

#include <algorithm>

#include "loader/shard_format.h"

namespace optimized::loader {

uint64_t staging_capacity(uint64_t batch_records, uint64_t record_bytes, uint64_t alignment, uint64_t max_runs,
                          uint64_t data_bytes) {
  const uint64_t b = batch_records, r = record_bytes;
  if (alignment <= 1) return b * r;
  const uint64_t runs = std::min(max_runs, b);
  // A run of k records read widened spans at most k r + 2 (a - 1) bytes, and at most
  // align_up(k r) + a; the batch is the sum over its runs.
  const uint64_t by_runs = std::min(b * r + runs * 2 * alignment, b * align_up(r, alignment) + runs * alignment);
  return std::min(by_runs, data_bytes);
}

uint64_t aligned_data_bytes(const DatasetInfo& info) {
  uint64_t bytes = 0;
  for (const ShardInfo& s : info.shards) bytes += align_up(s.record_count * info.record_bytes, kAlign);
  return bytes;
}

void plan_batch(const DatasetInfo& info, const std::vector<uint64_t>& ids, uint64_t alignment, uint64_t chunk_bytes,
                ReadPlan& plan, uint64_t max_gap, uint64_t staging_limit) {
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

  // The runs, in batch order.
  struct Run {
    uint32_t shard;
    size_t first;      // batch position of its first record
    size_t count;
    uint64_t begin;    // file offset of its first record
    uint64_t read_begin, read_end;
  };
  std::vector<Run> runs;
  size_t i = 0;
  while (i < ids.size()) {
    // Extend the run while the next record follows in the same shard.
    const uint32_t shard = shard_of(ids[i]);
    const ShardInfo& s = info.shards[shard];
    size_t j = i + 1;
    while (j < ids.size() && ids[j] == ids[j - 1] + 1 && ids[j] < s.first_record + s.record_count) ++j;
    const uint64_t begin = s.data_offset + (ids[i] - s.first_record) * r;
    const uint64_t end = begin + (j - i) * r;
    runs.push_back({shard, i, j - i, begin, aligned ? align_down(begin, alignment) : begin,
                    aligned ? align_up(end, alignment) : end});
    i = j;
  }

  auto emit_reads = [&](uint32_t shard, uint64_t read_begin, uint64_t read_end, uint64_t staging) {
    for (uint64_t off = read_begin; off < read_end; off += chunk_bytes) {
      const uint64_t n = std::min(chunk_bytes, read_end - off);
      plan.chunks.push_back({shard, off, n, staging + (off - read_begin)});
      plan.read_bytes += n;
    }
  };
  // Where each run's first record lies in staging.
  std::vector<uint64_t> run_src(runs.size());
  if (!aligned) {
    // Each run goes straight to its output offset: staging is the packed batch.
    for (size_t k = 0; k < runs.size(); ++k) {
      const Run& run = runs[k];
      run_src[k] = run.first * r;
      emit_reads(run.shard, run.read_begin, run.read_end, run_src[k]);
    }
    plan.staging_bytes = ids.size() * r;
  } else {
    // Read the widened ranges in file order, merging those that overlap or touch, each page once.
    std::vector<size_t> by_offset(runs.size());
    for (size_t k = 0; k < runs.size(); ++k) by_offset[k] = k;
    std::sort(by_offset.begin(), by_offset.end(), [&](size_t a, size_t b) {
      return runs[a].shard != runs[b].shard ? runs[a].shard < runs[b].shard : runs[a].read_begin < runs[b].read_begin;
    });
    struct Range {
      uint32_t shard;
      uint64_t begin, end;
      size_t first, last;  // its runs: by_offset[first, last)
    };
    std::vector<Range> ranges;
    uint64_t exact = 0;  // staging without gaps
    size_t k = 0;
    while (k < by_offset.size()) {
      Range g{runs[by_offset[k]].shard, runs[by_offset[k]].read_begin, runs[by_offset[k]].read_end, k, k + 1};
      while (g.last < by_offset.size() && runs[by_offset[g.last]].shard == g.shard &&
             runs[by_offset[g.last]].read_begin <= g.end) {
        g.end = std::max(g.end, runs[by_offset[g.last]].read_end);
        ++g.last;
      }
      exact += g.end - g.begin;
      ranges.push_back(g);
      k = g.last;
    }
    // Coalescing: neighbouring ranges of one shard at most max_gap apart are read as one, the gap
    // included (one request instead of two, for the price of the gap's bytes), while the staging stays
    // within staging_limit.
    if (max_gap > 0 && ranges.size() > 1) {
      uint64_t budget = staging_limit > exact ? staging_limit - exact : 0;
      std::vector<Range> merged;
      merged.push_back(ranges.front());
      for (size_t q = 1; q < ranges.size(); ++q) {
        Range& last = merged.back();
        const Range& g = ranges[q];
        const uint64_t gap = g.begin - last.end;  // (> 0: touching ranges were merged above)
        if (g.shard == last.shard && gap <= max_gap && gap <= budget) {
          budget -= gap;
          last.end = g.end;
          last.last = g.last;
        } else {
          merged.push_back(g);
        }
      }
      ranges.swap(merged);
    }
    // The ranges follow one another in staging.
    for (const Range& g : ranges) {
      const uint64_t staging = plan.staging_bytes;
      for (size_t q = g.first; q < g.last; ++q) run_src[by_offset[q]] = staging + (runs[by_offset[q]].begin - g.begin);
      emit_reads(g.shard, g.begin, g.end, staging);
      plan.staging_bytes += g.end - g.begin;
    }
  }
  for (size_t k = 0; k < runs.size(); ++k) {
    const Run& run = runs[k];
    plan.placements.push_back({run_src[k], run.first * r, run.count * r});
    plan.run_shard.push_back(run.shard);
    plan.run_offset.push_back(run.begin);
    for (size_t q = 0; q < run.count; ++q) {
      plan.record_src[run.first + q] = run_src[k] + q * r;
      plan.record_shard[run.first + q] = run.shard;
    }
  }
  plan.packed = !aligned;
}

}  // namespace optimized::loader
