// The scaled (fp8) GEMM, scaled_matmul (gemm.h), against the float64 reference of the dequantized
// inputs (testing/scaled_gemm_reference.h) on fresh random inputs: every variant (cpu and auto on
// CPU tensors; naive, wgmma_fp8 and auto on CUDA tensors, skipped with the reason without a CUDA
// device, wgmma_fp8 on compute capability 9.0 only), the fp8 format pairs (e5m2 x e5m2 refused), the
// output dtypes, bias present and absent, every scale layout of A crossed with every one of B, odd
// sizes, A row- and column-major, B column-major (K-major) and row-major, padded and misaligned
// leading dimensions and views, NaN propagation, a non-default stream (CPU: thread counts), the
// refusals naming their argument, the workspace query and a caller's workspace, and the names.
//
// Every run: A and B poisoned with NaN codes outside their views (a kernel that reads padding, or
// past K, gives NaN where the reference is finite), NaN after the last scale and after the bias
// (reading past them shows up the same way), C NaN before the run (an unwritten element shows up);
// then
//   1. every element of C (a sample of rows, columns and elements for the 1031 case) against the
//      reference: the GEMM rule (tolerance.h, fp32 accumulation) for cpu, naive and an auto that
//      cannot pick wgmma_fp8; scaled_gemm_allowed_error with promotion 128 for wgmma_fp8 and an
//      auto that may pick it; NaN exactly where the reference has NaN;
//   2. no byte of C's storage outside the view written; on CUDA, no byte of an input changed.
//
// Test names: the CUDA ones are the "Cuda/" instances and the ScaledGemmCuda* suites (ctest label
// cuda, tests/gemm/CMakeLists.txt); everything else runs on the CPU (label cpu).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "common/test_util.h"
#include "optimized/buffer.h"
#include "optimized/core.h"
#include "optimized/gemm.h"
#include "testing/linear_reference.h"
#include "testing/scaled_gemm_reference.h"
#include "testing/tolerance.h"

#if OPTIMIZED_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace optimized::testing {
namespace {

constexpr ScaleLayout kLayouts[] = {ScaleLayout::kTensor, ScaleLayout::kRowwise, ScaleLayout::kBlock1x128,
                                    ScaleLayout::kBlock128x128};
constexpr int64_t kTail = 16;      // NaN elements after the last scale and after the bias
constexpr uint8_t kNanCode = 0x7F;  // NaN in both formats (e4m3 S.1111.111, e5m2 S.11111.11)

int64_t blocks128(int64_t x) { return (x + 127) / 128; }
Fp8Format format_of(DType d) { return d == DType::kF8E5M2 ? Fp8Format::kE5M2 : Fp8Format::kE4M3; }
std::string name_of(DType d) { return std::string(dtype_name(d)); }
std::string name_of(ScaleLayout l) { return std::string(scale_layout_name(l)); }
std::string name_of(ScaledGemmVariant v) { return std::string(scaled_gemm_variant_name(v)); }
bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

// Every finite code of a format (NaN, and e5m2's infinities, left out): random codes spread over the
// whole range, subnormals included.
const std::vector<uint8_t>& finite_codes(Fp8Format f) {
  static const auto make = [](Fp8Format fmt) {
    std::vector<uint8_t> v;
    for (int i = 0; i < 256; ++i)
      if (std::isfinite(fp8_to_double(static_cast<uint8_t>(i), fmt))) v.push_back(static_cast<uint8_t>(i));
    return v;
  };
  static const std::vector<uint8_t> e4m3 = make(Fp8Format::kE4M3), e5m2 = make(Fp8Format::kE5M2);
  return f == Fp8Format::kE5M2 ? e5m2 : e4m3;
}

// The scale that brings a format's codes to values of order 1 (e4m3 reaches 448, e5m2 57344), as a
// quantizer's would: products and their sums then stay far inside fp16's range.
float base_scale(DType d) { return d == DType::kF8E5M2 ? std::ldexp(1.0f, -14) : std::ldexp(1.0f, -7); }

// ---- the case -----------------------------------------------------------------------------------

struct ScaledCase {
  ScaledGemmVariant variant = ScaledGemmVariant::kAuto;
  Device device = Device::cpu();
  int64_t m = 1, n = 1, k = 1;
  DType a_dtype = DType::kF8E4M3, b_dtype = DType::kF8E4M3, c_dtype = DType::kBF16;
  ScaleLayout la = ScaleLayout::kTensor, lb = ScaleLayout::kTensor;
  bool bias = false;
  bool a_col_major = false;  // A (M, K) row-major (K-major) unless set
  bool b_row_major = false;  // B (K, N) column-major (K-major: stored N x K) unless set
  int64_t lda_pad = 0, ldb_pad = 0, ldc_pad = 0;  // leading dimension = stored width + pad
  int64_t offset = 0;  // elements from each buffer's (256-byte aligned) start to the A, B and C views
  int scale_rank = 0;  // 0: the scales' natural shape ((M), (M, K/128), ...); 1: flat; 3: (1, natural...)
  int cpu_threads = 0;
  void* stream = nullptr;  // cudaStream_t (nullptr: the legacy default stream)
  int64_t samples = 0;     // 0: check every element; otherwise the first and last rows and columns and this many more

  GuardedLayout layout(int64_t rows, int64_t cols, bool col_major, int64_t pad) const {
    GuardedLayout l;
    l.rows = rows;
    l.cols = cols;
    l.col_major = col_major;
    l.ld = l.stored_cols() + pad;
    l.offset = offset;
    return l;
  }
  GuardedLayout layout_a() const { return layout(m, k, a_col_major, lda_pad); }
  GuardedLayout layout_b() const { return layout(k, n, !b_row_major, ldb_pad); }
  GuardedLayout layout_c() const { return layout(m, n, false, ldc_pad); }

  std::string describe() const {
    std::ostringstream s;
    s << name_of(variant) << " on " << device_name(device) << " M=" << m << " N=" << n << " K=" << k << " a "
      << name_of(a_dtype) << (a_col_major ? " col-major" : " row-major") << " lda=" << layout_a().ld << ", b "
      << name_of(b_dtype) << (b_row_major ? " row-major" : " col-major") << " ldb=" << layout_b().ld << ", c "
      << name_of(c_dtype) << " ldc=" << layout_c().ld << ", scales " << name_of(la) << " x " << name_of(lb);
    if (scale_rank) s << " (scale rank " << scale_rank << ")";
    s << (bias ? ", bias" : ", no bias");
    if (offset) s << " offset=" << offset;
    if (cpu_threads) s << " threads=" << cpu_threads;
    if (stream) s << " (own stream)";
    if (samples) s << " sampled";
    return s.str();
  }
};

// The natural shape of an operand's scales (gemm.h): a is A (M x K), else B (K x N).
std::vector<int64_t> scale_shape(ScaleLayout layout, int64_t m, int64_t n, int64_t k, bool a, int rank) {
  std::vector<int64_t> shape;
  switch (layout) {
    case ScaleLayout::kTensor: shape = {1}; break;
    case ScaleLayout::kRowwise: shape = {a ? m : n}; break;
    case ScaleLayout::kBlock1x128: shape = {a ? m : n, blocks128(k)}; break;
    case ScaleLayout::kBlock128x128:
      shape = a ? std::vector<int64_t>{blocks128(m), blocks128(k)} : std::vector<int64_t>{blocks128(k), blocks128(n)};
      break;
  }
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  if (rank == 1) return {count};
  if (rank == 3) shape.insert(shape.begin(), 1);
  return shape;
}

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= shape[i];
  }
  return strides;
}

// Host operands of a case, filled and poisoned. Tests may edit them (plant NaN, set known values)
// before running.
struct ScaledOperands {
  ScaledCase cs;
  GuardedLayout la, lb, lc;
  std::vector<int64_t> sa_shape, sb_shape;
  int64_t sa_count = 0, sb_count = 0;
  Buffer a, b, c0, sa, sb, bias;  // host; bias empty without one

