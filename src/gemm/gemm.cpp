// Public GEMM entry: validates the operands, builds GemmParams, and dispatches through the variant
// table (gemm_variants.h) to the CPU backend or a CUDA launcher.
#include <algorithm>
#include <array>
#include <cstring>
#include <optional>
#include <sstream>
#include <type_traits>
#include <utility>
#include <vector>

#include "gemm/cpu/cpu_gemm.h"
#include "gemm/gemm_config.h"
#include "gemm/gemm_operands.h"
#include "gemm/gemm_params.h"
#include "gemm/gemm_variants.h"
#include "optimized/gemm.h"

#if OPTIMIZED_WITH_CUDA
#include "core/cuda_launch.h"
#include "core/tensor_map.h"
#include "gemm/gemm_describe.h"
#endif

namespace optimized {

namespace {

using gemm_detail::as_matrix;
using gemm_detail::invalid;
using gemm_detail::Operand;
using gemm_detail::overlaps;
using gemm_detail::shape_string;

bool is_half(DType d) { return d == DType::kF16 || d == DType::kBF16; }

// C (or aux, residual) seen as a row-major matrix for an epilogue: as_matrix's view, except that a
// single contiguous column (which as_matrix reads as column-major for the operands' sake) is rows
// one element apart.
Operand as_row_major(const TensorView& t, const char* name) {
  Operand op = as_matrix(t, name);
  if (op.col_major && op.cols == 1) {
    op.col_major = false;
    op.ld = 1;
  }
  if (op.col_major)
    invalid(std::string(name) + ": expected a row-major view with an epilogue (unit stride in the last dimension); given strides of " +
            t.describe());
  return op;
}

// Fills p.epi from the epilogue's tensors, validated against C (already in p: M, N, batch, c_dtype).
void add_epilogue(GemmParams& p, const TensorView& a, const TensorView& b, const TensorView& c,
                  const GemmEpilogue& e) {
  const std::string c_dtype(dtype_name(p.c_dtype));
  const auto same_device = [&](const TensorView& t, const char* name) {
    if (!(t.device == c.device))
      invalid(std::string(name) + ": expected device " + device_name(c.device) + " (same as c); given " +
              device_name(t.device));
  };
  const auto c_like = [&](const TensorView& t, const char* name) {
    if (t.dtype != p.c_dtype)
      invalid(std::string(name) + ": expected dtype " + c_dtype + " (same as c); given " + std::string(dtype_name(t.dtype)));
    same_device(t, name);
    const Operand op = as_row_major(t, name);
    if (t.rank != c.rank || op.rows != p.m || op.cols != p.n || op.batch != p.batch)
      invalid(std::string(name) + ": expected c's shape " + shape_string(c) + "; given " + shape_string(t));
    return op;
  };
  const auto vector = [&](const TensorView& t, const char* name, DType dtype, int64_t length) {
    if (t.dtype != dtype)
      invalid(std::string(name) + ": expected dtype " + std::string(dtype_name(dtype)) + "; given " +
              std::string(dtype_name(t.dtype)));
    same_device(t, name);
    if (!t.data) invalid(std::string(name) + ": expected a non-null data pointer; given null");
    if (reinterpret_cast<uintptr_t>(t.data) % dtype_size(dtype) != 0)
      invalid(std::string(name) + ": expected data aligned to " + std::to_string(dtype_size(dtype)) +
              " bytes (the element size); given address " + std::to_string(reinterpret_cast<uintptr_t>(t.data)));
    if (t.rank != 1 || t.shape[0] != length || (length > 1 && t.strides[0] != 1))
      invalid(std::string(name) + ": expected a contiguous vector of " + std::to_string(length) + " elements; given " +
              t.describe());
  };
  if (e.activation_grad && (e.activation == Activation::kNone || !e.aux))
    invalid("activation_grad: expected an activation and aux (the forward's pre-activation) to take the gradient of; given " +
            std::string(e.activation == Activation::kNone ? "activation none" : "no aux"));
  if (e.bias) {
    vector(*e.bias, "bias", p.c_dtype, e.bias_along_m ? p.m : p.n);
    p.epi.bias = e.bias->data;
    p.epi.bias_along_m = e.bias_along_m;
  }
  p.epi.act = static_cast<int>(e.activation);
  p.epi.act_grad = e.activation_grad;
  if (e.aux) {
    const Operand op = c_like(*e.aux, "aux");
    p.epi.aux = e.aux->data;
    p.epi.ld_aux = op.ld;
    p.epi.batch_stride_aux = op.batch_stride;
  }
  if (e.residual) {
    const Operand op = c_like(*e.residual, "residual");
    p.epi.residual = e.residual->data;
    p.epi.ld_residual = op.ld;
    p.epi.batch_stride_residual = op.batch_stride;
  }
  if (e.column_sums) {
    const TensorView& t = *e.column_sums;
    if (t.dtype != DType::kF32)
      invalid("column_sums: expected dtype fp32; given " + std::string(dtype_name(t.dtype)));
    same_device(t, "column_sums");
    const bool rank3 = c.rank == 3;
    if (!t.data) invalid("column_sums: expected a non-null data pointer; given null");
    if (reinterpret_cast<uintptr_t>(t.data) % 4 != 0)
      invalid("column_sums: expected data aligned to 4 bytes (the element size); given address " +
              std::to_string(reinterpret_cast<uintptr_t>(t.data)));
    if (t.rank != (rank3 ? 2 : 1) || t.shape[t.rank - 1] != p.n || (rank3 && t.shape[0] != p.batch) || !t.is_contiguous())
      invalid("column_sums: expected a contiguous fp32 tensor of shape " +
              (rank3 ? "(" + std::to_string(p.batch) + ", " + std::to_string(p.n) + ")" : "(" + std::to_string(p.n) + ")") +
              " (c's batch and columns); given " + t.describe());
    p.epi.column_sums = static_cast<float*>(t.data);
  }
  // Outputs may not overlap anything else: c and column_sums always, aux when it is written.
  struct Named {
    const TensorView* t;
    const char* name;
    bool output;
  };
  const Named all[] = {{&c, "c", true},          {&a, "a", false},          {&b, "b", false},
                       {e.bias, "bias", false},  {e.aux, "aux", !e.activation_grad},
                       {e.residual, "residual", false}, {e.column_sums, "column_sums", true}};
  // Each pair once (c against a and b is make_params' check), the output named first.
  for (size_t i = 0; i < std::size(all); ++i)
    for (size_t j = std::max<size_t>(i + 1, 3); j < std::size(all); ++j) {
      const Named& x = all[i].output ? all[i] : all[j];
      const Named& y = all[i].output ? all[j] : all[i];
      if (!x.t || !y.t || !x.output) continue;
      if (overlaps(*x.t, x.name, *y.t, y.name))
        invalid(std::string(x.name) + ": expected an output that does not overlap " + y.name +
                "; given overlapping memory");
    }
}

GemmParams make_params(const TensorView& a, const TensorView& b, const TensorView& c, float alpha,
                       float beta, const GemmEpilogue* epilogue = nullptr) {
  const bool with_epilogue = epilogue && epilogue->any();
  const Operand A = as_matrix(a, "a"), B = as_matrix(b, "b");
  const Operand C = with_epilogue ? as_row_major(c, "c") : as_matrix(c, "c");
  if (b.dtype != a.dtype)
    invalid("b: expected dtype " + std::string(dtype_name(a.dtype)) + " (same as a); given " +
            std::string(dtype_name(b.dtype)));
  if (c.dtype != a.dtype && !(is_half(a.dtype) && c.dtype == DType::kF32))
    invalid("c: expected dtype " + std::string(dtype_name(a.dtype)) + " (same as a)" +
            (is_half(a.dtype) ? std::string(" or fp32") : std::string()) + "; given " + std::string(dtype_name(c.dtype)));
  if (a.dtype != DType::kF32 && a.dtype != DType::kF16 && a.dtype != DType::kBF16 && a.dtype != DType::kF64)
    throw Error(Status::kUnsupported,
                "a: expected dtype fp32, fp16, bf16 or fp64; given " + std::string(dtype_name(a.dtype)));
  for (const TensorView* t : {&b, &c})
    if (!(t->device == a.device))
      invalid(std::string(t == &b ? "b" : "c") + ": expected device " + device_name(a.device) +
              " (same as a); given " + device_name(t->device));
  if (A.cols != B.rows)
    invalid("b: expected " + std::to_string(A.cols) + " rows to match a's columns (K); given shape " +
            shape_string(b) + " with a " + shape_string(a));
  if (C.rows != A.rows || C.cols != B.cols)
    invalid("c: expected (" + std::to_string(A.rows) + ", " + std::to_string(B.cols) +
            ") rows x cols (M from a, N from b); given " + shape_string(c));
  for (const auto& [op, name] : {std::pair{A, "a"}, std::pair{B, "b"}})
    if (op.batch != 1 && op.batch != C.batch)
      invalid(std::string(name) + ": expected batch " + std::to_string(C.batch) + " (c's) or 1; given " +
              std::to_string(op.batch));
  const int64_t c_span = C.col_major ? (C.cols - 1) * C.ld + C.rows : (C.rows - 1) * C.ld + C.cols;
  if (C.batch > 1 && C.batch_stride < c_span)
    invalid("c: expected batch stride >= " + std::to_string(c_span) + " so that batches do not overlap; given " +
            std::to_string(C.batch_stride));
  const bool overlaps_a = overlaps(c, "c", a, "a"), overlaps_b = overlaps(c, "c", b, "b");
  if (overlaps_a || overlaps_b)
    invalid(std::string("c: expected an output that does not overlap ") + (overlaps_a ? "a" : "b") +
            "; given overlapping memory");
  GemmParams p;
  p.a = a.data;
  p.b = b.data;
  p.c = c.data;
  p.m = A.rows;
  p.n = B.cols;
  p.k = A.cols;
  p.batch = C.batch;
  p.lda = A.ld;
  p.ldb = B.ld;
  p.ldc = C.ld;
  p.trans_a = A.col_major;
  p.trans_b = B.col_major;
  p.batch_stride_a = A.batch == 1 ? 0 : A.batch_stride;
  p.batch_stride_b = B.batch == 1 ? 0 : B.batch_stride;
  p.batch_stride_c = C.batch_stride;
  if (C.col_major) {
    // A column-major C is the row-major C^T = B^T A^T: swap the operands and their layouts.
    std::swap(p.a, p.b);
    std::swap(p.m, p.n);
    std::swap(p.lda, p.ldb);
    std::swap(p.batch_stride_a, p.batch_stride_b);
    const bool ta = p.trans_a;
    p.trans_a = !p.trans_b;
    p.trans_b = !ta;
  }
  p.alpha = alpha;
  p.beta = beta;
  p.dtype = a.dtype;
  p.c_dtype = c.dtype;
  if (with_epilogue) add_epilogue(p, a, b, c, *epilogue);
  return p;
}

#if OPTIMIZED_WITH_CUDA
// Empty when the Hopper rungs can take p's operands (TMA describes A and B: 16-byte aligned bases,
// row and batch strides); otherwise why not, naming the argument. C is written from registers:
// any alignment.
std::string gemm_hopper_rejects(const GemmParams& p) {
  const int bytes = static_cast<int>(dtype_size(p.dtype));
  if (std::string why = tma_rejects(TmaMatrix{p.a, p.a_stored_rows(), p.a_stored_cols(), p.lda, p.batch, p.batch_stride_a, bytes}, "a");
      !why.empty())
    return why;
  return tma_rejects(TmaMatrix{p.b, p.b_stored_rows(), p.b_stored_cols(), p.ldb, p.batch, p.batch_stride_b, bytes}, "b");
}
#endif

// Whether kAuto may pick a Hopper rung for p on `device`: an sm_90a build, a compute capability
// 9.0 device, and operands TMA can describe, or a product large enough that wgmma_persistent's
// padded copies of them pay (gemm_hopper_staging_pays).
bool hopper_eligible([[maybe_unused]] const GemmParams& p, [[maybe_unused]] const Device& device) {
#if OPTIMIZED_WITH_CUDA && OPTIMIZED_WITH_SM90A
  if (!device.is_cuda() || (p.dtype != DType::kF16 && p.dtype != DType::kBF16)) return false;
  const DeviceFacts* facts = nullptr;
  if (device_facts(device.index, &facts) != cudaSuccess) return false;
  return facts->compute_capability == 90 &&
         (gemm_hopper_rejects(p).empty() ||
          gemm_hopper_staging_pays(p.m, p.n, p.k, p.batch, static_cast<int64_t>(dtype_size(p.dtype))));
#else
  return false;
#endif
}

// What kAuto runs for p (already validated) on its device.
GemmVariant auto_variant_for(const GemmParams& p, const Device& device) {
  const bool cuda = device.is_cuda();
  return gemm_auto_variant(p.dtype, cuda, cuda && hopper_eligible(p, device), p.m, p.needs_epilogue_rung());
}

// "cpu_naive, ..., wgmma_persistent": the rungs that fuse epilogues.
std::string epilogue_variants() {
  std::string s;
  for (const GemmVariantInfo& row : kGemmVariants)
    if (gemm_variant_fuses_epilogue(row.variant)) s += (s.empty() ? "" : ", ") + std::string(row.name);
  return s;
}

// The concrete variant for these (already validated) operands: kAuto resolved, then checked
// against the dtype, the epilogue and the device.
GemmVariant checked_variant(GemmVariant variant, const GemmParams& p, const Device& device) {
  if (variant == GemmVariant::kAuto) variant = auto_variant_for(p, device);
  const GemmVariantInfo& row = gemm_variant_info(variant);
  if (std::string why = variant_rejects_dtype(kGemmVariants, row, p.dtype, "matmul"); !why.empty())
    throw Error(Status::kUnsupported, "variant: " + why);
  if (p.needs_epilogue_rung() && !gemm_variant_fuses_epilogue(variant))
    throw Error(Status::kUnsupported,
                "variant: " + std::string(row.name) + " does not fuse epilogues (" +
                    (p.epi.any() ? "bias, activation, aux, residual, column sums" : "an fp32 c from " +
                                                                                       std::string(dtype_name(p.dtype)) + " operands") +
                    "); the variants that do: " + epilogue_variants());
  if (std::string why = variant_rejects_device(row, device); !why.empty()) invalid(why);
  return variant;
}

// Runs p (validated, variant checked) on its device.
void run_gemm(const GemmVariantInfo& row, const GemmParams& p, GemmVariant requested, const TensorView& c,
              const Device& device, const ExecutionContext& ctx) {
  if (row.backend == Backend::kCpu) {
    if (p.needs_epilogue_rung())
      cpu::gemm_with_epilogue(p, row.cpu, ctx.cpu_threads);
    else
      row.cpu(p, ctx.cpu_threads);
    return;
  }
#if OPTIMIZED_WITH_CUDA
  // Asked once per process (devices do not come and go), not on every call.
  static const std::string no_cuda = cuda_unavailable_reason();
  if (!no_cuda.empty()) throw Error(Status::kUnsupported, "a: CUDA tensors given but " + no_cuda);
  // Forced, a Hopper rung takes only what TMA describes; chosen by auto, wgmma_persistent stages
  // such operands through padded copies in its workspace.
  if (requested != GemmVariant::kAuto && row.arch == ArchRule::kArchSpecific)
    if (std::string why = gemm_hopper_rejects(p); !why.empty()) {
      // With a column-major C the params hold B^T as "a" and A^T as "b": name the user's operand.
      if (!p.epi.any() && as_matrix(c, "c").col_major && why.size() > 1 && why[1] == ':') why[0] = why[0] == 'a' ? 'b' : 'a';
      invalid(why + " (variant " + std::string(row.name) +
              " loads through TMA; auto copies such operands into aligned rows or runs mma_pipeline)");
    }
  launch_on_cuda(row, p, device.index, ctx, "matmul (" + std::string(row.name) + ")");
#else
  (void)requested, (void)c, (void)device;
  throw Error(Status::kUnsupported, "a: CUDA tensors given but this build is CPU-only (built without CUDA)");
#endif
}
}  // namespace

std::string_view activation_name(Activation activation) {
  switch (activation) {
    case Activation::kNone: return "none";
    case Activation::kRelu: return "relu";
    case Activation::kGeluErf: return "gelu";
    case Activation::kGeluTanh: return "gelu_tanh";
    case Activation::kSilu: return "silu";
  }
  return "?";
}

Activation parse_activation(std::string_view name) {
  for (Activation a : {Activation::kNone, Activation::kRelu, Activation::kGeluErf, Activation::kGeluTanh,
                       Activation::kSilu})
    if (activation_name(a) == name) return a;
  invalid("activation: expected one of none, relu, gelu, gelu_tanh, silu; given '" + std::string(name) + "'");
}

bool gemm_variant_supports_epilogue(GemmVariant variant) {
  return variant == GemmVariant::kAuto || gemm_variant_fuses_epilogue(variant);
}

GemmVariant resolve_gemm_variant(const TensorView& a, const TensorView& b, const TensorView& c) {
  return auto_variant_for(make_params(a, b, c, 1.0f, 0.0f), a.device);
}

GemmVariant resolve_gemm_variant(const TensorView& a, const TensorView& b, const TensorView& c,
                                 const GemmEpilogue& epilogue) {
  return auto_variant_for(make_params(a, b, c, 1.0f, 0.0f, &epilogue), a.device);
}

void matmul(const TensorView& a, const TensorView& b, const TensorView& c, float alpha, float beta,
            GemmVariant variant, const ExecutionContext& ctx) {
  const GemmParams p = make_params(a, b, c, alpha, beta);
  run_gemm(gemm_variant_info(checked_variant(variant, p, a.device)), p, variant, c, a.device, ctx);
}

void matmul(const TensorView& a, const TensorView& b, const TensorView& c, const GemmEpilogue& epilogue, float alpha,
            float beta, GemmVariant variant, const ExecutionContext& ctx) {
  const GemmParams p = make_params(a, b, c, alpha, beta, &epilogue);
  run_gemm(gemm_variant_info(checked_variant(variant, p, a.device)), p, variant, c, a.device, ctx);
}

size_t matmul_workspace_bytes(const TensorView& a, const TensorView& b, const TensorView& c,
                              const GemmEpilogue& epilogue, float beta, GemmVariant variant) {
  const GemmParams p = make_params(a, b, c, 1.0f, beta, &epilogue);
  const GemmVariantInfo& row = gemm_variant_info(checked_variant(variant, p, a.device));
  if (row.backend == Backend::kCpu) return 0;
#if OPTIMIZED_WITH_CUDA
  DeviceGuard guard(a.device.index);
  return launcher_workspace_bytes(row, p, "matmul_workspace_bytes (" + std::string(row.name) + ")");
#else
  return 0;
#endif
}

size_t matmul_workspace_bytes(int64_t m, int64_t n, int64_t k, int64_t batch, DType dtype, Device device,
                              GemmVariant variant) {
  for (const auto& [value, name] : {std::pair{m, "m"}, std::pair{n, "n"}, std::pair{k, "k"}, std::pair{batch, "batch"}})
    if (value < 1) invalid(std::string(name) + ": expected >= 1; given " + std::to_string(value));
  // auto: the largest need of what it may pick for these sizes (the Hopper rung wherever it can run).
  std::vector<GemmVariant> candidates = {variant};
  if (variant == GemmVariant::kAuto)
    candidates = {gemm_auto_variant(dtype, device.is_cuda(), false, m), gemm_auto_variant(dtype, device.is_cuda(), true, m)};
  size_t need = 0;
  for (GemmVariant v : candidates) {
    const GemmVariantInfo& row = gemm_variant_info(v);
    if (std::string why = variant_rejects_dtype(kGemmVariants, row, dtype, "matmul"); !why.empty())
      throw Error(Status::kUnsupported, "variant: " + why);
    if (row.backend == Backend::kCpu || !device.is_cuda()) continue;
#if OPTIMIZED_WITH_CUDA
    // The launcher's query on contiguous problems of these sizes in each layout (the need depends
    // on the sizes and the stored rows' alignment), on `device` (the split of K depends on its SM
    // count).
    static const bool usable = cuda_unavailable_reason().empty();
    std::optional<DeviceGuard> guard;  // without a usable device the query plans for an H100's 132 SMs
    if (usable) guard.emplace(device.index);
    for (int layout = 0; layout < 4; ++layout) {
      GemmParams p;
      p.m = m, p.n = n, p.k = k, p.batch = batch, p.dtype = dtype, p.c_dtype = dtype;
      p.trans_a = (layout & 1) != 0, p.trans_b = (layout & 2) != 0;
      p.lda = p.a_stored_cols(), p.ldb = p.b_stored_cols(), p.ldc = n;
      p.batch_stride_a = m * k, p.batch_stride_b = k * n, p.batch_stride_c = m * n;
      need = std::max(need, launcher_workspace_bytes(row, p, "matmul_workspace_bytes (" + std::string(row.name) + ")"));
    }
#endif
  }
  return need;
}

#if OPTIMIZED_WITH_CUDA
cuda::KernelResources describe_gemm_kernel(const TensorView& a, const TensorView& b, const TensorView& c,
                                           float alpha, float beta, GemmVariant variant,
                                           const GemmEpilogue* epilogue) {
  const GemmParams p = make_params(a, b, c, alpha, beta, epilogue);
  const GemmVariantInfo& row = gemm_variant_info(checked_variant(variant, p, a.device));
  cuda::KernelResources out;
  DeviceGuard guard(a.device.index);
  check_cuda(row.resources(p, &out), "describe_gemm_kernel (" + std::string(row.name) + ")");
  return out;
}
#endif

}  // namespace optimized
