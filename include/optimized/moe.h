// Mixture of Experts (the seed's moe_optimized family): routing and its backward, the permutation of the
// (token, expert) pairs by expert, the gather into slot order, the grouped GEMM (cpu, naive, loop, and the
// Hopper wgmma rung; SwiGLU in the up projection's epilogue), the combine, and the layer's forward
// (moe_forward; the C API's optimized_moe). The losses, the metrics and the module live in Python
// (optimized_ops.moe_layer, nn.MoE). Measured: docs/perf-notes/moe.md.
//
// ---- Routing --------------------------------------------------------------------------------------
//
//   logits (T, E)         fp32, fp16 or bf16; rows any stride apart, unit stride along E
//   bias (E)              fp32, contiguous, or absent: added to the scores for the choice only
//                         (DeepSeek-V3's balancing bias); the weights come from the unbiased scores
//   topk_ids (T, k)       int32, contiguous: the chosen experts of each token, best first
//   topk_weights (T, k)   fp32, contiguous: their weights
//   lse (T)               fp32, contiguous, or absent: logsumexp of each token's logits (the router
//                         z-loss is mean(lse^2))
//
// Scores (in fp32): softmax over the E logits (kSoftmax), or sigmoid of each (kSigmoid). With
// topk_softmax (Mixtral's order) the choice is on the logits and the weights are the softmax over
// the k chosen ones. Group-limited routing (n_groups > 1, DeepSeek-V3): the experts form n_groups
// equal groups, each group's score is the sum of its two best choice scores (its best one for
// groups of one expert), only the topk_groups best groups compete. normalize divides the weights
// by their sum over the k; routed_scale then multiplies them.
//
// Ties: the lower expert index wins (groups likewise), so the choice is the same on every backend
// and every run. NaN: a NaN choice score ranks below every number (chosen only when fewer than k
// experts have numbers); a NaN logit makes that token's softmax weights NaN (and its lse), never a
// silently finite answer.
//
// moe_route_backward: the gradient of the weights and of lse to the logits, for the ids the forward
// chose (the choice itself -- the bias, the groups -- has no gradient: the bias gets none, and the
// group options only need to be valid).
//
//   logits (T, E)         as the forward's (the same tensor): read in their dtype, math in fp32
//   topk_ids (T, k)       int32, contiguous: the forward's ids; an id outside [0, E) leaves its pair
//                         out of the list (never read or written out of bounds)
//   grad_weights (T, k)   fp32, contiguous, or absent (zero): the gradient of topk_weights
//   grad_lse (T)          fp32, contiguous, or absent (zero): the gradient of lse
//   grad_logits (T, E)    the logits' dtype or fp32; rows any stride apart, unit stride along E
//
// With g_j = routed_scale grad_weights[t, j], p = softmax(logits[t]) and the pairs' scores s_j:
//   softmax          s_j = p[id_j]:       grad[e] = p[e] (sum over j with id_j = e of g_j - sum_j g_j s_j)
//   softmax with topk_softmax or normalize: the weights are q = the softmax over the chosen logits
//                    (normalize divides p[id_j] by their sum: the same q), so grad[id_j] += q_j (g_j -
//                    sum_i g_i q_i) and the other experts get exact zeros
//   sigmoid          s_j = sigmoid(l[id_j]): grad[id_j] += h_j s_j (1 - s_j), h_j = g_j, or with
//                    normalize (S = sum_i s_i) h_j = (g_j - sum_i g_i s_i / S) / S
//   every mode       grad[e] += grad_lse[t] p[e]
// A zero incoming gradient adds exact zeros: a token whose grad_weights row is all zero (or absent)
// gets no weight term and a zero grad_lse no lse term, so that the zero gradient autograd passes for
// an unused output never makes a NaN logit's row NaN. Otherwise NaN propagates: with softmax scoring a
// NaN logit makes the token's whole gradient row NaN (as it made its weights and lse NaN).
//
// ---- Permutation ----------------------------------------------------------------------------------
//
// The T k pairs p = t k + j (token t's j-th choice, expert topk_ids[t, j]) sorted by expert, stably
// (by p within an expert): a counting sort on the device, deterministic, without atomics deciding
// any order and without a host synchronisation.
//
//   counts (E)          int32: pairs kept per expert (at most capacity)
//   offsets (E + 1)     int32: offsets[e] = sum of counts before e; offsets[E] = pairs kept
//   sorted_pairs (T k)  int32: slot s < offsets[E] holds the pair placed there; the slots past
//                       offsets[E] (dropped pairs) are -1
//   slot_of (T, k)      int32: the slot of each pair, -1 when it was dropped
//   dropped (1)         int32, or absent: pairs dropped
//
// capacity: 0 = dropless; otherwise each expert keeps its first `capacity` pairs (the lowest p,
// i.e. earlier tokens first) and drops the rest (moe_capacity gives ceil(cf T k / E)).
//
// ---- Combine ------------------------------------------------------------------------------------
//
//   y (S, N)            the experts' outputs in slot order (S >= the pairs kept), rows any stride
//                       apart, unit stride along N; fp32, fp16 or bf16
//   slot_of (T, k)      int32 (moe_permute's): the slot of each pair, -1 for a dropped one
//   weights (T, k)      fp32 (moe_route's)
//   out (T, N)          y's dtype: out[t] = sum over j of weights[t, j] y[slot_of[t, j]] (dropped
//                       pairs add nothing), in fp32 in the order j = 0, 1, ...: no atomics, the same
//                       bits every run
//
// moe_combine_backward, from dout (T, N) (out's dtype) and sorted_pairs (S) (moe_permute's; -1 for
// a slot no pair uses): grad_y[s] = weights[p] dout[p / k] for the pair p in slot s (zero rows for
// unused slots), grad_weights[t, j] = <dout[t], y[slot_of[t, j]]> (0 for a dropped pair; an fp32 sum
// in a fixed order). Either gradient may be absent. Slots outside [0, S) and pairs outside [0, T k)
// count as dropped / unused (never read out of bounds).
//
// ---- Grouped GEMM (torch._grouped_mm's 2-D x 3-D case) -----------------------------------------
//
//   x (M, K)      rows any stride apart, unit stride along K; the rows sorted by group
//   w (E, K, N)   any strides (w[g] row- or column-major: w.transpose(-2, -1) of an (E, N, K) tensor)
//   offs (E)      int32, contiguous: cumulative ends; group g owns rows [offs[g-1], offs[g]) (offs[-1] = 0)
//   out (M, N)    out[r] = x[r] @ w[g] for the rows of group g; rows from offs[E-1] on are zeros
//
// One dtype for x, w and out (fp32, fp16, bf16; products accumulate in fp32). offs is read on the
// device only (no host synchronisation); values outside [0, M] are clamped to it and a decreasing
// offset is raised to the one before (so a group is never negative), never read out of bounds.
// grouped_mm_weight_grad: dw[g] (K, N) = x[rows of g]^T @ dout[rows of g] (+ dw[g] with
// accumulate), dw of x's dtype or fp32; an empty group gives zeros. The backward of grouped_mm:
// grad_x = grouped_mm(dout, w viewed (E, N, K)), grad_w = grouped_mm_weight_grad(x, dout).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "optimized/core.h"