  explicit ScaledOperands(const ScaledCase& c)
      : cs(c), la(c.layout_a()), lb(c.layout_b()), lc(c.layout_c()),
        sa_shape(scale_shape(c.la, c.m, c.n, c.k, true, c.scale_rank)),
        sb_shape(scale_shape(c.lb, c.m, c.n, c.k, false, c.scale_rank)),
        sa_count(scale_count(c.la, c.m, c.k, true)), sb_count(scale_count(c.lb, c.k, c.n, false)),
        a(c.a_dtype, la.storage(), Device::cpu()), b(c.b_dtype, lb.storage(), Device::cpu()),
        c0(c.c_dtype, lc.storage(), Device::cpu()), sa(DType::kF32, sa_count + kTail, Device::cpu()),
        sb(DType::kF32, sb_count + kTail, Device::cpu()) {
    std::mt19937_64 rng = test_rng();
    for (Buffer* buf : {&a, &b, &c0, &sa, &sb}) buf->fill_bytes(0xFF);  // NaN everywhere outside the views
    fill_codes(a, la, format_of(c.a_dtype), rng);
    fill_codes(b, lb, format_of(c.b_dtype), rng);
    fill_scales(sa, sa_count, base_scale(c.a_dtype), rng);
    fill_scales(sb, sb_count, base_scale(c.b_dtype), rng);
    if (c.bias) {
      bias = Buffer(c.c_dtype, c.n + kTail, Device::cpu());
      bias.fill_bytes(0xFF);
      std::uniform_real_distribution<double> dist(-2.0, 2.0);
      for (int64_t j = 0; j < c.n; ++j) store_from_double(bias.data(), c.c_dtype, j, dist(rng));
    }
  }

  static void fill_codes(Buffer& buf, const GuardedLayout& l, Fp8Format f, std::mt19937_64& rng) {
    const std::vector<uint8_t>& codes = finite_codes(f);
    auto* p = static_cast<uint8_t*>(buf.data());
    for (int64_t i = 0; i < l.rows; ++i)
      for (int64_t j = 0; j < l.cols; ++j) p[l.index(i, j)] = codes[rng() % codes.size()];
  }
  // Random positive scales around `base`, spanning 2^-2 .. 2^3 of it, with full mantissas.
  static void fill_scales(Buffer& buf, int64_t count, float base, std::mt19937_64& rng) {
    auto* p = static_cast<float*>(buf.data());
    for (int64_t i = 0; i < count; ++i)
      p[i] = base * std::ldexp(1.0f + static_cast<float>(rng() % 100000) / 100000.0f, static_cast<int>(rng() % 5) - 2);
  }

  void set_a(int64_t i, int64_t kk, uint8_t code) { static_cast<uint8_t*>(a.data())[la.index(i, kk)] = code; }
  void set_b(int64_t kk, int64_t j, uint8_t code) { static_cast<uint8_t*>(b.data())[lb.index(kk, j)] = code; }
  float* scales_a() const { return static_cast<float*>(sa.data()); }
  float* scales_b() const { return static_cast<float*>(sb.data()); }
  double bias_at(int64_t j) const { return cs.bias ? load_as_double(bias.data(), cs.c_dtype, j) : 0.0; }

  // The views at bases (host or device copies of the buffers above) on `d`.
  TensorView view_a(void* base, Device d) const { return matrix(base, cs.a_dtype, d, la); }
  TensorView view_b(void* base, Device d) const { return matrix(base, cs.b_dtype, d, lb); }
  TensorView view_c(void* base, Device d) const { return matrix(base, cs.c_dtype, d, lc); }
  TensorView view_sa(void* base, Device d) const { return raw(base, DType::kF32, d, sa_shape, contiguous_strides(sa_shape)); }
  TensorView view_sb(void* base, Device d) const { return raw(base, DType::kF32, d, sb_shape, contiguous_strides(sb_shape)); }
  TensorView view_bias(void* base, Device d) const { return raw(base, cs.c_dtype, d, {cs.n}, {1}); }

  static TensorView matrix(void* base, DType dtype, Device d, const GuardedLayout& l) {
    void* data = static_cast<char*>(base) + l.offset * static_cast<int64_t>(dtype_size(dtype));
    return raw(data, dtype, d, {l.rows, l.cols}, {l.col_major ? 1 : l.ld, l.col_major ? l.ld : 1});
  }

  // The operands as the reference reads them (host).
  ScaledOperand ref_a() const { return ref(a, la, cs.a_dtype, scales_a(), cs.la); }
  ScaledOperand ref_b() const { return ref(b, lb, cs.b_dtype, scales_b(), cs.lb); }
  static ScaledOperand ref(const Buffer& buf, const GuardedLayout& l, DType dtype, const float* scale, ScaleLayout layout) {
    ScaledOperand op;
    op.data = static_cast<const uint8_t*>(buf.data()) + l.offset;
    op.rows = l.rows;
    op.cols = l.cols;
    op.row_stride = l.col_major ? 1 : l.ld;
    op.col_stride = l.col_major ? l.ld : 1;
    op.format = format_of(dtype);
    op.scale = scale;
    op.layout = layout;
    return op;
  }
};

// ---- wgmma_fp8's availability ---------------------------------------------------------------------

// Compute capability (major * 10 + minor) of CUDA device 0; 0 without one.
int compute_capability() {
#if OPTIMIZED_WITH_CUDA
  if (cuda_device_count() == 0) return 0;
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
  return major * 10 + minor;
#else
  return 0;
#endif
}

std::string cc_string(int cc) { return std::to_string(cc / 10) + "." + std::to_string(cc % 10); }

// Why wgmma_fp8 cannot run here; empty when it can: no CUDA device, a device other than compute
// capability 9.0 (sm_90a code), or a build without the sm_90a rungs (a forced 1x1x1 call says so).
// Any other error of the probe is left for the tests themselves to report.
const std::string& wgmma_fp8_unavailable() {
  static const std::string why = []() -> std::string {
    if (cuda_device_count() == 0) return "no CUDA device: " + cuda_unavailable_reason();
    const int cc = compute_capability();
    if (cc != 90) return "wgmma_fp8 is sm_90a code (compute capability 9.0 only); device 0 is " + cc_string(cc);
#if OPTIMIZED_WITH_CUDA
    Buffer a(DType::kF8E4M3, 256, Device::cuda()), c(DType::kF32, 64, Device::cuda()), s(DType::kF32, 64, Device::cuda());
    a.fill_bytes(0x38);  // 1.0
    const std::vector<float> ones(64, 1.0f);
    s.copy_from_host(ones.data());
    try {
      scaled_matmul(a.view({1, 1}), a.view({1, 1}), c.view({1, 1}), s.view({1}), ScaleLayout::kTensor, s.view({1}),
                    ScaleLayout::kTensor, nullptr, ScaledGemmVariant::kCudaWgmmaFp8);
      cudaDeviceSynchronize();
    } catch (const Error& e) {
      if (std::string(e.what()).find("not in this build") != std::string::npos) return e.what();
    }
#endif
    return "";
  }();
  return why;
}

// Whether a run of cs may go through wgmma_fp8 (and is held to its bound).
bool may_run_wgmma_fp8(const ScaledCase& cs) {
  if (cs.variant == ScaledGemmVariant::kCudaWgmmaFp8) return true;
  return cs.variant == ScaledGemmVariant::kAuto && cs.device.is_cuda() && cs.lb != ScaleLayout::kBlock1x128 &&
         wgmma_fp8_unavailable().empty();
}

// ---- running and checking ---------------------------------------------------------------------------

struct ScaledRun {
  Buffer c;  // host copy of C's storage after the run
  int64_t checked = 0, failures = 0;
  std::string first_failure;
  double worst_ratio = 0;
  int64_t written_outside = 0;
  std::string first_outside;
  std::string inputs_changed;  // CUDA runs: the inputs whose storage changed
  std::string cuda_error;
};

// scaled_matmul on the views at bases d (a, b, c, scale_a, scale_b, bias) on the case's device.
void call_scaled(const ScaledOperands& ops, const std::vector<void*>& d, const ExecutionContext& ctx) {
  const ScaledCase& cs = ops.cs;
  const Device dev = cs.device;
  const TensorView bias = cs.bias ? ops.view_bias(d[5], dev) : TensorView{};
  scaled_matmul(ops.view_a(d[0], dev), ops.view_b(d[1], dev), ops.view_c(d[2], dev), ops.view_sa(d[3], dev), cs.la,
                ops.view_sb(d[4], dev), cs.lb, cs.bias ? &bias : nullptr, cs.variant, ctx);
}

// The output against the float64 reference (check_scaled_gemm): the wgmma_fp8 bound where the
// case may run it, else the plain GEMM rule (fp32 accumulation throughout).
void check_output(const ScaledOperands& ops, ScaledRun& run) {
  const ScaledCase& cs = ops.cs;
  std::vector<double> bias;
  for (int64_t j = 0; cs.bias && j < cs.n; ++j) bias.push_back(ops.bias_at(j));
  const void* c = static_cast<const char*>(run.c.data()) + ops.lc.offset * static_cast<int64_t>(dtype_size(cs.c_dtype));
  const CheckResult r = check_scaled_gemm(ops.ref_a(), ops.ref_b(), cs.bias ? bias.data() : nullptr, c, cs.c_dtype,
                                          ops.lc.ld, may_run_wgmma_fp8(cs) ? 128 : 0, cs.samples);
  run.checked = r.checked;
  run.failures = r.failures;
  run.first_failure = r.first_failure;
  run.worst_ratio = r.worst_ratio;
}

