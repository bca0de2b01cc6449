// Core types: dtype names/sizes/parsing, devices, TensorView, Buffer, the fp16/bf16 conversions
// (against known bit patterns and an independent round-to-nearest-even reference), element
// load/store, and what the build and machine report about CUDA.
#include <gtest/gtest.h>

#include <bit>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/test_util.h"
#include "optimized/buffer.h"
#include "optimized/core.h"

namespace optimized {
namespace {

float f32(uint32_t bits) { return std::bit_cast<float>(bits); }
uint32_t bits_of(float f) { return std::bit_cast<uint32_t>(f); }

// ---- dtypes -----------------------------------------------------------------------------------

TEST(DType, NamesAndSizes) {
  struct Row {
    DType dtype;
    const char* name;
    size_t size;
  };
  for (const Row& r : {Row{DType::kF32, "fp32", 4}, Row{DType::kF16, "fp16", 2}, Row{DType::kBF16, "bf16", 2},
                       Row{DType::kF8E4M3, "fp8_e4m3", 1}, Row{DType::kF8E5M2, "fp8_e5m2", 1},
                       Row{DType::kI32, "int32", 4},
                       Row{DType::kI64, "int64", 8}, Row{DType::kF64, "fp64", 8}, Row{DType::kBool, "bool", 1}}) {
    EXPECT_EQ(dtype_name(r.dtype), r.name);
    EXPECT_EQ(dtype_size(r.dtype), r.size) << r.name;
    EXPECT_EQ(parse_dtype(r.name), r.dtype) << r.name;
  }
}

void expect_parse_dtype_error(const std::string& name) {
  try {
    parse_dtype(name);
    FAIL() << "parse_dtype(\"" << name << "\") did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument) << e.what();
    const std::string msg = e.what();
    EXPECT_NE(msg.find("dtype"), std::string::npos) << "message should name the argument: " << msg;
    if (!name.empty()) {
      EXPECT_NE(msg.find(name), std::string::npos) << "message should show what was given: " << msg;
    }
    // ... and what was expected: the choices.
    for (const char* choice : {"fp32", "fp16", "bf16"})
      EXPECT_NE(msg.find(choice), std::string::npos) << "message should list " << choice << ": " << msg;
  }
}

TEST(DType, ParseUnknownNamesThrows) {
  expect_parse_dtype_error("fp128");
  expect_parse_dtype_error("float32x");
  expect_parse_dtype_error("FP32 ");
  expect_parse_dtype_error("");
}

// ---- devices and status -----------------------------------------------------------------------

TEST(Device, NamesAndEquality) {
  EXPECT_EQ(device_name(Device::cpu()), "cpu");
  EXPECT_EQ(device_name(Device::cuda()), "cuda:0");
  EXPECT_EQ(device_name(Device::cuda(3)), "cuda:3");
  EXPECT_FALSE(Device::cpu().is_cuda());
  EXPECT_TRUE(Device::cuda(1).is_cuda());
  EXPECT_EQ(Device::cuda(1), Device::cuda(1));
  EXPECT_NE(Device::cuda(0), Device::cuda(1));
  EXPECT_NE(Device::cpu(), Device::cuda(0));
}

TEST(Status, NamesAreDistinct) {
  std::set<std::string> names;
  for (Status s : {Status::kOk, Status::kInvalidArgument, Status::kUnsupported, Status::kCudaError,
                   Status::kOutOfMemory, Status::kInternal}) {
    const std::string n(status_name(s));
    EXPECT_FALSE(n.empty());
    names.insert(n);
  }
  EXPECT_EQ(names.size(), 6u);
  const Error e(Status::kUnsupported, "x: expected y; given z");
  EXPECT_EQ(e.status(), Status::kUnsupported);
  EXPECT_STREQ(e.what(), "x: expected y; given z");
}

// ---- TensorView -------------------------------------------------------------------------------

TEST(TensorView, ContiguousConstructor) {
  float storage[24];
  TensorView t(storage, DType::kF32, Device::cpu(), {2, 3, 4});
  EXPECT_EQ(t.data, storage);
  EXPECT_EQ(t.rank, 3);
  EXPECT_EQ(t.shape[0], 2);
  EXPECT_EQ(t.shape[1], 3);
  EXPECT_EQ(t.shape[2], 4);
  EXPECT_EQ(t.strides[0], 12);
  EXPECT_EQ(t.strides[1], 4);
  EXPECT_EQ(t.strides[2], 1);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.describe(), "fp32[2, 3, 4] strides [12, 4, 1] on cpu");

