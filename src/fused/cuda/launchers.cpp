// The fused family's launchers (launchers.h): each routes to its design's per-dtype body
// (dtype_entries.h) for the dtypes this build has (OPTIMIZED_DTYPES). The element-wise ops run the
// one element-wise kernel under both fused variants. Host code: no kernel is compiled here.
#include "fused/launchers.h"

#include "core/dtypes_built.h"
#include "fused/cuda/dtype_entries.h"

namespace optimized::cuda {

namespace {

enum class Design { kUnfused, kStreaming, kRegisters, kElementwise };

// The body of `design` for p's dtype: launching (measure null) or measuring. A dtype this build
// lacks gives cudaErrorInvalidValue (the C++ API refuses it first, naming OPTIMIZED_DTYPES).
cudaError_t route(Design design, const FusedParams& p, const Workspace& workspace, cudaStream_t stream,
                  size_t* measure) {
  if ((design == Design::kStreaming || design == Design::kRegisters) && !p.has_row_reduction())
    design = Design::kElementwise;
  return dispatch_built_dtype(p.dtype, cudaErrorInvalidValue, [&]<DType kD>() {
    switch (design) {
      case Design::kUnfused: return fused_unfused_dtype<kD>(p, workspace, stream, measure);
      case Design::kStreaming: return fused_streaming_dtype<kD>(p, workspace, stream, measure);
      case Design::kRegisters: return fused_registers_dtype<kD>(p, workspace, stream, measure);
      case Design::kElementwise: return fused_elementwise_dtype<kD>(p, workspace, stream, measure);
    }
    return cudaErrorInvalidValue;
  });
}

}  // namespace

cudaError_t fused_unfused(const FusedParams& p, const Workspace& ws, cudaStream_t s) {
  return route(Design::kUnfused, p, ws, s, nullptr);
}
cudaError_t fused_streaming(const FusedParams& p, const Workspace& ws, cudaStream_t s) {
  return route(Design::kStreaming, p, ws, s, nullptr);
}
cudaError_t fused_registers(const FusedParams& p, const Workspace& ws, cudaStream_t s) {
  return route(Design::kRegisters, p, ws, s, nullptr);
}
cudaError_t fused_elementwise(const FusedParams& p, const Workspace& ws, cudaStream_t s) {
  return route(Design::kElementwise, p, ws, s, nullptr);
}

cudaError_t fused_unfused_workspace(const FusedParams& p, size_t* bytes) {
  return route(Design::kUnfused, p, {}, nullptr, bytes);
}
cudaError_t fused_streaming_workspace(const FusedParams& p, size_t* bytes) {
  return route(Design::kStreaming, p, {}, nullptr, bytes);
}
cudaError_t fused_registers_workspace(const FusedParams& p, size_t* bytes) {
  return route(Design::kRegisters, p, {}, nullptr, bytes);
}
cudaError_t fused_elementwise_workspace(const FusedParams& p, size_t* bytes) {
  return route(Design::kElementwise, p, {}, nullptr, bytes);
}

}  // namespace optimized::cuda
