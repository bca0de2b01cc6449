// The launcher contract's host side, on any machine: the workspace arena launchers carve their
// scratch with, the workspace queries' answers and refusals, what the variant tables generate, and
// the refusal of a dtype the build left out (OPTIMIZED_DTYPES).
#include <gtest/gtest.h>

#include <cstdint>
#include <span>
#include <string>
#include <utility>

#include "core/dtypes_built.h"
#include "core/workspace.h"
#include "optimized/fused.h"
#include "optimized/gemm.h"

namespace optimized {
namespace {

template <typename F>
Error caught(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e;
  }
  return Error(Status::kOk, "no error");
}
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// ---- the arena -----------------------------------------------------------------------------

TEST(WorkspaceArena, CountingMeasuresTheStackPeakWithAlignedSlices) {
  WorkspaceArena a;
  EXPECT_TRUE(a.counting());
  EXPECT_EQ(a.take<float>(10), nullptr);  // 40 bytes -> one 256-byte slice
  {
    ArenaScope scope(a);
    a.take<double>(100);  // 800 -> 1024
    a.take<char>(1);      // 256
  }
  a.take<float>(64);  // 256 bytes: reuses what the scope gave back
  EXPECT_EQ(a.peak(), 256u + 1024u + 256u);
  EXPECT_TRUE(a.ok());
}

TEST(WorkspaceArena, CarvingHandsOutAlignedSlicesAndRefusesPastTheEnd) {
  alignas(256) static char memory[1024];
  WorkspaceArena a(Workspace{memory, sizeof(memory)});
  EXPECT_FALSE(a.counting());
  float* x = a.take<float>(3);
  float* y = a.take<float>(3);
  EXPECT_EQ(reinterpret_cast<char*>(x), memory);
  EXPECT_EQ(reinterpret_cast<char*>(y), memory + 256);
  EXPECT_NE(a.take<char>(512), nullptr);  // exactly to the end
  EXPECT_TRUE(a.ok());
  EXPECT_EQ(a.take<char>(1), nullptr);
  EXPECT_FALSE(a.ok());
  EXPECT_EQ(a.peak(), 1024u + 256u);  // what it would have needed
}

// ---- workspace queries ---------------------------------------------------------------------

TEST(WorkspaceQueries, NothingOnTheCpu) {
  for (FusedOp op : all_fused_ops())
    for (bool backward : {false, true})
      for (DType d : {DType::kF32, DType::kBF16, DType::kF64})
        EXPECT_EQ(fused_workspace_bytes(op, backward, d, Device::cpu(), 1000, 4096), 0u);
  EXPECT_EQ(matmul_workspace_bytes(64, 64, 64, 1, DType::kF32, Device::cpu()), 0u);
  EXPECT_EQ(matmul_workspace_bytes(64, 64, 64, 3, DType::kF64, Device::cpu(), GemmVariant::kCpuBlocked), 0u);
}

TEST(WorkspaceQueries, NoGemmRungNeedsOne) {
  for (GemmVariant v : all_gemm_variants()) {
    if (!gemm_variant_is_cuda(v)) continue;
    EXPECT_EQ(matmul_workspace_bytes(4096, 4096, 4096, 2, DType::kBF16, Device::cuda(0), v), 0u)
        << gemm_variant_name(v);
  }
}

TEST(WorkspaceQueries, RefuseWhatTheOpsRefuse) {
  const Device gpu = Device::cuda(0);
  Error e = caught([&] { fused_workspace_bytes(FusedOp::kSoftmax, false, DType::kF32, gpu, -1, 16); });
  EXPECT_EQ(e.status(), Status::kInvalidArgument);
  EXPECT_TRUE(contains(e.what(), "rows")) << e.what();
  e = caught([&] { fused_workspace_bytes(FusedOp::kSoftmax, false, DType::kF32, gpu, 4, 0); });
  EXPECT_EQ(e.status(), Status::kInvalidArgument);
  EXPECT_TRUE(contains(e.what(), "width")) << e.what();
  e = caught([&] { fused_workspace_bytes(FusedOp::kLayerNorm, true, DType::kF64, gpu, 4, 16); });
  EXPECT_EQ(e.status(), Status::kUnsupported);
  EXPECT_TRUE(contains(e.what(), "fp64 runs on the cpu variant only")) << e.what();
  e = caught([&] {
    fused_workspace_bytes(FusedOp::kLayerNorm, true, DType::kF32, Device::cpu(), 4, 16, FusedVariant::kCudaUnfused);
  });
  EXPECT_EQ(e.status(), Status::kInvalidArgument);
  EXPECT_TRUE(contains(e.what(), "unfused runs on CUDA devices")) << e.what();
  e = caught([&] { matmul_workspace_bytes(0, 4, 4, 1, DType::kF32, gpu); });
  EXPECT_EQ(e.status(), Status::kInvalidArgument);
  e = caught([&] { matmul_workspace_bytes(4, 4, 4, 1, DType::kF32, gpu, GemmVariant::kCudaWmma); });
  EXPECT_EQ(e.status(), Status::kUnsupported);
  EXPECT_TRUE(contains(e.what(), "wmma supports fp16, bf16 (tensor cores); given fp32")) << e.what();
}

// A caller's workspace overlapping an operand is refused before any device is touched (host memory
// labelled CUDA).
TEST(WorkspaceChecks, OverlappingAnOperandIsRefused) {
  alignas(256) static float x[1024], y[1024];
  const TensorView xv(x, DType::kF32, Device::cuda(0), {16, 64}), yv(y, DType::kF32, Device::cuda(0), {16, 64});
  for (auto [data, name] : {std::pair<void*, const char*>{x + 512, "x"}, std::pair<void*, const char*>{y, "y"}}) {
    ExecutionContext ctx;
    ctx.workspace = {data, 1024};
    const Error e = caught([&] { softmax_forward(xv, yv, 1.0, false, FusedVariant::kAuto, ctx); });
    EXPECT_EQ(e.status(), Status::kInvalidArgument);
    EXPECT_EQ(std::string(e.what()),
              std::string("workspace: expected memory that does not overlap ") + name + "; given overlapping memory");
  }
}

// ---- what the variant tables generate --------------------------------------------------------

// The names of `variants` in order, each parsed back to itself.
template <typename Variant, typename Name, typename Parse>
std::string names_round_trip(std::span<const Variant> variants, Name name, Parse parse) {
  std::string all;
  for (Variant v : variants) {
    EXPECT_EQ(parse(name(v)), v) << name(v);
    all += std::string(name(v)) + " ";
  }
  return all;
}

TEST(VariantTables, GemmNamesParseAndRefusals) {
  EXPECT_EQ(names_round_trip(all_gemm_variants(), gemm_variant_name, parse_gemm_variant), "cpu_naive cpu_blocked cpu_packed naive coalesced smem_tiled register_tiled wmma mma_pipeline wgmma_tma wgmma_ws wgmma_persistent gemv ");
  EXPECT_EQ(parse_gemm_variant("auto"), GemmVariant::kAuto);
  const Error e = caught([] { parse_gemm_variant("fastest"); });
  EXPECT_EQ(e.status(), Status::kInvalidArgument);
  EXPECT_EQ(std::string(e.what()),
            "variant: expected one of auto, cpu_naive, cpu_blocked, cpu_packed, naive, coalesced, smem_tiled, "
            "register_tiled, wmma, mma_pipeline, wgmma_tma, wgmma_ws, wgmma_persistent, gemv; given 'fastest'");
  EXPECT_EQ(gemm_variant_rejects_dtype(GemmVariant::kCudaRegisterTiled, DType::kF64),
            "register_tiled supports fp32, fp16, bf16 (fp64 runs on cpu_naive, cpu_blocked); given fp64");
  EXPECT_EQ(gemm_variant_rejects_dtype(GemmVariant::kCudaMmaPipeline, DType::kF32),
            "mma_pipeline supports fp16, bf16 (tensor cores); given fp32");
  EXPECT_EQ(gemm_variant_rejects_dtype(GemmVariant::kAuto, DType::kI32), "matmul supports fp32, fp16, bf16, fp64; given int32");
  EXPECT_EQ(gemm_variant_rejects_dtype(GemmVariant::kAuto, DType::kF64), "");
  EXPECT_TRUE(gemm_variant_supports_dtype(GemmVariant::kCpuBlocked, DType::kF64));
  EXPECT_FALSE(gemm_variant_supports_dtype(GemmVariant::kCpuPacked, DType::kF64));
  EXPECT_EQ(gemm_variant_min_compute_capability(GemmVariant::kCudaMmaPipeline), 80);
  EXPECT_EQ(gemm_variant_min_compute_capability(GemmVariant::kCudaWgmmaPersistent), 90);
  EXPECT_EQ(gemm_variant_min_compute_capability(GemmVariant::kCpuPacked), 0);
  EXPECT_FALSE(gemm_variant_is_cuda(GemmVariant::kAuto));
  EXPECT_TRUE(gemm_variant_is_cuda(GemmVariant::kCudaNaive));
}

TEST(VariantTables, FusedNamesParseAndRefusals) {
  EXPECT_EQ(names_round_trip(all_fused_variants(), fused_variant_name, parse_fused_variant),
            "cpu unfused fused_streaming fused_registers ");
  EXPECT_EQ(names_round_trip(all_fused_ops(), fused_op_name, parse_fused_op), "softmax log_softmax layer_norm rms_norm add_layer_norm add_rms_norm bias_gelu silu_and_mul ");
  const Error e = caught([] { parse_fused_variant("best"); });
  EXPECT_EQ(std::string(e.what()),
            "variant: expected one of auto, cpu, unfused, fused_streaming, fused_registers; given 'best'");
  EXPECT_EQ(fused_variant_rejects_dtype(FusedVariant::kCudaUnfused, DType::kF64),
            "unfused supports fp32, fp16, bf16 (fp64 runs on cpu); given fp64");
  EXPECT_EQ(fused_variant_rejects_dtype(FusedVariant::kCpu, DType::kF64), "");
  EXPECT_EQ(fused_variant_rejects_dtype(FusedVariant::kAuto, DType::kI64),
            "the fused family supports fp32, fp16, bf16, fp64; given int64");
  EXPECT_EQ(fused_variant_min_compute_capability(FusedVariant::kCudaFusedRegisters), 90);  // clusters
  EXPECT_EQ(fused_variant_min_compute_capability(FusedVariant::kCpu), 0);
}

// ---- OPTIMIZED_DTYPES ------------------------------------------------------------------------

// A trimmed build (-DOPTIMIZED_DTYPES=bf16) refuses the others before looking for a device, naming
// the option; a full build (the default) has nothing to refuse.
TEST(DTypesBuilt, AnUnbuiltDtypeIsRefusedNamingTheOption) {
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16}) {
    SCOPED_TRACE(std::string(dtype_name(d)));
    const std::string why = cuda_dtype_not_built("fused", d);
    EXPECT_EQ(why.empty(), cuda_dtype_built(d));
    if (why.empty()) continue;
    EXPECT_TRUE(contains(why, "fused CUDA kernels for " + std::string(dtype_name(d)) + " were not built")) << why;
    EXPECT_TRUE(contains(why, "OPTIMIZED_DTYPES=")) << why;
    // Host memory labelled CUDA: refused before any device is touched.
    static float x[64], y[64];
    const Error e = caught([&] {
      softmax_forward(TensorView(x, d, Device::cuda(0), {4, 8}), TensorView(y, d, Device::cuda(0), {4, 8}));
    });
    EXPECT_EQ(e.status(), Status::kUnsupported);
    EXPECT_TRUE(contains(e.what(), why)) << e.what();
  }
}

}  // namespace
}  // namespace optimized