  TensorView v(storage, DType::kF16, Device::cpu(), {7});
  EXPECT_EQ(v.rank, 1);
  EXPECT_EQ(v.strides[0], 1);
  EXPECT_EQ(v.numel(), 7);
  EXPECT_TRUE(v.is_contiguous());
}

TEST(TensorView, StridedConstructorAndMatrix) {
  TensorView t(nullptr, DType::kF16, Device::cpu(), {3, 4}, {5, 1});
  EXPECT_EQ(t.strides[0], 5);
  EXPECT_EQ(t.strides[1], 1);
  EXPECT_EQ(t.numel(), 12);
  EXPECT_FALSE(t.is_contiguous());

  TensorView col(nullptr, DType::kF32, Device::cpu(), {3, 4}, {1, 3});  // column-major
  EXPECT_FALSE(col.is_contiguous());

  TensorView same(nullptr, DType::kF32, Device::cpu(), {3, 4}, {4, 1});
  EXPECT_TRUE(same.is_contiguous());

  int dummy = 0;
  TensorView m = TensorView::matrix(&dummy, DType::kBF16, Device::cuda(0), 17, 33, 40);
  EXPECT_EQ(m.data, &dummy);
  EXPECT_EQ(m.dtype, DType::kBF16);
  EXPECT_EQ(m.device, Device::cuda(0));
  EXPECT_EQ(m.rank, 2);
  EXPECT_EQ(m.shape[0], 17);
  EXPECT_EQ(m.shape[1], 33);
  EXPECT_EQ(m.strides[0], 40);
  EXPECT_EQ(m.strides[1], 1);
  EXPECT_EQ(m.numel(), 17 * 33);
  EXPECT_FALSE(m.is_contiguous());
  EXPECT_EQ(m.describe(), "bf16[17, 33] strides [40, 1] on cuda:0");  // the example in core.h

  TensorView packed = TensorView::matrix(&dummy, DType::kF32, Device::cpu(), 5, 6, 6);
  EXPECT_TRUE(packed.is_contiguous());

  TensorView empty(nullptr, DType::kF32, Device::cpu(), {0, 5});
  EXPECT_EQ(empty.numel(), 0);
}

// Error helpers: the status is kInvalidArgument and the message starts with the argument's name.
template <typename F>
std::string invalid_message(F&& f) {
  const testing::Caught c = testing::call(f);
  EXPECT_TRUE(c.thrown) << "expected an Error (invalid argument)";
  if (c.thrown) EXPECT_EQ(c.status, Status::kInvalidArgument) << c.message;
  return c.message;
}
bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

constexpr int64_t k2To40 = int64_t{1} << 40;

TEST(TensorView, ContiguousStridesThatOverflowThrow) {
  // [4, 2^40, 2^40]: the outer stride is 2^80.
  const std::string msg = invalid_message([] { TensorView(nullptr, DType::kF32, Device::cpu(), {4, k2To40, k2To40}); });
  EXPECT_TRUE(starts_with(msg, "shape: ")) << msg;
  EXPECT_NE(msg.find("int64"), std::string::npos) << msg;
  EXPECT_NE(msg.find("1099511627776"), std::string::npos) << "should show the shape: " << msg;
  // Strides that fit (the outermost size never enters a stride), and sizes of 0, are fine.
  TensorView wide(nullptr, DType::kF32, Device::cpu(), {int64_t{1} << 62, 2});
  EXPECT_EQ(wide.strides[0], 2);
  TensorView empty(nullptr, DType::kF32, Device::cpu(), {k2To40, k2To40, 0});
  EXPECT_EQ(empty.numel(), 0);
}

TEST(TensorView, NumelThatOverflowsThrows) {
  const TensorView t(nullptr, DType::kF32, Device::cpu(), {k2To40, k2To40, 4}, {0, 0, 0});
  const std::string msg = invalid_message([&] { (void)t.numel(); });
  EXPECT_TRUE(starts_with(msg, "shape: ")) << msg;
  EXPECT_NE(msg.find("int64"), std::string::npos) << msg;
  // A size of 0 anywhere: 0 elements, whatever the others.
  EXPECT_EQ(TensorView(nullptr, DType::kF32, Device::cpu(), {k2To40, k2To40, 0}, {0, 0, 0}).numel(), 0);
  EXPECT_EQ(TensorView(nullptr, DType::kF32, Device::cpu(), {0, k2To40, k2To40}, {0, 0, 0}).numel(), 0);
  // is_contiguous never overflows: expected strides past int64 match no stride.
  EXPECT_FALSE(TensorView(nullptr, DType::kF32, Device::cpu(), {3, k2To40, k2To40}, {0, k2To40, 1}).is_contiguous());
}

TEST(ViewExtent, OffsetsAndBytes) {
  alignas(8) float storage[64];
  const ViewExtent c = view_extent(TensorView(storage, DType::kF32, Device::cpu(), {3, 4}, {5, 1}), "t");
  EXPECT_EQ(c.numel, 12);
  EXPECT_EQ(c.lowest, 0);
  EXPECT_EQ(c.highest, 2 * 5 + 3);
  EXPECT_EQ(c.bytes, 14 * 4);
  EXPECT_EQ(c.begin, reinterpret_cast<uintptr_t>(storage));
  EXPECT_EQ(c.end, reinterpret_cast<uintptr_t>(storage + 14));
  // Negative strides reach below data.
  const ViewExtent n = view_extent(TensorView(storage + 20, DType::kF16, Device::cpu(), {3, 4}, {-5, 1}), "t");
  EXPECT_EQ(n.lowest, -10);
  EXPECT_EQ(n.highest, 3);
  EXPECT_EQ(n.bytes, 14 * 2);
  EXPECT_EQ(n.begin, reinterpret_cast<uintptr_t>(storage + 20) - 20);
  // No element: nothing is reached, whatever the strides.
  const ViewExtent e = view_extent(TensorView(storage, DType::kF32, Device::cpu(), {0, k2To40}, {k2To40, 1}), "t");
  EXPECT_EQ(e.numel, 0);
  EXPECT_EQ(e.bytes, 0);
  EXPECT_EQ(e.begin, e.end);
  // Rank 0: one element.
  EXPECT_EQ(view_extent(TensorView(storage, DType::kF64, Device::cpu(), {}), "t").bytes, 8);
}

TEST(ViewExtent, OverflowIsRefusedNamingTheArgument) {
  alignas(8) float storage[4];
  struct Bad {
    std::initializer_list<int64_t> shape, strides;
    DType dtype;
    const char* expect;  // a piece of the message
  };
  const Bad cases[] = {
      {{4, k2To40, k2To40}, {0, 0, 0}, DType::kF32, "element count"},                    // 2^82 elements
      {{4, 8}, {int64_t{1} << 62, 1}, DType::kF32, "offsets"},                             // 3 * 2^62
      {{4, 8}, {-(int64_t{1} << 62), 1}, DType::kF32, "offsets"},                          // -3 * 2^62
      {{2, 2}, {INT64_MAX, 1}, DType::kF32, "offsets"},                                    // INT64_MAX + 1
      {{2, 8}, {int64_t{1} << 61, 1}, DType::kF32, "byte span"},                           // (2^61 + 8) * 4 bytes
      {{2, 2}, {int64_t{1} << 62, -(int64_t{1} << 62)}, DType::kF32, "byte span"},         // 2^63 + 1 elements
      {{3}, {-1}, DType::kF32, "address space"},                                            // below address 0 (data = 4)
      {{-1, 4}, {4, 1}, DType::kF32, "sizes >= 0"},
  };
  for (const Bad& b : cases) {
    TensorView t(storage, b.dtype, Device::cpu(), b.shape, b.strides);
    if (std::string(b.expect) == "address space") t.data = reinterpret_cast<void*>(uintptr_t{4});
    const std::string msg = invalid_message([&] { view_extent(t, "weight"); });
    EXPECT_TRUE(starts_with(msg, "weight: expected ")) << msg;
    EXPECT_NE(msg.find(b.expect), std::string::npos) << msg;
    EXPECT_NE(msg.find(t.describe()), std::string::npos) << "should show the view: " << msg;
  }
}

// ---- Buffer -----------------------------------------------------------------------------------

TEST(Buffer, HostAllocCopyFill) {
  Buffer b(DType::kF32, 1001, Device::cpu());
  ASSERT_NE(b.data(), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % 256, 0u) << "host buffers are 256-byte aligned";
  EXPECT_EQ(b.dtype(), DType::kF32);
  EXPECT_EQ(b.device(), Device::cpu());
  EXPECT_EQ(b.count(), 1001);
  EXPECT_EQ(b.bytes(), 4004u);

  std::vector<float> src(1001), dst(1001, 0.0f);
  for (size_t i = 0; i < src.size(); ++i) src[i] = 0.5f * static_cast<float>(i) - 17.0f;
  b.copy_from_host(src.data());
  b.copy_to_host(dst.data());
  EXPECT_EQ(src, dst);
  EXPECT_EQ(std::memcmp(b.data(), src.data(), b.bytes()), 0);

  b.fill_bytes(0xFF);
  const auto* bytes = static_cast<const unsigned char*>(b.data());
  for (size_t i = 0; i < b.bytes(); ++i) ASSERT_EQ(bytes[i], 0xFF) << "byte " << i;
  b.copy_to_host(dst.data());
  for (float f : dst) ASSERT_TRUE(std::isnan(f)) << "0xFF bytes poison fp32 with NaN";
  b.fill_bytes(0x00);
  for (size_t i = 0; i < b.bytes(); ++i) ASSERT_EQ(bytes[i], 0x00) << "byte " << i;

  Buffer h(DType::kF16, 3, Device::cpu());
  h.fill_bytes(0xFF);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(std::isnan(load_as_double(h.data(), DType::kF16, i)));
}

TEST(Buffer, MoveAndViews) {
  Buffer a(DType::kBF16, 60, Device::cpu());
  void* p = a.data();
  Buffer b(std::move(a));
  EXPECT_EQ(b.data(), p);
  EXPECT_EQ(b.count(), 60);
  EXPECT_EQ(a.data(), nullptr);  // NOLINT(bugprone-use-after-move): moved-from is empty
  Buffer c;
  c = std::move(b);
  EXPECT_EQ(c.data(), p);
  EXPECT_EQ(c.dtype(), DType::kBF16);
  EXPECT_EQ(b.data(), nullptr);  // NOLINT(bugprone-use-after-move)

  TensorView m = c.matrix(5, 10, 12);
  EXPECT_EQ(m.data, p);
  EXPECT_EQ(m.dtype, DType::kBF16);
  EXPECT_EQ(m.rank, 2);
  EXPECT_EQ(m.shape[0], 5);
  EXPECT_EQ(m.shape[1], 10);
  EXPECT_EQ(m.strides[0], 12);
  EXPECT_EQ(m.strides[1], 1);

  TensorView v = c.view({3, 4, 5});
  EXPECT_EQ(v.data, p);
  EXPECT_EQ(v.rank, 3);
  EXPECT_EQ(v.strides[0], 20);
  EXPECT_EQ(v.strides[1], 5);
  EXPECT_TRUE(v.is_contiguous());

  TensorView s = c.view({3, 4}, {0, 1});
  EXPECT_EQ(s.strides[0], 0);
  EXPECT_EQ(s.strides[1], 1);
  EXPECT_EQ(s.device, Device::cpu());
}

TEST(Buffer, ViewsAndCountsThatOverflowAreRefused) {
  Buffer c(DType::kF32, 60, Device::cpu());
  // Extents are checked (view_extent) before they are compared with the buffer.
  std::string msg = invalid_message([&] { c.view({2, 8}, {int64_t{1} << 62, 1}); });
  EXPECT_TRUE(starts_with(msg, "view: ")) << msg;
  EXPECT_NE(msg.find("int64"), std::string::npos) << msg;
  msg = invalid_message([&] { c.matrix(4, 8, int64_t{1} << 62); });
  EXPECT_TRUE(starts_with(msg, "matrix: ")) << msg;
  EXPECT_NE(msg.find("int64"), std::string::npos) << msg;
  msg = invalid_message([&] { c.view({4, k2To40, k2To40}); });
  EXPECT_TRUE(starts_with(msg, "shape: ")) << msg;
  // A view reaching before the buffer (a negative stride) is as out of range as one past it.
  msg = invalid_message([&] { c.view({3, 4}, {-4, 1}); });
  EXPECT_TRUE(starts_with(msg, "view: ")) << msg;
  // A count whose byte size does not fit.
  msg = invalid_message([] { Buffer(DType::kF64, INT64_MAX / 4, Device::cpu()); });
  EXPECT_TRUE(starts_with(msg, "count: ")) << msg;
  EXPECT_NE(msg.find("int64"), std::string::npos) << msg;
}

TEST(Buffer, CudaBufferWithoutCudaIsUnsupported) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present";
  try {
    Buffer b(DType::kF32, 16, Device::cuda());
    FAIL() << "a CUDA buffer was allocated without a usable CUDA device";
  } catch (const Error& e) {
    EXPECT_TRUE(e.status() == Status::kUnsupported || e.status() == Status::kCudaError)
        << status_name(e.status()) << ": " << e.what();
    EXPECT_FALSE(std::string(e.what()).empty());
  }
}

