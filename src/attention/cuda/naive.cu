// Attention rung 1 of the CUDA ladder: naive, the O(N²) baseline. S and P are materialized in
// global memory, one simple kernel per step of the math.
//
//   forward    S = score(Q Kᵀ)            scores_kernel     one thread per (b, h, i, j)
//              P = softmax_rows(S), lse   softmax_kernel    one block per row, P over S in place
//              O = P V                    pv_kernel         one thread per (b, h, i, d)
//   backward   D_i = dout_i . out_i       row_dot_kernel    one warp per row (simt_common.cuh)
//              S again (and d s / d dot   scores_kernel     (the soft-cap's derivative, when on,
//              into the dS matrix)                            waits in the dS matrix)
//              P = exp(S - lse)           probs_kernel      one thread per (b, h, i, j)
//              dS = P (dO Vᵀ - D_i) ds'   ds_kernel         one thread per (b, h, i, j), in place
//              dq = dS K                  dq_kernel         one thread per (b, h, i, d)
//              dk = dSᵀ Q, dv = Pᵀ dO     dkdv_kernel       one thread per (b, kv head, j, d), summing
//                                                           the group's query heads: no atomics
//
// score() is AttentionScore (scale, soft-cap, ALiBi, window / causal range) plus the explicit mask;
// simt_common.cuh's ScoreRule. ds' = d score / d dot = scale (1 - tanh²) with the soft-cap, else
// scale; dS holds it, so dq and dk need no further factor.
//
// Why it is slow, and what flash fixes. Every score makes a round trip through global memory:
// the forward writes S (4 bytes per pair), reads and rewrites it as P, and reads it again for P V;
// the backward does the same with two matrices. At B = 1, H = 16, N = 8192 one matrix is 4 GiB
// (forward) and the backward holds two (8 GiB), so memory, not arithmetic, sets the time and the
// size limit. The dot products read q, k and v straight from global memory (the caches catch some
// reuse), one thread per output, no shared memory. flash keeps S in shared memory, one tile at a
// time, and needs no workspace in the forward.
//
// Workspace (attention_naive_workspace): the forward one fp32 matrix of B * H_q * seqlen_q *
// seqlen_k (varlen: the max lengths, a sequence uses its corner of its (b, h) block); the backward
// two such matrices (P and dS) and B * H_q * seqlen_q fp32 row sums D. When the count passes 2^60
// elements the query reports SIZE_MAX bytes (no allocation can hold it: the API's allocation fails
// with out-of-memory) and the launcher refuses with cudaErrorInvalidValue.
//
// Elements are walked by grid-stride loops over int64 flat indices (no grid limit applies); the
// flat index of the matrices is ((b * H_q + h) * seqlen_q + i) * seqlen_k + j.
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "attention/attention_params.h"
#include "attention/cuda/simt_common.cuh"
#include "attention/launchers.h"
#include "core/workspace.h"
#include "kernels/common.cuh"
#include "kernels/dispatch.cuh"
#include "kernels/dtype.cuh"
#include "kernels/online_softmax.cuh"
#include "kernels/reduce.cuh"

namespace optimized::cuda {
namespace {

using namespace optimized::kernels;
using attention_simt::head_rows;
using attention_simt::head_rows_mut;
using attention_simt::lse_row;
using attention_simt::ScoreRule;

constexpr int kThreads = 256;                       // every kernel's block
constexpr int64_t kMaxBlocks = int64_t{1} << 20;    // grid-stride loops go past this
constexpr int kWarps = kThreads / 32;

// Blocks for n elements (one per thread) or n rows (one per block), at most kMaxBlocks.
unsigned blocks_for(int64_t n, int64_t per_block) {
  const int64_t need = ceil_div(n, per_block);
  return static_cast<unsigned>(need < kMaxBlocks ? need : kMaxBlocks);
}

// A flat index of the matrices, split into (b, h, i, j).
struct PairIndex {
  int64_t b, h, i, j;
};
__device__ __forceinline__ PairIndex split_pair(const AttentionParams& p, int64_t e) {
  const int64_t j = e % p.seqlen_k, r = e / p.seqlen_k;
  const int64_t i = r % p.seqlen_q, bh = r / p.seqlen_q;
  return {bh / p.heads_q, bh % p.heads_q, i, j};
}

#define OPTIMIZED_GRID_STRIDE(e, n)                                                              \
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < (n); \
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)

// ---- S = score(Q Kᵀ) ------------------------------------------------------------------------
// S[e] for every pair of the (b, h) block; -inf where the pair is not visible (outside the window or
// the sequence). grad (backward with a soft-cap): d score / d dot at visible pairs.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    scores_kernel(const __grid_constant__ AttentionParams p, float* S, float* grad) {
  const int64_t n = p.batch * p.heads_q * p.seqlen_q * p.seqlen_k;
  OPTIMIZED_GRID_STRIDE(e, n) {
    const PairIndex x = split_pair(p, e);
    const AttentionSeq seq = attention_seq(p, x.b);
    const ScoreRule rule(p, seq, x.b, x.h);
    if (x.j >= seq.len_k || !rule.visible(x.i, x.j)) {
      S[e] = -INFINITY;
      continue;
    }
    const T* q = head_rows<T>(p.q, p.q_s, x.b, seq.start_q, x.h) + x.i * p.q_s.row;
    const T* k = head_rows<T>(p.k, p.k_s, x.b, seq.start_k, x.h / p.group()) + x.j * p.k_s.row;
    float dot = 0.0f;
    for (int64_t d = 0; d < p.head_dim; ++d) dot = fmaf(to_float(q[d]), to_float(k[d]), dot);
    S[e] = rule.value(dot, x.i, x.j);
    if (grad) grad[e] = rule.dot_grad(dot);
  }
}

