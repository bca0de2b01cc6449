// Public GEMM entry: validates the operands, builds GemmParams, and dispatches by device and
// variant to the CPU backend or a CUDA launcher.
#include <algorithm>
#include <array>
#include <cstring>
#include <sstream>

#include "gemm/cpu/cpu_gemm.h"
#include "gemm/gemm_params.h"
#include "optimized/gemm.h"

#if OPTIMIZED_WITH_CUDA
#include "core/cuda_device_guard.h"
#include "gemm/cuda/gemm_launchers.h"
#include "gemm/gemm_describe.h"
#endif

namespace optimized {

namespace {

constexpr std::array kVariants = {
    GemmVariant::kCpuNaive,       GemmVariant::kCpuBlocked,        GemmVariant::kCpuPacked,
    GemmVariant::kCudaNaive,      GemmVariant::kCudaCoalesced,     GemmVariant::kCudaSmemTiled,
    GemmVariant::kCudaRegisterTiled, GemmVariant::kCudaWmma,       GemmVariant::kCudaMmaPipeline,
};

[[noreturn]] void invalid(const std::string& message) { throw Error(Status::kInvalidArgument, message); }

std::string shape_string(const TensorView& t) {
  std::ostringstream s;
  s << "(";
  for (int i = 0; i < t.rank; ++i) s << (i ? ", " : "") << t.shape[i];
  s << ")";
  return s.str();
}

// One operand seen as (batch, rows, cols) with a row stride and a batch stride.
struct Operand {
  int64_t batch, rows, cols, ld, batch_stride;
};

Operand as_matrix(const TensorView& t, const char* name) {
  if (!t.data) invalid(std::string(name) + ": expected a non-null data pointer; given null");
  if (t.rank != 2 && t.rank != 3)
    invalid(std::string(name) + ": expected rank 2 (rows, cols) or 3 (batch, rows, cols); given rank " +
            std::to_string(t.rank) + " " + shape_string(t));
  for (int i = 0; i < t.rank; ++i)
    if (t.shape[i] < 1)
      invalid(std::string(name) + ": expected every dimension >= 1; given shape " + shape_string(t));
  if (reinterpret_cast<uintptr_t>(t.data) % dtype_size(t.dtype) != 0)
    invalid(std::string(name) + ": expected data aligned to " + std::to_string(dtype_size(t.dtype)) +
            " bytes (the element size); given address " + std::to_string(reinterpret_cast<uintptr_t>(t.data)));
  const int r = t.rank;
  Operand op{r == 3 ? t.shape[0] : 1, t.shape[r - 2], t.shape[r - 1], t.strides[r - 2],
             r == 3 ? t.strides[0] : 0};
  if (t.strides[r - 1] != 1)
    invalid(std::string(name) + ": expected unit stride in the last dimension (row-major); given strides of " +
            t.describe());
  if (op.ld < op.cols && op.rows > 1)
    invalid(std::string(name) + ": expected row stride (leading dimension) >= " + std::to_string(op.cols) +
            "; given " + std::to_string(op.ld));
  if (op.rows == 1) op.ld = std::max(op.ld, op.cols);  // a single row: its stride is never used
  if (r == 3 && op.batch > 1 && op.batch_stride < 0)
    invalid(std::string(name) + ": expected a non-negative batch stride; given " + std::to_string(op.batch_stride));
  return op;
}

// Whether two views' byte ranges meet (the aliasing check). view_extent checks that the shape and
// strides of each describe an int64-addressable range (no overflow), naming the argument.
bool overlaps(const TensorView& x, const char* x_name, const TensorView& y, const char* y_name) {
  const ViewExtent ex = view_extent(x, x_name), ey = view_extent(y, y_name);
  return ex.begin < ey.end && ey.begin < ex.end;
}

GemmParams make_params(const TensorView& a, const TensorView& b, const TensorView& c, float alpha,
                       float beta) {
  const Operand A = as_matrix(a, "a"), B = as_matrix(b, "b"), C = as_matrix(c, "c");
  for (const TensorView* t : {&b, &c})
    if (t->dtype != a.dtype)
      invalid(std::string(t == &b ? "b" : "c") + ": expected dtype " + std::string(dtype_name(a.dtype)) +
              " (same as a); given " + std::string(dtype_name(t->dtype)));
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
  if (C.batch > 1 && C.batch_stride < (C.rows - 1) * C.ld + C.cols)
    invalid("c: expected batch stride >= " + std::to_string((C.rows - 1) * C.ld + C.cols) +
            " so that batches do not overlap; given " + std::to_string(C.batch_stride));
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
  p.batch_stride_a = A.batch == 1 ? 0 : A.batch_stride;
  p.batch_stride_b = B.batch == 1 ? 0 : B.batch_stride;
  p.batch_stride_c = C.batch_stride;
  p.alpha = alpha;
  p.beta = beta;
  p.dtype = a.dtype;
  return p;
}

#if OPTIMIZED_WITH_CUDA
// Each CUDA rung: its launcher and the report of the kernel that launcher would run.
struct CudaRung {
  cudaError_t (*launch)(const GemmParams&, cudaStream_t);
  cudaError_t (*resources)(const GemmParams&, cuda::KernelResources*);
};

CudaRung cuda_rung(GemmVariant variant) {
  switch (variant) {
    case GemmVariant::kCudaNaive: return {cuda::gemm_naive, cuda::gemm_naive_resources};
    case GemmVariant::kCudaCoalesced: return {cuda::gemm_coalesced, cuda::gemm_coalesced_resources};
    case GemmVariant::kCudaSmemTiled: return {cuda::gemm_smem_tiled, cuda::gemm_smem_tiled_resources};
    case GemmVariant::kCudaRegisterTiled:
      return {cuda::gemm_register_tiled, cuda::gemm_register_tiled_resources};
    case GemmVariant::kCudaWmma: return {cuda::gemm_wmma, cuda::gemm_wmma_resources};
    case GemmVariant::kCudaMmaPipeline: return {cuda::gemm_mma_pipeline, cuda::gemm_mma_pipeline_resources};
    default: break;
  }
  throw Error(Status::kInternal, "variant: " + std::string(gemm_variant_name(variant)) + " is not a CUDA rung");
}

#endif

}  // namespace

std::string_view gemm_variant_name(GemmVariant variant) {
  switch (variant) {
    case GemmVariant::kAuto: return "auto";
    case GemmVariant::kCpuNaive: return "cpu_naive";
    case GemmVariant::kCpuBlocked: return "cpu_blocked";
    case GemmVariant::kCpuPacked: return "cpu_packed";
    case GemmVariant::kCudaNaive: return "naive";
    case GemmVariant::kCudaCoalesced: return "coalesced";
    case GemmVariant::kCudaSmemTiled: return "smem_tiled";
    case GemmVariant::kCudaRegisterTiled: return "register_tiled";
    case GemmVariant::kCudaWmma: return "wmma";
    case GemmVariant::kCudaMmaPipeline: return "mma_pipeline";
  }
  return "unknown";
}

GemmVariant parse_gemm_variant(std::string_view name) {
  if (name == "auto") return GemmVariant::kAuto;
  std::string choices = "auto";
  for (GemmVariant v : kVariants) {
    if (gemm_variant_name(v) == name) return v;
    choices += ", " + std::string(gemm_variant_name(v));
  }
  throw Error(Status::kInvalidArgument,
              "variant: expected one of " + choices + "; given '" + std::string(name) + "'");
}

std::span<const GemmVariant> all_gemm_variants() { return kVariants; }

bool gemm_variant_is_cuda(GemmVariant variant) {
  return variant != GemmVariant::kAuto && variant != GemmVariant::kCpuNaive &&
         variant != GemmVariant::kCpuBlocked && variant != GemmVariant::kCpuPacked;
}

std::string gemm_variant_rejects_dtype(GemmVariant variant, DType dtype) {
  const bool float_type = dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16;
  if (dtype == DType::kF64) {
    if (variant == GemmVariant::kAuto || variant == GemmVariant::kCpuNaive || variant == GemmVariant::kCpuBlocked)
      return "";
    return std::string(gemm_variant_name(variant)) +
           " supports fp32, fp16, bf16 (fp64 runs on cpu_naive and cpu_blocked); given fp64";
  }
  if (!float_type) return "matmul supports fp32, fp16, bf16, fp64; given " + std::string(dtype_name(dtype));
  if ((variant == GemmVariant::kCudaWmma || variant == GemmVariant::kCudaMmaPipeline) && dtype == DType::kF32)
    return std::string(gemm_variant_name(variant)) + " supports fp16, bf16 (tensor cores); given fp32";
  return "";
}

GemmVariant resolve_gemm_variant(const TensorView& a, const TensorView&, const TensorView&) {
  if (!a.device.is_cuda()) return a.dtype == DType::kF64 ? GemmVariant::kCpuBlocked : GemmVariant::kCpuPacked;
  return a.dtype == DType::kF32 ? GemmVariant::kCudaRegisterTiled : GemmVariant::kCudaMmaPipeline;
}

namespace {
// The concrete variant for these (already validated) operands: kAuto resolved, then checked
// against the dtype and the device.
GemmVariant checked_variant(GemmVariant variant, const TensorView& a, const TensorView& b, const TensorView& c) {
  if (variant == GemmVariant::kAuto) variant = resolve_gemm_variant(a, b, c);
  if (std::string why = gemm_variant_rejects_dtype(variant, a.dtype); !why.empty())
    throw Error(Status::kUnsupported, "variant: " + why);
  const bool cuda_variant = gemm_variant_is_cuda(variant);
  if (cuda_variant != a.device.is_cuda())
    invalid("variant: " + std::string(gemm_variant_name(variant)) + " runs on " +
            (cuda_variant ? "CUDA" : "the CPU") + " tensors; given tensors on " + device_name(a.device));
  return variant;
}
}  // namespace

void matmul(const TensorView& a, const TensorView& b, const TensorView& c, float alpha, float beta,
            GemmVariant variant, const ExecutionContext& ctx) {
  const GemmParams p = make_params(a, b, c, alpha, beta);
  variant = checked_variant(variant, a, b, c);
  const bool cuda_variant = gemm_variant_is_cuda(variant);
  if (!cuda_variant) {
    switch (variant) {
      case GemmVariant::kCpuNaive: cpu::gemm_naive(p); return;
      case GemmVariant::kCpuBlocked: cpu::gemm_blocked(p, ctx.cpu_threads); return;
      default: cpu::gemm_packed(p, ctx.cpu_threads); return;
    }
  }
#if OPTIMIZED_WITH_CUDA
  // Asked once per process (devices do not come and go), not on every call.
  static const std::string no_cuda = cuda_unavailable_reason();
  if (!no_cuda.empty()) throw Error(Status::kUnsupported, "a: CUDA tensors given but " + no_cuda);
  const CudaRung rung = cuda_rung(variant);
  DeviceGuard guard(a.device.index);
  if (cudaError_t e = rung.launch(p, static_cast<cudaStream_t>(ctx.cuda_stream)); e != cudaSuccess)
    check_cuda(e, "matmul (" + std::string(gemm_variant_name(variant)) + ")");
#else
  throw Error(Status::kUnsupported, "a: CUDA tensors given but this build is CPU-only (built without CUDA)");
#endif
}

#if OPTIMIZED_WITH_CUDA
cuda::KernelResources describe_gemm_kernel(const TensorView& a, const TensorView& b, const TensorView& c,
                                           float alpha, float beta, GemmVariant variant) {
  const GemmParams p = make_params(a, b, c, alpha, beta);
  variant = checked_variant(variant, a, b, c);
  cuda::KernelResources out;
  DeviceGuard guard(a.device.index);
  if (cudaError_t e = cuda_rung(variant).resources(p, &out); e != cudaSuccess)
    check_cuda(e, "describe_gemm_kernel (" + std::string(gemm_variant_name(variant)) + ")");
  return out;
}
#endif

}  // namespace optimized
