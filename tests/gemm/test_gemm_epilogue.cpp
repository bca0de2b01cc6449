// GEMM epilogues (gemm.h, GemmEpilogue): bias along N or M, the activations and their gradients,
// aux, residual, column sums, an fp32 C from 16-bit operands, on every rung that fuses them (the
// CPU rungs, naive, register_tiled, mma_pipeline, wgmma_persistent) and auto, against the float64
// reference of optimized_ops_testing (check_gemm_epilogue) on fresh random inputs, with every
// output poisoned (NaN) first, rows padded with poison that must stay untouched, odd sizes, batches,
// layouts and own streams; then every refusal. CUDA cases ("Cuda/" instances and the
// EpilogueCuda* suites) skip without a CUDA device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <sstream>
#include <tuple>

#include "common/test_util.h"
#include "gemm_test_util.h"
#include "testing/gemm_check.h"

namespace optimized::testing {
namespace {

enum class Bias { kNone, kN, kM };

struct EpiCase {
  GemmVariant variant = GemmVariant::kAuto;
  DType dtype = DType::kBF16;
  bool c_fp32 = false;  // C (and aux, residual, bias) fp32 with 16-bit operands
  Device device = Device::cpu();
  int64_t m = 1, n = 1, k = 1;
  int64_t batch = 0;  // 0: rank-2 tensors
  bool a_col_major = false, b_col_major = false;
  Bias bias = Bias::kNone;
  Activation act = Activation::kNone;
  bool grad = false, aux = false, residual = false, column_sums = false;
  float alpha = 1.0f, beta = 0.0f;
  int64_t pad = 0;  // row padding of C, aux and residual (poisoned, must stay untouched)
  bool align16 = false;  // A's and B's rows 16-byte aligned (what TMA needs): the Hopper rung's cases
  void* stream = nullptr;

  DType c_dtype() const { return c_fp32 ? DType::kF32 : dtype; }
  std::string describe() const {
    std::ostringstream s;
    s << gemm_variant_name(variant) << " " << dtype_name(dtype) << (c_fp32 ? "->fp32" : "") << " on "
      << device_name(device) << " M=" << m << " N=" << n << " K=" << k;
    if (batch) s << " batch=" << batch;
    if (a_col_major || b_col_major) s << " layout " << (a_col_major ? "T" : "N") << (b_col_major ? "T" : "N");
    s << " bias=" << (bias == Bias::kNone ? "none" : bias == Bias::kN ? "N" : "M") << " act=" << activation_name(act)
      << (grad ? " (grad)" : "") << (aux ? " aux" : "") << (residual ? " residual" : "")
      << (column_sums ? " column_sums" : "") << " alpha=" << alpha << " beta=" << beta << " pad=" << pad
      << (stream ? " (own stream)" : "");
    return s.str();
  }
};

// align16: rows 8 elements past the stored width rounded up to 8, batches 8 elements apart (16-byte
// aligned rows of 16-bit elements), else `pad` elements of padding and a gap of 3.
GuardedLayout matrix_layout(int64_t rows, int64_t cols, int64_t pad, bool col_major, int64_t batch,
                            bool align16 = false) {
  GuardedLayout l;
  l.rows = rows;
  l.cols = cols;
  l.col_major = col_major;
  l.ld = align16 ? (l.stored_cols() + 7) / 8 * 8 + 8 : l.stored_cols() + pad;
  l.batches = batch == 0 ? 1 : batch;
  l.batch_stride = l.stored_rows() * l.ld + (batch > 1 ? (align16 ? 8 : 3) : 0);  // a gap between batches
  return l;
}

TensorView matrix_view(void* base, DType dtype, Device device, const GuardedLayout& l, int64_t batch) {
  const int64_t rs = l.col_major ? 1 : l.ld, cs = l.col_major ? l.ld : 1;
  if (batch == 0) return TensorView(base, dtype, device, {l.rows, l.cols}, {rs, cs});
  return TensorView(base, dtype, device, {batch, l.rows, l.cols}, {l.batch_stride, rs, cs});
}

void fill(Buffer& buf, DType dtype, const GuardedLayout& l, std::mt19937_64& rng, double lo, double hi) {
  std::uniform_real_distribution<double> dist(lo, hi);
  for (int64_t z = 0; z < l.batches; ++z)
    for (int64_t i = 0; i < l.rows; ++i)
      for (int64_t j = 0; j < l.cols; ++j) store_from_double(buf.data(), dtype, l.at(z, i, j), dist(rng));
}

// The host storage of a case, filled and poisoned; slots in run_on_cuda's order.
struct EpiOperands {
  EpiCase cs;
  GuardedLayout la, lb, lc, lbias, lsums;
  Buffer a, b, c0, bias, aux0, res, sums0;
  enum Slot { kA, kB, kC, kBias, kAux, kRes, kSums };

