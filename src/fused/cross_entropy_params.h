// Cross-entropy of the fused family (include/optimized/fused.h, "cross-entropy"): the params struct
// every backend receives once the public API (src/fused/cross_entropy.cpp) has validated the
// operands, its variant table (cpu, fused_streaming) and the backends' entry points. Raw pointers,
// sizes and strides (in elements); no tensor view, no torch.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "core/variant_table.h"
#include "optimized/core.h"
#include "optimized/fused.h"

#if OPTIMIZED_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace optimized {

struct CrossEntropyParams {
  DType dtype = DType::kF32;         // of logits and grad (kF32, kF16, kBF16; kF64 on the CPU only)
  DType target_dtype = DType::kI64;  // kI64 or kI32
  int64_t rows = 0;                  // >= 1 (the API returns early on 0 rows)
  int64_t vocab = 0;                 // >= 1

  const void* logits = nullptr;  // (rows, vocab), unit stride along the vocabulary
  int64_t ld_logits = 0;
  const void* target = nullptr;  // (rows), target_stride apart
  int64_t target_stride = 1;

  // Outputs. loss, lse: (rows), contiguous, fp32 (fp64 for fp64 logits). grad: (rows, vocab) of the
  // logits' dtype, or null; it may be the logits' own memory (in place: grad == logits and
  // ld_grad == ld_logits; any other overlap is refused by the API).
  void* loss = nullptr;
  void* lse = nullptr;
  void* grad = nullptr;
  int64_t ld_grad = 0;

  // The gradient's factor (fp32; fp64 for fp64 logits), in the logits' memory: grad_scale[row *
  // grad_scale_stride] multiplies row's gradient (stride 0: one factor for every row), or null (1).
  // The forward folds it into the gradient it writes (a mean's 1 / count, counted on the device);
  // the backward (cross_entropy_backward) scales a stored gradient in place by it.
  const void* grad_scale = nullptr;
  int64_t grad_scale_stride = 0;

  int64_t ignore_index = -100;
  // As the caller gave them: the fp64 CPU path computes with these doubles; fp32 math rounds them
  // to fp32 once (CUDA: at the launch).
  double label_smoothing = 0.0;
  double z_loss = 0.0;
};

// The CPU backend (cpu/cross_entropy_cpu.cpp): fp32 math for fp32 / fp16 / bf16, fp64 for fp64.
// Targets are in range or ignore_index (the API checks them first on the CPU).
void cpu_cross_entropy(const CrossEntropyParams& params, int threads);
// The backward on the host: grad (rows, vocab) *= grad_scale per row, rows whose factor is 1 untouched.
void cpu_cross_entropy_scale_grad(const CrossEntropyParams& params, int threads);

#if OPTIMIZED_WITH_CUDA
namespace cuda {
// The CUDA launcher (cuda/cross_entropy.cu), under the launcher contract (core/cuda_launch.h): a
// block per row, or for long rows and few of them several blocks per row whose (max, sum) partials
// meet in the workspace (cross_entropy_fused_workspace says how many bytes; a smaller one is refused
// with cudaErrorInvalidValue). Targets outside [0, vocab) other than ignore_index: NaN loss, lse and
// gradient row, no access out of bounds.
cudaError_t cross_entropy_fused(const CrossEntropyParams& p, const Workspace& workspace, cudaStream_t stream);
cudaError_t cross_entropy_fused_workspace(const CrossEntropyParams& p, size_t* bytes);
// fused_registers: the row read once into the registers of a cluster of blocks (up to 512 KB rows), the
// gradient written from them (one DRAM read, yet slower than fused_streaming on the H100: too few rows in
// flight, docs/perf-notes/fused.md); calls it cannot hold (vocab not a multiple of 16 bytes, unaligned rows,
// longer rows, too few rows to fill the GPU, no clusters before sm_90) run cross_entropy_fused's kernels.
cudaError_t cross_entropy_registers(const CrossEntropyParams& p, const Workspace& workspace, cudaStream_t stream);
cudaError_t cross_entropy_registers_workspace(const CrossEntropyParams& p, size_t* bytes);
// The backward on CUDA: grad *= grad_scale per row in place; a row whose factor is exactly 1 is not
// read or written (the factor is read on the device: no sync).
cudaError_t cross_entropy_scale_grad(const CrossEntropyParams& p, cudaStream_t stream);
}  // namespace cuda
#endif

using CrossEntropyVariantInfo =
    VariantInfo<FusedVariant, CpuBackendFn<CrossEntropyParams>, LauncherFn<CrossEntropyParams>,
                WorkspaceQueryFn<CrossEntropyParams>, std::nullptr_t>;

// Cross-entropy's rows of the fused ladder: the CPU loops and two CUDA designs, the streaming one (a
// block streams its row twice: online softmax, then the gradient, re-read) and the registers one (the
// row held in a cluster's registers: read once). The family's unfused rung has no cross-entropy kernel
// and is refused by name.
inline constexpr std::array<CrossEntropyVariantInfo, 3> kCrossEntropyVariants = {{
    {FusedVariant::kCpu, "cpu", Backend::kCpu, {DType::kF32, DType::kF16, DType::kBF16, DType::kF64}, 0, "",
     &cpu_cross_entropy, nullptr, nullptr, nullptr},
    {FusedVariant::kCudaFusedStreaming, "fused_streaming", Backend::kCuda, {DType::kF32, DType::kF16, DType::kBF16},
     50, "", nullptr, OPTIMIZED_CUDA_FN(cuda::cross_entropy_fused),
     OPTIMIZED_CUDA_FN(cuda::cross_entropy_fused_workspace), nullptr},
    {FusedVariant::kCudaFusedRegisters, "fused_registers", Backend::kCuda, {DType::kF32, DType::kF16, DType::kBF16},
     50, "", nullptr, OPTIMIZED_CUDA_FN(cuda::cross_entropy_registers),
     OPTIMIZED_CUDA_FN(cuda::cross_entropy_registers_workspace), nullptr},
}};

}  // namespace optimized
