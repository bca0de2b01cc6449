// RoPE (rope_forward / rope_backward, include/optimized/fused.h) through the public API, on the cpu
// variant always and on the cuda variant when a device is present (those cases skip with the reason
// otherwise), against a float64 reference written here from the definition (angle = p *
// pow(theta, -2i / rotary_dim) in float64, std::cos / std::sin): both layouts, positions random up to
// 1e5, 0, 100000 and beyond (int32 and int64, (B, S) and (S)), D in {2, 64, 128, 80, 6} with partial
// rotary, GQA head counts, q and k sliced from one fused qkv buffer (strided, also one element off
// 16-byte alignment), every dtype, out of place into NaN-poisoned outputs and in place (the v heads
// of the qkv buffer, never an operand, must stay as they were), forward and backward, with and
// without a cos_sin cache; the backward is checked to be the exact transpose in float64
// (<rope(x), g> == <x, rope_backward(g)>), and every error path names its argument.
//
// Tolerance, per element (u: the output dtype's unit roundoff, 2^-24 fp32 / 2^-11 fp16 / 2^-8 bf16):
//   |out - ref| <= u * |ref| + (8 * 2^-24 + 2e-16 * |p|) * (|x0| + |x1|)     (fp64: 1e-12 for 8 * 2^-24)
// the 2e-16 * |p| term: the float64 angle's own rounding (a few ulps of p * inv_freq), which alone
// limits any implementation at p ~ 1e9; fp16 adds its subnormal spacing 2^-24 (tiny results).
// the rounding of the result plus a few fp32 ulps of the rotation (cos / sin exact to ~1 ulp, two
// products and a sum). With a plain fp32 angle the large positions would fail the fp32 bound.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/test_util.h"
#include "optimized/buffer.h"
#include "optimized/core.h"
#include "optimized/fused.h"
#include "optimized/rope.h"

namespace optimized::testing {
namespace {

void put(const Buffer& b, int64_t i, double v) {
  switch (b.dtype()) {
    case DType::kF32: static_cast<float*>(b.data())[i] = static_cast<float>(v); return;
    case DType::kF64: static_cast<double*>(b.data())[i] = v; return;
    case DType::kF16: static_cast<uint16_t*>(b.data())[i] = float_to_half(static_cast<float>(v)); return;
    case DType::kBF16: static_cast<uint16_t*>(b.data())[i] = float_to_bf16(static_cast<float>(v)); return;
    case DType::kI32: static_cast<int32_t*>(b.data())[i] = static_cast<int32_t>(v); return;
    case DType::kI64: static_cast<int64_t*>(b.data())[i] = static_cast<int64_t>(v); return;
    default: FAIL() << "dtype";
  }
}
double get(const Buffer& b, int64_t i) {
  switch (b.dtype()) {
    case DType::kF32: return static_cast<const float*>(b.data())[i];
    case DType::kF64: return static_cast<const double*>(b.data())[i];
    case DType::kF16: return half_to_float(static_cast<const uint16_t*>(b.data())[i]);
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(b.data())[i]);
    default: ADD_FAILURE() << "dtype"; return 0;
  }
}
double unit_roundoff(DType d) {
  switch (d) {
    case DType::kF16: return std::ldexp(1.0, -11);
    case DType::kBF16: return std::ldexp(1.0, -8);
    case DType::kF64: return 0.0;
    default: return std::ldexp(1.0, -24);
  }
}

enum class Pos { kRandom, kZero, kLarge, kHuge };

struct RopeCase {
  DType dtype = DType::kF32;
  bool neox = true;
  int64_t B = 2, S = 5, Hq = 4, Hk = 2, D = 64, rd = 0;  // rd 0: D
  bool qkv = false;     // q, k sliced from one (B, S, Hq + 2 Hk, D) buffer (+ v heads, untouched)
  int64_t offset = 0;   // elements before the data (1: rows off 16-byte alignment)
  bool inplace = false;
  bool backward = false;
  bool cos_sin = false;
  bool pos64 = false, pos_1d = false;
  Pos pos = Pos::kRandom;
  bool with_k = true;
  bool cuda = false;
  double theta = 10000.0;

