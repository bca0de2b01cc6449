// Rotary position embedding, the math every RoPE kernel shares (host and device: the CPU rungs and
// the CUDA kernels compute the same angles). No family knowledge: which element pairs rotate, the
// frequency of a pair, the angle reduced to [-pi, pi], the rotation.
//
// Precision. inv_freq[i] = theta^(-2i / rotary_dim) and angle = p * inv_freq[i] are formed in fp64:
// in fp32 the product alone rounds to half an ulp of the angle (4e-3 rad at p = 1e5), and
// inv_freq's own rounding is amplified by p. The fp64 angle (relative error ~1e-16, absolute 1e-11
// at p = 1e5) is reduced by the nearest multiple of 2 pi (Cody-Waite: 2 pi as a double plus its
// remainder, fma), so that the cos / sin that follow -- fp32 on the GPU, where |r| <= pi keeps
// sincosf on its fast, 1-ulp path -- see an argument exact to ~1e-16 * |angle|.
// Cost: ~50 fp64 operations per (token, pair) (pow, the product, the reduction), which the kernels amortize over the token's rows.
#pragma once

#include <math.h>

#include <cstdint>

#include "core/host_device.h"

namespace optimized::kernels {

// The two elements of rotation pair i (< half = rotary_dim / 2) of a row.
// neox: (i, i + half) ("rotate_half"); interleaved (GPT-J): (2i, 2i + 1).
OPTIMIZED_HOST_DEVICE inline int64_t rope_first(bool neox, int64_t i) { return neox ? i : 2 * i; }
OPTIMIZED_HOST_DEVICE inline int64_t rope_second(bool neox, int64_t i, int64_t half) { return neox ? i + half : 2 * i + 1; }

// theta^(-2i / rotary_dim) in fp64 (pow: within an ulp or two, the float64 reference's own formula).
OPTIMIZED_HOST_DEVICE inline double rope_inv_freq(int64_t i, int64_t rotary_dim, double theta) {
  return pow(theta, -static_cast<double>(2 * i) / static_cast<double>(rotary_dim));
}

// p * inv_freq minus the nearest multiple of 2 pi: in [-pi, pi] (up to rounding), fp64.
OPTIMIZED_HOST_DEVICE inline double rope_reduced_angle(int64_t position, double inv_freq) {
  constexpr double kTwoPiHi = 6.283185307179586;       // 2 pi rounded to fp64
  constexpr double kTwoPiLo = 2.4492935982947064e-16;  // 2 pi - kTwoPiHi
  constexpr double kInvTwoPi = 0.15915494309189535;
  const double a = static_cast<double>(position) * inv_freq;
  const double n = rint(a * kInvTwoPi);
  return fma(-n, kTwoPiLo, fma(-n, kTwoPiHi, a));
}

// The rotation of a pair by the angle whose cosine and sine are (c, s); the transpose (backward,
// inverse) is the same with -s.
template <typename A>
OPTIMIZED_HOST_DEVICE inline void rope_rotate(A x0, A x1, A c, A s, A* y0, A* y1) {
  *y0 = x0 * c - x1 * s;
  *y1 = x1 * c + x0 * s;
}

}  // namespace optimized::kernels
