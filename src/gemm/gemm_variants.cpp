// What the GEMM variant table generates: names, parsing, the list, dtype support and the refusals'
// messages (include/optimized/gemm.h).
#include "gemm/gemm_variants.h"

#include <string>

#include "gemm/gemm_config.h"

namespace optimized {

namespace {
constexpr auto kVariantEnums = variant_enums(kGemmVariants);
}  // namespace

const GemmVariantInfo& gemm_variant_info(GemmVariant variant) { return variant_row(kGemmVariants, variant); }

std::string_view gemm_variant_name(GemmVariant variant) { return variant_name(kGemmVariants, variant); }

GemmVariant parse_gemm_variant(std::string_view name) {
  return parse_variant(kGemmVariants, name, GemmVariant::kAuto);
}

std::span<const GemmVariant> all_gemm_variants() { return kVariantEnums; }

bool gemm_variant_is_cuda(GemmVariant variant) { return variant_is_cuda(kGemmVariants, variant); }

std::string gemm_variant_rejects_dtype(GemmVariant variant, DType dtype) {
  return variant_or_auto_rejects_dtype(kGemmVariants, variant, dtype, "matmul");
}

bool gemm_variant_supports_dtype(GemmVariant variant, DType dtype) {
  return gemm_variant_rejects_dtype(variant, dtype).empty();
}

int gemm_variant_min_compute_capability(GemmVariant variant) {
  return variant_min_compute_capability(kGemmVariants, variant);
}

}  // namespace optimized
