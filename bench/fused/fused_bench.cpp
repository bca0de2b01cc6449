// The fused plug-in (see fused_bench.h). Bench code only: every kernel runs through the public API
// of optimized/fused.h; the driver (harness/driver.h) validates, times and reports the rows.
//
// One group = (op, direction, dtype, shape, backend). What the family provides per group:
//   1. operands: input set 0 is generated on the host (uniform [-1, 1], fixed seeds; the saved
//      statistics of a norm backward are computed in double from its h), uploaded, and copied
//      device to device into the other rotating sets (other addresses, same values: the cache
//      cannot tell); every set has its own outputs;
//   2. the expected outputs, once: the float64 and same-dtype references of optimized_ops_testing
//      over row chunks in parallel (every row when the group is small, else the first, the last
//      and evenly spaced rows; the parameter gradients always over every row);
//   3. the check: set 0's outputs (poisoned before the run) read back and held to the fused rule
//      (src/testing/fused_check.h: per row, 2 x the same-dtype reference's error + rounding noise;
//      the same rule as the C++ tests and pytest);
//   4. the unfused variant as the baseline of the CUDA rows (its row, or timed on its own), and a
//      cudaMemcpyAsync of the row's min_bytes timed the same way (the same-size copy).
#include "fused/fused_bench.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>

#include "fused/fused_params.h"
#include "harness/ceilings.h"
#include "harness/data.h"
#include "harness/family.h"
#include "harness/gpu_timer.h"
#include "optimized/buffer.h"
#include "testing/fused_check.h"

