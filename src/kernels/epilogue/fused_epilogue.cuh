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
// params struct E with the fields below (the family's: GemmParams' GemmEpilogueParams). store() /
// store2() / store4() write one element, two or four neighbours (one access per tensor where the
// alignment allows) and return out in fp32 (the rung sums columns of it when asked); load2() and
// finish2() are store2() in two halves, the reads then the arithmetic and the writes, at a Cursor
// that a rung walking down rows advances, for a rung that keeps several rows' reads in flight. Every extra tensor is optional and read or written once per
// element; the rung decides the order of the elements.
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

// Two neighbouring elements at p as floats: one access when `pair` (p aligned to two elements),
// else two; and the store the other way.
template <typename TC>
__device__ __forceinline__ void load_pair(const TC* p, bool pair, float* x0, float* x1) {
  using Pair = std::conditional_t<sizeof(TC) == 2, uint32_t, float2>;
  if (pair) {
    const Pair w = *reinterpret_cast<const Pair*>(p);
    const TC* v = reinterpret_cast<const TC*>(&w);
    *x0 = to_float(v[0]);
    *x1 = to_float(v[1]);
  } else {
    *x0 = to_float(p[0]);
    *x1 = to_float(p[1]);
  }
}
template <typename TC>
__device__ __forceinline__ void store_pair(TC* p, bool pair, float v0, float v1) {
  if (pair) {
    if constexpr (sizeof(TC) == 2) {
      uint32_t packed;
      TC* pv = reinterpret_cast<TC*>(&packed);
      pv[0] = from_float<TC>(v0);
      pv[1] = from_float<TC>(v1);
      *reinterpret_cast<uint32_t*>(p) = packed;
    } else {
      *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
    }
  } else {
    p[0] = from_float<TC>(v0);
    p[1] = from_float<TC>(v1);
  }
}

template <typename TC, typename E>
struct FusedEpilogue {
  float alpha, beta;
  TC* c;  // batch 0's C, row-major
  int64_t ldc, batch_stride_c;
  E e;
  bool pairs;  // two neighbouring columns (even col) are one aligned access in C, aux and residual

  // What an element pair reads besides the accumulators: C (beta != 0), aux (the gradient), the
  // residual, a bias along M. Loaded apart from the arithmetic (load2, then finish2), so that a
  // caller can have several rows' loads in flight before the first one is used.
  struct Inputs {
    float c0 = 0.0f, c1 = 0.0f, x0 = 0.0f, x1 = 0.0f, r0 = 0.0f, r1 = 0.0f, bm = 0.0f;
  };

  // The bias of columns col and col + 1 when it runs along N (0 otherwise), for a caller that walks
  // rows of fixed columns and loads it once; col + 1 inside the matrix when `two`.
  __device__ __forceinline__ float2 column_bias(int64_t col, bool two) const {
    if (!e.bias || e.bias_along_m) return make_float2(0.0f, 0.0f);
    const TC* bias = static_cast<const TC*>(e.bias);
    return make_float2(to_float(bias[col]), two ? to_float(bias[col + 1]) : 0.0f);
  }

  // Where element (z, row, col) of each tensor is, for a caller that walks down rows of fixed
  // columns: pointers moved by pointer arithmetic (advance) instead of recomputing z * batch stride
  // + row * ld + col per element.
  struct Cursor {
    TC* c;
    TC* aux;
    const TC* residual;
    const TC* bias_m;  // the bias of the row when it runs along M
  };
  __device__ __forceinline__ Cursor cursor(int64_t z, int64_t row, int64_t col) const {
    Cursor at;
    at.c = c + z * batch_stride_c + row * ldc + col;
    at.aux = e.aux ? static_cast<TC*>(e.aux) + z * e.batch_stride_aux + row * e.ld_aux + col : nullptr;
    at.residual = e.residual
                      ? static_cast<const TC*>(e.residual) + z * e.batch_stride_residual + row * e.ld_residual + col
                      : nullptr;
    at.bias_m = e.bias && e.bias_along_m ? static_cast<const TC*>(e.bias) + row : nullptr;
    return at;
  }
  __device__ __forceinline__ void advance(Cursor& at, int rows) const {
    at.c += rows * ldc;
    if (at.aux) at.aux += rows * e.ld_aux;
    if (at.residual) at.residual += rows * e.ld_residual;
    if (at.bias_m) at.bias_m += rows;
  }

  // The inputs of the pair at `at` (col + 1 inside the matrix).
  __device__ __forceinline__ Inputs load2(const Cursor& at) const {
    Inputs in;
    if (beta != 0.0f) load_pair(at.c, pairs, &in.c0, &in.c1);
    if (e.act_grad) load_pair<TC>(at.aux, pairs, &in.x0, &in.x1);
    if (at.residual) load_pair(at.residual, pairs, &in.r0, &in.r1);
    if (at.bias_m) in.bm = to_float(*at.bias_m);
    return in;
  }

  // out for the pair at `at` from the accumulators, the inputs and the columns' bias
  // (column_bias); writes aux (the forward) and C.
  __device__ __forceinline__ void finish2(const Cursor& at, float acc0, float acc1, const Inputs& in, float2 col_bias,
                                          float* out0, float* out1) const {
    float p0 = alpha * acc0, p1 = alpha * acc1;
    if (beta != 0.0f) {
      p0 = fmaf(beta, in.c0, p0);
      p1 = fmaf(beta, in.c1, p1);
    }
    if (e.bias) {
      p0 += col_bias.x + in.bm;  // one of the two is 0
      p1 += col_bias.y + in.bm;
    }
    if (e.act_grad) {
      p0 *= activate_grad(e.act, in.x0);
      p1 *= activate_grad(e.act, in.x1);
    } else {
      if (at.aux) store_pair(at.aux, pairs, p0, p1);
      p0 = activate(e.act, p0);
      p1 = activate(e.act, p1);
    }
    p0 += in.r0;
    p1 += in.r1;
    store_pair(at.c, pairs, p0, p1);
    *out0 = p0;
    *out1 = p1;
  }

  // out at (z, row, col) for the product sum acc, one element (a matrix's last odd column); writes
  // aux in the forward and C. Returns out.
  __device__ __forceinline__ float store(int64_t z, int64_t row, int64_t col, float acc) const {
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
    c[z * batch_stride_c + row * ldc + col] = from_float<TC>(out);
    return out;
  }

  // Both neighbours (col, col + 1; col + 1 inside the matrix): load2 then finish2.
  __device__ __forceinline__ void store2(int64_t z, int64_t row, int64_t col, float acc0, float acc1, float* out0,
                                         float* out1) const {
    const Cursor at = cursor(z, row, col);
    finish2(at, acc0, acc1, load2(at), column_bias(col, true), out0, out1);
  }
  // Four neighbours (col a multiple of 4, col + 3 inside the matrix): two pairs.
  __device__ __forceinline__ void store4(int64_t z, int64_t row, int64_t col, float4 acc, float4* out) const {
    store2(z, row, col, acc.x, acc.y, &out->x, &out->y);
    store2(z, row, col + 2, acc.z, acc.w, &out->z, &out->w);
  }
};

}  // namespace optimized::kernels
