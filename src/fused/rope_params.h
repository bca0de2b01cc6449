// RoPE in the fused family (rope_forward / rope_backward, include/optimized/fused.h): the params
// struct every backend receives once src/fused/rope.cpp has validated the operands, the CPU backend
// and the CUDA launcher (under the launcher contract, src/core/cuda_launch.h), and the variant
// table they are dispatched through. Raw pointers, sizes and strides in elements; no tensor view.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "core/host_device.h"
#include "core/variant_table.h"
#include "optimized/core.h"
#include "optimized/fused.h"

#if OPTIMIZED_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace optimized {

// One rotated tensor (q or k) and its output: (B, S, heads, D), unit stride along D.
struct RopeTensor {
  const void* x = nullptr;  // null: absent (k); then heads = 0
  void* out = nullptr;      // == x: in place
  int64_t heads = 0;
  int64_t x_b = 0, x_s = 0, x_h = 0;        // strides of x, elements (>= 0)
  int64_t out_b = 0, out_s = 0, out_h = 0;  // strides of out
};

struct RopeParams {
  DType dtype = DType::kF32;  // of q, k and the outputs (kF64 on the CPU only)
  bool neox = true;           // else interleaved
  bool inverse = false;       // rotate by -angle (backward)
  int64_t batch = 0, seq = 0;  // tokens = batch * seq >= 1 (the API returns early on none)
  int64_t head_dim = 0;        // D >= rotary_dim
  int64_t rotary_dim = 0;      // even, 2..D
  RopeTensor q, k;
  // Positions (B, S) (pos_b = 0: (S), shared by the sequences), int32 or int64.
  const void* positions = nullptr;
  bool positions_i64 = false;
  int64_t pos_b = 0, pos_s = 0;
  // Optional cos / sin cache (max_pos, rotary_dim) = [cos | sin]: fp32 (fp64 with fp64 operands).
  const void* cos_sin = nullptr;
  int64_t cos_sin_rows = 0, ld_cos_sin = 0;
  double theta = 10000.0;

  OPTIMIZED_HOST_DEVICE int64_t tokens() const { return batch * seq; }
  OPTIMIZED_HOST_DEVICE int64_t half() const { return rotary_dim / 2; }
};

void cpu_rope(const RopeParams& p, int cpu_threads);

// The longest rotary_dim the CUDA kernel's shared-memory table (fp32 cos and sin) holds: 32 KiB.
inline constexpr int64_t kRopeCudaMaxRotaryDim = 8192;

#if OPTIMIZED_WITH_CUDA
namespace cuda {
// Launches the one RoPE kernel (src/fused/cuda/rope.cu); needs no workspace.
cudaError_t rope_cuda(const RopeParams& p, const Workspace& workspace, cudaStream_t stream);
}  // namespace cuda
#endif

using RopeVariantInfo =
    VariantInfo<RopeVariant, CpuBackendFn<RopeParams>, LauncherFn<RopeParams>, WorkspaceQueryFn<RopeParams>, std::nullptr_t>;

inline constexpr std::array<RopeVariantInfo, 2> kRopeVariants = {{
    {RopeVariant::kCpu, "cpu", Backend::kCpu, {DType::kF32, DType::kF16, DType::kBF16, DType::kF64}, 0, "", &cpu_rope,
     nullptr, nullptr, nullptr},
    {RopeVariant::kCuda, "cuda", Backend::kCuda, {DType::kF32, DType::kF16, DType::kBF16}, 50, "fp64 runs on cpu",
     nullptr, OPTIMIZED_CUDA_FN(cuda::rope_cuda), nullptr, nullptr},
}};

}  // namespace optimized