namespace bench {

using optimized::Buffer;
using optimized::Device;
using optimized::DType;
using optimized::FusedOp;
using optimized::FusedParams;
using optimized::FusedVariant;
using optimized::TensorView;

// ---- shapes and names -----------------------------------------------------------------------

std::string FusedShape::label() const {
  std::string s = std::to_string(rows) + "x" + std::to_string(width);
  if (ld > 0 && ld != width) s += ":" + std::to_string(ld);
  return s;
}

FusedShape parse_fused_shape(const std::string& text) {
  const size_t x = text.find_first_of("xX"), colon = text.find(':');
  const std::vector<int64_t> parts = parse_sizes(text, "xX:");
  const bool colon_after_x = colon == std::string::npos || (x != std::string::npos && colon > x);
  FusedShape s;
  if (colon_after_x && parts.size() == (colon == std::string::npos ? 2u : 3u)) {
    s.rows = parts[0];
    s.width = parts[1];
    s.ld = parts.size() == 3 && parts[2] != s.width ? parts[2] : 0;
    if (parts.size() < 3 || parts[2] >= s.width) return s;
  }
  throw std::invalid_argument("--shapes: expected ROWSxWIDTH or ROWSxWIDTH:LD (LD >= WIDTH) with positive integers; "
                              "given '" + text + "'");
}

std::string_view fused_direction_name(FusedDirection d) { return d == FusedDirection::kForward ? "fwd" : "bwd"; }

FusedDirection parse_fused_direction(std::string_view name) {
  if (name == "fwd" || name == "forward") return FusedDirection::kForward;
  if (name == "bwd" || name == "backward") return FusedDirection::kBackward;
  throw std::invalid_argument("--directions: expected fwd or bwd; given '" + std::string(name) + "'");
}

// ---- the byte model -------------------------------------------------------------------------

namespace {

// min_bytes = rows_units * R*W*E + vector_units * W*E + stats_units * 4*R.
struct ByteModel {
  int rows_units = 0;
  int vector_units = 0;
  int stats_units = 0;
  const char* what = "";
};

ByteModel byte_model(FusedOp op, FusedDirection d) {
  const bool fwd = d == FusedDirection::kForward;
  switch (op) {
    case FusedOp::kSoftmax:
    case FusedOp::kLogSoftmax:
      return fwd ? ByteModel{2, 0, 0, "read x; write y"} : ByteModel{3, 0, 0, "read y, dy; write dx"};
    case FusedOp::kLayerNorm:
      return fwd ? ByteModel{2, 2, 2, "read x, weight, bias; write y, mean, rstd"}
                 : ByteModel{3, 3, 2, "read dy, h, weight, mean, rstd; write dx, dweight, dbias"};
    case FusedOp::kRmsNorm:
      return fwd ? ByteModel{2, 1, 1, "read x, weight; write y, rstd"}
                 : ByteModel{3, 2, 1, "read dy, h, weight, rstd; write dx, dweight"};
    case FusedOp::kAddLayerNorm:
      return fwd ? ByteModel{4, 2, 2, "read x, residual, weight, bias; write y, residual_out, mean, rstd"}
                 : ByteModel{4, 3, 2, "read dy, h, dresidual_out, weight, mean, rstd; write dx, dweight, dbias"};
    case FusedOp::kAddRmsNorm:
      return fwd ? ByteModel{4, 1, 1, "read x, residual, weight; write y, residual_out, rstd"}
                 : ByteModel{4, 2, 1, "read dy, h, dresidual_out, weight, rstd; write dx, dweight"};
    case FusedOp::kBiasGelu:
      return fwd ? ByteModel{2, 1, 0, "read x, bias; write y"} : ByteModel{3, 2, 0, "read dy, x, bias; write dx, dbias"};
    case FusedOp::kSiluAndMul:
      return fwd ? ByteModel{3, 0, 0, "read x (R x 2d); write y (R x d)"}
                 : ByteModel{5, 0, 0, "read dy (R x d), x (R x 2d); write dx (R x 2d)"};
  }
  return {};
}

}  // namespace

double fused_min_bytes(FusedOp op, FusedDirection d, DType dtype, int64_t rows, int64_t width) {
  const ByteModel m = byte_model(op, d);
  const double e = static_cast<double>(optimized::dtype_size(dtype));
  const double r = static_cast<double>(rows), w = static_cast<double>(width);
  return m.rows_units * r * w * e + m.vector_units * w * e + m.stats_units * 4.0 * r;
}

std::string fused_bytes_formula(FusedOp op, FusedDirection d) {
  const ByteModel m = byte_model(op, d);
  const char* w = op == FusedOp::kSiluAndMul ? "d" : "W";
  std::string s = std::to_string(m.rows_units) + "*R*" + w + "*E";
  if (m.vector_units) s += " + " + (m.vector_units > 1 ? std::to_string(m.vector_units) + "*" : std::string()) + "W*E";
  if (m.stats_units) s += " + " + std::to_string(4 * m.stats_units) + "*R";
  return s + " (" + m.what + ")";
}

// ---- configs --------------------------------------------------------------------------------

namespace {

std::vector<FusedShape> shapes_of(std::initializer_list<const char*> texts) {
  std::vector<FusedShape> out;
  for (const char* t : texts) out.push_back(parse_fused_shape(t));
  return out;
}

FusedBenchConfig base_config() {
  FusedBenchConfig c;
  for (FusedOp op : optimized::all_fused_ops()) c.ops.push_back(op);
  c.directions = {FusedDirection::kForward, FusedDirection::kBackward};
  return c;
}

}  // namespace

std::vector<FusedBenchConfig> default_fused_configs(bool quick, bool gpu) {
  std::vector<FusedBenchConfig> out;
  const std::vector<FusedVariant> cuda_variants = {FusedVariant::kCudaUnfused, FusedVariant::kCudaFusedStreaming,
                                                   FusedVariant::kCudaFusedRegisters, FusedVariant::kAuto};
  if (gpu) {
    FusedBenchConfig bf16 = base_config();
    bf16.dtypes = {DType::kBF16};
    bf16.variants = cuda_variants;
    if (quick) {
      bf16.shapes = shapes_of({"4096x4096", "16384x8192", "4097x4099", "1x262144"});
    } else {
      for (int64_t rows : {4096, 16384})
        for (int64_t width : {1024, 2048, 4096, 8192, 16384, 32768}) bf16.shapes.push_back({rows, width, 0});
      for (const FusedShape& s : shapes_of({"4097x4099", "1x262144", "65536x128", "8x131072", "4096x8000:8192"}))
        bf16.shapes.push_back(s);
    }
    out.push_back(bf16);
    FusedBenchConfig other = base_config();
    other.dtypes = {DType::kF16, DType::kF32};
    other.variants = cuda_variants;
    other.shapes = quick ? shapes_of({"16384x8192"}) : shapes_of({"4096x4096", "16384x8192", "4097x4099"});
    out.push_back(other);
  }
  FusedBenchConfig cpu = base_config();
  cpu.dtypes = {DType::kF32, DType::kBF16};
  cpu.variants = {FusedVariant::kCpu};
  cpu.shapes = quick ? shapes_of({"1024x1024"}) : shapes_of({"1024x1024", "2048x4096"});
  out.push_back(cpu);
  return out;
}

std::vector<std::string> fused_notes(const std::vector<FusedBenchConfig>& configs) {
  std::vector<std::string> notes = {
      "fused rows: GB/s = min_bytes / median time, min_bytes the fewest bytes the op must move (each input "
      "read once, each output written once; R rows, W width (silu_and_mul: d, the output width), E bytes per "
      "element, statistics fp32); roofline = the fraction of the device_copy bandwidth measured in this run; "
      "'same-size copy' = the time of a cudaMemcpyAsync moving min_bytes (half read, half written), timed the "
      "same way, over ours (what launch and ramp-up cost at small sizes); vs baseline = unfused time / ours",
      "fused forward rows write the statistics the backward needs (a training forward); backward rows take "
      "dweight / dbias and, for the add forms, dresidual_out; backward inputs are random (softmax's y need not "
      "be a softmax output: the work and the bytes do not depend on it), the norms' mean / rstd computed from h"};
  std::vector<std::pair<FusedOp, FusedDirection>> seen;
  for (const auto& c : configs)
    for (FusedOp op : c.ops)
      for (FusedDirection d : c.directions)
        if (std::find(seen.begin(), seen.end(), std::pair{op, d}) == seen.end()) seen.push_back({op, d});
  for (const auto& [op, d] : seen)
    notes.push_back("min_bytes " + std::string(optimized::fused_op_name(op)) + " " +
                    std::string(fused_direction_name(d)) + " = " + fused_bytes_formula(op, d));
  return notes;
}

std::vector<FusedBenchConfig> fused_configs(const FusedFilters& f, bool quick, bool gpu) {
  std::vector<optimized::FusedOp> ops;
  for (const auto& name : split_commas(f.ops)) {
    if (name == "all") {
      for (auto op : optimized::all_fused_ops())
        if (std::find(ops.begin(), ops.end(), op) == ops.end()) ops.push_back(op);
    } else {
      const auto op = optimized::parse_fused_op(name);  // throws Error naming the choices
      if (std::find(ops.begin(), ops.end(), op) == ops.end()) ops.push_back(op);
    }
  }
  std::vector<FusedDirection> dirs;
  for (const auto& name : split_commas(f.directions)) {
    const auto d = parse_fused_direction(name);
    if (std::find(dirs.begin(), dirs.end(), d) == dirs.end()) dirs.push_back(d);
  }
  std::vector<DType> dtypes;
  for (const auto& name : split_commas(f.dtypes)) {
    const DType d = optimized::parse_dtype(name);
    if (d != DType::kF32 && d != DType::kF16 && d != DType::kBF16)
      throw std::invalid_argument("--dtypes: fused ops take fp32, fp16 or bf16; given '" + name + "'");
    if (std::find(dtypes.begin(), dtypes.end(), d) == dtypes.end()) dtypes.push_back(d);
  }
  std::vector<FusedShape> shapes;
  for (const auto& text : split_commas(f.shapes)) shapes.push_back(parse_fused_shape(text));
  std::vector<FusedVariant> variants;
  auto add = [&](FusedVariant v) {
    if (std::find(variants.begin(), variants.end(), v) == variants.end()) variants.push_back(v);
  };
  const std::vector<std::string> variant_names = split_commas(f.variants);
  const bool auto_named = std::find(variant_names.begin(), variant_names.end(), "auto") != variant_names.end();
  for (const auto& name : variant_names) {
    if (name == "all" || name == "cuda" || name == "cpu") {
      for (FusedVariant v : optimized::all_fused_variants())
        if (name == "all" || optimized::fused_variant_is_cuda(v) == (name == "cuda")) add(v);
      if (name != "cpu") add(FusedVariant::kAuto);
    } else {
      add(optimized::parse_fused_variant(name));  // throws Error naming the choices
    }
  }
  const bool explicit_cuda = std::any_of(variants.begin(), variants.end(), [](FusedVariant v) {
    return optimized::fused_variant_is_cuda(v);
  });
  // Without a GPU the CUDA configs are left out (a note says so), unless CUDA variants were named:
  // then their rows are listed as skipped.
  const bool want_cuda_configs = gpu || (explicit_cuda && variant_names != std::vector<std::string>{"all"});
  // The standard configs (GPU ones, then the CPU one). --shapes replaces the GPU configs by one
  // (the given shapes at the given dtypes, bf16 by default) and gives the CPU config the small ones;
  // --dtypes alone keeps each GPU config's dtypes among those given and sets the CPU config's.
  std::vector<FusedBenchConfig> gpu_cfgs, out;
  std::optional<FusedBenchConfig> cpu_cfg;
  for (FusedBenchConfig c : default_fused_configs(quick, true)) {
    if (c.variants == std::vector<FusedVariant>{FusedVariant::kCpu}) cpu_cfg = c;
    else gpu_cfgs.push_back(c);
  }
  if (!shapes.empty()) {
    gpu_cfgs.resize(1);
    gpu_cfgs[0].shapes = shapes;
    gpu_cfgs[0].dtypes = dtypes.empty() ? std::vector<DType>{DType::kBF16} : dtypes;
    cpu_cfg->shapes.clear();
    for (const auto& s : shapes)  // the CPU rows only take the small ones
      if (s.rows * s.width <= cpu_cfg->cpu_max_elements) cpu_cfg->shapes.push_back(s);
  }
  if (!dtypes.empty()) {
    for (auto& c : gpu_cfgs) {
      std::vector<DType> keep;
      for (DType d : dtypes)
        if (!shapes.empty() || std::find(c.dtypes.begin(), c.dtypes.end(), d) != c.dtypes.end()) keep.push_back(d);
      c.dtypes = keep;
    }
    cpu_cfg->dtypes = dtypes;
  }
  std::vector<FusedBenchConfig> all = want_cuda_configs ? gpu_cfgs : std::vector<FusedBenchConfig>{};
  all.push_back(*cpu_cfg);
  for (FusedBenchConfig c : all) {
    const bool cpu_config = c.variants == std::vector<FusedVariant>{FusedVariant::kCpu};
    c.ops = ops;
    c.directions = dirs;
    std::vector<FusedVariant> vs;
    for (FusedVariant v : variants) {
      if (v == FusedVariant::kAuto && !gpu && !auto_named) continue;  // "all" without a GPU: cpu says it
      const bool v_cpu = v == FusedVariant::kCpu || (v == FusedVariant::kAuto && !gpu);
      if (v_cpu == cpu_config) vs.push_back(v);
    }
    c.variants = vs;
    if (!c.dtypes.empty() && !c.shapes.empty() && !c.variants.empty() && !c.ops.empty() && !c.directions.empty())
      out.push_back(c);
  }
  return out;
}

// ---- operands -------------------------------------------------------------------------------

namespace {

// Every operand any op touches; a group uses some of them. kX holds h for a norm backward (the
// forward's input, or residual_out of an add form); kY is softmax backward's INPUT (the forward
// output).
enum Slot : int {
  kX, kResidual, kWeight, kBias, kY, kResidualOut, kMean, kRstd, kDy, kDresidualOut, kDx, kDweight, kDbias,
  kSlotCount
};
constexpr std::array<const char*, kSlotCount> kSlotNames = {
    "x", "residual", "weight", "bias", "y", "residual_out", "mean", "rstd", "dy", "dresidual_out", "dx",
    "dweight", "dbias"};

enum class Kind : uint8_t { kRows, kVector, kStats };  // (R, W[*2]) with a row stride | (W) | fp32 (R)

struct SlotUse {
  Slot slot;
  Kind kind;
  bool output;
  int factor = 1;  // silu_and_mul's x and dx hold 2 * d per row
};

std::vector<SlotUse> slot_uses(FusedOp op, FusedDirection d) {
  const bool add = op == FusedOp::kAddLayerNorm || op == FusedOp::kAddRmsNorm;
  const bool layer = op == FusedOp::kLayerNorm || op == FusedOp::kAddLayerNorm;
  std::vector<SlotUse> u;
  if (d == FusedDirection::kForward) {
    switch (op) {
      case FusedOp::kSoftmax:
      case FusedOp::kLogSoftmax: u = {{kX, Kind::kRows, false}, {kY, Kind::kRows, true}}; break;
      case FusedOp::kLayerNorm:
      case FusedOp::kRmsNorm:
      case FusedOp::kAddLayerNorm:
      case FusedOp::kAddRmsNorm:
        u.push_back({kX, Kind::kRows, false});
        if (add) u.push_back({kResidual, Kind::kRows, false});
        u.push_back({kWeight, Kind::kVector, false});
        if (layer) u.push_back({kBias, Kind::kVector, false});
        u.push_back({kY, Kind::kRows, true});
        if (add) u.push_back({kResidualOut, Kind::kRows, true});
        if (layer) u.push_back({kMean, Kind::kStats, true});
        u.push_back({kRstd, Kind::kStats, true});
        break;
      case FusedOp::kBiasGelu:
        u = {{kX, Kind::kRows, false}, {kBias, Kind::kVector, false}, {kY, Kind::kRows, true}};
        break;
      case FusedOp::kSiluAndMul: u = {{kX, Kind::kRows, false, 2}, {kY, Kind::kRows, true}}; break;
    }
  } else {
    switch (op) {
      case FusedOp::kSoftmax:
      case FusedOp::kLogSoftmax:
        u = {{kY, Kind::kRows, false}, {kDy, Kind::kRows, false}, {kDx, Kind::kRows, true}};
        break;
      case FusedOp::kLayerNorm:
      case FusedOp::kRmsNorm:
      case FusedOp::kAddLayerNorm:
      case FusedOp::kAddRmsNorm:
        u.push_back({kDy, Kind::kRows, false});
        u.push_back({kX, Kind::kRows, false});
        u.push_back({kWeight, Kind::kVector, false});
        if (layer) u.push_back({kMean, Kind::kStats, false});
        u.push_back({kRstd, Kind::kStats, false});
        if (add) u.push_back({kDresidualOut, Kind::kRows, false});
        u.push_back({kDx, Kind::kRows, true});
        u.push_back({kDweight, Kind::kVector, true});
        if (layer) u.push_back({kDbias, Kind::kVector, true});
        break;
      case FusedOp::kBiasGelu:
        u = {{kDy, Kind::kRows, false}, {kX, Kind::kRows, false}, {kBias, Kind::kVector, false},
             {kDx, Kind::kRows, true}, {kDbias, Kind::kVector, true}};
        break;
      case FusedOp::kSiluAndMul:
        u = {{kDy, Kind::kRows, false}, {kX, Kind::kRows, false, 2}, {kDx, Kind::kRows, true, 2}};
        break;
    }
  }
  return u;
}

bool has_row_reduction(FusedOp op) { return op != FusedOp::kBiasGelu && op != FusedOp::kSiluAndMul; }
bool is_norm(FusedOp op) { return op != FusedOp::kSoftmax && op != FusedOp::kLogSoftmax && has_row_reduction(op); }

// The geometry of one group's operands.
struct Layout {
  FusedOp op;
  FusedDirection dir;
  DType dtype;
  FusedShape shape;
  std::vector<SlotUse> uses;

