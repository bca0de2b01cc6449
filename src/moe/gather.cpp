// Public entry of the gather of token rows into slot order (include/optimized/moe.h: moe_gather): the
// dispatch step of an MoE layer, between moe_permute and the grouped GEMM. Its backward is moe_combine
// with unit weights (each token's rows summed in the pair order, no atomics).
#include <string>

#include "core/arg_checks.h"
#include "moe/cpu/moe_cpu.h"
#include "moe/moe_checks.h"
#include "moe/moe_params.h"
#include "optimized/moe.h"

#if OPTIMIZED_WITH_CUDA
#include <cuda_runtime.h>

#include "core/cuda_device_guard.h"
#include "moe/launchers.h"
#endif

namespace optimized {

void moe_gather(const TensorView& x, const TensorView& sorted_pairs, int64_t top_k, const TensorView& xs,
                const ExecutionContext& ctx) {
  using arg::invalid;
  arg::OperandSet ops;
  if (x.rank != 2) invalid("x: expected rank 2 (tokens T, N); given " + (x.rank ? arg::shape_string(x) : std::string("absent")));
  ops.add(x, "x", false);
  moe_checks::check_float(x, "x");
  if (top_k < 1) invalid("top_k: expected >= 1; given " + std::to_string(top_k));
  ops.add(sorted_pairs, "sorted_pairs", false);
  moe_checks::check_dtype(sorted_pairs, "sorted_pairs", DType::kI32);
  if (sorted_pairs.rank != 1 || !sorted_pairs.is_contiguous())
    invalid("sorted_pairs: expected a contiguous vector (the slots S); given " +
            (sorted_pairs.rank ? sorted_pairs.describe() : std::string("absent")));
  MoeGatherParams p;
  p.dtype = x.dtype;
  p.tokens = x.shape[0], p.k = top_k, p.n = x.shape[1], p.slots = sorted_pairs.shape[0];
  p.x = x.data;
  p.ld_x = moe_checks::row_stride(x, "x", p.tokens, p.n, "(T, N)");
  p.sorted_pairs = static_cast<const int32_t*>(sorted_pairs.data);
  ops.add(xs, "xs", true);
  if (xs.dtype != x.dtype) invalid("xs: expected dtype " + arg::dname(x.dtype) + " (x's); given " + arg::dname(xs.dtype));
  p.xs = xs.data;
  p.ld_xs = moe_checks::row_stride(xs, "xs", p.slots, p.n,
                                   "(S, N) = (" + std::to_string(p.slots) + ", " + std::to_string(p.n) + ")");
  ops.check_overlaps();
  const Device device = ops.device();
  moe_checks::cuda_prelude(device, "x");
  if (!device.is_cuda()) {
    cpu::moe_gather(p, ctx.cpu_threads);
    return;
  }
#if OPTIMIZED_WITH_CUDA
  DeviceGuard guard(device.index);
  check_cuda(cuda::moe_gather(p, {}, static_cast<cudaStream_t>(ctx.cuda_stream)), "moe_gather");
#endif
}

}  // namespace optimized
