// What the families' public entries (fused.cpp, attention.cpp, kv_cache.cpp, the GEMM operands)
// share to check arguments and word their errors: the Error shorthands, "absent" optional views,
// numbers and shapes as message text, and two checks of a single view. Host only, internal.
#pragma once

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "optimized/core.h"

namespace optimized::arg {

[[noreturn]] inline void invalid(const std::string& message) { throw Error(Status::kInvalidArgument, message); }
[[noreturn]] inline void unsupported(const std::string& message) { throw Error(Status::kUnsupported, message); }

// An optional operand passed as an empty view (rank 0) is absent.
inline bool present(const TensorView& t) { return t.rank != 0; }

// A double as the shortest text that reads back to it ("-1", "1e-05", "nan", "inf"). Not through
// an ostream: formatting a double with iostreams crashed inside num_put when the library ran in the
// H100's Python process (GCC 13 build, torch 2.11; C++ test processes were fine), and to_chars needs
// no locale.
inline std::string number(double v) {
  char text[64];
  const std::to_chars_result r = std::to_chars(text, text + sizeof text, v);
  return std::string(text, r.ptr);
}

// "(2, 3, 4)".
inline std::string shape_string(const TensorView& t) {
  std::string s = "(";
  for (int i = 0; i < t.rank; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + ")";
}

// Error kInvalidArgument naming `name` unless t's data is aligned to its element size.
inline void check_element_aligned(const TensorView& t, const char* name) {
  if (reinterpret_cast<uintptr_t>(t.data) % dtype_size(t.dtype) != 0)
    invalid(std::string(name) + ": expected data aligned to the element size (" + std::to_string(dtype_size(t.dtype)) +
            " bytes)");
}

// An output's elements must be distinct memory: sorted by stride, each dimension of size > 1 steps
// past everything the smaller ones span (a zero stride, or head rows interleaved with query rows,
// would have two threads write one address). A view with no element passes.
inline void check_distinct_elements(const TensorView& t, const char* name) {
  for (int i = 0; i < t.rank; ++i)
    if (t.shape[i] == 0) return;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (|stride|, size)
  for (int i = 0; i < t.rank; ++i)
    if (t.shape[i] > 1) dims.push_back({t.strides[i] < 0 ? -t.strides[i] : t.strides[i], t.shape[i]});
  std::sort(dims.begin(), dims.end());
  int64_t span = 1;  // elements covered by the smaller dimensions
  for (const auto& [stride, size] : dims) {
    if (stride < span)
      invalid(std::string(name) + ": expected an output whose elements do not overlap one another; given " +
              t.describe());
    span = stride * (size - 1) + span;
  }
}

}  // namespace optimized::arg
