// The KV-cache family's variants: one constexpr table, the only place a rung's name, backend,
// dtypes (of q / k / v / out; an fp8 e4m3 cache is a property of the cache, checked in
// kv_cache.cpp) and backends are written. kv_cache_variants.cpp generates the public name / parse /
// list / dtype functions from it, kv_cache.cpp dispatches through it. The CUDA rungs' launchers are decode launchers; append_kv on CUDA runs the one
// append kernel (cuda::kv_cache_append) whichever CUDA variant is named.
#pragma once

#include <array>
#include <cstddef>

#include "core/variant_table.h"
#include "kv_cache/cpu/kv_cache_cpu.h"
#include "kv_cache/kv_cache_params.h"
#include "optimized/kv_cache.h"

#if OPTIMIZED_WITH_CUDA
#include "kv_cache/launchers.h"
#endif

namespace optimized {

// The family has two ops: a CPU row carries both.
struct KvCacheCpuFns {
  CpuBackendFn<KvAppendParams> append = nullptr;
  CpuBackendFn<KvDecodeParams> decode = nullptr;
};

using KvCacheVariantInfo =
    VariantInfo<KvCacheVariant, KvCacheCpuFns, LauncherFn<KvDecodeParams>, WorkspaceQueryFn<KvDecodeParams>,
                std::nullptr_t>;

namespace kv_cache_table {
constexpr DTypeSet kFloat = {DType::kF32, DType::kF16, DType::kBF16};
}  // namespace kv_cache_table

// In ladder order. The CUDA rungs use shared memory, warp shuffles, the bf16 and fp8 e4m3
// conversions (8.0 for bf16; fp8 is converted in software before 8.9); paged_mma also cp.async,
// ldmatrix and mma.sync (8.0).
inline constexpr std::array<KvCacheVariantInfo, 5> kKvCacheVariants = {{
    {KvCacheVariant::kCpu, "cpu", Backend::kCpu, {DType::kF32, DType::kF16, DType::kBF16, DType::kF64}, 0, "",
     KvCacheCpuFns{&cpu_kv_append, &cpu_kv_decode}, nullptr, nullptr, nullptr},
    {KvCacheVariant::kContiguousNaive, "contiguous_naive", Backend::kCuda, kv_cache_table::kFloat, 80, "",
     KvCacheCpuFns{}, OPTIMIZED_CUDA_FN(cuda::kv_cache_contiguous_naive), nullptr, nullptr},
    {KvCacheVariant::kPaged, "paged", Backend::kCuda, kv_cache_table::kFloat, 80, "", KvCacheCpuFns{},
     OPTIMIZED_CUDA_FN(cuda::kv_cache_paged), nullptr, nullptr},
    {KvCacheVariant::kPagedSplit, "paged_split", Backend::kCuda, kv_cache_table::kFloat, 80, "", KvCacheCpuFns{},
     OPTIMIZED_CUDA_FN(cuda::kv_cache_paged_split), OPTIMIZED_CUDA_FN(cuda::kv_cache_paged_split_workspace), nullptr},
    {KvCacheVariant::kPagedMma, "paged_mma", Backend::kCuda, {DType::kF16, DType::kBF16}, 80, "", KvCacheCpuFns{},
     OPTIMIZED_CUDA_FN(cuda::kv_cache_paged_mma), OPTIMIZED_CUDA_FN(cuda::kv_cache_paged_mma_workspace), nullptr},
}};

const KvCacheVariantInfo& kv_cache_variant_info(KvCacheVariant variant);

}  // namespace optimized