  std::string label() const {
    std::ostringstream s;
    s << dtype_name(dtype) << (neox ? " neox" : " interleaved") << " B" << B << " S" << S << " Hq" << Hq << " Hk"
      << Hk << " D" << D << " rd" << rd << (qkv ? " qkv" : "") << " off" << offset << (inplace ? " inplace" : "")
      << (backward ? " bwd" : " fwd") << (cos_sin ? " cos_sin" : "") << (pos64 ? " i64" : " i32")
      << (pos_1d ? " pos(S)" : "") << " pos" << static_cast<int>(pos) << (with_k ? "" : " no-k")
      << (cuda ? " cuda" : " cpu");
    return s.str();
  }
};

// Runs one case and checks every element of every output (and what must not change).
void check_case(const RopeCase& c) {
  SCOPED_TRACE(c.label());
  const int64_t B = c.B, S = c.S, Hq = c.Hq, Hk = c.with_k ? c.Hk : 0, D = c.D;
  const int64_t rd = c.rd == 0 ? D : c.rd, half = rd / 2;
  std::mt19937_64 rng = test_rng();
  std::uniform_real_distribution<double> uni(-1.0, 1.0);

  // ---- storage: inputs (qkv: one buffer) and outputs, NaN outside the data ----
  const int64_t heads_all = c.qkv ? Hq + 2 * Hk : 0;
  const int64_t in_count = c.offset + (c.qkv ? B * S * heads_all * D : B * S * Hq * D) + 7;
  const int64_t k_count = c.qkv ? 0 : c.offset + B * S * Hk * D + 7;
  Buffer in(c.dtype, in_count, Device::cpu()), kin(c.dtype, std::max<int64_t>(k_count, 1), Device::cpu());
  in.fill_bytes(0xFF);
  kin.fill_bytes(0xFF);
  // Element offsets (relative to the buffer) of q / k element (b, s, h, d), inputs.
  auto q_at = [&](int64_t b, int64_t s, int64_t h, int64_t d) {
    return c.offset + (c.qkv ? ((b * S + s) * heads_all + h) * D : ((b * S + s) * Hq + h) * D) + d;
  };
  auto k_at = [&](int64_t b, int64_t s, int64_t h, int64_t d) {
    return c.offset + (c.qkv ? ((b * S + s) * heads_all + Hq + h) * D : ((b * S + s) * Hk + h) * D) + d;
  };
  const Buffer& kbuf = c.qkv ? in : kin;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t d = 0; d < D; ++d) put(in, q_at(b, s, h, d), uni(rng));
      for (int64_t h = 0; h < Hk; ++h)
        for (int64_t d = 0; d < D; ++d) put(kbuf, k_at(b, s, h, d), uni(rng));
      if (c.qkv)  // v heads: data that must survive
        for (int64_t h = Hq + Hk; h < heads_all; ++h)
          for (int64_t d = 0; d < D; ++d) put(in, c.offset + ((b * S + s) * heads_all + h) * D + d, uni(rng));
    }
  Buffer qout(c.dtype, B * S * Hq * D + 1, Device::cpu()), kout(c.dtype, B * S * Hk * D + 1, Device::cpu());
  qout.fill_bytes(0xFF);
  kout.fill_bytes(0xFF);

  // ---- positions and the cos_sin cache ----
  const int64_t npos = c.pos_1d ? S : B * S;
  Buffer pos(c.pos64 ? DType::kI64 : DType::kI32, npos, Device::cpu());
  std::vector<int64_t> pv(static_cast<size_t>(npos));
  const int64_t max_pos = 4096;
  for (int64_t i = 0; i < npos; ++i) {
    int64_t v = 0;
    switch (c.pos) {
      case Pos::kRandom: v = static_cast<int64_t>(rng() % (c.cos_sin ? max_pos : 100001)); break;
      case Pos::kZero: v = 0; break;
      case Pos::kLarge: v = 100000 + i; break;
      case Pos::kHuge: v = c.pos64 ? (int64_t{1} << 33) + 977 * i : 2000000000 + 977 * i; break;
    }
    pv[i] = v;
    put(pos, i, static_cast<double>(v));
  }
  auto angle = [&](int64_t p, int64_t i) {
    return static_cast<double>(p) * std::pow(c.theta, -static_cast<double>(2 * i) / static_cast<double>(rd));
  };
  const DType cs_dtype = c.dtype == DType::kF64 ? DType::kF64 : DType::kF32;
  Buffer cs(cs_dtype, max_pos * rd, Device::cpu());
  if (c.cos_sin)
    for (int64_t p = 0; p < max_pos; ++p)
      for (int64_t i = 0; i < half; ++i) {
        put(cs, p * rd + i, std::cos(angle(p, i)));
        put(cs, p * rd + half + i, std::sin(angle(p, i)));
      }

  // ---- the call ----
  const std::vector<const Buffer*> host = {&in, &kin, &qout, &kout, &pos, &cs};
  RopeOptions o;
  o.layout = c.neox ? RopeLayout::kNeox : RopeLayout::kInterleaved;
  o.theta = c.theta;
  o.rotary_dim = c.rd;
  const std::vector<Buffer> after = run_case(c.cuda, host, [&](const std::vector<void*>& base, Device dev) {
    auto v = [&](void* p, int64_t off, std::vector<int64_t> shape, std::vector<int64_t> strides) {
      return raw(static_cast<char*>(p) + off * static_cast<int64_t>(dtype_size(c.dtype)), c.dtype, dev, shape, strides);
    };
    TensorView q, k, qo, ko;
    if (c.qkv) {
      q = v(base[0], c.offset, {B, S, Hq, D}, {S * heads_all * D, heads_all * D, D, 1});
      if (Hk) k = v(base[0], c.offset + Hq * D, {B, S, Hk, D}, {S * heads_all * D, heads_all * D, D, 1});
    } else {
      q = v(base[0], c.offset, {B, S, Hq, D}, {S * Hq * D, Hq * D, D, 1});
      if (Hk) k = v(base[1], c.offset, {B, S, Hk, D}, {S * Hk * D, Hk * D, D, 1});
    }
    if (c.inplace) {
      qo = q, ko = k;
    } else {
      qo = v(base[2], 0, {B, S, Hq, D}, {S * Hq * D, Hq * D, D, 1});
      if (Hk) ko = v(base[3], 0, {B, S, Hk, D}, {S * Hk * D, Hk * D, D, 1});
    }
    const TensorView p = c.pos_1d ? raw(base[4], pos.dtype(), dev, {S}, {1}) : raw(base[4], pos.dtype(), dev, {B, S}, {S, 1});
    const TensorView csv = c.cos_sin ? raw(base[5], cs_dtype, dev, {max_pos, rd}, {rd, 1}) : TensorView{};
    if (c.backward)
      rope_backward(q, k, p, o, qo, ko, csv, RopeVariant::kAuto, {});
    else
      rope_forward(q, k, p, o, qo, ko, csv, RopeVariant::kAuto, {});
  });
  if (after.size() != host.size()) return;

  // ---- the check ----
  const double u = unit_roundoff(c.dtype);
  const double fp = c.dtype == DType::kF64 ? 1e-12 : 8 * std::ldexp(1.0, -24);
  const double floor = c.dtype == DType::kF16 ? std::ldexp(1.0, -24) : 0.0;  // fp16's subnormal spacing
  int failures = 0;
  int64_t pos_now = 0;  // the position of the row being checked: the float64 angle's own rounding, ~1e-16 * p
  auto expect = [&](double got, double want, double scale, const char* what, int64_t b, int64_t s, int64_t h, int64_t d) {
    const double tol = u * std::fabs(want) + (fp + 2e-16 * std::fabs(static_cast<double>(pos_now))) * scale + floor;
    if (!(std::fabs(got - want) <= tol) && failures++ < 5)
      ADD_FAILURE() << what << "[" << b << "][" << s << "][" << h << "][" << d << "] = " << got << ", expected "
                    << want << " (tol " << tol << ")";
  };
  auto check_tensor = [&](const char* what, const Buffer& src, std::function<int64_t(int64_t, int64_t, int64_t, int64_t)> at,
                          const Buffer& dst, bool dst_is_src, int64_t H) {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s) {
        const int64_t p = pv[c.pos_1d ? s : b * S + s];
        pos_now = p;
        for (int64_t h = 0; h < H; ++h) {
          auto out_at = [&](int64_t d) { return dst_is_src ? at(b, s, h, d) : ((b * S + s) * H + h) * D + d; };
          for (int64_t i = 0; i < half; ++i) {
            const int64_t i0 = c.neox ? i : 2 * i, i1 = c.neox ? i + half : 2 * i + 1;
            const double x0 = get(src, at(b, s, h, i0)), x1 = get(src, at(b, s, h, i1));
            const double co = std::cos(angle(p, i)), si = (c.backward ? -1 : 1) * std::sin(angle(p, i));
            const double scale = std::fabs(x0) + std::fabs(x1);
            expect(get(dst, out_at(i0)), x0 * co - x1 * si, scale, what, b, s, h, i0);
            expect(get(dst, out_at(i1)), x1 * co + x0 * si, scale, what, b, s, h, i1);
          }
          for (int64_t d = rd; d < D; ++d) {
            const double x = get(src, at(b, s, h, d)), y = get(dst, out_at(d));
            if (!(x == y) && failures++ < 5) ADD_FAILURE() << what << " pass-through dim " << d << ": " << y << " != " << x;
          }
        }
      }
  };
  // Inputs are read from the original host buffers; outputs from the buffers after the call.
  const Buffer& in_after = after[0];
  const Buffer& k_after = c.qkv ? after[0] : after[1];
  if (c.inplace) {
    check_tensor("q", in, q_at, in_after, true, Hq);
    check_tensor("k", kbuf, k_at, k_after, true, Hk);
  } else {
    check_tensor("q_out", in, q_at, after[2], false, Hq);
    check_tensor("k_out", kbuf, k_at, after[3], false, Hk);
    // Inputs unchanged, bit for bit.
    EXPECT_EQ(std::memcmp(in.data(), after[0].data(), in.bytes()), 0) << "an input changed";
    EXPECT_EQ(std::memcmp(kin.data(), after[1].data(), kin.bytes()), 0) << "an input changed";
    // Past the outputs: still poison.
    EXPECT_TRUE(std::isnan(get(after[2], B * S * Hq * D))) << "q_out written past its end";
    EXPECT_TRUE(std::isnan(get(after[3], B * S * Hk * D))) << "k_out written past its end";
  }
  // Everything of the input buffer that is neither q nor k (v heads, offset, guard): unchanged bytes.
  if (c.inplace) {
    std::vector<char> touched(static_cast<size_t>(in_count), 0);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s)
        for (int64_t d = 0; d < D; ++d) {
          for (int64_t h = 0; h < Hq; ++h) touched[q_at(b, s, h, d)] = 1;
          if (c.qkv)
            for (int64_t h = 0; h < Hk; ++h) touched[k_at(b, s, h, d)] = 1;
        }
    const size_t es = dtype_size(c.dtype);
    int64_t changed = 0;
    for (int64_t i = 0; i < in_count; ++i)
      if (!touched[i] && std::memcmp(static_cast<const char*>(in.data()) + i * es,
                                     static_cast<const char*>(in_after.data()) + i * es, es) != 0)
        ++changed;
    EXPECT_EQ(changed, 0) << "elements outside q and k changed (v heads, padding)";
  }
}

