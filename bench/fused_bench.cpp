// The fused memory-bound benchmark (see fused_bench.h). Bench code only: every kernel runs through
// the public API of optimized/fused.h, and the float64 reference of src/fused/fused_reference.h is
// the yardstick of the validation that precedes every timing.
//
// One group = (op, direction, dtype, shape, backend). Per group:
//   1. operands: input set 0 is generated on the host (uniform [-1, 1], fixed seeds; the saved
//      statistics of a norm backward are computed in double from its h), uploaded, and copied
//      device to device into the other rotating sets (other addresses, same values: the cache
//      cannot tell); every set has its own outputs; enough sets to cover 2x the L2;
//   2. the reference, once: fused_reference_f64 over row chunks in parallel (every row when the
//      group is small or has parameter gradients, else a sample of rows), kept for the rows checked;
//   3. per variant: outputs of set 0 poisoned (NaN), one run, outputs read back and checked, then
//      timed with measure_gpu / measure_cpu (cold L2, set i % n for sample i);
//   4. the unfused variant is the baseline of the CUDA rows (timed once, a row or not), and a
//      cudaMemcpyAsync of the row's min_bytes is timed the same way (the same-size copy).
//
// The check, per output element (ref: the float64 value; u_o: the unit roundoff of the output's
// dtype, fp32 for statistics; u_d: that of the data dtype):
//   |out - ref| <= 2 u_o |ref| + (h_round + 32 * 2^-24 * sqrt(n)) * scale + floor_o
// 2 u_o |ref|: the final rounding, with the factor the design's "2x torch's error" rule allows;
// 32 * 2^-24 * sqrt(n) * scale: fp32 arithmetic over a reduction of n terms (n = width for row
// reductions, rows for dweight / dbias, 1 for the elementwise ops), relative to the output's scale
// (the RMS of the reference row, or of the whole vector; the RMS of h for `mean`, whose value can
// cancel to ~0); h_round = 4 u_d for the add forms' forward, whose library rounds h = x + residual
// to the dtype before normalizing while the reference keeps it in double; floor_o: half the
// subnormal spacing of the output dtype. NaN must match NaN, an infinite reference exactly.
#include "fused_bench.h"

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

#include "data.h"
#include "fused/fused_params.h"
#include "testing/fused_reference.h"
#include "gpu_timer.h"
#include "optimized/buffer.h"

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
  auto fail = [&]() -> FusedShape {
    throw std::invalid_argument("--shapes: expected ROWSxWIDTH or ROWSxWIDTH:LD (LD >= WIDTH) with positive "
                                "integers; given '" + text + "'");
  };
  auto number = [&](const std::string& part) -> int64_t {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(part, &used);
    } catch (...) {
      used = 0;
    }
    if (part.empty() || used != part.size() || v < 1) fail();
    return v;
  };
  const size_t x = text.find_first_of("xX");
  if (x == std::string::npos) return fail();
  const size_t colon = text.find(':', x);
  FusedShape s;
  s.rows = number(text.substr(0, x));
  s.width = number(text.substr(x + 1, colon == std::string::npos ? std::string::npos : colon - x - 1));
  if (colon != std::string::npos) {
    s.ld = number(text.substr(colon + 1));
    if (s.ld < s.width) return fail();
    if (s.ld == s.width) s.ld = 0;
  }
  return s;
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

namespace {

std::vector<std::string> split_names(const std::vector<std::string>& items) {
  std::vector<std::string> out;
  for (const auto& item : items) {
    size_t pos = 0;
    while (pos <= item.size()) {
      const size_t next = std::min(item.find(',', pos), item.size());
      if (next > pos) out.push_back(item.substr(pos, next - pos));
      pos = next + 1;
    }
  }
  return out;
}

}  // namespace