// ---- forward: P = softmax(S) by rows, lse ---------------------------------------------------
// One block per row (b, h, i), rows walked by a grid-stride loop: the row's (max, sum) state
// merged over the block (kernels/online_softmax.cuh), then P = exp(S - max) / sum in place and
// lse = max + log(sum). A row with no visible key: P = 0, lse = -inf.
__global__ void __launch_bounds__(kThreads) softmax_kernel(const __grid_constant__ AttentionParams p, float* S) {
  __shared__ float scratch[2 * kWarps];
  const int64_t rows = p.batch * p.heads_q * p.seqlen_q;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t i = r % p.seqlen_q, bh = r / p.seqlen_q, h = bh % p.heads_q, b = bh / p.heads_q;
    const AttentionSeq seq = attention_seq(p, b);
    if (i >= seq.len_q) continue;  // the whole block: r is the block's
    float* row = S + r * p.seqlen_k;
    MaxSum state;
    for (int64_t j = threadIdx.x; j < seq.len_k; j += kThreads) {
      const float s = row[j];
      state = merge(state, MaxSum{s, s == -INFINITY ? 0.0f : 1.0f});  // (-inf, 0): nothing seen
    }
    state = block_merge(state, kThreads, scratch);
    const bool empty = state.m == -INFINITY;
    const float inv_sum = 1.0f / state.s;
    for (int64_t j = threadIdx.x; j < seq.len_k; j += kThreads) row[j] = empty ? 0.0f : expf(row[j] - state.m) * inv_sum;
    if (p.lse && threadIdx.x == 0) lse_row(p, b, h, seq.start_q)[i] = empty ? -INFINITY : state.m + logf(state.s);
  }
}

// ---- forward: O = P V -----------------------------------------------------------------------
// out[b, i, h, d] = sum over the visible keys j of P[i, j] v[j, d]. Lanes take consecutive d:
// v's rows are read coalesced, P[i, j] is one broadcast address per warp.
template <typename T>
__global__ void __launch_bounds__(kThreads) pv_kernel(const __grid_constant__ AttentionParams p, const float* P) {
  const int64_t n = p.batch * p.heads_q * p.seqlen_q * p.head_dim;
  OPTIMIZED_GRID_STRIDE(e, n) {
    const int64_t d = e % p.head_dim, r = e / p.head_dim;
    const int64_t i = r % p.seqlen_q, bh = r / p.seqlen_q, h = bh % p.heads_q, b = bh / p.heads_q;
    const AttentionSeq seq = attention_seq(p, b);
    if (i >= seq.len_q) continue;
    const ScoreRule rule(p, seq, b, h);
    const float* prow = P + r * p.seqlen_k;
    const T* v = head_rows<T>(p.v, p.v_s, b, seq.start_k, h / p.group()) + d;
    float acc = 0.0f;
    for (int64_t j = rule.sc.key_lo(i), hi = rule.sc.key_hi(i); j < hi; ++j)
      acc = fmaf(prow[j], to_float(v[j * p.v_s.row]), acc);
    head_rows_mut<T>(p.out, p.out_s, b, seq.start_q, h)[i * p.out_s.row + d] = from_float<T>(acc);
  }
}

// ---- backward: P = exp(S - lse) ---------------------------------------------------------------
__global__ void __launch_bounds__(kThreads) probs_kernel(const __grid_constant__ AttentionParams p, float* S) {
  const int64_t n = p.batch * p.heads_q * p.seqlen_q * p.seqlen_k;
  OPTIMIZED_GRID_STRIDE(e, n) {
    const PairIndex x = split_pair(p, e);
    const AttentionSeq seq = attention_seq(p, x.b);
    if (x.i >= seq.len_q || x.j >= seq.len_k) continue;  // never read
    S[e] = attention_simt::prob_from_lse(S[e], lse_row(p, x.b, x.h, seq.start_q)[x.i]);
  }
}