// ---- fp16 / bf16 conversions --------------------------------------------------------------------

// Independent references: decode by the formula; encode with exact double arithmetic and
// std::nearbyint (round half to even in the default rounding mode).
double ref_half_to_double(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  double v;
  if (exp == 0) v = std::ldexp(man, -24);
  else if (exp == 31) v = man ? std::numeric_limits<double>::quiet_NaN() : INFINITY;
  else v = std::ldexp(1024 + man, exp - 25);
  return sign ? -v : v;
}

// Rounds finite or infinite `x` to a format with `man_bits` stored mantissa bits, exponent bias
// `bias` and all-ones exponent `max_exp`; returns the bit pattern (NaN handled by the caller).
uint16_t ref_round(float x, int man_bits, int bias, int max_exp) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;  // bit 15 in both formats
  const double a = std::fabs(static_cast<double>(x));
  const uint16_t inf = static_cast<uint16_t>(sign | (max_exp << man_bits));
  if (std::isinf(a)) return inf;
  const int min_exp = 1 - bias;  // exponent of the smallest normal
  int e;
  std::frexp(a, &e);
  e -= 1;  // a = 1.xxx * 2^e
  if (a == 0 || e < min_exp) {
    const double q = std::nearbyint(std::ldexp(a, -(min_exp - man_bits)));  // units of the subnormal step
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(q));  // q == 2^man_bits is the smallest normal
  }
  double q = std::nearbyint(std::ldexp(a, man_bits - e));  // in [2^man_bits, 2^(man_bits+1)]
  if (q == std::ldexp(1.0, man_bits + 1)) {
    q /= 2;
    e += 1;
  }
  const int biased = e + bias;
  if (biased >= max_exp) return inf;
  return static_cast<uint16_t>(sign | (biased << man_bits) | (static_cast<uint16_t>(q) - (1u << man_bits)));
}
uint16_t ref_float_to_half(float x) { return ref_round(x, 10, 15, 31); }
uint16_t ref_float_to_bf16(float x) { return ref_round(x, 7, 127, 255); }

