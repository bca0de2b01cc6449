// cutlass_sm80, bf16 (fp32 accumulation, bf16 C): 2.x GemmUniversal for Sm80, threadblock
// (128, 256, 64), warps (64, 64, 64) (8 warps), mma m16n8k16, 3 cp.async stages;
// B row-major (NN) and stored (N, K) (NT).
#include "gemm/cutlass/sm80_gemm.cuh"

namespace bench::cutlass_kernels {

namespace {
using Block = cutlass::gemm::GemmShape<128, 256, 64>;  // (BLK_M, BLK_N, BLK_K)
using Warp = cutlass::gemm::GemmShape<64, 64, 64>;
using Mma = cutlass::gemm::GemmShape<16, 8, 16>;
using NN = Sm80Config<cutlass::bfloat16_t, cutlass::bfloat16_t, cutlass::layout::RowMajor, cutlass::arch::Sm80, Block,
                      Warp, Mma, 3>;
using NT = Sm80Config<cutlass::bfloat16_t, cutlass::bfloat16_t, cutlass::layout::ColumnMajor, cutlass::arch::Sm80,
                      Block, Warp, Mma, 3>;
}  // namespace

void add_bf16_sm80(std::vector<Entry>& out) {
  using optimized::DType;
  out.push_back(sm80_entry<NN>("cutlass_sm80", DType::kBF16, DType::kBF16, false));
  out.push_back(sm80_entry<NT>("cutlass_sm80", DType::kBF16, DType::kBF16, true));
}

}  // namespace bench::cutlass_kernels
