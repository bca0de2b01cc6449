// The GPU gather that packs a batch's records from the staging copy into the output, when they
// arrive as more than a few runs (shuffled records, odd record sizes under O_DIRECT).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "loader/read_plan.h"

namespace optimized::loader {

// Largest piece one thread block copies: placements are split into pieces of at most this size so
// that a long run is spread over many blocks.
inline constexpr uint64_t kGatherPieceBytes = 64 * 1024;

// dst_base[p.dst, p.dst + p.bytes) = src_base[p.src, ...) for each of `count` pieces (a device array,
// each piece <= kGatherPieceBytes). Returns the launch error.
cudaError_t launch_gather(const uint8_t* src_base, uint8_t* dst_base, const Placement* pieces, int64_t count,
                          cudaStream_t stream);

}  // namespace optimized::loader