bool half_is_nan(uint16_t h) { return (h & 0x7C00) == 0x7C00 && (h & 0x03FF) != 0; }
bool bf16_is_nan(uint16_t h) { return (h & 0x7F80) == 0x7F80 && (h & 0x007F) != 0; }

TEST(HalfConversion, KnownBitPatterns) {
  struct Row {
    float value;
    uint16_t bits;
  };
  const Row rows[] = {
      {0.0f, 0x0000},           {-0.0f, 0x8000},          {1.0f, 0x3C00},          {-2.0f, 0xC000},
      {0.5f, 0x3800},           {65504.0f, 0x7BFF},       {-65504.0f, 0xFBFF},     {0.333251953125f, 0x3555},
      {std::ldexp(1.0f, -14), 0x0400},                    // smallest normal
      {std::ldexp(1023.0f, -24), 0x03FF},                 // largest subnormal
      {std::ldexp(1.0f, -24), 0x0001},                    // smallest subnormal
      {-std::ldexp(1.0f, -24), 0x8001},
      {INFINITY, 0x7C00},       {-INFINITY, 0xFC00},
  };
  for (const Row& r : rows) {
    EXPECT_EQ(float_to_half(r.value), r.bits) << r.value;
    EXPECT_EQ(bits_of(half_to_float(r.bits)), bits_of(r.value)) << std::hex << r.bits;
  }
}

