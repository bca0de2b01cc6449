// CUTLASS GEMMs as peers of the GEMM and scaled (fp8) GEMM rows of optimized-bench (issue 22): the
// kernels a user could pick instead of ours, built from the CUTLASS headers (PyPI's nvidia-cutlass,
// scripts/fetch-wheels) when the build option OPTIMIZED_CUTLASS is on. Benchmark code only: nothing
// here reaches liboptimized_ops.
//
//   cutlass_ws_128x128       Hopper 3.x: TMA + wgmma, KernelTmaWarpSpecializedCooperative (a producer
//   cutlass_ws_128x256       warp loads, two consumer warpgroups split one tile), cluster 2x1
//   cutlass_pingpong_64x128  Hopper 3.x: KernelTmaWarpSpecializedPingpong (two consumer warpgroups, each on
//   cutlass_pingpong_128x128 a tile of its own, taking turns at the tensor cores and the epilogue), 2x1
//   cutlass_sm80             2.x GemmUniversal, mma.sync + cp.async multistage (bf16), Ampere's design
// fp8 (e4m3, per-tensor scales, bf16 out) has the same schedules with tiles that fit its promoted
// accumulators: cutlass_ws_128x128, cutlass_ws_128x192, cutlass_pingpong_64x128,
// cutlass_pingpong_64x192 (128x256 and ping-pong 128x128 spill: skipped rows saying so), and
//   cutlass_sm89             the 2.x design for fp8 (e4m3 mma.sync is Ada's, sm_89)
//
// Every peer is validated by the harness like cuBLAS before it is timed; one that cannot take a
// problem (layout, alignment, dtype) reports the reason from cutlass_peer_rejects (a skipped row).
// The header needs no CUTLASS: it builds (and answers "not built") without it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "harness/report.h"
#include "optimized/core.h"

namespace bench {

// One problem in our GEMM convention: C (M, N) row-major = alpha * A @ B + beta * C; A (M, K)
// row-major or stored (K, M) (trans_a); B (K, N) row-major or stored (N, K) (trans_b); batches of
// contiguous operands (M K, K N, M N apart).
struct CutlassProblem {
  int64_t m = 0, n = 0, k = 0, batch = 1;
  bool trans_a = false, trans_b = false;
  optimized::DType in = optimized::DType::kBF16;   // A and B (bf16, or fp8 e4m3 for the scaled rows)
  optimized::DType out = optimized::DType::kBF16;  // C
  float alpha = 1.0f, beta = 0.0f;
  // fp8 rows: alpha read on the device (the product of the per-tensor scales), as cuBLASLt reads its
  // scale pointers; null: `alpha`.
  const float* alpha_device = nullptr;
};

// One rotating input set's device pointers.
struct CutlassOperands {
  const void* a = nullptr;
  const void* b = nullptr;
  void* c = nullptr;
};

// What the report's kernel columns show: the harness's KernelInfo (name, registers, shared memory,
// threads, local bytes), put into a row's Result::kernel as it is.
using CutlassKernelReport = KernelInfo;

// One CUTLASS kernel initialized for one problem over every rotating set: the host-side work
// (arguments, TMA descriptors, can_implement) is done once when it is made, as a framework caches
// its plan, so a timed call is a launch.
class CutlassGemm {
 public:
  virtual ~CutlassGemm() = default;
  // Launches on set `set % sets` on `stream` (cudaStream_t). Throws std::runtime_error naming
  // CUTLASS's status.
  virtual void run(int set, void* stream) = 0;
  virtual CutlassKernelReport report() const = 0;
};

// Whether the build has the CUTLASS peers (OPTIMIZED_CUTLASS), and the headers' version ("4.2.0").
bool cutlass_peers_built();
std::string cutlass_version();

// The peers built for input dtype `in` (kBF16; kF8E4M3 for the scaled rows), in table order; empty
// when none is.
std::vector<std::string> cutlass_peer_names(optimized::DType in);

// --peers items: "cutlass" (every CUTLASS peer of the rows' dtypes), "none", or names of
// cutlass_peer_names(kBF16) and cutlass_peer_names(kF8E4M3). Throws std::invalid_argument naming the
// choices, or saying that the build has no CUTLASS peers and how to get them.
std::vector<std::string> parse_cutlass_peers(const std::vector<std::string>& items);

// "" when peer `name` can run the problem; else why not (a skipped row's reason).
std::string cutlass_peer_rejects(const std::string& name, const CutlassProblem& p);

// "" when device 0 can run the peers (compute capability 9.0: they are compiled for sm_90a alone,
// the sm80 / sm89 designs included); else why not.
std::string cutlass_device_rejects();

// The kernel of peer `name` for the problem over `sets` (host work done here). Throws
// std::runtime_error naming CUTLASS's status (can_implement, initialize) or the missing peer.
std::unique_ptr<CutlassGemm> make_cutlass_gemm(const std::string& name, const CutlassProblem& p,
                                               const std::vector<CutlassOperands>& sets, void* stream);

}  // namespace bench