std::vector<FusedBenchConfig> fused_configs(const FusedFilters& f, bool quick, bool gpu) {
  std::vector<optimized::FusedOp> ops;
  for (const auto& name : split_names(f.ops)) {
    if (name == "all") {
      for (auto op : optimized::all_fused_ops())
        if (std::find(ops.begin(), ops.end(), op) == ops.end()) ops.push_back(op);
    } else {
      const auto op = optimized::parse_fused_op(name);  // throws Error naming the choices
      if (std::find(ops.begin(), ops.end(), op) == ops.end()) ops.push_back(op);
    }
  }
  std::vector<FusedDirection> dirs;
  for (const auto& name : split_names(f.directions)) {
    const auto d = parse_fused_direction(name);
    if (std::find(dirs.begin(), dirs.end(), d) == dirs.end()) dirs.push_back(d);
  }
  std::vector<DType> dtypes;
  for (const auto& name : split_names(f.dtypes)) {
    const DType d = optimized::parse_dtype(name);
    if (d != DType::kF32 && d != DType::kF16 && d != DType::kBF16)
      throw std::invalid_argument("--dtypes: fused ops take fp32, fp16 or bf16; given '" + name + "'");
    if (std::find(dtypes.begin(), dtypes.end(), d) == dtypes.end()) dtypes.push_back(d);
  }
  std::vector<FusedShape> shapes;
  for (const auto& text : split_names(f.shapes)) shapes.push_back(parse_fused_shape(text));
  std::vector<FusedVariant> variants;
  auto add = [&](FusedVariant v) {
    if (std::find(variants.begin(), variants.end(), v) == variants.end()) variants.push_back(v);
  };
  const std::vector<std::string> variant_names = split_names(f.variants);
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
bool is_add_form(FusedOp op) { return op == FusedOp::kAddLayerNorm || op == FusedOp::kAddRmsNorm; }
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
  // Saved statistics (not read by the reference, which recomputes them; set for completeness).
  auto stats = [&](Slot s) -> float* {
    if (!L.use(s) || L.use(s)->output) return nullptr;
    return reinterpret_cast<float*>(const_cast<uint8_t*>(h.data[s].data())) + r0;
  };
  p.mean = stats(kMean);
  p.rstd = stats(kRstd);
  return p;
}

// ---- the reference on the checked rows ------------------------------------------------------

const std::vector<double>& ref_field(const optimized::testing::FusedReference& r, Slot s) {
  static const std::vector<double> empty;
  switch (s) {
    case kY: return r.y;
    case kResidualOut: return r.residual_out;
    case kMean: return r.mean;
    case kRstd: return r.rstd;
    case kDx: return r.dx;
    case kDweight: return r.dweight;
    case kDbias: return r.dbias;
    default: return empty;
  }
}

struct Expected {
  std::vector<int64_t> rows;  // the checked rows, ascending
  bool all_rows = false;
  // Per output slot: row / stats outputs (rows.size() x cols), vector outputs (W); and the scale
  // of the bound per checked row (one value for a vector output).
  std::array<std::vector<double>, kSlotCount> ref;
  std::array<std::vector<double>, kSlotCount> scale;
  double seconds = 0;
};

double rms(const double* v, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += v[i] * v[i];
  return n > 0 ? std::sqrt(s / static_cast<double>(n)) : 0.0;
}

