// cutlass_ws_128x192, fp8 e4m3 x e4m3 (fp32 accumulation promoted every 128 of K, bf16 C, per-tensor
// scales as alpha): KernelTmaWarpSpecializedCooperative, tile (BLK_M, BLK_N, BLK_K) = (128, 192, 128),
// cluster 2x1; B stored (N, K) (K-major, "TN": fp8 wgmma reads K-major operands only).
// fp8's second cooperative tile: the FP8 mainloop keeps two accumulators per warpgroup (the wgmma
// one and the promoted fp32 one), so bf16's 128x256 (64x256 per warpgroup: 2 x 128 registers per
// thread) spills; 64x192 per warpgroup (2 x 96) does not.
#include "gemm/cutlass/sm90_gemm.cuh"

namespace bench::cutlass_kernels {

namespace {
using Tile = Shape<_128, cute::Int<192>, _128>;  // (BLK_M, BLK_N, BLK_K)
using Cluster = Shape<_2, _1, _1>;
using TN = Sm90Config<cutlass::float_e4m3_t, cutlass::bfloat16_t, cutlass::layout::ColumnMajor, Tile, Cluster, Cooperative>;
}  // namespace

void add_fp8_ws_128x192(std::vector<Entry>& out) {
  using optimized::DType;
  out.push_back(sm90_entry<TN>("cutlass_ws_128x192", DType::kF8E4M3, DType::kBF16, true));
}

}  // namespace bench::cutlass_kernels