TEST(HalfConversion, RoundToNearestEven) {
  // Ties go to the even mantissa.
  EXPECT_EQ(float_to_half(1.0f + std::ldexp(1.0f, -11)), 0x3C00);      // halfway 0x3C00/0x3C01
  EXPECT_EQ(float_to_half(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);  // halfway 0x3C01/0x3C02
  EXPECT_EQ(float_to_half(1.0f + std::ldexp(1.0f, -11) + std::ldexp(1.0f, -20)), 0x3C01);  // above half
  EXPECT_EQ(float_to_half(1.0f + std::ldexp(1.0f, -11) - std::ldexp(1.0f, -23)), 0x3C00);  // below half
  EXPECT_EQ(float_to_half(-(1.0f + 3 * std::ldexp(1.0f, -11))), 0xBC02);
  // Carry out of the mantissa into the exponent: 2047/1024 * (1 + ...) rounds up to 2.0.
  EXPECT_EQ(float_to_half(2.0f - std::ldexp(1.0f, -12)), 0x4000);
  // Subnormal ties and the subnormal/normal boundary.
  EXPECT_EQ(float_to_half(std::ldexp(1.0f, -25)), 0x0000);      // half of the smallest subnormal: to 0
  EXPECT_EQ(float_to_half(std::ldexp(1.0f, -25) * 1.0000001f), 0x0001);
  EXPECT_EQ(float_to_half(3 * std::ldexp(1.0f, -25)), 0x0002);  // 1.5 steps: to 2 (even)
  EXPECT_EQ(float_to_half(5 * std::ldexp(1.0f, -25)), 0x0002);  // 2.5 steps: to 2 (even)
  EXPECT_EQ(float_to_half(std::ldexp(2047.0f, -25)), 0x0400);   // 1023.5 steps: to the smallest normal
  EXPECT_EQ(float_to_half(std::ldexp(1.0f, -30)), 0x0000);
  EXPECT_EQ(float_to_half(-std::ldexp(1.0f, -30)), 0x8000);
  EXPECT_EQ(float_to_half(std::numeric_limits<float>::denorm_min()), 0x0000);
}

TEST(HalfConversion, OverflowToInfinity) {
  EXPECT_EQ(float_to_half(65519.0f), 0x7BFF);  // below the midpoint to 65536
  EXPECT_EQ(float_to_half(65520.0f), 0x7C00);  // the midpoint rounds to even: Inf
  EXPECT_EQ(float_to_half(-65520.0f), 0xFC00);
  EXPECT_EQ(float_to_half(1e6f), 0x7C00);
  EXPECT_EQ(float_to_half(-1e6f), 0xFC00);
  EXPECT_EQ(float_to_half(std::numeric_limits<float>::max()), 0x7C00);
}

TEST(HalfConversion, NaN) {
  EXPECT_TRUE(half_is_nan(float_to_half(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(half_is_nan(float_to_half(-std::numeric_limits<float>::quiet_NaN())));
  // NaNs whose payload lives only in the low mantissa bits must not become Inf.
  for (uint32_t bits : {0x7F800001u, 0xFF800001u, 0x7F801FFFu, 0x7FFFFFFFu, 0x7FC00000u, 0x7F802000u})
    EXPECT_TRUE(half_is_nan(float_to_half(f32(bits)))) << std::hex << bits << " -> " << float_to_half(f32(bits));
  EXPECT_TRUE(std::isnan(half_to_float(0x7E00)));
  EXPECT_TRUE(std::isnan(half_to_float(0x7C01)));
  EXPECT_TRUE(std::isnan(half_to_float(0xFFFF)));
}

TEST(HalfConversion, EveryHalfDecodesExactlyAndRoundTrips) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const auto bits = static_cast<uint16_t>(h);
    const float f = half_to_float(bits);
    const double ref = ref_half_to_double(bits);
    if (std::isnan(ref)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << h;
      ASSERT_TRUE(half_is_nan(float_to_half(f))) << std::hex << h;
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), ref) << std::hex << h;
    ASSERT_EQ(std::signbit(f), std::signbit(ref)) << std::hex << h;
    ASSERT_EQ(float_to_half(f), bits) << std::hex << h;
  }
}

TEST(HalfConversion, EveryMidpointRoundsToEven) {
  // The midpoint between consecutive finite halfs (exact in fp32), and one fp32 ulp either side.
  for (uint32_t h = 0; h < 0x7BFF; ++h) {
    const double lo = ref_half_to_double(static_cast<uint16_t>(h)), hi = ref_half_to_double(static_cast<uint16_t>(h + 1));
    const float mid = static_cast<float>((lo + hi) / 2);
    ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2);
    const uint16_t even = (h % 2 == 0) ? static_cast<uint16_t>(h) : static_cast<uint16_t>(h + 1);
    ASSERT_EQ(float_to_half(mid), even) << "midpoint above " << std::hex << h;
    ASSERT_EQ(float_to_half(-mid), even | 0x8000) << "midpoint above -" << std::hex << h;
    ASSERT_EQ(float_to_half(std::nextafter(mid, 0.0f)), h) << std::hex << h;
    ASSERT_EQ(float_to_half(std::nextafter(mid, INFINITY)), h + 1) << std::hex << h;
  }
}

TEST(HalfConversion, MatchesReferenceOnSampledFloats) {
  std::mt19937 rng(12345);
  auto check = [](uint32_t bits) {
    const float f = f32(bits);
    const uint16_t got = float_to_half(f);
    if (std::isnan(f)) {
      ASSERT_TRUE(half_is_nan(got)) << std::hex << bits;
      return;
    }
    ASSERT_EQ(got, ref_float_to_half(f)) << std::hex << "float bits " << bits << " (" << f << ")";
  };
  for (uint64_t bits = 0; bits <= 0xFFFFFFFFull; bits += 4099) check(static_cast<uint32_t>(bits));
  for (int i = 0; i < 1000000; ++i) check(rng());
  // Dense around the fp16 range (exponents -30..17) where rounding matters most.
  std::uniform_int_distribution<uint32_t> mant(0, 0x7FFFFF);
  for (int e = -30; e <= 17; ++e)
    for (int i = 0; i < 20000; ++i) check((static_cast<uint32_t>(e + 127) << 23) | mant(rng) | (i % 2 ? 0x80000000u : 0));
}