  explicit EpiOperands(const EpiCase& c) : cs(c) {
    const int64_t nb = c.batch == 0 ? 1 : c.batch;
    la = matrix_layout(c.m, c.k, 1, c.a_col_major, c.batch, c.align16);
    lb = matrix_layout(c.k, c.n, 2, c.b_col_major, c.batch, c.align16);
    lc = matrix_layout(c.m, c.n, c.pad, false, c.batch);
    lbias = matrix_layout(1, c.bias == Bias::kM ? c.m : c.n, 0, false, 0);
    lsums = matrix_layout(nb, c.n, 0, false, 0);
    const DType cd = c.c_dtype();
    std::mt19937_64 rng = test_rng();
    a = Buffer(c.dtype, la.storage(), Device::cpu());
    b = Buffer(c.dtype, lb.storage(), Device::cpu());
    c0 = Buffer(cd, lc.storage(), Device::cpu());
    bias = Buffer(cd, lbias.storage(), Device::cpu());
    aux0 = Buffer(cd, lc.storage(), Device::cpu());
    res = Buffer(cd, lc.storage(), Device::cpu());
    sums0 = Buffer(DType::kF32, lsums.storage(), Device::cpu());
    for (Buffer* x : {&a, &b, &c0, &bias, &aux0, &res, &sums0}) x->fill_bytes(0xFF);  // NaN
    fill(a, c.dtype, la, rng, -1, 1);
    fill(b, c.dtype, lb, rng, -1, 1);
    if (c.beta != 0.0f) fill(c0, cd, lc, rng, -1, 1);
    fill(bias, cd, lbias, rng, -1, 1);
    if (c.grad) fill(aux0, cd, lc, rng, -3, 3);  // the forward's pre-activations
    fill(res, cd, lc, rng, -1, 1);
  }

  std::vector<const Buffer*> buffers() const {
    return {&a, &b, &c0, cs.bias != Bias::kNone ? &bias : nullptr, cs.aux ? &aux0 : nullptr,
            cs.residual ? &res : nullptr, cs.column_sums ? &sums0 : nullptr};
  }

