// What the fused tables generate (include/optimized/fused.h): variant and op names, parsing, the
// lists, dtype support, and the choice of kAuto with the registers design's width limit, both from
// the family's config (fused_config.h).
#include "fused/fused_variants.h"

#include <string>

#include "fused/fused_config.h"

namespace optimized {

namespace {
constexpr auto kVariantEnums = variant_enums(kFusedVariants);
constexpr auto kOpEnums = [] {
  std::array<FusedOp, kFusedOps.size()> out{};
  for (size_t i = 0; i < kFusedOps.size(); ++i) out[i] = kFusedOps[i].op;
  return out;
}();

[[noreturn]] void invalid(const std::string& message) { throw Error(Status::kInvalidArgument, message); }
}  // namespace

const FusedVariantInfo& fused_variant_info(FusedVariant variant) { return variant_row(kFusedVariants, variant); }

// ---- variants --------------------------------------------------------------------------------

std::string_view fused_variant_name(FusedVariant variant) { return variant_name(kFusedVariants, variant); }

FusedVariant parse_fused_variant(std::string_view name) {
  return parse_variant(kFusedVariants, name, FusedVariant::kAuto);
}

std::span<const FusedVariant> all_fused_variants() { return kVariantEnums; }

bool fused_variant_is_cuda(FusedVariant variant) { return variant_is_cuda(kFusedVariants, variant); }

std::string fused_variant_rejects_dtype(FusedVariant variant, DType dtype) {
  return variant_or_auto_rejects_dtype(kFusedVariants, variant, dtype, "the fused family");
}

bool fused_variant_supports_dtype(FusedVariant variant, DType dtype) {
  return fused_variant_rejects_dtype(variant, dtype).empty();
}

int fused_variant_min_compute_capability(FusedVariant variant) {
  return variant_min_compute_capability(kFusedVariants, variant);
}

// ---- ops -------------------------------------------------------------------------------------

std::string_view fused_op_name(FusedOp op) {
  for (const FusedOpInfo& row : kFusedOps)
    if (row.op == op) return row.name;
  return "?";
}

FusedOp parse_fused_op(std::string_view name) {
  std::string choices;
  for (const FusedOpInfo& row : kFusedOps) {
    if (row.name == name) return row.op;
    choices += (choices.empty() ? "" : ", ") + std::string(row.name);
  }
  invalid("op: expected one of " + choices + "; given '" + std::string(name) + "'");
}

std::span<const FusedOp> all_fused_ops() { return kOpEnums; }

// ---- the registers design's limit and kAuto (fused_config.h) -------------------------------

// The short-row kernel keeps up to registers_{forward,backward}_vectors 16-byte vectors of the row
// per thread, on up to registers_max_threads_per_row threads per block and a cluster of up to
// registers_max_cluster blocks per row (src/fused/cuda/row_registers.cuh).
int64_t fused_registers_max_width(FusedOp op, DType dtype, bool backward, bool aligned_rows) {
  bool reduces = false;
  for (const FusedOpInfo& row : kFusedOps)
    if (row.op == op) reduces = row.reduces_rows;
  if (!reduces || !fused_variant_supports_dtype(FusedVariant::kCudaFusedRegisters, dtype)) return 0;
  const int64_t per_vector = aligned_rows ? 16 / static_cast<int64_t>(dtype_size(dtype)) : 1;
  const int64_t vectors_per_thread =
      backward ? kFusedConfig.registers_backward_vectors : kFusedConfig.registers_forward_vectors;
  return int64_t{kFusedConfig.registers_max_threads_per_row} * kFusedConfig.registers_max_cluster *
         vectors_per_thread * per_vector;
}

// Which design kAuto runs: fused_config.h holds the thresholds and the measurements behind them.
FusedVariant resolve_fused_variant(FusedOp op, DType dtype, Device device, int64_t width, bool backward,
                                   bool aligned_rows) {
  if (device.type != DeviceType::kCpu && device.type != DeviceType::kCuda)
    invalid("device: expected cpu or cuda; given device type " + std::to_string(static_cast<int>(device.type)));
  if (device.is_cuda() && device.index < 0)
    invalid("device: expected a CUDA ordinal >= 0; given cuda:" + std::to_string(device.index));
  if (width < 0) invalid("width: expected a row length >= 0; given " + std::to_string(width));
  const DTypeSet all = table_dtypes(kFusedVariants);
  if (!all.has(dtype))
    throw Error(Status::kUnsupported, "dtype: expected " + all.names() + " (fp64 on the cpu variant); given " +
                                          std::string(dtype_name(dtype)));
  if (device.is_cuda() && !fused_variant_supports_dtype(FusedVariant::kCudaFusedStreaming, dtype))
    throw Error(Status::kUnsupported, "dtype: " + std::string(dtype_name(dtype)) + " runs on the " +
                                          variants_running(kFusedVariants, dtype) + " variant only; given " +
                                          std::string(dtype_name(dtype)) + " on " + device_name(device));
  if (!device.is_cuda()) return FusedVariant::kCpu;
  const FusedConfig& c = kFusedConfig;
  const int64_t max_width = fused_registers_max_width(op, dtype, backward, aligned_rows);
  if (max_width == 0) return FusedVariant::kCudaFusedRegisters;  // elementwise: one fused kernel
  if (width > max_width) return FusedVariant::kCudaFusedStreaming;
  const bool softmax = op == FusedOp::kSoftmax || op == FusedOp::kLogSoftmax;
  const int64_t e = dtype_size(dtype);
  if (!aligned_rows && width > c.auto_unaligned_registers_max_width.for_element_size(e))
    return FusedVariant::kCudaFusedStreaming;
  const FusedConfig::Width& from = softmax ? (backward ? c.auto_softmax_backward_streaming_from
                                                       : c.auto_softmax_forward_streaming_from)
                                           : c.auto_norm_forward_streaming_from;
  if ((softmax || !backward) && width >= from.for_element_size(e)) return FusedVariant::kCudaFusedStreaming;
  return FusedVariant::kCudaFusedRegisters;
}

}  // namespace optimized
