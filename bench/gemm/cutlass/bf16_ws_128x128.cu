// cutlass_ws_128x128, bf16 (fp32 accumulation, bf16 C): KernelTmaWarpSpecializedCooperative,
// tile (BLK_M, BLK_N, BLK_K) = (128, 128, 64), cluster 2x1; B row-major (NN) and stored (N, K) (NT).
#include "gemm/cutlass/sm90_gemm.cuh"

namespace bench::cutlass_kernels {

namespace {
using Tile = Shape<_128, _128, _64>;  // (BLK_M, BLK_N, BLK_K)
using Cluster = Shape<_2, _1, _1>;
using NN = Sm90Config<cutlass::bfloat16_t, cutlass::bfloat16_t, cutlass::layout::RowMajor, Tile, Cluster, Cooperative>;
using NT = Sm90Config<cutlass::bfloat16_t, cutlass::bfloat16_t, cutlass::layout::ColumnMajor, Tile, Cluster, Cooperative>;
}  // namespace

void add_bf16_ws_128x128(std::vector<Entry>& out) {
  using optimized::DType;
  out.push_back(sm90_entry<NN>("cutlass_ws_128x128", DType::kBF16, DType::kBF16, false));
  out.push_back(sm90_entry<NT>("cutlass_ws_128x128", DType::kBF16, DType::kBF16, true));
}

}  // namespace bench::cutlass_kernels