Expected compute_expected(const Layout& L, const HostInputs& h, const FusedBenchConfig& cfg) {
  const auto t0 = std::chrono::steady_clock::now();
  Expected e;
  const int64_t R = L.shape.rows, W = L.shape.width;
  int64_t widest = W;
  bool need_all = false;
  for (const auto& u : L.uses) {
    widest = std::max(widest, L.cols(u));
    if (u.output && u.kind == Kind::kVector) need_all = true;  // parameter gradients sum over every row
  }
  e.all_rows = R * widest <= cfg.full_check_elements || R <= std::max(cfg.check_rows, 2);
  if (e.all_rows) {
    e.rows.resize(static_cast<size_t>(R));
    for (int64_t r = 0; r < R; ++r) e.rows[static_cast<size_t>(r)] = r;
  } else {
    const int k = std::max(cfg.check_rows, 2);
    for (int i = 0; i < k; ++i) e.rows.push_back(static_cast<int64_t>(std::llround(static_cast<double>(i) * (R - 1) / (k - 1))));
    e.rows.erase(std::unique(e.rows.begin(), e.rows.end()), e.rows.end());
  }
  std::vector<int64_t> pos(static_cast<size_t>(R), -1);  // row -> index in e.rows
  for (size_t i = 0; i < e.rows.size(); ++i) pos[static_cast<size_t>(e.rows[i])] = static_cast<int64_t>(i);

  const size_t nchecked = e.rows.size();
  for (const auto& u : L.uses) {
    if (!u.output) continue;
    if (u.kind == Kind::kVector) e.ref[u.slot].assign(static_cast<size_t>(W), 0.0);
    else e.ref[u.slot].assign(nchecked * static_cast<size_t>(L.cols(u)), 0.0);
  }
  // Chunks: contiguous row ranges over every row (need_all) or the checked rows one by one.
  std::vector<std::pair<int64_t, int64_t>> chunks;
  if (need_all || e.all_rows) {
    const int64_t step = std::max<int64_t>(1, (int64_t{1} << 18) / widest);
    for (int64_t r = 0; r < R; r += step) chunks.push_back({r, std::min(step, R - r)});
  } else {
    for (int64_t r : e.rows) chunks.push_back({r, 1});
  }
  std::mutex mu;
  std::string error;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t c = 0; c < static_cast<int64_t>(chunks.size()); ++c) {
    try {
      const auto [r0, n] = chunks[static_cast<size_t>(c)];
      const optimized::testing::FusedReference ref = optimized::testing::fused_reference_f64(host_params(L, h, r0, n, cfg));
      for (const auto& u : L.uses) {
        if (!u.output) continue;
        const std::vector<double>& f = ref_field(ref, u.slot);
        if (u.kind == Kind::kVector) {
          if (f.size() != static_cast<size_t>(W)) throw std::runtime_error(std::string("reference has no ") + kSlotNames[u.slot]);
          std::lock_guard<std::mutex> lock(mu);
          for (int64_t j = 0; j < W; ++j) e.ref[u.slot][static_cast<size_t>(j)] += f[static_cast<size_t>(j)];
          continue;
        }
        const int64_t cols = L.cols(u);
        if (f.size() != static_cast<size_t>(n * cols))
          throw std::runtime_error(std::string("reference has no ") + kSlotNames[u.slot]);
        for (int64_t i = 0; i < n; ++i) {
          const int64_t p = pos[static_cast<size_t>(r0 + i)];
          if (p < 0) continue;
          std::copy_n(f.begin() + i * cols, cols, e.ref[u.slot].begin() + p * cols);
        }
      }
    } catch (const std::exception& ex) {
      std::lock_guard<std::mutex> lock(mu);
      if (error.empty()) error = ex.what();
    }
  }
  if (!error.empty()) throw std::runtime_error("float64 reference: " + error);

  // Scales of the bound.
  const bool add = is_add_form(L.op);
  for (const auto& u : L.uses) {
    if (!u.output) continue;
    std::vector<double>& s = e.scale[u.slot];
    const std::vector<double>& ref = e.ref[u.slot];
    if (u.kind == Kind::kVector) {
      s = {rms(ref.data(), W)};
    } else if (u.slot == kRstd) {
      s.resize(nchecked);
      for (size_t i = 0; i < nchecked; ++i) s[i] = std::abs(ref[i]);
    } else if (u.slot == kMean) {  // the RMS of h, which the mean may cancel to ~0
      s.resize(nchecked);
      const SlotUse& xu = *L.use(kX);
      for (size_t i = 0; i < nchecked; ++i) {
        double acc = 0;
        const int64_t r = e.rows[i];
        for (int64_t j = 0; j < W; ++j) {
          double v = optimized::load_as_double(h.data[kX].data(), L.dtype, r * L.ld(xu) + j);
          if (add) v += optimized::load_as_double(h.data[kResidual].data(), L.dtype, r * L.ld(*L.use(kResidual)) + j);
          acc += v * v;
        }
        s[i] = std::sqrt(acc / static_cast<double>(W));
      }
    } else {
      const int64_t cols = L.cols(u);
      s.resize(nchecked);
      for (size_t i = 0; i < nchecked; ++i) s[i] = rms(ref.data() + i * cols, cols);
    }
  }
  e.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return e;
}

// ---- reading outputs back and checking them -------------------------------------------------

