// cutlass_ws_128x128, fp8 e4m3 x e4m3 (fp32 accumulation promoted every 128 of K, bf16 C, per-tensor scales as
// alpha): KernelTmaWarpSpecializedCooperative, tile (BLK_M, BLK_N, BLK_K) = (128, 128, 128), cluster 2x1;
// B stored (N, K) (K-major, "TN": fp8 wgmma reads K-major operands only).
#include "gemm/cutlass/sm90_gemm.cuh"

namespace bench::cutlass_kernels {

namespace {
using Tile = Shape<_128, _128, _128>;  // (BLK_M, BLK_N, BLK_K)
using Cluster = Shape<_2, _1, _1>;
using TN = Sm90Config<cutlass::float_e4m3_t, cutlass::bfloat16_t, cutlass::layout::ColumnMajor, Tile, Cluster, Cooperative>;
}  // namespace

void add_fp8_ws_128x128(std::vector<Entry>& out) {
  using optimized::DType;
  out.push_back(sm90_entry<TN>("cutlass_ws_128x128", DType::kF8E4M3, DType::kBF16, true));
}

}  // namespace bench::cutlass_kernels
