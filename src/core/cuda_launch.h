// The launcher contract, and what the C++ API does around a launcher (CUDA builds).
//
// Every CUDA backend of every family is a launcher
//
//   cudaError_t <family>_<variant>(const Params&, const Workspace&, cudaStream_t)
//
// declared in src/<family>/launchers.h, with a workspace query cudaError_t <family>_<variant>
// _workspace(const Params&, size_t*) where it needs scratch. A launcher takes validated params,
// enqueues its kernels on the stream and returns the first CUDA error: it never throws, never
// allocates (its scratch is carved from the workspace, src/core/workspace.h) and never
// synchronises, so a call can be captured in a CUDA graph. The family's variant table
// (core/variant_table.h) holds the launchers; launch_on_cuda below runs one for the C++ API: it
// makes the operands' device current, refuses a device older than the variant needs, provides the
// workspace (the caller's, checked, or one allocated on the call's stream), launches, and turns
// the launcher's cudaError_t into optimized::Error.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "core/cuda_device_guard.h"
#include "core/device_facts.h"
#include "core/variant_table.h"
#include "optimized/core.h"

namespace optimized {

// The workspace of one call: the caller's (ExecutionContext::workspace) or, when the caller gave
// none and the launch needs some, one allocated on the call's stream from the library's pool
// (workspace_pool, core/device_facts.h) and freed on it afterwards.
class CallWorkspace {
 public:
  // `needed`: what the launch needs (its launcher's workspace query); `what`: the call, for messages
  // ("layer_norm backward (fused_registers)"); `device`: the stream's device.
  CallWorkspace(const ExecutionContext& ctx, size_t needed, const std::string& what, int device, cudaStream_t stream)
      : stream_(stream) {
    const Workspace& given = ctx.workspace;
    if (given.data != nullptr) {
      if (given.bytes < needed)
        throw Error(Status::kInvalidArgument,
                    "workspace: expected at least " + std::to_string(needed) + " bytes for " + what +
                        " (the op's workspace_bytes query says how much); given " + std::to_string(given.bytes) +
                        " bytes");
      if (needed > 0 && reinterpret_cast<uintptr_t>(given.data) % 256 != 0)
        throw Error(Status::kInvalidArgument, "workspace: expected data aligned to 256 bytes for " + what +
                                                  "; given address " +
                                                  std::to_string(reinterpret_cast<uintptr_t>(given.data)));
      ws_ = given;
      return;
    }
    if (needed == 0) return;
    cudaMemPool_t pool = nullptr;
    check_cuda(workspace_pool(device, &pool), "cudaMemPoolCreate (workspace of " + what + ")");
    check_cuda(cudaMallocFromPoolAsync(&owned_, needed, pool, stream), "cudaMallocFromPoolAsync (workspace of " + what + ")");
    ws_ = {owned_, needed};
  }
  ~CallWorkspace() {
    if (owned_) cudaFreeAsync(owned_, stream_);  // only when an exception left the call early
  }
  CallWorkspace(const CallWorkspace&) = delete;
  CallWorkspace& operator=(const CallWorkspace&) = delete;

  const Workspace& get() const { return ws_; }

  // Frees an allocated workspace on the stream, after the launch that used it (checked).
  void release(const std::string& what) {
    void* p = owned_;
    owned_ = nullptr;
    if (p) check_cuda(cudaFreeAsync(p, stream_), "cudaFreeAsync (workspace of " + what + ")");
  }

 private:
  cudaStream_t stream_;
  void* owned_ = nullptr;
  Workspace ws_;
};

// Error kUnsupported when the current device cannot run the variant: older than
// `min_compute_capability`, or (ArchRule::kArchSpecific, sm_90a code) not exactly that one.
inline void check_compute_capability(int min_compute_capability, ArchRule arch, std::string_view variant,
                                     int device) {
  if (min_compute_capability == 0) return;
  const DeviceFacts* facts = nullptr;
  check_cuda(device_facts(device, &facts), "cudaDeviceGetAttribute (device facts)");
  auto cc = [](int v) { return std::to_string(v / 10) + "." + std::to_string(v % 10); };
  const std::string given = "; given cuda:" + std::to_string(device) + " with " + cc(facts->compute_capability);
  if (arch == ArchRule::kArchSpecific && facts->compute_capability != min_compute_capability)
    throw Error(Status::kUnsupported, "variant: " + std::string(variant) + " is sm_" +
                                          std::to_string(min_compute_capability) + "a code, which runs on compute capability " +
                                          cc(min_compute_capability) + " only" + given);
  if (facts->compute_capability < min_compute_capability)
    throw Error(Status::kUnsupported, "variant: " + std::string(variant) + " needs compute capability " +
                                          cc(min_compute_capability) + " or newer" + given);
}

// The bytes of workspace `row`'s launcher needs for p (0 without a workspace query), on the current
// device.
template <typename Row, typename Params>
size_t launcher_workspace_bytes(const Row& row, const Params& p, const std::string& what) {
  size_t need = 0;
  if constexpr (!std::is_null_pointer_v<decltype(row.workspace)>)
    if (row.workspace) check_cuda(row.workspace(p, &need), what + ": workspace query");
  return need;
}

// Runs `row`'s launcher on p for the C++ API, on CUDA device `device` and ctx's stream.
template <typename Row, typename Params>
void launch_on_cuda(const Row& row, const Params& p, int device, const ExecutionContext& ctx,
                    const std::string& what) {
  DeviceGuard guard(device);
  if (!row.launch)
    throw Error(Status::kUnsupported, "variant: " + std::string(row.name) +
                                          " is not in this build (its sm_90a sources were not compiled: "
                                          "configure with OPTIMIZED_SM90A=ON and an sm_90a-capable nvcc)");
  check_compute_capability(row.min_compute_capability, row.arch, row.name, device);
  const auto stream = static_cast<cudaStream_t>(ctx.cuda_stream);
  CallWorkspace ws(ctx, launcher_workspace_bytes(row, p, what), what, device, stream);
  check_cuda(row.launch(p, ws.get(), stream), what);
  ws.release(what);
}

}  // namespace optimized