// Runs the case on ops (throws what scaled_matmul throws) and checks the output. ws: a caller's
// workspace for the CUDA run (ExecutionContext::workspace), or none.
ScaledRun run_scaled(const ScaledOperands& ops, const Workspace& ws = {}) {
  const ScaledCase& cs = ops.cs;
  ScaledRun run;
  ExecutionContext ctx;
  ctx.cpu_threads = cs.cpu_threads;
  ctx.cuda_stream = cs.stream;
  ctx.workspace = ws;
  if (!cs.device.is_cuda()) {
    run.c = Buffer(cs.c_dtype, ops.lc.storage(), Device::cpu());
    std::memcpy(run.c.data(), ops.c0.data(), ops.c0.bytes());
    call_scaled(ops, {ops.a.data(), ops.b.data(), run.c.data(), ops.sa.data(), ops.sb.data(), ops.bias.data()}, ctx);
  } else {
    std::vector<Buffer> after;
    const std::vector<const Buffer*> host = {&ops.a, &ops.b, &ops.c0, &ops.sa, &ops.sb, cs.bias ? &ops.bias : nullptr};
    run.cuda_error = run_on_cuda(host, cs.device, cs.stream,
                                 [&](const std::vector<void*>& d) { call_scaled(ops, d, ctx); }, after);
    if (!run.cuda_error.empty()) return run;
    run.c = std::move(after[2]);
    const char* names[] = {"a", "b", "", "scale_a", "scale_b", "bias"};
    for (size_t i = 0; i < host.size(); ++i)
      if (i != 2 && host[i] && std::memcmp(host[i]->data(), after[i].data(), host[i]->bytes()) != 0)
        run.inputs_changed += std::string(run.inputs_changed.empty() ? "" : ", ") + names[i];
  }
  check_output(ops, run);
  int64_t first = -1;
  run.written_outside = changed_elements(ops.lc, dtype_size(cs.c_dtype), ops.c0.data(), run.c.data(), true, &first);
  if (run.written_outside) run.first_outside = "element " + std::to_string(first) + " of C's storage";
  return run;
}

// Runs and asserts: no throw, C within the bound everywhere checked, nothing outside C's view
// written, no input changed.
ScaledRun expect_run_ok(const ScaledOperands& ops, const Workspace& ws = {}) {
  const ScaledCase& cs = ops.cs;
  ScaledRun run;
  try {
    run = run_scaled(ops, ws);
  } catch (const Error& e) {
    ADD_FAILURE() << cs.describe() << ": scaled_matmul threw (" << status_name(e.status()) << "): " << e.what();
    return run;
  }
  if (!run.cuda_error.empty()) {
    ADD_FAILURE() << cs.describe() << ": " << run.cuda_error;
    return run;
  }
  EXPECT_EQ(run.failures, 0) << cs.describe() << ": " << run.failures << " of " << run.checked
                             << " elements wrong; first: " << run.first_failure
                             << "; worst error / allowed = " << run.worst_ratio;
  EXPECT_EQ(run.written_outside, 0) << cs.describe() << ": wrote outside C's view, first at " << run.first_outside;
  EXPECT_EQ(run.inputs_changed, "") << cs.describe() << ": changed its inputs";
  return run;
}

void expect_ok(const ScaledCase& cs) {
  const ScaledOperands ops(cs);
  expect_run_ok(ops);
}

// What scaled_matmul throws for cs (run as expect_ok would run it); thrown = false when it ran.
Caught refusal_of(const ScaledCase& cs) {
  const ScaledOperands ops(cs);
  return call([&] {
    const ScaledRun run = run_scaled(ops);
    if (!run.cuda_error.empty()) ADD_FAILURE() << cs.describe() << ": " << run.cuda_error;
  });
}

// The error must have `status` and a message that starts with `prefix` ("scale_b: ") and contains
// every one of `parts`.
void expect_refusal(const Caught& c, Status status, const std::string& prefix,
                    std::initializer_list<std::string> parts = {}) {
  ASSERT_TRUE(c.thrown) << "expected an Error (" << status_name(status) << ") starting '" << prefix << "'";
  EXPECT_EQ(c.status, status) << "got " << status_name(c.status) << ": " << c.message;
  EXPECT_TRUE(starts_with(c.message, prefix)) << "message should start with '" << prefix << "': " << c.message;
  EXPECT_TRUE(contains_all(c.message, parts));
}

// ---- the variants, on every case ------------------------------------------------------------------

struct Rung {
  ScaledGemmVariant variant;
  bool cuda;
};
void PrintTo(const Rung& r, std::ostream* os) { *os << name_of(r.variant) << (r.cuda ? " on CUDA" : " on the CPU"); }

class ScaledGemm : public ::testing::TestWithParam<Rung> {
 protected:
  void SetUp() override {
    if (!GetParam().cuda) return;
    SKIP_WITHOUT_CUDA();
    if (variant() == ScaledGemmVariant::kCudaWgmmaFp8)
      if (const std::string& why = wgmma_fp8_unavailable(); !why.empty())
        GTEST_SKIP() << why << " (ScaledGemmCudaErrors.WgmmaFp8OffHopperNamesTheComputeCapability checks the refusal)";
  }
  ScaledGemmVariant variant() const { return GetParam().variant; }
  Device device() const { return GetParam().cuda ? Device::cuda(0) : Device::cpu(); }
  bool is_wgmma() const { return variant() == ScaledGemmVariant::kCudaWgmmaFp8; }
  // B's scale layouts the rung takes (wgmma_fp8 refuses block_1x128).
  std::vector<ScaleLayout> b_layouts() const {
    std::vector<ScaleLayout> out;
    for (ScaleLayout l : kLayouts)
      if (!is_wgmma() || l != ScaleLayout::kBlock1x128) out.push_back(l);
    return out;
  }
  ScaledCase base(int64_t m, int64_t n, int64_t k) const {
    ScaledCase cs;
    cs.variant = variant();
    cs.device = device();
    cs.m = m;
    cs.n = n;
    cs.k = k;
    return cs;
  }
};

constexpr std::pair<DType, DType> kFormats[] = {
    {DType::kF8E4M3, DType::kF8E4M3}, {DType::kF8E4M3, DType::kF8E5M2}, {DType::kF8E5M2, DType::kF8E4M3}};
constexpr DType kOutputs[] = {DType::kF32, DType::kBF16, DType::kF16};

// A small product with exact values: C = (0.5 A) @ (B . [1, 3] per column) + bias, in fp32.
TEST_P(ScaledGemm, KnownValues) {
  ScaledCase cs = base(2, 2, 2);
  cs.a_dtype = DType::kF8E4M3;
  cs.b_dtype = DType::kF8E5M2;
  cs.c_dtype = DType::kF32;
  cs.lb = ScaleLayout::kRowwise;
  cs.bias = true;
  ScaledOperands ops(cs);
  // A = [[1, 2], [0.5, -4]] (e4m3), B = [[1, 0], [0, 2]] (e5m2), scale_a 0.5, scale_b per column
  // [1, 3], bias [0.25, -1]: deq(A) = [[0.5, 1], [0.25, -2]], deq(B) = [[1, 0], [0, 6]].
  ops.set_a(0, 0, 0x38), ops.set_a(0, 1, 0x40), ops.set_a(1, 0, 0x30), ops.set_a(1, 1, 0xC8);
  ops.set_b(0, 0, 0x3C), ops.set_b(0, 1, 0x00), ops.set_b(1, 0, 0x00), ops.set_b(1, 1, 0x40);
  ops.scales_a()[0] = 0.5f;
  ops.scales_b()[0] = 1.0f, ops.scales_b()[1] = 3.0f;
  store_from_double(ops.bias.data(), DType::kF32, 0, 0.25);
  store_from_double(ops.bias.data(), DType::kF32, 1, -1.0);
  const ScaledRun run = expect_run_ok(ops);
  if (run.c.data() == nullptr) return;
  const double want[2][2] = {{0.75, 5.0}, {0.5, -13.0}};
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j)
      EXPECT_EQ(load_as_double(run.c.data(), DType::kF32, ops.lc.index(i, j)), want[i][j]) << i << ", " << j;
}