  const SlotUse* use(Slot s) const {
    for (const auto& u : uses)
      if (u.slot == s) return &u;
    return nullptr;
  }
  DType dtype_of(const SlotUse& u) const { return u.kind == Kind::kStats ? DType::kF32 : dtype; }
  int64_t cols(const SlotUse& u) const { return u.kind == Kind::kRows ? shape.width * u.factor : u.kind == Kind::kVector ? shape.width : 1; }
  int64_t ld(const SlotUse& u) const { return u.kind == Kind::kRows ? shape.stride() * u.factor : cols(u); }
  int64_t count(const SlotUse& u) const {
    if (u.kind == Kind::kVector) return shape.width;
    if (u.kind == Kind::kStats) return shape.rows;
    return (shape.rows - 1) * ld(u) + cols(u);  // the last row is not padded
  }
  int64_t bytes(const SlotUse& u) const { return count(u) * static_cast<int64_t>(optimized::dtype_size(dtype_of(u))); }
  int64_t set_bytes() const {
    int64_t b = 0;
    for (const auto& u : uses) b += bytes(u);
    return b;
  }
  bool backward() const { return dir == FusedDirection::kBackward; }
};

// One rotating set: a buffer per used slot.
struct OperandSet {
  std::array<Buffer, kSlotCount> buf;
};

TensorView view_of(const Layout& L, const OperandSet& s, Slot slot) {
  const SlotUse* u = L.use(slot);
  if (!u) return TensorView{};
  const Buffer& b = s.buf[slot];
  if (u->kind == Kind::kRows)
    return TensorView::matrix(b.data(), L.dtype_of(*u), b.device(), L.shape.rows, L.cols(*u), L.ld(*u));
  return TensorView(b.data(), L.dtype_of(*u), b.device(), {L.count(*u)});
}

// The call of the public API for this group on set `s`.
void call_op(const Layout& L, const OperandSet& s, FusedVariant v, const optimized::ExecutionContext& ctx,
             const FusedBenchConfig& cfg) {
  auto V = [&](Slot slot) { return view_of(L, s, slot); };
  const bool log = L.op == FusedOp::kLogSoftmax;
  const bool layer = L.op == FusedOp::kLayerNorm || L.op == FusedOp::kAddLayerNorm;
  if (!L.backward()) {
    switch (L.op) {
      case FusedOp::kSoftmax:
      case FusedOp::kLogSoftmax: optimized::softmax_forward(V(kX), V(kY), cfg.softmax_scale, log, v, ctx); return;
      case FusedOp::kLayerNorm:
      case FusedOp::kAddLayerNorm:
        optimized::layer_norm_forward(V(kX), V(kResidual), V(kWeight), V(kBias), cfg.eps, V(kY), V(kResidualOut),
                                      V(kMean), V(kRstd), v, ctx);
        return;
      case FusedOp::kRmsNorm:
      case FusedOp::kAddRmsNorm:
        optimized::rms_norm_forward(V(kX), V(kResidual), V(kWeight), cfg.eps, V(kY), V(kResidualOut), V(kRstd), v, ctx);
        return;
      case FusedOp::kBiasGelu: optimized::bias_gelu_forward(V(kX), V(kBias), cfg.gelu, V(kY), v, ctx); return;
      case FusedOp::kSiluAndMul: optimized::silu_and_mul_forward(V(kX), V(kY), v, ctx); return;
    }
  } else {
    switch (L.op) {
      case FusedOp::kSoftmax:
      case FusedOp::kLogSoftmax:
        optimized::softmax_backward(V(kY), V(kDy), V(kDx), cfg.softmax_scale, log, v, ctx);
        return;
      case FusedOp::kLayerNorm:
      case FusedOp::kAddLayerNorm:
      case FusedOp::kRmsNorm:
      case FusedOp::kAddRmsNorm:
        if (layer)
          optimized::layer_norm_backward(V(kDy), V(kX), V(kWeight), V(kMean), V(kRstd), V(kDresidualOut), V(kDx),
                                         V(kDweight), V(kDbias), v, ctx);
        else
          optimized::rms_norm_backward(V(kDy), V(kX), V(kWeight), V(kRstd), V(kDresidualOut), V(kDx), V(kDweight),
                                       v, ctx);
        return;
      case FusedOp::kBiasGelu:
        optimized::bias_gelu_backward(V(kDy), V(kX), V(kBias), cfg.gelu, V(kDx), V(kDbias), v, ctx);
        return;
      case FusedOp::kSiluAndMul: optimized::silu_and_mul_backward(V(kDy), V(kX), V(kDx), v, ctx); return;
    }
  }
}

// ---- inputs of set 0 on the host ------------------------------------------------------------

struct HostInputs {
  std::array<std::vector<uint8_t>, kSlotCount> data;
};

constexpr uint64_t kSeedBase = 0xF05ED;

// Random inputs; the saved statistics of a norm backward from h (slot kX) in double, as fp32.
HostInputs make_host_inputs(const Layout& L, float eps) {
  HostInputs h;
  for (const auto& u : L.uses) {
    if (u.output || u.kind == Kind::kStats) continue;
    h.data[u.slot] = random_host(L.dtype_of(u), L.count(u), kSeedBase + 97 * static_cast<uint64_t>(u.slot));
  }
  if (L.backward() && is_norm(L.op)) {
    const bool layer = L.op == FusedOp::kLayerNorm || L.op == FusedOp::kAddLayerNorm;
    const SlotUse& xu = *L.use(kX);
    const int64_t rows = L.shape.rows, n = L.shape.width, ld = L.ld(xu);
    std::vector<float> mean(static_cast<size_t>(rows)), rstd(static_cast<size_t>(rows));
    const void* x = h.data[kX].data();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      double s = 0, ss = 0;
      for (int64_t j = 0; j < n; ++j) s += optimized::load_as_double(x, L.dtype, r * ld + j);
      const double m = layer ? s / static_cast<double>(n) : 0.0;
      for (int64_t j = 0; j < n; ++j) {
        const double c = optimized::load_as_double(x, L.dtype, r * ld + j) - m;
        ss += c * c;
      }
      mean[static_cast<size_t>(r)] = static_cast<float>(m);
      rstd[static_cast<size_t>(r)] = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps));
    }
    auto bytes_of = [](const std::vector<float>& v) {
      std::vector<uint8_t> b(v.size() * sizeof(float));
      std::memcpy(b.data(), v.data(), b.size());
      return b;
    };
    if (layer) h.data[kMean] = bytes_of(mean);
    h.data[kRstd] = bytes_of(rstd);
  }
  return h;
}