// ---- the grid -------------------------------------------------------------------------------

const DType kAllDtypes[] = {DType::kF32, DType::kF16, DType::kBF16, DType::kF64};

void run_grid(bool cuda) {
  for (DType dt : kAllDtypes) {
    if (cuda && dt == DType::kF64) continue;
    for (bool neox : {true, false}) {
      // Head dims, partial rotary, GQA, odd sizes.
      const int64_t shapes[][5] = {
          // B, S, Hq, Hk, D ; rd below
          {2, 5, 4, 2, 64}, {1, 7, 3, 1, 128}, {3, 3, 5, 5, 80}, {1, 1, 1, 1, 2}, {2, 13, 8, 1, 6}};
      for (const auto& sh : shapes)
        for (int64_t rd : {int64_t{0}, sh[4] >= 8 ? sh[4] / 2 : int64_t{2}})
          for (bool backward : {false, true}) {
            RopeCase c;
            c.dtype = dt, c.neox = neox, c.B = sh[0], c.S = sh[1], c.Hq = sh[2], c.Hk = sh[3], c.D = sh[4], c.rd = rd;
            c.backward = backward, c.cuda = cuda;
            check_case(c);
          }
      // Strided q / k slices of one qkv buffer, in place and out of place, aligned and not.
      for (bool inplace : {false, true})
        for (int64_t offset : {0, 1}) {
          RopeCase c;
          c.dtype = dt, c.neox = neox, c.qkv = true, c.inplace = inplace, c.offset = offset, c.cuda = cuda;
          c.B = 2, c.S = 9, c.Hq = 8, c.Hk = 2, c.D = 128, c.rd = offset ? 64 : 0;
          check_case(c);
        }
      // Positions: zero, large, huge, int64, (S), the cos_sin cache; q only.
      for (Pos pk : {Pos::kZero, Pos::kLarge, Pos::kHuge}) {
        RopeCase c;
        c.dtype = dt, c.neox = neox, c.pos = pk, c.pos64 = pk == Pos::kHuge, c.cuda = cuda;
        check_case(c);
      }
      RopeCase c;
      c.dtype = dt, c.neox = neox, c.pos_1d = true, c.pos64 = true, c.cos_sin = true, c.cuda = cuda, c.D = 80, c.rd = 48;
      check_case(c);
      c.with_k = false, c.inplace = true, c.backward = true, c.cos_sin = false;
      check_case(c);
    }
  }
}