// e4m3 x e4m3, e4m3 x e5m2, e5m2 x e4m3, into fp32, bf16 and fp16, with and without bias (the scale
// layouts rotate); e5m2 x e5m2 is refused, naming b.
TEST_P(ScaledGemm, FormatsOutputDtypesAndBias) {
  const std::vector<ScaleLayout> bl = b_layouts();
  int i = 0;
  for (const auto& [fa, fb] : kFormats)
    for (DType out : kOutputs)
      for (bool bias : {false, true}) {
        ScaledCase cs = base(127, 129, 131);
        cs.a_dtype = fa;
        cs.b_dtype = fb;
        cs.c_dtype = out;
        cs.bias = bias;
        cs.la = kLayouts[i % 4];
        cs.lb = bl[(i / 4) % bl.size()];
        ++i;
        expect_ok(cs);
      }
  ScaledCase cs = base(17, 33, 65);
  cs.a_dtype = cs.b_dtype = DType::kF8E5M2;
  expect_refusal(refusal_of(cs), Status::kUnsupported, "b: ", {"fp8_e5m2"});
}

// The epilogue overload (what an fp8 linear layer asks): pre = product + bias + beta * C, aux = pre,
// C = act(pre), for every activation, beta 0 and 0.5, bf16 and fp32 outputs, odd sizes over
// several tiles; aux and C both against the float64 reference, nothing outside their views written.
TEST_P(ScaledGemm, EpilogueActivationAuxAndBeta) {
  int i = 0;
  for (Activation act : {Activation::kNone, Activation::kRelu, Activation::kGeluErf, Activation::kGeluTanh,
                         Activation::kSilu})
    for (float beta : {0.0f, 0.5f})
      for (DType out : {DType::kBF16, DType::kF32}) {
        ScaledCase cs = base(133 + 64 * (i % 3), 259, 200);
        cs.c_dtype = out;
        cs.bias = i % 2 == 0;
        cs.ldc_pad = 3;
        ++i;
        SCOPED_TRACE(cs.describe() + " act=" + std::string(activation_name(act)) + " beta=" + std::to_string(beta));
        ScaledOperands ops(cs);
        // C (read with beta) random in its view, NaN outside; aux NaN everywhere before the run.
        Buffer c0(out, ops.lc.storage(), Device::cpu()), aux(out, ops.lc.storage(), Device::cpu());
        std::memcpy(c0.data(), ops.c0.data(), c0.bytes());
        std::memcpy(aux.data(), ops.c0.data(), aux.bytes());
        std::mt19937_64 rng = test_rng();
        std::uniform_real_distribution<double> u(-1.0, 1.0);
        for (int64_t r = 0; r < cs.m; ++r)
          for (int64_t c = 0; c < cs.n; ++c) store_from_double(c0.data(), out, ops.lc.index(r, c), u(rng));
        std::vector<double> ref(static_cast<size_t>(cs.m * cs.n)), mag(ref.size());
        scaled_matmul_reference_f64(ops.ref_a(), ops.ref_b(), ref.data(), mag.data());
        const auto call_on = [&](const std::vector<void*>& d, Device dev) {
          GemmEpilogue e;
          const TensorView bias = cs.bias ? ops.view_bias(d[5], dev) : TensorView{};
          const TensorView auxv = ops.view_c(d[6], dev);
          e.bias = cs.bias ? &bias : nullptr;
          e.activation = act;
          e.aux = &auxv;
          ExecutionContext ctx;
          scaled_matmul(ops.view_a(d[0], dev), ops.view_b(d[1], dev), ops.view_c(d[2], dev), ops.view_sa(d[3], dev),
                        cs.la, ops.view_sb(d[4], dev), cs.lb, e, beta, cs.variant, ctx);
        };
        std::vector<const Buffer*> host = {&ops.a, &ops.b, &c0, &ops.sa, &ops.sb, cs.bias ? &ops.bias : nullptr, &aux};
        std::vector<Buffer> after;
        if (cs.device.is_cuda()) {
          const std::string err = run_on_cuda(host, cs.device, nullptr, [&](const std::vector<void*>& d) { call_on(d, cs.device); }, after);
          ASSERT_TRUE(err.empty()) << err;
        } else {
          std::vector<void*> d;
          for (const Buffer* h : host) {
            after.emplace_back(h ? h->dtype() : DType::kF32, h ? h->count() : 1, Device::cpu());
            if (h) std::memcpy(after.back().data(), h->data(), h->bytes());
            d.push_back(h ? after.back().data() : nullptr);
          }
          call_on(d, Device::cpu());
        }
        const int64_t promotion = may_run_wgmma_fp8(cs) ? 128 : 0;
        int64_t bad = 0;
        std::string first;
        for (int64_t r = 0; r < cs.m; ++r)
          for (int64_t c = 0; c < cs.n; ++c) {
            const size_t o = static_cast<size_t>(r * cs.n + c);
            const double c_old = load_as_double(c0.data(), out, ops.lc.index(r, c));
            const double pre = ref[o] + ops.bias_at(c) + beta * c_old;
            const double m2 = mag[o] + std::fabs(ops.bias_at(c)) + std::fabs(beta * c_old);
            const double y = activation_f64(act, pre);
            const double got_aux = load_as_double(after[6].data(), out, ops.lc.index(r, c));
            const double got_c = load_as_double(after[2].data(), out, ops.lc.index(r, c));
            const double tol_pre = scaled_gemm_allowed_error(out, cs.k, promotion, pre, m2);
            const double tol_y = 1.2 * scaled_gemm_allowed_error(out, cs.k, promotion, y, m2) + 1e-6 * std::fabs(pre);
            if (!(std::fabs(got_aux - pre) <= tol_pre) || !(std::fabs(got_c - y) <= tol_y)) {
              if (bad++ == 0)
                first = "(" + std::to_string(r) + ", " + std::to_string(c) + "): aux " + std::to_string(got_aux) +
                        " vs " + std::to_string(pre) + ", c " + std::to_string(got_c) + " vs " + std::to_string(y);
            }
          }
        EXPECT_EQ(bad, 0) << "first: " << first;
        int64_t at = -1;
        EXPECT_EQ(changed_elements(ops.lc, dtype_size(out), c0.data(), after[2].data(), true, &at), 0) << "C, at " << at;
        EXPECT_EQ(changed_elements(ops.lc, dtype_size(out), aux.data(), after[6].data(), true, &at), 0)
            << "aux, at " << at;
      }
}

// Every scale layout of A crossed with every one of B: M = 260 (three tile rows: the second tile of
// a cluster of two lies past the last), N = 257, K = 300 (two full 128-blocks and 44). wgmma_fp8
// refuses B's block_1x128 scales, naming scale_b.
TEST_P(ScaledGemm, EveryScaleLayoutPair) {
  int i = 0;
  for (ScaleLayout la : kLayouts)
    for (ScaleLayout lb : kLayouts) {
      ScaledCase cs = base(260, 257, 300);
      cs.la = la;
      cs.lb = lb;
      cs.a_dtype = kFormats[i % 3].first;
      cs.b_dtype = kFormats[i % 3].second;
      cs.c_dtype = kOutputs[(i / 3) % 3];
      cs.bias = i % 2 == 1;
      ++i;
      if (is_wgmma() && lb == ScaleLayout::kBlock1x128) {
        SCOPED_TRACE(cs.describe());
        expect_refusal(refusal_of(cs), Status::kUnsupported, "scale_b: ", {"block_1x128"});
        continue;
      }
      expect_ok(cs);
    }
}

// Odd sizes (1, primes, K not a multiple of 128, M or N below one tile) in the four operand layouts:
// A row- or column-major, B column-major (K-major) or row-major.
TEST_P(ScaledGemm, OddSizesAndOperandLayouts) {
  const struct {
    int64_t m, n, k;
  } sizes[] = {{1, 1, 1},     {1, 257, 129},   {17, 33, 65}, {127, 129, 131}, {128, 128, 128},
               {255, 257, 300}, {3, 300, 200}, {300, 5, 260}, {200, 1, 130},  {64, 96, 16}};
  const std::vector<ScaleLayout> bl = b_layouts();
  int i = 0;
  for (const auto& s : sizes)
    for (int layout = 0; layout < 4; ++layout) {
      ScaledCase cs = base(s.m, s.n, s.k);
      cs.a_col_major = (layout & 1) != 0;
      cs.b_row_major = (layout & 2) != 0;
      cs.la = kLayouts[(i + layout) % 4];
      cs.lb = bl[(i / 4 + 1) % bl.size()];
      cs.a_dtype = kFormats[i % 3].first;
      cs.b_dtype = kFormats[i % 3].second;
      cs.c_dtype = kOutputs[(i / 2) % 3];
      cs.bias = i % 3 == 0;
      ++i;
      expect_ok(cs);
    }
}