// The reference's params for rows [r0, r0 + n) of the host inputs.
FusedParams host_params(const Layout& L, const HostInputs& h, int64_t r0, int64_t n, const FusedBenchConfig& cfg) {
  FusedParams p;
  p.op = L.op;
  p.backward = L.backward();
  p.dtype = L.dtype;
  p.rows = n;
  p.width = L.shape.width;
  p.eps = cfg.eps;
  p.scale = cfg.softmax_scale;
  p.gelu = cfg.gelu;
  const size_t es = optimized::dtype_size(L.dtype);
  auto rows_at = [&](Slot s, int64_t* ld) -> const void* {
    const SlotUse* u = L.use(s);
    if (!u) return nullptr;
    *ld = L.ld(*u);
    return h.data[s].data() + static_cast<size_t>(r0 * L.ld(*u)) * es;
  };
  auto vec = [&](Slot s) -> const void* { return L.use(s) ? h.data[s].data() : nullptr; };
  int64_t ld = 0;
  // softmax backward reads the forward output from p.x
  const Slot xs = (L.backward() && !is_norm(L.op) && has_row_reduction(L.op)) ? kY : kX;
  p.x = rows_at(xs, &ld);
  p.ld_x = ld;
  if (L.use(kResidual)) p.residual = rows_at(kResidual, &p.ld_residual);
  p.weight = vec(kWeight);
  p.bias = vec(kBias);
  if (L.use(kDy)) p.dy = rows_at(kDy, &p.ld_dy);
  if (L.use(kDresidualOut)) p.dresidual_out = rows_at(kDresidualOut, &p.ld_dresidual_out);
  // Saved statistics: the same-dtype reference reads them, as the library does (the float64 one
  // recomputes them).
  auto stats = [&](Slot s) -> float* {
    if (!L.use(s) || L.use(s)->output) return nullptr;
    return reinterpret_cast<float*>(const_cast<uint8_t*>(h.data[s].data())) + r0;
  };
  p.mean = stats(kMean);
  p.rstd = stats(kRstd);
  return p;
}