TEST(Bf16Conversion, KnownBitPatterns) {
  EXPECT_EQ(float_to_bf16(0.0f), 0x0000);
  EXPECT_EQ(float_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(float_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(float_to_bf16(-2.0f), 0xC000);
  EXPECT_EQ(float_to_bf16(INFINITY), 0x7F80);
  EXPECT_EQ(float_to_bf16(-INFINITY), 0xFF80);
  EXPECT_EQ(float_to_bf16(1.0f / 3.0f), 0x3EAB);  // 0x3EAAAAAB rounds up
  EXPECT_EQ(bf16_to_float(0x3F80), 1.0f);
  EXPECT_EQ(bf16_to_float(0x3EAB), 0.333984375f);
  EXPECT_EQ(bits_of(bf16_to_float(0x8000)), 0x80000000u);
  EXPECT_EQ(bf16_to_float(0x0001), std::ldexp(1.0f, -133));  // smallest subnormal
  EXPECT_EQ(bf16_to_float(0x0080), std::ldexp(1.0f, -126));  // smallest normal
  EXPECT_EQ(bf16_to_float(0x7F7F), f32(0x7F7F0000u));        // largest finite
}

TEST(Bf16Conversion, RoundToNearestEven) {
  EXPECT_EQ(float_to_bf16(f32(0x3F808000u)), 0x3F80);  // tie, lower is even
  EXPECT_EQ(float_to_bf16(f32(0x3F818000u)), 0x3F82);  // tie, upper is even
  EXPECT_EQ(float_to_bf16(f32(0x3F808001u)), 0x3F81);  // above the tie
  EXPECT_EQ(float_to_bf16(f32(0x3F807FFFu)), 0x3F80);  // below the tie
  EXPECT_EQ(float_to_bf16(f32(0xBF818000u)), 0xBF82);
  EXPECT_EQ(float_to_bf16(f32(0x3FFFFFFFu)), 0x4000);  // carry into the exponent
  // Subnormals.
  EXPECT_EQ(float_to_bf16(f32(0x00000001u)), 0x0000);
  EXPECT_EQ(float_to_bf16(f32(0x00008000u)), 0x0000);  // tie to even (0)
  EXPECT_EQ(float_to_bf16(f32(0x00018000u)), 0x0002);  // tie to even (2)
  EXPECT_EQ(float_to_bf16(f32(0x00010000u)), 0x0001);
  EXPECT_EQ(float_to_bf16(f32(0x007FFFFFu)), 0x0080);  // largest subnormal float rounds to the smallest normal
  EXPECT_EQ(float_to_bf16(f32(0x80018000u)), 0x8002);
}

TEST(Bf16Conversion, OverflowToInfinity) {
  EXPECT_EQ(float_to_bf16(f32(0x7F7F7FFFu)), 0x7F7F);
  EXPECT_EQ(float_to_bf16(f32(0x7F7F8000u)), 0x7F80);  // tie, rounds to even: Inf
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7F80);
  EXPECT_EQ(float_to_bf16(-std::numeric_limits<float>::max()), 0xFF80);
}

TEST(Bf16Conversion, NaN) {
  for (uint32_t bits : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF800001u, 0x7FFFFFFFu, 0xFFFFFFFFu, 0x7F80FFFFu,
                        0x7FFF8000u})
    EXPECT_TRUE(bf16_is_nan(float_to_bf16(f32(bits)))) << std::hex << bits << " -> " << float_to_bf16(f32(bits));
  EXPECT_TRUE(std::isnan(bf16_to_float(0x7FC0)));
  EXPECT_TRUE(std::isnan(bf16_to_float(0x7F81)));
  EXPECT_TRUE(std::isnan(bf16_to_float(0xFFFF)));
}

TEST(Bf16Conversion, EveryBf16DecodesExactlyAndRoundTrips) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const auto bits = static_cast<uint16_t>(h);
    const float f = bf16_to_float(bits);
    if (bf16_is_nan(bits)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << h;
      ASSERT_TRUE(bf16_is_nan(float_to_bf16(f))) << std::hex << h;
      continue;
    }
    ASSERT_EQ(bits_of(f), h << 16) << std::hex << h;
    ASSERT_EQ(float_to_bf16(f), bits) << std::hex << h;
  }
}

TEST(Bf16Conversion, EveryMidpointRoundsToEven) {
  for (uint32_t h = 0; h < 0x7F7F; ++h) {
    const uint32_t mid = (h << 16) | 0x8000u;  // exactly halfway to h + 1
    const uint16_t even = (h % 2 == 0) ? static_cast<uint16_t>(h) : static_cast<uint16_t>(h + 1);
    ASSERT_EQ(float_to_bf16(f32(mid)), even) << std::hex << h;
    ASSERT_EQ(float_to_bf16(f32(mid | 0x80000000u)), even | 0x8000) << std::hex << h;
    ASSERT_EQ(float_to_bf16(f32(mid - 1)), h) << std::hex << h;
    ASSERT_EQ(float_to_bf16(f32(mid + 1)), h + 1) << std::hex << h;
  }
}

TEST(Bf16Conversion, MatchesReferenceOnSampledFloats) {
  std::mt19937 rng(54321);
  auto check = [](uint32_t bits) {
    const float f = f32(bits);
    const uint16_t got = float_to_bf16(f);
    if (std::isnan(f)) {
      ASSERT_TRUE(bf16_is_nan(got)) << std::hex << bits;
      return;
    }
    ASSERT_EQ(got, ref_float_to_bf16(f)) << std::hex << "float bits " << bits << " (" << f << ")";
  };
  for (uint64_t bits = 0; bits <= 0xFFFFFFFFull; bits += 4099) check(static_cast<uint32_t>(bits));
  for (int i = 0; i < 1000000; ++i) check(rng());
}

// ---- element load / store ---------------------------------------------------------------------

