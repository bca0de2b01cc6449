// The fused epilogue of a matrix product: what a linear layer, its backward and an MLP block do to
// the fp32 accumulators before the output is stored, in one pass (the GEMM's GemmEpilogue,
// include/optimized/gemm.h):
//
//   pre = alpha * acc + beta * C + bias[col] (or bias[row])
//   forward:   out = act(pre) + residual,          aux = pre (when asked)
//   gradient:  out = pre * act'(aux) + residual    (aux read: the forward's pre-activation)
//   C = round(out)
//
// FusedEpilogue<TC, E> takes the output's element type TC (bias, aux and residual share it) and a
// params struct E with the fields below (the family's: GemmParams' GemmEpilogueParams); value()
// returns out in fp32 (the rung sums columns of it when asked) and writes aux; store() / store2()
// also write C, one element or two neighbours as one access. Every extra tensor is optional and
// read or written once per element; the rung decides the order of the elements.
//
//   E: bias (const void*), bias_along_m, act (int: Activation), act_grad, aux (void*), ld_aux,
//      batch_stride_aux, residual (const void*), ld_residual, batch_stride_residual.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/dtype.cuh"
#include "kernels/math.cuh"

namespace optimized::kernels {

// The activations, numbered as optimized::Activation.
enum : int { kActNone = 0, kActRelu = 1, kActGeluErf = 2, kActGeluTanh = 3, kActSilu = 4 };

__device__ __forceinline__ float activate(int act, float x) {
  switch (act) {
    case kActRelu: return x > 0.0f ? x : (x == x ? 0.0f : x);  // NaN stays NaN (as torch.relu)
    case kActGeluErf: return gelu(x, false);
    case kActGeluTanh: return gelu(x, true);
    case kActSilu: return silu(x);
    default: return x;
  }
}

// d act(x) / dx; relu's derivative at 0 is 0 (torch's convention).
__device__ __forceinline__ float activate_grad(int act, float x) {
  switch (act) {
    case kActRelu: return x > 0.0f ? 1.0f : (x == x ? 0.0f : x);
    case kActGeluErf: return gelu_grad(x, false);
    case kActGeluTanh: return gelu_grad(x, true);
    case kActSilu: {
      const float s = sigmoid(x);
      return s * (1.0f + x * (1.0f - s));
    }
    default: return 1.0f;
  }
}

template <typename TC, typename E>
struct FusedEpilogue {
  float alpha, beta;
  TC* c;  // batch 0's C, row-major
  int64_t ldc, batch_stride_c;
  E e;
  bool pairs;  // two neighbouring columns (even col) are one aligned access in C, aux and residual

  // out at (z, row, col) for the product sum acc; writes aux in the forward.
  __device__ __forceinline__ float value(int64_t z, int64_t row, int64_t col, float acc) const {
    float pre = alpha * acc;
    if (beta != 0.0f) pre = fmaf(beta, to_float(c[z * batch_stride_c + row * ldc + col]), pre);
    if (e.bias) pre += to_float(static_cast<const TC*>(e.bias)[e.bias_along_m ? row : col]);
    float out;
    if (e.act_grad) {
      out = pre * activate_grad(e.act, to_float(static_cast<const TC*>(e.aux)[z * e.batch_stride_aux + row * e.ld_aux + col]));
    } else {
      if (e.aux) static_cast<TC*>(e.aux)[z * e.batch_stride_aux + row * e.ld_aux + col] = from_float<TC>(pre);
      out = activate(e.act, pre);
    }
    if (e.residual)
      out += to_float(static_cast<const TC*>(e.residual)[z * e.batch_stride_residual + row * e.ld_residual + col]);
    return out;
  }

