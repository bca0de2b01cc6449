// cutlass_sm89, fp8 e4m3 x e4m3 (fp32 accumulation, bf16 C, per-tensor scales as alpha): 2.x
// GemmUniversal for Sm89 (Ada's fp8 mma.sync m16n8k32, which sm_90 runs), threadblock (128, 128, 64),
// warps (32, 64, 64) (8 warps), 4 cp.async stages, staged accumulation (OpMultiplyAdd: each
// threadblock k-tile accumulates into a second fp32 fragment that is added into the main one, as
// cuBLASLt's default and our wgmma_fp8 promote); B stored (N, K) (K-major, "TN").
// ptxas: 255 registers and 24 bytes of spill stores -- the least of the configurations tried
// (64x64 warps: ~1 KB; CUTLASS example 58's 128x64x128 with 64x32 warps: 128 bytes; even with
// OpMultiplyAddFastAccum, 28 bytes).
#include "gemm/cutlass/sm80_gemm.cuh"

namespace bench::cutlass_kernels {

namespace {
using Block = cutlass::gemm::GemmShape<128, 128, 64>;  // (BLK_M, BLK_N, BLK_K)
using Warp = cutlass::gemm::GemmShape<32, 64, 64>;
using Mma = cutlass::gemm::GemmShape<16, 8, 32>;
using TN = Sm80Config<cutlass::float_e4m3_t, cutlass::bfloat16_t, cutlass::layout::ColumnMajor, cutlass::arch::Sm89,
                      Block, Warp, Mma, 4>;
}  // namespace

void add_fp8_sm89(std::vector<Entry>& out) {
  using optimized::DType;
  out.push_back(sm80_entry<TN>("cutlass_sm89", DType::kF8E4M3, DType::kBF16, true));
}

}  // namespace bench::cutlass_kernels