// Leading dimensions padded: to keep rows 16-byte aligned (wgmma_fp8's TMA reads them where they
// are), by odd amounts (rows not aligned: wgmma_fp8 copies them first), and views that start at an
// odd element (A and B not 16-byte aligned, C not aligned for paired stores); ldc padded.
TEST_P(ScaledGemm, PaddedAndMisalignedLeadingDimensions) {
  const struct {
    int64_t lda_pad, ldb_pad, ldc_pad, offset;
  } pads[] = {{16, 32, 8, 0}, {3, 5, 7, 0}, {0, 0, 0, 1}, {13, 11, 1, 3}};
  const struct {
    int64_t m, n, k;
  } sizes[] = {{129, 131, 260}, {64, 48, 256}};
  int i = 0;
  for (const auto& s : sizes)
    for (const auto& p : pads)
      for (int layout = 0; layout < 4; ++layout) {
        ScaledCase cs = base(s.m, s.n, s.k);
        cs.a_col_major = (layout & 1) != 0;
        cs.b_row_major = (layout & 2) != 0;
        cs.lda_pad = p.lda_pad;
        cs.ldb_pad = p.ldb_pad;
        cs.ldc_pad = p.ldc_pad;
        cs.offset = p.offset;
        cs.la = i % 2 ? ScaleLayout::kBlock1x128 : ScaleLayout::kRowwise;
        cs.lb = i % 3 ? ScaleLayout::kBlock128x128 : ScaleLayout::kTensor;
        cs.c_dtype = kOutputs[i % 3];
        cs.bias = i % 2 == 0;
        ++i;
        expect_ok(cs);
      }
}

// 1031 x 1029 x 1027 (no dimension a multiple of anything), K-major and transposed; checked on the
// first and last rows and columns and 2000 elements more.
TEST_P(ScaledGemm, Large1031x1029x1027Sampled) {
  ScaledCase cs = base(1031, 1029, 1027);
  cs.samples = 2000;
  cs.la = ScaleLayout::kBlock1x128;
  cs.lb = ScaleLayout::kBlock128x128;
  cs.bias = true;
  expect_ok(cs);
  cs.a_col_major = true;
  cs.b_row_major = true;
  cs.a_dtype = DType::kF8E5M2;
  cs.c_dtype = DType::kF16;
  cs.la = ScaleLayout::kRowwise;
  cs.lb = ScaleLayout::kTensor;
  cs.bias = false;
  expect_ok(cs);
}

// A NaN code in A row r makes C row r NaN, one in B column j C column j; everything else matches.
TEST_P(ScaledGemm, NanInARowOrBColumnPropagates) {
  for (int layout = 0; layout < 2; ++layout) {
    ScaledCase cs = base(130, 140, 260);
    cs.a_col_major = cs.b_row_major = layout == 1;
    cs.la = ScaleLayout::kBlock1x128;
    cs.lb = ScaleLayout::kBlock128x128;
    cs.c_dtype = layout == 0 ? DType::kBF16 : DType::kF32;
    SCOPED_TRACE(cs.describe());
    ScaledOperands ops(cs);
    const int64_t row = 77, col = 33;
    ops.set_a(row, 200, kNanCode);
    ops.set_b(5, col, kNanCode);
    const ScaledRun run = expect_run_ok(ops);
    if (run.c.data() == nullptr) continue;
    int64_t row_not_nan = 0, col_not_nan = 0, other_nan = 0;
    for (int64_t i = 0; i < cs.m; ++i)
      for (int64_t j = 0; j < cs.n; ++j) {
        const bool nan = std::isnan(load_as_double(run.c.data(), cs.c_dtype, ops.lc.index(i, j)));
        if (i == row) row_not_nan += !nan;
        if (j == col) col_not_nan += !nan;
        if (i != row && j != col) other_nan += nan;
      }
    EXPECT_EQ(row_not_nan, 0) << "a NaN in A row " << row << " must make all of C row " << row << " NaN";
    EXPECT_EQ(col_not_nan, 0) << "a NaN in B column " << col << " must make all of C column " << col << " NaN";
    EXPECT_EQ(other_nan, 0) << "NaN outside the poisoned row and column";
  }
}

// CUDA: the work goes on the context's stream (a non-blocking one of our own; run_on_cuda holds it
// back, so a kernel or a copy on another stream reads NaN), K-major and with the K-major copies.
// CPU: any thread count gives the same, correct result.
TEST_P(ScaledGemm, OwnStreamOrThreadCounts) {
  for (int layout = 0; layout < 2; ++layout) {
    ScaledCase cs = base(200, 136, 384);
    cs.a_col_major = cs.b_row_major = layout == 1;
    cs.la = ScaleLayout::kBlock128x128;
    cs.lb = ScaleLayout::kRowwise;
    cs.bias = true;
    if (cs.device.is_cuda()) {
      const OwnStream stream;
      cs.stream = stream.get();
      expect_ok(cs);
    } else {
      for (int threads : {1, 3}) {
        cs.cpu_threads = threads;
        expect_ok(cs);
      }
    }
  }
}

// A scale tensor may have any rank whose sizes multiply out to the count: flat, and with a leading 1.
TEST_P(ScaledGemm, ScaleTensorsOfAnyRank) {
  for (int rank : {1, 3}) {
    ScaledCase cs = base(150, 140, 270);
    cs.scale_rank = rank;
    cs.la = ScaleLayout::kBlock1x128;
    cs.lb = ScaleLayout::kBlock128x128;
    expect_ok(cs);
    cs.la = ScaleLayout::kBlock128x128;
    cs.lb = ScaleLayout::kRowwise;
    expect_ok(cs);
  }
}

std::string rung_name(const ::testing::TestParamInfo<Rung>& info) { return name_of(info.param.variant); }

INSTANTIATE_TEST_SUITE_P(Cpu, ScaledGemm,
                         ::testing::Values(Rung{ScaledGemmVariant::kCpu, false}, Rung{ScaledGemmVariant::kAuto, false}),
                         rung_name);
INSTANTIATE_TEST_SUITE_P(Cuda, ScaledGemm,
                         ::testing::Values(Rung{ScaledGemmVariant::kCudaNaive, true},
                                           Rung{ScaledGemmVariant::kCudaWgmmaFp8, true},
                                           Rung{ScaledGemmVariant::kAuto, true}),
                         rung_name);

// ---- refusals -----------------------------------------------------------------------------------------

// Small valid operands on a device (M = 4, N = 5, K = 130: two K-blocks), in buffers larger than the
// views so that a refusal that fails to come reads nothing out of bounds.
struct Small {
  static constexpr int64_t m = 4, n = 5, k = 130;
  Device d;
  Buffer a, b, c, sa, sb, bias;
  explicit Small(Device dev)
      : d(dev), a(DType::kF8E4M3, 8 * m * k, dev), b(DType::kF8E4M3, 8 * k * n, dev), c(DType::kF32, 4 * m * n, dev),
        sa(DType::kF32, 64, dev), sb(DType::kF32, 64, dev), bias(DType::kF32, 4 * n, dev) {
    for (Buffer* buf : {&a, &b}) buf->fill_bytes(0x38);  // 1.0
    for (Buffer* buf : {&c, &bias}) buf->fill_bytes(0);
    const std::vector<float> ones(64, 1.0f);
    sa.copy_from_host(ones.data());
    sb.copy_from_host(ones.data());
  }
  TensorView A(DType dtype = DType::kF8E4M3) const { return raw(a.data(), dtype, d, {m, k}, {k, 1}); }
  TensorView B(DType dtype = DType::kF8E4M3) const { return raw(b.data(), dtype, d, {k, n}, {1, k}); }
  TensorView C(DType dtype = DType::kF32) const { return raw(c.data(), dtype, d, {m, n}, {n, 1}); }
  TensorView S(const Buffer& s, int64_t count, DType dtype = DType::kF32) const {
    return raw(s.data(), dtype, d, {count}, {1});
  }
  TensorView Bias(int64_t count = n, DType dtype = DType::kF32) const { return raw(bias.data(), dtype, d, {count}, {1}); }
  // scaled_matmul with per-tensor scales unless given.
  Caught run(const TensorView& va, const TensorView& vb, const TensorView& vc, const TensorView* bias_view = nullptr,
             ScaledGemmVariant v = ScaledGemmVariant::kAuto) const {
    return run_scales(va, vb, vc, S(sa, 1), ScaleLayout::kTensor, S(sb, 1), ScaleLayout::kTensor, bias_view, v);
  }
  Caught run_scales(const TensorView& va, const TensorView& vb, const TensorView& vc, const TensorView& vsa,
                    ScaleLayout la, const TensorView& vsb, ScaleLayout lb, const TensorView* bias_view = nullptr,
                    ScaledGemmVariant v = ScaledGemmVariant::kAuto) const {
    const Caught caught = call([&] { scaled_matmul(va, vb, vc, vsa, la, vsb, lb, bias_view, v); });
#if OPTIMIZED_WITH_CUDA
    if (d.is_cuda()) {
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    }
#endif
    return caught;
  }
};