  // Both neighbours (col, col + 1; col + 1 inside the matrix), with one access per tensor when
  // `pairs` (col even), else element by element.
  __device__ __forceinline__ void value2(int64_t z, int64_t row, int64_t col, float acc0, float acc1, float* out0,
                                         float* out1) const {
    if (!pairs) {
      *out0 = value(z, row, col, acc0);
      *out1 = value(z, row, col + 1, acc1);
      return;
    }
    using Pair = std::conditional_t<sizeof(TC) == 2, uint32_t, float2>;
    const auto load2 = [](const TC* p, float* x0, float* x1) {
      const Pair w = *reinterpret_cast<const Pair*>(p);
      const TC* v = reinterpret_cast<const TC*>(&w);
      *x0 = to_float(v[0]);
      *x1 = to_float(v[1]);
    };
    float p0 = alpha * acc0, p1 = alpha * acc1;
    if (beta != 0.0f) {
      float c0, c1;
      load2(c + z * batch_stride_c + row * ldc + col, &c0, &c1);
      p0 = fmaf(beta, c0, p0);
      p1 = fmaf(beta, c1, p1);
    }
    if (e.bias) {
      const TC* bias = static_cast<const TC*>(e.bias);
      if (e.bias_along_m) {
        const float b = to_float(bias[row]);
        p0 += b;
        p1 += b;
      } else {
        float b0, b1;
        load2(bias + col, &b0, &b1);
        p0 += b0;
        p1 += b1;
      }
    }
    if (e.act_grad) {
      float x0, x1;
      load2(static_cast<const TC*>(e.aux) + z * e.batch_stride_aux + row * e.ld_aux + col, &x0, &x1);
      p0 *= activate_grad(e.act, x0);
      p1 *= activate_grad(e.act, x1);
    } else {
      if (e.aux) store2_raw(static_cast<TC*>(e.aux) + z * e.batch_stride_aux + row * e.ld_aux + col, p0, p1);
      p0 = activate(e.act, p0);
      p1 = activate(e.act, p1);
    }
    if (e.residual) {
      float r0, r1;
      load2(static_cast<const TC*>(e.residual) + z * e.batch_stride_residual + row * e.ld_residual + col, &r0, &r1);
      p0 += r0;
      p1 += r1;
    }
    *out0 = p0;
    *out1 = p1;
  }

  __device__ __forceinline__ static void store2_raw(TC* p, float v0, float v1) {
    if constexpr (sizeof(TC) == 2) {
      uint32_t packed;
      TC* pv = reinterpret_cast<TC*>(&packed);
      pv[0] = from_float<TC>(v0);
      pv[1] = from_float<TC>(v1);
      *reinterpret_cast<uint32_t*>(p) = packed;
    } else {
      *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
    }
  }

  // C(z, row, col) = out; returns out.
  __device__ __forceinline__ float store(int64_t z, int64_t row, int64_t col, float acc) const {
    const float out = value(z, row, col, acc);
    c[z * batch_stride_c + row * ldc + col] = from_float<TC>(out);
    return out;
  }
  // C(z, row, col .. col + 1), as one access when `pairs`; col + 1 inside the matrix.
  __device__ __forceinline__ void store2(int64_t z, int64_t row, int64_t col, float acc0, float acc1, float* out0,
                                         float* out1) const {
    value2(z, row, col, acc0, acc1, out0, out1);
    if (pairs) {
      store2_raw(c + z * batch_stride_c + row * ldc + col, *out0, *out1);
    } else {
      TC* p = c + z * batch_stride_c + row * ldc + col;
      p[0] = from_float<TC>(*out0);
      p[1] = from_float<TC>(*out1);
    }
  }
  // Four neighbours (col a multiple of 4, col + 3 inside the matrix): two pairs.
  __device__ __forceinline__ void store4(int64_t z, int64_t row, int64_t col, float4 acc, float4* out) const {
    store2(z, row, col, acc.x, acc.y, &out->x, &out->y);
    store2(z, row, col + 2, acc.z, acc.w, &out->z, &out->w);
  }
};

}  // namespace optimized::kernels
