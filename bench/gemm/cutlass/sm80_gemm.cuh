// The Ampere-class CUTLASS peer (2.x API): cutlass::gemm::device::GemmUniversal with tensor-core
// mma.sync (OpClassTensorOp), ldmatrix, and a multistage cp.async pipeline: the design of our
// mma_pipeline rung, as CUTLASS builds it. bf16 for Sm80 (mma m16n8k16); fp8 e4m3 for Sm89 (Ada's
// mma m16n8k32, which sm_90 runs too) with staged fp32 accumulation (OpMultiplyAdd, not
// OpMultiplyAddFastAccum). One CTA per output tile, no clusters, no TMA, no warp specialization.
// Epilogue LinearCombination: D = alpha * acc + beta * C, alpha from a device pointer where given.
// Batches: GemmUniversalMode::kBatched (kGemm with a batch count would mean serial split-K).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/device/gemm_universal.h"
#include "cutlass/gemm/threadblock/threadblock_swizzle.h"
#include "gemm/cutlass/common.cuh"

namespace bench::cutlass_kernels {

// ThreadblockShape / WarpShape / InstructionShape: cutlass::gemm::GemmShape<M, N, K>. Op: the mma
// operator (OpMultiplyAdd; for Sm89 fp8, OpMultiplyAdd means staged accumulation).
template <class ElementAB, class ElementC, class LayoutB, class Arch, class ThreadblockShape, class WarpShape,
          class InstructionShape, int kStages, class Op = cutlass::arch::OpMultiplyAdd>
struct Sm80Config {
  static constexpr int kAlignAB = 16 / static_cast<int>(sizeof(ElementAB));
  static constexpr int kAlignC = 16 / static_cast<int>(sizeof(ElementC));
  using RowMajor = cutlass::layout::RowMajor;
  using Epilogue = cutlass::epilogue::thread::LinearCombination<ElementC, kAlignC, float, float>;
  using Gemm = cutlass::gemm::device::GemmUniversal<
      ElementAB, RowMajor, ElementAB, LayoutB, ElementC, RowMajor, float, cutlass::arch::OpClassTensorOp, Arch,
      ThreadblockShape, WarpShape, InstructionShape, Epilogue,
      cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<8>, kStages, kAlignAB, kAlignAB,
      Op>;
  using Kernel = typename Gemm::GemmKernel;

  static std::string description() {
    return std::string("CUTLASS 2.x ") + (std::is_same_v<Arch, cutlass::arch::Sm89> ? "sm89" : "sm80") +
           " GemmUniversal mma.sync multistage " + std::to_string(ThreadblockShape::kM) + "x" +
           std::to_string(ThreadblockShape::kN) + "x" + std::to_string(ThreadblockShape::kK) + " warp " +
           std::to_string(WarpShape::kM) + "x" + std::to_string(WarpShape::kN) + "x" + std::to_string(WarpShape::kK) +
           " stages " + std::to_string(kStages);
  }
};

template <class Config>
class Sm80Runner final : public CutlassGemm {
  using Gemm = typename Config::Gemm;
  using Kernel = typename Config::Kernel;

 public:
  Sm80Runner(const CutlassProblem& p, const std::vector<CutlassOperands>& sets, void* stream)
      : set_(arguments(p, sets), stream, Config::description()) {}

  void run(int set, void* stream) override { set_.run(set, stream); }

  CutlassKernelReport report() const override {
    return kernel_report(cutlass::Kernel2<Kernel>, Config::description(), Kernel::kThreadCount,
                         static_cast<int>(sizeof(typename Kernel::SharedStorage)));
  }

 private:
  // The arguments of each set.
  static std::vector<typename Gemm::Arguments> arguments(const CutlassProblem& p,
                                                         const std::vector<CutlassOperands>& sets) {
    const cutlass::gemm::GemmCoord size(static_cast<int>(p.m), static_cast<int>(p.n), static_cast<int>(p.k));
    const auto mode = p.batch > 1 ? cutlass::gemm::GemmUniversalMode::kBatched : cutlass::gemm::GemmUniversalMode::kGemm;
    using Params = typename Config::Epilogue::Params;
    const Params epilogue = p.alpha_device ? Params(p.alpha_device) : Params(p.alpha, p.beta);
    // Leading dimensions: A (M, K) row-major: K; B row-major (K, N): N, stored (N, K) column-major: K; C: N.
    const int64_t ldb = std::is_same_v<typename Gemm::LayoutB, cutlass::layout::ColumnMajor> ? p.k : p.n;
    std::vector<typename Gemm::Arguments> args;
    for (const CutlassOperands& o : sets) {
      typename Gemm::Arguments a(mode, size, static_cast<int>(p.batch), epilogue, o.a, o.b, o.c, o.c, p.m * p.k,
                                 p.k * p.n, p.m * p.n, p.m * p.n, p.k, ldb, p.n, p.n);
      args.push_back(a);
    }
    return args;
  }

  GemmSet<Gemm> set_;
};

template <class Config>
Entry sm80_entry(const char* peer, optimized::DType in, optimized::DType out, bool b_k_major) {
  return runner_entry<Sm80Runner, Config>(peer, in, out, b_k_major);
}

}  // namespace bench::cutlass_kernels
