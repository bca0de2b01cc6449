// GEMM: C = alpha * A @ B + beta * C on row- or column-major matrices with leading dimensions.
//
//   A: (M, K) or (batch, M, K)   B: (K, N) or (batch, K, N)   C: (M, N) or (batch, M, N)
//
// Each operand is row-major (unit stride in the last dimension, rows at least a row apart:
// leading dimension >= width) or column-major (unit stride in the second-to-last dimension,
// columns at least a column apart), the NN/NT/TN/TT cases of BLAS; the layout is read from the
// views' strides (a dimension of extent 1 may have any stride). A column-major C is computed as
// C^T = B^T A^T. A batch dimension may have stride 0 on A or B (broadcast).
// A, B and C share one dtype (fp32, fp16 or bf16; fp64 on the CPU rungs cpu_naive and cpu_blocked);
// products accumulate in fp32 (fp64 for fp64), alpha and beta are fp32. When beta == 0, C is not read (BLAS convention): NaN in the old C does not propagate.
#pragma once

#include <span>
#include <string_view>

#include "optimized/core.h"

namespace optimized {

// The ladder, from naive to best. Each rung is a named, selectable variant.
enum class GemmVariant : uint8_t {
  kAuto,             // best for the device, dtype and shape
  kCpuNaive,         // triple loop, fp32 accumulate (fp64 for fp64)
  kCpuBlocked,       // cache-blocked loops without packing (fp64 too)
  kCpuPacked,        // packed panels + AVX2/AVX-512 microkernel (picked at run time) + threads
  kCudaNaive,        // one thread per C element, threads of a warp walk down a column of C
  kCudaCoalesced,    // one thread per C element, threads of a warp walk along a row of C
  kCudaSmemTiled,    // square tiles of A and B staged through shared memory
  kCudaRegisterTiled,// 2D register tile per thread, 16-byte vector loads
  kCudaWmma,         // tensor cores through WMMA fragments (fp16/bf16 only)
  kCudaMmaPipeline,  // mma.sync + ldmatrix + multi-stage cp.async pipeline (fp16/bf16 only)
  kCudaWgmmaTma,     // Hopper: TMA loads + wgmma, one warpgroup (fp16/bf16, sm_90a)
  kCudaWgmmaWs,      // Hopper: warp-specialized producer / consumers, setmaxnreg (fp16/bf16, sm_90a)
  kCudaWgmmaPersistent,  // Hopper: the warp-specialized kernel on a persistent grid (fp16/bf16, sm_90a)
  kCudaGemv,         // decode shapes (few rows): B streamed through CUDA cores, K split across threads
};

std::string_view gemm_variant_name(GemmVariant variant);  // "cpu_naive", ..., "gemv"
GemmVariant parse_gemm_variant(std::string_view name);    // throws Error naming the choices
std::span<const GemmVariant> all_gemm_variants();          // every variant but kAuto, in order
bool gemm_variant_is_cuda(GemmVariant variant);
// Empty when `variant` can run this dtype; otherwise why not ("wmma supports fp16, bf16; given fp32").
std::string gemm_variant_rejects_dtype(GemmVariant variant, DType dtype);
bool gemm_variant_supports_dtype(GemmVariant variant, DType dtype);
// The CUDA compute capability (major * 10 + minor) a variant needs; 0 for the CPU rungs and kAuto.
int gemm_variant_min_compute_capability(GemmVariant variant);

// The variant kAuto resolves to for these operands.
GemmVariant resolve_gemm_variant(const TensorView& a, const TensorView& b, const TensorView& c);

// Bytes of ExecutionContext::workspace a matmul of (batch, m, k) @ (batch, k, n) needs on `device`
// with contiguous operands in any of the layouts (A and B each row- or column-major; the largest
// need of the four): 0 on the CPU; on CUDA, wgmma_persistent's split-K partials and, for auto, the
// aligned copies of operands whose rows TMA cannot take. Operands with padded rows may need more
// (matmul then says so, naming the workspace). Throws Error for sizes < 1 or a dtype the variant
// refuses.
size_t matmul_workspace_bytes(int64_t m, int64_t n, int64_t k, int64_t batch, DType dtype, Device device,
                              GemmVariant variant = GemmVariant::kAuto);

// C = alpha * A @ B + beta * C. Validates every argument (throws Error with kInvalidArgument or
// kUnsupported), then runs on the device of the operands. CUDA work is enqueued on
// ctx.cuda_stream and is asynchronous; launch errors are reported (kCudaError).
// C's dtype may also be fp32 when A and B are fp16 or bf16 (an fp32 output, e.g. a gradient; on
// the variants that take epilogues, below).
void matmul(const TensorView& a, const TensorView& b, const TensorView& c, float alpha = 1.0f,
            float beta = 0.0f, GemmVariant variant = GemmVariant::kAuto,
            const ExecutionContext& ctx = {});

// ---- Epilogues -------------------------------------------------------------------------------
//
// What a linear layer, its backward and an MLP block do to a GEMM's result, fused into the store of
// the output (a GEMM with an epilogue reads and writes each extra tensor once, in the same kernel):
//
//   pre = alpha * A @ B + beta * C + bias                      (fp32, rounded once at the end)
//   forward:         out = act(pre) + residual                 aux = pre        (when given)
//   activation_grad: out = pre * act'(aux) + residual          (aux read: the forward's pre)
//   C = out;   column_sums[j] = sum_i out[i, j]                (when given)
//
// bias: (N), one per column (bias_along_m: (M), one per row), C's dtype, contiguous; broadcast over
// the batch. aux, residual: C's shape and dtype, row-major with any row stride (and batch stride).
// column_sums: fp32 (N), or (batch, N) for a rank-3 C: the sums over the rows of the fp32 values
// of out before they are rounded to C's dtype, in a fixed order (the same bits every run, no
// atomics) -- the bias gradient of a linear layer. With any of these, C must be row-major; an
// output (C, aux, column_sums) may not overlap another argument. activation_grad needs an
// activation and aux.
enum class Activation : uint8_t {
  kNone,
  kRelu,      // max(x, 0)
  kGeluErf,   // x * Phi(x)                                  (torch's gelu, approximate='none')
  kGeluTanh,  // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))  (approximate='tanh')
  kSilu,      // x * sigmoid(x)
};
std::string_view activation_name(Activation activation);  // "none", "relu", "gelu", "gelu_tanh", "silu"
Activation parse_activation(std::string_view name);        // throws Error naming the choices

struct GemmEpilogue {
  const TensorView* bias = nullptr;
  bool bias_along_m = false;
  Activation activation = Activation::kNone;
  bool activation_grad = false;
  const TensorView* aux = nullptr;
  const TensorView* residual = nullptr;
  const TensorView* column_sums = nullptr;

