// What the attention variant table generates (include/optimized/attention.h): names, parsing, the
// list, dtype support and the refusals' messages, and the head dims the CUDA rungs are built for.
#include "attention/attention_variants.h"

#include <array>
#include <string>

namespace optimized {

namespace {
constexpr auto kVariantEnums = variant_enums(kAttentionVariants);
constexpr std::array<int, 4> kHeadDims = {64, 96, 128, 256};
}  // namespace

const AttentionVariantInfo& attention_variant_info(AttentionVariant variant) {
  return variant_row(kAttentionVariants, variant);
}

std::string_view attention_variant_name(AttentionVariant variant) { return variant_name(kAttentionVariants, variant); }

AttentionVariant parse_attention_variant(std::string_view name) {
  return parse_variant(kAttentionVariants, name, AttentionVariant::kAuto);
}

std::span<const AttentionVariant> all_attention_variants() { return kVariantEnums; }

bool attention_variant_is_cuda(AttentionVariant variant) { return variant_is_cuda(kAttentionVariants, variant); }

std::string attention_variant_rejects_dtype(AttentionVariant variant, DType dtype) {
  return variant_or_auto_rejects_dtype(kAttentionVariants, variant, dtype, "attention");
}

bool attention_variant_supports_dtype(AttentionVariant variant, DType dtype) {
  return attention_variant_rejects_dtype(variant, dtype).empty();
}

int attention_variant_min_compute_capability(AttentionVariant variant) {
  return variant_min_compute_capability(kAttentionVariants, variant);
}

std::span<const int> attention_head_dims() { return kHeadDims; }

}  // namespace optimized
