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
                    float* c, float alpha, float beta, int threads, bool trans_a, bool trans_b) {
  openblas_set_num_threads(threads);
  const int lda = static_cast<int>(trans_a ? m : k), ldb = static_cast<int>(trans_b ? k : n);
  for (int64_t i = 0; i < batch; ++i) {
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a + i * m * k, lda,
                b + i * k * n, ldb, beta, c + i * m * n, static_cast<int>(n));
  }
}

#else

bool openblas_available() { return false; }
std::string openblas_description() { return "OpenBLAS not found"; }
void openblas_sgemm(int64_t, int64_t, int64_t, int64_t, const float*, const float*, float*, float,
                    float, int, bool, bool) {
  throw std::runtime_error("openblas_sgemm: this build has no OpenBLAS (OpenBLAS not found)");
}

#endif

}  // namespace bench
