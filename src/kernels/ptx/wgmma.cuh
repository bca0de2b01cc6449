// wgmma (sm_90a): warpgroup matrix multiply-accumulate. The four warps of a warpgroup (128
// threads, warp index a multiple of 4) issue together; A and B are read from shared memory
// through 64-bit matrix descriptors, the accumulators live in registers (m64nNk16 with fp32
// accumulation: N/2 floats per thread, laid out as N/8 mma.sync m16n8 C fragments per warp:
// warp w of the group holds rows 16w..16w+15; d[4j + 2h + e] is row 16w + lane/4 + 8h, column
// 8j + 2*(lane%4) + e).
//
//   wgmma_fence();                               before the first wgmma that reads registers written since
//   wgmma_m64n256k16<kTransA, kTransB>(acc, desc_a, desc_b, scale_d, Bf16Tag{});   ... asynchronous
//   wgmma_commit();                              close a group
//   wgmma_wait<N>();                             until at most N groups are in flight
//
// Shared-memory layouts (the ones a TMA box of 128-byte rows with CU_TENSOR_MAP_SWIZZLE_128B
// writes; 16-bit elements, so a row is 64 of them; tiles 1024-byte aligned):
//   K-major (trans 0): a row per M (or N) index, K contiguous. 8 rows x 128 bytes form one swizzle
//     atom; atoms follow each other along M every 1024 bytes (the stride byte offset, SBO). The
//     leading byte offset is unused (one 128-byte row covers the 64 K of a k-block). A k-step of
//     16 moves the start address by 32 bytes inside the swizzled row.
//   MN-major (trans 1): a row per K index, M (or N) contiguous, 64 of them per 128-byte row. 8 K
//     rows form an atom (SBO = 1024 to the next 8 K); the next 64 columns of M/N live in the next
//     TMA box, LBO bytes further. A k-step of 16 moves the start by 16 rows (2048 bytes).
// Addresses and offsets are in units of 16 bytes (14 bits each); swizzle mode 1 (128B), bits 62-63.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/ptx/smem.cuh"

namespace optimized::kernels::ptx {

__device__ __forceinline__ uint64_t make_smem_desc_sw128(const void* tile, uint32_t leading_bytes,
                                                         uint32_t stride_bytes) {
  const uint64_t addr = smem_u32(tile);
  uint64_t desc = 0;
  desc |= (addr & 0x3FFFF) >> 4;                                   // bits 0-13: start address / 16
  desc |= static_cast<uint64_t>((leading_bytes >> 4) & 0x3FFF) << 16;  // bits 16-29: leading byte offset / 16
  desc |= static_cast<uint64_t>((stride_bytes >> 4) & 0x3FFF) << 32;   // bits 32-45: stride byte offset / 16
  desc |= static_cast<uint64_t>(1) << 62;                          // bits 62-63: 128-byte swizzle
  return desc;
}

// A K-major tile (see above): SBO 1024, LBO unused (1 by convention).
__device__ __forceinline__ uint64_t make_smem_desc_k_major_sw128(const void* tile) {
  return make_smem_desc_sw128(tile, 16, 1024);
}

// An MN-major tile whose 64-column groups lie `group_bytes` apart (one TMA box each).
__device__ __forceinline__ uint64_t make_smem_desc_mn_major_sw128(const void* tile, uint32_t group_bytes) {
  return make_smem_desc_sw128(tile, group_bytes, 1024);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Keeps the compiler from moving accumulator reads or writes across the asynchronous wgmma.
template <int N>
__device__ __forceinline__ void wgmma_hold(float (&acc)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// The same for a register-A operand (16-bit P fragments) that an issued wgmma reads asynchronously:
// held after the wait, its registers stay untouched (not reused for other values) until then.
template <int N>
__device__ __forceinline__ void wgmma_hold(uint32_t (&a)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int r = 0; r < 4; ++r) asm volatile("" : "+r"(a[i][r])::"memory");
}

// The asm of one wgmma shape, one macro per N (its N/2 accumulator registers): SHAPE_TYPES is
// the rest of the instruction's name ("k16.f32.bf16.bf16", "k32.f32.e4m3.e5m2"), TAIL the operands
// after the scale immediates (", %R+3, %R+4" for the 16-bit transpose immediates, or nothing), and
// the variadic arguments their input constraints.
#define OPTIMIZED_WGMMA_M64N64(SHAPE_TYPES, TAIL, ...)                                         \
  asm volatile(                                                                                  \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                              \
      "wgmma.mma_async.sync.aligned.m64n64" SHAPE_TYPES " "                                      \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "  \
      "%32, %33, p, 1, 1" TAIL ";\n}\n"                                                   \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),                                   \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),                                   \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),                                   \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                                                      \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d) __VA_OPT__(, ) __VA_ARGS__)
#define OPTIMIZED_WGMMA_M64N128(SHAPE_TYPES, TAIL, ...)                                         \
  asm volatile(                                                                                  \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                              \
      "wgmma.mma_async.sync.aligned.m64n128" SHAPE_TYPES " "                                      \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "  \
      "%64, %65, p, 1, 1" TAIL ";\n}\n"                                                   \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),                                   \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),                                   \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),                                   \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),                                   \
      "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),                                   \
      "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),                                   \
      "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),                                   \
      "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])                                                      \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d) __VA_OPT__(, ) __VA_ARGS__)