TEST(LoadStore, FloatTypes) {
  Buffer f(DType::kF32, 4, Device::cpu()), h(DType::kF16, 4, Device::cpu()), b(DType::kBF16, 4, Device::cpu());
  store_from_double(f.data(), DType::kF32, 2, 0.1);
  EXPECT_EQ(load_as_double(f.data(), DType::kF32, 2), static_cast<double>(0.1f));
  EXPECT_EQ(static_cast<const float*>(f.data())[2], 0.1f);
  store_from_double(f.data(), DType::kF32, 3, -1e300);  // beyond fp32: -Inf
  EXPECT_EQ(load_as_double(f.data(), DType::kF32, 3), -INFINITY);

  store_from_double(h.data(), DType::kF16, 1, 1.0 / 3.0);
  EXPECT_EQ(static_cast<const uint16_t*>(h.data())[1], 0x3555);
  EXPECT_EQ(load_as_double(h.data(), DType::kF16, 1), 0.333251953125);
  store_from_double(h.data(), DType::kF16, 3, 70000.0);
  EXPECT_EQ(load_as_double(h.data(), DType::kF16, 3), INFINITY);
  store_from_double(h.data(), DType::kF16, 0, std::nan(""));
  EXPECT_TRUE(std::isnan(load_as_double(h.data(), DType::kF16, 0)));
  store_from_double(h.data(), DType::kF16, 2, -std::ldexp(1.0, -24));
  EXPECT_EQ(static_cast<const uint16_t*>(h.data())[2], 0x8001);

  store_from_double(b.data(), DType::kBF16, 3, 1.0 / 3.0);
  EXPECT_EQ(static_cast<const uint16_t*>(b.data())[3], 0x3EAB);
  EXPECT_EQ(load_as_double(b.data(), DType::kBF16, 3), 0.333984375);
  store_from_double(b.data(), DType::kBF16, 0, -2.5);
  EXPECT_EQ(load_as_double(b.data(), DType::kBF16, 0), -2.5);
  // Elements next to the stored ones are untouched.
  b.fill_bytes(0);
  store_from_double(b.data(), DType::kBF16, 1, 1.0);
  EXPECT_EQ(static_cast<const uint16_t*>(b.data())[0], 0);
  EXPECT_EQ(static_cast<const uint16_t*>(b.data())[1], 0x3F80);
  EXPECT_EQ(static_cast<const uint16_t*>(b.data())[2], 0);
}

TEST(LoadStore, IntegerTypes) {
  Buffer i32(DType::kI32, 3, Device::cpu()), i64(DType::kI64, 3, Device::cpu());
  store_from_double(i32.data(), DType::kI32, 1, 42.0);
  store_from_double(i32.data(), DType::kI32, 2, -7.0);
  EXPECT_EQ(static_cast<const int32_t*>(i32.data())[1], 42);
  EXPECT_EQ(static_cast<const int32_t*>(i32.data())[2], -7);
  EXPECT_EQ(load_as_double(i32.data(), DType::kI32, 2), -7.0);
  store_from_double(i64.data(), DType::kI64, 0, 1099511627776.0);  // 2^40
  EXPECT_EQ(static_cast<const int64_t*>(i64.data())[0], int64_t{1} << 40);
  EXPECT_EQ(load_as_double(i64.data(), DType::kI64, 0), 1099511627776.0);
}

TEST(LoadStore, Fp8E4M3) {
  // e4m3 (OCP FP8): bias 7, no infinities, 0x7F/0xFF are NaN, max 448.
  Buffer f8(DType::kF8E4M3, 8, Device::cpu());
  f8.fill_bytes(0);
  struct Row {
    double value;
    uint8_t bits;
  };
  int i = 0;
  for (const Row& r : {Row{1.0, 0x38}, Row{-2.0, 0xC0}, Row{448.0, 0x7E}, Row{0.5, 0x30},
                       Row{std::ldexp(1.0, -6), 0x08}, Row{std::ldexp(1.0, -9), 0x01}, Row{0.0, 0x00}}) {
    store_from_double(f8.data(), DType::kF8E4M3, i, r.value);
    EXPECT_EQ(static_cast<const uint8_t*>(f8.data())[i], r.bits) << r.value;
    EXPECT_EQ(load_as_double(f8.data(), DType::kF8E4M3, i), r.value) << r.value;
    ++i;
  }
  static_cast<uint8_t*>(f8.data())[7] = 0x7F;
  EXPECT_TRUE(std::isnan(load_as_double(f8.data(), DType::kF8E4M3, 7)));
}

TEST(LoadStore, Fp8E5M2) {
  // e5m2: bias 15, IEEE-style infinities (0x7C) and NaN, max 57344, subnormals down to 2^-16.
  Buffer f8(DType::kF8E5M2, 8, Device::cpu());
  f8.fill_bytes(0);
  struct Row {
    double value;
    uint8_t bits;
  };
  int i = 0;
  for (const Row& r : {Row{1.0, 0x3C}, Row{-2.0, 0xC0}, Row{57344.0, 0x7B}, Row{0.75, 0x3A},
                       Row{std::ldexp(1.0, -14), 0x04}, Row{std::ldexp(1.0, -16), 0x01}, Row{INFINITY, 0x7C}}) {
    store_from_double(f8.data(), DType::kF8E5M2, i, r.value);
    EXPECT_EQ(static_cast<const uint8_t*>(f8.data())[i], r.bits) << r.value;
    EXPECT_EQ(load_as_double(f8.data(), DType::kF8E5M2, i), r.value) << r.value;
    ++i;
  }
  static_cast<uint8_t*>(f8.data())[7] = 0x7F;
  EXPECT_TRUE(std::isnan(load_as_double(f8.data(), DType::kF8E5M2, 7)));
}

