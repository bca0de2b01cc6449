// The GEMM family's backends, one launcher per CUDA rung of the ladder (CUDA builds only), under
// the launcher contract (src/core/cuda_launch.h). wgmma_persistent needs a workspace when it
// splits K (its query says how much); each also reports the kernel it would run
// (KernelResources, for the benchmark).
#pragma once

#include <cuda_runtime.h>

#include "gemm/gemm_params.h"
#include "gemm/scaled_params.h"
#include "optimized/core.h"

namespace optimized::cuda {

// The rungs that fuse epilogues (gemm_variants.h) need a workspace for column sums (their
// queries say how much).
cudaError_t gemm_naive(const GemmParams& p, const Workspace& workspace, cudaStream_t stream);
cudaError_t gemm_naive_workspace(const GemmParams& p, size_t* bytes);
cudaError_t gemm_coalesced(const GemmParams& p, const Workspace& workspace, cudaStream_t stream);
cudaError_t gemm_smem_tiled(const GemmParams& p, const Workspace& workspace, cudaStream_t stream);
cudaError_t gemm_register_tiled(const GemmParams& p, const Workspace& workspace, cudaStream_t stream);
cudaError_t gemm_register_tiled_workspace(const GemmParams& p, size_t* bytes);
cudaError_t gemm_wmma(const GemmParams& p, const Workspace& workspace, cudaStream_t stream);          // fp16/bf16
cudaError_t gemm_mma_pipeline(const GemmParams& p, const Workspace& workspace, cudaStream_t stream);  // fp16/bf16
cudaError_t gemm_mma_pipeline_workspace(const GemmParams& p, size_t* bytes);
cudaError_t gemm_gemv(const GemmParams& p, const Workspace& workspace, cudaStream_t stream);  // fp32/fp16/bf16
// The Hopper rungs (sm_90a builds only: OPTIMIZED_WITH_SM90A); operands TMA can describe
// (gemm_hopper_rejects in gemm.cpp), fp16/bf16.
cudaError_t gemm_wgmma_tma(const GemmParams& p, const Workspace& workspace, cudaStream_t stream);
cudaError_t gemm_wgmma_ws(const GemmParams& p, const Workspace& workspace, cudaStream_t stream);
cudaError_t gemm_wgmma_persistent(const GemmParams& p, const Workspace& workspace, cudaStream_t stream);
cudaError_t gemm_wgmma_persistent_workspace(const GemmParams& p, size_t* bytes);

// The scaled (fp8) GEMM (scaled_variants.h): the naive rung (any layout, any GPU), and the Hopper
// rung (sm_90a builds), which reads A and B K-major through TMA; its workspace holds K-major
// copies of operands in other layouts (made first, on the stream).
cudaError_t scaled_gemm_naive(const ScaledGemmParams& p, const Workspace& workspace, cudaStream_t stream);
cudaError_t scaled_gemm_wgmma_fp8(const ScaledGemmParams& p, const Workspace& workspace, cudaStream_t stream);
cudaError_t scaled_gemm_wgmma_fp8_workspace(const ScaledGemmParams& p, size_t* bytes);

// What the compiler and the occupancy calculator say of the kernel a launcher would run for p.
struct KernelResources {
  const char* kernel_name = "";      // e.g. "gemm_register_tiled<bf16, 128x128x8, 8x8>"
  int registers_per_thread = 0;
  int static_smem_bytes = 0;
  int dynamic_smem_bytes = 0;
  int threads_per_block = 0;
  int blocks_per_sm = 0;             // cudaOccupancyMaxActiveBlocksPerMultiprocessor
  double theoretical_occupancy = 0;  // active warps per SM / max warps per SM
  int local_bytes_per_thread = 0;    // spills show up here
};

cudaError_t gemm_naive_resources(const GemmParams& p, KernelResources* out);
cudaError_t gemm_coalesced_resources(const GemmParams& p, KernelResources* out);
cudaError_t gemm_smem_tiled_resources(const GemmParams& p, KernelResources* out);
cudaError_t gemm_register_tiled_resources(const GemmParams& p, KernelResources* out);
cudaError_t gemm_wmma_resources(const GemmParams& p, KernelResources* out);
cudaError_t gemm_mma_pipeline_resources(const GemmParams& p, KernelResources* out);
cudaError_t gemm_gemv_resources(const GemmParams& p, KernelResources* out);
cudaError_t gemm_wgmma_tma_resources(const GemmParams& p, KernelResources* out);
cudaError_t gemm_wgmma_ws_resources(const GemmParams& p, KernelResources* out);
cudaError_t gemm_wgmma_persistent_resources(const GemmParams& p, KernelResources* out);

cudaError_t scaled_gemm_naive_resources(const ScaledGemmParams& p, KernelResources* out);
cudaError_t scaled_gemm_wgmma_fp8_resources(const ScaledGemmParams& p, KernelResources* out);

// Fills `out` from cudaFuncGetAttributes and the occupancy calculator (shared by the launchers).
cudaError_t describe_kernel(const void* kernel, const char* name, int threads_per_block,
                            int dynamic_smem_bytes, KernelResources* out);

}  // namespace optimized::cuda
