// What the CUTLASS peers' runners share: status checks, the workspace, the set of initialized Gemms,
// the kernel report.
// Included by the kernel translation units only (they need the CUTLASS headers).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cutlass/cutlass.h"
#include "gemm/cutlass/kernels.h"

namespace bench::cutlass_kernels {

inline void check_cutlass(cutlass::Status status, const std::string& what) {
  if (status != cutlass::Status::kSuccess)
    throw std::runtime_error(what + ": " + cutlassGetStatusString(status));
}

inline void check_cudart(cudaError_t err, const std::string& what) {
  if (err != cudaSuccess) throw std::runtime_error(what + ": " + cudaGetErrorString(err));
}

// A device workspace of the largest size any set asked for (the sets run one after another on one
// stream, so they can share it), freed with the runner.
class Workspace {
 public:
  Workspace() = default;
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  ~Workspace() {
    if (ptr_) cudaFree(ptr_);
  }
  void* reserve(size_t bytes) {
    if (bytes > bytes_) {
      if (ptr_) check_cudart(cudaFree(ptr_), "cudaFree (CUTLASS workspace)");
      ptr_ = nullptr;
      check_cudart(cudaMalloc(&ptr_, bytes), "cudaMalloc (CUTLASS workspace of " + std::to_string(bytes) + " bytes)");
      bytes_ = bytes;
    }
    return ptr_;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// A runner's device Gemm objects, one per rotating operand set (the arguments of each), each checked
// with can_implement and initialized once over one shared workspace (the largest any set asks for);
// run(set) is one launch of that set's Gemm, its status and the launch checked.
template <class Gemm>
class GemmSet {
 public:
  GemmSet(const std::vector<typename Gemm::Arguments>& args, void* stream, std::string what)
      : gemms_(args.size()), what_(std::move(what)) {
    size_t bytes = 0;
    for (const auto& a : args) {
      check_cutlass(Gemm::can_implement(a), what_ + ": can_implement");
      bytes = std::max(bytes, Gemm::get_workspace_size(a));
    }
    void* ws = workspace_.reserve(bytes);
    for (size_t i = 0; i < args.size(); ++i)
      check_cutlass(gemms_[i].initialize(args[i], ws, static_cast<cudaStream_t>(stream)), what_ + ": initialize");
  }

  void run(int set, void* stream) {
    Gemm& g = gemms_[static_cast<size_t>(set) % gemms_.size()];
    check_cutlass(g.run(static_cast<cudaStream_t>(stream)), what_ + ": run");
    check_cudart(cudaPeekAtLastError(), what_ + ": launch");
  }

 private:
  std::vector<Gemm> gemms_;
  Workspace workspace_;
  std::string what_;
};

// The report of `kernel` (a __global__ function): registers, static smem, local memory per thread.
template <class KernelFn>
CutlassKernelReport kernel_report(KernelFn kernel, std::string name, int threads, int dynamic_smem) {
  CutlassKernelReport r;
  r.name = std::move(name);
  r.threads = threads;
  r.dynamic_smem = dynamic_smem;
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, kernel) == cudaSuccess) {
    r.registers = attr.numRegs;
    r.static_smem = static_cast<int>(attr.sharedSizeBytes);
    r.local_bytes = static_cast<int>(attr.localSizeBytes);
  } else {
    (void)cudaGetLastError();
  }
  return r;
}

// The table entry of a config run by Runner<Config> (Sm80Runner, Sm90Runner): `peer` with in / out
// dtypes, B's layout, the config's alignments, and the runner made for a problem over the sets.
template <template <class> class Runner, class Config>
Entry runner_entry(const char* peer, optimized::DType in, optimized::DType out, bool b_k_major) {
  auto make = [](const CutlassProblem& p, const std::vector<CutlassOperands>& sets,
                 void* stream) -> std::unique_ptr<CutlassGemm> { return std::make_unique<Runner<Config>>(p, sets, stream); };
  return Entry{peer, in, out, b_k_major, Config::kAlignAB, Config::kAlignC, make};
}

}  // namespace bench::cutlass_kernels