  // The tensors as the op sees them, on `device`, from the bases of each slot.
  struct Views {
    TensorView a, b, c, bias, aux, res, sums;
    GemmEpilogue epi;
  };
  // (Views holds the tensors its epilogue points to: filled in place, never copied.)
  void views(const std::vector<void*>& base, Device device, Views& v) const {
    const DType cd = cs.c_dtype();
    v.a = matrix_view(base[kA], cs.dtype, device, la, cs.batch);
    v.b = matrix_view(base[kB], cs.dtype, device, lb, cs.batch);
    v.c = matrix_view(base[kC], cd, device, lc, cs.batch);
    if (cs.bias != Bias::kNone) {
      v.bias = TensorView(base[kBias], cd, device, {lbias.cols}, {1});
      v.epi.bias = &v.bias;
      v.epi.bias_along_m = cs.bias == Bias::kM;
    }
    v.epi.activation = cs.act;
    v.epi.activation_grad = cs.grad;
    if (cs.aux) {
      v.aux = matrix_view(base[kAux], cd, device, lc, cs.batch);
      v.epi.aux = &v.aux;
    }
    if (cs.residual) {
      v.res = matrix_view(base[kRes], cd, device, lc, cs.batch);
      v.epi.residual = &v.res;
    }
    if (cs.column_sums) {
      v.sums = cs.batch == 0 ? TensorView(base[kSums], DType::kF32, device, {cs.n}, {1})
                             : TensorView(base[kSums], DType::kF32, device, {cs.batch, cs.n}, {cs.n, 1});
      v.epi.column_sums = &v.sums;
    }
  }
  // The views of the inputs, the pointers of host storage.
  std::vector<void*> host_bases() const {
    return {a.data(), b.data(), c0.data(), bias.data(), aux0.data(), res.data(), sums0.data()};
  }
};

// Runs the case; returns the host copies of every slot after the run (empty entries for unused
// slots). Throws what matmul throws.
std::vector<Buffer> run_epilogue(const EpiOperands& ops, std::string* cuda_error) {
  const EpiCase& cs = ops.cs;
  std::vector<Buffer> after;
  if (!cs.device.is_cuda()) {
    const std::vector<const Buffer*> in = ops.buffers();
    after.resize(in.size());
    std::vector<void*> bases(in.size(), nullptr);
    for (size_t i = 0; i < in.size(); ++i) {
      if (!in[i]) continue;
      after[i] = Buffer(in[i]->dtype(), in[i]->count(), Device::cpu());
      std::memcpy(after[i].data(), in[i]->data(), in[i]->bytes());
      bases[i] = after[i].data();
    }
    EpiOperands::Views v;
    ops.views(bases, Device::cpu(), v);
    matmul(v.a, v.b, v.c, v.epi, cs.alpha, cs.beta, cs.variant);
    return after;
  }
  ExecutionContext ctx;
  ctx.cuda_stream = cs.stream;
  *cuda_error = run_on_cuda(ops.buffers(), cs.device, cs.stream,
                            [&](const std::vector<void*>& d) {
                              EpiOperands::Views v;
                              ops.views(d, cs.device, v);
                              matmul(v.a, v.b, v.c, v.epi, cs.alpha, cs.beta, cs.variant, ctx);
                            },
                            after);
  return after;
}

// Runs, checks every output against float64 and that nothing outside the outputs' views (row
// padding, gaps, guard zones) or in the inputs changed.
void expect_epilogue_ok(const EpiCase& cs) {
  SCOPED_TRACE(cs.describe());
  const EpiOperands ops(cs);
  std::string cuda_error;
  std::vector<Buffer> after;
  try {
    after = run_epilogue(ops, &cuda_error);
  } catch (const Error& e) {
    FAIL() << "matmul threw (" << status_name(e.status()) << "): " << e.what();
  }
  ASSERT_TRUE(cuda_error.empty()) << cuda_error;
  const std::vector<void*> out_bases = {after[0].data(), after[1].data(), after[2].data(),
                                        cs.bias != Bias::kNone ? after[3].data() : nullptr,
                                        cs.aux ? after[4].data() : nullptr,
                                        cs.residual ? after[5].data() : nullptr,
                                        cs.column_sums ? after[6].data() : nullptr};
  EpiOperands::Views got, in;
  ops.views(out_bases, Device::cpu(), got);
  ops.views(ops.host_bases(), Device::cpu(), in);
  GemmEpilogue check = got.epi;
  if (cs.grad) check.aux = &in.aux;  // the input (must be unchanged: below)
  const CheckResult r = check_gemm_epilogue(in.a, in.b, cs.beta != 0.0f ? &in.c : nullptr, got.c, check, cs.alpha,
                                            cs.beta);
  EXPECT_TRUE(r.passed) << r.failures << " of " << r.checked << " wrong; first: " << r.first_failure
                        << "; worst error/allowed = " << r.worst_ratio;
  int64_t first = -1;
  const size_t ce = dtype_size(cs.c_dtype());
  EXPECT_EQ(changed_elements(ops.lc, ce, ops.c0.data(), after[2].data(), true, &first), 0)
      << "C written outside its view, first at storage element " << first;
  if (cs.aux)
    EXPECT_EQ(changed_elements(ops.lc, ce, ops.aux0.data(), after[4].data(), !cs.grad, &first), 0)
        << (cs.grad ? "aux (an input) changed" : "aux written outside its view") << ", first at " << first;
  if (cs.column_sums)
    EXPECT_EQ(changed_elements(ops.lsums, 4, ops.sums0.data(), after[6].data(), true, &first), 0)
        << "column_sums written outside its view, first at " << first;
  if (cs.residual) EXPECT_EQ(changed_elements(ops.lc, ce, ops.res.data(), after[5].data(), false, &first), 0);
  if (cs.bias != Bias::kNone)
    EXPECT_EQ(changed_elements(ops.lbias, ce, ops.bias.data(), after[3].data(), false, &first), 0);
  EXPECT_EQ(changed_elements(ops.la, dtype_size(cs.dtype), ops.a.data(), after[0].data(), false, &first), 0);
}

// ---- the variants ---------------------------------------------------------------------------

using EpiParam = std::tuple<GemmVariant, DType>;

std::vector<EpiParam> cpu_params() {
  std::vector<EpiParam> out;
  for (GemmVariant v : {GemmVariant::kCpuNaive, GemmVariant::kCpuBlocked, GemmVariant::kCpuPacked, GemmVariant::kAuto})
    for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) out.emplace_back(v, d);
  out.emplace_back(GemmVariant::kCpuBlocked, DType::kF64);
  return out;
}

std::vector<EpiParam> cuda_params() {
  std::vector<EpiParam> out;
  for (GemmVariant v : {GemmVariant::kCudaNaive, GemmVariant::kCudaRegisterTiled, GemmVariant::kAuto})
    for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) out.emplace_back(v, d);
  for (GemmVariant v : {GemmVariant::kCudaMmaPipeline, GemmVariant::kCudaWgmmaPersistent})
    for (DType d : {DType::kBF16, DType::kF16}) out.emplace_back(v, d);
  return out;
}

