// GEMM rung 3 of the CUDA ladder: 32x32 tiles of A and B staged through shared memory.
//
//   C = alpha * A @ B + beta * C      A (M, K), B (K, N), C (M, N) with leading dims; A and B
//                                     row-major or stored transposed (column-major), C row-major
//
// What this rung changes versus coalesced: data reuse inside the block. In the coalesced rung
// each of the 1024 threads of a 32x32 patch of C fetched its own copy of a row of A and a column
// of B from L1/L2, so every element of A and B was requested 32 times per patch. Here the block
// walks K in steps of 32: all threads cooperatively load one 32x32 tile of A and one 32x32 tile
// of B (one element each, coalesced: lane x reads column x), park them in shared memory, sync,
// and then each thread runs 32 multiply-adds out of shared memory. Global traffic per
// multiply-add drops 32-fold; the work moves to shared memory, which is much faster but still
// costs one shared load per operand per multiply-add:
//
//   - As[ty][kk]: the same address for the whole warp (a warp is one row ty): a broadcast.
//   - Bs[kk][tx]: 32 consecutive words across the warp: one per bank, conflict-free.
//
// So the kernel is now bound by shared-memory load instructions (~1 LDS per FFMA; the compiler
// merges the broadcast As reads into LDS.128, so ~1.25). Rung 4 (register_tiled) makes each
// thread compute an 8x8 patch of C so that every value read from shared memory feeds 8 FFMAs.
//
// Tiles at the M, N and K edges are zero-filled, so any M, N, K >= 1 work; the store is
// guarded. The tiles hold fp32 (16-bit inputs are converted once, when staged).
//
// Layouts (NN, NT, TN, TT: GemmParams::trans_a / trans_b, compile-time parameters of the kernel
// dispatched once by the launcher, so the NN kernel is the one described above). The compute loop
// and the tiles' meaning do not change; only the staging does. A transposed operand is stored
// with the other index contiguous (A^T: M, B^T: K), so the thread that stages element (y, x) of
// the tile swaps roles: lane x reads the stored row's element x (A^T(k0 + ty, m0 + tx), or
// B^T(n0 + ty, k0 + tx)), which keeps the warp's global read one coalesced row, and writes it to
// As[tx][ty] (Bs[tx][ty]), down a column of the tile. Those tiles get one float of padding per
// row (33 floats), so the 32 lanes' column writes hit 32 different banks, and the compute loop's
// reads stay a broadcast (As) and 32 consecutive words (Bs). The cost is 128 bytes of shared
// memory per padded tile, nothing in the inner loop (measured on an H100, fp32 2048^3: 2.35 to
// 2.6 ms across the four layouts, NN 2.45).
//
// Block 32 x 32 threads: x -> 32 columns of C, y -> 32 rows. Grid x covers the N tiles, grid y
// the M tiles but is capped at 65535, so the block walks M tiles with a grid-stride loop (the
// loop condition is uniform across the block, so the __syncthreads inside are safe); grid z
// carries the batch, in launches of at most 65535.
#include <cstdint>
#include <string>

#include "gemm/cuda/gemm_common.cuh"
#include "gemm/launchers.h"

