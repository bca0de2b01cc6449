// The checks the MoE family's entries share (moe.cpp, grouped_gemm.cpp): messages name the argument,
// what was expected and what was given (core/arg_checks.h). Host only.
#pragma once

#include <initializer_list>
#include <string>

#include "core/arg_checks.h"
#include "optimized/core.h"

#if OPTIMIZED_WITH_CUDA
#include "core/cuda_launch.h"
#endif

namespace optimized::moe_checks {

inline void check_dtype(const TensorView& t, const char* name, DType want) {
  if (t.dtype != want)
    arg::invalid(std::string(name) + ": expected dtype " + arg::dname(want) + "; given " + arg::dname(t.dtype));
}

// fp32, fp16 or bf16 (what the family's float operands take), else kUnsupported.
inline void check_float(const TensorView& t, const char* name) {
  if (t.dtype != DType::kF32 && t.dtype != DType::kF16 && t.dtype != DType::kBF16)
    arg::unsupported(std::string(name) + ": expected dtype fp32, fp16 or bf16; given " + arg::dname(t.dtype));
}

// A contiguous tensor of exactly `shape` (`what` spells it in messages: "(T, k) = (7, 2)").
inline void check_contiguous(const TensorView& t, const char* name, std::initializer_list<int64_t> shape,
                             const std::string& what) {
  bool same = t.rank == static_cast<int>(shape.size());
  int d = 0;
  for (int64_t s : shape) same = same && t.shape[d++] == s;
  if (!same)
    arg::invalid(std::string(name) + ": expected shape " + what + "; given " + (t.rank ? arg::shape_string(t) : "absent"));
  if (!t.is_contiguous()) arg::invalid(std::string(name) + ": expected a contiguous tensor; given " + t.describe());
}

// check_dtype and check_contiguous of an operand added to ops (an output or not).
inline void add_exact(arg::OperandSet& ops, const TensorView& t, const char* name, bool output, DType want,
                      std::initializer_list<int64_t> shape, const std::string& what) {
  ops.add(t, name, output);
  check_dtype(t, name, want);
  check_contiguous(t, name, shape, what);
}

// A (rows, cols) matrix with unit stride along cols and rows at least cols apart: its row stride.
inline int64_t row_stride(const TensorView& t, const char* name, int64_t rows, int64_t cols, const std::string& what) {
  if (t.rank != 2 || t.shape[0] != rows || t.shape[1] != cols)
    arg::invalid(std::string(name) + ": expected shape " + what + "; given " + (t.rank ? arg::shape_string(t) : "absent"));
  if (cols > 1 && rows > 0 && t.strides[1] != 1)
    arg::invalid(std::string(name) + ": expected unit stride in the last dimension; given " + t.describe());
  if (rows > 1 && t.strides[0] < cols)
    arg::invalid(std::string(name) + ": expected rows at least " + std::to_string(cols) + " elements apart; given " +
                 t.describe());
  return rows > 1 ? t.strides[0] : cols;
}

// CUDA tensors: a usable device in this build (`first` names the argument in the message).
inline void cuda_prelude([[maybe_unused]] const Device& device, const char* first) {
  if (!device.is_cuda()) return;
#if OPTIMIZED_WITH_CUDA
  static const std::string no_cuda = cuda_unavailable_reason();
  if (!no_cuda.empty()) arg::unsupported(std::string(first) + ": CUDA tensors given but " + no_cuda);
#else
  arg::unsupported(std::string(first) + ": CUDA tensors given but this build is CPU-only (built without CUDA)");
#endif
}

}  // namespace optimized::moe_checks
