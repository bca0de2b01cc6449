// What the linear variant table generates (include/optimized/linear.h): names, parsing, the list,
// dtype support and the refusals' messages.
#include "linear/linear_variants.h"

#include <string>

namespace optimized {

namespace {
constexpr auto kVariantEnums = variant_enums(kLinearVariants);
}  // namespace

const LinearVariantInfo& linear_variant_info(LinearVariant variant) { return variant_row(kLinearVariants, variant); }

std::string_view linear_variant_name(LinearVariant variant) { return variant_name(kLinearVariants, variant); }

LinearVariant parse_linear_variant(std::string_view name) {
  return parse_variant(kLinearVariants, name, LinearVariant::kAuto);
}

std::span<const LinearVariant> all_linear_variants() { return kVariantEnums; }

bool linear_variant_is_cuda(LinearVariant variant) { return variant_is_cuda(kLinearVariants, variant); }

std::string linear_variant_rejects_dtype(LinearVariant variant, DType dtype) {
  return variant_or_auto_rejects_dtype(kLinearVariants, variant, dtype, "linear");
}

}  // namespace optimized