// ---- the expected outputs of the checked rows ------------------------------------------------

// The rows the validation checks, with the references (float64 and same-dtype, optimized_ops_testing)
// of each run of contiguous checked rows, and the parameter gradients summed over every row.
struct Expected {
  struct Chunk {
    int64_t r0 = 0, rows = 0;
    optimized::testing::FusedExpected e;
  };
  std::vector<Chunk> chunks;               // the checked rows, ascending
  optimized::testing::FusedExpected total;  // dweight / dbias over every row (when the op has them)
  bool all_rows = false;
};

using optimized::testing::FusedOutput;

FusedOutput output_of(Slot s) {
  switch (s) {
    case kY: return FusedOutput::kY;
    case kResidualOut: return FusedOutput::kResidualOut;
    case kMean: return FusedOutput::kMean;
    case kRstd: return FusedOutput::kRstd;
    case kDx: return FusedOutput::kDx;
    case kDweight: return FusedOutput::kDweight;
    default: return FusedOutput::kDbias;
  }
}

Expected compute_expected(const Layout& L, const HostInputs& h, const FusedBenchConfig& cfg) {
  Expected e;
  const int64_t R = L.shape.rows;
  int64_t widest = L.shape.width;
  bool need_all = false;
  for (const auto& u : L.uses) {
    widest = std::max(widest, L.cols(u));
    if (u.output && u.kind == Kind::kVector) need_all = true;  // parameter gradients sum over every row
  }
  e.all_rows = R * widest <= cfg.full_check_elements || R <= std::max(cfg.check_rows, 2);
  // Runs of rows: every row in chunks when all are checked (or the gradients need them all), else
  // the first, the last and evenly spaced rows one by one.
  std::vector<std::pair<int64_t, int64_t>> all, sampled;
  const int64_t step = std::max<int64_t>(1, (int64_t{1} << 18) / widest);
  if (e.all_rows || need_all)
    for (int64_t r = 0; r < R; r += step) all.push_back({r, std::min(step, R - r)});
  if (!e.all_rows) {
    const int k = std::max(cfg.check_rows, 2);
    std::vector<int64_t> rows;
    for (int i = 0; i < k; ++i) rows.push_back(static_cast<int64_t>(std::llround(static_cast<double>(i) * (R - 1) / (k - 1))));
    rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
    for (int64_t r : rows) sampled.push_back({r, 1});
  }
  std::vector<std::pair<int64_t, int64_t>> runs = all;
  if (!e.all_rows) runs.insert(runs.end(), sampled.begin(), sampled.end());
  std::vector<Expected::Chunk> chunks(runs.size());
  std::mutex mu;
  std::string error;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t c = 0; c < static_cast<int64_t>(runs.size()); ++c) {
    try {
      const auto [r0, n] = runs[static_cast<size_t>(c)];
      Expected::Chunk chunk{r0, n, optimized::testing::fused_expected(host_params(L, h, r0, n, cfg))};
      const bool checked = e.all_rows || static_cast<size_t>(c) >= all.size();
      const bool gradient_pass = static_cast<size_t>(c) < all.size();
      std::lock_guard<std::mutex> lock(mu);
      if (gradient_pass && need_all) optimized::testing::add_parameter_gradients(e.total, chunk.e);
      if (checked) chunks[static_cast<size_t>(c)] = std::move(chunk);
    } catch (const std::exception& ex) {
      std::lock_guard<std::mutex> lock(mu);
      if (error.empty()) error = ex.what();
    }
  }
  if (!error.empty()) throw std::runtime_error("float64 reference: " + error);
  for (auto& c : chunks)
    if (c.rows > 0) e.chunks.push_back(std::move(c));
  return e;
}