// The checked rows of a (rows, cols) output with row stride ld, packed (rows.size(), cols).
std::vector<uint8_t> read_rows(const Buffer& b, const std::vector<int64_t>& rows, bool all_rows, int64_t cols,
                               int64_t ld, size_t es) {
  std::vector<uint8_t> out(rows.size() * static_cast<size_t>(cols) * es);
  const size_t row_bytes = static_cast<size_t>(cols) * es, pitch = static_cast<size_t>(ld) * es;
  const auto* base = static_cast<const uint8_t*>(b.data());
  if (!b.device().is_cuda()) {
    for (size_t i = 0; i < rows.size(); ++i)
      std::memcpy(out.data() + i * row_bytes, base + static_cast<size_t>(rows[i]) * pitch, row_bytes);
    return out;
  }
#if OPTIMIZED_WITH_CUDA
  if (all_rows) {
    check_cuda(cudaMemcpy2D(out.data(), row_bytes, base, pitch, row_bytes, rows.size(), cudaMemcpyDeviceToHost),
               "cudaMemcpy2D (reading outputs back)");
  } else {
    for (size_t i = 0; i < rows.size(); ++i)
      check_cuda(cudaMemcpy(out.data() + i * row_bytes, base + static_cast<size_t>(rows[i]) * pitch, row_bytes,
                            cudaMemcpyDeviceToHost),
                 "cudaMemcpy (reading outputs back)");
  }
#else
  (void)all_rows;
  throw std::runtime_error("read_rows: device buffer in a build without CUDA");
#endif
  return out;
}

std::vector<uint8_t> read_all(const Buffer& b) {
  std::vector<uint8_t> out(b.bytes());
  b.copy_to_host(out.data());
  return out;
}

double unit_roundoff(DType d) {
  switch (d) {
    case DType::kF16: return std::ldexp(1.0, -11);
    case DType::kBF16: return std::ldexp(1.0, -8);
    case DType::kF64: return std::ldexp(1.0, -53);
    default: return std::ldexp(1.0, -24);
  }
}

double half_subnormal_step(DType d) {
  switch (d) {
    case DType::kF16: return std::ldexp(1.0, -25);
    case DType::kBF16: return std::ldexp(1.0, -134);
    case DType::kF64: return std::ldexp(1.0, -1075);
    default: return std::ldexp(1.0, -150);
  }
}

struct CheckOutcome {
  Validation validation;
  int64_t failures = 0;
  std::string first_failure;
};

CheckOutcome check_outputs(const Layout& L, const OperandSet& set0, const Expected& e) {
  CheckOutcome out;
  double max_rel = 0;
  const double u_d = unit_roundoff(L.dtype);
  const double h_round = (is_add_form(L.op) && !L.backward()) ? 4 * u_d : 0.0;
  for (const auto& u : L.uses) {
    if (!u.output) continue;
    const DType od = L.dtype_of(u);
    const size_t es = optimized::dtype_size(od);
    const double u_o = unit_roundoff(od), floor_o = half_subnormal_step(od);
    const int64_t n_red = u.kind == Kind::kVector ? L.shape.rows : has_row_reduction(L.op) ? L.shape.width : 1;
    const double acc = 32 * std::ldexp(1.0, -24) * std::sqrt(static_cast<double>(n_red));
    const std::vector<double>& ref = e.ref[u.slot];
    const std::vector<double>& scale = e.scale[u.slot];
    std::vector<uint8_t> got;
    int64_t cols = 1;
    if (u.kind == Kind::kRows) {
      cols = L.cols(u);
      got = read_rows(set0.buf[u.slot], e.rows, e.all_rows, cols, L.ld(u), es);
    } else if (u.kind == Kind::kStats) {
      const std::vector<uint8_t> all = read_all(set0.buf[u.slot]);
      got.resize(e.rows.size() * es);
      for (size_t i = 0; i < e.rows.size(); ++i)
        std::memcpy(got.data() + i * es, all.data() + static_cast<size_t>(e.rows[i]) * es, es);
    } else {
      got = read_all(set0.buf[u.slot]);
      cols = L.shape.width;
    }
    const int64_t nrows = u.kind == Kind::kVector ? 1 : static_cast<int64_t>(e.rows.size());
    double max_err = 0, max_ref = 0;
    for (int64_t i = 0; i < nrows; ++i) {
      const double s = scale[static_cast<size_t>(i)];
      for (int64_t j = 0; j < cols; ++j) {
        const size_t k = static_cast<size_t>(i * cols + j);
        const double r = ref[k];
        const double o = optimized::load_as_double(got.data(), od, static_cast<int64_t>(k));
        const double allowed = 2 * u_o * std::abs(r) + (h_round + acc) * s + floor_o;
        double ratio = 0;
        bool bad = false;
        if (std::isnan(r)) {
          bad = !std::isnan(o);
        } else if (std::isinf(r)) {
          bad = o != r;
        } else {
          const double err = std::abs(o - r);
          bad = !(err <= allowed);  // NaN output fails
          ratio = std::isnan(err) ? INFINITY : err / allowed;
          if (std::isfinite(err)) max_err = std::max(max_err, err);
          max_ref = std::max(max_ref, std::abs(r));
        }
        if (bad) ratio = std::max(ratio, std::isfinite(ratio) && ratio > 1 ? ratio : INFINITY);
        out.validation.worst_ratio = std::max(out.validation.worst_ratio, ratio);
        ++out.validation.checked;
        if (bad && out.failures++ == 0) {
          char buf[256];
          if (u.kind == Kind::kVector)
            std::snprintf(buf, sizeof buf, "%s[%lld] = %.6g, expected %.6g (allowed error %.3g)", kSlotNames[u.slot],
                          static_cast<long long>(j), o, r, allowed);
          else
            std::snprintf(buf, sizeof buf, "%s[%lld, %lld] = %.6g, expected %.6g (allowed error %.3g)",
                          kSlotNames[u.slot], static_cast<long long>(e.rows[static_cast<size_t>(i)]),
                          static_cast<long long>(j), o, r, allowed);
          out.first_failure = buf;
        }
      }
    }
    if (max_ref > 0) max_rel = std::max(max_rel, max_err / max_ref);
  }
  out.validation.max_rel_error = max_rel;
  out.validation.passed = out.failures == 0;
  return out;
}