TEST(Rope, CpuGrid) { run_grid(false); }

TEST(Rope, CudaGrid) {
  SKIP_WITHOUT_CUDA();
  run_grid(true);
}

// Zero tokens or zero heads: nothing happens, nothing is read.
TEST(Rope, Empty) {
  RopeOptions o;
  o.layout = RopeLayout::kNeox;
  Buffer pos(DType::kI32, 1, Device::cpu());
  TensorView q = raw(nullptr, DType::kF32, Device::cpu(), {0, 3, 2, 8}, {48, 16, 8, 1});
  TensorView p = raw(pos.data(), DType::kI32, Device::cpu(), {0, 3}, {3, 1});
  rope_forward(q, {}, p, o, q, {});
}

// ---- the transpose, in float64 --------------------------------------------------------------

TEST(Rope, BackwardIsTheTransposeInFloat64) {
  for (bool neox : {true, false}) {
    SCOPED_TRACE(neox ? "neox" : "interleaved");
    const int64_t B = 2, S = 7, H = 3, D = 80, n = B * S * H * D;
    std::mt19937_64 rng = test_rng();
    std::uniform_real_distribution<double> uni(-1.0, 1.0);
    Buffer x(DType::kF64, n, Device::cpu()), g(DType::kF64, n, Device::cpu()), y(DType::kF64, n, Device::cpu()),
        z(DType::kF64, n, Device::cpu()), back(DType::kF64, n, Device::cpu()), pos(DType::kI64, B * S, Device::cpu());
    for (int64_t i = 0; i < n; ++i) put(x, i, uni(rng)), put(g, i, uni(rng));
    for (int64_t i = 0; i < B * S; ++i) put(pos, i, static_cast<double>(rng() % 200000));
    auto view = [&](const Buffer& b) { return raw(b.data(), DType::kF64, Device::cpu(), {B, S, H, D}, {S * H * D, H * D, D, 1}); };
    const TensorView p = raw(pos.data(), DType::kI64, Device::cpu(), {B, S}, {S, 1});
    RopeOptions o;
    o.layout = neox ? RopeLayout::kNeox : RopeLayout::kInterleaved;
    o.rotary_dim = 64;
    rope_forward(view(x), {}, p, o, view(y), {});
    rope_backward(view(g), {}, p, o, view(z), {});
    rope_backward(view(y), {}, p, o, view(back), {});
    double yg = 0, xz = 0, scale = 0, err = 0;
    for (int64_t i = 0; i < n; ++i) {
      yg += get(y, i) * get(g, i);
      xz += get(x, i) * get(z, i);
      scale += std::fabs(get(x, i) * get(g, i));
      err = std::max(err, std::fabs(get(back, i) - get(x, i)));
    }
    EXPECT_NEAR(yg, xz, 1e-13 * scale) << "<rope(x), g> != <x, rope_backward(g)>";
    EXPECT_LE(err, 1e-14) << "rope_backward(rope_forward(x)) != x";
  }
}