// ---- backward: dS = P (dP - D_i) d score / d dot, dP = dout_i . v_j ---------------------------
// In place over dS, which holds d score / d dot when grad_in_ds (soft-cap), else the factor is
// scale. Pairs that are not visible get 0 (a select: a NaN elsewhere in the row does not leak).
template <typename T>
__global__ void __launch_bounds__(kThreads) ds_kernel(const __grid_constant__ AttentionParams p, const float* P,
                                                      float* dS, const float* D, bool grad_in_ds) {
  const int64_t n = p.batch * p.heads_q * p.seqlen_q * p.seqlen_k;
  OPTIMIZED_GRID_STRIDE(e, n) {
    const PairIndex x = split_pair(p, e);
    const AttentionSeq seq = attention_seq(p, x.b);
    if (x.i >= seq.len_q || x.j >= seq.len_k) continue;  // never read
    const ScoreRule rule(p, seq, x.b, x.h);
    if (!rule.visible(x.i, x.j)) {
      dS[e] = 0.0f;
      continue;
    }
    const T* g = head_rows<T>(p.dout, p.dout_s, x.b, seq.start_q, x.h) + x.i * p.dout_s.row;
    const T* v = head_rows<T>(p.v, p.v_s, x.b, seq.start_k, x.h / p.group()) + x.j * p.v_s.row;
    float dp = 0.0f;
    for (int64_t d = 0; d < p.head_dim; ++d) dp = fmaf(to_float(g[d]), to_float(v[d]), dp);
    const float factor = grad_in_ds ? dS[e] : rule.sc.scale;
    dS[e] = P[e] * (dp - D[e / p.seqlen_k]) * factor;
  }
}

// ---- backward: dq = dS K ----------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kThreads) dq_kernel(const __grid_constant__ AttentionParams p, const float* dS) {
  const int64_t n = p.batch * p.heads_q * p.seqlen_q * p.head_dim;
  OPTIMIZED_GRID_STRIDE(e, n) {
    const int64_t d = e % p.head_dim, r = e / p.head_dim;
    const int64_t i = r % p.seqlen_q, bh = r / p.seqlen_q, h = bh % p.heads_q, b = bh / p.heads_q;
    const AttentionSeq seq = attention_seq(p, b);
    if (i >= seq.len_q) continue;
    const ScoreRule rule(p, seq, b, h);
    const float* ds_row = dS + r * p.seqlen_k;
    const T* k = head_rows<T>(p.k, p.k_s, b, seq.start_k, h / p.group()) + d;
    float acc = 0.0f;
    for (int64_t j = rule.sc.key_lo(i), hi = rule.sc.key_hi(i); j < hi; ++j)
      acc = fmaf(ds_row[j], to_float(k[j * p.k_s.row]), acc);
    head_rows_mut<T>(p.dq, p.dq_s, b, seq.start_q, h)[i * p.dq_s.row + d] = from_float<T>(acc);
  }
}

// ---- backward: dk = dSᵀ Q, dv = Pᵀ dO, summed over the group -----------------------------------
// One thread per (b, kv head, key j, d) loops over the group's query heads and every query row that
// sees key j, in a fixed order: deterministic, no atomics. A key no query sees gets 0.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    dkdv_kernel(const __grid_constant__ AttentionParams p, const float* P, const float* dS) {
  const int64_t n = p.batch * p.heads_kv * p.seqlen_k * p.head_dim;
  const int64_t group = p.group();
  OPTIMIZED_GRID_STRIDE(e, n) {
    const int64_t d = e % p.head_dim, r = e / p.head_dim;
    const int64_t j = r % p.seqlen_k, bh = r / p.seqlen_k, hk = bh % p.heads_kv, b = bh / p.heads_kv;
    const AttentionSeq seq = attention_seq(p, b);
    if (j >= seq.len_k) continue;
    float dk = 0.0f, dv = 0.0f;
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      const ScoreRule rule(p, seq, b, h);
      const T* q = head_rows<T>(p.q, p.q_s, b, seq.start_q, h) + d;
      const T* g = head_rows<T>(p.dout, p.dout_s, b, seq.start_q, h) + d;
      const int64_t pair0 = (b * p.heads_q + h) * p.seqlen_q * p.seqlen_k + j;  // (b, h, i = 0, j)
      for (int64_t i = 0; i < seq.len_q; ++i) {
        if (!rule.visible(i, j)) continue;
        const int64_t pair = pair0 + i * p.seqlen_k;
        dk = fmaf(dS[pair], to_float(q[i * p.q_s.row]), dk);
        dv = fmaf(P[pair], to_float(g[i * p.dout_s.row]), dv);
      }
    }
    head_rows_mut<T>(p.dk, p.dk_s, b, seq.start_k, hk)[j * p.dk_s.row + d] = from_float<T>(dk);
    head_rows_mut<T>(p.dv, p.dv_s, b, seq.start_k, hk)[j * p.dv_s.row + d] = from_float<T>(dv);
  }
}

