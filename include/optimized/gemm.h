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
void matmul(const TensorView& a, const TensorView& b, const TensorView& c, float alpha = 1.0f,
            float beta = 0.0f, GemmVariant variant = GemmVariant::kAuto,
            const ExecutionContext& ctx = {});

}  // namespace optimized