// A position outside the cos_sin cache: NaN in the rotated dims, the pass-through dims as they were.
TEST(Rope, CosSinOutOfRangeGivesNan) {
  const int64_t D = 8, rd = 4;
  Buffer q(DType::kF32, D, Device::cpu()), out(DType::kF32, D, Device::cpu()), cs(DType::kF32, 2 * rd, Device::cpu()),
      pos(DType::kI32, 1, Device::cpu());
  for (int64_t i = 0; i < D; ++i) put(q, i, 0.5 + i);
  for (int64_t i = 0; i < 2 * rd; ++i) put(cs, i, 0.25);
  put(pos, 0, 2);  // max_pos = 2
  RopeOptions o;
  o.layout = RopeLayout::kNeox;
  o.rotary_dim = rd;
  rope_forward(raw(q.data(), DType::kF32, Device::cpu(), {1, 1, 1, D}, {D, D, D, 1}), {},
               raw(pos.data(), DType::kI32, Device::cpu(), {1}, {1}), o,
               raw(out.data(), DType::kF32, Device::cpu(), {1, 1, 1, D}, {D, D, D, 1}), {},
               raw(cs.data(), DType::kF32, Device::cpu(), {2, rd}, {rd, 1}));
  for (int64_t d = 0; d < rd; ++d) EXPECT_TRUE(std::isnan(get(out, d))) << d;
  for (int64_t d = rd; d < D; ++d) EXPECT_EQ(get(out, d), get(q, d)) << d;
}