  // Whether anything beyond alpha / beta is asked for.
  bool any() const {
    return bias || activation != Activation::kNone || activation_grad || aux || residual || column_sums;
  }
};

// Whether `variant` fuses epilogues (and writes an fp32 C from fp16/bf16 operands): the CPU rungs,
// naive, register_tiled, mma_pipeline and wgmma_persistent; auto picks among them (and true for
// auto). Others refuse with the list.
bool gemm_variant_supports_epilogue(GemmVariant variant);

// matmul with an epilogue (validated like matmul, each tensor named in errors).
void matmul(const TensorView& a, const TensorView& b, const TensorView& c, const GemmEpilogue& epilogue,
            float alpha = 1.0f, float beta = 0.0f, GemmVariant variant = GemmVariant::kAuto,
            const ExecutionContext& ctx = {});

// Exactly the workspace matmul with these arguments needs (column sums keep fp32 partial sums per
// block of rows there; split-K and staged copies as for the plain matmul), on the operands' device.
size_t matmul_workspace_bytes(const TensorView& a, const TensorView& b, const TensorView& c,
                              const GemmEpilogue& epilogue, float beta = 0.0f,
                              GemmVariant variant = GemmVariant::kAuto);
// The variant kAuto resolves to for these arguments.
GemmVariant resolve_gemm_variant(const TensorView& a, const TensorView& b, const TensorView& c,
                                 const GemmEpilogue& epilogue);

// ---- Scaled (fp8) GEMM -------------------------------------------------------------------------
//
//   C = (scale_a . A) @ (scale_b . B) + bias        A (M, K), B (K, N) fp8; C (M, N) fp32/bf16/fp16
//
// A and B are fp8 (fp8_e4m3, fp8_e5m2; not both e5m2), any strides the plain GEMM takes (row- or
// column-major); the Hopper rung reads both K-major (A row-major, B column-major, as
// torch._scaled_mm takes them: mat2 = w.t()) and auto copies other layouts into that one first.
// Products accumulate in fp32. The scales are fp32, each one of the layouts below, with the
// shapes given (a scale tensor may be of any rank whose dimensions multiply out to that count,
// contiguous):
//   kTensor        one scale for the operand                  (1)
//   kRowwise       A: one per row; B: one per column          A (M), B (N)
//   kBlock1x128    one per row of A / column of B per 128 K   A (M, ceil(K/128)), B (N, ceil(K/128))
//   kBlock128x128  one per 128 x 128 block                    A (ceil(M/128), ceil(K/128)),
//                                                             B (ceil(K/128), ceil(N/128))
// (the last two are DeepSeek-V3's layouts: activations 1x128, weights 128x128). bias: optional,
// (N) of C's dtype, added after the scales. C may not overlap the inputs.
enum class ScaleLayout : uint8_t { kTensor, kRowwise, kBlock1x128, kBlock128x128 };
std::string_view scale_layout_name(ScaleLayout layout);  // "tensor", "rowwise", "block_1x128", "block_128x128"
ScaleLayout parse_scale_layout(std::string_view name);    // throws Error naming the choices
// The number of scales an operand needs: a is the A operand (M x K), else B (K x N).
int64_t scale_count(ScaleLayout layout, int64_t rows, int64_t cols, bool a);

enum class ScaledGemmVariant : uint8_t {
  kAuto,           // wgmma_fp8 on an H100 (layouts copied K-major when needed), else naive / cpu
  kCpu,            // dequantize-on-load loops with fp32 accumulation, threads
  kCudaNaive,      // one thread per output, fp32 accumulation (any GPU, any layout)
  kCudaWgmmaFp8,   // Hopper: TMA + fp8 wgmma (QGMMA), persistent, promotion to fp32 every 128 K
};
std::string_view scaled_gemm_variant_name(ScaledGemmVariant variant);
ScaledGemmVariant parse_scaled_gemm_variant(std::string_view name);
std::span<const ScaledGemmVariant> all_scaled_gemm_variants();  // every variant but kAuto
bool scaled_gemm_variant_is_cuda(ScaledGemmVariant variant);
// Empty when `variant` takes inputs (a and b) of this dtype; otherwise why not.
std::string scaled_gemm_variant_rejects_dtype(ScaledGemmVariant variant, DType dtype);

// Bytes of ExecutionContext::workspace a scaled matmul of (m, k) @ (k, n) with contiguous operands
// needs on `device`: wgmma_fp8's K-major copies of A when it is not row-major and of B when it is
// not column-major, or when K is not a multiple of 16 (rows TMA cannot take); 0 on the CPU and
// for the naive rung. Operands with padded or misaligned rows may need more (scaled_matmul then
// says so, naming the workspace).
size_t scaled_matmul_workspace_bytes(int64_t m, int64_t n, int64_t k, Device device, bool a_k_major = true,
                                     bool b_k_major = true, ScaledGemmVariant variant = ScaledGemmVariant::kAuto);
// Exactly what scaled_matmul with these arguments needs (its strides, alignment and scale layouts
// included), on the operands' device; validates them as scaled_matmul does.
size_t scaled_matmul_workspace_bytes(const TensorView& a, const TensorView& b, const TensorView& c,
                                     const TensorView& scale_a, ScaleLayout scale_a_layout, const TensorView& scale_b,
                                     ScaleLayout scale_b_layout, const TensorView* bias, ScaledGemmVariant variant);

// The variant kAuto resolves to for these operands with scales wgmma_fp8 takes (scaled_matmul
// itself runs the naive rung on an H100 when B's scales are block_1x128).
ScaledGemmVariant resolve_scaled_gemm_variant(const TensorView& a, const TensorView& b, const TensorView& c);

// Validates every argument (Error with kInvalidArgument or kUnsupported, naming it), then runs on
// the operands' device, asynchronously on ctx.cuda_stream.
void scaled_matmul(const TensorView& a, const TensorView& b, const TensorView& c, const TensorView& scale_a,
                   ScaleLayout scale_a_layout, const TensorView& scale_b, ScaleLayout scale_b_layout,
                   const TensorView* bias = nullptr, ScaledGemmVariant variant = ScaledGemmVariant::kAuto,
                   const ExecutionContext& ctx = {});

// scaled_matmul with an epilogue (what an fp8 linear layer asks): of GemmEpilogue, the bias along
// N, the activation and aux (kUnsupported for the rest), and beta (C read; 0: not read):
//   pre = (scale_a . A) @ (scale_b . B) + bias + beta * C;  aux = pre (when given);  C = act(pre)
// aux: C's shape and dtype, row-major with any row stride, overlapping no other argument.
void scaled_matmul(const TensorView& a, const TensorView& b, const TensorView& c, const TensorView& scale_a,
                   ScaleLayout scale_a_layout, const TensorView& scale_b, ScaleLayout scale_b_layout,
                   const GemmEpilogue& epilogue, float beta = 0.0f,
                   ScaledGemmVariant variant = ScaledGemmVariant::kAuto, const ExecutionContext& ctx = {});

}  // namespace optimized
