// The Hopper CUTLASS peers (3.x API): a GEMM assembled by CUTLASS's collective builders from a
// tile shape, a cluster shape and a kernel schedule, run through GemmUniversalAdapter.
//
//   mainloop: TMA loads of A and B tiles into a shared-memory ring (stages: as many as fit beside
//             the epilogue's storage), wgmma from shared memory, a producer warp and consumer
//             warpgroups synchronized on mbarriers; fp8 operands get the FP8 mainloop, which promotes
//             the wgmma partial sums into fp32 registers every 4 k-blocks (128 of K: what cuBLASLt's
//             default, no fast accumulation, does);
//   schedule: KernelTmaWarpSpecializedCooperative: both consumer warpgroups work on one output tile
//             (each its half of the rows), persistent over the tiles;
//             KernelTmaWarpSpecializedPingpong: each consumer warpgroup owns a tile, and the two take
//             turns (ordered barriers): one runs its mainloop while the other runs its epilogue;
//   epilogue: TMA store (TmaWarpSpecializedCooperative / TmaWarpSpecialized), D = alpha * acc +
//             beta * C (C read only when beta != 0), alpha from a device pointer where given.
//
// A is row-major (K-major); B row-major (N-major, our "NN") or stored (N, K) (K-major, our "NT");
// C and D row-major (M, N); batches as the L mode.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"
#include "gemm/cutlass/common.cuh"

namespace bench::cutlass_kernels {

using cute::_1;
using cute::_2;
using cute::_64;
using cute::_128;
using cute::_256;
using cute::Shape;

struct Cooperative {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
  static constexpr const char* kName = "warp-specialized cooperative";
};
struct Pingpong {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized;
  static constexpr const char* kName = "warp-specialized ping-pong";
};

// ElementAB: bf16 or e4m3; ElementC: C and D; LayoutB: cutlass::layout::RowMajor (N-major) or
// ColumnMajor (K-major); TileShape (BLK_M, BLK_N, BLK_K); ClusterShape (CM, CN, 1).
template <class ElementAB, class ElementC, class LayoutB, class TileShape, class ClusterShape, class Schedule>
struct Sm90Config {
  static constexpr int kAlignAB = 16 / static_cast<int>(sizeof(ElementAB));  // 16-byte TMA rows
  static constexpr int kAlignC = 16 / static_cast<int>(sizeof(ElementC));
  using RowMajor = cutlass::layout::RowMajor;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto,
      float, float,                                   // accumulator, epilogue compute
      ElementC, RowMajor, kAlignC,                    // C
      ElementC, RowMajor, kAlignC,                    // D (= C's storage)
      typename Schedule::Epilogue>::CollectiveOp;     // fusion: LinearCombination (alpha, beta)

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      ElementAB, RowMajor, kAlignAB,                  // A (M, K) K-major
      ElementAB, LayoutB, kAlignAB,                   // B
      float,                                          // accumulator
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Schedule::Kernel>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>,  // (M, N, K, L)
                                                      CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static std::string description() {
    return std::string("CUTLASS 3.x sm90 ") + Schedule::kName + " " +
           std::to_string(cute::size<0>(TileShape{})) + "x" + std::to_string(cute::size<1>(TileShape{})) + "x" +
           std::to_string(cute::size<2>(TileShape{})) + " cluster " + std::to_string(cute::size<0>(ClusterShape{})) +
           "x" + std::to_string(cute::size<1>(ClusterShape{})) + " stages " +
           std::to_string(CollectiveMainloop::DispatchPolicy::Stages);
  }
};

// A packed stride of a (MN, K, L) operand: K-major (K, 1, MN K) when the stride's K mode is the
// static 1, else MN-major (1, MN, MN K). C and D are (M, N, L) row-major: mn = M, k = N.
template <class Stride>
Stride packed_stride(int64_t mn, int64_t k) {
  Stride s{};
  if constexpr (cute::is_static_v<cute::remove_cvref_t<decltype(cute::get<1>(s))>>) cute::get<0>(s) = k;
  else cute::get<1>(s) = mn;
  cute::get<2>(s) = mn * k;
  return s;
}

template <class Config>
class Sm90Runner final : public CutlassGemm {
  using Gemm = typename Config::Gemm;
  using Kernel = typename Config::Kernel;

 public:
  Sm90Runner(const CutlassProblem& p, const std::vector<CutlassOperands>& sets, void* stream)
      : set_(arguments(p, sets), stream, Config::description()) {}

  void run(int set, void* stream) override { set_.run(set, stream); }

  CutlassKernelReport report() const override {
    return kernel_report(cutlass::device_kernel<Kernel>, Config::description(), Kernel::MaxThreadsPerBlock,
                         Kernel::SharedStorageSize);
  }

 private:
  // The arguments of each set.
  static std::vector<typename Gemm::Arguments> arguments(const CutlassProblem& p,
                                                         const std::vector<CutlassOperands>& sets) {
    cutlass::KernelHardwareInfo hw;
    check_cudart(cudaGetDevice(&hw.device_id), "cudaGetDevice");
    hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(hw.device_id);
    const int m = static_cast<int>(p.m), n = static_cast<int>(p.n), k = static_cast<int>(p.k),
              l = static_cast<int>(p.batch);
    const auto sa = packed_stride<typename Kernel::StrideA>(p.m, p.k);
    const auto sb = packed_stride<typename Kernel::StrideB>(p.n, p.k);
    const auto sc = packed_stride<typename Kernel::StrideC>(p.m, p.n);
    const auto sd = packed_stride<typename Kernel::StrideD>(p.m, p.n);
    using EA = typename Gemm::ElementA;
    using EB = typename Gemm::ElementB;
    using EC = typename Gemm::ElementC;
    using ED = typename Gemm::ElementD;
    std::vector<typename Gemm::Arguments> args;
    for (const CutlassOperands& o : sets) {
      typename Gemm::Arguments a{cutlass::gemm::GemmUniversalMode::kGemm,
                                 {m, n, k, l},
                                 {static_cast<const EA*>(o.a), sa, static_cast<const EB*>(o.b), sb},
                                 {{}, static_cast<const EC*>(o.c), sc, static_cast<ED*>(o.c), sd},
                                 hw};
      a.epilogue.thread.alpha = p.alpha;
      a.epilogue.thread.beta = p.beta;
      a.epilogue.thread.alpha_ptr = p.alpha_device;
      args.push_back(a);
    }
    return args;
  }

  GemmSet<Gemm> set_;  // one Gemm per rotating set: initialized once, each timed call a launch
};

template <class Config>
Entry sm90_entry(const char* peer, optimized::DType in, optimized::DType out, bool b_k_major) {
  return runner_entry<Sm90Runner, Config>(peer, in, out, b_k_major);
}

}  // namespace bench::cutlass_kernels
