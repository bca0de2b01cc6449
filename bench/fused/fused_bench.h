// The fused plug-in of optimized-bench (`optimized-bench fused`, and the fused rows of `all`):
// softmax, log_softmax, layer_norm, rms_norm, add + norm, bias + GELU, SiLU-and-mul; forward and
// backward. For each (op, direction, dtype, shape) group: rotating operand sets, every variant run
// once through the public API on poisoned outputs and checked with the fused rule against the
// float64 and same-dtype references (optimized_ops_testing), then timed by the driver
// (harness/driver.h); next to the rows, in the same run: the unfused variant (the baseline of the
// CUDA rows) and a device copy that moves the same bytes (what launch and ramp-up cost at small
// sizes). GB/s are counted from the MINIMUM bytes the op must move (fused_min_bytes), and the
// roofline column is the fraction of the measured device copy bandwidth.
//
// Shapes are ROWSxWIDTH (optionally :LD, a row stride > WIDTH, e.g. 4096x8000:8192). For
// silu_and_mul WIDTH is d, the output width: x and dx hold 2*d per row.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "harness/driver.h"
#include "harness/harness.h"
#include "optimized/core.h"
#include "optimized/fused.h"

namespace bench {

struct FusedShape {
  int64_t rows = 0;
  int64_t width = 0;
  int64_t ld = 0;  // row stride in elements (>= width); 0: width
  int64_t stride() const { return ld > 0 ? ld : width; }
  std::string label() const;  // "4096x8192", "4096x8000:8192"
};

// "ROWSxWIDTH" or "ROWSxWIDTH:LD"; throws std::invalid_argument naming the text.
FusedShape parse_fused_shape(const std::string& text);

enum class FusedDirection : uint8_t { kForward, kBackward };
std::string_view fused_direction_name(FusedDirection d);  // "fwd" | "bwd"
FusedDirection parse_fused_direction(std::string_view name);  // throws std::invalid_argument

// The byte model: the fewest bytes the op must move through device memory, each input read once
// and each output written once. R rows, W width (d for silu_and_mul), E bytes per element of the
// dtype; statistics (mean, rstd) are fp32, 4 bytes per row.
//   forward writes the statistics the backward needs (a training forward); backward takes every
//   parameter gradient (dweight, dbias) and, for the add forms, the gradient arriving at
//   residual_out (dresidual_out).
double fused_min_bytes(optimized::FusedOp op, FusedDirection d, optimized::DType dtype, int64_t rows,
                       int64_t width);
// The formula behind fused_min_bytes, e.g. "2*R*W*E + W*E + 4*R (read x, weight; write y, rstd)".
std::string fused_bytes_formula(optimized::FusedOp op, FusedDirection d);

struct FusedBenchConfig {
  std::vector<optimized::FusedOp> ops;
  std::vector<FusedDirection> directions;
  std::vector<optimized::DType> dtypes;
  std::vector<FusedShape> shapes;
  // kAuto allowed (CUDA when there is a GPU); kCpu rows run on the host with `threads`.
  std::vector<optimized::FusedVariant> variants;
  int threads = 0;               // CPU rows: 0 = all hardware threads
  bool baseline = true;          // time the unfused variant next to the CUDA rows (when not a row itself)
  bool copy_same_size = true;    // time a device copy of each row's min_bytes
  optimized::GeluApproximation gelu = optimized::GeluApproximation::kNone;
  float softmax_scale = 1.0f;
  float eps = 1e-5f;
  int64_t cpu_max_elements = int64_t{1} << 24;  // CPU rows above rows*width are skipped (too slow)
  // Validation: every row is checked when rows*width <= full_check_elements; above, `check_rows`
  // rows (the first, the last and evenly spaced ones). Ops with parameter gradients (dweight,
  // dbias) always run the reference over every row, as those sum over all of them.
  int64_t full_check_elements = int64_t{1} << 24;
  int check_rows = 64;
  MeasureOptions measure;
};

// The standard configs: bf16 on the target grid (rows 4096, 16384 x width 1024 ... 32768) and
// the edge shapes (4097x4099, 1x262144, 65536x128, 8x131072, 4096x8000:8192); fp32 and fp16 on a
// few shapes; the cpu variant at two small shapes (fp32, bf16). `quick`: a few shapes per dtype.
// `gpu` false: the CPU config alone.
std::vector<FusedBenchConfig> default_fused_configs(bool quick, bool gpu);

// The `fused` subcommand's filters (names as given, commas allowed inside items).
struct FusedFilters {
  std::vector<std::string> ops{"all"}, directions{"fwd", "bwd"}, dtypes, shapes, variants{"all"};
};
// The standard configs narrowed by the filters: ops and directions as given; --shapes replaces the
// GPU configs by one (those shapes at the given dtypes, bf16 by default) and gives the CPU config
// the small ones; --dtypes alone keeps each GPU config's dtypes among those given and sets the CPU
// config's; variants "all" | "cuda" | "cpu" | names. Without a GPU the CUDA configs are left out
// unless CUDA variants are named (their rows are then listed as skipped). Throws
// std::invalid_argument / optimized::Error naming a bad name.
std::vector<FusedBenchConfig> fused_configs(const FusedFilters& filters, bool quick, bool gpu);

// Notes every fused report carries: what GB/s, roofline and the same-size copy mean, and the byte
// formula of each (op, direction) of the configs.
std::vector<std::string> fused_notes(const std::vector<FusedBenchConfig>& configs);

// The config's groups, planned for a machine with or without a GPU.
Groups fused_groups(const FusedBenchConfig& config, bool gpu_available);

}  // namespace bench
