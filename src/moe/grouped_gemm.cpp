// Public entry of the grouped GEMM (include/optimized/moe.h): validates the operands (messages name
// the argument), builds GroupedGemmParams, picks the variant from the table (grouped_variants.h) and
// runs the CPU backend or the CUDA launcher on the operands' device.
#include <algorithm>
#include <string>

#include "core/arg_checks.h"
#include "moe/moe_checks.h"
#include "moe/grouped_variants.h"
#include "moe/moe_params.h"
#include "optimized/moe.h"

#include <vector>

#include "optimized/fused.h"
#include "optimized/gemm.h"

#if OPTIMIZED_WITH_CUDA
#include <cuda_runtime.h>

#include "core/cuda_device_guard.h"
#include "core/cuda_launch.h"
#include "core/device_facts.h"
#include "core/tensor_map.h"
#endif

namespace optimized {

namespace {

using arg::dname;
using arg::invalid;
using arg::present;
using arg::shape_string;
using arg::unsupported;
using moe_checks::check_float;
using moe_checks::row_stride;

constexpr auto kVariantEnums = variant_enums(kGroupedGemmVariants);
void check_offs(arg::OperandSet& ops, const TensorView& offs, int64_t groups) {
  ops.add(offs, "offs", false);
  if (offs.dtype != DType::kI32) invalid("offs: expected dtype int32; given " + dname(offs.dtype));
  if (offs.rank != 1 || offs.shape[0] != groups || !offs.is_contiguous())
    invalid("offs: expected a contiguous vector of E = " + std::to_string(groups) + " (the groups); given " +
            (offs.rank ? offs.describe() : std::string("absent")));
}

// Why the wgmma rung cannot take p (empty: it can): what TMA and its 32-bit tile arithmetic need.
std::string wgmma_rejects(const GroupedGemmParams& p) {
  if (p.dtype != DType::kF16 && p.dtype != DType::kBF16) return "wgmma supports fp16, bf16; given " + dname(p.dtype);
  if (p.m >= INT32_MAX / 2 || p.n >= INT32_MAX / 2 || p.k >= INT32_MAX / 2 || p.groups >= INT32_MAX / 2)
    return "wgmma takes sizes below 2^30; given M " + std::to_string(p.m) + ", N " + std::to_string(p.n) + ", K " +
           std::to_string(p.k);
#if OPTIMIZED_WITH_CUDA
  std::string why;
  const auto check = [&](const TmaMatrix& m, const char* name) {
    if (why.empty()) why = tma_rejects(m, name);
  };
  if (p.weight_grad) {
    check({p.a, p.m, p.k, p.a_rs, 1, 0, 2}, "x");
    check({p.b, p.m, p.n, p.b_rs, 1, 0, 2}, "dout");
    return why;
  }
  check({p.a, p.m, p.k, p.a_rs, 1, 0, 2}, "x");
  if (p.swiglu && p.n % 16 != 0)  // the up half's columns start on a 16-byte boundary (TMA box coordinates)
    return "w: wgmma's SwiGLU takes F a multiple of 8; given F = " + std::to_string(p.n / 2);
  if (p.b_cs == 1)
    check({p.b, p.k, p.n, p.b_rs, p.groups, p.b_gs, 2}, "w");
  else if (p.b_rs == 1 && !p.swiglu)
    check({p.b, p.n, p.k, p.b_cs, p.groups, p.b_gs, 2}, "w");
  else
    return std::string("w: wgmma reads w with unit stride along ") + (p.swiglu ? "2F" : "N or K") + "; given strides (" +
           std::to_string(p.b_gs) + ", " + std::to_string(p.b_rs) + ", " + std::to_string(p.b_cs) + ")";
  return why;
#else
  return "wgmma needs a CUDA build";
#endif
}

// The variant that runs p: the one asked for (refused, naming why, where it cannot), or auto's pick.
GroupedGemmVariant resolve(GroupedGemmVariant v, const GroupedGemmParams& p, const Device& device,
                           const ExecutionContext& ctx) {
  if (v == GroupedGemmVariant::kAuto) {
    if (!device.is_cuda()) return GroupedGemmVariant::kCpu;
    v = GroupedGemmVariant::kCudaNaive;
#if OPTIMIZED_WITH_CUDA
    const GroupedGemmVariantInfo& wgmma = variant_row(kGroupedGemmVariants, GroupedGemmVariant::kCudaWgmma);
    const DeviceFacts* facts = nullptr;
    if (wgmma.launch && device_facts(device.index, &facts) == cudaSuccess &&
        facts->compute_capability == wgmma.min_compute_capability && wgmma_rejects(p).empty())
      return GroupedGemmVariant::kCudaWgmma;
    // loop reads the offsets back: not while the stream is being captured into a graph.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(static_cast<cudaStream_t>(ctx.cuda_stream), &capture) == cudaSuccess &&
        capture == cudaStreamCaptureStatusNone)
      v = GroupedGemmVariant::kCudaLoop;
#else
    (void)ctx;
#endif
    return v;
  }
  if (!find_variant(kGroupedGemmVariants, v))
    invalid("variant: expected one of " + variant_choices(kGroupedGemmVariants) + "; given value " +
            std::to_string(static_cast<unsigned>(v)));
  const GroupedGemmVariantInfo& row = variant_row(kGroupedGemmVariants, v);
  if (std::string why = variant_rejects_dtype(kGroupedGemmVariants, row, p.dtype, "grouped_mm"); !why.empty())
    unsupported("variant: " + why);
  if (std::string why = variant_rejects_device(row, device); !why.empty()) invalid(why);
  if (v == GroupedGemmVariant::kCudaWgmma)
    if (std::string why = wgmma_rejects(p); !why.empty()) unsupported("variant: " + why);
  return v;
}

TensorView view2d(const void* data, DType dtype, Device device, int64_t rows, int64_t cols, int64_t rs, int64_t cs) {
  TensorView t;
  t.data = const_cast<void*>(data);
  t.dtype = dtype;
  t.device = device;
  t.rank = 2;
  t.shape[0] = rows, t.shape[1] = cols;
  t.strides[0] = rs, t.strides[1] = cs;
  return t;
}

#if OPTIMIZED_WITH_CUDA
// The loop rung: the offsets read back (a synchronisation), then one GEMM per non-empty group on the
// GEMM family's auto; rows past the last group (forward) and empty groups' dw (weight grad, without
// accumulate) zeroed.
void run_loop(const GroupedGemmParams& p, const Device& device, const ExecutionContext& ctx) {
  DeviceGuard guard(device.index);
  const auto stream = static_cast<cudaStream_t>(ctx.cuda_stream);
  std::vector<int32_t> offs(static_cast<size_t>(p.groups));
  check_cuda(cudaMemcpyAsync(offs.data(), p.offs, offs.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, stream),
             "grouped_mm (loop): offsets read back");
  check_cuda(cudaStreamSynchronize(stream), "grouped_mm (loop): offsets read back");
  const size_t es = dtype_size(p.dtype), ces = dtype_size(p.c_dtype);
  int64_t begin = 0, end = 0;
  for (int64_t g = 0; g < p.groups; ++g) {
    begin = end;
    const int64_t o = std::clamp<int64_t>(offs[g], 0, p.m);
    end = std::max(end, o);
    const int64_t rows = end - begin;
    if (!p.weight_grad) {
      if (rows == 0) continue;
      matmul(view2d(static_cast<const char*>(p.a) + begin * p.a_rs * es, p.dtype, device, rows, p.k, p.a_rs, 1),
             view2d(static_cast<const char*>(p.b) + g * p.b_gs * es, p.dtype, device, p.k, p.n, p.b_rs, p.b_cs),
             view2d(static_cast<char*>(p.c) + begin * p.c_rs * ces, p.c_dtype, device, rows, p.n, p.c_rs, 1),
             GemmEpilogue{}, 1.0f, 0.0f, GemmVariant::kAuto, ctx);
      continue;
    }
    char* dw = static_cast<char*>(p.c) + g * p.c_gs * ces;
    if (rows == 0) {
      if (!p.accumulate)
        check_cuda(cudaMemset2DAsync(dw, static_cast<size_t>(p.c_rs) * ces, 0, static_cast<size_t>(p.n) * ces,
                                     static_cast<size_t>(p.k), stream),
                   "grouped_mm_weight_grad (loop): an empty group's dw zeroed");
      continue;
    }
    // dw[g] (K, N) = x[rows]^T (K, rows) @ dout[rows] (rows, N)
    matmul(view2d(static_cast<const char*>(p.a) + begin * p.a_rs * es, p.dtype, device, p.k, rows, 1, p.a_rs),
           view2d(static_cast<const char*>(p.b) + begin * p.b_rs * es, p.dtype, device, rows, p.n, p.b_rs, 1),
           view2d(dw, p.c_dtype, device, p.k, p.n, p.c_rs, 1), GemmEpilogue{}, 1.0f, p.accumulate ? 1.0f : 0.0f,
           GemmVariant::kAuto, ctx);
  }
  if (!p.weight_grad && end < p.m)
    check_cuda(cudaMemset2DAsync(static_cast<char*>(p.c) + end * p.c_rs * ces, static_cast<size_t>(p.c_rs) * ces, 0,
                                 static_cast<size_t>(p.n) * ces, static_cast<size_t>(p.m - end), stream),
               "grouped_mm (loop): rows past the last group zeroed");
}
#endif

void run(GroupedGemmVariant v, const GroupedGemmParams& p, const Device& device, const ExecutionContext& ctx,
         const char* what) {
  const GroupedGemmVariantInfo& row = variant_row(kGroupedGemmVariants, v);
  if (row.backend == Backend::kCpu) {
    row.cpu(p, ctx.cpu_threads);
    return;
  }
  moe_checks::cuda_prelude(device, "x");  // throws in a CPU-only build
#if OPTIMIZED_WITH_CUDA
  if (v == GroupedGemmVariant::kCudaLoop) {
    check_compute_capability(row.min_compute_capability, row.arch, row.name, device.index);
    run_loop(p, device, ctx);
    return;
  }
  // No rows: nothing for the tensor cores (and no TMA map of zero rows); the weight gradient's zeros
  // come from naive.
  const GroupedGemmVariantInfo& runs =
      v == GroupedGemmVariant::kCudaWgmma && p.m == 0 ? variant_row(kGroupedGemmVariants, GroupedGemmVariant::kCudaNaive)
                                                     : row;
  launch_on_cuda(runs, p, device.index, ctx, std::string(what) + " (" + std::string(row.name) + ")");
#else
  (void)ctx, (void)what;
#endif
}

// The forward's checks and params (grouped_mm; with swiglu, grouped_mm_swiglu's w (E, K, 2F) and out (M, F)).
GroupedGemmParams forward_params(arg::OperandSet& ops, const TensorView& x, const TensorView& w, const TensorView& offs,
                                 const TensorView& out, bool swiglu) {
  const char* w_dims = swiglu ? "(groups E, K, 2F: [gate | up])" : "(groups E, K, N)";
  if (x.rank != 2) invalid("x: expected rank 2 (rows M, K); given " + (x.rank ? shape_string(x) : std::string("absent")));
  if (w.rank != 3) invalid(std::string("w: expected rank 3 ") + w_dims + "; given " + (w.rank ? shape_string(w) : std::string("absent")));
  ops.add(x, "x", false);
  ops.add(w, "w", false);
  const int64_t M = x.shape[0], K = x.shape[1], E = w.shape[0], N = w.shape[2];
  check_float(x, "x");
  if (w.dtype != x.dtype) invalid("w: expected dtype " + dname(x.dtype) + " (x's); given " + dname(w.dtype));
  if (w.shape[1] != K) invalid("w: expected shape (E, " + std::to_string(K) + (swiglu ? ", 2F)" : ", N)") +
                               " (K = x's columns); given " + shape_string(w));
  if (E < 1 || K < 1 || N < 1) invalid("w: expected E, K, N >= 1; given " + shape_string(w) + " with x " + shape_string(x));
  if (swiglu && N % 2 != 0) invalid("w: expected an even last dimension (2F: [gate | up]); given " + shape_string(w));
  check_offs(ops, offs, E);
  ops.add(out, "out", true);
  if (out.dtype != x.dtype) invalid("out: expected dtype " + dname(x.dtype) + " (x's); given " + dname(out.dtype));
  const int64_t cols = swiglu ? N / 2 : N;
  GroupedGemmParams p;
  p.swiglu = swiglu;
  p.m = M, p.n = N, p.k = K, p.groups = E, p.dtype = x.dtype, p.c_dtype = out.dtype;
  p.a = x.data, p.a_rs = row_stride(x, "x", M, K, "(M, K)");
  p.b = w.data, p.b_gs = w.strides[0], p.b_rs = w.strides[1], p.b_cs = w.strides[2];
  p.offs = static_cast<const int32_t*>(offs.data);
  p.c = out.data;
  p.c_rs = row_stride(out, "out", M, cols, std::string(swiglu ? "(M, F)" : "(M, N)") + " = (" + std::to_string(M) + ", " +
                                               std::to_string(cols) + ")");
  return p;
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
  const GroupedGemmParams p = forward_params(ops, x, w, offs, out, false);
  const int64_t M = p.m;
  ops.check_overlaps();
  const Device device = ops.device();
  if (M == 0) {
    resolve(variant, p, device, ctx);  // the variant's refusals still apply
    return;
  }
  run(resolve(variant, p, device, ctx), p, device, ctx, "grouped_mm");
}

void grouped_mm_weight_grad(const TensorView& x, const TensorView& dout, const TensorView& offs, const TensorView& dw,
                            bool accumulate, GroupedGemmVariant variant, const ExecutionContext& ctx) {
  arg::OperandSet ops;
  if (x.rank != 2) invalid("x: expected rank 2 (rows M, K); given " + (x.rank ? shape_string(x) : std::string("absent")));
  if (dw.rank != 3)
    invalid("dw: expected rank 3 (groups E, K, N); given " + (dw.rank ? shape_string(dw) : std::string("absent")));
  ops.add(x, "x", false);
  const int64_t M = x.shape[0], K = x.shape[1], E = dw.shape[0], N = dw.shape[2];
  check_float(x, "x");
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
  run(resolve(variant, p, device, ctx), p, device, ctx, "grouped_mm_weight_grad");
}

void grouped_mm_swiglu(const TensorView& x, const TensorView& w, const TensorView& offs, const TensorView& out,
                       const TensorView& pre, GroupedGemmVariant variant, const ExecutionContext& ctx) {
  arg::OperandSet ops;
  GroupedGemmParams p = forward_params(ops, x, w, offs, out, true);
  const int64_t M = p.m, N = p.n;
  if (pre.rank != 0) {
    ops.add(pre, "pre", true);
    if (pre.dtype != x.dtype) invalid("pre: expected dtype " + dname(x.dtype) + " (x's); given " + dname(pre.dtype));
    p.pre = pre.data;
    p.pre_rs = row_stride(pre, "pre", M, N, "(M, 2F) = (" + std::to_string(M) + ", " + std::to_string(N) + ")");
  }
  ops.check_overlaps();
  const Device device = ops.device();
  const GroupedGemmVariant v = resolve(variant, p, device, ctx);
  if (M == 0) return;
  if (v == GroupedGemmVariant::kCudaWgmma) {
    run(v, p, device, ctx, "grouped_mm_swiglu");
    return;
  }
  // The other rungs: the products by grouped_mm into pre (or scratch), then silu_and_mul. The inner
  // calls get no caller workspace (it may hold the scratch).
  ExecutionContext inner = ctx;
  inner.workspace = {};
  const size_t bytes = static_cast<size_t>(M) * N * dtype_size(x.dtype);
  const auto finish = [&](void* h, int64_t ld) {
    const TensorView hv = view2d(h, x.dtype, device, M, N, ld, 1);
    grouped_mm(x, w, offs, hv, v, inner);
    silu_and_mul_forward(hv, out, FusedVariant::kAuto, inner);
  };
  if (p.pre) {
    finish(p.pre, p.pre_rs);
    return;
  }
  if (!device.is_cuda()) {
    std::vector<char> scratch(bytes);
    finish(scratch.data(), N);
    return;
  }
#if OPTIMIZED_WITH_CUDA
  DeviceGuard guard(device.index);
  const auto stream = static_cast<cudaStream_t>(ctx.cuda_stream);
  CallWorkspace ws(ctx, bytes, "grouped_mm_swiglu (" + std::string(grouped_gemm_variant_name(v)) + ")", device.index,
                   stream);
  finish(ws.get().data, N);
  ws.release("grouped_mm_swiglu");
#endif
}

}  // namespace optimized