// ---- errors ---------------------------------------------------------------------------------

struct ErrorFixture {
  Buffer qkv{DType::kF32, 2 * 3 * 8 * 16, Device::cpu()};
  Buffer out{DType::kF32, 2 * 3 * 8 * 16, Device::cpu()};
  Buffer pos{DType::kI32, 6, Device::cpu()};
  Buffer cs{DType::kF32, 64, Device::cpu()};
  RopeOptions o;
  ErrorFixture() {
    o.layout = RopeLayout::kNeox;
    for (int64_t i = 0; i < 6; ++i) put(pos, i, static_cast<double>(i));
  }
  // (2, 3, H, 16) views: q heads 0..3 of the qkv buffer, k heads 4..5.
  TensorView q() const { return raw(qkv.data(), DType::kF32, Device::cpu(), {2, 3, 4, 16}, {384, 128, 16, 1}); }
  TensorView k() const {
    return raw(static_cast<float*>(qkv.data()) + 64, DType::kF32, Device::cpu(), {2, 3, 2, 16}, {384, 128, 16, 1});
  }
  TensorView q_out() const { return raw(out.data(), DType::kF32, Device::cpu(), {2, 3, 4, 16}, {192, 64, 16, 1}); }
  TensorView k_out() const {
    return raw(static_cast<float*>(out.data()) + 512, DType::kF32, Device::cpu(), {2, 3, 2, 16}, {96, 32, 16, 1});
  }
  TensorView p() const { return raw(pos.data(), DType::kI32, Device::cpu(), {2, 3}, {3, 1}); }
};