// ---- checking the outputs ---------------------------------------------------------------------

// The outputs of set 0 against the expected ones, with the fused rule (optimized_ops_testing).
optimized::testing::CheckResult check_outputs(const Layout& L, const HostInputs& h, const FusedBenchConfig& cfg,
                                              const OperandSet& set0, const Expected& e) {
  optimized::testing::CheckResult result;
  std::vector<int64_t> rows;
  for (const auto& c : e.chunks)
    for (int64_t r = c.r0; r < c.r0 + c.rows; ++r) rows.push_back(r);
  for (const auto& u : L.uses) {
    if (!u.output) continue;
    const DType od = L.dtype_of(u);
    const size_t es = optimized::dtype_size(od);
    const FusedOutput out = output_of(u.slot);
    auto values = [&](const std::vector<uint8_t>& bytes, size_t first, size_t count) {
      std::vector<double> v(count);
      for (size_t k = 0; k < count; ++k) v[k] = optimized::load_as_double(bytes.data(), od, static_cast<int64_t>(first + k));
      return v;
    };
    if (u.kind == Kind::kVector) {
      const std::vector<double> got = values(read_all(set0.buf[u.slot]), 0, static_cast<size_t>(L.shape.width));
      result.merge(optimized::testing::check_fused_output(host_params(L, h, 0, L.shape.rows, cfg), e.total, out, got));
      continue;
    }
    const int64_t cols = u.kind == Kind::kRows ? L.cols(u) : 1;
    const std::vector<uint8_t> bytes = u.kind == Kind::kRows
                                           ? read_rows(set0.buf[u.slot], rows, e.all_rows, cols, L.ld(u), es)
                                           : read_all(set0.buf[u.slot]);
    size_t at = 0;  // checked row index (row outputs) / storage row (statistics)
    for (const auto& c : e.chunks) {
      const size_t first = u.kind == Kind::kRows ? at * static_cast<size_t>(cols) : static_cast<size_t>(c.r0);
      const std::vector<double> got = values(bytes, first, static_cast<size_t>(c.rows * cols));
      result.merge(optimized::testing::check_fused_output(host_params(L, h, c.r0, c.rows, cfg), c.e, out, got, c.r0));
      at += static_cast<size_t>(c.rows);
    }
  }
  return result;
}

// Operands of one group: nsets sets; set 0's inputs also on the host.
struct GroupData {
  std::vector<OperandSet> sets;
  HostInputs host;
};

GroupData make_group_data(const Layout& L, Device device, int nsets, float eps) {
  GroupData d;
  d.host = make_host_inputs(L, eps);
  d.sets.resize(static_cast<size_t>(nsets));
  for (int i = 0; i < nsets; ++i) {
    for (const auto& u : L.uses) {
      Buffer b(L.dtype_of(u), L.count(u), device);
      if (!u.output) {
        if (i == 0) {
          if (device.is_cuda()) b.copy_from_host(d.host.data[u.slot].data());
          else std::memcpy(b.data(), d.host.data[u.slot].data(), b.bytes());
        } else {
          const Buffer& src = d.sets[0].buf[u.slot];
#if OPTIMIZED_WITH_CUDA
          if (device.is_cuda())
            check_cuda(cudaMemcpy(b.data(), src.data(), b.bytes(), cudaMemcpyDeviceToDevice), "cudaMemcpy (input sets)");
          else
#endif
            std::memcpy(b.data(), src.data(), b.bytes());
        }
      } else {
        b.fill_bytes(0);  // timed runs write them; set 0's are poisoned before each validation
      }
      d.sets[static_cast<size_t>(i)].buf[u.slot] = std::move(b);
    }
  }
  return d;
}

void poison_outputs(const Layout& L, OperandSet& s) {
  for (const auto& u : L.uses)
    if (u.output) s.buf[u.slot].fill_bytes(0xFF);
}

// ---- groups ---------------------------------------------------------------------------------

std::string variant_name(FusedVariant v) { return std::string(optimized::fused_variant_name(v)); }
int resolve_threads(int t) { return t > 0 ? t : all_threads(); }

class FusedGroup : public BenchGroup {
 public:
  FusedGroup(const Layout& layout, bool on_cuda, int nthreads, const FusedBenchConfig& cfg)
      : L_(layout), cfg_(cfg) {
    family = "fused";
    cuda = on_cuda;
    threads = nthreads;
    label = std::string(optimized::fused_op_name(L_.op)) + " " + std::string(fused_direction_name(L_.dir)) + " " +
            std::string(optimized::dtype_name(L_.dtype)) + " " + L_.shape.label();
    if (!cuda) label += " cpu " + std::to_string(threads) + (threads == 1 ? " thread" : " threads");
  }

