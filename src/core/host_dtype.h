// CPU-side dtype traits for the CPU backends of every family: the storage type of a dtype, the type
// its math runs in (fp32 for the 16-bit types and fp32, fp64 for fp64) and the conversions, so that
// a CPU kernel is written once as a template over one of these.
#pragma once

#include <cstdint>

#include "optimized/buffer.h"

namespace optimized::host {

struct F32 {
  using T = float;
  using Acc = float;
  static float load(float v) { return v; }
  static float store(float v) { return v; }
};
struct F64 {  // fp64 operands compute in fp64 (float64 gradient checks from torch)
  using T = double;
  using Acc = double;
  static double load(double v) { return v; }
  static double store(double v) { return v; }
};
struct F16 {
  using T = uint16_t;
  using Acc = float;
  static float load(uint16_t v) { return half_to_float(v); }
  static uint16_t store(float v) { return float_to_half(v); }  // round to nearest even
};
struct BF16 {
  using T = uint16_t;
  using Acc = float;
  static float load(uint16_t v) { return bf16_to_float(v); }
  static uint16_t store(float v) { return float_to_bf16(v); }  // round to nearest even
};

// body.template operator()<D>() with D the traits of `dtype`: F16, BF16, F64, and F32 for any other (a
// CPU backend runs after the C++ API has refused the dtypes its family does not take).
template <typename Body>
decltype(auto) visit_traits(DType dtype, Body&& body) {
  switch (dtype) {
    case DType::kF16: return body.template operator()<F16>();
    case DType::kBF16: return body.template operator()<BF16>();
    case DType::kF64: return body.template operator()<F64>();
    default: return body.template operator()<F32>();
  }
}

}  // namespace optimized::host
