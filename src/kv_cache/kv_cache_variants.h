// The KV-cache family's variants: one constexpr table, the only place a rung's name, backend,
// dtypes (of q / k / v / out; an fp8 e4m3 cache is a property of the cache, checked in
// kv_cache.cpp) and backends are written. kv_cache_variants.cpp generates the public name / parse /
// list / dtype functions from it, kv_cache.cpp dispatches through it. Only the cpu rung exists yet.
#pragma once

#include <array>
#include <cstddef>

#include "core/variant_table.h"
#include "kv_cache/cpu/kv_cache_cpu.h"
#include "kv_cache/kv_cache_params.h"
#include "optimized/kv_cache.h"

namespace optimized {

// The family has two ops: a CPU row carries both.
struct KvCacheCpuFns {
  CpuBackendFn<KvAppendParams> append = nullptr;
  CpuBackendFn<KvDecodeParams> decode = nullptr;
};

using KvCacheVariantInfo =
    VariantInfo<KvCacheVariant, KvCacheCpuFns, LauncherFn<KvDecodeParams>, WorkspaceQueryFn<KvDecodeParams>,
                std::nullptr_t>;

inline constexpr std::array<KvCacheVariantInfo, 1> kKvCacheVariants = {{
    {KvCacheVariant::kCpu, "cpu", Backend::kCpu, {DType::kF32, DType::kF16, DType::kBF16, DType::kF64}, 0, "",
     KvCacheCpuFns{&cpu_kv_append, &cpu_kv_decode}, nullptr, nullptr, nullptr},
}};

const KvCacheVariantInfo& kv_cache_variant_info(KvCacheVariant variant);

}  // namespace optimized