TEST(RopeErrors, EveryArgumentIsNamed) {
  ErrorFixture f;
  // The valid call, in place on the qkv slices and out of place.
  rope_forward(f.q(), f.k(), f.p(), f.o, f.q(), f.k());
  rope_forward(f.q(), f.k(), f.p(), f.o, f.q_out(), f.k_out());

  auto expect = [&](const Caught& c, Status st, const char* word) {
    EXPECT_ERROR(c, st);
    EXPECT_MENTIONS(c, word);
  };
  expect(call([&] { rope_forward(raw(f.qkv.data(), DType::kF32, Device::cpu(), {6, 4, 16}, {64, 16, 1}), f.k(), f.p(), f.o, f.q_out(), f.k_out()); }),
         Status::kInvalidArgument, "q");
  expect(call([&] { rope_forward(f.q(), f.k(), f.p(), f.o, f.q_out(), {}); }), Status::kInvalidArgument, "k_out");
  expect(call([&] { rope_forward(f.q(), {}, f.p(), f.o, f.q_out(), f.k_out()); }), Status::kInvalidArgument, "k_out");
  expect(call([&] { rope_forward(f.q(), f.k(), raw(f.pos.data(), DType::kI32, Device::cpu(), {3, 2}, {2, 1}), f.o, f.q_out(), f.k_out()); }),
         Status::kInvalidArgument, "positions");
  expect(call([&] { rope_forward(f.q(), f.k(), as(f.p(), DType::kF32), f.o, f.q_out(), f.k_out()); }),
         Status::kInvalidArgument, "positions");
  {
    RopeOptions bad = f.o;
    bad.rotary_dim = 5;
    expect(call([&] { rope_forward(f.q(), f.k(), f.p(), bad, f.q_out(), f.k_out()); }), Status::kInvalidArgument,
           "rope.rotary_dim");
    bad.rotary_dim = 18;
    expect(call([&] { rope_forward(f.q(), f.k(), f.p(), bad, f.q_out(), f.k_out()); }), Status::kInvalidArgument,
           "rope.rotary_dim");
    bad = f.o;
    bad.layout = RopeLayout::kNone;
    expect(call([&] { rope_forward(f.q(), f.k(), f.p(), bad, f.q_out(), f.k_out()); }), Status::kInvalidArgument,
           "rope.layout");
    bad = f.o;
    bad.theta = -1;
    expect(call([&] { rope_forward(f.q(), f.k(), f.p(), bad, f.q_out(), f.k_out()); }), Status::kInvalidArgument,
           "rope.theta");
  }
  // Unit stride along D.
  expect(call([&] { rope_forward(raw(f.qkv.data(), DType::kF32, Device::cpu(), {2, 3, 4, 8}, {384, 128, 16, 2}), {}, f.p(), f.o,
                                 raw(f.out.data(), DType::kF32, Device::cpu(), {2, 3, 4, 8}, {96, 32, 8, 1}), {}); }),
         Status::kInvalidArgument, "q");
  // k's shape, dtype.
  expect(call([&] { rope_forward(f.q(), raw(f.qkv.data(), DType::kF32, Device::cpu(), {2, 3, 2, 8}, {384, 128, 16, 1}), f.p(), f.o,
                                 f.q_out(), f.k_out()); }),
         Status::kInvalidArgument, "k");
  expect(call([&] { rope_forward(f.q(), as(f.k(), DType::kF16), f.p(), f.o, f.q_out(), f.k_out()); }),
         Status::kInvalidArgument, "k");
  // Aliasing: q_out over k (a different view), k_out over q_out, an output over positions.
  expect(call([&] { rope_forward(f.q(), f.k(), f.p(), f.o, raw(static_cast<float*>(f.qkv.data()) + 32, DType::kF32, Device::cpu(), {2, 3, 4, 16}, {384, 128, 16, 1}), f.k_out()); }),
         Status::kInvalidArgument, "q_out");
  expect(call([&] { rope_forward(f.q(), f.k(), f.p(), f.o, f.q_out(), raw(f.out.data(), DType::kF32, Device::cpu(), {2, 3, 2, 16}, {96, 32, 16, 1})); }),
         Status::kInvalidArgument, "k_out");
  expect(call([&] { rope_forward(f.q(), f.k(), f.p(), f.o, f.q_out(), raw(f.qkv.data(), DType::kF32, Device::cpu(), {2, 3, 2, 16}, {384, 128, 16, 1})); }),
         Status::kInvalidArgument, "k_out");
  // k_out = k (in place for k only) beside a fresh q_out: valid.
  rope_forward(f.q(), f.k(), f.p(), f.o, f.q_out(), f.k());
  // An output whose elements overlap one another.
  expect(call([&] { rope_forward(f.q(), {}, f.p(), f.o, raw(f.out.data(), DType::kF32, Device::cpu(), {2, 3, 4, 16}, {0, 64, 16, 1}), {}); }),
         Status::kInvalidArgument, "q_out");
  // cos_sin: shape, dtype.
  expect(call([&] { rope_forward(f.q(), f.k(), f.p(), f.o, f.q_out(), f.k_out(), raw(f.cs.data(), DType::kF32, Device::cpu(), {4, 8}, {8, 1})); }),
         Status::kInvalidArgument, "cos_sin");
  expect(call([&] { rope_forward(f.q(), f.k(), f.p(), f.o, f.q_out(), f.k_out(), raw(f.cs.data(), DType::kF16, Device::cpu(), {4, 16}, {16, 1})); }),
         Status::kInvalidArgument, "cos_sin");
  // Backward names its own arguments.
  expect(call([&] { rope_backward(f.q(), f.k(), f.p(), f.o, f.q_out(), {}); }), Status::kInvalidArgument, "dk");
  // Variants: cuda on CPU operands; names.
  expect(call([&] { rope_forward(f.q(), f.k(), f.p(), f.o, f.q_out(), f.k_out(), {}, RopeVariant::kCuda); }),
         Status::kInvalidArgument, "cuda");
  expect(call([] { parse_rope_variant("fast"); }), Status::kInvalidArgument, "variant");
  expect(call([] { parse_rope_layout("rotate"); }), Status::kInvalidArgument, "layout");
  EXPECT_EQ(parse_rope_variant("cuda"), RopeVariant::kCuda);
  EXPECT_EQ(rope_variant_name(RopeVariant::kCpu), "cpu");
  EXPECT_EQ(all_rope_variants().size(), 2u);
  // int8 q: unsupported dtype.
  expect(call([&] { rope_forward(as(f.q(), DType::kI32), {}, f.p(), f.o, as(f.q_out(), DType::kI32), {}); }),
         Status::kUnsupported, "q");
}

TEST(RopeErrors, CudaRefusesFp64) {
  SKIP_WITHOUT_CUDA();
  Buffer q(DType::kF64, 16, Device::cuda(0)), o(DType::kF64, 16, Device::cuda(0)), pos(DType::kI32, 1, Device::cuda(0));
  RopeOptions opt;
  opt.layout = RopeLayout::kNeox;
  const Caught c = call([&] {
    rope_forward(raw(q.data(), DType::kF64, Device::cuda(0), {1, 1, 1, 16}, {16, 16, 16, 1}), {},
                 raw(pos.data(), DType::kI32, Device::cuda(0), {1}, {1}), opt,
                 raw(o.data(), DType::kF64, Device::cuda(0), {1, 1, 1, 16}, {16, 16, 16, 1}), {});
  });
  EXPECT_ERROR(c, Status::kUnsupported);
  EXPECT_MENTIONS(c, "cpu");
}

}  // namespace
}  // namespace optimized::testing