namespace optimized::cuda {
namespace {

constexpr int kTile = 32;  // C tile per block is kTile x kTile; K advances kTile per step
constexpr int kThreads = kTile * kTile;  // 1024: one thread per element of the C tile

// Rows of a staged tile: 32 floats, or 33 for a tile staged down its columns (a transposed
// operand), so that the 32 lanes' writes of one column fall into 32 different banks.
template <bool kTransposed>
constexpr int kTileLd = kTransposed ? kTile + 1 : kTile;

template <typename T, bool kTransA, bool kTransB>
__global__ void __launch_bounds__(kThreads)
    gemm_smem_tiled_kernel(GemmParams p, int64_t batch_offset) {
  __shared__ float As[kTile][kTileLd<kTransA>];  // As[y][x] = A(m0 + y, k0 + x)
  __shared__ float Bs[kTile][kTileLd<kTransB>];  // Bs[y][x] = B(k0 + y, n0 + x)

  const BatchOperands<T> ops = batch_operands<T>(p, batch_offset + blockIdx.z);
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kTile + tx;  // of C and of B
  const int64_t tiles_m = (p.m + kTile - 1) / kTile;

  for (int64_t tile_m = blockIdx.y; tile_m < tiles_m; tile_m += gridDim.y) {
    const int64_t row = tile_m * kTile + ty;  // of C and of A
    const T* a_row = ops.a + row * p.lda;     // row-major A: only dereferenced when row < M
    float acc = 0.0f;
    for (int64_t k0 = 0; k0 < p.k; k0 += kTile) {
      // Stage the tiles: one element each, zero outside the matrices. Lane tx always reads
      // element tx of a stored row (coalesced); a transposed operand's element lands in column
      // ty of the tile.
      const int64_t ka = k0 + tx;  // k of the element read along a stored row (A, or B^T)
      const int64_t kb = k0 + ty;  // k of the stored row read (B, or A^T)
      if constexpr (kTransA) {
        const int64_t ma = tile_m * kTile + tx;  // A(ma, kb): A^T's stored row kb, element ma
        As[tx][ty] = (ma < p.m && kb < p.k) ? to_float(ops.a[kb * p.lda + ma]) : 0.0f;
      } else {
        As[ty][tx] = (row < p.m && ka < p.k) ? to_float(a_row[ka]) : 0.0f;
      }
      if constexpr (kTransB) {
        const int64_t nb = static_cast<int64_t>(blockIdx.x) * kTile + ty;  // B(ka, nb): B^T's row nb
        Bs[tx][ty] = (ka < p.k && nb < p.n) ? to_float(ops.b[nb * p.ldb + ka]) : 0.0f;
      } else {
        Bs[ty][tx] = (kb < p.k && col < p.n) ? to_float(ops.b[kb * p.ldb + col]) : 0.0f;
      }
      __syncthreads();  // tiles complete before anyone reads them
#pragma unroll
      for (int kk = 0; kk < kTile; ++kk) acc = fmaf(As[ty][kk], Bs[kk][tx], acc);
      __syncthreads();  // everyone done reading before the next step overwrites the tiles
    }
    if (row < p.m && col < p.n) store_alpha_beta(ops.c + row * p.ldc + col, acc, p.alpha, p.beta);
  }
}

template <typename T, bool kTransA, bool kTransB>
const char* kernel_name() {
  static const std::string name =
      std::string("smem_tiled<") + dtype_label<T>() + ", 32x32x32, 1x1" + kLayoutSuffix<kTransA, kTransB> + ">";
  return name.c_str();
}

}  // namespace

cudaError_t gemm_smem_tiled(const GemmParams& p, const Workspace&, cudaStream_t stream) {
  const int64_t tiles_n = ceil_div(p.n, kTile);
  if (tiles_n > INT32_MAX) return cudaErrorInvalidConfiguration;  // grid.x limit
  const int64_t tiles_m = ceil_div(p.m, kTile);
  const int64_t blocks_y = tiles_m < kMaxGridY ? tiles_m : kMaxGridY;
  return dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    return dispatch_layout(p, [&]<bool kTransA, bool kTransB>() -> cudaError_t {
      return launch_batch_chunks(p.batch, [&](int64_t first, unsigned count) {
        const dim3 grid(static_cast<unsigned>(tiles_n), static_cast<unsigned>(blocks_y), count);
        gemm_smem_tiled_kernel<T, kTransA, kTransB><<<grid, dim3(kTile, kTile), 0, stream>>>(p, first);
      });
    });
  });
}

cudaError_t gemm_smem_tiled_resources(const GemmParams& p, KernelResources* out) {
  return dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    return dispatch_layout(p, [&]<bool kTransA, bool kTransB>() -> cudaError_t {
      return describe_kernel(reinterpret_cast<const void*>(&gemm_smem_tiled_kernel<T, kTransA, kTransB>),
                             kernel_name<T, kTransA, kTransB>(), kThreads, /*dynamic_smem_bytes=*/0, out);
    });
  });
}

}  // namespace optimized::cuda
