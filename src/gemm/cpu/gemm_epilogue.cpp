// The CPU rungs' epilogue (GemmEpilogue in gemm.h; an fp32 C from 16-bit operands too), shared by
// cpu_naive, cpu_blocked and cpu_packed: the rung computes alpha * A @ B into a wide scratch, then
// one pass applies the rest of the epilogue and rounds once into C.
//
//   1. 16-bit A and B are widened to fp32 copies (exact), so the rung runs its fp32 kernel: the
//      same products and fp32 accumulation as its 16-bit path, with a wide (fp32) result.
//   2. scratch = alpha * A @ B (fp32; fp64 for fp64 operands), by the rung.
//   3. per element: pre = scratch + beta * C + bias; out = act(pre) or pre * act'(aux);
//      + residual; aux = pre (forward); C = round(out), rows in parallel.
//   4. column sums: each column summed over the rows in row order (in fp64, stored as fp32), so
//      the result is the same on every run and thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/host_dtype.h"
#include "gemm/cpu/activation.h"
#include "gemm/cpu/cpu_gemm.h"
#include "optimized/buffer.h"

namespace optimized::cpu {
namespace {

// A stored operand (rows x cols of `batches` matrices, ld and batch stride in elements) widened
// to a contiguous fp32 copy.
std::vector<float> widen(const void* src, DType dtype, int64_t rows, int64_t cols, int64_t ld, int64_t batch_stride,
                         int64_t batches) {
  std::vector<float> out(static_cast<size_t>(batches * rows * cols));
  const auto* s = static_cast<const uint16_t*>(src);
  for (int64_t z = 0; z < batches; ++z)
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        const uint16_t v = s[z * batch_stride + i * ld + j];
        out[static_cast<size_t>((z * rows + i) * cols + j)] = dtype == DType::kF16 ? half_to_float(v) : bf16_to_float(v);
      }
  return out;
}

template <typename Acc>
void apply(const GemmParams& p, std::vector<Acc>& scratch, int threads) {
  const GemmEpilogueParams& e = p.epi;
  const int64_t rows = p.batch * p.m;
  const int nth = threads > 0 ? threads : omp_get_max_threads();
#pragma omp parallel for num_threads(nth) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t z = r / p.m, i = r % p.m;
    for (int64_t j = 0; j < p.n; ++j) {
      const size_t o = static_cast<size_t>(r * p.n + j);
      const int64_t ci = z * p.batch_stride_c + i * p.ldc + j;
      Acc pre = scratch[o];
      if (p.beta != 0.0f) pre += Acc(p.beta) * static_cast<Acc>(load_as_double(p.c, p.c_dtype, ci));
      if (e.bias) pre += static_cast<Acc>(load_as_double(e.bias, p.c_dtype, e.bias_along_m ? i : j));
      Acc out;
      if (e.act_grad) {
        out = pre * activate_grad(e.act, static_cast<Acc>(load_as_double(e.aux, p.c_dtype, z * e.batch_stride_aux + i * e.ld_aux + j)));
      } else {
        if (e.aux) store_from_double(e.aux, p.c_dtype, z * e.batch_stride_aux + i * e.ld_aux + j, pre);
        out = activate(e.act, pre);
      }
      if (e.residual)
        out += static_cast<Acc>(load_as_double(e.residual, p.c_dtype, z * e.batch_stride_residual + i * e.ld_residual + j));
      scratch[o] = out;  // kept for the column sums
      store_from_double(p.c, p.c_dtype, ci, out);
    }
  }
  if (!e.column_sums) return;
#pragma omp parallel for num_threads(nth) schedule(static)
  for (int64_t col = 0; col < p.batch * p.n; ++col) {
    const int64_t z = col / p.n, j = col % p.n;
    double sum = 0;
    for (int64_t i = 0; i < p.m; ++i) sum += static_cast<double>(scratch[static_cast<size_t>((z * p.m + i) * p.n + j)]);
    e.column_sums[col] = static_cast<float>(sum);
  }
}

}  // namespace

void gemm_with_epilogue(const GemmParams& p, void (*rung)(const GemmParams&, int), int threads) {
  GemmParams q = p;
  q.epi = {};
  q.beta = 0.0f;
  std::vector<float> a16, b16;
  if (p.dtype == DType::kF16 || p.dtype == DType::kBF16) {
    // Widened copies in the stored layouts, contiguous (a broadcast batch stays one matrix).
    const int64_t batches_a = p.batch_stride_a != 0 ? p.batch : 1, batches_b = p.batch_stride_b != 0 ? p.batch : 1;
    a16 = widen(p.a, p.dtype, p.a_stored_rows(), p.a_stored_cols(), p.lda, p.batch_stride_a, batches_a);
    b16 = widen(p.b, p.dtype, p.b_stored_rows(), p.b_stored_cols(), p.ldb, p.batch_stride_b, batches_b);
    q.a = a16.data();
    q.b = b16.data();
    q.lda = p.a_stored_cols();
    q.ldb = p.b_stored_cols();
    q.batch_stride_a = batches_a > 1 ? p.a_stored_rows() * p.a_stored_cols() : 0;
    q.batch_stride_b = batches_b > 1 ? p.b_stored_rows() * p.b_stored_cols() : 0;
    q.dtype = DType::kF32;
  }
  q.c_dtype = q.dtype;
  q.ldc = p.n;
  q.batch_stride_c = p.m * p.n;
  if (q.dtype == DType::kF64) {
    std::vector<double> scratch(static_cast<size_t>(p.batch * p.m * p.n));
    q.c = scratch.data();
    rung(q, threads);
    apply<double>(p, scratch, threads);
  } else {
    std::vector<float> scratch(static_cast<size_t>(p.batch * p.m * p.n));
    q.c = scratch.data();
    rung(q, threads);
    apply<float>(p, scratch, threads);
  }
}

}  // namespace optimized::cpu