// Every code of both fp8 formats decodes to its value and encodes back to itself; the midpoint of
// two neighbouring codes rounds to the even one and anything past it to the nearer one; the
// overflow rules (e4m3: NaN past the tie at 464, as torch.float8_e4m3fn; e5m2: infinity).
template <typename Decode, typename Encode>
void expect_fp8_format(Decode decode, Encode encode, uint8_t max_code, bool has_inf) {
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    const double v = decode(code);
    if (std::isnan(v)) continue;
    EXPECT_EQ(encode(v), code) << "code " << c << " = " << v;
    if ((c & 0x7f) >= max_code) continue;
    // The neighbour above in magnitude (same sign): midpoint, and just either side of it.
    const double w = decode(static_cast<uint8_t>(c + 1));
    const double mid = (v + w) / 2;
    const uint8_t even = (c & 1) ? static_cast<uint8_t>(c + 1) : code;
    EXPECT_EQ(encode(mid), even) << "tie between codes " << c << " and " << c + 1;
    EXPECT_EQ(encode(std::nextafter(mid, 0.0 * mid)), code) << "below the midpoint above code " << c;
    EXPECT_EQ(encode(std::nextafter(mid, 2 * mid)), static_cast<uint8_t>(c + 1)) << "above the midpoint, code " << c;
  }
  const double max = decode(max_code);
  EXPECT_EQ(encode(-max), static_cast<uint8_t>(0x80 | max_code));
  // Just past the largest finite value (below the tie): still the largest finite value.
  EXPECT_EQ(encode(std::nextafter(max, 2 * max)), max_code) << (has_inf ? "e5m2" : "e4m3");
  EXPECT_EQ(encode(0.0), 0x00);
  EXPECT_EQ(encode(-0.0), 0x80);
}

TEST(Fp8, E4M3EveryCodeRoundingAndOverflow) {
  expect_fp8_format([](uint8_t b) { return static_cast<double>(fp8_e4m3_to_float(b)); },
                    [](double x) { return float_to_fp8_e4m3(x); }, 0x7E, false);
  EXPECT_EQ(fp8_e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(fp8_e4m3_to_float(0x01), std::ldexp(1.0f, -9));  // the smallest subnormal
  EXPECT_EQ(fp8_e4m3_to_float(0x08), std::ldexp(1.0f, -6));  // the smallest normal
  EXPECT_EQ(float_to_fp8_e4m3(464.0), 0x7E);                   // the tie with the NaN code: even, 448
  EXPECT_EQ(float_to_fp8_e4m3(464.5), 0x7F);                   // past it: NaN (no infinity)
  EXPECT_EQ(float_to_fp8_e4m3(-1e30), 0xFF);
  EXPECT_EQ(float_to_fp8_e4m3(INFINITY), 0x7F);
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_float(float_to_fp8_e4m3(NAN))));
  EXPECT_EQ(float_to_fp8_e4m3(std::ldexp(1.0, -10)), 0x00);   // half the smallest subnormal: tie to 0
  EXPECT_EQ(float_to_fp8_e4m3(std::ldexp(1.5, -9)), 0x02);    // 1.5 steps: tie to 2 (even)
  EXPECT_EQ(float_to_fp8_e4m3(std::ldexp(1.0, -20)), 0x00);   // underflow to zero
  EXPECT_EQ(float_to_fp8_e4m3(-std::ldexp(1.0, -20)), 0x80);  // keeps the sign
}

TEST(Fp8, E5M2EveryCodeRoundingAndOverflow) {
  expect_fp8_format([](uint8_t b) { return static_cast<double>(fp8_e5m2_to_float(b)); },
                    [](double x) { return float_to_fp8_e5m2(x); }, 0x7B, true);
  EXPECT_EQ(fp8_e5m2_to_float(0x7B), 57344.0f);
  EXPECT_EQ(fp8_e5m2_to_float(0x7C), INFINITY);
  EXPECT_EQ(fp8_e5m2_to_float(0xFC), -INFINITY);
  EXPECT_TRUE(std::isnan(fp8_e5m2_to_float(0x7D)));
  EXPECT_EQ(fp8_e5m2_to_float(0x01), std::ldexp(1.0f, -16));
  EXPECT_EQ(float_to_fp8_e5m2(61440.0), 0x7C);  // the tie between 57344 (odd) and 65536: infinity
  EXPECT_EQ(float_to_fp8_e5m2(61439.0), 0x7B);
  EXPECT_EQ(float_to_fp8_e5m2(-1e30), 0xFC);
  EXPECT_EQ(float_to_fp8_e5m2(INFINITY), 0x7C);
}

// ---- build and machine facts ------------------------------------------------------------------

TEST(Cuda, DeviceCountConsistentWithBuild) {
#if OPTIMIZED_WITH_CUDA
  EXPECT_TRUE(built_with_cuda());
#else
  EXPECT_FALSE(built_with_cuda());
#endif
  const int count = cuda_device_count();
  EXPECT_GE(count, 0);
  EXPECT_EQ(cuda_device_count(), count) << "stable across calls";
  const std::string reason = cuda_unavailable_reason();
  if (!built_with_cuda()) {
    EXPECT_EQ(count, 0);
    EXPECT_NE(reason.find("CUDA"), std::string::npos) << reason;
  }
  if (count > 0) {
    EXPECT_EQ(reason, "") << "no reason when a device is usable";
  } else {
    EXPECT_FALSE(reason.empty()) << "a reason when no device is usable";
  }
  std::cout << "built_with_cuda=" << built_with_cuda() << " cuda_device_count=" << count << " reason='" << reason
            << "'\n";
}

}  // namespace
}  // namespace optimized
