// Attention: out = softmax(S) V with S = score(Q Kᵀ), forward and backward, and its ladder from a
// materialized O(N²) baseline to an mma.sync FlashAttention-2 kernel.
//
// Layouts. The fixed-length ops take q (B, S_q, H_q, D) and k, v (B, S_k, H_kv, D): 4-D views whose
// last dimension has unit stride and whose other strides are free, so (B, S, H, D) tensors and
// (B, H, S, D) tensors (as a permuted view) both run without a copy. The varlen ops take packed
// q (total_q, H_q, D), k, v (total_k, H_kv, D) and cu_seqlens_q / cu_seqlens_k (B + 1) int32 offsets
// (cu[0] = 0, non-decreasing, cu[B] = total): sequence b is rows cu[b] .. cu[b+1] - 1. Sequences
// may be empty or of length 1. out has q's shape; dq, dk, dv have q's, k's, v's shapes.
//
// Dtypes: fp16 and bf16 on every rung; fp32 on cpu, naive and flash; fp64 on cpu (so that
// gradients can be checked in float64 on the library's own code). Every rung computes in fp32
// (fp64 for fp64) with the same dtype for q, k, v, out and the gradients. lse is fp32 (fp64 on
// fp64 inputs).
//
// Head dims: the CUDA rungs are instantiated for D in {64, 96, 128, 256}; any multiple of 8 up to
// 256 runs on the next instantiated size (the extra columns read as zeros). The CPU rung takes any
// D >= 1. Anything else is an Error naming head_dim and the supported sizes.
//
// The score of query i and key j of one sequence (S_q queries, S_k keys, batch b, head h):
//   s = scale * q_i . k_j                         (scale: softmax_scale, default 1/sqrt(D))
//   s = softcap * tanh(s / softcap)               (softcap > 0)
//   s = s - slope[b][h] * |i + offset - j|        (ALiBi slopes)
//   s = s + mask[b, h, i, j]  or  -inf where a bool mask is false           (explicit mask)
//   s = -inf where j is outside [i + offset - window_left, i + offset + window_right]
//     (a side of -1, or wider than 2^40, is unbounded; causal sets window_right = 0)
// offset = S_k - S_q (bottom-right alignment, the flash-attn convention) or 0 (top-left, the
// torch.nn.functional.scaled_dot_product_attention convention).
// out_i = sum_j softmax_j(s) v_j; lse_i = log(sum_j exp(s_ij)) (natural log).
// A row with no visible key (every score -inf) gives out 0 and lse -inf; its gradients are 0.
// NaN in q, k or v propagates to the rows it reaches; an infinite input gives NaN, as in torch.
// flash2 and hopper multiply whole tiles, so a NaN or Inf of q, k or v also reaches the rows (forward, dq)
// and keys (dk, dv) of its tile that do not see it (0 * NaN, as torch's math path and
// FlashAttention give); the other rungs touch only the pairs a row sees.
//
// GQA / MQA: H_q is a multiple of H_kv; query head h reads key/value head h / (H_q / H_kv). The
// backward sums dk, dv over the group.
//
// Backward: dq, dk, dv from dout, q, k, v, out and the forward's lse. `deterministic` gives the
// same bits on every run (no floating-point atomics); otherwise flash2 accumulates dq with atomics.
#pragma once

#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>

#include "optimized/core.h"