std::string param_name(const ::testing::TestParamInfo<EpiParam>& info) {
  return std::string(gemm_variant_name(std::get<0>(info.param))) + "_" + dtype_label(std::get<1>(info.param));
}

bool hopper_device() {
#if OPTIMIZED_WITH_CUDA
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0) != cudaSuccess) return false;
  return major == 9 && minor == 0;
#else
  return false;
#endif
}

class Epilogue : public ::testing::TestWithParam<EpiParam> {
 protected:
  void SetUp() override {
    if (gemm_variant_is_cuda(variant()) || on_cuda_) {
      SKIP_WITHOUT_CUDA();
      if (variant() == GemmVariant::kCudaWgmmaPersistent && !hopper_device())
        GTEST_SKIP() << "wgmma_persistent runs on compute capability 9.0 only";
    }
  }
  GemmVariant variant() const { return std::get<0>(GetParam()); }
  DType dtype() const { return std::get<1>(GetParam()); }
  bool half() const { return dtype() == DType::kF16 || dtype() == DType::kBF16; }
  bool cpu() const { return !on_cuda_; }
  EpiCase base(int64_t m, int64_t n, int64_t k) const {
    EpiCase cs;
    cs.variant = variant();
    cs.dtype = dtype();
    cs.device = on_cuda_ ? Device::cuda(0) : Device::cpu();
    cs.m = m, cs.n = n, cs.k = k;
    // The Hopper rung loads through TMA (16-byte aligned rows of A and B); auto stages or falls
    // back by itself.
    cs.align16 = variant() == GemmVariant::kCudaWgmmaPersistent;
    return cs;
  }
  bool on_cuda_ = false;
};

class CpuEpilogue : public Epilogue {};
class CudaEpilogue : public Epilogue {
 protected:
  CudaEpilogue() { on_cuda_ = true; }
};

// Every feature alone and together, at a size that is no multiple of any tile.
void feature_sweep(const std::function<EpiCase(int64_t, int64_t, int64_t)>& base, int64_t m, int64_t n, int64_t k,
                   bool half) {
  std::vector<EpiCase> cases;
  auto add = [&](auto&& edit) {
    EpiCase cs = base(m, n, k);
    edit(cs);
    cases.push_back(cs);
  };
  add([](EpiCase& c) { c.bias = Bias::kN; });
  add([](EpiCase& c) { c.bias = Bias::kM; c.act = Activation::kRelu; });
  add([](EpiCase& c) { c.bias = Bias::kN; c.act = Activation::kGeluTanh; c.aux = true; });
  add([](EpiCase& c) { c.act = Activation::kGeluErf; c.aux = true; c.column_sums = true; });
  add([](EpiCase& c) { c.act = Activation::kSilu; c.residual = true; });
  add([](EpiCase& c) { c.residual = true; c.column_sums = true; c.alpha = -0.75f; });
  add([](EpiCase& c) { c.act = Activation::kGeluTanh; c.grad = true; c.aux = true; c.column_sums = true; });
  add([](EpiCase& c) { c.act = Activation::kSilu; c.grad = true; c.aux = true; c.bias = Bias::kN; });
  add([](EpiCase& c) { c.act = Activation::kRelu; c.grad = true; c.aux = true; c.residual = true; });
  add([](EpiCase& c) {
    c.bias = Bias::kN, c.act = Activation::kGeluErf, c.aux = true, c.residual = true, c.column_sums = true;
    c.beta = 0.5f, c.pad = 3;
  });
  add([](EpiCase& c) { c.beta = 1.0f; c.column_sums = true; c.pad = 5; });  // accumulate into C
  if (half) {
    add([](EpiCase& c) { c.c_fp32 = true; });  // an fp32 C, nothing else
    add([](EpiCase& c) { c.c_fp32 = true; c.beta = 1.0f; c.column_sums = true; });  // wgrad + bgrad into fp32
    add([](EpiCase& c) {
      c.c_fp32 = true, c.bias = Bias::kN, c.act = Activation::kGeluTanh, c.aux = true, c.residual = true;
    });
  }
  for (const EpiCase& cs : cases) expect_epilogue_ok(cs);
}