namespace optimized {

enum class MoeScoring : uint8_t { kSoftmax, kSigmoid };
std::string_view moe_scoring_name(MoeScoring scoring);  // "softmax", "sigmoid"
MoeScoring parse_moe_scoring(std::string_view name);    // throws Error naming the choices

struct MoeRouteOptions {
  int top_k = 2;                          // 1 <= k <= E
  MoeScoring scoring = MoeScoring::kSoftmax;
  bool topk_softmax = false;              // choose on the logits, softmax over the chosen k (kSoftmax only)
  bool normalize = false;                 // weights / their sum over the k
  int n_groups = 1, topk_groups = 1;      // group-limited routing: E % n_groups == 0, 1 <= topk_groups <= n_groups
  float routed_scale = 1.0f;              // weights * routed_scale (after normalize)
};

// Largest E and k the routing takes (one warp holds a token's scores on CUDA).
constexpr int64_t kMoeMaxExperts = 1024;
constexpr int64_t kMoeMaxTopK = 32;

void moe_route(const TensorView& logits, const TensorView& bias, const TensorView& topk_ids,
               const TensorView& topk_weights, const TensorView& lse, const MoeRouteOptions& options,
               const ExecutionContext& ctx = {});
// The gradient to the logits (above); options as the forward's (top_k: topk_ids' second dimension).
void moe_route_backward(const TensorView& logits, const TensorView& topk_ids, const TensorView& grad_weights,
                        const TensorView& grad_lse, const TensorView& grad_logits, const MoeRouteOptions& options,
                        const ExecutionContext& ctx = {});

// ceil(capacity_factor * T * k / E) (capacity_factor > 0).
int64_t moe_capacity(double capacity_factor, int64_t tokens, int64_t top_k, int64_t experts);

// Workspace bytes moe_permute needs for T k pairs and E experts on `device` (0 on the CPU).
size_t moe_permute_workspace_bytes(int64_t pairs, int64_t experts, Device device);

void moe_permute(const TensorView& topk_ids, int64_t num_experts, int64_t capacity, const TensorView& counts,
                 const TensorView& offsets, const TensorView& sorted_pairs, const TensorView& slot_of,
                 const TensorView& dropped, const ExecutionContext& ctx = {});

// The dispatch of token rows to their slots (moe_permute's order), what the grouped GEMM reads:
// xs[s] = x[sorted_pairs[s] / top_k] for the slots that hold a pair, zeros for the others (slots past
// offsets[E], which dropped pairs leave unused). x (T, N) fp32 / fp16 / bf16 (rows may be strided),
// sorted_pairs (S) int32, xs (S, N) of x's dtype. Its gradient is moe_combine with unit weights.
void moe_gather(const TensorView& x, const TensorView& sorted_pairs, int64_t top_k, const TensorView& xs,
                const ExecutionContext& ctx = {});

void moe_combine(const TensorView& y, const TensorView& slot_of, const TensorView& weights, const TensorView& out,
                 const ExecutionContext& ctx = {});
void moe_combine_backward(const TensorView& dout, const TensorView& y, const TensorView& slot_of,
                          const TensorView& sorted_pairs, const TensorView& weights, const TensorView& grad_y,
                          const TensorView& grad_weights, const ExecutionContext& ctx = {});

enum class GroupedGemmVariant : uint8_t {
  kAuto,       // cpu on the CPU; on CUDA wgmma where it applies (sm_90, fp16 / bf16, operands TMA can
               // describe), else loop, or naive while the stream is being captured (loop synchronises)
  kCpu,        // threads over rows (forward) or groups (weight grad), fp32 accumulation
  kCudaNaive,  // one thread per output, its group found on the device
  kCudaLoop,   // one GEMM per non-empty group (the GEMM family's auto): reads offs to the host, so it
               // synchronises the stream and cannot be captured in a CUDA graph (the torch loop's way)
  kCudaWgmma,  // Hopper (sm_90a): the wgmma mainloop under a persistent scheduler over every group's tiles,
               // one launch, offsets read on the device only; fp16 / bf16
};
std::string_view grouped_gemm_variant_name(GroupedGemmVariant variant);  // "cpu", "naive", "loop", "wgmma"
GroupedGemmVariant parse_grouped_gemm_variant(std::string_view name);   // throws Error naming the choices
std::span<const GroupedGemmVariant> all_grouped_gemm_variants();        // every variant but kAuto
std::string grouped_gemm_variant_rejects_dtype(GroupedGemmVariant variant, DType dtype);  // empty: takes it

void grouped_mm(const TensorView& x, const TensorView& w, const TensorView& offs, const TensorView& out,
                GroupedGemmVariant variant = GroupedGemmVariant::kAuto, const ExecutionContext& ctx = {});
void grouped_mm_weight_grad(const TensorView& x, const TensorView& dout, const TensorView& offs, const TensorView& dw,
                            bool accumulate = false, GroupedGemmVariant variant = GroupedGemmVariant::kAuto,
                            const ExecutionContext& ctx = {});

// The expert MLP's up projection with SwiGLU: w (E, K, 2F) holds [gate | up] of each group, and for the
// rows of group g, out (M, F) = silu(x @ w[g][:, :F]) * (x @ w[g][:, F:]); rows past the last group are
// zeros. pre (M, 2F), optional (rank 0: absent), receives x @ w[g] in x's dtype, what the backward needs.
// wgmma applies the SwiGLU to the fp32 accumulators in its epilogue; the other variants run grouped_mm
// into pre (or scratch) and then the fused family's silu_and_mul, which reads the rounded products. x,
// w, out, pre: one dtype; w row-major per group (unit stride along 2F) for wgmma.
void grouped_mm_swiglu(const TensorView& x, const TensorView& w, const TensorView& offs, const TensorView& out,
                       const TensorView& pre = {}, GroupedGemmVariant variant = GroupedGemmVariant::kAuto,
                       const ExecutionContext& ctx = {});

// ---- The layer's forward (src/moe/moe_layer.cpp) ---------------------------------------------------
//
// A Mixture-of-Experts feed-forward layer with SwiGLU experts, for inference (and the C API's
// optimized_moe): the pieces above composed, with every intermediate in one workspace.
//
//   x (T, d)                 fp32, fp16 or bf16; rows any stride apart, unit stride along d
//   router_weight (E, d)     x's dtype, or fp32 (fp32 with 16-bit x: CPU only for now -- the GEMM takes
//                            one operand dtype and the family has no cast kernel yet: kUnsupported on
//                            CUDA); rows any stride apart, unit stride along d
//   w13 (E, d, 2F)           x's dtype: each expert's [gate | up] (any strides; the wgmma rung wants
//                            unit stride along 2F and F a multiple of 8)
//   w2 (E, F, d)             x's dtype (any strides)
//   out (T, d)               x's dtype; rows any stride apart, unit stride along d
//   tokens_per_expert (E)    int32, contiguous, or absent: the pairs each expert processed (after the
//                            capacity: moe_permute's counts)
//   dropped (1)              int32, or absent: the pairs the capacity dropped (0 when dropless)
//
// The steps, on ctx's stream, with no host synchronisation of their own (the `loop` grouped GEMM,
// which auto picks on CUDA devices without wgmma outside stream capture, reads its offsets back):
//   logits (T, E) fp32  = x @ router_weight^T   (matmul with an fp32 output: fp32 products and sums)
//   ids, weights        = moe_route(logits)     (options below; ties: the lower expert index)
//   permutation         = moe_permute(ids, E, capacity)        S = T k slots (min(T k, E capacity))
//   xs (S, d)           = moe_gather(x)
//   a (S, F)            = grouped_mm_swiglu(xs, w13, offsets[1:])
//   y (S, d)            = grouped_mm(a, w2, offsets[1:])
//   out                 = moe_combine(y, slot_of, weights)     (dropped pairs add nothing)
// xs, a and y are rounded to x's dtype between the steps (as the pieces called one by one round
// them); the combine sums in fp32 in the order j = 0, 1, ...: the same bits every run.
struct MoeLayerOptions {
  int top_k = 2;                               // 1 <= k <= min(E, kMoeMaxTopK)
  MoeScoring scoring = MoeScoring::kSoftmax;
  bool topk_softmax = false;                   // Mixtral's order (kSoftmax only): moe_route's
  bool normalize = false;                      // weights / their sum over the k (Mixtral: true)
  float routed_scale = 1.0f;                   // weights * routed_scale (after normalize)
  double capacity_factor = 0.0;                // <= 0: dropless; else capacity = moe_capacity(cf, T, k, E)
  GroupedGemmVariant variant = GroupedGemmVariant::kAuto;  // of both grouped GEMMs
};

// Workspace bytes moe_forward needs for T tokens on `device` (0 on the CPU): its intermediates
// (logits, routing, permutation, xs, a, y) and moe_permute's scratch, carved in one piece. The inner
// calls get no caller workspace: those that need scratch of their own (the matmul's split-K partials,
// grouped_mm_swiglu's products on the rungs that do not fuse SwiGLU) allocate it on the stream.
size_t moe_forward_workspace_bytes(int64_t tokens, int64_t d_model, int64_t d_ff, int64_t experts, DType dtype,
                                   const MoeLayerOptions& options, Device device);

// Validates every argument first (messages name it: x, router_weight, w13, w2, out, tokens_per_expert,
// dropped, top_k, capacity_factor, variant, ...), then runs the steps above on x's device. T = 0:
// tokens_per_expert and dropped are zeroed, nothing else runs.
void moe_forward(const TensorView& x, const TensorView& router_weight, const TensorView& w13, const TensorView& w2,
                 const MoeLayerOptions& options, const TensorView& out, const TensorView& tokens_per_expert = {},
                 const TensorView& dropped = {}, const ExecutionContext& ctx = {});

// Whether the grouped GEMM's `variant` runs CUDA tensors (false for kCpu and kAuto): its table's
// backend, for callers that check a variant against a device before running (the C API).
bool grouped_gemm_variant_is_cuda(GroupedGemmVariant variant);

}  // namespace optimized