// Every argument check on CPU tensors, each naming the argument.
TEST(ScaledGemmErrors, ArgumentsAreNamed) {
  const Small s(Device::cpu());
  // The valid call runs (a baseline for the refusals below): 130 products of 1 * 1.
  ASSERT_FALSE(s.run(s.A(), s.B(), s.C()).thrown);
  EXPECT_EQ(static_cast<const float*>(s.c.data())[0], 130.0f);

  expect_refusal(s.run(s.A(DType::kBF16), s.B(), s.C()), Status::kUnsupported, "a: ", {"fp8_e4m3 or fp8_e5m2", "bf16"});
  expect_refusal(s.run(s.A(), s.B(DType::kF32), s.C()), Status::kUnsupported, "b: ", {"fp8_e4m3 or fp8_e5m2", "fp32"});
  expect_refusal(s.run(s.A(DType::kF8E5M2), s.B(DType::kF8E5M2), s.C()), Status::kUnsupported, "b: ", {"fp8_e5m2"});
  expect_refusal(s.run(s.A(), s.B(), s.C(DType::kI32)), Status::kUnsupported, "c: ", {"fp32, bf16 or fp16", "int32"});
  expect_refusal(s.run(s.A(), s.B(), s.C(DType::kF64)), Status::kUnsupported, "c: ", {"fp64"});

  // Scale counts: each layout given one scale too many names the operand, the count and the shape.
  const struct {
    ScaleLayout layout;
    int64_t a_count, b_count;
    std::string a_shape, b_shape;
  } counts[] = {
      {ScaleLayout::kTensor, 1, 1, "(1)", "(1)"},
      {ScaleLayout::kRowwise, 4, 5, "(M = 4)", "(N = 5)"},
      {ScaleLayout::kBlock1x128, 8, 10, "(M, ceil(K/128)) = (4, 2)", "(N, ceil(K/128)) = (5, 2)"},
      {ScaleLayout::kBlock128x128, 2, 2, "(1, 2)", "(2, 1)"},
  };
  for (const auto& c : counts) {
    SCOPED_TRACE(name_of(c.layout));
    EXPECT_EQ(scale_count(c.layout, s.m, s.k, true), c.a_count);
    EXPECT_EQ(scale_count(c.layout, s.k, s.n, false), c.b_count);
    const std::string l = name_of(c.layout);
    EXPECT_FALSE(s.run_scales(s.A(), s.B(), s.C(), s.S(s.sa, c.a_count), c.layout, s.S(s.sb, c.b_count), c.layout).thrown);
    expect_refusal(s.run_scales(s.A(), s.B(), s.C(), s.S(s.sa, c.a_count + 1), c.layout, s.S(s.sb, c.b_count), c.layout),
                   Status::kInvalidArgument, "scale_a: ",
                   {"expected " + std::to_string(c.a_count) + " scales for layout " + l, c.a_shape});
    expect_refusal(s.run_scales(s.A(), s.B(), s.C(), s.S(s.sa, c.a_count), c.layout, s.S(s.sb, c.b_count + 1), c.layout),
                   Status::kInvalidArgument, "scale_b: ",
                   {"expected " + std::to_string(c.b_count) + " scales for layout " + l, c.b_shape});
  }
  // A count that fits another layout is still the wrong count for the one named.
  expect_refusal(s.run_scales(s.A(), s.B(), s.C(), s.S(s.sa, 4), ScaleLayout::kBlock1x128, s.S(s.sb, 1),
                              ScaleLayout::kTensor),
                 Status::kInvalidArgument, "scale_a: ", {"block_1x128"});

  // Scale dtype, contiguity, alignment, presence.
  expect_refusal(s.run_scales(s.A(), s.B(), s.C(), s.S(s.sa, 1, DType::kBF16), ScaleLayout::kTensor, s.S(s.sb, 1),
                              ScaleLayout::kTensor),
                 Status::kInvalidArgument, "scale_a: ", {"fp32", "bf16"});
  expect_refusal(s.run_scales(s.A(), s.B(), s.C(), s.S(s.sa, 1), ScaleLayout::kTensor, s.S(s.sb, 1, DType::kF16),
                              ScaleLayout::kTensor),
                 Status::kInvalidArgument, "scale_b: ", {"fp32", "fp16"});
  const TensorView strided = raw(s.sb.data(), DType::kF32, s.d, {5}, {2});
  expect_refusal(s.run_scales(s.A(), s.B(), s.C(), s.S(s.sa, 1), ScaleLayout::kTensor, strided, ScaleLayout::kRowwise),
                 Status::kInvalidArgument, "scale_b: ", {"contiguous"});
  expect_refusal(s.run_scales(s.A(), s.B(), s.C(), shifted(as(s.S(s.sa, 4), DType::kF8E4M3), 1), ScaleLayout::kRowwise,
                              s.S(s.sb, 1), ScaleLayout::kTensor),
                 Status::kInvalidArgument, "scale_a: ");  // an fp8 "scale": the dtype is named first
  TensorView misaligned = s.S(s.sa, 4);
  misaligned.data = static_cast<char*>(misaligned.data) + 2;
  expect_refusal(s.run_scales(s.A(), s.B(), s.C(), misaligned, ScaleLayout::kRowwise, s.S(s.sb, 1), ScaleLayout::kTensor),
                 Status::kInvalidArgument, "scale_a: ", {"aligned"});
  TensorView null_scale = s.S(s.sb, 1);
  null_scale.data = nullptr;
  expect_refusal(s.run_scales(s.A(), s.B(), s.C(), s.S(s.sa, 1), ScaleLayout::kTensor, null_scale, ScaleLayout::kTensor),
                 Status::kInvalidArgument, "scale_b: ", {"null"});

  // Bias: C's dtype, N contiguous elements.
  const TensorView bias_bf16 = s.Bias(s.n, DType::kBF16), bias_long = s.Bias(s.n + 1),
                   bias_strided = raw(s.bias.data(), DType::kF32, s.d, {s.n}, {2});
  expect_refusal(s.run(s.A(), s.B(), s.C(), &bias_bf16), Status::kInvalidArgument, "bias: ", {"fp32", "bf16"});
  expect_refusal(s.run(s.A(), s.B(), s.C(), &bias_long), Status::kInvalidArgument, "bias: ", {"5 contiguous elements"});
  expect_refusal(s.run(s.A(), s.B(), s.C(), &bias_strided), Status::kInvalidArgument, "bias: ");
  const TensorView bias_ok = s.Bias();
  EXPECT_FALSE(s.run(s.A(), s.B(), s.C(), &bias_ok).thrown);

  // Shapes, ranks, layouts, overlaps.
  expect_refusal(s.run(raw(s.a.data(), DType::kF8E4M3, s.d, {1, s.m, s.k}, {s.m * s.k, s.k, 1}), s.B(), s.C()),
                 Status::kInvalidArgument, "a: ", {"rank 2", "rank 3"});
  expect_refusal(s.run(s.A(), raw(s.b.data(), DType::kF8E4M3, s.d, {1, s.k, s.n}, {s.k * s.n, 1, s.k}), s.C()),
                 Status::kInvalidArgument, "b: ", {"rank 2"});
  expect_refusal(s.run(s.A(), s.B(), raw(s.c.data(), DType::kF32, s.d, {1, s.m, s.n}, {s.m * s.n, s.n, 1})),
                 Status::kInvalidArgument, "c: ", {"rank 2"});
  expect_refusal(s.run(s.A(), raw(s.b.data(), DType::kF8E4M3, s.d, {s.k - 1, s.n}, {1, s.k}), s.C()),
                 Status::kInvalidArgument, "b: ", {"130 rows"});
  expect_refusal(s.run(s.A(), s.B(), raw(s.c.data(), DType::kF32, s.d, {s.m, s.n + 1}, {s.n + 1, 1})),
                 Status::kInvalidArgument, "c: ", {"(4, 5)"});
  expect_refusal(s.run(s.A(), s.B(), raw(s.c.data(), DType::kF32, s.d, {s.m, s.n}, {1, s.m})),
                 Status::kInvalidArgument, "c: ", {"row-major"});
  expect_refusal(s.run(raw(s.a.data(), DType::kF8E4M3, s.d, {s.m, s.k}, {1, 2}), s.B(), s.C()),
                 Status::kInvalidArgument, "a: ", {"row-major view"});
  expect_refusal(s.run(s.A(), s.B(), raw(s.a.data(), DType::kF32, s.d, {s.m, s.n}, {s.n, 1})),
                 Status::kInvalidArgument, "c: ", {"does not overlap a"});
  expect_refusal(s.run(s.A(), s.B(), raw(s.b.data(), DType::kF32, s.d, {s.m, s.n}, {s.n, 1})),
                 Status::kInvalidArgument, "c: ", {"does not overlap b"});
  expect_refusal(s.run_scales(s.A(), s.B(), raw(s.sa.data(), DType::kF32, s.d, {s.m, s.n}, {s.n, 1}), s.S(s.sa, 1),
                              ScaleLayout::kTensor, s.S(s.sb, 1), ScaleLayout::kTensor),
                 Status::kInvalidArgument, "c: ", {"does not overlap scale_a"});
  const TensorView bias_in_c = raw(s.c.data(), DType::kF32, s.d, {s.n}, {1});
  expect_refusal(s.run(s.A(), s.B(), s.C(), &bias_in_c), Status::kInvalidArgument, "c: ", {"does not overlap bias"});
  TensorView null_a = s.A();
  null_a.data = nullptr;
  expect_refusal(s.run(null_a, s.B(), s.C()), Status::kInvalidArgument, "a: ", {"null"});

  // Variants of the other device.
  expect_refusal(s.run(s.A(), s.B(), s.C(), nullptr, ScaledGemmVariant::kCudaNaive), Status::kInvalidArgument,
                 "variant: ", {"naive", "CUDA"});
  expect_refusal(s.run(s.A(), s.B(), s.C(), nullptr, ScaledGemmVariant::kCudaWgmmaFp8), Status::kInvalidArgument,
                 "variant: ", {"wgmma_fp8", "CUDA"});

  // Mixed devices, and CUDA tensors where no CUDA device can run them (nothing is launched then).
  expect_refusal(s.run(s.A(), on(s.B(), Device::cuda(0)), s.C()), Status::kInvalidArgument, "b: ", {"device"});
  expect_refusal(s.run_scales(s.A(), s.B(), s.C(), on(s.S(s.sa, 1), Device::cuda(0)), ScaleLayout::kTensor,
                              s.S(s.sb, 1), ScaleLayout::kTensor),
                 Status::kInvalidArgument, "scale_a: ", {"device cpu"});
  const TensorView bias_cuda = on(s.Bias(), Device::cuda(0));
  expect_refusal(s.run(s.A(), s.B(), s.C(), &bias_cuda), Status::kInvalidArgument, "bias: ", {"device"});
  if (cuda_device_count() == 0) {
    const Device g = Device::cuda(0);
    expect_refusal(s.run_scales(on(s.A(), g), on(s.B(), g), on(s.C(), g), on(s.S(s.sa, 1), g), ScaleLayout::kTensor,
                                on(s.S(s.sb, 1), g), ScaleLayout::kTensor),
                   Status::kUnsupported, "a: ", {"CUDA tensors given"});
  }
}

