// The activations of the GEMM epilogues (optimized::Activation, numbered as its values) and their
// derivatives on the host, in the accumulation type (fp32; fp64 for fp64 operands): the formulas of
// the device's kernels::activate / activate_grad (src/kernels/epilogue/fused_epilogue.cuh), shared
// by the CPU GEMM epilogue (cpu/gemm_epilogue.cpp) and the linear family's backward (g = dy *
// act'(pre), src/linear/cpu/linear_cpu.cpp). ReLU keeps NaN, and its derivative at 0 is 0 (torch's).
#pragma once

#include <cmath>

namespace optimized::cpu {

template <typename Acc>
Acc activate(int act, Acc x) {
  constexpr Acc kHalf = Acc(0.5), kSqrt1_2 = Acc(0.70710678118654752440), kSqrt2OverPi = Acc(0.79788456080286535588);
  switch (act) {
    case 1: return x > 0 ? x : (x == x ? Acc(0) : x);
    case 2: return kHalf * x * (1 + std::erf(x * kSqrt1_2));
    case 3: return kHalf * x * (1 + std::tanh(kSqrt2OverPi * (x + Acc(0.044715) * x * x * x)));
    case 4: return x / (1 + std::exp(-x));
    default: return x;
  }
}

template <typename Acc>
Acc activate_grad(int act, Acc x) {
  constexpr Acc kSqrt1_2 = Acc(0.70710678118654752440), kSqrt2OverPi = Acc(0.79788456080286535588),
                kInvSqrt2Pi = Acc(0.39894228040143267794), kCubic = Acc(0.044715);
  switch (act) {
    case 1: return x > 0 ? Acc(1) : (x == x ? Acc(0) : x);
    case 2: return Acc(0.5) * (1 + std::erf(x * kSqrt1_2)) + x * kInvSqrt2Pi * std::exp(Acc(-0.5) * x * x);
    case 3: {
      const Acc t = std::tanh(kSqrt2OverPi * (x + kCubic * x * x * x));
      return Acc(0.5) * (1 + t) + Acc(0.5) * x * (1 - t * t) * kSqrt2OverPi * (1 + 3 * kCubic * x * x);
    }
    case 4: {
      const Acc s = 1 / (1 + std::exp(-x));
      return s * (1 + x * (1 - s));
    }
    default: return Acc(1);
  }
}

}  // namespace optimized::cpu
