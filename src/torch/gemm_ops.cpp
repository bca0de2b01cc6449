// The torch glue of GEMM (include/optimized/gemm.h):
//
//   TORCH_LIBRARY(optimized, m)             the schemas of torch.ops.optimized.matmul and
//                                           gemm_variants (the first glue file: it opens the library;
//                                           the other families add TORCH_LIBRARY_FRAGMENTs)
//   TORCH_LIBRARY_IMPL(optimized, CPU|CUDA) the kernel: torch.matmul's N-D shape rules on top of the
//                                           C++ API's batched matrices; outputs from torch (the caching
//                                           allocator, so CUDA graphs capture them); the current stream
//                                           of the device, under a device guard.
//
// Checks (see common.h for who checks what): the glue checks the tensors' torch facts and
// torch.matmul's N-D rules (at least one dimension, K of 1-D and N-D operands, broadcastable batch
// dimensions); dtypes, devices and variants are the C++ API's to check, and its messages arrive
// prefixed "optimized::matmul: ".
//
// Autograd and the fake (meta) kernel are registered from Python (python/optimized_ops/gemm/),
// through the package's register_autograd and torch.library.register_fake.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <string>
#include <vector>

#include "common.h"
#include "optimized/core.h"
#include "optimized/gemm.h"

namespace optimized::torch_glue {

namespace {

constexpr const char* kOp = "matmul";

// ---- N-D operands as batches of matrices ---------------------------------------------------------
//
// torch.matmul's shape rules: a 1-D a is one row (1, K) whose M dimension the result drops; a 1-D b
// is one column (K, 1) whose N dimension the result drops; every dimension before the last two is a
// batch dimension, and the two operands' batch shapes broadcast (aligned on the right, a size of 1
// stretches) to the batch shape of the result, (*batch, M, N) less what the 1-D operands drop.
//
// The C++ API takes one batch dimension with a stride (0 for broadcast). Without copying, the
// glue sees each operand through the broadcast batch shape (stride 0 where it is broadcast, i.e.
// an expanded view), drops batch dimensions of size 1 and merges neighbouring batch dimensions
// when they collapse into one stride for a, b and the output together. The innermost merged group
// becomes the C++ batch; any outer groups (batch dimensions that do not collapse, as with
// (2, 1, M, K) @ (7, K, N)) are walked here, one C++ call per outer index with offset pointers,
// instead of materializing an expanded copy. Only the matrices themselves must qualify: row-major
// (unit stride along a row, rows at least a row apart) or column-major (the transpose of that:
// x.t(), x.mT, the weight of a linear layer as x @ w.t()), which the C++ API takes as they are;
// operands that do not (expanded rows, other strides) are copied with .contiguous() as given,
// before broadcasting: a broadcast is never materialized.

// One operand seen as a batch of (rows, cols) matrices: element (batch index p, i, j) lies at
// data + sum_d p_d * batch_strides[d] + i * row_stride + j * col_stride.
struct Matrices {
  at::Tensor tensor;  // owns the memory (the input, or a contiguous copy of it)
  std::vector<int64_t> batch_sizes, batch_strides;
  int64_t rows = 1, cols = 1, row_stride = 1, col_stride = 1;
};

// is_a: a 1-D tensor is a row (1, K); otherwise (K, 1), a column.
Matrices as_matrices(const at::Tensor& t, bool is_a) {
  Matrices m;
  m.tensor = t;
  const int64_t r = t.dim();
  if (r == 1) {
    if (is_a) {
      m.cols = t.size(0);
      m.col_stride = t.stride(0);
      m.row_stride = m.cols;
    } else {
      m.rows = t.size(0);
      m.row_stride = t.stride(0);
    }
    return m;
  }
  m.batch_sizes.assign(t.sizes().begin(), t.sizes().end() - 2);
  m.batch_strides.assign(t.strides().begin(), t.strides().end() - 2);
  m.rows = t.size(r - 2);
  m.cols = t.size(r - 1);
  m.row_stride = t.stride(r - 2);
  m.col_stride = t.stride(r - 1);
  return m;
}

// Whether the C++ API takes each matrix as it is (common.h).
bool row_major(const Matrices& m) { return row_major_strides(m.rows, m.cols, m.row_stride, m.col_stride); }
bool column_major(const Matrices& m) { return column_major_strides(m.rows, m.cols, m.row_stride, m.col_stride); }
bool qualifies(const Matrices& m) { return row_major(m) || column_major(m); }

// The stride of broadcast batch dimension d (of `rank`) for an operand: 0 where it is broadcast
// (missing on the left, or of size 1), as Tensor::expand would give.
int64_t broadcast_stride(const Matrices& m, size_t d, size_t rank) {
  const size_t missing = rank - m.batch_sizes.size();
  if (d < missing) return 0;
  const size_t i = d - missing;
  return m.batch_sizes[i] == 1 ? 0 : m.batch_strides[i];
}

// A group of merged batch dimensions: its size and the stride of a, b and the output per step.
struct BatchGroup {
  int64_t size;
  int64_t stride[3];
};

// The broadcast batch dimensions of a, b and the output, merged where they collapse, innermost
// group first. Dimensions of size 1 are dropped (no index moves along them).
std::vector<BatchGroup> fold_batch(const std::vector<int64_t>& batch, const Matrices& a, const Matrices& b,
                                   const std::vector<int64_t>& out_strides) {
  std::vector<BatchGroup> groups;
  for (size_t d = batch.size(); d-- > 0;) {
    if (batch[d] == 1) continue;
    const BatchGroup dim{batch[d],
                         {broadcast_stride(a, d, batch.size()), broadcast_stride(b, d, batch.size()), out_strides[d]}};
    if (!groups.empty()) {
      BatchGroup& inner = groups.back();
      bool collapses = true;
      for (int i = 0; i < 3; ++i) collapses = collapses && dim.stride[i] == inner.stride[i] * inner.size;
      if (collapses) {
        inner.size *= dim.size;
        continue;
      }
    }
    groups.push_back(dim);
  }
  return groups;
}

// The rank-2 (no group) or rank-3 (batch, rows, cols) view of one operand's matrices at `offset`
// elements from its data, with `group` as the batch.
TensorView matrix_view(const Matrices& m, int64_t offset, const BatchGroup* group, int which) {
  static constexpr const char* kArgs[3] = {"a", "b", "out"};
  const at::Tensor& t = m.tensor;
  const std::string prefix = arg_prefix(kOp, kArgs[which]);
  TensorView v;
  v.data = static_cast<char*>(t.data_ptr()) + offset * static_cast<int64_t>(t.element_size());
  v.dtype = to_dtype(t.scalar_type(), prefix);
  v.device = to_device(t.device(), prefix);
  v.rank = group ? 3 : 2;
  const int r = v.rank;
  v.shape[r - 2] = m.rows;
  v.shape[r - 1] = m.cols;
  // The strides of the layout the C++ API will see (a stride along a dimension of one is never
  // used; it is set so that the view reads as that layout).
  if (row_major(m)) {
    v.strides[r - 2] = m.rows == 1 ? m.cols : m.row_stride;
    v.strides[r - 1] = 1;
  } else {
    v.strides[r - 2] = 1;
    v.strides[r - 1] = m.cols == 1 ? m.rows : m.col_stride;
  }
  if (group) {
    v.shape[0] = group->size;
    v.strides[0] = group->stride[which];
  }
  return v;
}

// A tensor torch.matmul takes: at least one dimension (a 0-D operand has no K).
void check_operand(const at::Tensor& t, const char* name, const char* shapes) {
  check_tensor(t, kOp, name);
  TORCH_CHECK_VALUE(t.dim() >= 1, arg_prefix(kOp, name) + "expected a tensor of at least 1 dimension, " + shapes +
                                      "; given 0-D (a scalar)");
}

}  // namespace

// out = a @ b with torch.matmul's shape rules (see "N-D operands" above): a (..., M, K) or (K,),
// b (..., K, N) or (K,); out (*broadcast batch, M, N) without M when a is 1-D and without N when b
// is 1-D; contiguous.
at::Tensor matmul(const at::Tensor& a, const at::Tensor& b, c10::string_view variant_name) {
  check_operand(a, "a", "(K,) or (..., M, K)");
  check_operand(b, "b", "(K,) or (..., K, N)");
  // dtypes and devices: the C++ API's (one dtype and device for a, b and the output).
  Matrices ma = as_matrices(a, true), mb = as_matrices(b, false);
  const int64_t m = ma.rows, k = ma.cols, n = mb.cols;
  // K here, not only in the C++ API: in the words of 1-D operands, and before the zero-size
  // shortcuts below, which never reach the C++ API.
  TORCH_CHECK_VALUE(mb.rows == k, arg_prefix(kOp, "b") + "expected " +
                                      (b.dim() == 1 ? "length " + str(k) : str(k) + " rows") + " to match a's " +
                                      (a.dim() == 1 ? "length" : "columns") + " (K); given shape " + str(b.sizes()) +
                                      " with a of shape " + str(a.sizes()));
  // The broadcast batch shape, aligned on the right.
  const size_t rank = std::max(ma.batch_sizes.size(), mb.batch_sizes.size());
  std::vector<int64_t> batch(rank);
  for (size_t d = 0; d < rank; ++d) {
    const size_t da = rank - ma.batch_sizes.size(), db = rank - mb.batch_sizes.size();
    const int64_t sa = d < da ? 1 : ma.batch_sizes[d - da], sb = d < db ? 1 : mb.batch_sizes[d - db];
    TORCH_CHECK_VALUE(sa == sb || sa == 1 || sb == 1,
                      arg_prefix(kOp, "b") + "expected batch dimensions broadcastable with a's " +
                          str(ma.batch_sizes) + " (each equal, or 1 in either); given " + str(mb.batch_sizes) +
                          " (b of shape " + str(b.sizes()) + ", a of shape " + str(a.sizes()) + ")");
    batch[d] = sa == 1 ? sb : sa;  // a size of 1 stretches (also to 0)
  }
  const std::string where = op_name(kOp);
  const GemmVariant variant = call_api(
      where, [&] { return parse_gemm_variant(std::string_view(variant_name.data(), variant_name.size())); });

  std::vector<int64_t> out_shape = batch;
  if (a.dim() > 1) out_shape.push_back(m);
  if (b.dim() > 1) out_shape.push_back(n);
  at::Tensor out = at::empty(out_shape, a.options());
  if (out.numel() == 0) return out;
  // The C++ API takes dimensions >= 1 only: an empty result, or an empty sum (K = 0), is the glue's.
  if (k == 0) return out.zero_();

  // Matrices that do not qualify (neither row- nor column-major: expanded rows, other strides) are
  // copied, un-broadcast.
  if (!qualifies(ma)) ma = as_matrices(a.contiguous(), true);
  if (!qualifies(mb)) mb = as_matrices(b.contiguous(), false);
  // The output as (*batch, M, N), contiguous.
  Matrices mc;
  mc.tensor = out;
  mc.rows = m;
  mc.cols = n;
  mc.row_stride = n;
  std::vector<int64_t> out_strides(rank);
  int64_t step = m * n;
  for (size_t d = rank; d-- > 0;) {
    out_strides[d] = step;
    step *= batch[d];
  }
  const std::vector<BatchGroup> groups = fold_batch(batch, ma, mb, out_strides);
  const BatchGroup* inner = groups.empty() ? nullptr : &groups.front();

  const Launch launch(a.device());
  // One call per index of the outer groups (an odometer over groups[1..]), with offset pointers.
  std::vector<int64_t> index(groups.size(), 0);
  int64_t offset[3] = {0, 0, 0};
  call_api(where, [&] {
    while (true) {
      // In order (std::array{...} evaluates left to right): a dtype without a C++ type is a's first.
      const auto [av, bv, cv] = std::array{matrix_view(ma, offset[0], inner, 0), matrix_view(mb, offset[1], inner, 1),
                                           matrix_view(mc, offset[2], inner, 2)};
      optimized::matmul(av, bv, cv, 1.0f, 0.0f, variant, launch.ctx);
      size_t g = 1;
      for (; g < groups.size(); ++g) {
        for (int i = 0; i < 3; ++i) offset[i] += groups[g].stride[i];
        if (++index[g] < groups[g].size) break;
        for (int i = 0; i < 3; ++i) offset[i] -= groups[g].size * groups[g].stride[i];
        index[g] = 0;
      }
      if (g >= groups.size()) break;
    }
  });
  return out;
}

// The ladder (naive to best, "auto" excluded), from the C++ API's table.
std::vector<std::string> gemm_variants() { return variant_names(all_gemm_variants(), gemm_variant_name); }

}  // namespace optimized::torch_glue

TORCH_LIBRARY(optimized, m) {
  m.def(
      "matmul(Tensor a, Tensor b, *, str variant='auto') -> Tensor",
      {at::Tag::pt2_compliant_tag});
  m.def("gemm_variants() -> str[]", &optimized::torch_glue::gemm_variants);
}

TORCH_LIBRARY_IMPL(optimized, CPU, m) { m.impl("matmul", &optimized::torch_glue::matmul); }

TORCH_LIBRARY_IMPL(optimized, CUDA, m) { m.impl("matmul", &optimized::torch_glue::matmul); }
