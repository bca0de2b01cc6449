// Activation math in fp32: GELU (erf form and torch's tanh approximation) and its derivative,
// sigmoid, SiLU.
#pragma once

#include <cuda_runtime.h>

namespace optimized::kernels {

constexpr float kSqrt1_2 = 0.70710678118654752440f;
constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;
constexpr float kGeluCubic = 0.044715f;

// gelu(x) = x * Phi(x); tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
__device__ __forceinline__ float gelu(float x, bool tanh_form) {
  if (tanh_form) return 0.5f * x * (1.0f + tanhf(kSqrt2OverPi * (x + kGeluCubic * x * x * x)));
  return 0.5f * x * (1.0f + erff(x * kSqrt1_2));
}
// d gelu(x) / dx, same form.
__device__ __forceinline__ float gelu_grad(float x, bool tanh_form) {
  if (tanh_form) {
    const float inner = kSqrt2OverPi * (x + kGeluCubic * x * x * x);
    const float t = tanhf(inner);
    const float dinner = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x);
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * dinner;
  }
  return 0.5f * (1.0f + erff(x * kSqrt1_2)) + x * kInvSqrt2Pi * expf(-0.5f * x * x);
}
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
// silu(a) = a / (1 + exp(-a)) (a kernel that also needs sigmoid(a) computes a * sigmoid(a)).
__device__ __forceinline__ float silu(float a) { return a / (1.0f + expf(-a)); }

}  // namespace optimized::kernels