TEST_P(CpuEpilogue, EveryFeature) {
  feature_sweep([&](int64_t m, int64_t n, int64_t k) { return base(m, n, k); }, 37, 29, 45, half());
}

TEST_P(CpuEpilogue, OddSizesAndBatches) {
  for (const Mnk s : std::vector<Mnk>{{1, 1, 1}, {1, 17, 3}, {23, 1, 9}, {65, 67, 33}}) {
    EpiCase cs = base(s.m, s.n, s.k);
    cs.bias = Bias::kN, cs.act = Activation::kGeluTanh, cs.aux = true, cs.residual = true, cs.column_sums = true;
    expect_epilogue_ok(cs);
  }
  EpiCase cs = base(19, 21, 13);
  cs.batch = 3, cs.bias = Bias::kM, cs.act = Activation::kSilu, cs.aux = true, cs.column_sums = true, cs.pad = 2;
  expect_epilogue_ok(cs);
  cs.a_col_major = true, cs.b_col_major = true, cs.grad = true;
  expect_epilogue_ok(cs);
}

INSTANTIATE_TEST_SUITE_P(Cpu, CpuEpilogue, ::testing::ValuesIn(cpu_params()), param_name);

TEST_P(CudaEpilogue, EveryFeature) {
  feature_sweep([&](int64_t m, int64_t n, int64_t k) { return base(m, n, k); }, 131, 137, 203, half());
}

TEST_P(CudaEpilogue, OddSizes) {
  for (const Mnk s : odd_sizes()) {
    EpiCase cs = base(s.m, s.n, s.k);
    cs.bias = Bias::kN, cs.act = Activation::kGeluTanh, cs.aux = true, cs.residual = true, cs.column_sums = true;
    expect_epilogue_ok(cs);
  }
}

TEST_P(CudaEpilogue, TilesAndPaths) {
  // Several tiles in both directions, tile rows that leave a cluster's second block below the last
  // one (300 rows: 3 tiles of 128), N a multiple of 8 (the TMA-store path) and not (direct stores),
  // C fp32 (direct stores), the small-M configuration with split-K, the small tiles at M > 64 over
  // two waves (100 x 9000), and both layouts of B.
  for (const Mnk s : std::vector<Mnk>{{300, 512, 256}, {300, 513, 264}, {257, 384, 128}, {32, 1024, 4096},
                                      {8, 2048, 1024}, {100, 9000, 192}}) {
    for (bool c_fp32 : {false, true}) {
      if (c_fp32 && !half()) continue;
      EpiCase cs = base(s.m, s.n, s.k);
      cs.c_fp32 = c_fp32;
      cs.bias = Bias::kN, cs.act = Activation::kGeluErf, cs.aux = true, cs.residual = true, cs.column_sums = true;
      expect_epilogue_ok(cs);
      cs.b_col_major = true, cs.grad = true, cs.bias = Bias::kM, cs.residual = false;
      expect_epilogue_ok(cs);
    }
  }
}