// ---- names, counts, the table, the CPU's answers ---------------------------------------------------

TEST(ScaledGemmApi, ScaleLayoutNamesRoundTrip) {
  const char* names[] = {"tensor", "rowwise", "block_1x128", "block_128x128"};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(scale_layout_name(kLayouts[i]), names[i]);
    EXPECT_EQ(parse_scale_layout(names[i]), kLayouts[i]);
  }
  const Caught c = call([] { parse_scale_layout("block_128"); });
  expect_refusal(c, Status::kInvalidArgument, "scale layout: ",
                 {"tensor, rowwise, block_1x128, block_128x128", "'block_128'"});
}

TEST(ScaledGemmApi, ScaleCounts) {
  // A is M x K, B is K x N.
  EXPECT_EQ(scale_count(ScaleLayout::kTensor, 1031, 1027, true), 1);
  EXPECT_EQ(scale_count(ScaleLayout::kTensor, 1027, 1029, false), 1);
  EXPECT_EQ(scale_count(ScaleLayout::kRowwise, 1031, 1027, true), 1031);
  EXPECT_EQ(scale_count(ScaleLayout::kRowwise, 1027, 1029, false), 1029);
  EXPECT_EQ(scale_count(ScaleLayout::kBlock1x128, 1031, 1027, true), 1031 * 9);
  EXPECT_EQ(scale_count(ScaleLayout::kBlock1x128, 1027, 1029, false), 1029 * 9);
  EXPECT_EQ(scale_count(ScaleLayout::kBlock128x128, 1031, 1027, true), 9 * 9);
  EXPECT_EQ(scale_count(ScaleLayout::kBlock128x128, 1027, 1029, false), 9 * 9);
  EXPECT_EQ(scale_count(ScaleLayout::kBlock1x128, 1, 128, true), 1);
  EXPECT_EQ(scale_count(ScaleLayout::kBlock1x128, 1, 129, true), 2);
  EXPECT_EQ(scale_count(ScaleLayout::kBlock128x128, 129, 256, true), 2 * 2);
  EXPECT_EQ(scale_count(ScaleLayout::kBlock128x128, 256, 1, false), 2 * 1);
  EXPECT_EQ(scale_count(ScaleLayout::kBlock128x128, 300, 130, false), 3 * 2);  // (K/128, N/128)
  EXPECT_EQ(scale_count(ScaleLayout::kBlock1x128, 300, 130, false), 130 * 3);  // (N, K/128)
}

TEST(ScaledGemmApi, VariantTable) {
  std::vector<std::string> names;
  for (ScaledGemmVariant v : all_scaled_gemm_variants()) {
    names.push_back(name_of(v));
    EXPECT_EQ(parse_scaled_gemm_variant(name_of(v)), v);
    EXPECT_EQ(scaled_gemm_variant_is_cuda(v), v != ScaledGemmVariant::kCpu) << name_of(v);
  }
  EXPECT_EQ(names, (std::vector<std::string>{"cpu", "naive", "wgmma_fp8"}));
  EXPECT_EQ(parse_scaled_gemm_variant("auto"), ScaledGemmVariant::kAuto);
  EXPECT_EQ(name_of(ScaledGemmVariant::kAuto), "auto");
  expect_refusal(call([] { parse_scaled_gemm_variant("wgmma"); }), Status::kInvalidArgument, "variant: ",
                 {"auto, cpu, naive, wgmma_fp8", "'wgmma'"});
}

TEST(ScaledGemmApi, CpuResolutionAndWorkspace) {
  const Small s(Device::cpu());
  EXPECT_EQ(resolve_scaled_gemm_variant(s.A(), s.B(), s.C()), ScaledGemmVariant::kCpu);
  for (bool a_k : {true, false})
    for (bool b_k : {true, false}) {
      EXPECT_EQ(scaled_matmul_workspace_bytes(1031, 1029, 1027, Device::cpu(), a_k, b_k), 0u);
      EXPECT_EQ(scaled_matmul_workspace_bytes(64, 64, 64, Device::cpu(), a_k, b_k, ScaledGemmVariant::kCpu), 0u);
    }
  // The query on the arguments themselves: 0 on the CPU; it validates them as scaled_matmul does.
  EXPECT_EQ(scaled_matmul_workspace_bytes(s.A(), s.B(), s.C(), s.S(s.sa, 1), ScaleLayout::kTensor, s.S(s.sb, 1),
                                          ScaleLayout::kTensor, nullptr, ScaledGemmVariant::kAuto),
            0u);
  expect_refusal(call([&] {
                   scaled_matmul_workspace_bytes(s.A(), s.B(), s.C(), s.S(s.sa, 2), ScaleLayout::kTensor, s.S(s.sb, 1),
                                                 ScaleLayout::kTensor, nullptr, ScaledGemmVariant::kAuto);
                 }),
                 Status::kInvalidArgument, "scale_a: ");
  expect_refusal(call([] { scaled_matmul_workspace_bytes(0, 4, 4, Device::cpu()); }), Status::kInvalidArgument, "m: ");
  expect_refusal(call([] { scaled_matmul_workspace_bytes(4, 4, -1, Device::cuda(0)); }), Status::kInvalidArgument,
                 "k: ");
}

// ---- CUDA: refusals, resolution, the workspace ------------------------------------------------------