#define OPTIMIZED_WGMMA_M64N256(SHAPE_TYPES, TAIL, ...)                                         \
  asm volatile(                                                                                  \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                              \
      "wgmma.mma_async.sync.aligned.m64n256" SHAPE_TYPES " "                                      \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "  \
      "%128, %129, p, 1, 1" TAIL ";\n}\n"                                                   \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),                                   \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),                                   \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),                                   \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),                                   \
      "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),                                   \
      "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),                                   \
      "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),                                   \
      "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),                                   \
      "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),                                   \
      "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),                                   \
      "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),                                   \
      "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),                                   \
      "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),                                   \
      "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),                                   \
      "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),                                   \
      "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])                                                      \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d) __VA_OPT__(, ) __VA_ARGS__)

// The operand types, as tags (the instruction names them; the registers are the same).
struct Bf16Tag {};
struct F16Tag {};

// acc (N/2 floats per thread) = A (64x16, desc_a) * B (16xN, desc_b) + (scale_d ? acc : 0).
// kTransA / kTransB: 0 K-major, 1 MN-major (16-bit operands only). N = 64, 128, 256, bf16 or fp16.
template <int kTransA, int kTransB, typename Tag>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int scale_d, Tag) {
  if constexpr (std::is_same_v<Tag, F16Tag>)
    OPTIMIZED_WGMMA_M64N64("k16.f32.f16.f16", ", %35, %36", "n"(kTransA), "n"(kTransB));
  else
    OPTIMIZED_WGMMA_M64N64("k16.f32.bf16.bf16", ", %35, %36", "n"(kTransA), "n"(kTransB));
}
template <int kTransA, int kTransB, typename Tag>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d, Tag) {
  if constexpr (std::is_same_v<Tag, F16Tag>)
    OPTIMIZED_WGMMA_M64N128("k16.f32.f16.f16", ", %67, %68", "n"(kTransA), "n"(kTransB));
  else
    OPTIMIZED_WGMMA_M64N128("k16.f32.bf16.bf16", ", %67, %68", "n"(kTransA), "n"(kTransB));
}
template <int kTransA, int kTransB, typename Tag>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int scale_d, Tag) {
  if constexpr (std::is_same_v<Tag, F16Tag>)
    OPTIMIZED_WGMMA_M64N256("k16.f32.f16.f16", ", %131, %132", "n"(kTransA), "n"(kTransB));
  else
    OPTIMIZED_WGMMA_M64N256("k16.f32.bf16.bf16", ", %131, %132", "n"(kTransA), "n"(kTransB));
}

