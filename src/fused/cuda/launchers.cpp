// The fused family's launchers (launchers.h): each routes to its design's per-dtype body
// (dtype_entries.h) for the dtypes this build has (OPTIMIZED_DTYPES). The element-wise ops run the
// one element-wise kernel under both fused variants. Host code: no kernel is compiled here.
#include "fused/launchers.h"

#include "core/dtypes_built.h"
#include "fused/cuda/dtype_entries.h"

namespace optimized::cuda {

namespace {
// body<kDType>() for the dtypes this build has; cudaErrorInvalidValue for the others (the C++ API
// refuses them first, naming OPTIMIZED_DTYPES).
template <typename Body>
cudaError_t per_dtype(const FusedParams& p, Body&& body) {
  return dispatch_built_dtype(p.dtype, cudaErrorInvalidValue, body);
}
}  // namespace

cudaError_t fused_unfused(const FusedParams& p, const Workspace& workspace, cudaStream_t stream) {
  return per_dtype(p, [&]<DType kD>() { return fused_unfused_dtype<kD>(p, workspace, stream, nullptr); });
}
cudaError_t fused_unfused_workspace(const FusedParams& p, size_t* bytes) {
  return per_dtype(p, [&]<DType kD>() { return fused_unfused_dtype<kD>(p, Workspace{}, nullptr, bytes); });
}

cudaError_t fused_elementwise(const FusedParams& p, const Workspace& workspace, cudaStream_t stream) {
  return per_dtype(p, [&]<DType kD>() { return fused_elementwise_dtype<kD>(p, workspace, stream, nullptr); });
}
cudaError_t fused_elementwise_workspace(const FusedParams& p, size_t* bytes) {
  return per_dtype(p, [&]<DType kD>() { return fused_elementwise_dtype<kD>(p, Workspace{}, nullptr, bytes); });
}

cudaError_t fused_streaming(const FusedParams& p, const Workspace& workspace, cudaStream_t stream) {
  if (!p.has_row_reduction()) return fused_elementwise(p, workspace, stream);
  return per_dtype(p, [&]<DType kD>() { return fused_streaming_dtype<kD>(p, workspace, stream, nullptr); });
}
cudaError_t fused_streaming_workspace(const FusedParams& p, size_t* bytes) {
  if (!p.has_row_reduction()) return fused_elementwise_workspace(p, bytes);
  return per_dtype(p, [&]<DType kD>() { return fused_streaming_dtype<kD>(p, Workspace{}, nullptr, bytes); });
}

cudaError_t fused_registers(const FusedParams& p, const Workspace& workspace, cudaStream_t stream) {
  if (!p.has_row_reduction()) return fused_elementwise(p, workspace, stream);
  return per_dtype(p, [&]<DType kD>() { return fused_registers_dtype<kD>(p, workspace, stream, nullptr); });
}
cudaError_t fused_registers_workspace(const FusedParams& p, size_t* bytes) {
  if (!p.has_row_reduction()) return fused_elementwise_workspace(p, bytes);
  return per_dtype(p, [&]<DType kD>() { return fused_registers_dtype<kD>(p, Workspace{}, nullptr, bytes); });
}

}  // namespace optimized::cuda