TEST(ScaledGemmCudaErrors, ArgumentsAreNamed) {
  SKIP_WITHOUT_CUDA();
  const Small g(Device::cuda(0)), h(Device::cpu());
  ASSERT_FALSE(g.run(g.A(), g.B(), g.C()).thrown);
  ASSERT_FALSE(g.run(g.A(), g.B(), g.C(), nullptr, ScaledGemmVariant::kCudaNaive).thrown);
  expect_refusal(g.run(g.A(), g.B(), g.C(), nullptr, ScaledGemmVariant::kCpu), Status::kInvalidArgument, "variant: ",
                 {"cpu", "the CPU", "cuda:0"});
  expect_refusal(g.run(g.A(), h.B(), g.C()), Status::kInvalidArgument, "b: ", {"cuda:0"});
  expect_refusal(g.run(g.A(), g.B(), h.C()), Status::kInvalidArgument, "c: ", {"cuda:0"});
  expect_refusal(g.run_scales(g.A(), g.B(), g.C(), h.S(h.sa, 1), ScaleLayout::kTensor, g.S(g.sb, 1), ScaleLayout::kTensor),
                 Status::kInvalidArgument, "scale_a: ", {"device cuda:0", "cpu"});
  expect_refusal(g.run_scales(g.A(), g.B(), g.C(), g.S(g.sa, 1), ScaleLayout::kTensor, h.S(h.sb, 5), ScaleLayout::kRowwise),
                 Status::kInvalidArgument, "scale_b: ", {"device cuda:0"});
  const TensorView bias_host = h.Bias();
  expect_refusal(g.run(g.A(), g.B(), g.C(), &bias_host), Status::kInvalidArgument, "bias: ", {"cuda:0"});
  expect_refusal(g.run_scales(g.A(), g.B(), g.C(), g.S(g.sa, 3), ScaleLayout::kRowwise, g.S(g.sb, 1), ScaleLayout::kTensor,
                              nullptr, ScaledGemmVariant::kCudaNaive),
                 Status::kInvalidArgument, "scale_a: ", {"expected 4 scales for layout rowwise", "(M = 4)"});
  expect_refusal(g.run(g.A(DType::kF8E5M2), g.B(DType::kF8E5M2), g.C()), Status::kUnsupported, "b: ");
}

// wgmma_fp8 forced on a device other than compute capability 9.0: refused, naming the compute
// capability (or, in a build without the sm_90a rungs, saying so).
TEST(ScaledGemmCudaErrors, WgmmaFp8OffHopperNamesTheComputeCapability) {
  SKIP_WITHOUT_CUDA();
  const int cc = compute_capability();
  if (cc == 90) GTEST_SKIP() << "device 0 is compute capability 9.0: wgmma_fp8 runs there (Cuda/ScaledGemm.*/wgmma_fp8)";
  const Small g(Device::cuda(0));
  const Caught c = g.run(g.A(), g.B(), g.C(), nullptr, ScaledGemmVariant::kCudaWgmmaFp8);
  ASSERT_TRUE(c.thrown) << "wgmma_fp8 ran on a compute capability " << cc_string(cc) << " device";
  EXPECT_EQ(c.status, Status::kUnsupported) << c.message;
  EXPECT_TRUE(starts_with(c.message, "variant: wgmma_fp8")) << c.message;
  if (c.message.find("not in this build") == std::string::npos) {
    EXPECT_TRUE(contains_all(c.message, {"compute capability 9.0", cc_string(cc)}));
  }
  // auto runs naive there.
  EXPECT_EQ(resolve_scaled_gemm_variant(g.A(), g.B(), g.C()), ScaledGemmVariant::kCudaNaive);
}

// wgmma_fp8 takes B's scales per tensor, per column or per 128 x 128 block: block_1x128 is refused
// before anything runs, on any device; auto runs naive for it (Cuda/ScaledGemm.EveryScaleLayoutPair/auto).
TEST(ScaledGemmCudaErrors, WgmmaFp8RefusesBBlock1x128) {
  SKIP_WITHOUT_CUDA();
  const Small g(Device::cuda(0));
  const Caught c = g.run_scales(g.A(), g.B(), g.C(), g.S(g.sa, 1), ScaleLayout::kTensor, g.S(g.sb, 10),
                                ScaleLayout::kBlock1x128, nullptr, ScaledGemmVariant::kCudaWgmmaFp8);
  if (c.thrown && c.message.find("not in this build") != std::string::npos)
    GTEST_SKIP() << "this build has no sm_90a rungs: " << c.message;
  expect_refusal(c, Status::kUnsupported, "scale_b: ", {"wgmma_fp8", "block_1x128"});
  // Through auto: runs (naive), and right.
  EXPECT_FALSE(g.run_scales(g.A(), g.B(), g.C(), g.S(g.sa, 1), ScaleLayout::kTensor, g.S(g.sb, 10),
                            ScaleLayout::kBlock1x128)
                   .thrown);
  float c00 = 0;
#if OPTIMIZED_WITH_CUDA
  ASSERT_EQ(cudaMemcpy(&c00, g.c.data(), sizeof c00, cudaMemcpyDeviceToHost), cudaSuccess);
#endif
  EXPECT_EQ(c00, 130.0f);
}

TEST(ScaledGemmCudaApi, ResolutionOnTheDevice) {
  SKIP_WITHOUT_CUDA();
  const Small g(Device::cuda(0));
  const ScaledGemmVariant want =
      wgmma_fp8_unavailable().empty() ? ScaledGemmVariant::kCudaWgmmaFp8 : ScaledGemmVariant::kCudaNaive;
  EXPECT_EQ(resolve_scaled_gemm_variant(g.A(), g.B(), g.C()), want) << wgmma_fp8_unavailable();
  // A column-major A is copied K-major by auto on Hopper: still wgmma_fp8.
  EXPECT_EQ(resolve_scaled_gemm_variant(raw(g.a.data(), DType::kF8E4M3, g.d, {g.m, g.k}, {1, g.m}), g.B(), g.C()), want);
}

// The workspace: 0 for K-major operands (K a multiple of 16, so that TMA takes their rows where they
// are) and for naive; on Hopper, the K-major copies of a column-major A or a row-major B. A caller's
// workspace of exactly the queried size runs; one byte less is refused, naming the workspace.
TEST(ScaledGemmCudaWorkspace, QueryAndCallerWorkspace) {
  SKIP_WITHOUT_CUDA();
  const Device g = Device::cuda(0);
  const int64_t m = 200, n = 136, k = 384;
  EXPECT_EQ(scaled_matmul_workspace_bytes(m, n, k, g), 0u);
  EXPECT_EQ(scaled_matmul_workspace_bytes(m, n, k, g, false, false, ScaledGemmVariant::kCudaNaive), 0u);
  if (const std::string& why = wgmma_fp8_unavailable(); !why.empty()) {
    EXPECT_EQ(scaled_matmul_workspace_bytes(m, n, k, g, false, false), 0u) << "auto runs naive here";
    GTEST_SKIP() << why;
  }
  const ScaledGemmVariant w = ScaledGemmVariant::kCudaWgmmaFp8;
  EXPECT_EQ(scaled_matmul_workspace_bytes(m, n, k, g, true, true, w), 0u);
  const size_t a_copy = scaled_matmul_workspace_bytes(m, n, k, g, false, true, w);
  const size_t b_copy = scaled_matmul_workspace_bytes(m, n, k, g, true, false, w);
  const size_t both = scaled_matmul_workspace_bytes(m, n, k, g, false, false, w);
  EXPECT_GE(a_copy, static_cast<size_t>(m * k)) << "a K-major copy of A";
  EXPECT_GE(b_copy, static_cast<size_t>(n * k)) << "a K-major copy of B";
  EXPECT_GE(both, a_copy + b_copy);
  EXPECT_EQ(scaled_matmul_workspace_bytes(m, n, k, g, false, false), both) << "auto runs wgmma_fp8 on Hopper";

  // A column-major, B row-major: the call with exactly `both` bytes, then one byte short.
  ScaledCase cs;
  cs.variant = w;
  cs.device = g;
  cs.m = m, cs.n = n, cs.k = k;
  cs.a_col_major = cs.b_row_major = true;
  cs.la = ScaleLayout::kBlock1x128;
  cs.lb = ScaleLayout::kBlock128x128;
  const ScaledOperands ops(cs);
  Buffer ws(DType::kF32, static_cast<int64_t>(both / 4 + 1), g);
  ws.fill_bytes(0xFF);
  {
    SCOPED_TRACE("caller's workspace of the queried size");
    expect_run_ok(ops, Workspace{ws.data(), both});
  }
  const Caught c = call([&] { run_scaled(ops, Workspace{ws.data(), both - 1}); });
  expect_refusal(c, Status::kInvalidArgument, "workspace: ", {std::to_string(both)});
}

}  // namespace
}  // namespace optimized::testing