// The Hopper rung's register epilogue (a bias along N, an activation, aux; a 16-bit C whose rows
// TMA can store: N a multiple of 8): every activation with and without aux, alpha != 1, column
// counts that end inside a 64-column chunk (the bias read stops at N, TMA clips the boxes), big
// tiles with a partial last tile row, batches and a column-major B, shapes whose big tiles fill
// under a wave (the small tiles with split-K: 256 x 1024 x 1024, 96 x 520 x 640; over two waves of
// them: 100 x 9000 x 192), and over a wave (2080 x 2104: the big tiles, several per block).
TEST_P(CudaEpilogue, RegisterEpilogue) {
  const Activation acts[] = {Activation::kNone, Activation::kRelu, Activation::kGeluErf, Activation::kGeluTanh,
                             Activation::kSilu};
  int i = 0;
  for (const Mnk s : std::vector<Mnk>{{300, 512, 256}, {130, 264, 72}, {256, 1024, 1024}, {96, 520, 640}, {1, 8, 8},
                                      {100, 9000, 192}}) {
    for (const Activation act : acts) {
      for (bool aux : {false, true}) {
        EpiCase cs = base(s.m, s.n, s.k);
        cs.act = act, cs.aux = aux;
        cs.bias = (++i % 3 == 0) ? Bias::kNone : Bias::kN;
        if (i % 4 == 0) cs.alpha = -0.5f;
        if (i % 5 == 0) cs.b_col_major = true;
        if (i % 7 == 0) cs.pad = 8;  // C and aux rows padded: TMA writes none of the padding
        SCOPED_TRACE(std::to_string(s.m) + "x" + std::to_string(s.n) + "x" + std::to_string(s.k) + " act " +
                     std::to_string(static_cast<int>(act)) + (aux ? " aux" : ""));
        expect_epilogue_ok(cs);
      }
    }
  }
  EpiCase cs = base(70, 96, 64);
  cs.batch = 3, cs.bias = Bias::kN, cs.act = Activation::kGeluErf, cs.aux = true;
  expect_epilogue_ok(cs);
  // A wave of big tiles or more (several tiles per persistent block), M and N past the last full
  // tile.
  EpiCase big = base(2080, 2104, 72);
  big.bias = Bias::kN, big.act = Activation::kGeluErf, big.aux = true;
  expect_epilogue_ok(big);
  big.bias = Bias::kNone, big.act = Activation::kSilu, big.aux = false, big.alpha = -0.5f, big.b_col_major = true;
  expect_epilogue_ok(big);
}

TEST_P(CudaEpilogue, BatchedLayoutsAndStreams) {
  EpiCase cs = base(70, 90, 60);
  cs.batch = 3, cs.bias = Bias::kN, cs.act = Activation::kSilu, cs.aux = true, cs.residual = true;
  cs.column_sums = true, cs.pad = 8;
  expect_epilogue_ok(cs);
  cs.a_col_major = true;
  expect_epilogue_ok(cs);
  cs.b_col_major = true, cs.grad = true;
  OwnStream stream;
  cs.stream = stream.get();
  expect_epilogue_ok(cs);
}

TEST_P(CudaEpilogue, ColumnSumsAreDeterministic) {
  EpiCase cs = base(1000, 264, 512);
  cs.column_sums = true, cs.act = Activation::kGeluTanh;
  const EpiOperands ops(cs);
  std::string e1, e2;
  const std::vector<Buffer> r1 = run_epilogue(ops, &e1), r2 = run_epilogue(ops, &e2);
  ASSERT_TRUE(e1.empty() && e2.empty()) << e1 << e2;
  EXPECT_EQ(std::memcmp(r1[6].data(), r2[6].data(), r1[6].bytes()), 0) << "column sums differ between two runs";
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaEpilogue, ::testing::ValuesIn(cuda_params()), param_name);

// ---- refusals -----------------------------------------------------------------------------

// Host operands for the error paths: A (4, 6), B (6, 5), C (4, 5) bf16, and epilogue tensors.
struct ErrorArgs {
  Buffer a{DType::kBF16, 24, Device::cpu()}, b{DType::kBF16, 30, Device::cpu()}, c{DType::kBF16, 40, Device::cpu()};
  Buffer bias{DType::kBF16, 8, Device::cpu()}, aux{DType::kBF16, 40, Device::cpu()}, sums{DType::kF32, 8, Device::cpu()};
  Buffer c32{DType::kF32, 20, Device::cpu()};
  TensorView A = raw(a.data(), DType::kBF16, Device::cpu(), {4, 6}, {6, 1});
  TensorView B = raw(b.data(), DType::kBF16, Device::cpu(), {6, 5}, {5, 1});
  TensorView C = raw(c.data(), DType::kBF16, Device::cpu(), {4, 5}, {5, 1});
  TensorView Bias5 = raw(bias.data(), DType::kBF16, Device::cpu(), {5}, {1});
  TensorView Aux = raw(aux.data(), DType::kBF16, Device::cpu(), {4, 5}, {5, 1});
  TensorView Sums = raw(sums.data(), DType::kF32, Device::cpu(), {5}, {1});
};