// fp8 (QGMMA): acc (N/2 floats per thread) = A (64x32, desc_a) * B (32xN, desc_b) + (scale_d ? acc : 0),
// e4m3 or e5m2 each. 8-bit operands are K-major only (no transpose immediates): a K-major tile of
// 128-byte rows holds 128 of them per row, and a k-step of 32 moves the start 32 bytes along the
// swizzled row, as for 16-bit operands. The tensor cores add the products with reduced internal
// precision (about 14 bits of mantissa); callers promote partial sums into fp32 registers along K.
struct E4m3Tag {};
struct E5m2Tag {};

template <typename TagA, typename TagB>
__device__ __forceinline__ void wgmma_m64n128k32(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d, TagA,
                                                 TagB) {
  constexpr bool a4 = std::is_same_v<TagA, E4m3Tag>, b4 = std::is_same_v<TagB, E4m3Tag>;
  if constexpr (a4 && b4)
    OPTIMIZED_WGMMA_M64N128("k32.f32.e4m3.e4m3", "");
  else if constexpr (a4)
    OPTIMIZED_WGMMA_M64N128("k32.f32.e4m3.e5m2", "");
  else if constexpr (b4)
    OPTIMIZED_WGMMA_M64N128("k32.f32.e5m2.e4m3", "");
  else
    OPTIMIZED_WGMMA_M64N128("k32.f32.e5m2.e5m2", "");
}

#define OPTIMIZED_WGMMA_RS_M64N64(SHAPE_TYPES)                                              \
  asm volatile(                                                                                  \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                              \
      "wgmma.mma_async.sync.aligned.m64n64" SHAPE_TYPES " "                                      \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "  \
      "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"                               \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),                                   \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),                                   \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),                                   \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                                                      \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB))
#define OPTIMIZED_WGMMA_RS_M64N128(SHAPE_TYPES)                                              \
  asm volatile(                                                                                  \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                              \
      "wgmma.mma_async.sync.aligned.m64n128" SHAPE_TYPES " "                                      \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "  \
      "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"                               \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),                                   \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),                                   \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),                                   \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),                                   \
      "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),                                   \
      "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),                                   \
      "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),                                   \
      "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])                                                      \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB))

// The same with A from registers ("RS": the attention rungs' P V, where P is the softmax of a
// tile just computed in registers and never goes through shared memory). a holds the warp's
// 16x16 slice of A exactly as an mma.sync m16n8k16 A fragment: warp w of the group owns rows
// 16w..16w+15; a[0] = (row g, cols 2t, 2t+1), a[1] = (row g + 8, same), a[2] = (row g, cols
// 2t + 8, 2t + 9), a[3] = (row g + 8, same), with g = lane / 4, t = lane % 4, two 16-bit
// elements per register (the lower column in the low half). That is the accumulator layout of
// the previous wgmma with its columns 16k..16k+15 taken as k-step k: a[0] packs d[8k], d[8k + 1];
// a[1] d[8k + 2], d[8k + 3]; a[2] d[8k + 4], d[8k + 5]; a[3] d[8k + 6], d[8k + 7]. There is no A
// transpose immediate (a register A is always K-major); kTransB as above.
template <int kTransB, typename Tag>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b,
                                                   int scale_d, Tag) {
  if constexpr (std::is_same_v<Tag, F16Tag>)
    OPTIMIZED_WGMMA_RS_M64N64("k16.f32.f16.f16");
  else
    OPTIMIZED_WGMMA_RS_M64N64("k16.f32.bf16.bf16");
}
template <int kTransB, typename Tag>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b,
                                                    int scale_d, Tag) {
  if constexpr (std::is_same_v<Tag, F16Tag>)
    OPTIMIZED_WGMMA_RS_M64N128("k16.f32.f16.f16");
  else
    OPTIMIZED_WGMMA_RS_M64N128("k16.f32.bf16.bf16");
}

#undef OPTIMIZED_WGMMA_M64N64
#undef OPTIMIZED_WGMMA_RS_M64N64
#undef OPTIMIZED_WGMMA_RS_M64N128
#undef OPTIMIZED_WGMMA_M64N128
#undef OPTIMIZED_WGMMA_M64N256

// Moves registers between the warpgroups of a warp-specialized kernel: the producer gives some
// back, the consumers take them (counts multiples of 8, 24 to 256).
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

}  // namespace optimized::kernels::ptx
