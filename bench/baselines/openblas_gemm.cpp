// OpenBLAS baseline (see openblas_gemm.h).
#include "baselines/openblas_gemm.h"

#include <stdexcept>

#if OPTIMIZED_HAVE_OPENBLAS
#include <cblas.h>
extern "C" {
void openblas_set_num_threads(int num_threads);
char* openblas_get_config(void);
}
#endif

namespace bench {

#if OPTIMIZED_HAVE_OPENBLAS

bool openblas_available() { return true; }

std::string openblas_description() {
  const char* config = openblas_get_config();
  return config ? std::string("OpenBLAS ") + config : "OpenBLAS";
}

void openblas_sgemm(int64_t m, int64_t n, int64_t k, int64_t batch, const float* a, const float* b,
                    float* c, float alpha, float beta, int threads) {
  openblas_set_num_threads(threads);
  for (int64_t i = 0; i < batch; ++i) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
                static_cast<int>(k), alpha, a + i * m * k, static_cast<int>(k), b + i * k * n,
                static_cast<int>(n), beta, c + i * m * n, static_cast<int>(n));
  }
}

#else

bool openblas_available() { return false; }
std::string openblas_description() { return "OpenBLAS not found"; }
void openblas_sgemm(int64_t, int64_t, int64_t, int64_t, const float*, const float*, float*, float,
                    float, int) {
  throw std::runtime_error("openblas_sgemm: this build has no OpenBLAS (OpenBLAS not found)");
}

#endif

}  // namespace bench