  void add_row(FusedVariant v, const std::string& skip) {
    Result r;
    r.op = std::string(optimized::fused_op_name(L_.op));
    r.family = "fused";
    r.direction = std::string(fused_direction_name(L_.dir));
    r.variant = variant_name(v);
    r.backend = cuda ? "cuda" : "cpu";
    r.dtype = std::string(optimized::dtype_name(L_.dtype));
    r.shape = {{"rows", L_.shape.rows}, {"width", L_.shape.width}};
    if (L_.shape.ld > 0) r.shape.push_back({"ld", L_.shape.ld});
    r.shape_label = L_.shape.label();
    if (!cuda) r.threads = threads;
    r.flops = 0;  // memory-bound: the roofline is the copy bandwidth alone
    r.min_bytes = fused_min_bytes(L_.op, L_.dir, L_.dtype, L_.shape.rows, L_.shape.width);
    r.bytes_formula = fused_bytes_formula(L_.op, L_.dir);
    if (!skip.empty()) r.status = "skipped", r.reason = skip;
    rows.push_back(r);
    variants_.push_back(v);
  }
  FusedVariant variant(size_t i) const { return variants_[i]; }

  int64_t set_bytes() const override { return L_.set_bytes(); }
  void allocate(int sets, const RunEnv& env) override {
    data_ = std::make_unique<GroupData>(make_group_data(L_, env.cuda ? Device::cuda() : Device::cpu(), sets, cfg_.eps));
  }
  void release() override { data_.reset(); }

  Candidate row_candidate(size_t i, const RunEnv& env) override {
    const FusedVariant v = variants_[i];
    Candidate c = checked(v, env);
    c.annotate = [this, v, env](Result& r) {
      if (v != FusedVariant::kAuto) return;
      const bool aligned = (L_.shape.stride() * static_cast<int64_t>(optimized::dtype_size(L_.dtype))) % 16 == 0;
      r.resolved_variant = variant_name(optimized::resolve_fused_variant(
          L_.op, L_.dtype, env.cuda ? Device::cuda() : Device::cpu(), L_.shape.width, L_.backward(), aligned));
    };
    return c;
  }
  Candidate baseline_candidate(const RunEnv& env) override { return checked(FusedVariant::kCudaUnfused, env); }

  void roofline(const std::vector<Ceiling>& ceilings, const std::optional<BaselineResult>&, std::optional<Rate>&,
                std::optional<Rate>& bandwidth) const override {
    if (const Ceiling* c = best_ceiling(ceilings, cuda ? "device_copy" : "host_copy"))
      bandwidth = Rate{c->name, c->value, c->unit};
  }

  // The same-size copy: a cudaMemcpyAsync moving the rows' min_bytes, timed like them.
  void after_rows(const RunEnv& env, const MeasureOptions& opt, Progress& progress,
                  std::vector<std::string>& notes) override {
    if (extra_tasks == 0) return;
    progress.step("fused " + label + " same-size copy");
#if OPTIMIZED_WITH_CUDA
    try {
      const Stats copy = measure_copy_of(rows.front().min_bytes, opt, static_cast<cudaStream_t>(env.stream));
      for (Result& r : rows)
        if (r.status == "ok") r.copy_same_size = copy;
    } catch (const std::exception& e) {
      notes.push_back("same-size copy at " + label + " failed: " + e.what());
    }
#else
    (void)env, (void)opt, (void)notes;
#endif
  }

 private:
  // Variant v on the group's operands, with set 0's outputs poisoned before and checked after.
  Candidate checked(FusedVariant v, const RunEnv& env) {
    Candidate c;
    const optimized::ExecutionContext ctx = env.context();
    c.run = [this, v, ctx](int it) {
      call_op(L_, data_->sets[static_cast<size_t>(it) % data_->sets.size()], v, ctx, cfg_);
    };
    c.prepare = [this] { poison_outputs(L_, data_->sets[0]); };
    c.check = [this] {
      if (!expected_) expected_ = compute_expected(L_, data_->host, cfg_);  // once per group
      return check_outputs(L_, data_->host, cfg_, data_->sets[0], *expected_);
    };
    return c;
  }

  Layout L_;
  FusedBenchConfig cfg_;
  std::vector<FusedVariant> variants_;
  std::unique_ptr<GroupData> data_;
  std::optional<Expected> expected_;
};

}  // namespace

Groups fused_groups(const FusedBenchConfig& cfg, bool gpu) {
  Groups groups;
  for (FusedOp op : cfg.ops)
    for (FusedDirection dir : cfg.directions)
      for (DType dtype : cfg.dtypes)
        for (const FusedShape& shape : cfg.shapes) {
          const Layout layout{op, dir, dtype, shape, slot_uses(op, dir)};
          auto g = std::make_unique<FusedGroup>(layout, true, 0, cfg);
          auto c = std::make_unique<FusedGroup>(layout, false, resolve_threads(cfg.threads), cfg);
          for (FusedVariant v : cfg.variants) {
            const bool on_cuda = v == FusedVariant::kAuto ? gpu : optimized::fused_variant_is_cuda(v);
            std::string skip;
            if (on_cuda) {
              if (!gpu) skip = "no CUDA GPU found (" + optimized::cuda_unavailable_reason() + ")";
              else if (v == FusedVariant::kCudaFusedRegisters && !has_row_reduction(op))
                skip = "elementwise op: fused_registers runs the same kernel as fused_streaming";
              g->add_row(v, skip);
            } else {
              if (shape.rows * shape.width > cfg.cpu_max_elements)
                skip = "too slow above " + std::to_string(cfg.cpu_max_elements) +
                       " elements on the CPU (--cpu-max-elements)";
              c->add_row(v, skip);
            }
          }
          if (!g->rows.empty()) {
            // The unfused variant is the baseline of the CUDA rows: its row, or timed on its own.
            for (size_t i = 0; i < g->rows.size(); ++i)
              if (g->variant(i) == FusedVariant::kCudaUnfused && g->rows[i].status == "ok")
                g->baseline = BaselinePlan{"unfused", static_cast<int>(i), false};
            if (!g->baseline && gpu && cfg.baseline) g->baseline = BaselinePlan{"unfused", -1, false};
            g->extra_tasks = gpu && cfg.copy_same_size ? 1 : 0;
            groups.push_back(std::move(g));
          }
          if (!c->rows.empty()) groups.push_back(std::move(c));
        }
  return groups;
}

// ---- the CLI: `optimized-bench fused` and the fused rows of `all` ---------------------------

