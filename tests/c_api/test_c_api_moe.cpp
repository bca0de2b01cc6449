// optimized_moe (the C API's MoE layer) is the C++ moe_forward: the same inputs through both give the same
// bits (out, tokens_per_expert, dropped), on the CPU and on cuda:0 when a device is present, and a
// refused call returns the C++ Error's status with its message, word for word, in optimized_last_error().
// The layer's results themselves are checked against float64 in tests/moe/test_moe_layer.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/test_util.h"
#include "optimized/buffer.h"
#include "optimized/c_api.h"
#include "optimized/moe.h"

namespace optimized::testing {
namespace {

struct Shape {
  int64_t tokens = 257, experts = 8, d = 24, f = 40;
  DType dtype = DType::kBF16;
};

// x, router_weight, w13, w2: fresh values; out (twice: C++ and C), counts (twice), dropped (twice): poison.
std::vector<Buffer> make_buffers(const Shape& s, std::mt19937_64& rng) {
  const int64_t T = s.tokens, E = s.experts, d = s.d, F = s.f;
  std::vector<Buffer> b;
  b.emplace_back(s.dtype, T * d, Device::cpu());
  b.emplace_back(s.dtype, E * d, Device::cpu());
  b.emplace_back(s.dtype, E * d * 2 * F, Device::cpu());
  b.emplace_back(s.dtype, E * F * d, Device::cpu());
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (Buffer& buf : b)
    for (int64_t i = 0; i < buf.count(); ++i) store_from_double(buf.data(), buf.dtype(), i, u(rng) * 0.5);
  for (int twice = 0; twice < 2; ++twice) {
    b.emplace_back(s.dtype, T * d, Device::cpu());
    b.back().fill_bytes(0xFF);
  }
  for (int twice = 0; twice < 2; ++twice) {
    b.emplace_back(DType::kI32, E, Device::cpu());
    b.back().fill_bytes(0x5A);
  }
  for (int twice = 0; twice < 2; ++twice) {
    b.emplace_back(DType::kI32, 1, Device::cpu());
    b.back().fill_bytes(0x5A);
  }
  return b;
}

optimized_tensor c_tensor(void* data, DType dtype, Device device, std::vector<int64_t> shape) {
  optimized_tensor t;
  EXPECT_EQ(optimized_tensor_contiguous(&t, data, static_cast<optimized_dtype>(dtype),
                                        device.is_cuda() ? OPTIMIZED_DEVICE_CUDA : OPTIMIZED_DEVICE_CPU, device.index,
                                        static_cast<int32_t>(shape.size()), shape.data()),
            OPTIMIZED_STATUS_OK)
      << optimized_last_error();
  return t;
}

// The layer through C++ (buffers 4, 6, 8) and through C (5, 7, 9) on `device`'s copies of b.
void compare(const Shape& s, double capacity_factor, bool cuda) {
  SCOPED_TRACE("cf=" + std::to_string(capacity_factor) + (cuda ? " cuda" : " cpu"));
  const int64_t T = s.tokens, E = s.experts, d = s.d, F = s.f;
  std::mt19937_64 rng = test_rng();
  const std::vector<Buffer> b = make_buffers(s, rng);
  std::vector<const Buffer*> host;
  for (const Buffer& buf : b) host.push_back(&buf);
  MoeLayerOptions o;
  o.top_k = 2, o.normalize = true, o.capacity_factor = capacity_factor;
  optimized_moe_options co;
  ASSERT_EQ(optimized_moe_options_default(&co), OPTIMIZED_STATUS_OK);
  co.top_k = 2, co.normalize = 1, co.capacity_factor = capacity_factor;
  std::string c_error;
  const std::vector<Buffer> r = run_case(cuda, host, [&](const std::vector<void*>& p, Device dev) {
    moe_forward(TensorView(p[0], s.dtype, dev, {T, d}), TensorView(p[1], s.dtype, dev, {E, d}),
                TensorView(p[2], s.dtype, dev, {E, d, 2 * F}), TensorView(p[3], s.dtype, dev, {E, F, d}), o,
                TensorView(p[4], s.dtype, dev, {T, d}), TensorView(p[6], DType::kI32, dev, {E}),
                TensorView(p[8], DType::kI32, dev, {1}));
    const optimized_tensor x = c_tensor(p[0], s.dtype, dev, {T, d}), rw = c_tensor(p[1], s.dtype, dev, {E, d});
    const optimized_tensor w13 = c_tensor(p[2], s.dtype, dev, {E, d, 2 * F}), w2 = c_tensor(p[3], s.dtype, dev, {E, F, d});
    optimized_tensor out = c_tensor(p[5], s.dtype, dev, {T, d}), counts = c_tensor(p[7], DType::kI32, dev, {E});
    optimized_tensor dropped = c_tensor(p[9], DType::kI32, dev, {1});
    if (optimized_moe(&x, &rw, &w13, &w2, &out, &counts, &dropped, &co, "auto", nullptr) != OPTIMIZED_STATUS_OK)
      c_error = optimized_last_error();
  });
  ASSERT_EQ(r.size(), b.size());
  ASSERT_EQ(c_error, "");
  EXPECT_STREQ(optimized_last_error(), "");
  EXPECT_EQ(std::memcmp(r[4].data(), r[5].data(), r[4].bytes()), 0) << "out";
  EXPECT_EQ(std::memcmp(r[6].data(), r[7].data(), r[6].bytes()), 0) << "tokens_per_expert";
  EXPECT_EQ(std::memcmp(r[8].data(), r[9].data(), r[8].bytes()), 0) << "dropped";
  EXPECT_FALSE(std::isnan(load_as_double(r[5].data(), s.dtype, 0))) << "out written";
  if (capacity_factor > 0) {
    EXPECT_GT(*static_cast<const int32_t*>(r[9].data()), 0) << "some pairs dropped";
  }
}

TEST(CApiMoe, SameBitsAsCpp) {
  compare(Shape{}, 0.0, false);
  compare(Shape{}, 0.5, false);
}

// The C API returns the C++ refusal: its status, and its message word for word.
TEST(CApiMoe, ErrorIsTheCppMessage) {
  const int64_t T = 7, E = 4, d = 16, F = 8;
  std::vector<float> x(T * d, 1.0f), rw(E * d, 1.0f), w13(E * d * 2 * F, 1.0f), w2(E * F * d, 1.0f), out(T * d);
  const Device cpu = Device::cpu();
  // router_weight of the wrong width
  const Caught cpp = call([&] {
    moe_forward(TensorView(x.data(), DType::kF32, cpu, {T, d}), TensorView(rw.data(), DType::kF32, cpu, {E, d - 1}),
                TensorView(w13.data(), DType::kF32, cpu, {E, d, 2 * F}), TensorView(w2.data(), DType::kF32, cpu, {E, F, d}),
                MoeLayerOptions{}, TensorView(out.data(), DType::kF32, cpu, {T, d}));
  });
  ASSERT_TRUE(cpp.thrown);
  const optimized_tensor cx = c_tensor(x.data(), DType::kF32, cpu, {T, d}), crw = c_tensor(rw.data(), DType::kF32, cpu, {E, d - 1});
  const optimized_tensor c13 = c_tensor(w13.data(), DType::kF32, cpu, {E, d, 2 * F});
  const optimized_tensor c2 = c_tensor(w2.data(), DType::kF32, cpu, {E, F, d});
  optimized_tensor cout_ = c_tensor(out.data(), DType::kF32, cpu, {T, d});
  const optimized_status st = optimized_moe(&cx, &crw, &c13, &c2, &cout_, nullptr, nullptr, nullptr, nullptr, nullptr);
  EXPECT_EQ(static_cast<int>(st), static_cast<int>(cpp.status));
  EXPECT_EQ(std::string(optimized_last_error()), cpp.message);
  EXPECT_TRUE(contains_all(optimized_last_error(), {"router_weight", "(E, 16)", "(4, 15)"})) << optimized_last_error();
  std::printf("optimized_moe refused: %s (%s)\n", optimized_last_error(), optimized_status_string(st));

  // the C layer's own checks name the field
  optimized_moe_options o;
  ASSERT_EQ(optimized_moe_options_default(&o), OPTIMIZED_STATUS_OK);
  o.scoring = 3;
  const optimized_tensor crw_ok = c_tensor(rw.data(), DType::kF32, cpu, {E, d});
  EXPECT_EQ(optimized_moe(&cx, &crw_ok, &c13, &c2, &cout_, nullptr, nullptr, &o, "auto", nullptr),
            OPTIMIZED_STATUS_INVALID_ARGUMENT);
  EXPECT_TRUE(contains_all(optimized_last_error(), {"options.scoring", "given 3"})) << optimized_last_error();
}

TEST(CApiMoeCuda, SameBitsAsCpp) {
  SKIP_WITHOUT_CUDA();
  compare(Shape{}, 0.0, true);
  compare(Shape{}, 0.5, true);
}

}  // namespace
}  // namespace optimized::testing
