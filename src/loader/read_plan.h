// The read plan of one batch: which byte ranges of which shards to read into the staging buffer,
// and where each record then lies in it.
//
// Records consecutive in the batch and adjacent in one shard form a run, read as one range (a
// sequential epoch reads each batch as one or two runs). With O_DIRECT, file offsets, lengths and
// buffer addresses must be multiples of 4 KiB, and records need not be: each run's range is widened
// to 4 KiB boundaries, so a run's records start a few bytes into its staging range. Widened ranges
// that overlap or touch (small shuffled records share pages) are merged and read once, so a batch
// never stages a page twice: its staging is bounded by the shards' data as well as by the batch.
// Placements (one per run: staging offset -> output offset, bytes) then pack the records into the
// batch: a single H2D copy when there is one run, else a gather on the GPU (or memcpy on the CPU).
// Without O_DIRECT (alignment 1) runs are read straight to their output offsets: staging already
// holds the packed batch. With O_DIRECT, ranges a small gap apart may be coalesced into one read of
// both and the gap (plan_batch's max_gap), within the slot's slack.
#pragma once

#include <cstdint>
#include <vector>

#include "optimized/loader.h"

namespace optimized::loader {

struct ReadChunk {
  uint32_t shard = 0;
  uint64_t file_offset = 0;
  uint64_t bytes = 0;
  uint64_t staging_offset = 0;
};

// Copy `bytes` from staging offset `src` to output offset `dst`. Laid out as the gather kernel reads it.
struct Placement {
  uint64_t src = 0;
  uint64_t dst = 0;
  uint64_t bytes = 0;
};

struct ReadPlan {
  std::vector<ReadChunk> chunks;        // reads, each <= chunk_bytes
  std::vector<Placement> placements;    // one per run, in batch order
  std::vector<uint64_t> record_src;     // staging offset of each record, in batch order
  std::vector<uint32_t> record_shard;   // shard of each record
  std::vector<uint32_t> run_shard;      // shard of each placement's run
  std::vector<uint64_t> run_offset;     // file offset of each run's first record (mmap reads there)
  uint64_t staging_bytes = 0;           // staging used
  uint64_t read_bytes = 0;              // sum of chunk bytes
  bool packed = false;                  // staging[0, n * record_bytes) is the batch as delivered
};

// Staging bytes a batch of up to `batch_records` records can need at `alignment`. Alignment 1: the
// records. Aligned: each of at most `max_runs` runs widened by under one alignment unit on either
// side, and never more than `data_bytes` (the sum of the shards' aligned data sections, since no page
// is read twice). max_runs: batch_records when shuffled; the shard count when sequential (a range of
// consecutive records is one run per shard it touches).
uint64_t staging_capacity(uint64_t batch_records, uint64_t record_bytes, uint64_t alignment,
                          uint64_t max_runs = UINT64_MAX, uint64_t data_bytes = UINT64_MAX);
// The sum of the shards' data sections, each widened to whole 4 KiB pages.
uint64_t aligned_data_bytes(const DatasetInfo& info);

// ids: dataset record indices in batch order. alignment: 4096 (O_DIRECT) or 1. chunk_bytes: a
// multiple of alignment. Aligned plans only: ranges of one shard at most max_gap bytes apart (after
// widening and merging) are read as one range, gap included, as long as the plan's staging stays within
// staging_limit (so a slot sized by staging_capacity still holds it; the gaps use its slack); a gap of
// 0 keeps the plan as without coalescing. Coalesced or not, every record lands at record_src.
void plan_batch(const DatasetInfo& info, const std::vector<uint64_t>& ids, uint64_t alignment,
                uint64_t chunk_bytes, ReadPlan& plan, uint64_t max_gap = 0, uint64_t staging_limit = UINT64_MAX);

// The gap the loader coalesces across with O_DIRECT: 32 KiB, about what a request costs on the disks
// measured (a virtio disk at 2 GB/s reads 32 KiB in 16 us, less than a request's round trip).
inline constexpr uint64_t kCoalesceGapBytes = 32 * 1024;

}  // namespace optimized::loader
