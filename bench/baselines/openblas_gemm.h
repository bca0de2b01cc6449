// OpenBLAS baseline for the CPU rows: cblas_sgemm (fp32, row-major) with a chosen thread count.
// Optional: compiled in only when CMake found OpenBLAS (OPTIMIZED_HAVE_OPENBLAS).
#pragma once

#include <cstdint>
#include <string>

namespace bench {

bool openblas_available();
// openblas_get_config() ("OpenBLAS 0.3.21 DYNAMIC_ARCH ..."), or "OpenBLAS not found".
std::string openblas_description();

// C = alpha * A @ B + beta * C on contiguous fp32, C row-major, A row-major or stored (K, M) when
// trans_a, B row-major or stored (N, K) when trans_b (batch > 1: a loop of sgemm calls over M*K,
// K*N, M*N strided batches) with `threads` OpenBLAS threads. Throws when not available.
void openblas_sgemm(int64_t m, int64_t n, int64_t k, int64_t batch, const float* a, const float* b,
                    float* c, float alpha, float beta, int threads, bool trans_a = false, bool trans_b = false);

}  // namespace bench
