// The float64 GEMM reference (see gemm_reference.h).
#include "testing/gemm_reference.h"

#include <algorithm>
#include <vector>

#include "optimized/buffer.h"

namespace optimized::testing {

int64_t element_offset(const TensorView& t, int64_t z, int64_t i, int64_t j) {
  const int r = t.rank;
  const int64_t batch_offset = (r == 3 && t.shape[0] > 1) ? z * t.strides[0] : 0;
  return batch_offset + i * t.strides[r - 2] + j * t.strides[r - 1];
}

void matmul_reference_f64(const TensorView& a, const TensorView& b, const TensorView* c_in,
                          double alpha, double beta, double* c_out) {
  for (const TensorView* t : {&a, &b})
    if (t->device.is_cuda() || (t->rank != 2 && t->rank != 3))
      throw Error(Status::kInvalidArgument, "matmul_reference_f64: expected rank-2/3 host views; given " +
                                                t->describe());
  if (beta != 0.0 && !c_in)
    throw Error(Status::kInvalidArgument, "c_in: expected a view when beta != 0; given null");
  const int64_t m = a.shape[a.rank - 2], k = a.shape[a.rank - 1], n = b.shape[b.rank - 1];
  int64_t batch = 1;
  for (const TensorView* t : {&a, &b, c_in})
    if (t && t->rank == 3) batch = std::max(batch, t->shape[0]);
  std::vector<double> row(static_cast<size_t>(n));
  for (int64_t z = 0; z < batch; ++z)
    for (int64_t i = 0; i < m; ++i) {
      std::fill(row.begin(), row.end(), 0.0);
      for (int64_t p = 0; p < k; ++p) {
        const double aip = load_as_double(a.data, a.dtype, element_offset(a, z, i, p));
        for (int64_t j = 0; j < n; ++j) row[j] += aip * load_as_double(b.data, b.dtype, element_offset(b, z, p, j));
      }
      double* out = c_out + (z * m + i) * n;
      for (int64_t j = 0; j < n; ++j) {
        double v = alpha * row[j];
        if (beta != 0.0) v += beta * load_as_double(c_in->data, c_in->dtype, element_offset(*c_in, z, i, j));
        out[j] = v;
      }
    }
}

}  // namespace optimized::testing