#undef OPTIMIZED_GRID_STRIDE

// ---- the launch ---------------------------------------------------------------------------------
struct NaiveScratch {
  float* s = nullptr;    // S, then P: B * H_q * seqlen_q * seqlen_k
  float* ds = nullptr;   // backward: dS (first d score / d dot with a soft-cap), same size
  float* row_dot = nullptr;  // backward: D, B * H_q * seqlen_q
};

// Takes the scratch of p from the arena; false when the sizes pass 2^60 elements.
bool carve(WorkspaceArena& arena, const AttentionParams& p, NaiveScratch* out) {
  const int64_t pairs = attention_simt::checked_count(p.batch, p.heads_q, p.seqlen_q, p.seqlen_k);
  const int64_t rows = attention_simt::checked_count(p.batch, p.heads_q, p.seqlen_q, 1);
  if (pairs < 0 || rows < 0) return false;
  out->s = arena.take<float>(pairs);
  if (p.backward) {
    out->ds = arena.take<float>(pairs);
    out->row_dot = arena.take<float>(rows);
  }
  return true;
}

template <typename T>
cudaError_t naive_forward(const AttentionParams& p, const NaiveScratch& s, cudaStream_t stream) {
  const int64_t pairs = p.batch * p.heads_q * p.seqlen_q * p.seqlen_k;
  const int64_t rows = p.batch * p.heads_q * p.seqlen_q;
  const int64_t outs = rows * p.head_dim;
  if (pairs > 0) {
    scores_kernel<T><<<blocks_for(pairs, kThreads), kThreads, 0, stream>>>(p, s.s, nullptr);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  if (rows > 0) {  // also with seqlen_k = 0: lse = -inf
    softmax_kernel<<<blocks_for(rows, 1), kThreads, 0, stream>>>(p, s.s);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  if (outs > 0) {  // also with seqlen_k = 0: out = 0
    pv_kernel<T><<<blocks_for(outs, kThreads), kThreads, 0, stream>>>(p, s.s);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

template <typename T>
cudaError_t naive_backward(const AttentionParams& p, const NaiveScratch& s, cudaStream_t stream) {
  const int64_t pairs = p.batch * p.heads_q * p.seqlen_q * p.seqlen_k;
  const int64_t dq_elems = p.batch * p.heads_q * p.seqlen_q * p.head_dim;
  const int64_t dk_elems = p.batch * p.heads_kv * p.seqlen_k * p.head_dim;
  const bool softcap = p.softcap > 0.0;
  if (cudaError_t e = attention_simt::launch_row_dot<T>(p, s.row_dot, stream); e != cudaSuccess) return e;
  if (pairs > 0) {
    scores_kernel<T><<<blocks_for(pairs, kThreads), kThreads, 0, stream>>>(p, s.s, softcap ? s.ds : nullptr);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    probs_kernel<<<blocks_for(pairs, kThreads), kThreads, 0, stream>>>(p, s.s);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    ds_kernel<T><<<blocks_for(pairs, kThreads), kThreads, 0, stream>>>(p, s.s, s.ds, s.row_dot, softcap);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  if (dq_elems > 0) {  // also with seqlen_k = 0: dq = 0
    dq_kernel<T><<<blocks_for(dq_elems, kThreads), kThreads, 0, stream>>>(p, s.ds);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  if (dk_elems > 0) {  // also with seqlen_q = 0: dk = dv = 0
    dkdv_kernel<T><<<blocks_for(dk_elems, kThreads), kThreads, 0, stream>>>(p, s.s, s.ds);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t attention_naive(const AttentionParams& p, const Workspace& workspace, cudaStream_t stream) {
  WorkspaceArena arena(workspace);
  NaiveScratch scratch;
  if (!carve(arena, p, &scratch) || !arena.ok()) return cudaErrorInvalidValue;
  return dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    return p.backward ? naive_backward<T>(p, scratch, stream) : naive_forward<T>(p, scratch, stream);
  });
}

cudaError_t attention_naive_workspace(const AttentionParams& p, size_t* bytes) {
  WorkspaceArena arena;  // counting
  NaiveScratch scratch;
  *bytes = carve(arena, p, &scratch) ? arena.peak() : SIZE_MAX;
  return cudaSuccess;
}

}  // namespace optimized::cuda
