// TMA tensor maps (CUDA builds): the host side of the Hopper kernels' bulk tensor copies. A map
// describes a batched row-major matrix in global memory and the box one copy brings; the kernel
// takes it as a __grid_constant__ parameter (src/kernels/ptx/tma.cuh).
#pragma once

#if OPTIMIZED_WITH_CUDA
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace optimized {

// A (batch, rows, cols) row-major matrix: row stride ld, batch stride (0: one matrix for every
// batch), in elements.
struct TmaMatrix {
  const void* data;
  int64_t rows, cols, ld;
  int64_t batch, batch_stride;
  int element_bytes;  // 1, 2 or 4
};

// Empty when TMA can describe m (base 16-byte aligned, row and batch strides multiples of 16
// bytes, sizes below 2^31); otherwise why not, naming `name` ("a: ...").
std::string tma_rejects(const TmaMatrix& m, const char* name);

// A 3-D map (cols, rows, batch) of m with boxes of box_cols x box_rows x 1, 128-byte swizzle
// (box_cols * element_bytes must be 128), zeros outside the matrix. cudaErrorInvalidValue when
// the driver refuses it.
cudaError_t make_tma_map_sw128(CUtensorMap* map, const TmaMatrix& m, int box_cols, int box_rows);

// A 4-D tensor of 16-bit (or 1- or 4-byte) elements: dims innermost first (dims[0] contiguous),
// strides of dims 1..3 in elements, any order (attention's (B, S, H, D) as (D, S, H, B) has the
// head stride below the row stride).
struct TmaTensor4 {
  const void* data;
  int64_t dims[4];
  int64_t strides[3];
  int element_bytes;
};

// Empty when TMA can describe t (base 16-byte aligned, strides of dimensions larger than 1
// multiples of 16 bytes, sizes below 2^31); otherwise why not, naming `name`.
std::string tma_rejects(const TmaTensor4& t, const char* name);

// A 4-D map of t with boxes of box_cols x box_rows x 1 x 1 (dims 0 and 1), 128-byte swizzle
// (box_cols * element_bytes must be 128), zeros outside the tensor. A dimension of size 1 gets a
// stride TMA accepts whatever the view says (it is never stepped). cudaErrorInvalidValue when the
// driver refuses it.
cudaError_t make_tma_map_sw128(CUtensorMap* map, const TmaTensor4& t, int box_cols, int box_rows);

}  // namespace optimized
#endif