namespace {

class FusedFamily : public Family {
 public:
  CLI::App* add_subcommand(CLI::App& app) override {
    CLI::App* sub = app.add_subcommand(
        "fused",
        "Benchmark the fused memory-bound ops (softmax, log_softmax, layer_norm, rms_norm, add_layer_norm,\n"
        "add_rms_norm, bias_gelu, silu_and_mul; fwd and bwd) in GB/s of their minimum bytes, vs the unfused\n"
        "variant, the measured device copy bandwidth and a same-size copy. Default: bf16 on rows {4096, 16384} x\n"
        "width {1024 ... 32768} and edge shapes, fp16/fp32 on a few shapes, the cpu variant at two small shapes");
    sub->add_option("--ops", filters_.ops, "all, or op names separated by commas")->delimiter(',')->capture_default_str();
    sub->add_option("--directions", filters_.directions, "fwd, bwd")->delimiter(',')->capture_default_str();
    sub->add_option("--dtypes", filters_.dtypes, "fp32, fp16, bf16 [default: each standard config's]")->delimiter(',');
    sub->add_option("--shapes", filters_.shapes,
                    "ROWSxWIDTH or ROWSxWIDTH:LD (row stride), separated by commas [default: the standard grid]; "
                    "silu_and_mul's WIDTH is d (x holds 2*d)")
        ->delimiter(',');
    sub->add_option("--variants", filters_.variants,
                    "all | cuda | cpu | names (unfused, fused_streaming, fused_registers, auto, cpu)")
        ->delimiter(',')
        ->capture_default_str();
    sub->add_flag("--quick", quick_, "A few shapes per dtype and short measurements (--min-time 0.05 --max-time 0.3)");
    sub->add_option("--threads", threads_, "CPU rows: thread count (0: all)")->capture_default_str();
    sub->add_option("--gelu", gelu_, "bias_gelu's form: none (erf) or tanh")->capture_default_str();
    sub->add_option("--check-rows", check_rows_,
                    "Rows validated per large group (first, last, evenly spaced); groups of <= 2^24 elements are checked whole")
        ->capture_default_str();
    sub->add_option("--cpu-max-elements", cpu_max_, "Run the cpu variant up to rows*width <= N [default: 2^24]");
    sub->add_flag("--no-baseline", no_baseline_, "Do not time the unfused variant next to the CUDA rows");
    sub->add_flag("--no-copy", no_copy_, "Do not time the same-size device copy next to each group");
    sub->add_flag("--no-ceilings", no_ceilings_, "Do not measure the copy bandwidth (no roofline column)");
    return sub;
  }

  void add_all_options(CLI::App& all) override {
    all.add_flag("--no-fused", all_no_fused_, "Leave out the fused ops");
    all.add_flag("--fused-quick", all_quick_, "The fused ops on a few shapes only (as `fused --quick`)");
  }

  SubcommandPlan plan(const Env& env, const CLI::App& sub, MeasureOptions& measure) override {
    if (quick_) {  // shorter measurements unless given
      if (sub.count("--min-time") == 0) measure.min_time_s = 0.05;
      if (sub.count("--max-time") == 0) measure.max_time_s = 0.3;
    }
    std::vector<FusedBenchConfig> cfgs = fused_configs(filters_, quick_, env.gpu);
    optimized::GeluApproximation gelu = optimized::GeluApproximation::kNone;
    if (gelu_ == "tanh") gelu = optimized::GeluApproximation::kTanh;
    else if (gelu_ != "none") throw std::invalid_argument("--gelu: expected none or tanh; given '" + gelu_ + "'");
    if (check_rows_ < 2) throw std::invalid_argument("--check-rows: expected >= 2");
    SubcommandPlan plan;
    bool has_gpu_rows = false, has_cpu_rows = false;
    for (auto& c : cfgs) {
      c.measure = measure;
      c.threads = threads_;
      c.gelu = gelu;
      c.check_rows = check_rows_;
      c.baseline = !no_baseline_;
      c.copy_same_size = !no_copy_;
      if (cpu_max_ > 0) c.cpu_max_elements = cpu_max_;
      for (auto v : c.variants)
        ((v == FusedVariant::kAuto ? env.gpu : optimized::fused_variant_is_cuda(v)) ? has_gpu_rows : has_cpu_rows) = true;
    }
    if (cfgs.empty()) throw std::invalid_argument("fused: the filters leave no row to run");
    if (!env.gpu)
      plan.notes.push_back("no CUDA GPU found (" + optimized::cuda_unavailable_reason() +
                           "): the CUDA rows are left out (or listed as skipped when named)");
    if (!no_ceilings_) {
      plan.ceilings.device_copy = has_gpu_rows && env.gpu;
      plan.ceilings.host_copy = has_cpu_rows;
    }
    plan.runs = runs_of(cfgs, env.gpu);
    return plan;
  }

  // The standard GPU configs when the GPU rows run, the CPU one with the CPU rows.
  std::vector<FamilyRun> plan_all(const AllOptions& all, const MeasureOptions& measure) override {
    if (all_no_fused_) return {};
    std::vector<FusedBenchConfig> cfgs;
    for (FusedBenchConfig c : default_fused_configs(all_quick_, all.run_gpu())) {
      const bool cpu_config = c.variants == std::vector<FusedVariant>{FusedVariant::kCpu};
      if (cpu_config && all.no_cpu) continue;
      c.measure = measure;
      cfgs.push_back(c);
    }
    return runs_of(cfgs, all.run_gpu());
  }

 private:
  // One run per config; the first carries the notes of them all (what GB/s, roofline and the
  // same-size copy mean, the byte formulas).
  static std::vector<FamilyRun> runs_of(const std::vector<FusedBenchConfig>& cfgs, bool gpu) {
    std::vector<FamilyRun> runs;
    for (const auto& c : cfgs) runs.push_back({fused_groups(c, gpu), c.measure, {}});
    if (!runs.empty()) runs.front().notes = fused_notes(cfgs);
    return runs;
  }

  FusedFilters filters_;
  bool quick_ = false, no_baseline_ = false, no_copy_ = false, no_ceilings_ = false;
  std::string gelu_ = "none";
  int threads_ = 0, check_rows_ = 64;
  int64_t cpu_max_ = 0;
  bool all_no_fused_ = false, all_quick_ = false;
};

}  // namespace

std::unique_ptr<Family> make_fused_family() { return std::make_unique<FusedFamily>(); }

}  // namespace bench