std::string failure_reason(const CheckOutcome& c) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "validation: %lld of %lld checked elements over their bound (worst ratio %.3g)",
                static_cast<long long>(c.failures), static_cast<long long>(c.validation.checked),
                c.validation.worst_ratio);
  return std::string(buf) + "; first: " + c.first_failure;
}

// ---- the plan -------------------------------------------------------------------------------

struct PlannedRow {
  FusedVariant variant;
  std::string skip;
};

struct Group {
  Layout layout;
  bool cuda = false;
  int threads = 0;  // CPU groups
  std::vector<PlannedRow> rows;
  bool baseline_only = false;  // time unfused as the baseline without a row of its own
  bool copy = false;           // time the same-size copy

  int runnable() const {
    return static_cast<int>(std::count_if(rows.begin(), rows.end(), [](const PlannedRow& r) { return r.skip.empty(); }));
  }
  int tasks() const { return runnable() + (baseline_only ? 1 : 0) + (copy ? 1 : 0); }
};

int resolve_threads(int t) { return t > 0 ? t : static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

std::vector<Group> plan_groups(const FusedBenchConfig& cfg, bool gpu) {
  std::vector<Group> groups;
  for (FusedOp op : cfg.ops) {
    for (FusedDirection dir : cfg.directions) {
      for (DType dtype : cfg.dtypes) {
        for (const FusedShape& shape : cfg.shapes) {
          const Layout layout{op, dir, dtype, shape, slot_uses(op, dir)};
          Group g{layout, true, 0, {}, false, false};
          Group c{layout, false, resolve_threads(cfg.threads), {}, false, false};
          for (FusedVariant v : cfg.variants) {
            const bool on_cuda = v == FusedVariant::kAuto ? gpu : optimized::fused_variant_is_cuda(v);
            PlannedRow row{v, ""};
            if (on_cuda) {
              if (!gpu) row.skip = "no CUDA GPU found (" + optimized::cuda_unavailable_reason() + ")";
              else if (v == FusedVariant::kCudaFusedRegisters && !has_row_reduction(op))
                row.skip = "elementwise op: fused_registers runs the same kernel as fused_streaming";
              g.rows.push_back(row);
            } else {
              if (shape.rows * shape.width > cfg.cpu_max_elements)
                row.skip = "too slow above " + std::to_string(cfg.cpu_max_elements) +
                           " elements on the CPU (--cpu-max-elements)";
              c.rows.push_back(row);
            }
          }
          if (!g.rows.empty()) {
            const bool unfused_row = std::any_of(g.rows.begin(), g.rows.end(), [](const PlannedRow& r) {
              return r.variant == FusedVariant::kCudaUnfused && r.skip.empty();
            });
            g.baseline_only = gpu && cfg.baseline && !unfused_row && g.runnable() > 0;
            g.copy = gpu && cfg.copy_same_size && g.runnable() > 0;
            groups.push_back(std::move(g));
          }
          if (!c.rows.empty()) groups.push_back(std::move(c));
        }
      }
    }
  }
  return groups;
}

// ---- rows -----------------------------------------------------------------------------------

std::string variant_name(FusedVariant v) { return std::string(optimized::fused_variant_name(v)); }

std::string group_label(const Group& g) {
  const Layout& L = g.layout;
  std::string s = std::string(optimized::fused_op_name(L.op)) + " " + std::string(fused_direction_name(L.dir)) +
                  " " + std::string(optimized::dtype_name(L.dtype)) + " " + L.shape.label();
  if (!g.cuda) s += " cpu " + std::to_string(g.threads) + (g.threads == 1 ? " thread" : " threads");
  return s;
}

Result base_row(const Group& g, FusedVariant v) {
  const Layout& L = g.layout;
  Result r;
  r.op = std::string(optimized::fused_op_name(L.op));
  r.family = "fused";
  r.direction = std::string(fused_direction_name(L.dir));
  r.variant = variant_name(v);
  r.backend = g.cuda ? "cuda" : "cpu";
  r.dtype = std::string(optimized::dtype_name(L.dtype));
  r.shape = {{"rows", L.shape.rows}, {"width", L.shape.width}};
  if (L.shape.ld > 0) r.shape.push_back({"ld", L.shape.ld});
  r.shape_label = L.shape.label();
  if (!g.cuda) r.threads = g.threads;
  r.flops = 0;  // memory-bound: the roofline is the copy bandwidth alone
  r.min_bytes = fused_min_bytes(L.op, L.dir, L.dtype, L.shape.rows, L.shape.width);
  r.bytes_formula = fused_bytes_formula(L.op, L.dir);
  return r;
}

// Exceptions from a row: kUnsupported from the library means "skipped", anything else "failed".
void record_exception(Result& r, const std::exception& e) {
  if (auto* oe = dynamic_cast<const optimized::Error*>(&e); oe && oe->status() == optimized::Status::kUnsupported)
    r.status = "skipped";
  else
    r.status = "failed";
  r.reason = e.what();
  r.time = Stats{};
}

// A validation run that took longer than the warm-up budget is warm-up enough.
MeasureOptions after_validation(MeasureOptions opt, double validation_s) {
  if (validation_s >= opt.warmup_s) opt.max_warmup = 0;
  return opt;
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

// Validate variant v on set 0 (poisoned outputs), then time it. Fills r.validation / r.time or
// the failure. `expected` is computed on first use.
template <typename Wait, typename Measure>
void validate_and_time(const FusedBenchConfig& cfg, const Group& g, GroupData& data, std::optional<Expected>& expected,
                       FusedVariant v, const optimized::ExecutionContext& ctx, Result& r, const Wait& wait,
                       const Measure& measure) {
  const Layout& L = g.layout;
  const int nsets = static_cast<int>(data.sets.size());
  auto run = [&](int it) { call_op(L, data.sets[static_cast<size_t>(it % nsets)], v, ctx, cfg); };
  poison_outputs(L, data.sets[0]);
  wait();
  const auto t0 = std::chrono::steady_clock::now();
  run(0);
  wait();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!expected) expected = compute_expected(L, data.host, cfg);
  const CheckOutcome check = check_outputs(L, data.sets[0], *expected);
  r.validation = check.validation;
  if (!check.validation.passed) {
    r.status = "failed";
    r.reason = failure_reason(check);
    return;
  }
  r.time = measure(run, after_validation(cfg.measure, seconds));
}

#if OPTIMIZED_WITH_CUDA

// A device copy of `bytes` (half read, half written), rotating through enough buffer pairs to
// cover 2x the L2, timed like the rows.
Stats measure_same_size_copy(double min_bytes, const MeasureOptions& opt, cudaStream_t st, int64_t l2) {
  const int64_t half = std::max<int64_t>(static_cast<int64_t>(min_bytes / 2) & ~int64_t{15}, 16);
  size_t free_b = 0, total_b = 0;
  check_cuda(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  const int npairs = rotating_set_count(2 * half, l2, static_cast<int64_t>(free_b / 2));
  std::vector<Buffer> src, dst;
  for (int i = 0; i < npairs; ++i) {
    src.emplace_back(DType::kF32, (half + 3) / 4, Device::cuda());
    dst.emplace_back(DType::kF32, (half + 3) / 4, Device::cuda());
    src.back().fill_bytes(0x3C);
    dst.back().fill_bytes(0);
  }
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  return measure_gpu(
      [&](int i) {
        const size_t k = static_cast<size_t>(i % npairs);
        check_cuda(cudaMemcpyAsync(dst[k].data(), src[k].data(), static_cast<size_t>(half), cudaMemcpyDeviceToDevice, st),
                   "cudaMemcpyAsync (same-size copy)");
      },
      st, opt);
}

void run_cuda_group(const FusedBenchConfig& cfg, const Group& g, const std::vector<Ceiling>& ceilings,
                    Progress& progress, std::vector<Result>& results, std::vector<std::string>& notes) {
  const Layout& L = g.layout;
  std::vector<Result> rows;
  for (const PlannedRow& pr : g.rows) {
    Result r = base_row(g, pr.variant);
    if (!pr.skip.empty()) r.status = "skipped", r.reason = pr.skip;
    rows.push_back(r);
  }
  auto finish = [&] {
    for (auto& r : rows) results.push_back(std::move(r));
  };
  if (g.runnable() == 0) return finish();
  std::optional<Rate> bandwidth;
  if (const Ceiling* c = best_ceiling(ceilings, "device_copy")) bandwidth = Rate{c->name, c->value, c->unit};
  for (auto& r : rows) r.roofline_bandwidth = bandwidth;

  std::unique_ptr<GroupData> data;
  std::unique_ptr<CudaStream> stream;
  int l2 = 0;
  try {
    size_t free_b = 0, total_b = 0;
    check_cuda(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
    check_cuda(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0), "cudaDeviceGetAttribute");
    const int nsets = rotating_set_count(L.set_bytes(), l2, static_cast<int64_t>(free_b / 2));
    data = std::make_unique<GroupData>(make_group_data(L, Device::cuda(), nsets, cfg.eps));
    stream = std::make_unique<CudaStream>();
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize after allocating operands");
  } catch (const std::exception& e) {
    for (auto& r : rows) {
      if (r.status != "ok") continue;
      progress.step("fused " + group_label(g) + " " + r.variant);
      r.status = "failed";
      r.reason = std::string("setting up operands: ") + e.what();
    }
    if (g.baseline_only) progress.step("fused " + group_label(g) + " unfused (baseline)");
    if (g.copy) progress.step("fused " + group_label(g) + " same-size copy");
    return finish();
  }
  cudaStream_t st = stream->get();
  optimized::ExecutionContext ctx;
  ctx.cuda_stream = st;
  auto wait = [&] {
    check_cuda(cudaStreamSynchronize(st), "cudaStreamSynchronize");
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  };
  auto measure = [&](const std::function<void(int)>& run, const MeasureOptions& o) { return measure_gpu(run, st, o); };
  std::optional<Expected> expected;

  // The baseline first: the unfused row, or unfused timed on its own.
  std::optional<BaselineResult> baseline;
  auto take_baseline = [&](const Result& r) {
    if (r.status == "ok" && r.timed()) baseline = BaselineResult{"unfused", r.time, 0.0, r.validation};
    else notes.push_back("unfused baseline at " + group_label(g) + ": " + r.status + " (" + r.reason + ")");
  };
  std::vector<size_t> order;
  for (size_t i = 0; i < rows.size(); ++i)
    if (g.rows[i].variant == FusedVariant::kCudaUnfused) order.insert(order.begin(), i);
    else order.push_back(i);
  if (g.baseline_only) {
    progress.step("fused " + group_label(g) + " unfused (baseline)");
    Result b = base_row(g, FusedVariant::kCudaUnfused);
    try {
      validate_and_time(cfg, g, *data, expected, FusedVariant::kCudaUnfused, ctx, b, wait, measure);
    } catch (const std::exception& e) {
      record_exception(b, e);
    }
    take_baseline(b);
  }
  for (size_t i : order) {
    Result& r = rows[i];
    if (r.status != "ok") continue;
    const FusedVariant v = g.rows[i].variant;
    progress.step("fused " + group_label(g) + " " + r.variant);
    try {
      if (v == FusedVariant::kAuto) {
        const bool aligned = (L.shape.stride() * static_cast<int64_t>(optimized::dtype_size(L.dtype))) % 16 == 0;
        r.resolved_variant = variant_name(optimized::resolve_fused_variant(L.op, L.dtype, Device::cuda(), L.shape.width,
                                                                           L.backward(), aligned));
      }
      validate_and_time(cfg, g, *data, expected, v, ctx, r, wait, measure);
    } catch (const std::exception& e) {
      record_exception(r, e);
    }
    if (v == FusedVariant::kCudaUnfused) take_baseline(r);
  }
  data.reset();  // the copy below gets the memory

  std::optional<Stats> copy;
  if (g.copy) {
    progress.step("fused " + group_label(g) + " same-size copy");
    try {
      copy = measure_same_size_copy(rows.front().min_bytes, cfg.measure, st, l2);
    } catch (const std::exception& e) {
      notes.push_back("same-size copy at " + group_label(g) + " failed: " + e.what());
    }
  }
  for (auto& r : rows) {
    if (r.status != "ok") continue;
    r.baseline = baseline;
    r.copy_same_size = copy;
  }
  finish();
}

#endif  // OPTIMIZED_WITH_CUDA

void run_cpu_group(const FusedBenchConfig& cfg, const Group& g, const std::vector<Ceiling>& ceilings,
                   Progress& progress, std::vector<Result>& results) {
  const Layout& L = g.layout;
  std::vector<Result> rows;
  for (const PlannedRow& pr : g.rows) {
    Result r = base_row(g, pr.variant);
    if (!pr.skip.empty()) r.status = "skipped", r.reason = pr.skip;
    rows.push_back(r);
  }
  auto finish = [&] {
    for (auto& r : rows) results.push_back(std::move(r));
  };
  if (g.runnable() == 0) return finish();
  std::optional<Rate> bandwidth;
  if (const Ceiling* c = best_ceiling(ceilings, "host_copy")) bandwidth = Rate{c->name, c->value, c->unit};

  std::unique_ptr<GroupData> data;
  try {
    const int nsets = rotating_set_count(L.set_bytes(), host_llc_bytes(), int64_t{1} << 30);
    data = std::make_unique<GroupData>(make_group_data(L, Device::cpu(), nsets, cfg.eps));
  } catch (const std::exception& e) {
    for (auto& r : rows) {
      if (r.status != "ok") continue;
      progress.step("fused " + group_label(g) + " " + r.variant);
      r.status = "failed";
      r.reason = std::string("setting up operands: ") + e.what();
    }
    return finish();
  }
  optimized::ExecutionContext ctx;
  ctx.cpu_threads = g.threads;
  auto wait = [] {};
  auto measure = [&](const std::function<void(int)>& run, const MeasureOptions& o) { return measure_cpu(run, o); };
  std::optional<Expected> expected;
  for (size_t i = 0; i < rows.size(); ++i) {
    Result& r = rows[i];
    if (r.status != "ok") continue;
    const FusedVariant v = g.rows[i].variant;
    progress.step("fused " + group_label(g) + " " + r.variant);
    try {
      if (v == FusedVariant::kAuto)
        r.resolved_variant = variant_name(
            optimized::resolve_fused_variant(L.op, L.dtype, Device::cpu(), L.shape.width, L.backward()));
      validate_and_time(cfg, g, *data, expected, v, ctx, r, wait, measure);
    } catch (const std::exception& e) {
      record_exception(r, e);
    }
    r.roofline_bandwidth = bandwidth;
  }
  finish();
}

}  // namespace

int count_fused_tasks(const FusedBenchConfig& config, bool gpu_available) {
  int n = 0;
  for (const Group& g : plan_groups(config, gpu_available)) n += g.tasks();
  return n;
}

void run_fused_bench(const FusedBenchConfig& config, const std::vector<Ceiling>& ceilings, Progress& progress,
                     std::vector<Result>& results, std::vector<std::string>& notes) {
  const bool gpu = optimized::cuda_device_count() > 0;
  for (const Group& g : plan_groups(config, gpu)) {
    if (g.cuda) {
#if OPTIMIZED_WITH_CUDA
      if (gpu) {
        run_cuda_group(config, g, ceilings, progress, results, notes);
        continue;
      }
#endif
      for (const PlannedRow& pr : g.rows) {  // all skipped: no GPU
        Result r = base_row(g, pr.variant);
        r.status = "skipped";
        r.reason = pr.skip.empty() ? "no CUDA GPU found (" + optimized::cuda_unavailable_reason() + ")" : pr.skip;
        results.push_back(r);
      }
    } else {
      run_cpu_group(config, g, ceilings, progress, results);
    }
  }
}

}  // namespace bench