TEST(EpilogueErrors, ArgumentsAreNamed) {
  ErrorArgs x;
  const auto expect = [&](const GemmEpilogue& e, Status status, std::initializer_list<std::string> words,
                          GemmVariant v = GemmVariant::kAuto, const TensorView* c = nullptr) {
    const Caught caught = call([&] { matmul(x.A, x.B, c ? *c : x.C, e, 1.0f, 0.0f, v); });
    EXPECT_EQ(caught.status, status) << caught.message;
    EXPECT_TRUE(contains_all(caught.message, words));
  };
  {
    GemmEpilogue e;
    e.activation_grad = true;
    e.aux = &x.Aux;
    expect(e, Status::kInvalidArgument, {"activation_grad", "activation none"});
    e.activation = Activation::kGeluErf;
    e.aux = nullptr;
    expect(e, Status::kInvalidArgument, {"activation_grad", "no aux"});
  }
  {
    GemmEpilogue e;
    TensorView wrong = raw(x.bias.data(), DType::kBF16, Device::cpu(), {4}, {1});
    e.bias = &wrong;
    expect(e, Status::kInvalidArgument, {"bias", "5 elements"});
    e.bias_along_m = true;  // (M) = 4: fine
    EXPECT_FALSE(call([&] { matmul(x.A, x.B, x.C, e); }).thrown);
    TensorView strided = raw(x.bias.data(), DType::kBF16, Device::cpu(), {4}, {2});
    e.bias = &strided;
    expect(e, Status::kInvalidArgument, {"bias", "contiguous"});
    TensorView f32 = raw(x.sums.data(), DType::kF32, Device::cpu(), {4}, {1});
    e.bias = &f32;
    expect(e, Status::kInvalidArgument, {"bias", "bf16", "fp32"});
  }
  {
    GemmEpilogue e;
    TensorView shape = raw(x.aux.data(), DType::kBF16, Device::cpu(), {5, 4}, {4, 1});
    e.aux = &shape;
    expect(e, Status::kInvalidArgument, {"aux", "shape"});
    TensorView col = raw(x.aux.data(), DType::kBF16, Device::cpu(), {4, 5}, {1, 4});
    e.aux = &col;
    expect(e, Status::kInvalidArgument, {"aux", "row-major"});
    e.aux = nullptr;
    e.residual = &col;
    expect(e, Status::kInvalidArgument, {"residual", "row-major"});
    TensorView overlap = raw(x.c.data(), DType::kBF16, Device::cpu(), {4, 5}, {5, 1});
    e.residual = nullptr;
    e.aux = &overlap;
    expect(e, Status::kInvalidArgument, {"aux", "overlap", "c"});
  }
  {
    GemmEpilogue e;
    TensorView bf = raw(x.bias.data(), DType::kBF16, Device::cpu(), {5}, {1});
    e.column_sums = &bf;
    expect(e, Status::kInvalidArgument, {"column_sums", "fp32"});
    TensorView short_sums = raw(x.sums.data(), DType::kF32, Device::cpu(), {4}, {1});
    e.column_sums = &short_sums;
    expect(e, Status::kInvalidArgument, {"column_sums", "(5)"});
    e.column_sums = &x.Sums;
    e.bias = &x.Sums;  // an fp32 bias would be wrong anyway; the overlap must be named first or the dtype
    const Caught caught = call([&] { matmul(x.A, x.B, x.C, e); });
    EXPECT_EQ(caught.status, Status::kInvalidArgument);
    EXPECT_TRUE(mentions(caught.message, "bias")) << caught.message;
  }
  {
    GemmEpilogue e;
    e.activation = Activation::kRelu;
    TensorView col_c = raw(x.c.data(), DType::kBF16, Device::cpu(), {4, 5}, {1, 4});
    expect(e, Status::kInvalidArgument, {"c", "row-major", "epilogue"}, GemmVariant::kAuto, &col_c);
    // Variants that do not fuse epilogues say so and list those that do.
    expect(e, Status::kUnsupported, {"coalesced", "does not fuse epilogues", "wgmma_persistent", "cpu_naive"},
           GemmVariant::kCudaCoalesced);
  }
  {
    // An fp32 C from bf16 operands: only the epilogue rungs; fp16 C from bf16: never.
    TensorView c32 = raw(x.c32.data(), DType::kF32, Device::cpu(), {4, 5}, {5, 1});
    const Caught refused = call([&] { matmul(x.A, x.B, c32, 1.0f, 0.0f, GemmVariant::kCudaWmma); });
    EXPECT_EQ(refused.status, Status::kUnsupported) << refused.message;
    EXPECT_TRUE(contains_all(refused.message, {"wmma", "fp32 c from bf16"}));
    EXPECT_FALSE(call([&] { matmul(x.A, x.B, c32, 1.0f, 0.0f, GemmVariant::kCpuPacked); }).thrown);
    TensorView c16 = raw(x.c.data(), DType::kF16, Device::cpu(), {4, 5}, {5, 1});
    const Caught wrong = call([&] { matmul(x.A, x.B, c16); });
    EXPECT_EQ(wrong.status, Status::kInvalidArgument);
    EXPECT_TRUE(contains_all(wrong.message, {"c", "bf16", "fp32", "fp16"})) << wrong.message;
  }
}

