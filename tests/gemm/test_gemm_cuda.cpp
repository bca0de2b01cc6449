// CUDA GEMM through the public API: every CUDA rung of the ladder (naive, coalesced, smem_tiled,
// register_tiled and gemv for fp32/fp16/bf16; wmma, mma_pipeline and the Hopper rungs wgmma_tma, wgmma_ws,
// wgmma_persistent for fp16/bf16) and kAuto, against the float64 reference on fresh random inputs
// with poisoned outputs and padding (gemm_test_util.h). The Hopper rungs load through TMA: their
// cases get leading dimensions padded to 16 bytes unless a test sets its own, and a case TMA
// cannot describe must be refused naming the operand (expect_case).
// A plain C++ file, built in every configuration: without a CUDA device every test skips.
#include <gtest/gtest.h>

#include <tuple>

#include "gemm_test_util.h"

namespace optimized::testing {
namespace {

using VariantParam = std::tuple<GemmVariant, DType>;

std::vector<VariantParam> cuda_variants() {
  std::vector<VariantParam> out;
  for (GemmVariant v : {GemmVariant::kCudaNaive, GemmVariant::kCudaCoalesced, GemmVariant::kCudaSmemTiled,
                        GemmVariant::kCudaRegisterTiled, GemmVariant::kCudaGemv})
    for (DType d : {DType::kF32, DType::kF16, DType::kBF16}) out.emplace_back(v, d);
  for (GemmVariant v : {GemmVariant::kCudaWmma, GemmVariant::kCudaMmaPipeline, GemmVariant::kCudaWgmmaTma,
                        GemmVariant::kCudaWgmmaWs, GemmVariant::kCudaWgmmaPersistent})
    for (DType d : {DType::kF16, DType::kBF16}) out.emplace_back(v, d);
  return out;
}

bool is_hopper(GemmVariant v) {
  return v == GemmVariant::kCudaWgmmaTma || v == GemmVariant::kCudaWgmmaWs || v == GemmVariant::kCudaWgmmaPersistent;
}

// Runs a case: checked against the reference, or, for a Hopper rung given operands TMA cannot
// describe, refused with an error naming a or b.
void expect_case(const GemmCase& cs) {
  if (!is_hopper(cs.variant) || gemm_case_tma_describable(cs)) return expect_gemm_ok(cs);
  const std::string error = gemm_cuda_error(cs);
  EXPECT_NE(error.find("for TMA"), std::string::npos) << cs.describe() << ": " << error;
  EXPECT_TRUE(error.find("a: expected") != std::string::npos || error.find("b: expected") != std::string::npos)
      << cs.describe() << ": " << error;
}

std::string param_name(const ::testing::TestParamInfo<VariantParam>& info) {
  return std::string(gemm_variant_name(std::get<0>(info.param))) + "_" + dtype_label(std::get<1>(info.param));
}

class CudaGemm : public ::testing::TestWithParam<VariantParam> {
 protected:
  void SetUp() override { SKIP_WITHOUT_CUDA(); }
  GemmCase base(int64_t m, int64_t n, int64_t k, GemmLayout layout = {false, false, false}) const {
    GemmCase cs;
    cs.variant = std::get<0>(GetParam());
    cs.dtype = std::get<1>(GetParam());
    cs.device = Device::cuda(0);
    cs.m = m;
    cs.n = n;
    cs.k = k;
    layout.apply(cs);
    if (is_hopper(cs.variant)) {  // stored rows of A and B 16-byte aligned (what TMA needs)
      const int64_t a_width = cs.layout_a().stored_cols(), b_width = cs.layout_b().stored_cols();
      cs.lda_pad = (vec() - a_width % vec()) % vec();
      cs.ldb_pad = (vec() - b_width % vec()) % vec();
    }
    return cs;
  }
  // Elements per 16 bytes: a padding of this many keeps rows 16-byte aligned.
  int64_t vec() const { return 16 / static_cast<int64_t>(dtype_size(std::get<1>(GetParam()))); }
};

TEST_P(CudaGemm, OddSizes) {
  for (const Mnk& s : odd_sizes()) expect_case(base(s.m, s.n, s.k));
}

TEST_P(CudaGemm, BigSquare1024) {
  GemmCase cs = base(1024, 1024, 1024);
  cs.samples = 4096;
  expect_case(cs);
}

TEST_P(CudaGemm, BigSquare4096Sampled) {
  GemmCase cs = base(4096, 4096, 4096);
  cs.samples = 4096;
  expect_case(cs);
}

TEST_P(CudaGemm, BigOdd4097x4095x4093Sampled) {
  GemmCase cs = base(4097, 4095, 4093);
  cs.samples = 4096;
  expect_case(cs);
}

TEST_P(CudaGemm, LeadingDims) {
  // Misaligned: rows an odd number of elements apart (16-byte vector loads must fall back).
  for (Mnk s : {Mnk{128, 128, 128}, Mnk{127, 129, 131}, Mnk{64, 72, 80}, Mnk{1, 257, 1}, Mnk{257, 1, 129}}) {
    GemmCase cs = base(s.m, s.n, s.k);
    cs.lda_pad = 1;
    cs.ldb_pad = 1;
    cs.ldc_pad = 1;
    expect_case(cs);
    cs.lda_pad = 3;
    cs.ldb_pad = 0;
    cs.ldc_pad = 5;
    expect_case(cs);
  }
  // Aligned but padded: rows 16 bytes aligned, ld > width.
  for (Mnk s : {Mnk{128, 128, 128}, Mnk{256, 192, 320}, Mnk{127, 129, 131}}) {
    GemmCase cs = base(s.m, s.n, s.k);
    cs.lda_pad = vec();
    cs.ldb_pad = 2 * vec();
    cs.ldc_pad = vec();
    expect_case(cs);
  }
}

TEST_P(CudaGemm, ViewsNotAtBufferStart) {
  // Base pointers one element past a 256-byte boundary, with aligned and misaligned ld.
  for (Mnk s : {Mnk{128, 128, 128}, Mnk{127, 129, 131}}) {
    GemmCase cs = base(s.m, s.n, s.k);
    cs.offset = 1;
    expect_case(cs);
    cs.lda_pad = vec();
    cs.ldb_pad = vec();
    cs.ldc_pad = vec();
    expect_case(cs);
  }
}

TEST_P(CudaGemm, AlphaBeta) {
  for (Mnk s : {Mnk{127, 129, 131}, Mnk{256, 256, 256}, Mnk{31, 1, 97}}) {
    GemmCase cs = base(s.m, s.n, s.k);
    cs.alpha = 0.5f;
    cs.beta = -1.25f;
    expect_case(cs);
    cs.ldc_pad = 3;
    cs.alpha = -2.0f;
    cs.beta = 1.0f;
    expect_case(cs);
  }
  GemmCase cs = base(64, 96, 32);
  cs.alpha = 0.0f;  // C = beta * C
  cs.beta = 1.0f;
  expect_case(cs);
  cs.beta = 0.0f;  // C = 0 over a NaN-poisoned C
  expect_case(cs);
}

// The Hopper rung's tile configurations by shape (gemm_config.h's plan): the small tiles with
// split-K (256 x 1024 x 1024), the small tiles over two waves at M > 64 (100 x 9000 x 192, 130 x
// 8200 x 512: a partial tile row and column), the big tiles unsplit (1100 x 4000 x 72); each with
// a column-major B, and with alpha / beta. wgmma_persistent only (the rung with the plan; the others
// take these as any shape, and their float64 references cost minutes over every rung).
TEST_P(CudaGemm, HopperTileConfigs) {
  if (std::get<0>(GetParam()) != GemmVariant::kCudaWgmmaPersistent)
    GTEST_SKIP() << "the persistent Hopper rung's tile configurations";
  for (Mnk s : {Mnk{256, 1024, 1024}, Mnk{100, 9000, 192}, Mnk{130, 8200, 512}, Mnk{1100, 4000, 72}}) {
    for (bool trans_b : {false, true}) {
      GemmCase cs = base(s.m, s.n, s.k, GemmLayout{false, trans_b, false});
      expect_case(cs);
      cs.alpha = 0.5f;
      cs.beta = -1.25f;
      expect_case(cs);
    }
  }
}

TEST_P(CudaGemm, BetaZeroDoesNotReadNanC) {
  for (Mnk s : {Mnk{17, 33, 65}, Mnk{256, 256, 256}}) {
    GemmCase cs = base(s.m, s.n, s.k);
    cs.alpha = 0.75f;
    cs.ldc_pad = vec();
    GemmOperands ops(cs);
    GemmRun run = run_gemm(ops);
    EXPECT_TRUE(run.check.passed) << cs.describe() << ": " << run.check.first_failure;
    int64_t non_finite = 0;
    for (int64_t i = 0; i < cs.m; ++i)
      for (int64_t j = 0; j < cs.n; ++j)
        non_finite += !std::isfinite(load_as_double(run.c.data(), cs.dtype, ops.lc.at(0, i, j)));
    EXPECT_EQ(non_finite, 0) << cs.describe() << ": beta == 0 must not propagate NaN from the old C";
  }
}

TEST_P(CudaGemm, Batched) {
  for (Broadcast a_bc : {Broadcast::kNone, Broadcast::kStride0, Broadcast::kRank2})
    for (Broadcast b_bc : {Broadcast::kNone, Broadcast::kStride0, Broadcast::kRank2}) {
      if (a_bc != Broadcast::kNone && b_bc != Broadcast::kNone) continue;
      GemmCase cs = base(129, 136, 72);
      cs.batch = 3;
      cs.a_bcast = a_bc;
      cs.b_bcast = b_bc;
      expect_case(cs);
      cs = base(37, 41, 29);
      cs.batch = 3;
      cs.a_bcast = a_bc;
      cs.b_bcast = b_bc;
      cs.batch_gap = 5;
      cs.lda_pad = 1;
      cs.ldc_pad = 2;
      cs.alpha = 0.5f;
      cs.beta = -1.25f;
      expect_case(cs);
      cs = base(37, 41, 29);  // gaps between batches that keep 16-byte alignment (TMA takes them)
      cs.batch = 3;
      cs.a_bcast = a_bc;
      cs.b_bcast = b_bc;
      cs.batch_gap = 3 * vec();
      cs.ldc_pad = 3;
      cs.alpha = 0.5f;
      cs.beta = -1.25f;
      expect_case(cs);
    }
  GemmCase cs = base(64, 64, 64);
  cs.batch = 1;  // rank 3 with a batch of one
  expect_case(cs);
}

TEST_P(CudaGemm, NanAndInfPropagate) {
  for (Mnk s : {Mnk{17, 33, 65}, Mnk{128, 128, 128}, Mnk{255, 257, 100}, Mnk{2, 3, 4}}) expect_nan_inf_propagation(base(s.m, s.n, s.k));
  GemmCase cs = base(64, 72, 48);
  cs.batch = 3;
  cs.a_bcast = Broadcast::kStride0;
  expect_nan_inf_propagation(cs);
}

// Decode shapes (M <= 64) and shapes whose tiles do not fill the SMs: wgmma_persistent runs its
// small-M configuration and splits K (gemm_config.h); every rung must give the same answers.
TEST_P(CudaGemm, SmallMAndSplitK) {
  for (Mnk s : {Mnk{1, 4096, 4096}, Mnk{37, 520, 2048}, Mnk{64, 1000, 3000}, Mnk{200, 300, 1000}, Mnk{1, 8, 8},
                Mnk{65, 264, 4104}}) {
    GemmCase cs = base(s.m, s.n, s.k);
    expect_case(cs);
    cs.alpha = 0.5f;
    cs.beta = -1.25f;
    cs.ldc_pad = 8;
    expect_case(cs);
  }
  GemmCase cs = base(48, 136, 1536);
  cs.batch = 3;
  cs.b_bcast = Broadcast::kStride0;
  expect_case(cs);
  expect_nan_inf_propagation(base(33, 200, 2048));
}

TEST_P(CudaGemm, NonDefaultStream) {
  OwnStream stream;
  for (Mnk s : {Mnk{127, 129, 131}, Mnk{256, 256, 256}}) {
    GemmCase cs = base(s.m, s.n, s.k);
    cs.stream = stream.get();
    expect_case(cs);
  }
  GemmCase cs = base(129, 136, 72);
  cs.stream = stream.get();
  cs.batch = 3;
  cs.b_bcast = Broadcast::kStride0;
  cs.alpha = 0.5f;
  cs.beta = -1.25f;
  expect_case(cs);
}

// Every layout of A and B (NN, NT, TN, TT) and a column-major C (computed as C^T = B^T A^T):
// odd sizes, one-row and one-column problems (where a view's stride along the unit dimension does
// not matter), the small-M and split-K shapes, misaligned leading dimensions (which the Hopper
// rungs refuse), alpha/beta, batches with a broadcast operand, NaN/Inf.
TEST_P(CudaGemm, Layouts) {
  for (const GemmLayout& l : gemm_layouts(true)) {
    SCOPED_TRACE(l.name());
    for (Mnk s : {Mnk{1, 1, 1}, Mnk{17, 33, 65}, Mnk{1, 257, 1}, Mnk{257, 1, 129}, Mnk{127, 129, 131},
                  Mnk{256, 192, 320}, Mnk{4, 300, 512}, Mnk{48, 1000, 3000}, Mnk{300, 520, 1000}}) {
      GemmCase cs = base(s.m, s.n, s.k, l);
      expect_case(cs);
      cs.alpha = 0.5f;
      cs.beta = -1.25f;
      cs.ldc_pad = 3;
      expect_case(cs);
      cs.lda_pad += 1;  // stored rows an odd number of elements apart
      cs.ldb_pad += 3;
      expect_case(cs);
    }
    GemmCase cs = base(129, 136, 72, l);
    cs.batch = 3;
    cs.b_bcast = Broadcast::kStride0;
    cs.batch_gap = 2 * vec();
    expect_case(cs);
    cs.b_bcast = Broadcast::kNone;
    cs.a_bcast = Broadcast::kRank2;
    cs.alpha = 0.5f;
    cs.beta = -1.25f;
    expect_case(cs);
    cs = base(1031, 1029, 1027, l);
    cs.samples = 4096;
    expect_case(cs);
    expect_nan_inf_propagation(base(64, 72, 48, l));
    expect_nan_inf_propagation(base(255, 257, 100, l));
  }
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaGemm, ::testing::ValuesIn(cuda_variants()), param_name);

// ---- kAuto on CUDA tensors ---------------------------------------------------------------------

class CudaGemmAuto : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override { SKIP_WITHOUT_CUDA(); }
};

TEST_P(CudaGemmAuto, ResolvesToACudaVariantThatAcceptsTheDtype) {
  const DType d = GetParam();
  Buffer a(d, 64 * 64, Device::cuda()), b(d, 64 * 64, Device::cuda()), c(d, 64 * 64, Device::cuda());
  const GemmVariant v = resolve_gemm_variant(a.view({64, 64}), b.view({64, 64}), c.view({64, 64}));
  EXPECT_TRUE(gemm_variant_is_cuda(v)) << gemm_variant_name(v);
  EXPECT_EQ(gemm_variant_rejects_dtype(v, d), "") << gemm_variant_name(v);
}

TEST_P(CudaGemmAuto, OddSizesAndBatches) {
  for (const Mnk& s : odd_sizes()) {
    GemmCase cs;
    cs.dtype = GetParam();
    cs.device = Device::cuda(0);
    cs.m = s.m;
    cs.n = s.n;
    cs.k = s.k;
    expect_gemm_ok(cs);
  }
  GemmCase cs;
  cs.dtype = GetParam();
  cs.device = Device::cuda(0);
  cs.m = 129;
  cs.n = 136;
  cs.k = 72;
  cs.batch = 3;
  cs.b_bcast = Broadcast::kStride0;
  cs.lda_pad = 1;
  cs.alpha = 0.5f;
  cs.beta = -1.25f;
  expect_gemm_ok(cs);
}

// Operands TMA cannot describe (odd K or N), large enough that auto runs wgmma_persistent on
// padded copies of them (gemm_hopper_staging_pays) on an H100.
TEST_P(CudaGemmAuto, StagesWhatTmaCannotDescribe) {
  const DType d = GetParam();
  GemmCase cs;
  cs.dtype = d;
  cs.device = Device::cuda(0);
  cs.m = 4097, cs.n = 4095, cs.k = 4093;
  cs.samples = 4096;
  expect_gemm_ok(cs);
  if (hopper_device() && d != DType::kF32) {
    Buffer a(d, 4097 * 4093, Device::cuda()), b(d, 4093 * 4095, Device::cuda()), c(d, 4097 * 4095, Device::cuda());
    EXPECT_EQ(resolve_gemm_variant(a.view({4097, 4093}), b.view({4093, 4095}), c.view({4097, 4095})),
              GemmVariant::kCudaWgmmaPersistent);
  }
  // Batched, A with odd rows and gaps between batches, B shared by every batch.
  cs = GemmCase{};
  cs.dtype = d;
  cs.device = Device::cuda(0);
  cs.m = 1500, cs.n = 1600, cs.k = 2001;
  cs.batch = 3;
  cs.lda_pad = 1;
  cs.batch_gap = 5;
  cs.b_bcast = Broadcast::kStride0;
  cs.alpha = 0.5f;
  cs.beta = -1.25f;
  cs.samples = 4096;
  expect_gemm_ok(cs);
  // B with odd rows (N = 1601), A aligned.
  cs.n = 1601;
  cs.k = 2048;
  cs.lda_pad = 0;
  cs.batch_gap = 0;
  cs.b_bcast = Broadcast::kNone;
  cs.beta = 0.0f;
  expect_gemm_ok(cs);
  // Column-major operands with odd stored rows (staged in their own layouts), and a column-major C.
  for (const GemmLayout& l : gemm_layouts(true)) {
    if (!l.a_col_major && !l.b_col_major && !l.c_col_major) continue;
    SCOPED_TRACE(l.name());
    cs = GemmCase{};
    cs.dtype = d;
    cs.device = Device::cuda(0);
    cs.m = 1501, cs.n = 1603, cs.k = 2001;
    cs.batch = 2;
    cs.samples = 4096;
    l.apply(cs);
    expect_gemm_ok(cs);
  }
}

// ---- every CUDA variant gives the same finite results on the same inputs ------------------------

TEST_P(CudaGemmAuto, AllVariantsAgree) {
  const DType d = GetParam();
  std::vector<GemmVariant> variants;
  for (const auto& [v, vd] : cuda_variants())
    if (vd == d) variants.push_back(v);
  variants.push_back(GemmVariant::kAuto);
  for (Mnk s : {Mnk{257, 263, 269}, Mnk{128, 128, 128}}) {
    GemmCase cs;
    cs.dtype = d;
    cs.device = Device::cuda(0);
    cs.m = s.m;
    cs.n = s.n;
    cs.k = s.k;
    const int64_t vec = 16 / static_cast<int64_t>(dtype_size(d));  // rows 16-byte aligned: every rung runs
    for (const GemmLayout& l : gemm_layouts(false)) {
      l.apply(cs);
      const int64_t a_width = cs.layout_a().stored_cols(), b_width = cs.layout_b().stored_cols();
      cs.lda_pad = (vec - a_width % vec) % vec;
      cs.ldb_pad = (vec - b_width % vec) % vec;
      cs.alpha = 0.5f;
      cs.beta = -1.25f;
      SCOPED_TRACE(l.name());
      expect_variants_agree(cs, variants);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaGemmAuto, ::testing::Values(DType::kF32, DType::kF16, DType::kBF16),
                         [](const ::testing::TestParamInfo<DType>& info) { return dtype_label(info.param); });

// ---- split-K's workspace (wgmma_persistent) ------------------------------------------------------

TEST(CudaGemmSplitK, WorkspaceQueryGivenWorkspaceAndDeterminism) {
  SKIP_WITHOUT_CUDA();
  if (!hopper_device()) GTEST_SKIP() << "wgmma_persistent is sm_90a code: needs compute capability 9.0";
  const int64_t m = 16, n = 4096, k = 4096;
  const GemmVariant v = GemmVariant::kCudaWgmmaPersistent;
  const size_t need = matmul_workspace_bytes(m, n, k, 1, DType::kBF16, Device::cuda(0), v);
  EXPECT_GT(need, 0u) << "a 16 x 4096 x 4096 product splits K across the SMs";
  EXPECT_EQ(matmul_workspace_bytes(4096, 4096, 4096, 1, DType::kBF16, Device::cuda(0), v), 0u);
  EXPECT_GE(matmul_workspace_bytes(m, n, k, 1, DType::kBF16, Device::cuda(0), GemmVariant::kAuto), need);

  std::mt19937_64 rng(7);
  std::vector<uint16_t> ha(m * k), hb(k * n);
  for (auto& x : ha) x = static_cast<uint16_t>(0x3c00 + rng() % 0x300);  // bf16 in [1, 8)
  for (auto& x : hb) x = static_cast<uint16_t>(0xbc00 + rng() % 0x300);  // and (-8, -1]
  Buffer a(DType::kBF16, m * k, Device::cuda()), b(DType::kBF16, k * n, Device::cuda()),
      c(DType::kBF16, m * n, Device::cuda()), ws(DType::kF32, static_cast<int64_t>(need / 4 + 1), Device::cuda());
  a.copy_from_host(ha.data());
  b.copy_from_host(hb.data());
  auto run = [&](const ExecutionContext& ctx) {
    c.fill_bytes(0xFF);
    matmul(a.matrix(m, k, k), b.matrix(k, n, n), c.matrix(m, n, n), 1.0f, 0.0f, v, ctx);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<uint16_t> out(m * n);
    c.copy_to_host(out.data());
    return out;
  };
  const std::vector<uint16_t> own = run(ExecutionContext{});  // the library allocates the workspace
  ExecutionContext given;
  given.workspace = {ws.data(), need};
  EXPECT_EQ(run(given), own) << "the caller's workspace gives the same bits";
  EXPECT_EQ(run(ExecutionContext{}), own) << "split-K sums the partials in split order: same bits every run";
  ExecutionContext tiny;
  tiny.workspace = {ws.data(), need / 2};
  try {
    run(tiny);
    ADD_FAILURE() << "a workspace of half the size was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("workspace: expected at least"), std::string::npos) << e.what();
  }
}

// ---- the device buffer itself ------------------------------------------------------------------

TEST(CudaBuffer, RoundTripAndFill) {
  SKIP_WITHOUT_CUDA();
  std::vector<uint16_t> host(1000), back(1000, 0);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<uint16_t>(i * 7919u);
  Buffer d(DType::kBF16, 1000, Device::cuda());
  EXPECT_TRUE(d.device().is_cuda());
  EXPECT_EQ(d.bytes(), 2000u);
  d.copy_from_host(host.data());
  d.copy_to_host(back.data());
  EXPECT_EQ(host, back);
  d.fill_bytes(0xAB);
  d.copy_to_host(back.data());
  for (uint16_t v : back) ASSERT_EQ(v, 0xABAB);
}

}  // namespace
}  // namespace optimized::testing
