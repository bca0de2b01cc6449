// TMA tensor maps through the driver's cuTensorMapEncodeTiled, reached with the runtime's entry
// point query so that the library does not link libcuda itself.
#include "core/tensor_map.h"

#if OPTIMIZED_WITH_CUDA

namespace optimized {

namespace {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiledFn encode_tiled() {
  static EncodeTiledFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      p = nullptr;
    return reinterpret_cast<EncodeTiledFn>(p);
  }();
  return fn;
}

CUtensorMapDataType data_type(int element_bytes) {
  switch (element_bytes) {
    case 1: return CU_TENSOR_MAP_DATA_TYPE_UINT8;
    case 2: return CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;  // the bits are copied as they are: fp16 too
    default: return CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  }
}

}  // namespace

std::string tma_rejects(const TmaMatrix& m, const char* name) {
  const std::string n(name);
  if (reinterpret_cast<uintptr_t>(m.data) % 16 != 0)
    return n + ": expected a 16-byte aligned data pointer for TMA; given address " +
           std::to_string(reinterpret_cast<uintptr_t>(m.data));
  if (m.rows > 1 && (m.ld * m.element_bytes) % 16 != 0)
    return n + ": expected a row stride (leading dimension) that is a multiple of " +
           std::to_string(16 / m.element_bytes) + " elements (16 bytes) for TMA; given " + std::to_string(m.ld);
  if (m.batch > 1 && m.batch_stride != 0 && (m.batch_stride * m.element_bytes) % 16 != 0)
    return n + ": expected a batch stride that is a multiple of " + std::to_string(16 / m.element_bytes) +
           " elements (16 bytes) for TMA; given " + std::to_string(m.batch_stride);
  if (m.rows >= (int64_t(1) << 31) || m.cols >= (int64_t(1) << 31) || m.batch >= (int64_t(1) << 31))
    return n + ": expected rows, columns and batch below 2^31 for TMA";
  return "";
}

cudaError_t make_tma_map_sw128(CUtensorMap* map, const TmaMatrix& m, int box_cols, int box_rows) {
  const EncodeTiledFn encode = encode_tiled();
  if (!encode) return cudaErrorNotSupported;
  const int64_t ld = m.rows > 1 ? m.ld : ((m.cols * m.element_bytes + 15) / 16) * 16 / m.element_bytes;
  const bool batched = m.batch > 1 && m.batch_stride != 0;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(m.cols), static_cast<cuuint64_t>(m.rows),
                              static_cast<cuuint64_t>(batched ? m.batch : 1)};
  // Strides of dimensions 1 and 2 in bytes (dimension 0 is contiguous). A single matrix gets a
  // batch stride that is never stepped.
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(ld * m.element_bytes),
                                 static_cast<cuuint64_t>((batched ? m.batch_stride : ld * m.rows) * m.element_bytes)};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows), 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult r = encode(map, data_type(m.element_bytes), 3, const_cast<void*>(m.data), dims, strides, box,
                            element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

std::string tma_rejects(const TmaTensor4& t, const char* name) {
  const std::string n(name);
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0)
    return n + ": expected a 16-byte aligned data pointer for TMA; given address " +
           std::to_string(reinterpret_cast<uintptr_t>(t.data));
  for (int i = 0; i < 3; ++i)
    if (t.dims[i + 1] > 1 && (t.strides[i] * t.element_bytes) % 16 != 0)
      return n + ": expected strides that are multiples of " + std::to_string(16 / t.element_bytes) +
             " elements (16 bytes) for TMA; given " + std::to_string(t.strides[i]) + " for dimension " +
             std::to_string(i + 1) + " (innermost first)";
  for (int i = 0; i < 4; ++i)
    if (t.dims[i] >= (int64_t(1) << 31)) return n + ": expected sizes below 2^31 for TMA";
  return "";
}

cudaError_t make_tma_map_sw128(CUtensorMap* map, const TmaTensor4& t, int box_cols, int box_rows) {
  const EncodeTiledFn encode = encode_tiled();
  if (!encode) return cudaErrorNotSupported;
  cuuint64_t dims[4];
  for (int i = 0; i < 4; ++i) dims[i] = static_cast<cuuint64_t>(t.dims[i] > 0 ? t.dims[i] : 1);
  // Byte strides of dims 1..3; a size-1 dimension takes the extent of the dimensions inside it
  // (rounded up to 16 bytes), a stride that is never stepped but always valid.
  cuuint64_t strides[3];
  int64_t extent = ((t.dims[0] * t.element_bytes + 15) / 16) * 16;
  for (int i = 0; i < 3; ++i) {
    const int64_t s = t.dims[i + 1] > 1 ? t.strides[i] * t.element_bytes : extent;
    strides[i] = static_cast<cuuint64_t>(s);
    extent = s * static_cast<int64_t>(dims[i + 1]);
  }
  const cuuint32_t box[4] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, data_type(t.element_bytes), 4, const_cast<void*>(t.data), dims, strides, box,
                            element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace optimized
#endif
