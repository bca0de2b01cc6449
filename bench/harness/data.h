// Benchmark data: fixed-seed uniform [-1, 1] values (never all zeros) in any float dtype, device
// buffers filled with them, and results read back to the host.
#pragma once

#include <cstdint>
#include <vector>

#include "optimized/buffer.h"
#include "optimized/core.h"

namespace bench {

// count elements of `dtype` with values uniform in [-1, 1], a pure function of (seed, index)
// (so the result does not depend on the thread count).
std::vector<uint8_t> random_host(optimized::DType dtype, int64_t count, uint64_t seed);
void fill_random(void* host, optimized::DType dtype, int64_t count, uint64_t seed);

// A buffer on `device` holding random_host(dtype, count, seed); when host_copy is not null the host
// data is moved there.
optimized::Buffer random_buffer(optimized::DType dtype, int64_t count, optimized::Device device,
                                uint64_t seed, std::vector<uint8_t>* host_copy = nullptr);

// Reading results back to the host: rows `rows` (ascending) of a (.., cols) output whose rows are
// `ld` elements apart, packed (rows.size(), cols); `contiguous`: the rows are one run (one 2-D copy
// from a device); and a whole buffer.
std::vector<uint8_t> read_rows(const optimized::Buffer& b, const std::vector<int64_t>& rows, bool contiguous,
                               int64_t cols, int64_t ld, size_t elem_size);
std::vector<uint8_t> read_all(const optimized::Buffer& b);

}  // namespace bench