namespace optimized {

// The ladder.
enum class AttentionVariant : uint8_t {
  kAuto,    // CPU: kCpu; CUDA: kFlash2 where it runs the call (fp16/bf16), else kFlash
  kCpu,     // threads over (batch, head, query rows); fp32 / fp64 math; any head dim
  kNaive,   // CUDA: S = scale Q Kᵀ and P = softmax(S) materialized in global memory (workspace
            // of B * H_q * S_q * S_k floats): the O(N²) baseline
  kFlash,   // CUDA: tiled, online softmax, S never leaves the chip (FlashAttention-1 structure,
            // SIMT fp32 math)
  kFlash2,  // CUDA: mma.sync tensor cores, ldmatrix, cp.async double-buffered K/V tiles, warps
            // split query rows (FlashAttention-2), fp16 / bf16
  kHopper,  // CUDA sm_90a (compute capability 9.0 only; builds with the sm_90a sources): wgmma and
            // TMA, a producer warp and two consumer warpgroups (setmaxnreg), fp16 / bf16. Forward
            // only (the backward runs on flash2, from the lse this forward writes); fixed length,
            // head dim 64 or 128, causal or no mask, GQA; no window, softcap, ALiBi, mask or
            // varlen yet (each refused with a message). Not picked by auto until measured.
};

std::string_view attention_variant_name(AttentionVariant variant);  // "cpu", "naive", "flash", "flash2", "hopper"
AttentionVariant parse_attention_variant(std::string_view name);     // throws Error naming the choices
std::span<const AttentionVariant> all_attention_variants();           // every variant but kAuto, in order
bool attention_variant_is_cuda(AttentionVariant variant);
// Empty when `variant` runs `dtype`; otherwise why not. kAuto: whatever some variant runs.
std::string attention_variant_rejects_dtype(AttentionVariant variant, DType dtype);
bool attention_variant_supports_dtype(AttentionVariant variant, DType dtype);
int attention_variant_min_compute_capability(AttentionVariant variant);

// The head dims the CUDA rungs are compiled for, ascending: {64, 96, 128, 256}.
std::span<const int> attention_head_dims();

// How causal and window masks line up when S_q != S_k.
enum class CausalAlignment : uint8_t {
  kBottomRight,  // query i sees key j <= i + S_k - S_q (flash-attn; the last query sees every key)
  kTopLeft,      // query i sees key j <= i (torch's scaled_dot_product_attention is_causal)
};

struct AttentionOptions {
  // NaN: 1 / sqrt(D). Any finite value is used as given.
  double softmax_scale = std::numeric_limits<double>::quiet_NaN();
  bool causal = false;
  CausalAlignment alignment = CausalAlignment::kBottomRight;
  // Sliding window (left, right) in keys around the aligned diagonal; -1 (or more than 2^40): unbounded.
  int64_t window_left = -1;
  int64_t window_right = -1;
  double softcap = 0.0;  // > 0: s = softcap * tanh(s / softcap); 0: off
  // ALiBi slopes, fp32: (H_q) or (B, H_q), unit stride along H_q; absent (rank 0): off.
  TensorView alibi_slopes;
  // Explicit mask (torch's attn_mask): a 4-D view broadcastable to (B, H_q, S_q, S_k) (size-1 or
  // stride-0 dimensions broadcast), bool (true: attend) or additive (q's dtype or fp32). Read tile
  // by tile where it lies; never copied. Fixed-length ops only. Absent (rank 0): none.
  TensorView mask;
  // Backward: the same bits on every run (no atomics in dq).
  bool deterministic = false;
  // Varlen on CUDA: read cu_seqlens back to the host (a synchronization) and check them; skipped
  // while the stream is being captured into a CUDA graph. The CPU always checks.
  bool check_cu_seqlens = true;
};

// ---- fixed length ---------------------------------------------------------------------------
// q (B, S_q, H_q, D); k, v (B, S_k, H_kv, D); out (B, S_q, H_q, D); lse fp32 (B, H_q, S_q) with
// unit stride along S_q, or absent (rank 0: not written).
void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                       const TensorView& lse, const AttentionOptions& options = {},
                       AttentionVariant variant = AttentionVariant::kAuto, const ExecutionContext& ctx = {});

// dout, out, dq: q's shape; dk, dv: k's shape; lse as the forward wrote it (required).
void attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& out, const TensorView& lse, const TensorView& dq, const TensorView& dk,
                        const TensorView& dv, const AttentionOptions& options = {},
                        AttentionVariant variant = AttentionVariant::kAuto, const ExecutionContext& ctx = {});

// ---- variable length (packed) ---------------------------------------------------------------
// q (total_q, H_q, D); k, v (total_k, H_kv, D); cu_seqlens_q, cu_seqlens_k int32 (B + 1),
// contiguous, on the tensors' device; max_seqlen_q / _k: at least the longest sequence (the
// grids are sized by them). lse fp32 (H_q, total_q) with unit stride along total_q, or absent.
void attention_varlen_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                              const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k, int64_t max_seqlen_q,
                              int64_t max_seqlen_k, const TensorView& out, const TensorView& lse,
                              const AttentionOptions& options = {},
                              AttentionVariant variant = AttentionVariant::kAuto, const ExecutionContext& ctx = {});
void attention_varlen_backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                               const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k, int64_t max_seqlen_q,
                               int64_t max_seqlen_k, const TensorView& out, const TensorView& lse,
                               const TensorView& dq, const TensorView& dk, const TensorView& dv,
                               const AttentionOptions& options = {},
                               AttentionVariant variant = AttentionVariant::kAuto, const ExecutionContext& ctx = {});

// ---- queries ----------------------------------------------------------------------------------
// The variant kAuto resolves to for this dtype, head dim and device.
AttentionVariant resolve_attention_variant(DType dtype, int64_t head_dim, Device device);

// Bytes of ExecutionContext::workspace a call needs (forward or backward), for calls of these sizes
// on `device` (varlen: batch = number of sequences, seqlen_* = the max_seqlen_* given, total_q the
// packed rows). naive needs B * H_q * S_q * S_k floats (x2 backward); the flash backward a row-sum
// vector (B * H_q * S_q floats), flash2's that and an fp32 dq accumulator. Throws Error as the ops do for a bad variant, dtype or device.
struct AttentionShape {
  int64_t batch = 1, seqlen_q = 0, seqlen_k = 0, heads_q = 1, heads_kv = 1, head_dim = 0;
  int64_t total_q = -1;  // varlen: packed query rows; -1: fixed length (batch * seqlen_q)
};
size_t attention_workspace_bytes(const AttentionShape& shape, DType dtype, Device device, bool backward,
                                 const AttentionOptions& options = {},
                                 AttentionVariant variant = AttentionVariant::kAuto);

}  // namespace optimized
