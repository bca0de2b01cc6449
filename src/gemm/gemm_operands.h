// What the GEMM entry points (gemm.cpp, scaled_gemm.cpp) share to validate their operands: one
// operand seen as a batch of row- or column-major matrices (checked, naming the argument), and the
// aliasing check. Host only, private to the family.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "core/arg_checks.h"
#include "optimized/core.h"

namespace optimized::gemm_detail {

using arg::invalid;
using arg::shape_string;

// One operand seen as (batch, rows, cols) stored row-major (col_major false: rows ld apart) or
// column-major (col_major true: columns ld apart), with a batch stride.
struct Operand {
  int64_t batch, rows, cols, ld, batch_stride;
  bool col_major;
};

inline Operand as_matrix(const TensorView& t, const char* name) {
  if (!t.data) invalid(std::string(name) + ": expected a non-null data pointer; given null");
  if (t.rank != 2 && t.rank != 3)
    invalid(std::string(name) + ": expected rank 2 (rows, cols) or 3 (batch, rows, cols); given rank " +
            std::to_string(t.rank) + " " + shape_string(t));
  for (int i = 0; i < t.rank; ++i)
    if (t.shape[i] < 1)
      invalid(std::string(name) + ": expected every dimension >= 1; given shape " + shape_string(t));
  if (reinterpret_cast<uintptr_t>(t.data) % dtype_size(t.dtype) != 0)
    invalid(std::string(name) + ": expected data aligned to " + std::to_string(dtype_size(t.dtype)) +
            " bytes (the element size); given address " + std::to_string(reinterpret_cast<uintptr_t>(t.data)));
  const int r = t.rank;
  const int64_t rows = t.shape[r - 2], cols = t.shape[r - 1];
  const int64_t row_stride = t.strides[r - 2], col_stride = t.strides[r - 1];
  Operand op{r == 3 ? t.shape[0] : 1, rows, cols, 0, r == 3 ? t.strides[0] : 0, false};
  // Row-major: unit stride along a row, rows at least a row apart; column-major the other way
  // round. A dimension of extent 1 never steps, so its stride does not matter (a row vector with
  // strided elements is a column-major (1, K) matrix).
  // A single column with unit stride reads either way; column-major makes it one contiguous
  // stored row (what TMA and vector loads want), where row-major would be rows one element apart.
  const bool contiguous_column = cols == 1 && rows > 1 && row_stride == 1;
  if (!contiguous_column && (cols == 1 || col_stride == 1) && (rows == 1 || row_stride >= cols)) {
    op.ld = rows == 1 ? cols : row_stride;
  } else if ((rows == 1 || row_stride == 1) && (cols == 1 || col_stride >= rows)) {
    op.col_major = true;
    op.ld = cols == 1 ? rows : col_stride;
  } else {
    invalid(std::string(name) +
            ": expected a row-major view (unit stride in the last dimension, row stride >= " + std::to_string(cols) +
            ") or a column-major one (unit stride in the second-to-last, column stride >= " + std::to_string(rows) +
            "); given strides of " + t.describe());
  }
  if (r == 3 && op.batch > 1 && op.batch_stride < 0)
    invalid(std::string(name) + ": expected a non-negative batch stride; given " + std::to_string(op.batch_stride));
  return op;
}

// Whether two views' byte ranges meet (the aliasing check). view_extent checks that the shape and
// strides of each describe an int64-addressable range (no overflow), naming the argument.
inline bool overlaps(const TensorView& x, const char* x_name, const TensorView& y, const char* y_name) {
  const ViewExtent ex = view_extent(x, x_name), ey = view_extent(y, y_name);
  return ex.begin < ey.end && ey.begin < ex.end;
}

}  // namespace optimized::gemm_detail
