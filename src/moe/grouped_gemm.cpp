// Public entry of the grouped GEMM (include/optimized/moe.h): validates the operands (messages name
// the argument), builds GroupedGemmParams, picks the variant from the table (grouped_variants.h) and
// runs the CPU backend or the CUDA launcher on the operands' device.
#include <string>

#include "core/arg_checks.h"
#include "moe/grouped_variants.h"
#include "moe/moe_params.h"
#include "optimized/moe.h"

#if OPTIMIZED_WITH_CUDA
#include "core/cuda_launch.h"
#endif

namespace optimized {

namespace {

using arg::invalid;
using arg::present;
using arg::shape_string;
using arg::unsupported;

constexpr auto kVariantEnums = variant_enums(kGroupedGemmVariants);
std::string dname(DType d) { return std::string(dtype_name(d)); }
bool is_float(DType d) { return d == DType::kF32 || d == DType::kF16 || d == DType::kBF16; }

// A (rows, cols) matrix with unit stride along cols: its row stride.
int64_t row_stride(const TensorView& t, const char* name, int64_t rows, int64_t cols, const std::string& what) {
  if (t.rank != 2 || t.shape[0] != rows || t.shape[1] != cols)
    invalid(std::string(name) + ": expected shape " + what + "; given " + (t.rank ? shape_string(t) : "absent"));
  if (cols > 1 && rows > 0 && t.strides[1] != 1)
    invalid(std::string(name) + ": expected unit stride in the last dimension; given " + t.describe());
  if (rows > 1 && t.strides[0] < cols)
    invalid(std::string(name) + ": expected rows at least " + std::to_string(cols) + " elements apart; given " + t.describe());
  return rows > 1 ? t.strides[0] : cols;
}

void check_offs(arg::OperandSet& ops, const TensorView& offs, int64_t groups) {
  ops.add(offs, "offs", false);
  if (offs.dtype != DType::kI32) invalid("offs: expected dtype int32; given " + dname(offs.dtype));
  if (offs.rank != 1 || offs.shape[0] != groups || !offs.is_contiguous())
    invalid("offs: expected a contiguous vector of E = " + std::to_string(groups) + " (the groups); given " +
            (offs.rank ? offs.describe() : std::string("absent")));
}

GroupedGemmVariant resolve(GroupedGemmVariant v, DType dtype, const Device& device) {
  if (v == GroupedGemmVariant::kAuto) v = device.is_cuda() ? GroupedGemmVariant::kCudaNaive : GroupedGemmVariant::kCpu;
  if (!find_variant(kGroupedGemmVariants, v))
    invalid("variant: expected one of " + variant_choices(kGroupedGemmVariants) + "; given value " +
            std::to_string(static_cast<unsigned>(v)));
  const GroupedGemmVariantInfo& row = variant_row(kGroupedGemmVariants, v);
  if (std::string why = variant_rejects_dtype(kGroupedGemmVariants, row, dtype, "grouped_mm"); !why.empty())
    unsupported("variant: " + why);
  if (std::string why = variant_rejects_device(row, device); !why.empty()) invalid(why);
  return v;
}

void run(GroupedGemmVariant v, const GroupedGemmParams& p, const Device& device, const ExecutionContext& ctx,
         const char* what) {
  const GroupedGemmVariantInfo& row = variant_row(kGroupedGemmVariants, v);
  if (row.backend == Backend::kCpu) {
    row.cpu(p, ctx.cpu_threads);
    return;
  }
#if OPTIMIZED_WITH_CUDA
  static const std::string no_cuda = cuda_unavailable_reason();
  if (!no_cuda.empty()) unsupported(std::string("x: CUDA tensors given but ") + no_cuda);
  launch_on_cuda(row, p, device.index, ctx, std::string(what) + " (" + std::string(row.name) + ")");
#else
  (void)device, (void)ctx, (void)what;
  unsupported("x: CUDA tensors given but this build is CPU-only (built without CUDA)");
#endif
}

}  // namespace

std::string_view grouped_gemm_variant_name(GroupedGemmVariant variant) {
  return variant_name(kGroupedGemmVariants, variant);
}
GroupedGemmVariant parse_grouped_gemm_variant(std::string_view name) {
  return parse_variant(kGroupedGemmVariants, name, GroupedGemmVariant::kAuto);
}
std::span<const GroupedGemmVariant> all_grouped_gemm_variants() { return kVariantEnums; }
std::string grouped_gemm_variant_rejects_dtype(GroupedGemmVariant variant, DType dtype) {
  return variant_or_auto_rejects_dtype(kGroupedGemmVariants, variant, dtype, "grouped_mm");
}

void grouped_mm(const TensorView& x, const TensorView& w, const TensorView& offs, const TensorView& out,
                GroupedGemmVariant variant, const ExecutionContext& ctx) {
  arg::OperandSet ops;
  if (x.rank != 2) invalid("x: expected rank 2 (rows M, K); given " + (x.rank ? shape_string(x) : std::string("absent")));
  if (w.rank != 3)
    invalid("w: expected rank 3 (groups E, K, N); given " + (w.rank ? shape_string(w) : std::string("absent")));
  ops.add(x, "x", false);
  ops.add(w, "w", false);
  const int64_t M = x.shape[0], K = x.shape[1], E = w.shape[0], N = w.shape[2];
  if (!is_float(x.dtype)) unsupported("x: expected dtype fp32, fp16 or bf16; given " + dname(x.dtype));
  if (w.dtype != x.dtype) invalid("w: expected dtype " + dname(x.dtype) + " (x's); given " + dname(w.dtype));
  if (w.shape[1] != K) invalid("w: expected shape (E, " + std::to_string(K) + ", N) (K = x's columns); given " + shape_string(w));
  if (E < 1 || K < 1 || N < 1) invalid("w: expected E, K, N >= 1; given " + shape_string(w) + " with x " + shape_string(x));
  check_offs(ops, offs, E);
  ops.add(out, "out", true);
  if (out.dtype != x.dtype) invalid("out: expected dtype " + dname(x.dtype) + " (x's); given " + dname(out.dtype));
  GroupedGemmParams p;
  p.m = M, p.n = N, p.k = K, p.groups = E, p.dtype = x.dtype, p.c_dtype = out.dtype;
  p.a = x.data, p.a_rs = row_stride(x, "x", M, K, "(M, K)");
  p.b = w.data, p.b_gs = w.strides[0], p.b_rs = w.strides[1], p.b_cs = w.strides[2];
  p.offs = static_cast<const int32_t*>(offs.data);
  p.c = out.data;
  p.c_rs = row_stride(out, "out", M, N, "(M, N) = (" + std::to_string(M) + ", " + std::to_string(N) + ")");
  ops.check_overlaps();
  const Device device = ops.device();
  const GroupedGemmVariant v = resolve(variant, x.dtype, device);
  if (M == 0) return;
  run(v, p, device, ctx, "grouped_mm");
}

void grouped_mm_weight_grad(const TensorView& x, const TensorView& dout, const TensorView& offs, const TensorView& dw,
                            bool accumulate, GroupedGemmVariant variant, const ExecutionContext& ctx) {
  arg::OperandSet ops;
  if (x.rank != 2) invalid("x: expected rank 2 (rows M, K); given " + (x.rank ? shape_string(x) : std::string("absent")));
  if (dw.rank != 3)
    invalid("dw: expected rank 3 (groups E, K, N); given " + (dw.rank ? shape_string(dw) : std::string("absent")));
  ops.add(x, "x", false);
  const int64_t M = x.shape[0], K = x.shape[1], E = dw.shape[0], N = dw.shape[2];
  if (!is_float(x.dtype)) unsupported("x: expected dtype fp32, fp16 or bf16; given " + dname(x.dtype));
  ops.add(dout, "dout", false);
  if (dout.dtype != x.dtype) invalid("dout: expected dtype " + dname(x.dtype) + " (x's); given " + dname(dout.dtype));
  if (dw.shape[1] != K || E < 1 || K < 1 || N < 1)
    invalid("dw: expected shape (E, " + std::to_string(K) + ", N) with E, N >= 1; given " + shape_string(dw));
  check_offs(ops, offs, E);
  ops.add(dw, "dw", true);
  if (dw.dtype != x.dtype && dw.dtype != DType::kF32)
    invalid("dw: expected dtype " + dname(x.dtype) + " or fp32; given " + dname(dw.dtype));
  if (N > 1 && dw.strides[2] != 1) invalid("dw: expected unit stride in the last dimension; given " + dw.describe());
  GroupedGemmParams p;
  p.weight_grad = true, p.accumulate = accumulate;
  p.m = M, p.n = N, p.k = K, p.groups = E, p.dtype = x.dtype, p.c_dtype = dw.dtype;
  p.a = x.data, p.a_rs = row_stride(x, "x", M, K, "(M, K)");
  p.b = dout.data;
  p.b_rs = row_stride(dout, "dout", M, N, "(M, N) = (" + std::to_string(M) + ", " + std::to_string(N) + ")");
  p.offs = static_cast<const int32_t*>(offs.data);
  p.c = dw.data, p.c_gs = dw.strides[0], p.c_rs = dw.strides[1];
  ops.check_overlaps();
  const Device device = ops.device();
  const GroupedGemmVariant v = resolve(variant, x.dtype, device);
  run(v, p, device, ctx, "grouped_mm_weight_grad");
}

}  // namespace optimized
