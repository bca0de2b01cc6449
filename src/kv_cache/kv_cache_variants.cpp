// What the KV-cache variant table generates (include/optimized/kv_cache.h): names, parsing, the
// list, dtype support and the refusals' messages.
#include "kv_cache/kv_cache_variants.h"

#include <string>

namespace optimized {

namespace {
constexpr auto kVariantEnums = variant_enums(kKvCacheVariants);
}  // namespace

const KvCacheVariantInfo& kv_cache_variant_info(KvCacheVariant variant) { return variant_row(kKvCacheVariants, variant); }

std::string_view kv_cache_variant_name(KvCacheVariant variant) { return variant_name(kKvCacheVariants, variant); }

KvCacheVariant parse_kv_cache_variant(std::string_view name) {
  return parse_variant(kKvCacheVariants, name, KvCacheVariant::kAuto);
}

std::span<const KvCacheVariant> all_kv_cache_variants() { return kVariantEnums; }

bool kv_cache_variant_is_cuda(KvCacheVariant variant) { return variant_is_cuda(kKvCacheVariants, variant); }

std::string kv_cache_variant_rejects_dtype(KvCacheVariant variant, DType dtype) {
  return variant_or_auto_rejects_dtype(kKvCacheVariants, variant, dtype, "kv_cache");
}

}  // namespace optimized