TEST(EpilogueErrors, NamesAndQueries) {
  for (Activation a : {Activation::kNone, Activation::kRelu, Activation::kGeluErf, Activation::kGeluTanh,
                       Activation::kSilu})
    EXPECT_EQ(parse_activation(activation_name(a)), a);
  const Caught bad = call([] { parse_activation("tanh"); });
  EXPECT_EQ(bad.status, Status::kInvalidArgument);
  EXPECT_TRUE(contains_all(bad.message, {"activation", "gelu_tanh", "silu", "'tanh'"}));
  for (GemmVariant v : all_gemm_variants()) {
    const bool fuses = v == GemmVariant::kCpuNaive || v == GemmVariant::kCpuBlocked || v == GemmVariant::kCpuPacked ||
                       v == GemmVariant::kCudaNaive || v == GemmVariant::kCudaRegisterTiled ||
                       v == GemmVariant::kCudaMmaPipeline || v == GemmVariant::kCudaWgmmaPersistent;
    EXPECT_EQ(gemm_variant_supports_epilogue(v), fuses) << gemm_variant_name(v);
  }
  EXPECT_TRUE(gemm_variant_supports_epilogue(GemmVariant::kAuto));
  ErrorArgs x;
  GemmEpilogue e;
  e.column_sums = &x.Sums;
  EXPECT_EQ(matmul_workspace_bytes(x.A, x.B, x.C, e), 0u);  // the CPU needs none
  EXPECT_EQ(resolve_gemm_variant(x.A, x.B, x.C, e), GemmVariant::kCpuPacked);
}

TEST(EpilogueCudaWorkspace, QueriedAndChecked) {
  SKIP_WITHOUT_CUDA();
  // Column sums need partials in the workspace: the query says how much, a caller's smaller one is
  // refused naming the workspace, and the right size runs.
  EpiCase cs;
  cs.variant = GemmVariant::kCudaNaive;
  cs.dtype = DType::kF32;
  cs.device = Device::cuda(0);
  cs.m = 33, cs.n = 17, cs.k = 9;
  cs.column_sums = true;
  const EpiOperands ops(cs);
  std::vector<Buffer> after;
  const std::string error = run_on_cuda(ops.buffers(), cs.device, nullptr, [&](const std::vector<void*>& d) {
    EpiOperands::Views v;
    ops.views(d, cs.device, v);
    const size_t need = matmul_workspace_bytes(v.a, v.b, v.c, v.epi, 0.0f, cs.variant);
    EXPECT_GE(need, size_t(33 * 17 * 4));
    Buffer ws(DType::kF32, static_cast<int64_t>(need / 4 + 64), cs.device);
    ExecutionContext small;
    small.workspace = {ws.data(), need - 4};
    const Caught refused = call([&] { matmul(v.a, v.b, v.c, v.epi, 1.0f, 0.0f, cs.variant, small); });
    EXPECT_EQ(refused.status, Status::kInvalidArgument) << refused.message;
    EXPECT_TRUE(mentions(refused.message, "workspace")) << refused.message;
    ExecutionContext enough;
    enough.workspace = {ws.data(), need};
    matmul(v.a, v.b, v.c, v.epi, 1.0f, 0.0f, cs.variant, enough);
  }, after);
  ASSERT_TRUE(error.empty()) << error;
  EpiOperands::Views in, got;
  ops.views(ops.host_bases(), Device::cpu(), in);
  ops.views({after[0].data(), after[1].data(), after[2].data(), nullptr, nullptr, nullptr, after[6].data()},
            Device::cpu(), got);
  const CheckResult r = check_gemm_epilogue(in.a, in.b, nullptr, got.c, got.epi, 1.0f, 0.0f);
  EXPECT_TRUE(r.passed) << r.first_failure;
}

}  // namespace
}  // namespace optimized::testing
